"""Model library in one process: causality, pipeline form, registry.

Activation checkpointing (every architecture, single model and pipeline units): test_zero3_init.py.
"""

from __future__ import annotations

import gc

import pytest
import torch

from tapered_megatron.architectures import ARCHITECTURES
from tapered_megatron.config import ConfigError, load_config
from tapered_megatron.models import (
    Architecture,
    ArchitectureError,
    blocks,
    build_model,
    lm_loss,
    pipeline_layer_specs,
    register_architecture,
    resolve_architecture,
    set_recompute,
)
from tapered_megatron.parallel import cross_entropy

TINY = [
    "--model.d_model", "64", "--model.layers", "3", "--model.heads", "4", "--model.d_ff", "128",
    "--model.vocab_size", "256", "--model.seq_len", "24", "--taper.multiple", "8",
]  # fmt: skip
MIXERS = {
    "transformer": ["--model.arch", "transformer"],
    "gated_elementwise": ["--model.arch", "gated_attention"],
    "gated_headwise": ["--model.arch", "gated_attention", "--model.gate", "headwise"],
}


def tiny(case: str = "transformer", *extra: str):
    return load_config("quickstart", TINY + MIXERS[case] + list(extra))


@pytest.mark.parametrize("case", sorted(MIXERS))
def test_causal_in_training_mode(case):
    cfg = tiny(case)
    model = build_model(cfg).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, cfg.model.seq_len), generator=g)
    base = model(ids)
    for t in (0, 7, cfg.model.seq_len - 2):
        changed = ids.clone()
        changed[:, t + 1 :] = torch.randint(0, 256, changed[:, t + 1 :].shape, generator=g)
        out = model(changed)
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], atol=0, rtol=0)
        assert not torch.allclose(out[:, t + 1 :], base[:, t + 1 :])


def test_forward_shapes_and_initial_loss():
    cfg = tiny()
    model = build_model(cfg)
    ids = torch.randint(0, 256, (3, 10))
    assert model(ids).shape == (3, 10, cfg.padded_vocab_size)
    loss = model(ids, ids)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.2


