"""Titans memory: chunk-parallel rule vs a plain token-by-token reference, causality, gradients,
TP=2 vs TP=1, tapered-vs-uniform budget, training on real text."""

from __future__ import annotations

import functools
import itertools
import json
import statistics
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_memory import assert_causal, assert_learns_real_text, tiny_cfg

from tapered_megatron.config import load_config
from tapered_megatron.models import build_model, count_model, lm_loss, take_diagnostics
from tapered_megatron.models.titans import (
    GATE_INIT,
    MAX_GRAD_NORM,
    NLMS_EPS,
    MemoryState,
    NeuralMemory,
    TitansMixer,
    memory_scan,
)
from tapered_megatron.parallel import init_parameters
from tapered_megatron.parallel.local_launch import run_workers

# --------------------------------------------------------------------------------------------
# TP=2 vs TP=1


def tp_run(arch_overrides: dict[str, list[str]], rank: int, world: int) -> dict:
    """Worker body: build each config at TP=world, return numpy logits and full gradients."""
    import torch.distributed as dist

    from tapered_megatron.parallel import (
        gather_from_tp_region,
        get_tensor_model_parallel_world_size,
        init_model_parallel,
        unshard,
    )

    if dist.is_initialized():
        init_model_parallel(tp=world, pp=1)
    tp = get_tensor_model_parallel_world_size()
    out = {}
    for key, (arch, *ov) in arch_overrides.items():
        cfg = tiny_cfg(arch, *ov)
        model = build_model(cfg)
        ids = torch.randint(0, 256, (2, cfg.model.seq_len + 1), generator=torch.Generator())
        ids = torch.randint(0, 256, ids.shape, generator=torch.Generator().manual_seed(7))
        logits = model(ids[:, :-1])
        lm_loss(logits, ids[:, 1:]).backward()
        res = {"logits": gather_from_tp_region(logits).detach().numpy()}
        for name, p in model.named_parameters():
            grad, layout = p.grad.detach(), getattr(p, "tp_layout", None)
            if tp > 1 and layout is not None:
                pieces = [torch.empty_like(grad) for _ in range(tp)]
                dist.all_gather(pieces, grad.contiguous())
                grad = unshard(pieces, layout)
            res[name] = grad.numpy().copy()
        out[key] = res
    return out


def assert_tp_equal(cases: dict[str, list[str]]) -> None:
    """TP=2 (two real processes) vs TP=1 (this process): logits and all gradients within 1e-5."""
    ref = tp_run(cases, 0, 1)
    got = run_workers(_tp_worker, 2, cases)
    for rank_result in got:
        for key, res in ref.items():
            for name, value in res.items():
                torch.testing.assert_close(
                    torch.from_numpy(rank_result[key][name]),
                    torch.from_numpy(value),
                    rtol=1e-5,
                    atol=1e-5,
                    msg=lambda m, k=key, n=name: f"{k} {n}: {m}",
                )


def _tp_worker(rank: int, world: int, cases: dict) -> dict:
    return tp_run(cases, rank, world)


# --------------------------------------------------------------------------------------------
# the memory rule


