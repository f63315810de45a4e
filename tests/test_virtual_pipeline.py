"""Pipelines give one process's losses, gradient norms, gradients and parameters with clipping
active: the virtual-stage schedules on torch.distributed.pipelining (DeepSpeed as launcher,
topology and optimizer) and DeepSpeed's own 1F1B engine, at ZeRO-0 and ZeRO-1, with TP and DP.
Engines are built the way the trainer builds them (``build_engine``, ``optimizer_kwargs``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from pipeline_ref import canonical_names, full_tensor, reference_steps

from tapered_megatron.config import load_config
from tapered_megatron.parallel.local_launch import run_workers

TINY = [
    "--model.d_model", "32", "--model.layers", "4", "--model.heads", "2", "--model.d_ff", "64",
    "--model.vocab_size", "128", "--model.seq_len", "8", "--taper.multiple", "8",
    "--parallel.pp", "2", "--train.weight_decay", "0", "--train.warmup_iters", "0",
    "--train.lr", "0.5", "--train.min_lr", "0.5",
]  # fmt: skip
MICRO = 4  # micro-batches per step and data-parallel rank
STEPS = 2
LR = 0.5  # constant: the trainer's schedule from train.lr = train.min_lr, no warmup
CLIP = 0.2  # well below the gradients' norm: every stage must clip by the norm over all of them
NORM_RTOL = 1e-5  # DeepSpeed's own fp32 ZeRO-0 norm under a pipeline grid is ~1e-4 off
SCHEDULES = [("interleaved", 2), ("zbv", 2), ("dualpipev", 2), ("zero_bubble", 2)]


def _cfg(case: dict[str, Any]):
    extra = [
        "--parallel.schedule", case["schedule"], "--parallel.virtual_stages", str(case["v"]),
        "--model.arch", case.get("arch", "transformer"), "--parallel.tp", str(case.get("tp", 1)),
    ]  # fmt: skip
    return load_config("quickstart", [*TINY, *extra])


def _steps(cfg, dp: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, the micro-batches of every DP rank in rank order (rank r: the r-th slice)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(
            0, cfg.model.vocab_size, (MICRO * dp, 1, cfg.model.seq_len + 1), generator=g
        )
        out.append([(b[:, :-1], b[:, 1:]) for b in ids])
    return out


def _ds_config(case: dict[str, Any]) -> dict[str, Any]:
    """SGD under ZeRO ``case["zero"]`` (default 1), clipping at :data:`CLIP`; with
    ``case["bf16"]`` bf16 with fp32 gradient accumulation (DeepSpeed's BF16_Optimizer)."""
    out: dict[str, Any] = {
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": MICRO,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": case.get("zero", 1)},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if case.get("bf16"):
        out["bf16"] = {"enabled": True, "immediate_grad_update": case.get("immediate", True)}
        out["data_types"] = {"grad_accum_dtype": "fp32"}
    return out


def _engine(case: dict[str, Any], cfg, ds_config: dict[str, Any], dp: int) -> tuple[Any, Any]:
    """The trainer's pipeline for ``case``: DeepSpeed's 1F1B engine from ``build_engine``, or
    a :class:`VirtualPipeline` with the trainer's optimizer arguments and a stage clock; and
    its module."""
    from tapered_megatron.checkpoint.layout import ParallelLayout
    from tapered_megatron.parallel.schedules import VirtualPipeline
    from tapered_megatron.planning.clock import StageClock
    from tapered_megatron.training.trainer import build_engine, optimizer_kwargs

    if case["schedule"] == "1f1b":
        zero = ds_config["zero_optimization"]["stage"]
        lay = ParallelLayout(tp=case.get("tp", 1), pp=2, dp=dp, zero_stage=zero, grad_accum=MICRO)
        engine = build_engine(cfg, ds_config, lay)
        return engine, engine.module
    pipe = VirtualPipeline(
        cfg, ds_config, MICRO, lambda m: optimizer_kwargs(cfg, ds_config, m), clock=StageClock()
    )
    if not case.get("reduce", True):
        pipe.reduce_gradients = lambda: None
    return pipe, pipe.module


def _run(case: dict[str, Any], dp: int) -> dict[str, Any]:
    """One case on this rank: losses, logged gradient norms and full parameters (by
    single-model name, gathered over TP) before and after every step; under a virtual
    schedule each step's timed passes (``passes``: kind -> count) and milliseconds.
    ``case["reduce"] = False`` skips the data-parallel reduction."""
    from tapered_megatron.parallel import get_data_parallel_rank

    cfg = _cfg(case)
    pipe, module = _engine(case, cfg, _ds_config(case), dp)
    names = canonical_names(module, cfg)

    def params() -> dict[str, np.ndarray]:
        return {names[p]: full_tensor(p.data, p) for p in module.parameters()}

    r = get_data_parallel_rank()
    out = {"losses": [], "norms": [], "params": [params()], "parts": getattr(pipe, "parts", [])}
    out["passes"] = []
    steps = _steps(cfg, dp)
    if case["schedule"] != "1f1b":
        pipe.eval()
        out["eval"] = pipe.eval_batch(iter(steps[0][r * MICRO : (r + 1) * MICRO]), MICRO)
        pipe.train()
    clock = None if case["schedule"] == "1f1b" else pipe.stages[0].clock
    for batches in steps:
        before = len(clock.passes) if clock else 0
        out["losses"].append(float(pipe.train_batch(iter(batches[r * MICRO : (r + 1) * MICRO]))))
        # what the trainer logs
        norm = pipe.last_grad_norm if case["schedule"] != "1f1b" else pipe.get_global_grad_norm()
        out["norms"].append(None if norm is None else float(norm))
        out["params"].append(params())
        if clock:
            done = [kind for kind, _ in clock.passes[before:]]
            counts = {k: done.count(k) for k in ("forward", "backward")}
            out["passes"].append((counts, clock.take()))
    return out


def _worker(rank: int, world: int, cases: list[dict[str, Any]], tp: int = 1) -> list[dict]:
    import deepspeed

    from tapered_megatron.parallel import init_model_parallel, model_parallel_seed

    deepspeed.init_distributed(dist_backend="gloo")
    init_model_parallel(tp=tp, pp=2)
    model_parallel_seed(1234)
    return [_run({**case, "tp": tp}, world // (2 * tp)) for case in cases]


def _mismatch(per_rank: list[dict[str, Any]], case: dict[str, Any]) -> str | None:
    """The first difference from one process (the evaluation loss before training; per step
    the loss, the gradient norm before clipping, the gradient the step applied and the
    parameters after it), or None."""
    cfg = _cfg({**case, "tp": 1})
    ref = reference_steps(cfg, _steps(cfg, len(per_rank) // (2 * case.get("tp", 1))), LR, CLIP)
    assert all(step["norm"] > 2 * CLIP for step in ref)  # clipping is active in every step
    if any(abs(rank.get("eval", ref[0]["loss"]) - ref[0]["loss"]) > 1e-5 for rank in per_rank):
        return f"evaluation loss {per_rank[0]['eval']} vs {ref[0]['loss']}"
    for k, step in enumerate(ref):
        got: dict[str, np.ndarray] = {}
        before: dict[str, np.ndarray] = {}
        for rank in per_rank:
            if abs(rank["losses"][k] - step["loss"]) > 1e-5:
                return f"step {k} loss {rank['losses'][k]} vs {step['loss']}"
            norm = rank["norms"][k]
            if norm is None or abs(norm - step["norm"]) > NORM_RTOL * step["norm"]:
                return f"step {k} gradient norm {rank['norms'][k]} vs {step['norm']}"
            got.update(rank["params"][k + 1])
            before.update(rank["params"][k])
        assert sorted(got) == sorted(step["params"])  # every parameter on some rank
        for name, want in step["params"].items():
            grad = (before[name] - got[name]) / LR  # the clipped gradient the step applied
            for what, a, b in (("grad", grad, step["grads"][name]), ("param", got[name], want)):
                if not np.allclose(a, b.numpy(), rtol=1e-4, atol=1e-6):
                    return f"step {k} {what} {name}: max error {np.abs(a - b.numpy()).max():.3g}"
    return None


@pytest.mark.distributed
def test_interleaved_pp2_v2_and_deepspeed_1f1b_zero0_match_one_process():
    """Interleaved PP2 x v2 (ZeRO-1) and DeepSpeed's 1F1B engine at fp32 ZeRO-0, where
    DeepSpeed's own clipping drops the second stage's replicated parameters from the norm and
    keeps no norm to log."""
    cases = [{"schedule": "interleaved", "v": 2}, {"schedule": "1f1b", "v": 1, "zero": 0}]
    per_rank = run_workers(_worker, 2, cases)
    assert len(per_rank[0][0]["parts"]) == 5
    for rank in per_rank:  # every pass of the rank's two chunks timed (the trainer's stage ms)
        for counts, ms in rank[0]["passes"]:
            assert counts == {"forward": 2 * MICRO, "backward": 2 * MICRO} and ms > 0, counts
    for i, case in enumerate(cases):
        assert _mismatch([r[i] for r in per_rank], case) is None, case


REFUSED = [  # (schedule, other flags, precision, what the one-line refusal names)
    ("zbv", ["--train.recompute", "full"], "fp32", "recomputation"),
    ("interleaved", ["--train.universal_checkpoint", "false"], "fp32", "universal copy"),
    ("interleaved", [], "fp16", "fp16"),
    ("dualpipev", [], "fp32", "at least 4 micro-batches"),
]


def test_what_the_runtime_does_not_do_is_refused_in_one_line() -> None:
    from tapered_megatron.parallel.schedules import run_problem

    def cfg(schedule: str, extra: list[str]):
        flags = ["--parallel.schedule", schedule, "--parallel.virtual_stages", "2", *extra]
        return load_config("quickstart", [*TINY, *flags])

    for schedule, extra, precision, needle in REFUSED:
        problem = run_problem(cfg(schedule, extra), 2, precision) or ""
        assert needle in problem and "\n" not in problem, (schedule, problem)
    assert run_problem(cfg("interleaved", []), 4, "bf16") is None


@pytest.mark.slow
@pytest.mark.distributed
def test_every_schedule_zero0_and_zero1_pp2_v2_matches_one_process():
    cases = [{"schedule": s, "v": v, "zero": z} for s, v in SCHEDULES for z in (0, 1)]
    cases.append({"schedule": "1f1b", "v": 1, "zero": 1})
    per_rank = run_workers(_worker, 2, cases)
    for i, case in enumerate(cases):
        assert _mismatch([r[i] for r in per_rank], case) is None, case


@pytest.mark.slow
@pytest.mark.distributed
def test_pp2_dp2_zero1_matches_one_process_and_needs_the_dp_reduction():
    cases = [{"schedule": s, "v": v, "zero": 1} for s, v in SCHEDULES]
    cases += [{"schedule": "interleaved", "v": 2, "zero": 0}]
    cases += [{"schedule": "1f1b", "v": 1, "zero": z} for z in (0, 1)]
    # without the all-reduce each data-parallel rank steps with its own gradients (under ZeRO-1
    # the optimizer has no reduced partition to step and fails outright)
    control = {"schedule": "interleaved", "v": 2, "zero": 0, "reduce": False}
    per_rank = run_workers(_worker, 4, [*cases, control])
    for i, case in enumerate(cases):
        assert _mismatch([r[i] for r in per_rank], case) is None, case
    assert _mismatch([r[-1] for r in per_rank], control) is not None  # negative control


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_pp2_clips_exactly_under_1f1b_and_virtual_schedules():
    """TP2 x PP2 (four ranks): DeepSpeed's 1F1B engine and two virtual schedules, ZeRO-0 and
    ZeRO-1: the norm counts every TP shard once and every replicated parameter once."""
    cases = [{"schedule": s, "v": v, "zero": z} for s, v in SCHEDULES[:2] for z in (0, 1)]
    cases += [{"schedule": "1f1b", "v": 1, "zero": z} for z in (0, 1)]
    per_rank = run_workers(_worker, 4, cases, 2)
    for i, case in enumerate(cases):
        assert _mismatch([r[i] for r in per_rank], {**case, "tp": 2}) is None, case


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["titans", "hope_attention", "gated_attention"])
def test_memory_architectures_pp2_v2_match_one_process(arch: str):
    cases = [{"schedule": s, "v": v, "arch": arch} for s, v in SCHEDULES[:2]]
    per_rank = run_workers(_worker, 2, cases)
    for i, case in enumerate(cases):
        assert _mismatch([r[i] for r in per_rank], case) is None, case


def _one_process_worker(rank: int, world: int, case: dict[str, Any], dp: int = 1) -> dict[str, Any]:
    """The single model under DeepSpeed in one process, with ``case``'s DeepSpeed config,
    accumulating the micro-batches of ``dp`` data-parallel ranks."""
    import deepspeed

    from tapered_megatron.models import build_model

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = _cfg(case)
    model = build_model(cfg)
    config = {**_ds_config(case), "gradient_accumulation_steps": MICRO * dp}
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )

    def params() -> dict[str, np.ndarray]:
        return {n: p.detach().float().numpy().copy() for n, p in model.named_parameters()}

    out = {"losses": [], "norms": [], "params": [params()]}
    for batches in _steps(cfg, dp):
        total = 0.0
        for x, y in batches:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += float(loss) / (MICRO * dp)
        out["losses"].append(total)
        out["norms"].append(float(engine.get_global_grad_norm()))
        out["params"].append(params())
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_bf16_with_fp32_accumulation_matches_one_process_under_deepspeed():
    cases = [
        {"schedule": s, "v": v, "bf16": True, "immediate": imm}
        for s, v in SCHEDULES
        for imm in (True, False)
    ]
    per_rank = run_workers(_worker, 2, cases)
    ref = run_workers(_one_process_worker, 1, cases[0])[0]
    for i, case in enumerate(cases):
        _assert_bf16_close([r[i] for r in per_rank], ref, case)


@pytest.mark.slow
@pytest.mark.distributed
def test_bf16_pp2_dp2_zero1_matches_one_process():
    """bf16 with fp32 accumulation at PP2 x DP2 under ZeRO-1 (the bf16 optimizer all-reduces
    its fp32 gradients over the data-parallel ranks), a full-backward and a split-backward
    schedule, against one process accumulating both ranks' micro-batches."""
    cases = [{"schedule": s, "v": v, "bf16": True} for s, v in SCHEDULES[:2]]
    per_rank = run_workers(_worker, 4, cases)
    ref = run_workers(_one_process_worker, 1, cases[0], 2)[0]
    for i, case in enumerate(cases):
        _assert_bf16_close([r[i] for r in per_rank], ref, case)


def _assert_bf16_close(per_rank: list[dict], ref: dict, case: dict[str, Any]) -> None:
    """Every rank's losses and gradient norms equal one process's to 1e-4, the parameters
    (every one on some rank) to bf16's resolution."""
    for k in range(STEPS):
        got: dict[str, np.ndarray] = {}
        for rank in per_rank:
            assert abs(rank["losses"][k] - ref["losses"][k]) < 1e-4, case
            assert rank["norms"][k] == pytest.approx(ref["norms"][k], rel=1e-4), case
            got.update(rank["params"][k + 1])
        assert sorted(got) == sorted(ref["params"][k + 1])
        for name, want in ref["params"][k + 1].items():  # a few bf16 steps apart at most
            np.testing.assert_allclose(got[name], want, rtol=2**-7, atol=1e-4, err_msg=name)
