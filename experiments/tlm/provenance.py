"""What trained a run: the code version (commit, clean or modified tree), the machine and the
versions of Python, torch and DeepSpeed, and the CPU (model, instruction-set flags, the kernels
torch dispatches). The driver records it in each run directory
(``provenance.json``, one entry per distinct environment the run was trained in) and refuses to
mix code versions within one configuration unless told to."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

# The results the driver writes itself: a change there is not a change of the code.
_NOT_CODE = ":(exclude)docs"


def _git(repo: Path, *args: str) -> str | None:
    try:
        p = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return p.stdout


def code_version(repo: Path) -> dict[str, Any]:
    """``{"commit", "clean", "changes"}`` of the checkout at ``repo``.

    ``clean``: no tracked change and no untracked file outside ``docs/`` (where the driver writes
    its results); ``changes``: a digest of the modification when not clean (two modified trees
    of one commit are the same code only when their digests match). ``commit`` is None outside a
    git checkout.
    """
    commit = _git(repo, "rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "clean": None, "changes": None}
    diff = _git(repo, "diff", "HEAD", "--binary", "--", ".", _NOT_CODE) or ""
    untracked = _git(repo, "ls-files", "--others", "--exclude-standard", "--", ".", _NOT_CODE) or ""
    h = hashlib.sha256(diff.encode())
    for name in untracked.splitlines():
        h.update(name.encode() + b"\0" + (repo / name).read_bytes())
    clean = not diff and not untracked.strip()
    return {
        "commit": commit.strip(),
        "clean": clean,
        "changes": None if clean else h.hexdigest()[:16],
    }


def machine() -> str:
    """The machine in a few words: cores, architecture, OS and the accelerator if any."""
    import torch

    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{os.cpu_count()}-core {platform.machine()} {platform.system()}{gpu}"


# The instruction-set extensions that decide which CPU kernels torch and oneDNN run (x86 flags
# and aarch64 features as /proc/cpuinfo names them); the rest of the flags are left out.
ISA_PREFIXES = ("sse4", "avx", "fma", "f16c", "amx", "asimd", "sve", "bf16", "i8mm")


def cpu() -> dict[str, Any]:
    """The CPU: ``model`` (``/proc/cpuinfo``'s model name, else the platform's processor),
    ``isa`` (its SIMD instruction-set flags, sorted) and ``torch_kernels`` (the capability torch
    dispatches its CPU kernels for, e.g. ``AVX512``)."""
    import torch

    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = (info.get("flags") or info.get("Features") or "").split()
    return {
        "model": info.get("model name") or platform.processor() or "unknown",
        "isa": sorted(f for f in set(flags) if f.startswith(ISA_PREFIXES)),
        "torch_kernels": torch.backends.cpu.get_cpu_capability(),
    }


def environment(repo: Path) -> dict[str, Any]:
    """The code version of ``repo``, the machine, its CPU and the package versions runs are
    trained with."""
    return {
        **code_version(repo),
        "machine": machine(),
        "cpu": cpu(),
        "python": platform.python_version(),
        "torch": metadata.version("torch"),
        "deepspeed": metadata.version("deepspeed"),
    }


def cpu_label(entry: dict[str, Any] | None) -> str:
    """The CPU of an environment in words: model, torch's kernel capability and the SIMD flags
    (``CPU not recorded`` for entries made before the CPU was)."""
    c = (entry or {}).get("cpu")
    if not c:
        return "CPU not recorded"
    return f"{c['model']}, torch kernels {c['torch_kernels']} (flags: {' '.join(c['isa'])})"


def code_label(entry: dict[str, Any] | None) -> str:
    """A code version in words: ``<commit 12> (clean)``, ``... (modified <digest>)``, ``not
    recorded`` (None) or ``not a git checkout``."""
    if entry is None:
        return "not recorded"
    if entry["commit"] is None:
        return "not a git checkout"
    state = "clean" if entry["clean"] else f"modified {entry['changes']}"
    return f"{entry['commit'][:12]} ({state})"


def versions_label(entry: dict[str, Any] | None) -> str:
    """Machine and package versions in words (``not recorded`` for None)."""
    if entry is None:
        return "not recorded"
    return (
        f"{entry['machine']}; python {entry['python']}, torch {entry['torch']}, "
        f"deepspeed {entry['deepspeed']}"
    )


def read(run_dir: Path) -> list[dict[str, Any]]:
    """The environments recorded for a run directory (empty when none is)."""
    f = run_dir / "provenance.json"
    return json.loads(f.read_text()) if f.exists() else []


def record(run_dir: Path, env: dict[str, Any]) -> None:
    """Add ``env`` to the run directory's record unless it is there already."""
    seen = read(run_dir)
    if env not in seen:
        (run_dir / "provenance.json").write_text(json.dumps([*seen, env], indent=1) + "\n")