def _mlp(weights: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    for i, w in enumerate(weights):
        x = torch.einsum("bhoi,bhi->bho", w, x)
        if i < len(weights) - 1:
            x = F.silu(x)
    return x


def token_rule(
    q, k, v, theta, eta, alpha, m, s, chunk: int = 1, max_norm: float = MAX_GRAD_NORM,
    normalized: bool = False, cut: int = 0, graph: bool = False,
):  # fmt: skip
    """The Titans rule written plainly, one token at a time from memory ``m`` and momentum ``s``
    (per layer ``[B, H, out, in]``), gradients by autograd (each token's gradient clipped to
    Frobenius norm ``max_norm``, as the rule says; 0: not clipped; ``normalized``: the step
    divided by twice the curvature along the error plus ``NLMS_EPS``, ``||G||^2 / (4 ||e||^2)``
    with ``e = M(k) - v``, before the clip). Returns the read-outs and final m, s.

    ``chunk > 1``: gradients w.r.t. the weights at the start of each chunk of ``chunk`` tokens
    (the rule the chunk-parallel form implements), everything else per token. ``cut``: the
    state detached before every ``cut``-th token (truncated backpropagation through it).
    ``graph``: the memory gradients part of autograd's graph (the rule differentiable).
    """
    m_start, ys = m, []
    for t in range(q.shape[2]):
        if cut and t and t % cut == 0:
            m, s = [w.detach() for w in m], [x.detach() for x in s]
        if t % chunk == 0:
            m_start = [w if graph else w.detach() for w in m]
        wg = [w if w.requires_grad else w.clone().requires_grad_() for w in m_start]
        err = _mlp(wg, k[:, :, t]) - v[:, :, t]
        grads = torch.autograd.grad(err.pow(2).sum(), wg, create_graph=graph)
        norm = torch.sqrt(sum(g.pow(2).sum((-1, -2)) for g in grads))[..., None, None]
        scale = torch.ones_like(norm)
        if normalized:
            e_sq = (err if graph else err.detach()).pow(2).sum(-1)[..., None, None]
            scale = e_sq / (2 * (norm**2 / 4 + NLMS_EPS * e_sq))
        if max_norm:
            scale = torch.minimum(scale, max_norm / norm)
        grads = [g * scale for g in grads]
        s = [
            eta[:, :, t, None, None] * sl - theta[:, :, t, None, None] * g
            for sl, g in zip(s, grads)
        ]
        m = [(1 - alpha[:, :, t, None, None]) * w + sl for w, sl in zip(m, s)]
        ys.append(_mlp(m, q[:, :, t]))
    return torch.stack(ys, dim=2), m, s


def token_by_token(
    q, k, v, theta, eta, alpha, weights, chunk: int = 1, max_norm: float = MAX_GRAD_NORM,
    normalized: bool = False,
) -> torch.Tensor:  # fmt: skip
    """:func:`token_rule` from the learned weights and zero momentum (a sequence start)."""
    m = [w.unsqueeze(0).expand(q.shape[0], -1, -1, -1).clone() for w in weights]
    s = [torch.zeros_like(w) for w in m]
    return token_rule(q, k, v, theta, eta, alpha, m, s, chunk, max_norm, normalized)[0]


def _memory_inputs(seq: int = 24, depth: int = 3):
    """q, k, v, gates and initial weights from a real NeuralMemory (its init, its gates)."""
    cfg = tiny_cfg("titans", "--model.titans.memory_depth", str(depth))
    torch.manual_seed(0)
    mem = NeuralMemory(cfg)
    init_parameters(mem, 0)
    x = torch.randn(2, seq, cfg.model.d_model)
    with torch.no_grad():
        q, k, v, _ = mem.project(x)
        theta, eta, alpha = mem.gate_values(x)
    return q, k, v, theta, eta, alpha, [w.detach() for w in mem.memory]


@pytest.mark.parametrize(
    "depth, max_norm, normalized",
    [(2, MAX_GRAD_NORM, False), (3, MAX_GRAD_NORM, False), (2, 0.0, False), (2, 0.0, True),
     (3, 0.1, True)],
)  # fmt: skip
def test_chunk_size_one_equals_token_by_token(depth, max_norm, normalized):
    """Also without the clip (``model.titans.memory_clip 0``) and with the normalised step
    (``model.titans.normalized_step``), each of which changes the read-out."""
    args = _memory_inputs(depth=depth)
    if normalized:  # larger values: the clip of 0.1 acts on some tokens only
        args = (*args[:2], args[2] * torch.linspace(0.1, 4.0, args[2].shape[2])[:, None], *args[3:])
    ref = token_by_token(*args, max_norm=max_norm, normalized=normalized)
    got, _ = memory_scan(*args, chunk_size=1, max_norm=max_norm, normalized=normalized)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    plain = memory_scan(*args, chunk_size=1)[0]
    if not max_norm or normalized:
        assert (got - plain).norm() > 1e-3 * got.norm()


def test_chunked_rule_and_its_approximation_error():
    """Chunk b: equals the plain rule with chunk-start gradients; the gap to b = 1 is reported."""
    q, k, v, theta, eta, alpha, w = _memory_inputs(seq=32)
    # sharper gates than the init so the approximation is visible
    theta = theta.clamp_min(0.3)
    exact = token_by_token(q, k, v, theta, eta, alpha, w)
    report = {}
    for b in (2, 4, 8, 16, 32):
        got, _ = memory_scan(q, k, v, theta, eta, alpha, w, chunk_size=b)
        ref = token_by_token(q, k, v, theta, eta, alpha, w, chunk=b)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        got = memory_scan(q, k, v, theta, eta, alpha, w, chunk_size=b, normalized=True)[0]
        ref = token_by_token(q, k, v, theta, eta, alpha, w, chunk=b, normalized=True)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        got, _ = memory_scan(q, k, v, theta, eta, alpha, w, chunk_size=b)
        report[b] = ((got - exact).norm() / exact.norm()).item()
        assert report[b] < 1.0
    print("relative read-out difference, chunked vs token-by-token:", report)
    assert report[2] > 0


def test_sequence_not_multiple_of_chunk():
    args = _memory_inputs(seq=23)
    torch.testing.assert_close(
        memory_scan(*args, chunk_size=5)[0], token_by_token(*args, chunk=5), rtol=1e-5, atol=1e-5
    )


def test_scan_continues_from_a_state():
    """Two halves, the second from the first's final state, equal one scan (MAC's segments)."""
    q, k, v, theta, eta, alpha, w = _memory_inputs(seq=24)
    whole, end = memory_scan(q, k, v, theta, eta, alpha, w, chunk_size=4)
    first, mid = memory_scan(*(t[:, :, :12] for t in (q, k, v, theta, eta, alpha)), w, 4)
    second, end2 = memory_scan(*(t[:, :, 12:] for t in (q, k, v, theta, eta, alpha)), w, 4, mid)
    torch.testing.assert_close(torch.cat((first, second), dim=2), whole, rtol=1e-6, atol=1e-6)
    for a, b in zip(end.layers, end2.layers):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "depth, from_state, max_norm, normalized",
    [(2, False, MAX_GRAD_NORM, False), (3, True, MAX_GRAD_NORM, False), (2, False, 0.0, False),
     (2, True, MAX_GRAD_NORM, True), (2, False, 0.0, True),
     pytest.param(2, True, 0.5, False, marks=pytest.mark.slow),
     pytest.param(3, False, 0.0, True, marks=pytest.mark.slow)]
)  # fmt: skip
def test_scan_gradients_match_finite_differences(depth, from_state, max_norm, normalized):
    """The scan's hand-written backward against finite differences in fp64: two sequences
    sharing the initial state (or each continuing from its own state, as MAC's segments), a
    ragged last chunk, the final state as an output too, and the per-token clip both active
    and inactive (small and large values in turn), at two clip norms and without the clip,
    with the plain and the normalised step."""
    g = torch.Generator().manual_seed(0)
    bsz, heads, seq, dim, hidden = 2, 2, 7, 3, 4

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k = (
        F.normalize(r(bsz, heads, seq, dim), dim=-1),
        F.normalize(r(bsz, heads, seq, dim), dim=-1),
    )
    scale = torch.tensor([0.05, 2.0] * seq, dtype=torch.float64)[:seq, None]
    v = r(bsz, heads, seq, dim) * scale
    gates = [torch.sigmoid(r(bsz, heads, seq) + b) for b in (-1.0, 1.0, -2.0)]
    sizes = [dim, *[hidden] * (depth - 1), dim]
    weights = [r(heads, o, i) / 2 for i, o in itertools.pairwise(sizes)]
    start = [r(bsz, heads, 2, *w.shape[1:]) / 2 for w in weights] if from_state else []
    inputs = [t.requires_grad_() for t in (q, k, v, *gates, *(start or weights))]

    def scan(q, k, v, theta, eta, alpha, *layers):
        state = MemoryState(list(layers)) if from_state else None
        y, end = memory_scan(
            q, k, v, theta, eta, alpha, list(layers), 3, state, max_norm=max_norm,
            normalized=normalized,
        )  # fmt: skip
        return (y, *end.layers)

    # the first chunk's steps (at the initial weights) fall on both sides of the clip
    m = [x[:, :, 0] for x in start] or [w.expand(bsz, -1, -1, -1) for w in weights]
    norms = []
    for t in range(3):
        wg = [w.detach().clone().requires_grad_() for w in m]
        err = _mlp(wg, k[:, :, t].detach()) - v[:, :, t].detach()
        grads = torch.autograd.grad(err.pow(2).sum(), wg)
        norm = torch.sqrt(sum(x.pow(2).sum((-1, -2)) for x in grads))  # per sequence, head
        if normalized:  # the normalised step's norm, as a multiple of theta
            e_sq = err.detach().pow(2).sum(-1)
            norm = norm * e_sq / (2 * (norm**2 / 4 + NLMS_EPS * e_sq))
        norms.append(norm)
    norms = torch.stack(norms)
    assert norms.min() < (max_norm or MAX_GRAD_NORM) < norms.max()
    assert torch.autograd.gradcheck(
        scan, inputs, atol=1e-7, rtol=1e-5, fast_mode=depth > 2 or normalized
    )


