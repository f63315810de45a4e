"""The planner held against published measured runs (``python -m tapered_megatron.plan
--calibrate``): the calibration set's provenance and the scores the cost model must reach."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from tapered_megatron.plan import main
from tapered_megatron.planning import calibration as cal
from tapered_megatron.planning import cost as costlib
from tapered_megatron.planning.planner import evaluate

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.fixture(scope="module")
def preds() -> list[cal.Prediction]:
    """The planner's prediction of every run of the calibration set."""
    return [cal.predict(r) for r in cal.load_runs()]


def documented_misses() -> set[str]:
    """The runs docs/balancer.md lists, with their reasons, as the calibration's misses."""
    text = (DOCS / "balancer.md").read_text()
    section = text.split("### Runs the calibration misses", 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"^\| `([^`]+)`", section, re.M))


def test_calibration_set_is_published_runs_with_their_sources() -> None:
    """At least 40 runs from at least 3 sources, every source cited, FSDP/ZeRO-3 and Megatron
    TP+PP, A100 and H100, sequences 2k-32k, with and without recompute, a declared split."""
    runs, sources = cal.load_runs(), cal.sources()
    assert len(runs) >= 40 and len({r.id for r in runs}) == len(runs)
    assert {r.source for r in runs} == set(sources) and len(sources) >= 3
    assert all(len(text) > 40 for text in sources.values())
    layouts = [cal.parse_layout(r.layout.replace("?", "1")) for r in runs]
    assert any(c.zero == 3 for c in layouts) and any(c.tp > 1 and c.pp > 1 for c in layouts)
    assert {r.device for r in runs} == {"a100", "h100"}
    assert min(r.seq for r in runs) == 2048 and max(r.seq for r in runs) == 32768
    assert {c.recompute for c in layouts} == {"none", "full"}
    assert {r.split for r in runs} == {"fit", "heldout"}
    assert all(r.split == ("fit" if i % 3 == 0 else "heldout") for i, r in _by_source(runs))
    # what ran each row: Megatron-LM 2021 without flash attention, FSDP for the other two
    ran = {r.source: (r.framework, r.flash_attention) for r in runs}
    assert len(ran) == len(sources) and ran["narayanan-sc21"] == ("megatron", False)
    assert ran["llm-foundry"] == ("fsdp", True) and ran["torchtitan"] == ("fsdp2", True)
    assert all(r.stand_in.tied_head == r.model.startswith(("gpt", "mpt")) for r in runs)


def _by_source(runs: list[cal.Run]) -> list[tuple[int, cal.Run]]:
    """(index within its source, run) in file order: the split rule's index."""
    seen: dict[str, int] = {}
    out = []
    for r in runs:
        out.append((seen.get(r.source, 0), r))
        seen[r.source] = seen.get(r.source, 0) + 1
    return out


def test_narayanan_flops_convert_to_tokens() -> None:
    """Table 1's 1T row: its tokens/s per GPU times the paper's equation (3) per token is the
    published 163 TFLOP/s per GPU."""
    dims = {"layers": 128, "d_model": 25600, "vocab": 51200}
    tokens = cal.narayanan_tokens(163, dims, 2048)
    per_token = 96 * 128 * 25600**2 * (1 + 2048 / (6 * 25600) + 51200 / (16 * 128 * 25600))
    assert tokens * per_token == pytest.approx(163e12)


def test_calibration_meets_its_targets(preds) -> None:
    """Held out: median error <= 10 % (now 2.5 %), clearly better than a constant MFU per
    device; pairs ordered as measured >= 80 % (now 92 %); every published run predicted to
    fit. Every run off by more than 25 % (at most a tenth of the runs) is one docs/balancer.md
    lists with its reason (and no other): without them the worst held-out error is <= 25 %."""
    s = cal.scores(preds)
    assert s["rows"] == len(preds) and s["heldout_rows"] == sum(
        p.run.split == "heldout" for p in preds
    )
    assert s["heldout_median_err"] <= 0.03
    assert s["heldout_median_err"] <= 0.3 * s["baseline_median_err"]
    assert s["heldout_worst_err"] <= 0.345
    assert s["ranking_agreement"] >= 0.9
    assert s["fit_fraction"] == 1.0
    missed = {p.run.id for p in preds if abs(p.err) > 0.25 or not p.fits}
    assert missed == documented_misses()
    assert sum(abs(p.err) > 0.25 for p in preds) <= 0.1 * len(preds)
    kept = [p for p in preds if p.run.id not in missed]
    assert all(p.fits for p in kept)
    assert max(abs(p.err) for p in kept if p.run.split == "heldout") <= 0.25
    assert s["heldout_worst_err"] == round(
        max(abs(p.err) for p in preds if p.run.split == "heldout"), 4
    )


