"""The evaluation tools against independent computations: perplexity, alignment (rho), the real
lm-evaluation-harness on the shipped local tasks, the zero-shot wrapper and generation."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_export import ARCHS, VOCAB, tiny_config, tiny_export, tiny_tokenizer

from tapered_megatron.data import IndexedDataset, split_ranges, write_indexed_dataset
from tapered_megatron.data.sample_corpus import sample_corpus_docs
from tapered_megatron.eval.alignment import alignment_of
from tapered_megatron.models import build_model

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tasks"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _run(*args: str) -> str:
    """Run a tool in a fresh process (this checkout first on the path); its stdout."""
    env = dict(
        os.environ, **OFFLINE, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    )
    p = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> str:
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def export(tok, tmp_path_factory):
    return tiny_export(tmp_path_factory.mktemp("export") / "out", "transformer", tok)


@pytest.fixture(scope="module")
def dataset(tok, tmp_path_factory) -> tuple[str, list[str]]:
    """40 held-out sample documents with EOD, as an indexed dataset and as a jsonl file."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=tok)
    texts = [t[:600] for t in sample_corpus_docs(240)[200:]]
    folder = tmp_path_factory.mktemp("data")
    prefix = str(folder / "held_text_document")
    write_indexed_dataset(prefix, [[*sp.encode(t), sp.eos_id()] for t in texts])
    (folder / "held.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return prefix, texts


def test_perplexity_equals_independent_computation(export, dataset, capsys):
    out, model = export
    prefix, _ = dataset
    last = _run("-m", "tapered_megatron.eval.perplexity", "--model", str(out), "--data-path",
                prefix, "--split", "valid", "--data-split", "60,40,0", "--seq-len", "48",
                "--json").strip().splitlines()[-1]  # fmt: skip
    got = json.loads(last)
    # independent: the valid documents' tokens, windows of 48 inputs, per-token cross-entropy
    ds = IndexedDataset(prefix)
    lo, hi = split_ranges("60,40,0", ds.num_documents)[1]
    stream = torch.as_tensor(
        np.concatenate([ds.document(d) for d in range(lo, hi)]).astype(np.int64)
    )
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, stream.numel() - 1, 48):
            w = stream[start : start + 49]
            logits = model(w[None, :-1])[0]
            nll += F.cross_entropy(logits.double(), w[1:], reduction="sum").item()
            count += w.numel() - 1
    assert got["tokens"] == count == stream.numel() - 1
    assert got["loss"] == pytest.approx(nll / count, rel=1e-6)
    assert got["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert got["split"] == "valid"

    # the same documents as a jsonl file, tokenized on the fly, give the same numbers
    from tapered_megatron.eval.perplexity import main

    jsonl = str(Path(prefix).parent / "held.jsonl")
    assert main(["--model", str(out), "--data-path", jsonl, "--split", "valid", "--data-split",
                 "60,40,0", "--seq-len", "48", "--json"]) == 0  # fmt: skip
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["tokens"] == got["tokens"]
    assert again["loss"] == pytest.approx(got["loss"], rel=1e-9)


@pytest.mark.parametrize("arch", ARCHS)
def test_alignment_equals_manual_layer_walk(arch):
    model = build_model(tiny_config(arch)).eval()
    ids = torch.randint(0, VOCAB, (3, 64), generator=torch.Generator().manual_seed(0))
    rows, tokens = alignment_of(model, [ids[:2], ids[2:]])
    assert tokens == ids.numel()
    with torch.no_grad():
        h = model.embedding(ids)
        for layer, block in enumerate(model.layers):
            z = h + block.mixer(block.mixer_norm(h))
            f = block.mlp(block.mlp_norm(z))
            h_next = z + f
            dot = lambda a, b: (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))  # noqa: E731
            want_block = dot(h_next - h, h).mean().item()
            want_mlp = dot(f, h).mean().item()
            assert rows[layer].layer == layer
            assert abs(rows[layer].rho_block - want_block) <= 1e-5
            assert abs(rows[layer].rho_mlp - want_mlp) <= 1e-5
            h = h_next