@pytest.mark.parametrize("chunk, blocks, max_norm", [(1, 4, 0.0), (3, 2, 0.0), (2, 3, 0.1)])
def test_truncated_backprop_equals_the_rule_with_its_state_detached(chunk, blocks, max_norm):
    """``backprop_chunks``: the forward unchanged, the hand-written backward equal to autograd's
    through the token-by-token rule with the state detached at every block of that many chunks
    (normalised step, with and without the clip, a ragged last chunk), and different from the
    untruncated gradient."""
    *args, weights = (t if isinstance(t, list) else t.double() for t in _memory_inputs(seq=19))
    args[2] = args[2] * torch.linspace(0.1, 4.0, 19, dtype=torch.float64)[:, None]
    inputs = [t.clone().requires_grad_() for t in (*args, *(w.double() for w in weights))]
    probe = torch.randn_like(args[0])

    def grads(y: torch.Tensor) -> list[torch.Tensor]:
        return torch.autograd.grad((y * probe).sum(), inputs)

    def scan(horizon: int) -> torch.Tensor:
        return memory_scan(
            *inputs[:6], inputs[6:], chunk, max_norm=max_norm, normalized=True,
            backprop_chunks=horizon,
        )[0]  # fmt: skip

    got = scan(blocks)
    m = [w.unsqueeze(0).expand(2, -1, -1, -1) for w in inputs[6:]]
    s = [torch.zeros_like(w) for w in m]
    rule = functools.partial(token_rule, *inputs[:6], m, s, chunk, max_norm, True, graph=True)
    ref = rule(cut=chunk * blocks)[0]
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)
    cut = grads(got)
    for a, b in zip(cut, grads(ref)):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)
    full = grads(scan(0))
    for a, b in zip(full, grads(rule()[0])):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)
    assert any((a - b).norm() > 1e-6 * a.norm() for a, b in zip(full, cut))


