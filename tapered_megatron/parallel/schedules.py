"""Virtual-stage pipeline runtime: torch.distributed.pipelining's schedules over this rank's chunks.

``parallel.schedule`` ``interleaved``, ``zbv``, ``dualpipev`` or ``zero_bubble`` with
``parallel.virtual_stages v`` cuts the units into ``P x v`` chunks with the virtual-stage
balancer (:mod:`tapered_megatron.planning.chunks`), builds this rank's chunks
(:class:`RankChunks`) and runs them with torch's schedule class (:data:`~tapered_megatron.
planning.schedule.TORCH_SCHEDULES`). DeepSpeed stays the launcher, the topology and the
optimizer: ``deepspeed.initialize`` wraps the rank's chunks with ZeRO-0/1 (fp32, or bf16 with
fp32 gradient accumulation) and DeepSpeed's ``PipelineParallelGrid`` as ``mpu``. After the
schedule's step the gradients are reduced over the data-parallel axis explicitly
(:meth:`VirtualPipeline.reduce_gradients`: torch's weight-gradient pass bypasses the hooks
through which DeepSpeed reduces otherwise), then ``engine.step()`` clips by the global norm
and steps (fp32 ZeRO-0: the pipeline clips, see :mod:`tapered_megatron.parallel.norms`).
``1f1b`` stays on DeepSpeed's PipelineEngine (:mod:`tapered_megatron.parallel.pipeline`).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.pipe.topology import PipelineParallelGrid
from torch import nn
from torch.distributed.pipelining import PipelineStage

from tapered_megatron import parallel
from tapered_megatron.parallel.norms import clip_grads, grad_norm, own_clip
from tapered_megatron.parallel.pipeline import agree_on_parts
from tapered_megatron.planning.schedule import (
    SPLIT_BACKWARD,
    TORCH_SCHEDULES,
    schedule_problem,
    stage_ranks,
)

if TYPE_CHECKING:
    from tapered_megatron.config import Config
    from tapered_megatron.planning.clock import StageClock


class RankChunks(nn.Module):
    """This rank's chunks: their units registered under the unit index (the parameter names of
    a DeepSpeed pipeline stage, ``<unit>.<name in the unit>``, hence one name per parameter in
    every layout), and per chunk (stage index) an ``nn.Sequential`` over the same modules."""

    def __init__(self, cfg: Config, parts: Sequence[int], stages: Sequence[int]) -> None:
        from tapered_megatron.models import units

        super().__init__()
        table = units(cfg)
        chunks: dict[int, nn.Module] = {}
        head = None
        for s in stages:
            mods = OrderedDict((str(i), table[i].build()) for i in range(parts[s], parts[s + 1]))
            for name, m in mods.items():
                self.add_module(name, m)
            chunks[s] = nn.Sequential(mods)
            if parts[s + 1] == len(table):
                head = mods[str(len(table) - 1)]
                chunks[s] = _HiddenOut(chunks[s])
        # views of the units, not registered twice
        object.__setattr__(self, "chunks", chunks)
        object.__setattr__(self, "head", head)

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The single model's fused LM-head loss of the last chunk's output."""
        from tapered_megatron.models import lm_loss
        from tapered_megatron.models.language_model import HeadOutput

        return lm_loss(HeadOutput(hidden, self.head.proj.weight), labels)

    def forward(self, *args: Any) -> Any:
        """Not called: the schedule runs the chunks."""
        raise RuntimeError("RankChunks runs through VirtualPipeline.train_batch, chunk by chunk")


class _HiddenOut(nn.Module):
    """The last chunk, handing on only the head's hidden states: a stage's outputs must be
    activations (torch detaches them in place), and the head's weight is a parameter; the
    loss (:meth:`RankChunks.loss`) takes it from the head."""

    def __init__(self, chunk: nn.Sequential) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The chunk's units, then the head's hidden states."""
        return self.chunk(h).hidden


class _Stage(PipelineStage):
    """torch's pipeline stage, calling ``after_backward`` after each backward pass of a
    micro-batch (full, input or weight), where DeepSpeed's pipeline engine hands the bf16
    optimizer the gradients (fp32 accumulation); each pass timed by ``clock`` when given."""

    def __init__(
        self,
        *args: Any,
        after_backward: Callable[[], None],
        clock: StageClock | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.after_backward = after_backward
        self.clock = clock

    def _timed(self, kind: str) -> contextlib.AbstractContextManager:
        return self.clock.span(kind) if self.clock is not None else contextlib.nullcontext()

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        """torch's forward of one micro-batch, timed."""
        with self._timed("forward"):
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        """torch's backward of one micro-batch, then ``after_backward``."""
        with self._timed("backward"):
            out = super().backward_one_chunk(*args, **kwargs)
            self.after_backward()
        return out

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        """torch's weight pass of one micro-batch, then ``after_backward``."""
        with self._timed("backward"):
            out = super().backward_weight_one_chunk(*args, **kwargs)
            self.after_backward()
        return out


