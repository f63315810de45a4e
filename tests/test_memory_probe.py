"""The memory probe (``tapered_megatron.eval.memory_probe``, ``models.in_context_memory``): what
"memory off" computes, the library function and its command line, and, per memory
architecture, that a model trained where recall needs its memory loses that recall when the
probe switches the in-context updates off.

The recall task and models are scripts/bench_memory_recall.py's: key/value pairs, a filler gap
longer than all layers' attention windows together, then the keys again; loss on the queried
values only, so attention alone is at chance and what the model recalls, its memory carries.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_export import VOCAB, tiny_config, tiny_export

from tapered_megatron.eval.memory_probe import main as probe_main
from tapered_megatron.eval.memory_probe import memory_probe
from tapered_megatron.models import in_context_memory, lm_loss
from tapered_megatron.models.titans import TitansMixer
from tapered_megatron.parallel import init_parameters

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module")
def recall(request):
    """scripts/bench_memory_recall.py as a module (it imports bench_common from its folder)."""
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(
        "bench_memory_recall", SCRIPTS / "bench_memory_recall.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    request.addfinalizer(mp.undo)
    return mod


def test_titans_memory_off_is_the_rule_without_steps_or_forgetting():
    """Off, every token reads the learned initial memory: the same output as the memory rule
    with its step size and forgetting gates shut (theta = alpha ~ 1e-13), and not the output
    with them open; the switch is restored on exit."""
    cfg = tiny_config("titans")
    torch.manual_seed(0)
    mixer = TitansMixer(cfg, 0)
    init_parameters(mixer, cfg.train.seed, "layers.0.mixer.")
    x = torch.randn(2, 96, cfg.model.d_model)
    heads = mixer.memory.local_heads
    with torch.no_grad():
        on = mixer(x)
        with in_context_memory(mixer, False) as n:
            off = mixer(x)
        assert n == 1 and mixer.memory.in_context
        mixer.memory.gate_bias[:heads] = -30.0  # theta
        mixer.memory.gate_bias[2 * heads :] = -30.0  # alpha
        shut = mixer(x)
    torch.testing.assert_close(off, shut, rtol=1e-5, atol=1e-6)
    assert (on - off).norm() > 0.05 * off.norm()


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    """Random tokens below the tiny vocabulary as an indexed dataset (two documents)."""
    from tapered_megatron.data import write_indexed_dataset

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, VOCAB, 300).tolist() for _ in range(2)]
    prefix = str(tmp_path_factory.mktemp("probe") / "held_text_document")
    write_indexed_dataset(prefix, docs)
    return prefix


@pytest.mark.parametrize("arch", ["titans", "hope_attention"])
def test_probe_command_line(arch, held_out, tmp_path, capsys):
    """The CLI's on/off losses at the training length and 4x it equal the library's, which
    equal a direct token-weighted evaluation with the switch; a transformer is refused."""
    out, model = tiny_export(tmp_path / "out", arch, None)
    args = ["--model", str(out), "--data-path", held_out, "--split", "all", "--seq-len", "64"]
    assert probe_main([*args, "--batch-size", "4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [p["seq_len"] for p in got["probes"]] == [64, 256]
    from tapered_megatron.data import IndexedDataset

    ds = IndexedDataset(held_out)
    stream = np.asarray(ds.tokens(0, int(ds.document_lengths.sum()))).astype(np.int64)
    lib = memory_probe(model, stream, [64, 256], batch_size=4)
    for p, q in zip(got["probes"], lib):
        assert p["on"] == pytest.approx(q.on, rel=1e-5)
        assert p["off"] == pytest.approx(q.off, rel=1e-5)
        assert p["gap"] == pytest.approx(q.off - q.on, abs=1e-5)
        assert p["tokens"] == stream.size - 1
    # direct: the stream in windows of 256 (the last one shorter), the switch set by hand
    t = torch.as_tensor(stream)
    for on, want in ((True, lib[1].on), (False, lib[1].off)):
        nll = 0.0
        with torch.no_grad(), in_context_memory(model, on):
            for s in range(0, t.numel() - 1, 256):
                w = t[s : s + 257]
                nll += lm_loss(model(w[None, :-1]), w[None, 1:]).item() * (w.numel() - 1)
        assert nll / (t.numel() - 1) == pytest.approx(want, rel=1e-5)
    assert lib[0].off != lib[0].on  # the updates move the loss even at init

    plain, _ = tiny_export(tmp_path / "plain", "transformer", None)
    assert probe_main(["--model", str(plain), *args[2:]]) == 2
    assert "no in-context memory" in capsys.readouterr().err


RECALL = {  # bench_memory_recall models whose recall after training needs the memory
    "titans": ("titans",),  # MAG, window 16, chunk 8
    # W_2's gate spread at init: the default learns this task within 300 steps on 1 of 6 seeds,
    # this on 5 of 6 (docs/BENCHMARKS.md); seed 0 learns
    "hope_attention": ("hope_attention", "--model.hope.w2_gate_spread", "4.8"),
}


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(RECALL))
def test_memory_off_loses_the_recall_it_learned(arch, recall):
    """Trained on the recall task, the model predicts the queried values far better with its
    in-context memory than with it switched off (then it is at chance, like attention alone)."""
    pairs, gap, window, steps = 8, 48, 16, 300
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = recall.build(RECALL[arch][0], window, 4 * pairs + gap, *RECALL[arch][1:])
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(steps):
        ids, mask = recall.make_batch(32, pairs, gap, gen)
        loss = lm_loss(model(ids[:, :-1]), (ids[:, 1:], mask))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    ids, mask = recall.make_batch(64, pairs, gap, torch.Generator().manual_seed(1))
    with torch.no_grad():
        on = lm_loss(model(ids[:, :-1]), (ids[:, 1:], mask)).item()
        with in_context_memory(model, False):
            off = lm_loss(model(ids[:, :-1]), (ids[:, 1:], mask)).item()
    chance = float(np.log(recall.VALUES))
    print(f"{arch}: queried-value loss {on:.3f} with the memory, {off:.3f} without")
    assert off > chance - 0.1  # off: attention alone, at chance
    assert off - on > 0.3  # measured: see docs/testing.md