def test_alignment_cli_writes_json_table_and_png(export, dataset, tmp_path):
    out, model = export
    prefix, _ = dataset
    png = tmp_path / "rho.png"
    stdout = _run("-m", "tapered_megatron.eval.alignment", "--model", str(out), "--data-path",
                  prefix, "--split", "all", "--tokens", "500", "--seq-len", "100", "--plot",
                  str(png), "--json")  # fmt: skip
    got = json.loads(stdout.strip().splitlines()[-1])
    assert "rho_block" in stdout and got["tokens"] == 500
    assert [r["layer"] for r in got["layers"]] == [0, 1]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ids = torch.as_tensor(IndexedDataset(prefix).tokens(0, 500).astype(np.int64)).view(5, 100)
    rows, _ = alignment_of(model, ids)
    for r, g in zip(rows, got["layers"]):
        assert g["rho_block"] == pytest.approx(r.rho_block, abs=1e-6)
        assert g["rho_mlp"] == pytest.approx(r.rho_mlp, abs=1e-6)


def _loglik(model, sp, context: str, continuation: str) -> tuple[float, bool]:
    """Our scorer, written from the harness's documented rules: trailing context whitespace
    moves to the continuation; the continuation's tokens are those of ``encode(context +
    continuation)`` after ``encode(context)``; logits over the real vocabulary."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = sp.encode(context + continuation), sp.encode(context)
    cont = whole[len(ctx) :]
    with torch.no_grad():
        logits = model(torch.tensor([whole[:-1]]))[0, -len(cont) :, :VOCAB]
    logp = torch.log_softmax(logits.double(), dim=-1)
    target = torch.tensor(cont)
    return logp[torch.arange(len(cont)), target].sum().item(), bool(
        (logp.argmax(-1) == target).all()
    )


def _own_scores(model, tok: str, limit: int) -> dict[str, dict[str, float]]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=tok)
    data = TASKS / "data"
    mc = [json.loads(x) for x in (data / "tm_shakespeare_nextline.jsonl").read_text().splitlines()]
    acc = acc_norm = 0
    for item in mc[:limit]:
        ll = [_loglik(model, sp, item["context"], "\n" + c)[0] for c in item["choices"]]
        norm = [x / len(c) for x, c in zip(ll, item["choices"])]
        acc += int(np.argmax(ll) == item["label"])
        acc_norm += int(np.argmax(norm) == item["label"])
    cloze = [
        json.loads(x) for x in (data / "tm_shakespeare_lastword.jsonl").read_text().splitlines()
    ]
    greedy = [_loglik(model, sp, it["context"], " " + it["target"])[1] for it in cloze[:limit]]
    return {
        "tm_shakespeare_nextline": {"acc": acc / limit, "acc_norm": acc_norm / limit},
        "tm_shakespeare_lastword": {"acc": sum(greedy) / limit},
    }


@pytest.fixture(scope="module")
def harness_run(export, tmp_path_factory) -> Path:
    """The real ``lm_eval`` command line on the export, both local tasks, 8 items each, with
    every item's log-likelihoods (``--log_samples``); its output folder (the dev extra installs
    it: a missing one is a failure, not a skip)."""
    import lm_eval  # noqa: F401

    out, _ = export
    res = tmp_path_factory.mktemp("lm_eval")
    _run("-m", "lm_eval", "--model", "hf", "--model_args",
         f"pretrained={out},trust_remote_code=True", "--tasks",
         "tm_shakespeare_nextline,tm_shakespeare_lastword", "--include_path", str(TASKS),
         "--limit", "8", "--batch_size", "4", "--log_samples",
         "--output_path", str(res))  # fmt: skip
    return res


@pytest.fixture(scope="module")
def harness(harness_run) -> dict:
    """The harness's aggregate results per task."""
    (path,) = harness_run.rglob("results_*.json")
    return json.loads(path.read_text())["results"]