def run_problem(cfg: Config, micro_batches: int, precision: str) -> str | None:
    """Why a training run cannot use ``cfg.parallel.schedule`` (one line naming the fix), or
    None: the layout (:func:`~tapered_megatron.planning.schedule.schedule_problem`) and what
    the runtime does not do."""
    p, tr = cfg.parallel, cfg.train
    name = f"parallel.schedule {p.schedule}"
    if problem := schedule_problem(p.schedule, p.pp, p.virtual_stages, micro_batches):
        return problem
    if not tr.universal_checkpoint:
        return (
            f"{name}: its checkpoints resume and export through the universal copy; drop "
            "--train.universal_checkpoint false"
        )
    if tr.compile:
        return f"{name}: train.compile is not supported here; drop --train.compile"
    if precision == "fp16":
        return f"{name}: fp16 (loss scaling) is not supported; use bf16 or fp32"
    if tr.recompute != "none" and p.schedule in SPLIT_BACKWARD:
        return (
            f"{name} runs weight gradients in a separate pass, which torch's activation "
            "recomputation cannot replay; use --parallel.schedule interleaved or "
            "--train.recompute none"
        )
    return None


def chunk_parts(cfg: Config, micro_batches: int, dp: int, zero_stage: int) -> tuple[list[int], str]:
    """The balancer's ``P x v`` cut of ``cfg`` (rank 0's, on every rank) and its table."""
    from tapered_megatron.planning.balance import analyse_chunks
    from tapered_megatron.planning.chunks import chunk_table

    p = cfg.parallel
    setup, plans = analyse_chunks(
        cfg, p.pp, p.virtual_stages, p.schedule, micro_batches, dp=dp, zero_stage=zero_stage
    )
    return agree_on_parts(list(plans["balancer"].parts), chunk_table(setup, plans))