def test_calibrate_prints_each_run_then_the_scores(capsys) -> None:
    """``--calibrate``: a line per run, predicted beside published, then the JSON line."""
    assert main(["--calibrate"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    s = json.loads(lines[-1])
    keys = ("rows", "heldout_rows", "heldout_median_err", "heldout_worst_err",
            "baseline_median_err", "ranking_agreement")  # fmt: skip
    assert set(keys) <= set(s) and s["rows"] == len(lines) - 2
    assert "predicted" in lines[0] and "published" in lines[0]
    run = cal.load_runs()[0]
    line = next(x for x in lines if x.startswith(run.id + " "))
    assert f"{run.published:,.0f}" in line


@pytest.mark.slow
def test_fit_on_the_fitting_runs_returns_the_presets_constants() -> None:
    """The GPU presets' constants are what ``--calibrate --fit`` finds on the fitting runs (a
    fixed point of its coordinate descent), so they were fitted on those runs only (~3 min)."""
    assert cal.fit(cal.load_runs()) == cal.Constants.current()


def _run(run_id: str) -> cal.Run:
    return next(r for r in cal.load_runs() if r.id == run_id)


def test_fsdp_rows_are_costed_with_fsdps_memory() -> None:
    """A run's ``framework`` picks its memory model: MPT-13B on 8 A100 40GB (FSDP) is costed
    with FSDP's 16 bytes of model state per parameter over dp (DeepSpeed ZeRO-3's 18: at least
    2 / dp bytes per parameter more) and the root and two blocks gathered; FSDP2 (torchtitan)
    adds its fp32 copy of a block's gradients for the reduce-scatter."""
    run = _run("llmf-a100-40-13b-s8192-g8")
    shape = costlib.RunShape(
        seq_len=run.seq, dp=8, zero_stage=3, pipeline=False, zero3=costlib.Fsdp()
    )
    costs = costlib.unit_costs(cal.model_config(run), shape, cal.device(run))
    fsdp, ds = cal.predict(run), cal.predict(replace(run, framework="deepspeed"))
    assert fsdp.fits
    params = sum(c.params for c in costs)
    assert ds.pick.mem_gib - fsdp.pick.mem_gib >= 2 * params / 8 / costlib.GiB
    ds_costs = costlib.unit_costs(cal.model_config(run), replace(shape, zero3=costlib.Zero3()),
                                  cal.device(run))  # fmt: skip
    layer, ds_layer = costs[1], ds_costs[1]
    assert ds_layer.static - layer.static == pytest.approx(layer.local_params * (18 - 16) / 8)
    root = costs[0].local_params + costs[-1].local_params
    assert costlib.fsdp_stage_bytes(costs, shape) == 2 * (root + 2 * layer.local_params)
    fsdp2 = replace(shape, zero3=cal.FSDP["fsdp2"])  # its fp32 reduce-scatter input
    extra = costlib.fsdp_stage_bytes(costs, fsdp2) - costlib.fsdp_stage_bytes(costs, shape)
    assert extra == 4 * layer.local_params


def test_stand_in_costs_the_runs_own_model() -> None:
    """MPT-7B: its GeLU MLP of 4 d saves (1 + 8) d activations per token and layer where the
    SwiGLU stand-in's saves d + 4 d_ff; its head is the embedding (no weights of its own but the
    final norm's, outside a pipeline). GPT of SC '21: the materialised scores, 5 heads x seq
    bytes per token and layer (Korthikanti et al.)."""
    run = _run("llmf-h100-7b-s2048-g8")
    cfg, dev, d = cal.model_config(run), cal.device(run), run.dims["d_model"]
    plain = costlib.RunShape(seq_len=run.seq, recompute="none", pipeline=False)
    own = replace(plain, stand_in=run.stand_in)
    (p_layer, o_layer), (p_head, o_head) = (
        [next(c for c in costlib.unit_costs(cfg, s, dev) if c.kind == k) for s in (plain, own)]
        for k in ("layer", "head")
    )
    d_ff = cfg.model.d_ff
    assert o_layer.act - p_layer.act == 2 * ((1 + 8) * d - (d + 4 * d_ff)) * run.seq
    assert (p_head.local_params, o_head.local_params) == (cfg.padded_vocab_size * d + d, d)
    piped = costlib.unit_costs(cfg, replace(own, pipeline=True), dev)
    assert piped[-1].local_params == p_head.local_params
    gpt = _run("sc21-t1-1.7b")
    heads = gpt.dims["heads"]
    assert costlib.materialised_scores_bytes(cal.model_config(gpt), 2) == 5 * heads * gpt.seq


def test_a100_40gb_runs_are_costed_at_hbm2_bandwidth() -> None:
    """An A100 of 40 GB moves 1,555 GB/s (HBM2), the 80 GB preset 2,000: the memory-bound part of
    every pass is slower, so MPT-13B on 8 A100 40GB is predicted at least 1 % slower than the
    same run at the 80 GB part's bandwidth."""
    run = _run("llmf-a100-40-13b-s8192-g8")
    assert cal.device(run).mem_bw == 1.555e12
    assert costlib.get_device("a100", mem_bytes=80 * costlib.GiB).mem_bw == 2.0e12
    assert costlib.get_device("a100", mem_bytes=40 * costlib.GiB, mem_bw=3e12).mem_bw == 3e12
    fast = replace(cal.device(run), mem_bw=costlib.DEVICES["a100"].mem_bw)
    cfg, c = cal.model_config(run), cal.parse_layout(run.layout)
    at_80 = evaluate(cfg, c, fast, float("inf"), zero3=run.sharding, stand_in=run.stand_in)
    assert cal.predict(run).pick.step_s > 1.01 * at_80.step_s


def test_a_row_without_a_known_framework_is_refused(tmp_path) -> None:
    """A row whose framework the cost model does not know is refused naming the row and the
    choices."""
    text = cal.DATA.read_text().replace("framework: fsdp2", "framework: ddp", 1)
    (tmp_path / "runs.yaml").write_text(text)
    with pytest.raises(ValueError, match=r"tt-a100-llama3-70b-full: framework 'ddp'; give one"):
        cal.load_runs(tmp_path / "runs.yaml")