def test_lm_eval_cli_accuracy_equals_own_scorer(harness, export, tok):
    _, model = export
    own = _own_scores(model, tok, 8)
    for task, metrics in own.items():
        for name, value in metrics.items():
            assert harness[task][f"{name},none"] == pytest.approx(value, abs=1e-9), (task, name)
    assert harness["tm_shakespeare_lastword"]["perplexity,none"] > 1


def test_lm_eval_per_item_loglikelihoods_equal_own_scorer(harness_run, export, tok):
    """Every request the harness scored (4 choices of 8 next-line items, 8 last words): its
    log-likelihood and greedy flag equal our scorer's on the same context and continuation
    (1e-6 relative: the harness sums in float32), item by item, not only in an accuracy that a
    random model leaves at 0."""
    import sentencepiece as spm

    _, model = export
    sp = spm.SentencePieceProcessor(model_file=tok)
    seen = 0
    for task, choices in (("tm_shakespeare_nextline", 4), ("tm_shakespeare_lastword", 1)):
        (path,) = harness_run.rglob(f"samples_{task}_*.jsonl")
        items = [json.loads(x) for x in path.read_text().splitlines()]
        assert sorted(it["doc_id"] for it in items) == list(range(8))
        for it in items:
            requests = [it["arguments"][f"gen_args_{k}"] for k in range(len(it["resps"]))]
            assert len(requests) == choices
            for req, resp in zip(requests, it["resps"], strict=True):
                ll, greedy = resp[0]
                want_ll, want_greedy = _loglik(model, sp, req["arg_0"], req["arg_1"])
                assert float(ll) == pytest.approx(want_ll, rel=1e-6), (task, it["doc_id"])
                assert str(greedy) == str(want_greedy), (task, it["doc_id"])
                seen += 1
    assert seen == 8 * 4 + 8


def test_zeroshot_wrapper_writes_json_and_markdown(harness, export, tmp_path):
    from tapered_megatron.eval.zeroshot import main

    out, _ = export
    assert main(["--model", str(out), "--limit", "8", "--batch-size", "4",
                 "--output", str(tmp_path)]) == 0  # fmt: skip
    got = json.loads((tmp_path / "zeroshot.json").read_text())
    assert set(got["tasks"]) == {"tm_shakespeare_nextline", "tm_shakespeare_lastword"}
    for task, m in got["tasks"].items():
        assert m["n"] == 8
        assert m["acc"] == harness[task]["acc,none"]
    assert got["tasks"]["tm_shakespeare_lastword"]["acc_norm"] is None
    assert got["average_acc"] == pytest.approx(np.mean([m["acc"] for m in got["tasks"].values()]))
    assert "| **average** |" in (tmp_path / "zeroshot.md").read_text()


def test_generate_cli_greedy_with_and_without_cache(export, capsys):
    from tapered_megatron.generate import main

    out, _ = export
    args = ["--model", str(out), "--prompt", "To be, or not", "--max-new-tokens", "12",
            "--temperature", "0"]  # fmt: skip
    assert main(args) == 0
    cached = capsys.readouterr().out
    assert main([*args, "--no-cache"]) == 0
    assert capsys.readouterr().out == cached
    assert cached.startswith("To be, or not") and len(cached) > len("To be, or not\n")
    assert main([*args[:4], "--max-new-tokens", "5", "--temperature", "0.8", "--seed", "1"]) == 0


def test_fused_loss_makes_no_gradients_under_no_grad(monkeypatch):
    """Evaluation (perplexity, validation) runs the fused LM-head loss without its in-forward
    gradient products; training still makes them."""
    from tapered_megatron.parallel import cross_entropy

    calls = []
    real = cross_entropy._ce_grad_
    monkeypatch.setattr(cross_entropy, "_ce_grad_", lambda *a: calls.append(1) or real(*a))
    model = build_model(tiny_config("transformer"))
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        evaluated = model(ids[:, :-1], ids[:, 1:])
    assert not calls
    trained = model(ids[:, :-1], ids[:, 1:])
    trained.backward()
    assert calls and model.head.proj.weight.grad is not None
    assert evaluated.item() == pytest.approx(trained.item(), abs=1e-6)
