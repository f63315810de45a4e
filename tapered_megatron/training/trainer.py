"""The training job behind ``pretrain/main.py``: model, data, DeepSpeed engine, loop.

One global batch per iteration: ``train.global_batch_size`` samples, split into micro-batches of
``train.micro_batch_size`` per data-parallel rank and ``grad_accum`` accumulation steps. Sample
``k`` of the run is the same token sequence in every parallel layout (the sampler hands DP rank
``r`` slice ``r`` of each ``micro x dp`` chunk), and initialisation is layout-invariant, so DP /
ZeRO / TP / PP runs of one seed follow the same loss curve up to float reduction order.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.utils import is_model_parallel_parameter

from tapered_megatron import parallel
from tapered_megatron.config import Config
from tapered_megatron.eval import validation_loss
from tapered_megatron.models import build_model, count_model, lm_loss
from tapered_megatron.training import checkpoint, optim
from tapered_megatron.training.launch import Layout
from tapered_megatron.training.logger import TrainLogger


class Trainer:
    """Builds everything for one run; :meth:`fit` trains. All ranks construct it together."""

    def __init__(self, cfg: Config, ds_config: dict[str, Any], layout: Layout, t0: float) -> None:
        self.cfg, self.ds_config, self.layout, self.t0 = cfg, ds_config, layout, t0
        self.rank = dist.get_rank()
        self.device = get_accelerator().current_device_name()
        parallel.init_model_parallel(layout.tp, layout.pp)
        parallel.model_parallel_seed(cfg.train.seed)
        self.dp_rank = parallel.get_data_parallel_rank()
        self.dp_group = parallel.get_data_parallel_group()
        self.pipeline = layout.pp > 1
        self._stage_ms = 0.0

        self.train_ds, self.valid_ds = self._build_data()
        self.engine = self._build_engine()
        self.iteration, self.consumed = 0, 0
        where = checkpoint.find_resume(cfg)
        if where is not None:
            client = checkpoint.load(self.engine, *where)
            self.iteration = int(client["iteration"])
            self.consumed = int(client["consumed_samples"])
            self.log(f"resumed from {where[0] / where[1]} at iteration {self.iteration}")
        elif cfg.train.resume:
            self.log(f"train.resume={cfg.train.resume}: no checkpoint yet, starting fresh")
        tb = cfg.logging.tensorboard_dir or str(Path(cfg.train.save_dir) / "tensorboard")
        self.logger = TrainLogger(
            cfg, self.rank, count_model(cfg).train_flops_per_token, layout.world_size, tb
        )

    # ----------------------------------------------------------------- set-up
    def log(self, msg: str) -> None:
        """Print on rank 0."""
        if self.rank == 0:
            print(msg, flush=True)

    def _build_data(self) -> tuple[Any, Any]:
        from tapered_megatron import data

        cfg, lay = self.cfg, self.layout
        d = cfg.data
        if d.path:
            prefix, tok_path = d.path, d.tokenizer_model
        else:
            tok_path, prefix = data.prepare_sample_corpus(d.cache_dir, cfg.model.vocab_size)
        if tok_path:
            vocab = data.load_tokenizer(tok_path).vocab_size
            if vocab > cfg.model.vocab_size:
                raise ValueError(
                    f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's "
                    f"vocabulary ({vocab}); set --model.vocab_size {vocab}"
                )
        n_eval = cfg.eval.iters * lay.global_batch_size if cfg.eval.interval > 0 else 0
        train, valid, _ = data.build_gpt_datasets(
            prefix,
            d.split,
            cfg.model.seq_len,
            d.seed,
            (cfg.train.iters * lay.global_batch_size, n_eval, 0),
            d.cache_dir,
            vocab_size=cfg.model.vocab_size,
            log=self.log,
        )
        if n_eval and valid is None:
            self.log(f"data.split={d.split!r} leaves no validation documents: evaluation is off")
        return train, valid

    def _batches(self, dataset: Any, total: int, consumed: int) -> Iterator[tuple]:
        """Endless ``(inputs, labels)`` micro-batches of this DP rank, starting at ``consumed``."""
        from tapered_megatron.data import PretrainingSampler

        sampler = PretrainingSampler(
            total, consumed, self.layout.micro_batch_size, self.dp_rank, self.layout.dp
        )
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=self.cfg.data.num_workers,
            collate_fn=_collate,
        )
        for tokens in loader:
            tokens = tokens.to(self.device)
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def _build_engine(self) -> Any:
        cfg, ds = self.cfg, self.ds_config
        if self.pipeline:
            model = self._pipeline_module()
        else:
            model = build_model(cfg)
        model.to(self.device)
        groups = optim.param_groups(model, cfg.train.weight_decay)
        kwargs: dict[str, Any] = {"model": model, "config": ds}
        if "optimizer" in ds:
            kwargs["model_parameters"] = groups
        else:
            kwargs["optimizer"] = optim.build_optimizer(model, cfg.train)
        if "scheduler" not in ds:
            kwargs["lr_scheduler"] = lambda opt: optim.build_scheduler(opt, cfg.train)
        if not self.pipeline and self.layout.tp > 1:
            kwargs["mpu"] = parallel.topology  # DeepSpeed's mpu protocol (TP-aware ZeRO, norms)
        engine, *_ = deepspeed.initialize(**kwargs)
        if cfg.train.compile:
            engine.compile()
        if self.pipeline:
            self._time_pipeline_compute(engine)
        # Only fp32 ZeRO-0 leaves the gradient norm uncomputed (DeepSpeed clips without storing it).
        self._fp32_stage0 = engine.zero_optimization_stage() == 0 and not (
            engine.fp16_enabled() or engine.bfloat16_enabled()
        )
        return engine

    def _pipeline_module(self) -> Any:
        """Stages from our balancer (``parallel.partition``), never DeepSpeed's defaults."""
        from tapered_megatron.pipeline.module import BalancedPipelineModule

        lay = self.layout
        stage = self.ds_config.get("zero_optimization", {}).get("stage", 0)
        return BalancedPipelineModule.from_config(
            self.cfg,
            topology=parallel.get_topology(),
            micro_batches=lay.grad_accum,
            loss_fn=lm_loss,
            partition_kwargs={"dp": lay.dp, "zero_stage": stage},
        )

    def _time_pipeline_compute(self, engine: Any) -> None:
        """Accumulate this stage's forward + backward compute time (per-stage logs)."""
        from deepspeed.runtime.pipe import schedule

        acc = get_accelerator()
        table = dict(type(engine)._INSTRUCTION_MAP)

        def timed(fn: Any) -> Any:
            def run(eng: Any, *a: Any, **kw: Any) -> Any:
                acc.synchronize()
                t = time.perf_counter()
                out = fn(eng, *a, **kw)
                acc.synchronize()
                self._stage_ms += 1000 * (time.perf_counter() - t)
                return out

            return run

        for instr in (schedule.ForwardPass, schedule.BackwardPass):
            table[instr] = timed(table[instr])
        engine._INSTRUCTION_MAP = table

    # ------------------------------------------------------------------ loop
    def _grad_norm(self) -> float | None:
        """Global gradient norm of the step just taken (DeepSpeed's, or computed for ZeRO-0)."""
        gn = self.engine.get_global_grad_norm()
        if gn is not None:
            return float(gn)
        return None

    def _stage0_grad_norm(self) -> float:
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        tp_rank = parallel.get_tensor_model_parallel_rank()
        for p in self.engine.module.parameters():
            if p.grad is not None and (tp_rank == 0 or is_model_parallel_parameter(p)):
                sq += p.grad.detach().double().pow(2).sum()
        if parallel.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(sq, group=parallel.get_tensor_model_parallel_group())
        return math.sqrt(sq.item())

    def _train_step(self, batches: Iterator[tuple], want_norm: bool) -> tuple[float, float | None]:
        eng = self.engine
        if self.pipeline:
            loss = float(eng.train_batch(batches))
            return loss, self._grad_norm()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        norm = None
        for k in range(self.layout.grad_accum):
            x, y = next(batches)
            loss = eng(x, y)  # the model's loss: LM head fused into the cross-entropy
            eng.backward(loss)
            last = k == self.layout.grad_accum - 1
            if last and want_norm and self._fp32_stage0:
                norm = self._stage0_grad_norm()
            eng.step()
            total += loss.detach().double()
        total /= self.layout.grad_accum
        if self.layout.dp > 1:
            dist.all_reduce(total, group=self.dp_group)
            total /= self.layout.dp
        return total.item(), norm if norm is not None else self._grad_norm()

    def _validate(self) -> float:
        lay = self.layout
        n = self.cfg.eval.iters * lay.global_batch_size
        batches = self._batches(self.valid_ds, n, 0)
        return validation_loss(
            self.engine, batches, self.cfg.eval.iters, lay.grad_accum, self.dp_group
        )

    def fit(self) -> list[float]:
        """Train to ``train.iters``; return the per-iteration training losses of this run."""
        cfg, lay = self.cfg, self.layout
        tr = cfg.train
        self.logger.widths_figure()
        self.log(
            f"layout: world {lay.world_size} = dp {lay.dp} x tp {lay.tp} x pp {lay.pp} | "
            f"global batch {lay.global_batch_size} = micro {lay.micro_batch_size} x dp {lay.dp} "
            f"x accumulation {lay.grad_accum} | zero stage {self.engine.zero_optimization_stage()}"
        )
        self.log(cfg.taper_plan.table())
        batches = self._batches(self.train_ds, tr.iters * lay.global_batch_size, self.consumed)
        tokens_per_iter = lay.global_batch_size * cfg.model.seq_len
        metrics = _MetricsFile(cfg.logging.metrics_file if self.rank == 0 else "")
        losses: list[float] = []
        acc_loss, acc_iters, acc_time, self._stage_ms = 0.0, 0, 0.0, 0.0
        while self.iteration < tr.iters:
            it = self.iteration + 1
            log_now = it % cfg.logging.interval == 0 or it == tr.iters
            lr = self.engine.get_lr()[0]
            t = time.perf_counter()
            loss, gnorm = self._train_step(batches, log_now or bool(cfg.logging.metrics_file))
            step_s = time.perf_counter() - t
            acc_time += step_s
            if not losses:
                self.log(f"first step done {time.time() - self.t0:.1f} s after process start")
            self.iteration, self.consumed = it, self.consumed + lay.global_batch_size
            losses.append(loss)
            acc_loss, acc_iters = acc_loss + loss, acc_iters + 1
            record = {"iteration": it, "loss": loss, "lr": lr, "grad_norm": gnorm}
            record.update(step_s=step_s, wall=time.time())
            if log_now:
                self.logger.train(
                    it,
                    acc_loss / acc_iters,
                    lr,
                    gnorm,
                    tokens_per_iter * acc_iters,
                    acc_time,
                    self._gather_stage_ms(acc_iters) if self.pipeline else None,
                )
                acc_loss, acc_iters, acc_time, self._stage_ms = 0.0, 0, 0.0, 0.0
            if self.valid_ds is not None and (it % cfg.eval.interval == 0 or it == tr.iters):
                record["val_loss"] = self._validate()
                self.logger.val(it, record["val_loss"])
            metrics.write(record)
            stop = tr.exit_interval > 0 and it % tr.exit_interval == 0
            if (tr.save_interval > 0 and it % tr.save_interval == 0) or it == tr.iters or stop:
                self.log(f"saved checkpoint {checkpoint.save(self.engine, cfg, it, self.consumed)}")
            if stop and it < tr.iters:
                self.log(f"train.exit_interval={tr.exit_interval}: stopping at iteration {it}")
                break
        self.logger.close()
        metrics.close()
        return losses

    def _gather_stage_ms(self, iters: int) -> list[float]:
        """Per-stage compute ms per iteration (max over the ranks of each stage)."""
        world = self.layout.world_size
        mine = torch.tensor(
            [float(parallel.get_pipeline_model_parallel_rank()), self._stage_ms / max(iters, 1)],
            dtype=torch.float64,
        )
        out = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
        if get_accelerator().device_name() != "cpu":
            mine = mine.to(self.device)
            out = [o.to(self.device) for o in out]
        dist.all_gather(out, mine)
        per = [0.0] * self.layout.pp
        for t in out:
            s, ms = int(t[0].item()), t[1].item()
            per[s] = max(per[s], ms)
        return per


class _MetricsFile:
    """Append-only JSON lines, one per iteration (rank 0; disabled when ``path`` is empty)."""

    def __init__(self, path: str) -> None:
        self.f = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.f = open(path, "a")  # noqa: SIM115 - kept open for the whole run

    def write(self, record: dict[str, Any]) -> None:
        if self.f is not None:
            self.f.write(json.dumps(record) + "\n")
            self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def _collate(samples: list[Any]) -> torch.Tensor:
    return torch.stack([torch.as_tensor(s, dtype=torch.int64) for s in samples])


def run(cfg: Config, ds_config: dict[str, Any], layout: Layout, t0: float) -> list[float]:
    """Train one run in an initialised process group (used by ``pretrain/main.py``)."""
    os.makedirs(cfg.train.save_dir, exist_ok=True)
    return Trainer(cfg, ds_config, layout, t0).fit()
