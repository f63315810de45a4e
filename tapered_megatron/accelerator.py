"""Which accelerator this process runs on, by its product name, and exact name lookups.

DeepSpeed's accelerator object (``deepspeed.accelerator.get_accelerator()``) tells the device
*kind* (``device_name()``: ``cuda``, ``xpu``, ``cpu``, ...) but has no product name. The product
name comes from PyTorch's device module of that kind (``torch.cuda.get_device_name()`` for
``cuda``). Tables keyed by product (peak TFLOP/s, cost-model presets) are matched on whole
alphanumeric tokens of the name, so ``A10`` never matches ``NVIDIA A10G`` and ``L40`` never
matches ``NVIDIA L40S``.
"""

from __future__ import annotations

import platform
import re
from collections.abc import Mapping
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
