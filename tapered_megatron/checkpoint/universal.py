"""Layout-free checkpoints: resume a run under another (TP, PP, DP, ZeRO stage, pipeline unit).

DeepSpeed's own checkpoint files are per rank of one layout. Beside them a checkpoint holds
(``train.universal_checkpoint``, on by default) a ``universal/`` folder that no layout owns: per
parameter, keyed by its canonical name (its name in the single
:class:`~tapered_megatron.models.LanguageModel`, ``layers.3.mlp.w13.weight``), the FULL fp32
weight and the full AdamW moments (``exp_avg``, ``exp_avg_sq``), plus ``meta.pt``: the layout it
was saved under, the world size, the optimizer step, the LR scheduler state and the client state
(iteration, consumed samples). Model shapes depend on the config alone, so the full tensors fit
any layout; the TP split of each parameter is read from its ``tp_layout`` (see
:mod:`tapered_megatron.parallel.layers`). It costs 12 bytes per parameter on disk.

Save (collective): each rank reads the DP-full tensors of its own parameters through DeepSpeed's
fragment API (``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``;
plain ``param`` / ``optimizer.state`` without ZeRO), gathers the TP pieces, and the (TP rank 0,
DP rank 0) rank of each pipeline stage writes them.
Load: each rank cuts its TP piece of every parameter it holds and hands it to the engine (ZeRO
partitions, the model's own copy, AdamW state with the saved step), restores the LR schedule
and the engine's step / sample counters. The data position is the client state's consumed
samples (the sampler starts there under any DP). RNG: rank ``r`` restores the saved states of
rank ``r mod old world``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import (
    lazy_init_hp_params_optimizer_state,
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)

from tapered_megatron import parallel
from tapered_megatron.checkpoint import safe_load
from tapered_megatron.checkpoint.layout import (
    UNIVERSAL,
    UNIVERSAL_META,
    ParallelLayout,
    has_universal,
)
from tapered_megatron.config import Config
from tapered_megatron.models import canonical_parameters
from tapered_megatron.parallel.layers import param_shape, shard, unshard
from tapered_megatron.parallel.random import set_rng_state
from tapered_megatron.training import optim

MOMENTS = ("exp_avg", "exp_avg_sq")


def _base_optimizer(engine: Any) -> torch.optim.Optimizer:
    opt = engine.optimizer
    return opt.optimizer if hasattr(opt, "optimizer") else opt


def _link_optimizer_state(engine: Any) -> torch.optim.Optimizer:
    """Make the AdamW moments of every optimized tensor exist and be visible through DeepSpeed's
    fragment API; return the torch optimizer.

    Torch's AdamW creates its state at its first step, so a fresh engine (resume) has none:
    zero moments are created here (the values are set right after). ZeRO-1/2 and the
    BF16_Optimizer (bf16 with fp32 gradient accumulation at ZeRO-1, pipelines) link each
    parameter's view into the flat partition's state once, after the step of the FIRST param
    group, when the other groups have no state yet (DeepSpeed 0.19), so the no-decay group's
    parameters would have no moments to read: the links are remade for every group here.
    """
    opt, zero = _base_optimizer(engine), engine.optimizer
    if hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3 empties the groups between steps
        tensors = list(zero.fp32_partitioned_groups_flat)
    else:
        tensors = [p for group in opt.param_groups for p in group["params"]]
    for p in tensors:
        state = opt.state[p]
        if any(k not in state for k in MOMENTS):
            state["step"] = torch.tensor(0.0)
            for k in MOMENTS:
                state[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if hasattr(zero, "single_partition_of_fp32_groups"):  # ZeRO-1/2
        for lp, hp in zip(zero.bit16_groups, zero.single_partition_of_fp32_groups):
            lazy_init_hp_params_optimizer_state(lp, hp, opt.state)
    elif hasattr(zero, "fp32_groups_flat_partition"):  # BF16_Optimizer (fp32 accumulation, pp)
        for lp, hp in zip(zero.bf16_groups, zero.fp32_groups_flat_partition):
            lazy_init_hp_params_optimizer_state(lp, hp, opt.state)
    return opt


def _own_state(
    p: torch.nn.Parameter, opt: torch.optim.Optimizer, masters: dict
) -> list[torch.Tensor]:
    """The fp32 weight and the AdamW moments of ``p`` where no ZeRO optimizer owns it: views of
    the 16-bit optimizer's fp32 master and its state, or ``p`` and its state (fp32 runs)."""
    if id(p) not in masters:
        return [p.data, *(opt.state[p][k] for k in MOMENTS)]
    key, part = masters[id(p)]

    def view(t: torch.Tensor) -> torch.Tensor:
        return t.data.view(-1) if part is None else t.data.view(-1)[part]

    return [view(key), *(view(opt.state[key][k]) for k in MOMENTS)]


