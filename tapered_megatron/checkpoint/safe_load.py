"""Loading ``.pt`` files received from elsewhere (checkpoints, exports) without running code.

Every file the project reads from a checkpoint is loaded with ``torch.load(weights_only=True)``:
tensors and plain types (lists, tuples, dicts, numbers, strings) only, plus the exact classes of
:data:`ALLOWED` that DeepSpeed's own files hold. A pickle naming anything else (a function to
call, another class) is refused before any of it runs. DeepSpeed's engine loads its files with
its own ``torch.load``, so :func:`verify_tag` loads every file of a checkpoint this way first.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from tapered_megatron.config_fields import first_line

# The classes DeepSpeed's optimizer files hold beyond tensors and plain types (ZeRO-1/2/3 and
# the bf16 optimizer: the stage, the loss scaler, the fragment map of each parameter; fp16's
# dynamic loss scaler). Its model-states files hold plain types only.
ALLOWED: list[Any] = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
# numpy arrays (RNG files written before they held numpy's state as ints): the array's own
# reconstructor and its dtype; an object array's items still go through the same restricted
# unpickler, so nothing else becomes loadable.
ALLOWED += [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


class UnsafeFileError(ValueError):
    """A received file that is unreadable or would need more than plain data to load (one line,
    naming the file)."""


def load(path: str | Path, mmap: bool = False) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)`` with :data:`ALLOWED`;
    ``mmap`` maps the tensors instead of reading them. Raises :class:`UnsafeFileError`."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise UnsafeFileError(
            f"{path}: not a torch.save zip archive (truncated, overwritten or a raw pickle); "
            "refused"
        )
    try:
        with torch.serialization.safe_globals(ALLOWED):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        named = _GLOBAL.search(str(e))
        what = f"names {named.group(1)}" if named else "holds more than tensors and plain data"
        raise UnsafeFileError(
            f"{path}: refused, its pickle {what} (code or a class this project does not load "
            "from received files)"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise UnsafeFileError(f"{path}: unreadable ({first_line(e)})") from None


def verify_tag(tag_dir: Path) -> None:
    """Load every ``.pt`` file under ``tag_dir`` as :func:`load` does (tensors memory-mapped,
    not read); raise :class:`UnsafeFileError` naming the first that fails."""
    for f in sorted(tag_dir.rglob("*.pt")):
        load(f, mmap=True)
