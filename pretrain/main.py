"""Pretrain a tapered language model with DeepSpeed (the project's main job).

    deepspeed pretrain/main.py --ds_config ds_configs/default.json                 # quickstart
    deepspeed --num_gpus 8 pretrain/main.py --ds_config ds_configs/zero1.json \\
        --config transformer_440m --parallel.tp 2 --train.iters 1000
    deepspeed --hostfile hostfile pretrain/main.py --ds_config ds_configs/pipeline.json ...
    mpirun -np 16 -hostfile hosts python pretrain/main.py --ds_config ds_configs/zero1.json ...

With no ``--config`` the quickstart preset trains on the sample corpus shipped in the repo
(tokenizer and dataset prepared on first use in ``data.cache_dir``). Any config key can be
overridden with ``--section.key VALUE``; ``--resume auto`` (= ``--train.resume auto``) continues
from the newest complete checkpoint in ``train.save_dir``. Config and DeepSpeed config are
validated before any process group starts.
"""

import time

T0 = time.time()
PREEMPTED = 75  # EX_TEMPFAIL: stopped on train.exit_signal after saving; resume to continue

import sys  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 for a rejected configuration)."""
    from tapered_megatron.config import ConfigError
    from tapered_megatron.training import launch

    try:
        _args, cfg, ds, layout = launch.setup(argv)
    except ConfigError as e:
        if launch.env_rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2

    import torch.distributed as dist

    from tapered_megatron.training.trainer import TrainingPreempted, TrainingStopped, run

    beat = launch.init_distributed(cfg.train.collective_timeout_s)
    try:
        run(cfg, ds, layout, T0)
    except TrainingStopped as e:
        if launch.env_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except TrainingPreempted as e:  # the job script requeues on this code
        if launch.env_rank() == 0:
            print(str(e), flush=True)
        return PREEMPTED
    except Exception as e:  # a failed or timed-out collective: name the rank that went quiet
        if beat is None or not beat.explain(e):
            raise
        return 1
    finally:
        if beat is not None:
            beat.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
