"""Exports load with transformers (AutoModelForCausalLM / AutoTokenizer / pipeline, remote code
importing this package) and behave like our own module; the key/value cache is exact."""

from __future__ import annotations

import os

import pytest
import sentencepiece as spm
import torch
from tiny_export import ARCHS, VOCAB, tiny_config, tiny_export, tiny_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # the dev extra installs it: missing is a failure, not a skip

from tapered_megatron.data.sample_corpus import sample_corpus_docs
from tapered_megatron.hf.tokenization import EDGE_CASES
from tapered_megatron.models import build_model


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> str:
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def exports(tok, tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    return {arch: tiny_export(root / arch, arch, tok) for arch in ARCHS}


def _ids(seed: int, shape=(2, 40)) -> torch.Tensor:
    return torch.randint(4, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_from_pretrained_logits_equal_our_module(arch, exports):
    out, ours = exports[arch]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert type(hf).__name__ == "TaperedForCausalLM"
    assert dict(hf.state_dict()).keys() == dict(ours.state_dict()).keys()
    ids = _ids(0)
    with torch.no_grad():
        want = ours(ids)[..., :VOCAB]
        got = hf(ids).logits
        labels_loss = hf(ids, labels=ids).loss
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5
    # HF's label convention (unshifted labels) gives our own next-token loss
    with torch.no_grad():
        assert abs(labels_loss.item() - ours(ids[:, :-1], ids[:, 1:]).item()) <= 1e-5


def test_hope_teach_signal_runs_under_transformers(tok, tmp_path):
    """``hope.update = teach`` needs the first pass of the whole model; the HF forward runs it
    (logits equal ours, and differ from the chain without the teach signal)."""
    from tapered_megatron.models.hope import ContinuumMemory

    out, ours = tiny_export(
        tmp_path / "teach",
        "hope_attention",
        tok,
        *("--model.hope.update", "teach", "--model.hope.lr", "1", "--model.hope.rate_init", "0.9"),
    )  # large initial steps, so the teach signal visibly moves a fresh model
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    ids = _ids(3)
    with torch.no_grad():
        want = ours(ids)[..., :VOCAB]
        got = hf(ids).logits
        for m in ours.modules():
            if isinstance(m, ContinuumMemory):
                m.teach_signal = None
        h = ours.embedding(ids)
        for block in ours.layers:
            h = block(h)
        static = ours.head(h).logits()[..., :VOCAB]
    assert (got - want).abs().max().item() <= 1e-5
    assert (static - want).abs().max().item() > 1e-3


@pytest.mark.parametrize("arch", ["transformer", "gated_attention"])
def test_kv_cache_steps_equal_full_forward(arch, exports):
    out, _ = exports[arch]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ids = _ids(1, (2, 150))  # past the 128-token RoPE tables of training
    with torch.no_grad():
        full = hf(ids, use_cache=False).logits
        step = hf(ids[:, :20], use_cache=True)
        parts, cache = [step.logits], step.cache
        for lo, hi in ((20, 21), (21, 60), (60, 61), (61, 150)):  # single tokens and chunks
            step = hf(ids[:, lo:hi], cache=cache, use_cache=True)
            parts.append(step.logits)
            cache = step.cache
    assert cache.get_seq_length() == 150
    assert (torch.cat(parts, dim=1) - full).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch", ["transformer", "gated_attention"])  # those with a KV cache
def test_greedy_generate_with_and_without_cache(arch, exports):
    out, _ = exports[arch]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert hf.supports_kv_cache  # else both calls would take the same path
    prompt = _ids(2, (1, 12))
    kw = {"max_new_tokens": 24, "min_new_tokens": 24, "do_sample": False}
    with torch.no_grad():
        cached = hf.generate(prompt, use_cache=True, **kw)
        plain = hf.generate(prompt, use_cache=False, **kw)
    assert cached.shape == (1, 36)
    assert cached.tolist() == plain.tolist()


@pytest.mark.parametrize("arch", ["titans", "hope_attention"])
def test_memory_architectures_generate_without_a_cache(arch, exports):
    """Titans and Hope keep no key/value cache: ``use_cache`` is ignored and greedy generation
    equals the argmax of full forwards, token by token."""
    out, ours = exports[arch]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert not hf.supports_kv_cache
    prompt = _ids(2, (1, 12))
    with torch.no_grad():
        got = hf.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        want = prompt
        for _ in range(6):
            nxt = ours(want)[:, -1, :VOCAB].argmax(-1, keepdim=True)
            want = torch.cat([want, nxt], dim=1)
    assert got.tolist() == want.tolist()


def test_auto_tokenizer_and_pipeline(exports, tok):
    out, _ = exports["transformer"]
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    sp = spm.SentencePieceProcessor(model_file=tok)
    for text in [*EDGE_CASES, *sample_corpus_docs(200)[150:]]:  # documents it was not trained on
        ids = sp.encode(text)
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == ids
        assert hf_tok.decode(ids) == sp.decode(ids)
    assert (hf_tok.eos_token_id, hf_tok.pad_token_id) == (sp.eos_id(), sp.pad_id())
    gen = transformers.pipeline("text-generation", model=str(out), trust_remote_code=True)
    text = gen("To be, or not", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text.startswith("To be, or not")


def test_padding(exports):
    out, _ = exports["transformer"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    ids = _ids(3, (2, 10))
    right = torch.ones_like(ids)
    right[1, 6:] = 0  # right padding: earlier positions are unaffected, accepted
    with torch.no_grad():
        assert torch.equal(hf(ids, attention_mask=right).logits, hf(ids).logits)
        left = right.flip(1)
        with pytest.raises(ValueError, match="left padding"):
            hf(ids, attention_mask=left)


def test_uniform_transformer_equals_llama_for_causal_lm(tmp_path):
    """A uniform-taper transformer is Llama: the same weights in ``LlamaForCausalLM`` give our
    logits (fp32, within 1e-5); a tapered model is refused."""
    from tapered_megatron.hf.llama import to_llama

    cfg = tiny_config("transformer", None, "--taper.schedule", "uniform")
    ours = build_model(cfg).eval()
    llama = to_llama(cfg, dict(ours.state_dict()))
    ids = _ids(3)
    with torch.no_grad():
        want = ours(ids)[..., :VOCAB]
        got = llama(ids).logits
    assert (got - want).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="uniform-taper transformer"):
        to_llama(tiny_config("transformer", None), dict(ours.state_dict()))


GQA_DEFAULT = ("transformer", "titans")  # the attention with a cache, repeated k/v without


@pytest.mark.parametrize(
    "arch", [a if a in GQA_DEFAULT else pytest.param(a, marks=pytest.mark.slow) for a in ARCHS]
)
def test_grouped_query_export_loads_and_generates_with_a_cache(arch, tok, tmp_path):
    """``model.kv_heads`` 2 of 4 heads: the export loads (``num_key_value_heads`` 2), its logits
    equal ours, and the attention-only architectures cache 2 key/value heads per layer, the
    cached steps and greedy generation equal the uncached ones."""
    out, ours = tiny_export(tmp_path / arch, arch, tok, "--model.kv_heads", "2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert hf.config.num_key_value_heads == 2 and hf.config.num_attention_heads == 4
    ids = _ids(4)
    with torch.no_grad():
        want = ours(ids)[..., :VOCAB]
        assert (hf(ids).logits - want).abs().max().item() <= 1e-5
        if not hf.supports_kv_cache:
            return
        step = hf(ids[:, :25], use_cache=True)
        last = hf(ids[:, 25:], cache=step.cache, use_cache=True)
        cached = torch.cat((step.logits, last.logits), dim=1)
        assert (cached - want).abs().max().item() <= 1e-5
        assert last.cache.layers[0].keys.shape[1] == 2  # [b, kv_heads, s, head_dim]
        prompt, kw = ids[:1, :12], {"max_new_tokens": 16, "min_new_tokens": 16, "do_sample": False}
        assert hf.generate(prompt, use_cache=True, **kw).tolist() == (
            hf.generate(prompt, use_cache=False, **kw).tolist()
        )


@pytest.mark.parametrize("kv", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_grouped_query_transformer_equals_llama_for_causal_lm(kv, tok, tmp_path):
    """A uniform-taper transformer with ``kv`` key/value heads is Llama with
    ``num_key_value_heads = kv``: the exported weights give our logits in ``LlamaForCausalLM``
    (within 1e-5), and its cached greedy generation equals ours."""
    from safetensors.torch import load_file

    from tapered_megatron.hf.llama import to_llama

    out, ours = tiny_export(
        tmp_path / "export", "transformer", tok, "--taper.schedule", "uniform",
        "--model.kv_heads", str(kv),
    )  # fmt: skip
    cfg = ours.cfg
    llama = to_llama(cfg, load_file(str(out / "model.safetensors")))
    assert llama.config.num_key_value_heads == kv
    ids = _ids(5)
    with torch.no_grad():
        want = ours(ids)[..., :VOCAB]
        assert (llama(ids).logits - want).abs().max().item() <= 1e-5
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
        prompt, kw = ids[:1, :12], {"max_new_tokens": 16, "min_new_tokens": 16, "do_sample": False}
        got = llama.generate(prompt, use_cache=True, **kw)
        assert got.tolist() == hf.generate(prompt, use_cache=True, **kw).tolist()
