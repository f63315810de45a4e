"""Per-unit times measured on this device, cached on disk; and this CPU's matmul peak.

:func:`profile_units` builds every entry of the unit table ``units(cfg, unit)`` once (TP = 1, one
process), runs forward + backward of one micro-batch through it (the head with its fused loss),
keeps the median of a few repetitions after two warm-up calls, and counts the bytes autograd
saves for backward (the unit's real activation memory). On the CPU the clock is the thread's CPU
time (``time.thread_time``): on a shared machine wall time measures the neighbours. Results are
cached as JSON under ``$TM_PROFILE_CACHE`` (default ``~/.cache/tapered_megatron/profiles``),
keyed by a hash of the model config, the taper widths, the unit kind, the micro-batch size,
checkpointing, the device name, the torch version and the thread count, so a profile is reused
only where it is valid.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tapered_megatron.config import Config


def cache_dir() -> Path:
    """Where profiles are cached."""
    root = os.environ.get("TM_PROFILE_CACHE", "~/.cache/tapered_megatron/profiles")
    return Path(root).expanduser()


def device_label() -> str:
    """Name of the device the profile was taken on (kind and product, e.g. ``cuda:NVIDIA H200``)."""
    from tapered_megatron.accelerator import device_kind, product_name

    if device_kind() == "cpu":
        return f"cpu:{platform.machine()}:{platform.processor() or 'unknown'}"
    return f"{device_kind()}:{product_name()}"


def _key(payload: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def _cached(payload: dict[str, Any], compute: Any) -> Any:
    path = cache_dir() / f"{_key(payload)}.json"
    if path.exists():
        return json.loads(path.read_text())["value"]
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": payload, "value": value}))
    tmp.replace(path)
    return value


def measure_cpu_peak(n: int = 512, reps: int = 10) -> float:
    """Achieved fp32 matmul FLOP/s of one thread (``n x n`` squared, thread CPU time), cached."""
    from tapered_megatron.accelerator import matmul_peak

    payload = {
        "what": "cpu_peak",
        "device": device_label(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "n": n,
    }

    def run() -> float:
        cpu = torch.device("cpu")
        clocks = (time.thread_time,)
        return matmul_peak([(n, n, n)], device=cpu, reps=reps, warmup=3, clocks=clocks)[0]

    return float(_cached(payload, run))


def _time_once(module: torch.nn.Module, make_input: Any, loss: Any) -> float:
    """One forward + backward. On the CPU the clock is the thread's CPU time (torch runs
    single-threaded ops in the calling thread), elsewhere wall time between synchronisations."""
    from tapered_megatron.accelerator import on_cpu, synchronize

    clock = time.thread_time if on_cpu() else time.perf_counter
    x = make_input()
    synchronize()
    t0 = clock()
    loss(module(x)).backward()
    synchronize()
    dt = clock() - t0
    module.zero_grad(set_to_none=True)
    return dt


def saved_bytes(module: torch.nn.Module, x: torch.Tensor, loss: Any) -> float:
    """Bytes autograd keeps for backward in one forward (unique storages, parameters and the
    input excluded): the activation memory of one micro-batch."""
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()}
    skip.add(x.untyped_storage().data_ptr())
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss(module(x))
    return float(sum(seen.values()))


class _Loss(torch.nn.Module):
    """``ids -> model(ids, labels)``: the fused training loss as one module."""

    def __init__(self, model: torch.nn.Module, labels: torch.Tensor) -> None:
        super().__init__()
        self.model, self.labels = model, labels

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, self.labels)


def model_saved_bytes(cfg: Config, micro_batch_size: int, seed: int = 0) -> float:
    """Bytes autograd keeps on this rank in one training forward of the whole model built from
    ``cfg`` under the current TP group (the fused loss of ``micro_batch_size`` random
    sequences, :func:`saved_bytes`): what the cost model predicts as one micro-batch's
    activations."""
    from tapered_megatron.models import build_model

    g = torch.Generator().manual_seed(seed)
    shape = (micro_batch_size, cfg.model.seq_len + 1)
    ids = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    module = _Loss(build_model(cfg).train(), ids[:, 1:])
    return saved_bytes(module, ids[:, :-1], lambda loss: loss)


def measure_units(
    cfg: Config, unit: str, micro_batch_size: int, recompute: str, reps: int = 7
) -> dict[str, list[float]]:
    """Per entry of the unit table, for one micro-batch: forward + backward seconds (``time``)
    and the activation bytes per token autograd keeps (``act_bytes``). Not cached.

    Units run on this rank's accelerator device; off the CPU under bf16 autocast (the
    precision the cost model's GPU presets assume)."""
    from tapered_megatron.accelerator import current_device
    from tapered_megatron.models import lm_loss, set_recompute, units

    torch.manual_seed(0)
    dev = current_device()
    b, s, d = micro_batch_size, cfg.model.seq_len, cfg.model.d_model
    ids = torch.randint(0, cfg.model.vocab_size, (b, s)).to(dev)

    def square_mean(y: torch.Tensor) -> torch.Tensor:
        return y.float().square().mean()

    def hidden() -> torch.Tensor:
        return torch.randn(b, s, d, device=dev, requires_grad=True)

    runs = []
    for u in units(cfg, unit):
        module = set_recompute(u.build(), recompute).train().to(dev)
        if u.kind == "embedding":
            runs.append((module, lambda: ids, square_mean))
        elif u.kind == "head":
            runs.append((module, hidden, lambda y: lm_loss(y, ids)))
        else:
            runs.append((module, hidden, square_mean))
    # Repetitions in the outer loop: a burst of background load hits every unit alike, so the
    # relative costs (what the balancer needs) stay right even on a shared machine.
    times: list[list[float]] = [[] for _ in runs]
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type != "cpu"):
        for rep in range(reps + 2):
            for i, (module, make, loss) in enumerate(runs):
                dt = _time_once(module, make, loss)
                if rep >= 2:  # two warm-up rounds
                    times[i].append(dt)
        act = [saved_bytes(m, make(), loss) / (b * s) for m, make, loss in runs]
    return {"time": [statistics.median(t) for t in times], "act_bytes": act}


def profile_units(
    cfg: Config, unit: str, micro_batch_size: int, recompute: str
) -> dict[str, list[float]]:
    """Cached :func:`measure_units` (see the module docstring for the cache key)."""
    cfg1 = cfg.with_overrides(
        ["--parallel.tp", "1", "--parallel.pp", "1", "--parallel.sequence_parallel", "false"]
    )
    payload = {
        "what": "units-v4",
        "model": cfg1.to_dict()["model"],
        "widths": list(cfg1.taper_plan.widths),
        "unit": unit,
        "micro_batch_size": micro_batch_size,
        "recompute": recompute,
        "device": device_label(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    return _cached(payload, lambda: measure_units(cfg1, unit, micro_batch_size, recompute))
