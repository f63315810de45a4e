"""The planner held against published measured runs: predict each run of the calibration set
(``calibration_runs.yaml``, shipped beside this module) and score the predictions.

``python -m tapered_megatron.plan --calibrate [--json]`` prints, per run, the predicted and the
published throughput (tokens/s per GPU) and whether the published run fits in the predicted
memory, then one JSON line of scores over the held-out runs (the cost model's constants may be
fitted on the ``fit`` runs only):

* ``heldout_median_err`` / ``heldout_worst_err``: median and largest
  ``|predicted / published - 1|``;
* ``baseline_median_err``: the same median for a constant-MFU prediction (one MFU per device,
  the median published MFU of that device's fitting runs, FLOPs counted as the planner counts
  them);
* ``ranking_agreement``: over every two runs (held out or not) of one model on one source's
  hardware whose published throughputs differ by at least :data:`RANK_MIN_GAP`, the fraction the
  planner orders as measured;
* ``fit_fraction``: the share of all runs predicted to fit in the GPU's memory (they all ran).

A run is the planner's own model: the ``transformer`` architecture, uniform (``taper.schedule:
uniform``), at the run's shape; a GeLU MLP of ``expansion x d_model`` (GPT, MPT) becomes a SwiGLU
MLP of the same parameters and FLOPs (``d_ff = 2/3 x expansion x d_model``, rounded to a multiple
of 128). What the stand-in's counts lack, read from the data file, is the cost model's
:class:`~tapered_megatron.planning.cost.StandIn`: a GeLU MLP's activations, a head tied to the
embedding (``tied``), attention without flash attention (``flash_attention: false``); a run's
``framework`` picks the memory model of its sharding (``fsdp``, ``fsdp2``: PyTorch FSDP,
:class:`~tapered_megatron.planning.cost.Fsdp`; else DeepSpeed's). Biases, learned position
embeddings and ALiBi's bias are not modelled (each under a percent of the parameters or
memory).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, replace
from functools import cache
from itertools import combinations
from pathlib import Path
from typing import Any

import yaml

from tapered_megatron.config import Config
from tapered_megatron.planning import cost as costlib
from tapered_megatron.planning.planner import (
    MICRO_BATCHES,
    Candidate,
    evaluate,
    layout_problem,
    parse_layout,
)

DATA = Path(__file__).with_name("calibration_runs.yaml")
#: Two runs whose published throughputs differ by less than this fraction are a tie (the
#: run-to-run spread of such benchmarks): they count for no ranking pair.
RANK_MIN_GAP = 0.03
#: What ran a row: PyTorch FSDP (llm-foundry), FSDP2 (torchtitan), Megatron-LM or DeepSpeed;
#: the memory model of each FSDP (the others: DeepSpeed's).
FSDP = {"fsdp": costlib.Fsdp(), "fsdp2": costlib.Fsdp(reduce_copy_bytes=4)}
FRAMEWORKS = (*FSDP, "megatron", "deepspeed")


@dataclass(frozen=True)
class Run:
    """One published run of the calibration set (see the data file's header)."""

    id: str
    source: str
    table: str
    model: str
    dims: dict[str, Any]
    device: str
    gpu_mem: float
    seq: int
    gpus: int
    layout: str
    published: float  # tokens/s per GPU
    split: str
    framework: str  # one of FRAMEWORKS
    global_batch: int = 0  # only where the layout leaves the micro-batch open ("mbs? gas?")
    flash_attention: bool = True

    @property
    def stand_in(self) -> costlib.StandIn:
        """How the run's model differs from the planner's transformer at its shape."""
        d = self.dims
        gelu = d["expansion"] if d["mlp"] == "gelu" else 0
        return costlib.StandIn(gelu, d.get("tied", False), self.flash_attention)

    @property
    def sharding(self) -> costlib.Fsdp | None:
        """The memory model of the run's ZeRO-3-style sharding (``None``: DeepSpeed's)."""
        return FSDP.get(self.framework)


@dataclass(frozen=True)
class Prediction:
    """The planner's prediction for one run."""

    run: Run
    pick: Candidate
    flops_per_token: float  # model FLOPs (3 x forward) per token, as the planner counts them

    @property
    def tokens_per_gpu(self) -> float:
        """Predicted tokens/s per GPU."""
        return self.pick.tokens_per_s / self.run.gpus

    @property
    def err(self) -> float:
        """Relative error of the predicted throughput against the published one."""
        return self.tokens_per_gpu / self.run.published - 1.0

    @property
    def fits(self) -> bool:
        """Whether the predicted memory of the run's worst stage fits the GPU it ran on."""
        return self.pick.mem_gib <= self.run.gpu_mem


def narayanan_tokens(tflops_per_gpu: float, dims: dict[str, Any], seq: int) -> float:
    """Tokens/s per GPU behind an achieved TFLOP/s per GPU of Narayanan et al. (SC '21), by that
    paper's count of FLOPs per token with activation recomputation (its equation 3 per token):
    ``96 l h^2 (1 + s / 6h + V / 16 l h)``."""
    layers, h, vocab = dims["layers"], dims["d_model"], dims["vocab"]
    per_token = 96 * layers * h**2 * (1 + seq / (6 * h) + vocab / (16 * layers * h))
    return tflops_per_gpu * 1e12 / per_token


def load_runs(path: Path = DATA) -> list[Run]:
    """The runs of the calibration set, their throughput in tokens/s per GPU."""
    data = yaml.safe_load(path.read_text())
    out = []
    for r in data["runs"]:
        dims = data["models"][r["model"]]
        if "tflops_per_gpu" in r:
            published = narayanan_tokens(r["tflops_per_gpu"], dims, r["seq"])
        else:
            published = float(r["tokens_per_s_per_gpu"])
        if r.get("framework") not in FRAMEWORKS:
            raise ValueError(
                f"calibration run {r['id']}: framework {r.get('framework')!r}; give one of "
                f"{', '.join(FRAMEWORKS)}"
            )
        keys = ("id", "source", "table", "model", "device", "gpu_mem", "seq", "gpus", "layout")
        out.append(
            Run(
                **{k: r[k] for k in keys},
                dims=dims,
                published=published,
                split=r["split"],
                framework=r["framework"],
                global_batch=r.get("global_batch", 0),
                flash_attention=r.get("flash_attention", True),
            )
        )
    return out


def sources(path: Path = DATA) -> dict[str, str]:
    """Where each source's rows come from (paper and table, or repository, commit and file)."""
    return yaml.safe_load(path.read_text())["sources"]


@cache
def _model(dims_items: tuple[tuple[str, Any], ...], seq: int) -> Config:
    dims = dict(dims_items)
    h = dims["d_model"]
    if dims["mlp"] == "gelu":  # two matrices of e*h -> three of 2/3 e*h: same params and FLOPs
        d_ff = round(2 * dims["expansion"] * h / 3 / 128) * 128
    else:
        d_ff = dims["d_ff"]
    values = {
        "model.d_model": h,
        "model.layers": dims["layers"],
        "model.heads": dims["heads"],
        "model.kv_heads": dims.get("kv_heads", dims["heads"]),
        "model.d_ff": d_ff,
        "model.vocab_size": dims["vocab"],
        "model.seq_len": seq,
        "taper.schedule": "uniform",
        "taper.multiple": 128,
    }
    return Config().with_overrides([x for k, v in values.items() for x in (f"--{k}", str(v))])


def model_config(run: Run) -> Config:
    """The planner's config of the run's model (see the module docstring)."""
    return replace(_model(tuple(sorted(run.dims.items())), run.seq), name=run.model)


@dataclass(frozen=True)
class Constants:
    """The cost model's fitted constants: per GPU preset its dense and core efficiency
    (:func:`~tapered_megatron.planning.cost.gpu_efficiency`), and the overlap tax."""

    h100: tuple[float, float]
    a100: tuple[float, float]
    overlap_tax: float
    act_traffic: float
    launch_s: float

    @classmethod
    def current(cls) -> Constants:
        """The constants the presets carry now."""

        def pair(e: dict[str, float]) -> tuple[float, float]:
            return (e["mlp"], e["core"])

        return cls(
            pair(costlib.H100_EFFICIENCY),
            pair(costlib.A100_EFFICIENCY),
            costlib.GPU_OVERLAP_TAX,
            costlib.GPU_ACT_TRAFFIC,
            costlib.GPU_LAUNCH_S,
        )


def device(run: Run, k: Constants | None = None) -> costlib.Device:
    """The device preset of the run, with the memory it ran on (and constants ``k``)."""
    dev = costlib.get_device(run.device, mem_bytes=run.gpu_mem * costlib.GiB)
    if k is None:
        return dev
    eff = costlib.gpu_efficiency(*getattr(k, run.device))
    shared = {"overlap_tax": k.overlap_tax, "act_traffic": k.act_traffic, "launch_s": k.launch_s}
    return replace(dev, efficiency=eff, **shared)


def _layouts(run: Run) -> list[Candidate]:
    """The run's layout; where the source leaves the micro-batch open, each size of the
    planner's :data:`~tapered_megatron.planning.planner.MICRO_BATCHES` that divides the run's
    batch per replica."""
    if "mbs?" not in run.layout:
        return [parse_layout(run.layout)]
    base = parse_layout(run.layout.replace("mbs?", "mbs1").replace("gas?", "gas1"))
    per_replica = run.global_batch // base.dp
    return [
        replace(base, micro_batch_size=b, grad_accum=per_replica // b)
        for b in MICRO_BATCHES
        if per_replica % b == 0
    ]


def predict(run: Run, k: Constants | None = None) -> Prediction:
    """The planner's prediction for ``run`` (for an open micro-batch: the fastest predicted
    layout that fits, else the fastest), with the presets' constants or ``k``."""
    cfg, dev = model_config(run), device(run, k)
    picks = []
    for c in _layouts(run):
        problem = layout_problem(cfg, c, run.gpus, dev.gpus_per_node)
        if problem:
            raise ValueError(f"calibration run {run.id}: {problem}")
        pick = evaluate(cfg, c, dev, float("inf"), zero3=run.sharding, stand_in=run.stand_in)
        picks.append(pick)
    fitting = [p for p in picks if p.mem_gib <= run.gpu_mem] or picks
    pick = min(fitting, key=lambda p: p.step_s)
    flops = pick.mfu * run.gpus * dev.peak_flops / pick.tokens_per_s
    return Prediction(run, pick, flops)


#: The values :func:`fit` tries for each constant.
FIT_GRID = {
    "dense": [x / 100 for x in range(30, 81, 2)],
    "core": [x / 100 for x in range(6, 71, 2)],
    "overlap_tax": [x / 20 for x in range(0, 21)],
    "act_traffic": [x / 4 for x in range(0, 25)],
    "launch_s": [x * 1e-6 for x in (0, 20, 50, 100, 150, 200, 300, 400, 500, 750, 1000, 1500)],
}


def fit_error(runs: list[Run], k: Constants) -> float:
    """Mean absolute log-ratio of predicted to published throughput over ``runs``."""
    return statistics.fmean(abs(math.log(1 + predict(r, k).err)) for r in runs)


def _with_efficiency(k: Constants, gpu: str, i: int, value: float) -> Constants:
    pair = list(getattr(k, gpu))
    pair[i] = value
    return replace(k, **{gpu: tuple(pair)})


def fit(runs: list[Run], rounds: int = 12) -> Constants:
    """The constants that minimise :func:`fit_error` over the ``fit`` runs of ``runs`` only,
    by coordinate descent over :data:`FIT_GRID` from the current constants, until a round
    changes nothing (at most ``rounds``)."""
    train = [r for r in runs if r.split == "fit"]
    k = Constants.current()
    for _ in range(rounds):
        before = k
        for gpu in ("h100", "a100"):
            mine = [r for r in train if r.device == gpu]
            for i, name in enumerate(("dense", "core")):
                tries = [_with_efficiency(k, gpu, i, v) for v in FIT_GRID[name]]
                k = min(tries, key=lambda c, mine=mine: fit_error(mine, c))
        for name in ("overlap_tax", "act_traffic", "launch_s"):
            tries = [replace(k, **{name: v}) for v in FIT_GRID[name]]
            k = min(tries, key=lambda c: fit_error(train, c))
        if k == before:
            break
    return k


def baseline_mfu(preds: list[Prediction]) -> dict[str, float]:
    """Per device, the median published MFU of its fitting runs (FLOPs as the planner counts)."""
    out: dict[str, list[float]] = {}
    for p in preds:
        if p.run.split == "fit":
            peak = costlib.DEVICES[p.run.device].peak_flops
            out.setdefault(p.run.device, []).append(p.run.published * p.flops_per_token / peak)
    return {k: statistics.median(v) for k, v in out.items()}


def ranking_agreement(preds: list[Prediction]) -> float:
    """Share of same-model, same-hardware pairs of runs the planner orders as measured."""
    agree = total = 0
    for a, b in combinations(preds, 2):
        ra, rb = a.run, b.run
        if (ra.model, ra.source, ra.device, ra.gpu_mem) != (
            rb.model,
            rb.source,
            rb.device,
            rb.gpu_mem,
        ):
            continue
        if abs(ra.published / rb.published - 1) < RANK_MIN_GAP:
            continue
        total += 1
        agree += (ra.published > rb.published) == (a.tokens_per_gpu > b.tokens_per_gpu)
    return agree / total if total else 1.0


def scores(preds: list[Prediction]) -> dict[str, Any]:
    """The JSON line's scores (fractions; see the module docstring)."""
    held = [p for p in preds if p.run.split == "heldout"]
    errs = [abs(p.err) for p in held]
    mfu = baseline_mfu(preds)
    base = [
        abs(mfu[p.run.device] * costlib.DEVICES[p.run.device].peak_flops / p.flops_per_token
            / p.run.published - 1)
        for p in held
    ]  # fmt: skip
    return {
        "rows": len(preds),
        "heldout_rows": len(held),
        "heldout_median_err": round(statistics.median(errs), 4),
        "heldout_worst_err": round(max(errs), 4),
        "baseline_median_err": round(statistics.median(base), 4),
        "ranking_agreement": round(ranking_agreement(preds), 4),
        "fit_fraction": round(sum(p.fits for p in preds) / len(preds), 4),
        "sources": len({p.run.source for p in preds}),
    }


def report(preds: list[Prediction]) -> list[str]:
    """One line per run: predicted vs published throughput and the memory check."""
    lines = [
        f"{'run':<30} {'split':<7} {'layout':<46} {'predicted':>9} {'published':>9} "
        f"{'err':>7} {'mem GiB':>13}  (tokens/s per GPU; memory predicted / the GPU's)"
    ]
    for p in preds:
        mem = f"{p.pick.mem_gib:5.1f}/{p.run.gpu_mem:<3g}{'' if p.fits else ' NO'}"
        lines.append(
            f"{p.run.id:<30} {p.run.split:<7} {p.pick.label:<46} {p.tokens_per_gpu:>9,.0f} "
            f"{p.run.published:>9,.0f} {p.err:>+7.1%} {mem:>13}"
        )
    return lines


def main(as_json: bool = False, refit: bool = False) -> int:
    """``--calibrate``: the per-run lines (unless ``as_json``), then the JSON line of scores;
    ``refit``: instead, the constants fitted on the fitting runs (one JSON line)."""
    if refit:
        k = fit(load_runs())
        print(json.dumps(asdict(k)))
        return 0
    preds = [predict(r) for r in load_runs()]
    if not as_json:
        print("\n".join(report(preds)))
    print(json.dumps(scores(preds)))
    return 0
