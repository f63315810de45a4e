"""Hand-written autograd functions under ``torch.autocast``.

Autocast does not reach inside ``torch.autograd.Function``: its forward would see the autocast
dtype for some products and fp32 parameters elsewhere, and its backward runs with autocast off.
Callers therefore cast the operands themselves and apply the function with autocast disabled,
so forward and backward agree on one dtype; autograd casts the gradients back to each
parameter's own dtype.
"""

from __future__ import annotations

import torch


def autocast_operands(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` cast to the active autocast dtype of their device (unchanged when off)."""
    dtype = autocast_dtype(tensors[0])
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) for t in tensors)


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The active autocast dtype of ``x``'s device type, or None when autocast is off there."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def autocast_off(device: torch.device) -> torch.autocast:
    """A context with autocast disabled on ``device``'s type."""
    return torch.autocast(device.type, enabled=False)
