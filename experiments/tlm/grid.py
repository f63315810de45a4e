"""The paper's experiments as a grid of runs: model variants, experiments, scales and seeds.

Every run is one configuration x one seed; a configuration shared by several experiments (the
uniform Transformer, cosine 1.5/0.5) is trained once (:func:`plan_runs`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tapered_megatron.architectures import ARCHITECTURES, BUILT_IN

ARCHS = BUILT_IN  # the paper's architectures, in its order


EXPERIMENTS = ("controlled", "sweep", "archs", "alignment", "scale", "corpus")


# Each experiment's letter in RESULTS.md.
TAGS = {
    "controlled": "(a)",
    "sweep": "(b)",
    "archs": "(c)",
    "alignment": "(e)",
    "scale": "(g)",
    "corpus": "(h)",
}


# The experiments whose seed count is ``--headline-seeds``: (c) and the (g) second scale.
HEADLINE = ("archs", "scale")


# (g): the architectures trained at both sizes (the Transformer and one memory architecture).
# Hope-attention is the memory architecture: its parameters equal the transformer's at both sizes
# without an override, a d_model-256 run takes ~28 min on one core here (Titans ~97 min, and its
# stability at that shape is unmeasured), and its memory is shown to be used at the first size.
SCALE_ARCHS = ("transformer", "hope_attention")


# The name of the (g) second size (its overrides: ``Scale.second_size``).
SECOND = "d256"


# The (h) second corpus (experiments.tlm.corpus): its name in run names.
SECOND_CORPUS = "pydocs"


SWEEP_SCHEDULES = ("cosine", "linear", "sigmoid")


SWEEP_RATIOS = ((1.25, 0.75), (1.375, 0.625), (1.5, 0.5), (1.625, 0.375), (1.75, 0.25))


# The controlled experiment's thirds: 1.5 x the base width in one third, 0.75 in the other two.
STEP_THIRDS = {
    "wider-early": (1.5, 0.75, 0.75),
    "wider-middle": (0.75, 1.5, 0.75),
    "wider-late": (0.75, 0.75, 1.5),
}


DEFAULT_TAPER = ("cosine", (1.5, 0.5))


@dataclass(frozen=True)
class Variant:
    """One model configuration (without the seed)."""

    arch: str = "transformer"
    schedule: str = "uniform"
    ratio: tuple[float, ...] = ()
    reverse: bool = False
    size: str = ""  # "": the scale's own size; SECOND: the (g) second size
    corpus: str = ""  # "": the scale's corpus; SECOND_CORPUS: the (h) second corpus

    @property
    def key(self) -> str:
        """Stable, file-name-safe identifier, e.g. ``transformer-cosine-1.5-0.5-rev``
        (``...-d256`` at the second size, ``...-pydocs`` on the second corpus)."""
        parts = [self.arch, self.schedule, *(f"{r:g}" for r in self.ratio)]
        if self.reverse:
            parts.append("rev")
        return "-".join([*parts, *(x for x in (self.size, self.corpus) if x)])

    @property
    def label(self) -> str:
        """Human-readable label for tables, e.g. ``cosine 1.5/0.5 (reverse)``."""
        if self.schedule == "uniform":
            return "uniform"
        if self.schedule == "step":
            for name, mult in STEP_THIRDS.items():
                if mult == self.ratio:
                    return f"{name} [{'/'.join(f'{r:g}' for r in mult)}]"
        text = f"{self.schedule} {'/'.join(f'{r:g}' for r in self.ratio)}"
        return text + (" (reverse)" if self.reverse else "")

    def overrides(self) -> list[str]:
        """Config overrides that select this variant."""
        out = ["--model.arch", self.arch, "--taper.schedule", self.schedule]
        if self.schedule == "step":
            out += ["--taper.step_multipliers", *(f"{r:g}" for r in self.ratio)]
        elif self.schedule != "uniform":
            out += ["--taper.ratio", *(f"{r:g}" for r in self.ratio)]
        if self.reverse:
            out += ["--taper.reverse", "true"]
        return out


UNIFORM = Variant()


def arch_variants(arch: str) -> tuple[Variant, Variant, Variant]:
    """Experiment (c)'s three configurations of ``arch``: uniform, the default taper, reversed."""
    sched, ratio = DEFAULT_TAPER
    return Variant(arch), Variant(arch, sched, ratio), Variant(arch, sched, ratio, True)


def experiment_variants(name: str) -> list[Variant]:
    """The configurations one experiment compares (its first entry is the uniform baseline)."""
    if name == "controlled":
        return [UNIFORM, *(Variant("transformer", "step", m) for m in STEP_THIRDS.values())]
    if name == "sweep":
        return [UNIFORM] + [
            Variant("transformer", s, r) for r in SWEEP_RATIOS for s in SWEEP_SCHEDULES
        ]
    if name == "archs":
        return [v for a in ARCHS for v in arch_variants(a)]
    if name == "alignment":
        sched, ratio = DEFAULT_TAPER
        return [UNIFORM, Variant("transformer", sched, ratio)]
    if name == "scale":
        return [v for size in ("", SECOND) for v in scale_variants(size)]
    if name == "corpus":
        sched, ratio = DEFAULT_TAPER
        return [
            Variant(corpus=SECOND_CORPUS),
            Variant("transformer", sched, ratio, corpus=SECOND_CORPUS),
            Variant("transformer", sched, ratio, True, corpus=SECOND_CORPUS),
        ]
    raise ValueError(f"unknown experiment {name!r}; choose from {', '.join(EXPERIMENTS)}")