class VirtualPipeline:
    """This rank's chunks, their DeepSpeed engine and torch's schedule over them.

    Args:
        cfg: the run's config (``parallel.schedule``, ``parallel.virtual_stages``).
        ds_config: the DeepSpeed config (ZeRO stage 0 or 1, fp32 or bf16).
        micro_batches: micro-batches per optimizer step on this data-parallel rank.
        engine_kwargs: a function of the rank's module giving ``deepspeed.initialize``'s
            other arguments (``optimizer`` or ``model_parameters``, ``lr_scheduler``); default
            ``model_parameters`` (the optimizer of ``ds_config``).
        parts: the chunk boundaries (default: the virtual-stage balancer's).
        clock: times this rank's passes (forward with the loss, backward, weight) for the
            trainer's per-stage compute time, which is per pipeline rank here (its chunks).
    """

    def __init__(
        self,
        cfg: Config,
        ds_config: dict[str, Any],
        micro_batches: int,
        engine_kwargs: Callable[[nn.Module], dict[str, Any]] | None = None,
        parts: Sequence[int] | None = None,
        clock: StageClock | None = None,
    ) -> None:
        import deepspeed
        from torch.distributed.pipelining import schedules as torch_schedules

        p = cfg.parallel
        topo = parallel.get_topology()
        self.grid = PipelineParallelGrid(topology=topo, process_group=dist.group.WORLD)
        self.pp, self.v, self.micro_batches = p.pp, p.virtual_stages, micro_batches
        self.schedule_name = p.schedule
        self.pipe_rank = parallel.get_pipeline_model_parallel_rank()
        zero = int(ds_config.get("zero_optimization", {}).get("stage", 0))
        if zero > 1:
            raise ValueError(
                f"parallel.schedule {p.schedule}: ZeRO stage {zero} partitions gradients, which "
                "pipeline schedules cannot accumulate; use ZeRO stage 0 or 1"
            )
        if parts is None:
            dp = parallel.get_data_parallel_world_size()
            parts, table = chunk_parts(cfg, micro_batches, dp, zero)
            if dist.get_rank() == 0:
                print(table, flush=True)
        self.parts = list(parts)
        ranks = stage_ranks(p.schedule, self.pp, self.v)
        self.stage_ids = [s for s in range(self.pp * self.v) if ranks[s] == self.pipe_rank]
        self.module = RankChunks(cfg, self.parts, self.stage_ids)
        extra = (
            engine_kwargs(self.module)
            if engine_kwargs is not None
            else {"model_parameters": self.module.parameters()}
        )
        # fp32 ZeRO-0: the pipeline computes the norm and clips (parallel/norms.py says why)
        clip = own_clip(ds_config)
        self.own_norm = clip is not None
        self.clip = clip or 0.0
        config = {**ds_config, "gradient_clipping": 0.0} if self.own_norm else ds_config
        self.engine, *_ = deepspeed.initialize(
            model=self.module, config=config, mpu=self.grid, **extra
        )
        device = torch.device(self.engine.device)
        group = parallel.get_pipeline_model_parallel_group()
        self.stages = [
            _Stage(
                self.module.chunks[s],
                s,
                self.pp * self.v,
                device,
                group=group,
                after_backward=self._after_backward,
                clock=clock,
            )
            for s in self.stage_ids
        ]
        cls = getattr(torch_schedules, TORCH_SCHEDULES[p.schedule])
        # Each micro-batch's loss is divided by M before its backward, not the summed gradients
        # after the step (torch's scale_grads): bf16's optimizer takes gradients as they
        # accumulate, and what it has taken is no longer on the parameters to be divided.
        loss_fn = clock.timed(self._loss) if clock is not None else self._loss
        self.schedule = cls(
            self.stages, n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=False
        )
        self.first = 0 in self.stage_ids
        self.last = self.pp * self.v - 1 in self.stage_ids
        self.last_rank = ranks[-1]

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One micro-batch's share of the step's mean loss."""
        return self.module.loss(hidden, labels) / self.micro_batches

    def train_batch(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One optimizer step over the next ``micro_batches`` micro-batches of ``batches``;
        returns the mean loss over the global batch (on every rank); ``last_grad_norm`` is the
        step's global gradient norm before clipping."""
        loss = self._run(batches, self.schedule.step)
        self.engine.set_gradient_accumulation_boundary(True)  # ZeRO keeps reduced grads only then
        self.reduce_gradients()
        self.last_grad_norm = self._grad_norm() if self.own_norm else None
        if self.last_grad_norm is not None:
            clip_grads(self.module.parameters(), self.last_grad_norm, self.clip)
        self.engine.step()
        if not self.own_norm:
            self.last_grad_norm = float(self.engine.get_global_grad_norm())
        return loss

    def eval_batch(
        self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], num_micro_batches: int
    ) -> float:
        """Mean loss of the next ``num_micro_batches`` (the schedule's own count) micro-batches,
        forward only (the pipeline engine's ``eval_batch``, for the validation loss): chunk by
        chunk in stage order (torch's ``eval`` fails for the V schedules, whose two local
        chunks hand over a backward that evaluation does not run)."""
        if num_micro_batches != self.micro_batches:
            raise ValueError(
                f"the schedule runs {self.micro_batches} micro-batches, not {num_micro_batches}"
            )
        with torch.no_grad():
            return self._run(batches, self._forward_only)

    def _forward_only(
        self,
        *args: torch.Tensor,
        target: torch.Tensor | None = None,
        losses: list[torch.Tensor] | None = None,
    ) -> None:
        """Every micro-batch through the chunks in stage order; a chunk's output goes to the
        next chunk's rank (shape first, then the tensor); the last chunk appends the losses."""
        pipe = parallel.get_pipeline_model_parallel_group()
        ranks = stage_ranks(self.schedule_name, self.pp, self.v)
        n = self.pp * self.v
        xs = args[0].chunk(self.micro_batches) if args else [None] * self.micro_batches
        ys = target.chunk(self.micro_batches) if target is not None else []
        dtype = next(self.module.parameters()).dtype
        for m in range(self.micro_batches):
            h = xs[m]
            for s in self.stage_ids:
                if s > 0 and ranks[s - 1] != self.pipe_rank:
                    h = _recv(dist.get_global_rank(pipe, ranks[s - 1]), dtype, pipe)
                h = self.module.chunks[s](h)
                if s == n - 1:
                    losses.append(self._loss(h, ys[m]))
                elif ranks[s + 1] != self.pipe_rank:
                    _send(h, dist.get_global_rank(pipe, ranks[s + 1]), pipe)

    def eval(self) -> None:
        """Evaluation mode (dropout off)."""
        self.engine.eval()

    def train(self) -> None:
        """Training mode."""
        self.engine.train()

    def _run(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], run: Callable) -> float:
        """Feed the next micro-batches to ``run`` (the schedule's ``step`` or ``eval``) on the
        ranks of the first and the last chunk; the mean loss over the global batch."""
        xs, ys = zip(*(next(batches) for _ in range(self.micro_batches)), strict=True)
        args = (torch.cat(xs),) if self.first else ()
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"target": torch.cat(ys), "losses": losses} if self.last else {}
        run(*args, **kwargs)
        zero = torch.zeros((), dtype=torch.float64)
        loss = torch.stack(losses).detach().sum().double() if self.last else zero
        pipe = parallel.get_pipeline_model_parallel_group()
        dist.broadcast(loss, src=dist.get_global_rank(pipe, self.last_rank), group=pipe)
        dp = parallel.get_data_parallel_world_size()
        if dp > 1:
            dist.all_reduce(loss, group=parallel.get_data_parallel_group())
            loss /= dp
        return float(loss)

    def _after_backward(self) -> None:
        """The bf16 optimizer takes the new gradients into its fp32 buffer."""
        if isinstance(self.engine.optimizer, BF16_Optimizer):
            _take_bf16_grads(self.engine.optimizer)

    def _grad_norm(self) -> float | None:
        """The global gradient 2-norm from the parameters' gradients (fp32 ZeRO-0, where
        DeepSpeed keeps none), summed over every stage (the grid's model-parallel group)."""
        return grad_norm(self.engine, self.grid.get_model_parallel_group())

    def reduce_gradients(self) -> None:
        """Data-parallel reduction of this step's gradients, the way DeepSpeed's optimizer
        expects it: bf16's optimizer (fp32 accumulation) all-reduces its fp32 gradients,
        ZeRO-1 reduces into its partitions, ZeRO-0 all-reduces."""
        eng = self.engine
        opt = eng.optimizer
        if isinstance(opt, BF16_Optimizer):
            if parallel.get_data_parallel_world_size() > 1:
                eng.buffered_allreduce_fallback(grads=None, elements_per_buffer=BF16_BUCKET)
        elif eng.zero_optimization_stage() == 1:
            for p in self.module.parameters():  # ZeRO flattens them with view()
                if p.grad is not None and not p.grad.is_contiguous():
                    p.grad = p.grad.contiguous()
            opt.reduce_gradients(pipeline_parallel=True)
        elif parallel.get_data_parallel_world_size() > 1:
            eng.allreduce_gradients()


