"""The training job behind ``pretrain/main.py``: model, data, DeepSpeed engine, loop.

One global batch per iteration: ``train.global_batch_size`` samples, split into micro-batches of
``train.micro_batch_size`` per data-parallel rank and ``grad_accum`` accumulation steps. Sample
``k`` of the run is the same token sequence in every parallel layout (the sampler hands DP rank
``r`` slice ``r`` of each ``micro x dp`` chunk), and initialisation is layout-invariant, so DP /
ZeRO / TP / PP runs of one seed follow the same loss curve up to float reduction order.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from torch import nn

from tapered_megatron import parallel
from tapered_megatron.checkpoint import layout as layout_files
from tapered_megatron.checkpoint import resume, save, save_dir, universal
from tapered_megatron.checkpoint.layout import ParallelLayout, saved_layout
from tapered_megatron.config import Config, ConfigError
from tapered_megatron.models import (
    allow_layer_recompiles,
    build_model,
    count_model,
    lm_loss,
    take_diagnostics,
)
from tapered_megatron.parallel.norms import clip_in_step, computes_grad_norm, grad_norm, own_clip
from tapered_megatron.planning.clock import StageClock
from tapered_megatron.training import optim
from tapered_megatron.training.alignment import AlignmentProbe
from tapered_megatron.training.faults import injected_nan_iterations, nan_first_loss
from tapered_megatron.training.launch import precision_note
from tapered_megatron.training.logger import TrainLogger
from tapered_megatron.training.monitor import Cadence, ExitSignal, Health, MetricsFile, Window
from tapered_megatron.training.validation import validation_loss


class Trainer:
    """Builds everything for one run; :meth:`fit` trains. All ranks construct it together."""

    def __init__(
        self, cfg: Config, ds_config: dict[str, Any], layout: ParallelLayout, t0: float
    ) -> None:
        self.cfg, self.ds_config, self.layout, self.t0 = cfg, ds_config, layout, t0
        self.rank = dist.get_rank()
        self.device = get_accelerator().current_device_name()
        parallel.init_model_parallel(layout.tp, layout.pp)
        parallel.model_parallel_seed(cfg.train.seed)
        self.dp_rank = parallel.get_data_parallel_rank()
        self.dp_group = parallel.get_data_parallel_group()
        self.pipeline = layout.pp > 1
        # parallel.schedule other than 1f1b: torch.distributed.pipelining over this rank's chunks
        self.virtual: Any = None
        one_f_one_b = self.pipeline and cfg.parallel.schedule == "1f1b"
        # per-stage compute time (a virtual schedule's: per pipeline rank, all its chunks)
        self.clock = StageClock() if self.pipeline else None

        self.train_ds, self.valid_ds = self._build_data()
        self.extra_ds = self._build_extra_data()
        if self.pipeline and not one_f_one_b:
            self.engine = self._virtual_engine()
        else:
            self.engine = build_engine(cfg, ds_config, layout, self.clock)
        self.nan_iters = injected_nan_iterations()
        self.exit_signal = ExitSignal(cfg.train.exit_signal, self.device)
        self.iteration, self.consumed = 0, 0
        where = self._verified_resume()
        self.lineage = save.Lineage(resumed=where[1] if where else None)
        if where is not None:
            for tag in layout_files.partial_tags(where[0], layout_files.iteration_of(where[1])):
                self.log(
                    f"{where[0] / tag} is partial (no complete marker: a save cut short); ignored"
                )
            client = self.load(*where)
            self.iteration = int(client["iteration"])
            self.consumed = int(client["consumed_samples"])
            self.log(f"resumed from {where[0] / where[1]} at iteration {self.iteration}")
        elif cfg.train.resume:
            self.log(f"train.resume={cfg.train.resume}: no checkpoint yet, starting fresh")
        tb = cfg.logging.tensorboard_dir or str(Path(cfg.train.save_dir) / "tensorboard")
        self.logger = TrainLogger(
            cfg,
            self.rank,
            count_model(cfg).train_flops_per_token,
            layout.world_size,
            tb,
            asdict(layout),
        )

    # ----------------------------------------------------------------- set-up
    def _verified_resume(self) -> tuple[Path, str] | None:
        """:func:`resume.find_resume`, each candidate also checked against its manifest's
        sha256 (the ranks share the hashing); a checkpoint whose files changed after saving is
        passed over like any unusable one, with the one-line note."""
        known: dict[str, str] = {}
        try:
            while True:
                notes: list[str] = []  # only the final choice's notes are printed
                where = resume.find_resume(self.cfg, note=notes.append, known=known)
                why = resume.hash_problem(where[0] / where[1]) if where else None
                if why is None:
                    break
                known[where[1]] = why
        except ConfigError as e:
            raise TrainingStopped(str(e)) from None
        for line in notes:
            self.log(line)
        return where

    def _stopped(self, why: str) -> TrainingStopped:
        """:class:`TrainingStopped` with ``why``, which a rank other than 0 also prints (``main``
        prints rank 0's; the others stop when their next collective fails)."""
        if self.rank != 0:
            print(f"error: rank {self.rank}: {why}", file=sys.stderr, flush=True)
        return TrainingStopped(why)

    def log(self, msg: str) -> None:
        """Print on rank 0."""
        if self.rank == 0:
            print(msg, flush=True)

    def _build_data(self) -> tuple[Any, Any]:
        from tapered_megatron import data

        cfg, lay = self.cfg, self.layout
        d = cfg.data
        if d.path:
            prefix = d.path  # its files and tokenizer were checked by training/preflight.py
        else:
            _, prefix = data.prepare_sample_corpus(d.cache_dir, cfg.model.vocab_size)
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
            self.log(f"data.split={d.split!r} leaves no validation documents: no validation loss")
        return train, valid

    def _build_extra_data(self) -> dict[str, Any]:
        """``eval.extra_paths``: file name -> a dataset over all the prefix's documents (the
        first ``eval.iters`` global batches are read at each evaluation)."""
        from tapered_megatron import data

        cfg = self.cfg
        if cfg.eval.interval <= 0:
            return {}
        n = cfg.eval.iters * self.layout.global_batch_size
        out = {}
        for prefix in cfg.eval.extra_paths:
            _, valid, _ = data.build_gpt_datasets(
                prefix,
                "0,1,0",
                cfg.model.seq_len,
                cfg.data.seed,
                (0, n, 0),
                cfg.data.cache_dir,
                vocab_size=cfg.model.vocab_size,
                log=self.log,
            )
            out[Path(prefix).name] = valid
        return out

    def batches(self, dataset: Any, total: int, consumed: int) -> Iterator[tuple]:
        """Endless ``(inputs, labels)`` micro-batches of this DP rank, starting at ``consumed``."""
        from tapered_megatron import data
        from tapered_megatron.data import PretrainingSampler

        sampler = PretrainingSampler(
            total, consumed, self.layout.micro_batch_size, self.dp_rank, self.layout.dp
        )
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=self.cfg.data.num_workers,
            collate_fn=_collate,
            # its own generator: a new iterator (each resume, each evaluation) draws a worker
            # seed, which must not advance the model's stream (dropout) that checkpoints restore
            generator=torch.Generator().manual_seed(self.cfg.data.seed),
        )
        try:
            for tokens in loader:
                tokens = tokens.to(self.device)
                yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        except data.IndexedDatasetError as e:  # an id beyond the vocabulary, caught at the batch
            raise self._stopped(f"{data.error_line(e)}; stopped without saving") from None

    def _virtual_engine(self) -> Any:
        """``parallel.schedule`` interleaved / zbv / dualpipev / zero_bubble: this rank's chunks
        (the virtual-stage balancer's cut) under torch's schedule; DeepSpeed's engine over
        them (what it does not support was refused at launch: ``schedules.run_problem``)."""
        from tapered_megatron.parallel.schedules import VirtualPipeline

        cfg, ds = self.cfg, self.ds_config
        self.virtual = VirtualPipeline(
            cfg,
            ds,
            self.layout.grad_accum,
            lambda model: optimizer_kwargs(cfg, ds, model),
            clock=self.clock,
        )
        optim.undo_priming_step(self.virtual.engine)
        optim.skip_nonfinite_steps(self.virtual.engine)
        return self.virtual.engine

    def load(self, load_dir: Path, tag: str) -> dict[str, Any]:
        """DeepSpeed's own files when the layout is the one saved, else the layout-free copy
        (always under a virtual-stage schedule: DeepSpeed's engine over a rank's chunks names
        its ZeRO files by the tensor-parallel rank, so one stage's optimizer state is missing
        there)."""
        now = self.layout
        saved = saved_layout(load_dir / tag)
        same = saved is not None and saved.to_record() == now.to_record()
        if self.virtual is None and (saved is None or same):
            return resume.load(self.engine, load_dir, tag)
        if same:
            self.log(f"resuming {load_dir / tag} from its universal/ copy")
            return universal.load(self.engine, self.cfg, load_dir / tag)
        self.log(
            f"layout change: checkpoint {load_dir / tag} was saved under {saved.describe()}, "
            f"resuming under {now.describe()} (resharded from its universal/ copy)"
        )
        return universal.load(self.engine, self.cfg, load_dir / tag)

    def save(self, it: int) -> Path:
        """A checkpoint of iteration ``it``, with its layout and (if on) the universal copy."""

        def with_universal(
            tag_dir: Path, client: dict[str, Any], torch_save: Callable[[Any, Path], None]
        ) -> None:
            universal.save(self.engine, self.cfg, self.layout, tag_dir, client, torch_save)

        also = with_universal if self.cfg.train.universal_checkpoint else None
        try:
            return save.save(
                self.engine,
                self.cfg,
                it,
                self.consumed,
                also=also,
                layout=self.layout,
                lineage=self.lineage,
            )
        except save.SaveFailed as e:
            raise TrainingStopped(str(e)) from None

    # ------------------------------------------------------------------ loop
    def train_step(
        self, batches: Iterator[tuple], want_norm: bool, it: int = 0
    ) -> tuple[float, float | None]:
        """One global batch; returns the mean loss and (when ``want_norm``) the gradient norm.

        Iteration ``it`` listed in ``$TAPERED_MEGATRON_INJECT_NAN`` gets a NaN loss on rank 0,
        under a pipeline in its first micro-batch on the first replica's last stage (the rank of
        the last chunk under a virtual-stage schedule): a fault-injection hook for tests."""
        eng = self.engine
        nan = self.pipeline and it in self.nan_iters and parallel.get_data_parallel_rank() == 0
        if self.virtual is not None:
            with nan_first_loss(self.virtual.module, "loss", nan):
                loss = self.virtual.train_batch(batches)
            return loss, self.virtual.last_grad_norm if want_norm else None
        if self.pipeline:  # every pipeline engine keeps its norm (norms.clip_in_step at fp32)
            with nan_first_loss(eng.module, "loss_fn", nan):
                loss = float(eng.train_batch(batches))
            norm = eng.get_global_grad_norm() if want_norm else None
            return loss, None if norm is None else float(norm)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        norm = None
        scale = loss_scale_to_apply(eng)  # read before the step may change it
        before_step = want_norm and not computes_grad_norm(eng)
        for k in range(self.layout.grad_accum):
            x, y = next(batches)
            loss = eng(x, y)  # the model's loss: LM head fused into the cross-entropy
            if k == 0 and it in self.nan_iters and self.rank == 0:
                loss = loss * float("nan")
            eng.backward(loss if scale == 1.0 else loss * scale)
            if before_step and k == self.layout.grad_accum - 1:
                norm = grad_norm(eng)
            eng.step()
            total += loss.detach().double()
        if want_norm and not before_step:
            norm = grad_norm(eng)
            norm = None if norm is None else norm / scale
        total /= self.layout.grad_accum
        if self.layout.dp > 1:
            dist.all_reduce(total, group=self.dp_group)
            total /= self.layout.dp
        return total.item(), norm

    def _validate(self) -> dict[str, Any]:
        """The validation loss (``val_loss``), each ``eval.extra_paths`` dataset's loss
        (``extra_val_loss``) and, with ``eval.alignment``, the per-layer alignment measured
        on the validation batches (``alignment``). Collective over all ranks."""
        cfg, lay = self.cfg, self.layout
        n = cfg.eval.iters * lay.global_batch_size
        out: dict[str, Any] = {}

        def loss(dataset: Any, after: Callable[[], None] | None = None) -> float:
            batches = self.batches(dataset, n, 0)
            return validation_loss(
                self.virtual or self.engine,
                batches,
                cfg.eval.iters,
                lay.grad_accum,
                self.dp_group,
                after,
            )

        if self.valid_ds is not None and cfg.eval.alignment:
            probe = AlignmentProbe(
                self.engine.module, cfg.model.layers, self.device, commit_each_pass=self.pipeline
            )
            with probe:
                out["val_loss"] = loss(self.valid_ds, probe.commit)
            out["alignment"] = probe.result(all_ranks=True)
        elif self.valid_ds is not None:
            out["val_loss"] = loss(self.valid_ds)
        if self.extra_ds:
            out["extra_val_loss"] = {name: loss(ds) for name, ds in self.extra_ds.items()}
        return out

    def fit(self) -> list[float]:
        """Train to ``train.iters``; return the per-iteration training losses of this run."""
        cfg, lay = self.cfg, self.layout
        self.logger.widths_figure()
        self.log(
            f"layout: world {lay.world_size} = dp {lay.dp} x tp {lay.tp} x pp {lay.pp} | "
            f"global batch {lay.global_batch_size} = micro {lay.micro_batch_size} x dp {lay.dp} "
            f"x accumulation {lay.grad_accum} | zero stage {self.engine.zero_optimization_stage()}"
        )
        self.log(cfg.taper_plan.table())
        if note := precision_note(self.ds_config):
            self.log(note)
        cadence = Cadence.of(cfg, can_eval=self.valid_ds is not None or bool(self.extra_ds))
        batches = self.batches(self.train_ds, cadence.iters * lay.global_batch_size, self.consumed)
        metrics = MetricsFile(cfg.logging.metrics_file if self.rank == 0 else "")
        window = Window(lay.global_batch_size * cfg.model.seq_len)
        health = Health(cfg.train.max_skipped_steps, cfg.train.loss_spike_factor)
        losses: list[float] = []
        while self.iteration < cadence.iters:
            it = self.iteration + 1
            lr = self.engine.get_lr()[0]
            t = time.perf_counter()
            want_norm = cadence.log(it) or bool(cfg.logging.metrics_file)  # same on all ranks
            skipped_before = self.engine.skipped_steps
            loss, gnorm = self.train_step(batches, want_norm, it)
            skipped = self.engine.skipped_steps > skipped_before
            overflow = skipped and self.engine.fp16_enabled() and math.isfinite(loss)
            step_s = time.perf_counter() - t
            if not losses:
                self.log(f"first step done {time.time() - self.t0:.1f} s after process start")
            self.iteration, self.consumed = it, self.consumed + lay.global_batch_size
            losses.append(loss)
            window.add(loss, step_s, counted=overflow or not skipped)
            record = {"iteration": it, "loss": loss, "lr": lr, "grad_norm": gnorm}
            record.update(step_s=step_s, wall=time.time())
            if overflow:
                scale = self.engine.optimizer.loss_scale
                self.log(
                    f"iteration {it}: fp16 gradient overflow: step skipped, loss scale {scale:g}"
                )
                record["skipped"] = True
            note, stop = health.update(
                it, loss, skipped and not overflow, self.consumed, lay.global_batch_size
            )
            if note:
                self.log(note)
                record["skipped" if skipped else "loss_spike"] = True
            if stop:
                metrics.write(record)
                self.logger.close()
                metrics.close()
                raise TrainingStopped(stop)
            if cadence.log(it):
                stages = self._gather_stage_ms(window.iters) if self.clock else None
                scale = self.engine.optimizer.loss_scale if self.engine.fp16_enabled() else None
                diag = take_diagnostics(self.engine.module)  # this rank's modules, since the last
                record.update(diag)
                self.logger.train(
                    it, window.mean_loss, lr, gnorm, *window.take(), stages, scale,
                    self.engine.skipped_steps, diag,
                )  # fmt: skip
            if cadence.evaluate(it):
                record.update(self._evaluate(it))
            metrics.write(record)
            if cadence.save(it):
                self._save_if_safe(it, loss, health.in_a_row)
            if cadence.stop(it):
                self.log(f"train.exit_interval={cadence.exit_every}: stopping at iteration {it}")
                break
            if it < cadence.iters and self.exit_signal.received():
                if not cadence.save(it):
                    self._save_if_safe(it, loss, health.in_a_row)
                self.logger.close()
                metrics.close()
                raise TrainingPreempted(
                    f"{self.cfg.train.exit_signal} received: stopped at iteration {it} after "
                    "saving; continue with --resume auto"
                )
        self.logger.close()
        metrics.close()
        return losses

    def _save_if_safe(self, it: int, loss: float, skipped_in_a_row: int) -> None:
        """Save iteration ``it``, unless :meth:`_unsafe_to_save` says why not (one line)."""
        if why := self._unsafe_to_save(loss, skipped_in_a_row):
            self.log(
                f"iteration {it}: checkpoint withheld ({why}); the last complete checkpoint "
                "stays latest and nothing is pruned"
            )
        else:
            self.log(f"saved checkpoint {self.save(it)}")

    def _unsafe_to_save(self, loss: float, skipped_in_a_row: int) -> str:
        """Why the state after this step must not become a checkpoint ("" when it may): the
        last steps were skipped, the loss is not finite, or a weight is not finite on some
        rank (collective). A bad step never replaces a good checkpoint."""
        if skipped_in_a_row:
            return f"the last {skipped_in_a_row} step(s) were skipped as non-finite"
        if not math.isfinite(loss):
            return f"loss {loss}"
        bad = torch.zeros((), device=self.device)
        for p in self.engine.module.parameters():
            local = p.ds_tensor if hasattr(p, "ds_tensor") else p.data  # ZeRO-3: the partition
            if local.numel() and not torch.isfinite(local).all():
                bad.fill_(1.0)
                break
        if dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return "a weight is not finite" if bad.item() else ""

    def _evaluate(self, it: int) -> dict[str, Any]:
        """Run :meth:`_validate`, log its results; return them as metrics-file fields."""
        results = self._validate()
        record: dict[str, Any] = {}
        if "val_loss" in results:
            record["val_loss"] = results["val_loss"]
            self.logger.val(it, results["val_loss"])
        for name, value in results.get("extra_val_loss", {}).items():
            self.logger.val(it, value, name)
        if "extra_val_loss" in results:
            record["extra_val_loss"] = results["extra_val_loss"]
        if "alignment" in results:
            rows = results["alignment"]
            self.logger.alignment(it, rows)
            record["alignment"] = [
                {
                    k: (None if isinstance(v, float) and math.isnan(v) else v)
                    for k, v in asdict(r).items()
                }
                for r in rows
            ]
        return record

    def _gather_stage_ms(self, iters: int) -> list[float]:
        """Per-stage compute ms per iteration (max over the ranks of each stage)."""
        world = self.layout.world_size
        ms = self.clock.take() / max(iters, 1)
        mine = torch.tensor(
            [float(parallel.get_pipeline_model_parallel_rank()), ms], dtype=torch.float64
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


class TrainingStopped(RuntimeError):
    """The run cannot continue (e.g. too many non-finite steps); the message says why."""


class TrainingPreempted(RuntimeError):
    """``train.exit_signal`` arrived: every rank saved and stopped at the same iteration."""


def build_engine(
    cfg: Config, ds_config: dict[str, Any], layout: ParallelLayout, clock: StageClock | None = None
) -> Any:
    """This rank's DeepSpeed engine as training runs it, from no data: the model (under
    ``parallel.pp > 1`` this rank's pipeline stage from our balancer, timed by ``clock``; else
    the single model, built partitioned under ZeRO-3), the trainer's optimizer and schedule
    unless the ds_config names its own, ``deepspeed.initialize``, the 16-bit optimizers'
    priming step taken back and non-finite steps skipped; a pipeline at fp32 ZeRO-0 clips by
    the exact global norm itself (:func:`~tapered_megatron.parallel.norms.clip_in_step`). Call after
    :func:`parallel.init_model_parallel` and :func:`parallel.model_parallel_seed`."""
    pipeline = layout.pp > 1
    mpu = parallel.topology if not pipeline and layout.tp > 1 else None
    clip = own_clip(ds_config) if pipeline else None  # fp32 ZeRO-0: exact clipping is ours
    if clip is not None:
        ds_config = {**ds_config, "gradient_clipping": 0.0}
    if pipeline:
        model = _pipeline_module(cfg, layout, clock)
    else:
        model = build_partitioned(cfg, ds_config)
    if not is_zero3_partitioned(model):
        model.to(get_accelerator().current_device_name())
    kwargs: dict[str, Any] = {
        "model": model,
        "config": ds_config,
        **optimizer_kwargs(cfg, ds_config, model),
    }
    if mpu is not None:
        kwargs["mpu"] = mpu  # DeepSpeed's mpu protocol (TP-aware ZeRO, norms)
    engine, *_ = deepspeed.initialize(**kwargs)
    if cfg.train.compile:
        allow_layer_recompiles(cfg)  # every tapered layer width compiled, none left eager
        engine.compile()
    if clock is not None:
        clock.attach(engine.module)
    optim.undo_priming_step(engine)
    optim.skip_nonfinite_steps(engine)
    if clip is not None:
        clip_in_step(engine, clip, engine.mpu.get_model_parallel_group())
    return engine


def optimizer_kwargs(cfg: Config, ds_config: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """``deepspeed.initialize``'s optimizer and LR-schedule arguments for ``model``: the
    trainer's AdamW groups and warmup + cosine schedule unless the ds_config names its own."""
    out: dict[str, Any] = {}
    if "optimizer" in ds_config:
        out["model_parameters"] = optim.param_groups(model, cfg.train.weight_decay)
    else:
        out["optimizer"] = optim.build_optimizer(model, cfg.train, ds_config)
    if "scheduler" not in ds_config:
        out["lr_scheduler"] = lambda opt: optim.build_scheduler(opt, cfg.train)
    return out


def _pipeline_module(cfg: Config, layout: ParallelLayout, clock: StageClock | None) -> Any:
    """Stages from our balancer (``parallel.partition``), never DeepSpeed's defaults."""
    from tapered_megatron.parallel.pipeline import BalancedPipelineModule

    return BalancedPipelineModule.from_config(
        cfg,
        topology=parallel.get_topology(),
        micro_batches=layout.grad_accum,
        # the single model's loss, fused LM head
        loss_fn=clock.timed(lm_loss) if clock is not None else lm_loss,
        partition_kwargs={"dp": layout.dp, "zero_stage": layout.zero_stage},
    )


def build_partitioned(cfg: Config, ds_config: dict[str, Any]) -> nn.Module:
    """The single model of ``cfg``; under ZeRO stage 3 built inside ``deepspeed.zero.Init``, so
    each parameter is partitioned over the data-parallel ranks as soon as its module exists and
    no rank ever holds the whole model (each rank writes only its own partition of the
    layout-invariant init). Partitions span this rank's data-parallel group (call
    :func:`parallel.init_model_parallel` first). Other stages: :func:`build_model` as is."""
    if ds_config.get("zero_optimization", {}).get("stage", 0) != 3:
        return build_model(cfg)
    deepspeed.init_distributed(dist.get_backend())  # zero.Init reads the world from it
    with (
        _heap_returns_freed_memory(),
        deepspeed.zero.Init(
            config_dict_or_path=ds_config,
            mpu=parallel.topology,  # batch keys checked against the DP size
            data_parallel_group=parallel.get_data_parallel_group(),  # its default: the world
        ),
    ):
        return build_model(cfg)


# glibc mallopt parameters (malloc.h) and its dynamic mmap threshold's ceiling on 64-bit
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_GLIBC_MMAP_MAX = 32 * 2**20


@contextlib.contextmanager
def _heap_returns_freed_memory(threshold: int = 2**20) -> Iterator[None]:
    """While building, glibc serves every allocation of ``threshold`` bytes or more with its own
    mapping, returned to the system when freed.

    The partitioned build draws each parameter's full fp32 tensor on the host and frees it once
    this rank's slice is written. glibc's default raises its mmap threshold to the size of each
    freed mapped block (up to 32 MiB), after which the block-sized draws of the layers come
    from its heap and stay resident when freed: 73-299 MiB per rank on the 760M preset (4
    ranks), the build peak's excess over the partition plus the largest parameter (measured in
    docs/BENCHMARKS.md, ZeRO-3 section). Afterwards the
    threshold is set to that 32 MiB ceiling (where glibc's own adjustment ends up) and the
    freed heap is trimmed. A no-op where the C library is not glibc, and where the process
    was started with glibc's threshold set (``MALLOC_MMAP_THRESHOLD_``).
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        yield
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt  # noqa: B018 - glibc only
    except (OSError, AttributeError):
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, threshold)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_MMAP_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * _GLIBC_MMAP_MAX)
        libc.malloc_trim(0)


def is_zero3_partitioned(model: nn.Module) -> bool:
    """Whether ``model``'s parameters were partitioned by ``deepspeed.zero.Init``."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def loss_scale_to_apply(engine: Any) -> float:
    """The factor the trainer multiplies the loss by before ``engine.backward`` (and divides
    the reported gradient norm by): fp16's current dynamic loss scale without ZeRO, else 1.

    DeepSpeed's ``engine.backward`` applies the loss scale only for ZeRO optimizers, while its
    fp16 optimizers without ZeRO (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``) still divide
    the gradients by the scale, grow it after every window without overflow and report the
    norm of the scaled gradients: unscaled, the updates would shrink by the scale and
    overflows would never be seen.
    """
    if engine.fp16_enabled() and not isinstance(engine.optimizer, ZeROOptimizer):
        return float(engine.optimizer.loss_scale)
    return 1.0


def _collate(samples: list[Any]) -> torch.Tensor:
    return torch.stack([torch.as_tensor(s, dtype=torch.int64) for s in samples])


def run(cfg: Config, ds_config: dict[str, Any], layout: ParallelLayout, t0: float) -> list[float]:
    """Train one run in an initialised process group (used by ``pretrain/main.py``), holding
    ``train.save_dir`` for it (:func:`save_dir.own_save_dir`)."""
    os.makedirs(cfg.train.save_dir, exist_ok=True)
    try:
        with save_dir.own_save_dir(cfg):
            return Trainer(cfg, ds_config, layout, t0).fit()
    except save_dir.SaveDirTaken as e:
        raise TrainingStopped(str(e)) from None