def scale_variants(size: str = "") -> list[Variant]:
    """{uniform, cosine 1.5/0.5, reverse} of each (g) architecture at ``size``."""
    sched, ratio = DEFAULT_TAPER
    return [
        Variant(a, *spec, size=size)
        for a in SCALE_ARCHS
        for spec in (("uniform", ()), (sched, ratio), (sched, ratio, True))
    ]


@dataclass(frozen=True)
class Scale:
    """How big the runs are: a preset per architecture plus overrides, and evaluation sizes."""

    name: str
    presets: dict[str, str]
    overrides: tuple[str, ...] = ()
    alignment_tokens: int = 16384
    gpu: bool = False  # needs an accelerator (the plan is printed instead where none is)
    second_size: tuple[str, ...] = ()  # overrides of the (g) second size; (): no (g) here
    second_corpus: bool = False  # whether (h) runs (the second corpus is small: cpu scale only)

    def experiments(self) -> tuple[str, ...]:
        """The experiments this scale can run ((g) needs a second size, (h) the second
        corpus)."""
        return tuple(
            e
            for e in EXPERIMENTS
            if (e != "scale" or self.second_size) and (e != "corpus" or self.second_corpus)
        )


def _preset_scale(name: str, tag: str) -> Scale:
    return Scale(name, {a: f"{a}_{tag}" for a in ARCHS}, (), 262144, True)


# The (g) second size of the cpu scale: about 4x the parameters and tokens of tlm_cpu (d_model
# 256, 8 layers, the same head width; 1280 x 1024 = 1.3M tokens), the schedule scaled with it.
CPU_SECOND_SIZE = (
    "--model.d_model",
    "256",
    "--model.layers",
    "8",
    "--model.heads",
    "8",
    "--model.d_ff",
    "768",
    "--train.iters",
    "1280",
    "--train.warmup_iters",
    "120",
    "--train.save_interval",
    "320",
    "--eval.interval",
    "160",
    "--logging.interval",
    "160",
)


SCALES = {
    # tlm_cpu.yaml: a ~1.3M-parameter model (d_model 128, 6 layers, vocab 2048), 320 x 1024 tokens;
    # <arch>_cpu (scales/cpu.yaml): the same recipe, each architecture's settings from its record
    # (budget-matched d_ff; titans: 512-token sequences, a 64-token window, persistent tokens;
    # hope: the teach-signal update)
    "cpu": Scale(
        "cpu",
        {a: f"{a}_cpu" for a in ARCHS},
        alignment_tokens=16384,
        second_size=CPU_SECOND_SIZE,
        second_corpus=True,
    ),
    "440m": _preset_scale("440m", "440m"),
    "760m": _preset_scale("760m", "760m"),
    "1.3b": _preset_scale("1.3b", "1.3b"),
}


SMOKE_OVERRIDES = (
    "--model.d_model",
    "32",
    "--model.layers",
    "3",
    "--model.heads",
    "2",
    "--model.d_ff",
    "96",
    "--model.seq_len",
    "64",
    "--train.iters",
    "4",
    "--train.micro_batch_size",
    "2",
    "--train.warmup_iters",
    "1",
    "--eval.interval",
    "2",
    "--eval.iters",
    "2",
    "--logging.interval",
    "2",
)


# The second size under --smoke: a little larger than the smoke shapes, as quick.
SMOKE_SECOND_SIZE = (
    "--model.d_model",
    "48",
    "--model.layers",
    "4",
    "--model.heads",
    "2",
    "--model.d_ff",
    "144",
)


def shape_overrides(v: Variant, scale: Scale, smoke: bool) -> tuple[str, ...]:
    """The overrides of ``v``'s shape: the smoke ones under ``smoke``, then its size's, each
    replacing any key an earlier one gives (a key may be given only once)."""
    pairs = dict(zip(SMOKE_OVERRIDES[::2], SMOKE_OVERRIDES[1::2])) if smoke else {}
    if v.size:
        size = SMOKE_SECOND_SIZE if smoke else scale.second_size
        pairs.update(zip(size[::2], size[1::2]))
    return tuple(x for kv in pairs.items() for x in kv)


@dataclass(frozen=True)
class Run:
    """One training job: a variant and a seed."""

    variant: Variant
    seed: int

    @property
    def name(self) -> str:
        """Directory name under ``<out>/runs``."""
        return f"{self.variant.key}-s{self.seed}"


def plan_runs(experiments: Iterable[str], seeds: int, headline_seeds: int = 0) -> list[Run]:
    """Deduplicated runs of ``experiments``, seed-major (all of seed 1 first) for early tables.

    A configuration gets ``seeds`` seeds, or ``headline_seeds`` (default: ``seeds``) when a
    :data:`HEADLINE` experiment includes it; a configuration shared by several takes the most.
    """
    count: dict[Variant, int] = {}
    for e in experiments:
        n = (headline_seeds or seeds) if e in HEADLINE else seeds
        for v in experiment_variants(e):
            count[v] = max(count.get(v, 0), n)
    top = max(count.values(), default=0)
    return [Run(v, s) for s in range(1, top + 1) for v, n in count.items() if s <= n]


# in-context memory (the record's in_context): the memory probe's runs
MEMORY_ARCHS = tuple(a for a in ARCHS if ARCHITECTURES[a].in_context)


def evaluation_phases(experiments: Iterable[str]) -> dict[str, list[Variant]]:
    """Which variants each evaluation phase covers: (e) alignment, (f) zero-shot of (c), the
    memory probe of (c)'s memory architectures."""
    phases: dict[str, list[Variant]] = {}
    if "alignment" in experiments:
        phases["alignment"] = experiment_variants("alignment")
    if "archs" in experiments:
        phases["zeroshot"] = experiment_variants("archs")
        phases["memory_probe"] = [v for v in experiment_variants("archs") if v.arch in MEMORY_ARCHS]
    return phases