def _send(t: torch.Tensor, dst: int, group: Any) -> None:
    """Send ``t``: a header (its number of dimensions and its shape, int64), then its data."""
    head = torch.zeros(_HEADER, dtype=torch.int64)
    head[0] = t.dim()
    head[1 : 1 + t.dim()] = torch.tensor(t.shape)
    dist.send(head, dst, group=group)
    dist.send(t.contiguous(), dst, group=group)


def _recv(src: int, dtype: torch.dtype, group: Any) -> torch.Tensor:
    """Receive what :func:`_send` sent."""
    head = torch.zeros(_HEADER, dtype=torch.int64)
    dist.recv(head, src, group=group)
    out = torch.empty([int(x) for x in head[1 : 1 + int(head[0])]], dtype=dtype)
    dist.recv(out, src, group=group)
    return out


_HEADER = 8  # a header's entries: the number of dimensions, then up to 7 sizes


#: Elements per all-reduce of the bf16 optimizer's fp32 gradients (DeepSpeed's pipeline
#: engine's ``MEMORY_OPT_ALLREDUCE_SIZE``).
BF16_BUCKET = 500_000_000


def _take_bf16_grads(opt: BF16_Optimizer) -> None:
    """Add each bf16 gradient the optimizer has not taken yet into its fp32 gradient and clear
    it, so gradients accumulate over micro-batches in fp32.

    With ``bf16.immediate_grad_update`` hooks take each gradient as autograd accumulates it,
    but torch's weight-gradient pass (zero-bubble schedules) sets gradients without them: what
    is left on a parameter is taken here. Without it, everything is."""
    if not opt.immediate_grad_update:
        opt.update_hp_grads(clear_lp_grads=True)
        return
    for i, group in enumerate(opt.bf16_groups):
        for j, lp in enumerate(group):
            if lp.grad is not None:
                opt.accumulate_hp_grads_and_remove_lp(lp, i, j)
