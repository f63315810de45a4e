"""Which accelerator this process runs on, by its product name, and exact name lookups.

DeepSpeed's accelerator object (``deepspeed.accelerator.get_accelerator()``) tells the device
*kind* (``device_name()``: ``cuda``, ``xpu``, ``cpu``, ...) but has no product name. The product
name comes from PyTorch's device module of that kind (``torch.cuda.get_device_name()`` for
``cuda``). Tables keyed by product (peak TFLOP/s, cost-model presets) are matched on whole
alphanumeric tokens of the name, so ``A10`` never matches ``NVIDIA A10G`` and ``L40`` never
matches ``NVIDIA L40S``. :func:`matmul_peak` is the one matmul-rate probe (the logger's MFU peak
on an unknown device, the cost model's CPU peak, the benchmarks' peaks).
"""

from __future__ import annotations

import platform
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

import torch
from deepspeed.accelerator import get_accelerator

T = TypeVar("T")


def device_kind() -> str:
    """DeepSpeed's accelerator kind: ``cuda``, ``xpu``, ``cpu``, ..."""
    return get_accelerator().device_name()


def on_cpu() -> bool:
    """Whether DeepSpeed's accelerator is the CPU."""
    return device_kind() == "cpu"


def product_name() -> str:
    """The accelerator's product name (e.g. ``NVIDIA H200``), or the CPU's on a CPU."""
    kind = device_kind()
    if kind == "cpu":
        return platform.processor() or platform.machine()
    module = torch.get_device_module(kind)
    return str(module.get_device_name()) if hasattr(module, "get_device_name") else kind


def name_tokens(name: str) -> list[str]:
    """Upper-case alphanumeric tokens of a product name (``NVIDIA A100-SXM4-80GB`` ->
    ``["NVIDIA", "A100", "SXM4", "80GB"]``)."""
    return re.findall(r"[A-Z0-9]+", name.upper())


def lookup(name: str, table: Mapping[str, T]) -> T | None:
    """The entry of ``table`` whose key equals a whole token of ``name`` (case-insensitive),
    ``None`` when no key does. Keys are single tokens such as ``H100`` or ``A10G``."""
    tokens = set(name_tokens(name))
    for key, value in table.items():
        if key.upper() in tokens:
            return value
    return None


def current_device() -> torch.device:
    """This rank's device (``cuda:0``, ``cpu``, ...)."""
    return torch.device(get_accelerator().current_device_name())


def synchronize() -> None:
    """Wait for the accelerator's queued work (nothing to wait for on the CPU)."""
    if not on_cpu():
        get_accelerator().synchronize()


def matmul_peak(
    shapes: Iterable[tuple[int, int, int]],
    *,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    reps: int = 1,
    warmup: int = 1,
    seconds: float = 0.0,
    clocks: Sequence[Callable[[], float]] = (time.perf_counter,),
) -> list[float]:
    """Best matmul FLOP/s on ``device`` (default this rank's), one figure per clock of ``clocks``.

    For each ``(m, k, n)`` of ``shapes`` (an ``m x k`` by ``k x n`` product of random ``dtype``
    operands; default fp32 on a CPU, bf16 on an accelerator): ``warmup`` untimed products, then
    ``reps`` timings between synchronisations. A timing runs one product, or back-to-back
    products until ``seconds`` have passed on the first clock; its rate is the products' FLOPs
    over the time each clock advanced. Returns each clock's best rate over shapes and timings.
    Operands come from a private generator, so the global RNG stream is left untouched.
    """
    device = current_device() if device is None else device
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    sync = get_accelerator().synchronize if device.type != "cpu" else lambda: None
    g = torch.Generator().manual_seed(0)
    best = [0.0] * len(clocks)
    for m, k, n in shapes:
        a = torch.randn(m, k, generator=g).to(device, dtype)
        b = torch.randn(k, n, generator=g).to(device, dtype)
        for _ in range(warmup):
            torch.mm(a, b)
        for _ in range(reps):
            sync()
            start = [clock() for clock in clocks]
            products = 0
            while True:
                torch.mm(a, b)
                products += 1
                if clocks[0]() - start[0] >= seconds:
                    break
            sync()
            flop = 2.0 * m * k * n * products
            for i, clock in enumerate(clocks):
                best[i] = max(best[i], flop / max(clock() - start[i], 1e-9))
    return best