def _loss_scale(engine: Any) -> float | None:
    """fp16's current dynamic loss scale (``None`` in bf16/fp32, which do not scale)."""
    return float(engine.optimizer.loss_scale) if engine.fp16_enabled() else None


def _zero(p: torch.nn.Parameter) -> bool:
    """Whether DeepSpeed's fragment API owns ``p`` (ZeRO-3, or ZeRO-1/2 where every parameter
    has ``_hp_mapping``, ``None`` on a rank whose partition holds none of it)."""
    return hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")


def _tp_full(t: torch.Tensor, p: torch.nn.Parameter) -> torch.Tensor:
    """The full tensor from this rank's TP piece (collective over the TP group)."""
    layout = getattr(p, "tp_layout", None)
    tp = parallel.get_tensor_model_parallel_world_size()
    if layout is None or tp == 1:
        return t
    pieces = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(pieces, t.contiguous(), group=parallel.get_tensor_model_parallel_group())
    return unshard(pieces, layout)


def _tp_piece(full: torch.Tensor, p: torch.nn.Parameter) -> torch.Tensor:
    layout = getattr(p, "tp_layout", None)
    tp = parallel.get_tensor_model_parallel_world_size()
    if layout is None or tp == 1:
        return full
    return shard(full, layout, parallel.get_tensor_model_parallel_rank(), tp)


def _step(opt: torch.optim.Optimizer) -> float:
    for s in opt.state.values():
        if "step" in s:
            return float(s["step"])
    return 0.0


def save(
    engine: Any,
    cfg: Config,
    layout: ParallelLayout,
    tag_dir: Path,
    client: dict[str, Any],
    torch_save: Callable[[Any, Path], None] = torch.save,
) -> None:
    """Write ``tag_dir/universal`` (collective: every rank calls it, before ``complete``), each
    file with ``torch_save(obj, path)`` (the save's own writes,
    :func:`tapered_megatron.checkpoint.save.save`)."""
    out = tag_dir / UNIVERSAL
    out.mkdir(parents=True, exist_ok=True)
    opt = _link_optimizer_state(engine)
    writer = (
        parallel.get_tensor_model_parallel_rank() == 0 and parallel.get_data_parallel_rank() == 0
    )
    masters = optim.fp32_masters(engine)
    for name, p in canonical_parameters(engine.module, cfg):
        if _zero(p):
            w = safe_get_full_fp32_param(p)
            moments = [safe_get_full_optimizer_state(p, k) for k in MOMENTS]
        else:
            w, *moments = _own_state(p, opt, masters)
        full = [_tp_full(t.detach().float().reshape(param_shape(p)), p) for t in (w, *moments)]
        if writer:
            torch_save(dict(zip(("fp32", *MOMENTS), full)), out / f"{name}.pt")
    if dist.get_rank() == 0:
        meta = {
            "layout": layout.to_record(),
            "world_size": dist.get_world_size(),
            "step": _step(opt),
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
            "loss_scale": _loss_scale(engine),
            "client": client,
        }
        torch_save(meta, out / UNIVERSAL_META)