def test_memory_module_passes_backprop_chunks_to_the_scan():
    """``model.titans.backprop_chunks`` reaches the scan: same read-out, other gate gradients."""
    x = torch.randn(2, 24, tiny_cfg("titans").model.d_model)
    outs = []
    for cut in ("0", "2"):
        mem = NeuralMemory(tiny_cfg("titans", "--model.titans.backprop_chunks", cut))
        init_parameters(mem, 0)
        y = mem(x)
        y.pow(2).sum().backward()
        outs.append((y.detach(), mem.gates.weight.grad))
    torch.testing.assert_close(outs[0][0], outs[1][0])
    assert (outs[0][1] - outs[1][1]).norm() > 1e-6 * outs[0][1].norm()


@pytest.mark.parametrize(
    "seq, window, persistent",
    [(32, 8, 0), (32, 8, 3), (29, 5, 1), (24, 8, 0), (32, 32, 0), (20, 32, 2), (16, 1, 0)],
)
def test_window_attention_equals_dense_softmax(seq, window, persistent):
    """:func:`window_attention` (blocks, ragged last block, a window covering the sequence,
    window 1, persistent tokens) equals softmax attention written plainly with the dense window
    mask: outputs and gradients of q, k, v and the persistent pairs, fp64."""
    from tapered_megatron.models.titans import window_attention

    g = torch.Generator().manual_seed(0)
    bsz, heads, dim = 2, 3, 4
    inputs = [torch.randn(bsz, seq, heads, dim, generator=g, dtype=torch.float64) for _ in "qkv"]
    if persistent:
        inputs.append(torch.randn(heads, 2, persistent, dim, generator=g, dtype=torch.float64))
    inputs = [t.requires_grad_() for t in inputs]

    def plain(q, k, v, p=None):
        t = torch.arange(seq)
        allowed = (t[None] <= t[:, None]) & (t[:, None] - t[None] < window)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        if p is not None:
            k = torch.cat((p[:, 0].expand(bsz, -1, -1, -1), k), 2)
            v = torch.cat((p[:, 1].expand(bsz, -1, -1, -1), v), 2)
            allowed = torch.cat((torch.ones(seq, persistent, dtype=torch.bool), allowed), 1)
        scores = (q @ k.mT / dim**0.5).masked_fill(~allowed, float("-inf"))
        return (scores.softmax(-1) @ v).transpose(1, 2)

    got = window_attention(*inputs[:3], window, inputs[3] if persistent else None)
    ref = plain(*inputs)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    expected = torch.autograd.grad(ref, inputs, grad)
    for a, b in zip(torch.autograd.grad(got, inputs, grad), expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gated_head_norms_equal_plain_ops():
    """MAG's/MAC's gated output (one autograd node) equals two per-head RMS norms with gains, a
    sigmoid and a product: output and the gradients of both inputs and both gains, fp64, the
    memory read-out non-contiguous as the scan returns it; finite-difference check."""
    from tapered_megatron.models.titans import _head_rms_norm, gated_head_norms

    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    inputs = [r(2, 5, 3, 4), r(2, 3, 5, 4).transpose(1, 2), 1 + r(12), 1 + r(12)]
    inputs = [t.requires_grad_() for t in inputs]

    def plain(a, m, ga, gm):
        return _head_rms_norm(a, ga, 1e-5) * torch.sigmoid(_head_rms_norm(m, gm, 1e-5))

    got, ref = gated_head_norms(*inputs, 1e-5), plain(*inputs)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    grad = r(2, 5, 3, 4)
    expected = torch.autograd.grad(ref, inputs, grad)
    for a, b in zip(torch.autograd.grad(got, inputs, grad), expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *t: gated_head_norms(*t, 1e-5), inputs)
    # as under bf16 autocast: bf16 activations, fp32 gains; gradients in each input's dtype
    mixed = [
        t.detach().to(d).requires_grad_()
        for t, d in zip(inputs, [torch.bfloat16] * 2 + [torch.float32] * 2)
    ]
    got, ref = gated_head_norms(*mixed, 1e-5), plain(*mixed)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    grads = torch.autograd.grad(got, mixed, grad.float())
    for a, b, t in zip(grads, torch.autograd.grad(ref, mixed, grad.float()), mixed):
        assert a.dtype == t.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("width", [1, 4])
def test_conv_silu_normalize_equals_plain_ops(width):
    """The fused convolution + SiLU + per-head l2 normalisation equals ``conv1d`` with left zero
    padding (or a prefix), ``F.silu`` and ``F.normalize``: outputs and the gradients of x, the
    weight and the prefix in fp64, within round-off; its backward passes a finite-difference
    check, a head whose activations vanish (the clamped norm) included."""
    from tapered_megatron.models.titans import conv_silu_normalize

    g = torch.Generator().manual_seed(0)
    bsz, seq, heads, dim = 2, 9, 3, 4  # heads: q, k normalised, v not
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    x, prefix, w = r(bsz, seq, heads * dim), r(bsz, width - 1, heads * dim), r(heads * dim, width)
    # the first head's norm is clamped (< 1e-12) where silu(-35 + noise) ~ -2e-14
    w[:dim] = F.one_hot(torch.tensor(width - 1), width).double()  # the current token only
    x[1, 2:5, :dim] = -35.0 + r(3, dim)

    def activations(x, w, pre):
        padded = F.pad(x, (0, 0, width - 1, 0)) if pre is None else torch.cat((pre, x), 1)
        a = F.conv1d(padded.transpose(1, 2), w.unsqueeze(1), groups=heads * dim).transpose(1, 2)
        return F.silu(a).unflatten(-1, (heads, dim))

    def plain(x, w, pre):
        a = activations(x, w, pre)
        return torch.cat((F.normalize(a[:, :, :2], dim=-1), a[:, :, 2:]), 2).flatten(-2)

    grad = r(bsz, seq, heads * dim)
    for pre in (None, prefix):
        inputs = [t.clone().requires_grad_() for t in (x, w) + ((pre,) if pre is not None else ())]
        args = (*inputs[:2], inputs[2] if pre is not None else None)
        got = conv_silu_normalize(*args, dim, 2 * dim)
        ref = plain(*args)
        norms = activations(*args)[:, :, 0].norm(dim=-1)
        assert (norms < 1e-12).any()  # the clamped case is there: cannot pass vacuously
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
        for a, b in zip(
            torch.autograd.grad(got, inputs, grad), torch.autograd.grad(ref, inputs, grad)
        ):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert torch.autograd.gradcheck(
            lambda *t: conv_silu_normalize(t[0], t[1], t[2] if len(t) > 2 else None, dim, 2 * dim),
            inputs,
        )


def mac_reference(mixer: TitansMixer, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """Titans MAC written plainly: per segment, retrieve with the memory at the segment start
    (plain MLP), memory tokens, explicit softmax attention over [persistent | memory tokens |
    segment] with the causal masks, then :func:`token_rule` over ``x + W_y attn``."""
    mem = mixer.memory
    bsz, seq, _ = x.shape
    h, hd, win = mixer.local_heads, mixer.head_dim, mixer.window
    n = h * hd
    queries = mem.queries(x)
    aq, ak, av = mixer._qkv(x)
    m = [w.unsqueeze(0).expand(bsz, -1, -1, -1).clone() for w in mem.memory]
    s = [torch.zeros_like(w) for w in m]
    tail, attn, read = None, [], []
    for start in range(0, seq, win):
        c = min(win, seq - start)
        hm = torch.stack([_mlp(m, queries[:, :, start + j]) for j in range(c)], dim=1)
        hm = hm * torch.rsqrt(hm.pow(2).mean(-1, keepdim=True) + mixer.eps)
        tokens = mixer.mem_tokens(hm.reshape(bsz, c, n))
        mk, mv = F.linear(tokens, mixer.attn_qkv.weight[n:]).view(bsz, c, 2, h, hd).unbind(2)
        q = mixer.rope(aq[:, start : start + c]).transpose(1, 2)
        keys = torch.cat((mixer.rope(mk), mixer.rope(ak[:, start : start + c])), 1).transpose(1, 2)
        vals = torch.cat((mv, av[:, start : start + c]), 1).transpose(1, 2)
        allowed = torch.ones(c, c, dtype=torch.bool).tril().repeat(1, 2)
        if mixer.persistent is not None:
            p = mixer.persistent.unsqueeze(0).expand(bsz, -1, -1, -1, -1)
            keys, vals = torch.cat((p[:, :, 0], keys), 2), torch.cat((p[:, :, 1], vals), 2)
            allowed = torch.cat((torch.ones(c, p.shape[3], dtype=torch.bool), allowed), 1)
        scores = (q @ keys.mT) / hd**0.5
        a = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ vals).transpose(1, 2)
        y = x[:, start : start + c] + mixer.attn_proj(a.reshape(bsz, c, n))
        qm, km, vm, tail = mem.project(y, tail)
        r, m, s = token_rule(qm, km, vm, *mem.gate_values(y), m, s, chunk)
        attn.append(a)
        read.append(r.transpose(1, 2))
    from tapered_megatron.models.titans import _head_rms_norm

    a, r = torch.cat(attn, 1), torch.cat(read, 1)
    gate = torch.sigmoid(_head_rms_norm(r, mixer.mem_norm, mixer.eps))
    o = _head_rms_norm(a, mixer.attn_norm, mixer.eps) * gate
    return mixer.out(o.reshape(bsz, seq, -1))


@pytest.mark.parametrize("chunk, seq", [(1, 32), (4, 30)])
def test_mac_equals_plain_reference(chunk, seq):
    """chunk 1: the token-by-token rule exactly; chunk 4: the chunk-start gradient rule; a
    sequence that ends inside a segment (30 = 3 segments of 8 + 6)."""
    cfg = tiny_cfg(
        "titans",
        *("--model.titans.variant", "mac", "--model.titans.persistent_tokens", "2"),
        *("--model.titans.chunk_size", str(chunk), "--model.seq_len", str(seq)),
    )
    torch.manual_seed(0)
    mixer = TitansMixer(cfg, 0)
    init_parameters(mixer, 0)
    x = torch.randn(2, seq, cfg.model.d_model)
    with torch.no_grad():
        got = mixer(x)
    ref = mac_reference(mixer, x, chunk)
    torch.testing.assert_close(got, ref.detach(), rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------
# the model


@pytest.mark.parametrize(
    "variant, persistent", [("mag", 0), ("mal", 0), ("lmm", 0), ("mac", 0), ("mac", 2), ("mag", 2)]
)
def test_causal_across_chunk_boundaries(variant, persistent):
    cfg = tiny_cfg(
        "titans",
        "--model.titans.variant",
        variant,
        "--model.titans.persistent_tokens",
        str(persistent),
    )
    torch.manual_seed(0)
    model = build_model(cfg).train()
    # chunk 4, window (MAC: segment) 8: cut points on, before and after chunk and window
    # boundaries
    assert_causal(model, 256, 32, [0, 3, 4, 7, 8, 12, 17, 30])


def test_gradients_reach_gates_and_memory():
    cfg = tiny_cfg("titans")
    model = build_model(cfg)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    lm_loss(model(ids[:, :-1]), ids[:, 1:]).backward()
    mixer = model.layers[0].mixer
    assert isinstance(mixer, TitansMixer)
    mem = mixer.memory
    heads = cfg.model.heads
    gw = mem.gates.weight.grad.view(3, heads, -1)
    gb = mem.gate_bias.grad.view(3, heads)
    for i, name in enumerate(("theta", "eta", "alpha")):
        assert gw[i].abs().sum() > 0, f"no gradient reaches the {name} projection"
        assert gb[i].abs().sum() > 0, f"no gradient reaches the {name} bias"
    for p in (*mem.memory, mem.conv, mem.qkv.weight, mixer.attn_qkv.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_tapered_and_uniform_budgets_match():
    for arch in ("titans", "hope_attention"):
        base = ["--model.arch", arch, "--model.layers", "8", "--model.d_ff", "688"]
        tapered = load_config("quickstart", [*base, "--taper.schedule", "cosine"])
        uniform = load_config("quickstart", [*base, "--taper.schedule", "uniform"])
        dev = tapered.taper_plan.deviation - uniform.taper_plan.deviation
        diff = count_model(tapered).params_total - count_model(uniform).params_total
        assert diff == 3 * tapered.model.d_model * dev
        meta = build_model(tapered, device="meta")
        assert sum(p.numel() for p in meta.parameters()) == count_model(tapered).params_total


@pytest.mark.distributed
def test_tp2_equals_tp1_titans_and_hope():
    """One launch of two processes covers every Titans variant (MAC and persistent tokens
    included) and hope_attention (the CMS's in-context updates: association and teach signal,
    every W_2 step norm, learned and constant rates, folded windows), to keep the default run
    short."""
    assert_tp_equal(
        {
            "mag": ["titans"],
            "mal": ["titans", "--model.titans.variant", "mal"],
            "lmm": ["titans", "--model.titans.variant", "lmm"],
            "mac": [
                "titans",
                "--model.titans.variant",
                "mac",
                "--model.titans.persistent_tokens",
                "2",
            ],
            "mag_persistent": ["titans", "--model.titans.persistent_tokens", "2"],
            "hope": ["hope_attention"],
            "hope_teach": ["hope_attention", "--model.hope.update", "teach"],
            "hope_own": ["hope_attention", "--model.hope.step_norm", "own"],
            # input, constant rates; seq 300: folded windows, a short last period; init std
            # 0.07: a third of the inner gradients clipped (the clip's gradient across ranks)
            "hope_input": [
                "hope_attention",
                *("--model.hope.step_norm", "input", "--model.hope.rate", "constant"),
                *("--model.seq_len", "300", "--model.init_std", "0.07"),
            ],
        }
    )


def test_loss_decreases_on_real_text():
    assert_learns_real_text("titans", 160)


@pytest.mark.parametrize("arch", ["titans", "hope_attention"])
def test_pipeline_form_equals_plain_model(arch):
    from tapered_megatron.models import pipeline_layer_specs

    cfg = tiny_cfg(arch)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = build_model(cfg)(ids)
        for unit in ("layer", "sublayer"):
            h = ids
            for spec in pipeline_layer_specs(cfg, unit):
                h = spec.build()(h)
            torch.testing.assert_close(h.logits(), ref, rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["lmm", "mac"])
def test_bf16_autocast_memory_matches_fp64_at_4096(variant):
    """The memory state stays fp32 under bf16 autocast: over 4096 tokens the read-out of the
    memory branch (MAC: the whole mixer) stays within 1 % of the same module run in fp64.

    Head dim 64 (as in the presets): at the tiny test head dim 16 the fresh memory is chaotic
    (a 0.2 % input change grows to 50 % of the read-out within 1000 tokens), so no dtype could
    match there; at head dim 64 the same perturbation stays at 0.3 %."""
    seq = 4096
    cfg = tiny_cfg(
        "titans",
        *("--model.d_model", "128", "--model.seq_len", str(seq), "--model.titans.chunk_size", "64"),
        *("--model.titans.window", "1024", "--model.titans.variant", variant),
    )
    torch.manual_seed(0)
    mixer = TitansMixer(cfg, 0)
    init_parameters(mixer, 0)
    module = mixer.memory if variant == "lmm" else mixer
    x = torch.randn(1, seq, cfg.model.d_model, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = module(x)
        high = module.double()(x.double())
    assert low.dtype == torch.bfloat16
    err = ((low.double() - high).norm() / high.norm()).item()
    print(f"{variant}: bf16 autocast vs fp64 relative error of the read-out at {seq}: {err:.4f}")
    assert err <= 0.01


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["titans", "hope_attention"])
def test_compile_reaches_every_tapered_layer(arch, monkeypatch):
    """A tapered model with more distinct layer widths (12) than ``torch._dynamo``'s default
    recompile limit (8): the memory blocks break the graph, so their functions compile once per
    width; after :func:`allow_layer_recompiles` (as ``train.compile`` calls it) no function hits
    the limit (which would leave the remaining layers eager) and the loss equals eager mode's."""
    import torch._dynamo

    from tapered_megatron.models import allow_layer_recompiles

    torch._dynamo.reset()
    for key in ("recompile_limit", "accumulated_recompile_limit"):  # restored after the test
        monkeypatch.setattr(torch._dynamo.config, key, getattr(torch._dynamo.config, key))
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    cfg = tiny_cfg(arch, "--model.layers", "12", "--model.d_ff", "512", "--train.compile", "true")
    assert len(set(cfg.taper_plan.widths)) == 12 > torch._dynamo.config.recompile_limit
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    ref = build_model(cfg)(ids[:, :-1], ids[:, 1:])
    allow_layer_recompiles(cfg)
    loss = torch.compile(build_model(cfg))(ids[:, :-1], ids[:, 1:])
    loss.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("titans", []),
        ("titans", ["--model.titans.variant", "mac", "--model.titans.persistent_tokens", "2"]),
        ("titans", ["--model.titans.normalized_step", "true", "--model.titans.memory_clip", "0"]),
        ("hope_attention", []),
    ],
)
def test_compiled_model_matches_eager(arch, overrides):
    """``torch.compile`` of the whole model (as ``train.compile`` does): the memory loops run
    eagerly (Titans' chunk step compiled on its own), loss and gradients match eager mode."""
    cfg = tiny_cfg(arch, *overrides)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    eager = build_model(cfg)
    ref = eager(ids[:, :-1], ids[:, 1:])
    ref.backward()
    model = build_model(cfg.with_overrides(["--train.compile", "true"]))
    loss = torch.compile(model)(ids[:, :-1], ids[:, 1:])
    loss.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(eager.named_parameters(), model.parameters()):
        assert ((a.grad - b.grad).norm() / a.grad.norm()).item() < 1e-4, name


@pytest.mark.parametrize("caps", [(1.0, 1.0), (0.1, 0.95)])
def test_gate_caps_bound_theta_and_eta_and_keep_their_init(caps):
    """``model.titans.max_step`` / ``max_momentum`` scale theta's / eta's sigmoid: both start at
    the uncapped gates' values (alpha's init unchanged) and never exceed their caps, however
    large the gate logits get."""
    step, momentum = caps
    over = ["--model.titans.max_step", str(step), "--model.titans.max_momentum", str(momentum)]
    cfg = tiny_cfg("titans", *over)
    mem = NeuralMemory(cfg)
    init_parameters(mem, 0)
    plain = NeuralMemory(tiny_cfg("titans"))
    init_parameters(plain, 0)
    x = torch.randn(1, 5, cfg.model.d_model)
    with torch.no_grad():
        mem.gates.weight.zero_()
        theta, eta, alpha = mem.gate_values(x)
        torch.testing.assert_close(theta, torch.full_like(theta, GATE_INIT["theta"]))
        torch.testing.assert_close(eta, torch.full_like(eta, GATE_INIT["eta"]))
        plain.gates.weight.zero_()
        torch.testing.assert_close(alpha, plain.gate_values(x)[2])
        mem.gate_bias.fill_(30.0)
        theta, eta, _ = mem.gate_values(x)
    torch.testing.assert_close(theta, torch.full_like(theta, step))
    torch.testing.assert_close(eta, torch.full_like(eta, momentum))


def test_clip_tally_counts_the_tokens_the_clip_scales_down():
    """One chunk (every gradient at the initial weights): the tally's clipped count equals the
    number of (token, head) gradients whose Frobenius norm exceeds the clip, counted from
    autograd's per-token gradients; the mixer's ``diagnostics()`` reports and resets it."""
    q, k, v, theta, eta, alpha, w = _memory_inputs(seq=24)
    v = v * torch.linspace(0.1, 20.0, 24)[:, None]  # both sides of the clip
    tally: list[torch.Tensor] = []
    memory_scan(q, k, v, theta, eta, alpha, w, 24, clip_tally=tally)
    m = [x.unsqueeze(0).expand(q.shape[0], -1, -1, -1).clone() for x in w]
    clipped = 0
    for t in range(24):
        wg = [x.clone().requires_grad_() for x in m]
        loss = (_mlp(wg, k[:, :, t]) - v[:, :, t]).pow(2).sum()
        norm = torch.sqrt(sum(g.pow(2).sum((-1, -2)) for g in torch.autograd.grad(loss, wg)))
        clipped += int((norm > MAX_GRAD_NORM).sum())
    n = q.shape[0] * q.shape[1] * 24
    assert 0 < clipped < n
    assert tally[0].tolist() == [clipped, n]
    memory_scan(q, k, v, theta, eta, alpha, w, 24, clip_tally=tally)  # added to the tally
    assert tally[0].tolist() == [2 * clipped, 2 * n]
    unclipped: list[torch.Tensor] = []
    memory_scan(q, k, v, theta, eta, alpha, w, 24, clip_tally=unclipped, max_norm=0.0)
    assert unclipped[0].tolist() == [0, n]  # memory_clip 0: no clip
    # the normalised step: the clip acts where it scales the step below the rule's
    normalized = 0
    for t in range(24):
        wg = [x.clone().requires_grad_() for x in m]
        err = _mlp(wg, k[:, :, t]) - v[:, :, t]
        norm = torch.sqrt(
            sum(g.pow(2).sum((-1, -2)) for g in torch.autograd.grad(err.pow(2).sum(), wg))
        )
        e_sq = err.detach().pow(2).sum(-1)
        normalized += int(
            (MAX_GRAD_NORM / norm < e_sq / (2 * (norm**2 / 4 + NLMS_EPS * e_sq))).sum()
        )
    assert 0 < normalized < clipped
    tally = []
    memory_scan(q, k, v, theta, eta, alpha, w, 24, clip_tally=tally, normalized=True)
    assert tally[0].tolist() == [normalized, n]

    cfg = tiny_cfg("titans")
    mixer = TitansMixer(cfg, 0)
    init_parameters(mixer, 0)
    x = torch.randn(2, 40, cfg.model.d_model)
    mixer.eval()(x)
    assert take_diagnostics(mixer) == {}  # evaluation forwards are not counted
    mixer.train()(x)
    mixer.train()(x)
    share = take_diagnostics(mixer)["memory_clip"]
    assert 0.0 <= share <= 1.0 and take_diagnostics(mixer) == {}


def test_reproduction_titans_runs_train_without_gradient_spikes():
    """Every saved (c) Titans run that keeps its gradient-norm curve: no norm above 100, none
    after the first 10 % of iterations above 10x the run's median, and the per-token clip (its
    logged share) active on a minority of token-heads."""
    runs = Path(__file__).resolve().parents[1] / "docs" / "results" / "runs"
    recs = [json.loads(f.read_text()) for f in sorted(runs.glob("titans-*/metrics.json"))]
    recs = [r for r in recs if "grad_norm" in r]
    assert recs, "no saved Titans run with its grad_norm curve"
    for r in recs:
        norms = r["grad_norm"]
        assert len(norms) == r["iterations"], r["run"]
        median = statistics.median(n for _, n in norms)
        late = [n for it, n in norms if it > r["iterations"] / 10]
        assert max(n for _, n in norms) <= 100 and max(late) <= 10 * median, r["run"]
        assert all(share < 0.5 for _, share in r.get("memory_clip", [])), r["run"]


@pytest.mark.xfail(
    strict=True,
    reason="titans-cosine-1.5-0.5-s4 (trained at 2185fc8) costs 0.0195 nats at 512 tokens (0.0140 "
    "at 2048); the other 14 runs 0.0228-0.0786",
)
def test_reproduction_titans_memory_does_the_work():
    """Every saved (c) Titans run: switching the memory off costs at least 0.02 nats at the
    training length (the memory probe over the validation split)."""
    runs = Path(__file__).resolve().parents[1] / "docs" / "results" / "runs"
    recs = [json.loads(f.read_text()) for f in sorted(runs.glob("titans-*/metrics.json"))]
    assert len(recs) == 15
    for r in recs:
        probe = {p["seq_len"]: p["gap"] for p in r["memory_probe"]}
        assert probe[r["model"]["seq_len"]] >= 0.02, (r["run"], probe)


@pytest.mark.slow
def test_gpu_preset_memory_trains_stably_at_its_sequence_length(tmp_path, monkeypatch):
    """``titans_440m``'s sequence length and memory settings (4096 tokens, a 1024-token window,
    the GPU presets' memory rule) at reduced width (d_model 256, 2 layers, the ``titans_cpu``
    recipe) through its 30 warm-up iterations: every gradient finite, none above 100, none after
    the first 10 % above 10x the median, no loss spike, the loss falling
    (``scripts/bench_titans_stability.py`` runs the same for longer)."""
    import importlib.util

    scripts = Path(__file__).resolve().parents[1] / "scripts"
    monkeypatch.syspath_prepend(str(scripts))  # the script imports bench_common from its folder
    spec = importlib.util.spec_from_file_location(
        "bench_titans_stability", scripts / "bench_titans_stability.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.train("titans_440m", 30, 256, 2, tmp_path, []) == 0
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    result = bench.summarise([json.loads(line) for line in lines])
    print(result)
    assert result["iterations"] == 30 and result["stable"], result
    assert result["loss_last10"] < result["loss_first10"] - 0.5, result