def test_gated_attention_widens_query_projection():
    base, ew, hw = (
        build_model(tiny(c)) for c in ("transformer", "gated_elementwise", "gated_headwise")
    )
    shape = {n: p.shape for n, p in base.named_parameters()}
    d, heads = 64, 4
    for model, g in ((ew, d // heads), (hw, 1)):
        for name, p in model.named_parameters():
            if name.endswith("mixer.qkv.weight"):
                assert p.shape == (heads * (3 * d // heads + g), d)
            else:
                assert p.shape == shape[name]


@pytest.mark.parametrize("unit", ["layer", "sublayer"])
def test_pipeline_form_equals_build_model(unit):
    cfg = tiny("gated_elementwise")
    model = build_model(cfg)
    units = [spec.build() for spec in pipeline_layer_specs(cfg, unit=unit)]
    assert len(units) == cfg.model.layers * (1 if unit == "layer" else 2) + 2
    full = dict(model.named_parameters())
    names = {"Embedding": "embedding.", "Head": "head."}
    for u in units:
        prefix = names.get(type(u).__name__, f"layers.{getattr(u, 'layer', '')}.")
        for name, p in u.named_parameters():
            torch.testing.assert_close(p, full[prefix + name], atol=0, rtol=0)
    ids = torch.randint(0, 256, (2, 16))
    x = ids
    for u in units:
        x = u(x)
    torch.testing.assert_close(x.logits(), model(ids), atol=1e-6, rtol=0)
    # the pipeline's loss_fn on the head's output is the model's own (fused) loss
    torch.testing.assert_close(lm_loss(x, ids), model(ids, ids), atol=0, rtol=0)
    torch.testing.assert_close(lm_loss(x.logits(), ids), model(ids, ids), atol=1e-6, rtol=0)


def test_dropout_option():
    """``model.dropout``: off by default (no random numbers drawn), random in training mode,
    inactive in eval mode, replayed exactly by activation checkpointing, bounds checked."""
    ids = torch.randint(0, 256, (2, 16))
    plain = build_model(tiny())
    state = torch.get_rng_state()
    ref = plain(ids, ids)
    assert torch.equal(torch.get_rng_state(), state), "dropout 0 must draw nothing"
    cfg = tiny("transformer", "--model.dropout", "0.2")
    model = build_model(cfg)
    first, second = model(ids, ids), model(ids, ids)
    assert first != ref and second != first  # a new mask each pass
    torch.manual_seed(5)
    again = model(ids, ids)
    torch.manual_seed(5)
    assert torch.equal(model(ids, ids), again)  # masks come from the default generator
    assert torch.equal(model.eval()(ids, ids), ref)
    grads = []
    for mode in ("none", "full"):
        model = set_recompute(build_model(cfg), mode)
        torch.manual_seed(7)
        model(ids, ids).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    for bad, why in (("1", "must be below 1"), ("-0.1", "must be >= 0")):
        with pytest.raises(ConfigError, match=f"model.dropout.*{why}"):
            tiny("transformer", "--model.dropout", bad)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("chunk_bytes", [None, 7 * 256 * 4])  # default (one chunk), 7 tokens
def test_fused_chunked_loss_equals_logits_path(masked, chunk_bytes, monkeypatch):
    """``model(ids, labels)`` (LM head fused into the loss, gradients made in the forward pass,
    chunks of 7 tokens that don't divide the 48) equals ``lm_loss(model(ids), labels)``."""
    if chunk_bytes:
        monkeypatch.setattr(cross_entropy, "CHUNK_BYTES", chunk_bytes)
    cfg = tiny("gated_elementwise")
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    labels = (ids, (torch.rand(2, 24) > 0.3).float()) if masked else ids
    runs = []
    for fused in (False, True):
        model = build_model(cfg)
        loss = model(ids, labels) if fused else lm_loss(model(ids), labels)
        (3.0 * loss).backward()  # a non-unit upstream gradient reaches the saved gradients
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(runs[1][0], runs[0][0], atol=1e-6, rtol=0)
    for name, grad in runs[0][1].items():
        torch.testing.assert_close(runs[1][1][name], grad, atol=1e-6, rtol=1e-5, msg=name)
    with torch.no_grad():  # evaluation: loss only, same value
        torch.testing.assert_close(model(ids, labels), runs[1][0], atol=1e-6, rtol=0)


def test_fused_loss_keeps_no_logits_sized_tensor():
    """Nothing of ``tokens x vocab`` size outlives the fused loss's forward: neither what it
    saves for backward (seen by saved-tensor hooks) nor anything stashed on Python objects."""
    tokens, d, vocab = 64, 16, 512
    h = torch.randn(tokens, d, requires_grad=True)
    weight = torch.randn(vocab, d, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,))
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    def big() -> set[int]:  # tensors alive of at least tokens x vocab elements
        gc.collect()
        live = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
        return {id(t) for t in live if t.numel() >= tokens * vocab}

    before = big()  # what earlier tests in this process left (a simulated rank's engine)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cross_entropy.vocab_parallel_linear_cross_entropy_mean(
            h, weight, target, chunk_tokens=8
        )
    assert saved and max(saved) == vocab * d < tokens * vocab
    assert not big() - before
    loss.backward()
    assert h.grad.shape == h.shape and weight.grad.shape == weight.shape


@pytest.mark.parametrize("arch", ["transformer", "gated_attention", "titans", "hope_attention"])
def test_bf16_autocast_trains_like_fp32(arch):
    """Under ``torch.autocast`` (bf16) the hand-written autograd functions get consistent
    operands: forward and backward run, and loss and gradients track the fp32 ones."""
    cfg = load_config("quickstart", [*TINY, "--model.arch", arch])
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(9))
    runs = []
    for autocast in (False, True):
        model = build_model(cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(ids, ids)
        loss.backward()
        # hope's level of period 64 never updates in 24 tokens: its rate gates get no gradient
        unused = [n for n, p in model.named_parameters() if p.grad is None]
        assert all("rate_" in n.split(".")[-1] for n in unused), unused
        used = [p for p in model.parameters() if p.grad is not None]
        grads = torch.cat([p.grad.flatten() for p in used])
        assert all(p.grad.dtype == torch.float32 for p in used)
        runs.append((loss.item(), grads))
    assert abs(runs[1][0] - runs[0][0]) < 2e-2
    assert torch.isfinite(runs[1][1]).all()
    assert torch.nn.functional.cosine_similarity(runs[0][1], runs[1][1], dim=0) > 0.99


def test_loss_mask():
    cfg = tiny()
    model = build_model(cfg)
    ids = torch.randint(0, 256, (2, 8))
    mask = torch.zeros(2, 8)
    mask[:, :4] = 1
    logits = model(ids)
    per_token = torch.nn.functional.cross_entropy(logits[:, :4].flatten(0, 1), ids[:, :4].flatten())
    torch.testing.assert_close(lm_loss(logits, (ids, mask)), per_token, atol=1e-5, rtol=0)


def test_registry_is_the_list_of_architectures():
    """``model.arch`` accepts exactly the registered records; an architecture registered at run
    time is accepted by the config at once, and its options come from its own section only."""
    with pytest.raises(ArchitectureError, match="unknown architecture"):
        resolve_architecture("nope")
    with pytest.raises(ConfigError, match=r"unknown architecture 'nope'.*model\.plugins"):
        load_config("quickstart", ["--model.arch", "nope"])
    base = resolve_architecture("transformer")
    with pytest.raises(TypeError, match="TokenMixer"):
        blocks(Architecture("_bad", base.mlp, base.mlp))
    register_architecture(Architecture("_copy", base.mixer, base.mlp))
    try:
        cfg = load_config("quickstart", [*TINY, "--model.arch", "_copy"])
        assert cfg.model.arch == "_copy" and "gate" not in cfg.to_dict()["model"]
        assert build_model(cfg)(torch.randint(0, 256, (1, 8))).shape[-1] == cfg.padded_vocab_size
    finally:
        del ARCHITECTURES["_copy"]
    titans = load_config("quickstart", ["--model.arch", "titans"]).to_dict()["model"]
    assert "titans" in titans and "hope" not in titans and "gate" not in titans
    with pytest.raises(ConfigError, match=r"model\.titans: a setting of model\.arch titans"):
        load_config("quickstart", ["--model.titans.chunk_size", "8"])
    with pytest.raises(ConfigError, match=r"model\.gate: .*'sideways'; use one of"):
        load_config("quickstart", ["--model.arch", "gated_attention", "--model.gate", "sideways"])


def test_same_seed_same_weights_other_seed_differs():
    a, b = build_model(tiny()), build_model(tiny())
    c = build_model(tiny("transformer", "--train.seed", "99"))
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)
        if n.endswith(("qkv.weight", "w13.weight")):
            assert not torch.equal(p, r)


def test_rope_scores_depend_on_relative_position_only():
    from tapered_megatron.models.layers import RotaryEmbedding

    rope = RotaryEmbedding(8, 16, 10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    rq, rk = rope(q.expand(1, 16, 1, 8)), rope(k.expand(1, 16, 1, 8))
    score = lambda m, n: (rq[0, m, 0] * rk[0, n, 0]).sum()  # noqa: E731
    torch.testing.assert_close(score(5, 2), score(12, 9))
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1).expand(1, 16, 1))
    torch.testing.assert_close(rope(q.expand(1, 40, 1, 8))[:, :16], rq)  # tables regrow


def test_rmsnorm_matches_reference_and_gradients():
    from tapered_megatron.models.layers import RMSNorm, _RMSNormFn

    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.empty(16, dtype=torch.float64).uniform_(0.5, 1.5).requires_grad_()
    ref = x / x.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() * w
    torch.testing.assert_close(_RMSNormFn.apply(x, w, 1e-5), ref)
    assert torch.autograd.gradcheck(lambda a, b: _RMSNormFn.apply(a, b, 1e-5), (x, w))
    norm = RMSNorm(16)
    torch.testing.assert_close(
        norm(x.float()), torch.nn.functional.rms_norm(x.float(), (16,), eps=1e-5)
    )