def _set_full(p: torch.nn.Parameter, value: torch.Tensor, key: str | None) -> None:
    """Set this rank's part of the fp32 weight (``key`` None) or of moment ``key`` of ``p`` from
    the tensor of the whole parameter (its TP piece); every DP rank calls it.

    ZeRO-3: DeepSpeed's setter cuts the value into DP-size pieces without the padding of the
    last one and fails when the size is not a multiple of the DP size (DP3 after losing a
    node); the partition is written here the way DeepSpeed lays it out (equal padded pieces).
    """
    if not hasattr(p, "ds_id"):  # ZeRO-1/2: the fragment of each rank
        if key is None:
            safe_set_full_fp32_param(p, value)
        else:
            safe_set_full_optimizer_state(p, value, key)
        return
    zero = p._z3_optimizer
    part, group = zero._get_fp32_opt_state_partition(p, False, optim_state_key=key)
    n, rank = part.numel(), zero._get_param_partition_rank(p)
    mine = value.reshape(-1)[n * rank : n * (rank + 1)]
    part.data.zero_()
    part.data[: mine.numel()].copy_(mine)
    if zero._swappable_optimizer_subgroup(group):
        zero._optimizer_states_and_gradient_swap_out(group)


def _load_scheduler(engine: Any, state: dict[str, Any] | None) -> None:
    """Restore the LR schedule and put its current rate into every optimizer group. A stage of
    another layout may hold another number of groups (empty ones are dropped); all groups share
    one schedule, so per-group lists are cut or repeated to the new count."""
    sched = engine.lr_scheduler
    if sched is None or state is None:
        return
    groups = engine.optimizer.param_groups
    state = dict(state)
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        if isinstance(state.get(key), list) and state[key]:
            state[key] = state[key][:1] * len(groups)
    sched.load_state_dict(state)
    if hasattr(sched, "get_last_lr"):
        for g, lr in zip(groups, sched.get_last_lr()):
            g["lr"] = lr


def load(engine: Any, cfg: Config, tag_dir: Path) -> dict[str, Any]:
    """Load ``tag_dir/universal`` into ``engine`` (any layout); return the client state."""
    src = tag_dir / UNIVERSAL
    if not has_universal(tag_dir):
        raise FileNotFoundError(
            f"{tag_dir} has no {UNIVERSAL}/ copy (saved with train.universal_checkpoint false): it "
            "resumes only under the layout it was saved under (its layout.json)"
        )
    meta = safe_load.load(src / UNIVERSAL_META)
    opt = _link_optimizer_state(engine)
    masters = optim.fp32_masters(engine)
    for name, p in canonical_parameters(engine.module, cfg):
        f = src / f"{name}.pt"
        if not f.exists():
            raise FileNotFoundError(f"{f}: the checkpoint has no parameter {name}")
        rec = safe_load.load(f)
        w, *moments = (_tp_piece(rec[k], p) for k in ("fp32", *MOMENTS))
        if _zero(p):
            for k, t in zip((None, *MOMENTS), (w, *moments)):
                _set_full(p, t, k)
            z3 = hasattr(p, "ds_id")
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0, enabled=z3):
                p.data.copy_(w.to(p.dtype))  # the model's own copy (the engine's is above)
        else:
            with torch.no_grad():
                for own, t in zip(_own_state(p, opt, masters), (w, *moments)):
                    own.copy_(t.reshape(own.shape))
                p.copy_(w.to(p.dtype))  # the model's copy (bf16/fp16: rounded from the master)
    for s in opt.state.values():  # every AdamW state entry carries the step count
        s["step"] = torch.tensor(meta["step"], dtype=torch.float32)
    if meta.get("loss_scale") is not None and engine.fp16_enabled():
        engine.optimizer.loss_scale = meta["loss_scale"]
    _load_scheduler(engine, meta["lr_scheduler"])
    client = dict(meta["client"])
    engine.global_steps = int(client["iteration"])
    engine.global_samples = int(client["consumed_samples"])
    rng = tag_dir / f"rng_rank{dist.get_rank() % meta['world_size']:05d}.pt"
    if rng.exists():
        set_rng_state(safe_load.load(rng))
    return client
