"""Overrides for one architecture out of a list written for all of them.

A config carries only its own architecture's section (``model.titans`` only when ``model.arch`` is
``titans``), so tests that loop over architectures keep one override list and pass
``for_arch(arch, overrides)``.
"""

from tapered_megatron.models import ARCHITECTURES


def for_arch(arch: str, overrides: list[str]) -> list[str]:
    """``--model.arch arch`` plus ``overrides`` without the other architectures' sections."""
    own = ARCHITECTURES[arch].options_key
    foreign = {
        f"--model.{rec.options_key}."
        for rec in ARCHITECTURES.values()
        if rec.options_key and rec.options_key != own
    }
    out, skipping = ["--model.arch", arch], False
    for tok in overrides:
        if tok.startswith("--"):
            skipping = any(tok.startswith(p) for p in foreign)
        if not skipping:
            out.append(tok)
    return out
