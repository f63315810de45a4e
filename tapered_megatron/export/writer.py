"""Write a consolidated checkpoint as a Hugging Face-style directory.

``OUT/`` after :func:`export_checkpoint`:

* ``model.safetensors``: full weights (fp32, or bf16 with ``--dtype bfloat16``) under the
  single-process names (see :mod:`tapered_megatron.checkpoint.consolidate`); embedding and LM-head
  keep the padded vocabulary rows of training (``config.json``: ``padded_vocab_size``), logits
  are returned over ``vocab_size`` only. A model larger than ``--max_shard_size`` is split as
  Hugging Face's ``save_pretrained`` splits it (``huggingface_hub``'s planner): shards
  ``model-00001-of-0000N.safetensors`` and the index ``model.safetensors.index.json``. Tensors
  are read from the checkpoint and written one at a time, straight into their shard, so the
  export holds about one tensor in memory, never the whole model;
* ``config.json``: :class:`~tapered_megatron.hf.configuration.TaperedConfig` (the run's whole
  configuration, the taper widths, ``auto_map`` to the two code files below, ``training``:
  iteration, tokens and source tag);
* ``configuration_tapered.py`` / ``modeling_tapered.py``: two import lines each (the model code
  is this package's, never copied), for ``trust_remote_code=True``;
* ``tokenizer.json`` + ``tokenizer_config.json`` (fast tokenizer, checked to encode exactly as
  sentencepiece) and ``tokenizer.model`` (the sentencepiece model), when the run's tokenizer is
  known; ``generation_config.json``; ``README.md``, the model card;
* ``manifest.json``: the size and sha256 of every other file (the format of a checkpoint's
  ``complete``, :func:`~tapered_megatron.checkpoint.manifest.write_manifest`), checked by our
  loaders before they read anything else.

Everything is written into a temporary directory beside ``OUT`` and renamed into place at the
end, so a failure leaves no partial ``OUT``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from tapered_megatron.architectures import resolve_architecture
from tapered_megatron.checkpoint.consolidate import CheckpointRef, resolve_checkpoint, weights
from tapered_megatron.checkpoint.manifest import EXPORT_MANIFEST, manifest, write_manifest
from tapered_megatron.config import Config
from tapered_megatron.export.load import (
    DTYPES,
    WEIGHTS_INDEX,
    ExportError,
    check_dtype,
    check_tokenizer,
    run_tokenizer,
)
from tapered_megatron.models import build_model

CONFIG_STUB = '''"""Config of a tapered-megatron export (the code is tapered_megatron's)."""

from tapered_megatron.hf.configuration import TaperedConfig

__all__ = ["TaperedConfig"]
'''
MODELING_STUB = '''"""Model of a tapered-megatron export (the code is tapered_megatron's)."""

from tapered_megatron.hf.modeling import TaperedForCausalLM

__all__ = ["TaperedForCausalLM"]
'''
TOKENIZER_CHECK_DOCS = 200  # sample-corpus documents the fast tokenizer is checked on
MAX_SHARD_SIZE = "5GB"  # per safetensors file; Hugging Face's size strings or bytes
_SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16"}
_WRITE_CHUNK = 1 << 20  # elements converted and written at a time


def write_safetensors(
    path: Path, specs: Mapping[str, torch.Tensor], read: Callable[[str], torch.Tensor]
) -> None:
    """Write the safetensors file ``path`` holding the tensors of ``specs`` (name -> a meta
    tensor of the shape and dtype to write), each obtained from ``read(name)`` only when its
    bytes are written and released after: the header (all shapes, dtypes and offsets) goes
    first, then the tensors' bytes in the header's order. Reads back with ``safetensors``."""
    header: dict[str, object] = {}
    offset = 0
    for name, m in specs.items():
        n = m.numel() * m.element_size()
        entry = {"dtype": _SAFETENSORS_DTYPE[m.dtype], "shape": list(m.shape)}
        header[name] = {**entry, "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, m in specs.items():
            t = read(name).detach()
            if tuple(t.shape) != tuple(m.shape):
                raise ExportError(f"{name}: shape {tuple(t.shape)}, expected {tuple(m.shape)}")
            for part in t.reshape(-1).split(_WRITE_CHUNK):  # converted piece by piece
                f.write(part.to(m.dtype).contiguous().view(torch.uint8).numpy().data)
            del t


def check_weight_options(dtype: str, max_shard_size: int | str) -> int:
    """Check ``--dtype`` and ``--max_shard_size`` (bytes, or a size as ``save_pretrained``
    reads it: ``5GB``, ``500MB``, ``2GiB``); the shard size in bytes."""
    from transformers.utils.hub import convert_file_size_to_int

    check_dtype(dtype)
    size = str(max_shard_size).strip()
    try:
        limit = int(size) if size.isdigit() else convert_file_size_to_int(size)
    except ValueError:
        limit = 0
    if limit <= 0:
        raise ExportError(
            f"--max_shard_size {max_shard_size}: give bytes or a size such as 5GB, 500MB or 2GiB"
        )
    return limit


def write_weights(
    folder: Path,
    cfg: Config,
    state: Mapping[str, torch.Tensor],
    dtype: str = "float32",
    max_shard_size: int | str = MAX_SHARD_SIZE,
) -> int:
    """Write the full weights ``state`` of a model of ``cfg`` into ``folder`` as
    ``save_pretrained`` lays them out: ``model.safetensors``, or shards of at most
    ``max_shard_size`` (a tensor larger than that alone in its shard) and the index
    ``model.safetensors.index.json``. ``state`` is read one tensor at a time (a lazy mapping
    such as :func:`~tapered_megatron.checkpoint.consolidate.weights` is never held whole). Returns
    the number of parameters."""
    from huggingface_hub import split_torch_state_dict_into_shards

    limit = check_weight_options(dtype, max_shard_size)
    model = build_model(cfg, device="meta")
    specs = {
        n: torch.empty(p.shape, dtype=DTYPES[dtype], device="meta")
        for n, p in model.named_parameters()
    }
    if set(state) != set(specs):
        missing, extra = sorted(set(specs) - set(state)), sorted(set(state) - set(specs))
        raise ExportError(
            f"weights do not match the configuration: missing {missing[:4]}, unexpected {extra[:4]}"
        )
    split = split_torch_state_dict_into_shards(specs, max_shard_size=limit)
    for filename, names in split.filename_to_tensors.items():
        write_safetensors(folder / filename, {n: specs[n] for n in names}, state.__getitem__)
    n_params = sum(m.numel() for m in specs.values())
    if split.is_sharded:
        index = {
            "metadata": {"total_parameters": n_params, **split.metadata},
            "weight_map": split.tensor_to_filename,
        }
        (folder / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return n_params


def earlier_export_problem(out: Path) -> str | None:
    """Why ``--overwrite`` may not replace the non-empty directory ``out`` (one line), or None
    when it is an earlier export: a ``manifest.json`` listing every other entry, nothing
    unlisted (no checkpoint, no one's notes) and no symbolic link. Only what an export wrote is
    ever deleted."""
    if out.is_symlink():
        return f"--out {out}: a symbolic link; --overwrite replaces only an earlier export"
    listed = manifest(out, EXPORT_MANIFEST)
    if listed is None:
        return (
            f"--out {out}: not empty and not an earlier export (no readable {EXPORT_MANIFEST}); "
            "--overwrite replaces only an export, so choose a new directory"
        )
    for root, dirs, files in os.walk(out):  # symbolic links are listed, never followed
        for name in dirs + files:
            f = Path(root) / name
            rel = str(f.relative_to(out))
            if f.is_symlink() or not (f.is_dir() or rel in listed or rel == EXPORT_MANIFEST):
                return (
                    f"--out {out}: holds {rel}, which its {EXPORT_MANIFEST} does not list; "
                    "--overwrite replaces only what an export wrote, so choose a new directory"
                )
    return None


def _prepare_out(out: Path, overwrite: bool) -> Path:
    """Check ``out`` can be (re)placed and return a fresh temporary directory beside it."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ExportError(f"--out {out}: not empty; choose a new directory or pass --overwrite")
        why = earlier_export_problem(out)
        if why is not None:
            raise ExportError(why)
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp", dir=parent))
    except OSError as e:
        raise ExportError(
            f"--out {out}: cannot write in {parent} ({e.strerror}); choose a writable directory"
        ) from None


def _publish(tmp: Path) -> None:
    """Give the directory and its files the permissions of normally created ones (the
    temporary directory is private)."""
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    for f in tmp.iterdir():
        f.chmod(0o666 & ~umask)


def special_ids(tokenizer_model: str | None) -> dict[str, int | None]:
    """BOS / EOS (end of document) / pad ids of a sentencepiece model (ours: 1, 2, 3)."""
    if tokenizer_model is None:
        return {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    from tapered_megatron.data import load_tokenizer

    tok = load_tokenizer(tokenizer_model)
    return {"bos_token_id": tok.bos_id, "eos_token_id": tok.eod_id, "pad_token_id": tok.pad_id}


def _event_scalars(path: Path, tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` of one scalar tag in a tensorboard event file (TFRecord framing)."""
    from tensorboardX.proto import event_pb2

    data, pos, out = path.read_bytes(), 0, []
    while pos + 12 <= len(data):
        (n,) = struct.unpack_from("<Q", data, pos)
        event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n])
        pos += 12 + n + 4
        out += [(event.step, v.simple_value) for v in event.summary.value if v.tag == tag]
    return out


def final_validation_loss(ref: CheckpointRef) -> tuple[int, float] | None:
    """``(iteration, loss)`` of the last validation at or before the checkpoint, from the run's
    metrics file or its tensorboard events; ``None`` if the run recorded none."""
    cfg, records = ref.cfg, []
    metrics = Path(cfg.logging.metrics_file) if cfg.logging.metrics_file else None
    if metrics is not None and metrics.is_file():
        for line in metrics.read_text().splitlines():
            r = json.loads(line)
            if "val_loss" in r:
                records.append((int(r["iteration"]), float(r["val_loss"])))
    if not records:
        tb = Path(cfg.logging.tensorboard_dir or ref.save_dir / "tensorboard")
        for f in sorted(tb.glob("events.out.tfevents.*")) if tb.is_dir() else []:
            records += _event_scalars(f, "val/loss")
    records = [r for r in records if r[0] <= ref.iteration]
    return max(records) if records else None


@dataclass(frozen=True)
class Provenance:
    """Where exported weights come from, for ``config.json`` and the model card."""

    source: str  # checkpoint tag directory (or a description)
    iteration: int = 0
    consumed_samples: int = 0
    val: tuple[int, float] | None = None  # (iteration, loss) of the last validation

    @classmethod
    def of(cls, ref: CheckpointRef) -> Provenance:
        """The provenance of a resolved checkpoint (its final validation loss included)."""
        val = final_validation_loss(ref)
        return cls(str(ref.tag_dir), ref.iteration, ref.consumed_samples, val)


def model_card(
    cfg: Config, prov: Provenance, n_params: int, tokenizer: str, weights_note: str
) -> str:
    """The ``README.md`` of an export (``weights_note``: the weight files' dtype and layout)."""
    m, plan, val = cfg.model, cfg.taper_plan, prov.val
    tokens = prov.consumed_samples * m.seq_len
    arch = resolve_architecture(m.arch).describe(cfg)
    ratios = "/".join(f"{r:g}" for r in plan.ratios)
    val_line = "not recorded by the run"
    if val is not None:
        val_line = f"{val[1]:.4f} (perplexity {math.exp(val[1]):.2f}) at iteration {val[0]}"
    rows = "\n".join(f"| {i} | {w} | {w / plan.d_ff_base:.3f} |" for i, w in enumerate(plan.widths))
    return f"""---
library_name: transformers
tags: [tapered-megatron, tapered-language-model, {m.arch}]
---
# {cfg.name}: a tapered language model ({m.arch})

Exported with `python -m tapered_megatron.export` from `{prov.source}`.

| | |
|---|---|
| architecture | {arch} |
| layers / d_model / heads | {m.layers} / {m.d_model} / {m.heads} |
| vocabulary | {m.vocab_size} (weights padded to {cfg.padded_vocab_size} rows) |
| training sequence length | {m.seq_len} |
| MLP taper | {plan.schedule} {ratios}{" reversed" if plan.reverse else ""}, \
unit {plan.unit}, budget {plan.budget} (deviation {plan.deviation}) |
| parameters | {n_params:,} |
| tokens trained | {tokens:,} (iteration {prov.iteration}, {prov.consumed_samples:,} \
samples x {m.seq_len}) |
| final validation loss | {val_line} |
| tokenizer | {tokenizer} |

## Per-layer MLP widths

| layer | d_ff | d_ff / uniform |
|---|---|---|
{rows}

## Weights

{weights_note}. Names: `embedding.embed.weight` [padded vocab, d_model];
per layer `layers.N.mixer_norm.weight`, `layers.N.mixer.*` (attention: `qkv.weight`, fused
head-major `[q | gate | k | v]` per head, or with fewer key/value heads (grouped-query)
`q.weight` `[q | gate]` per head and `kv.weight` `[k | v]` per key/value head; and
`out.weight`), `layers.N.mlp_norm.weight`,
`layers.N.mlp.*` (SwiGLU: `w13.weight` = `[W1; W3]`, `w2.weight`); `head.norm.weight`,
`head.proj.weight` [padded vocab, d_model].

## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(OUT)
ids = tokenizer("To be, or not to be", return_tensors="pt").input_ids
print(tokenizer.decode(model.generate(ids, max_new_tokens=40)[0]))
```

or `python -m tapered_megatron.generate --model OUT --prompt "..."`,
`python -m tapered_megatron.eval.perplexity --model OUT --data-path PREFIX`. Needs the
`tapered_megatron` package (`pip install tapered-megatron[export]`).
"""


def write_export(
    out: str | Path,
    cfg: Config,
    state: Mapping[str, torch.Tensor],
    prov: Provenance,
    tokenizer_model: str | None = None,
    overwrite: bool = False,
    dtype: str = "float32",
    max_shard_size: int | str = MAX_SHARD_SIZE,
) -> Path:
    """Write full weights ``state`` of a model of ``cfg`` as the export directory ``out``
    (atomically: into a temporary sibling, renamed at the end); ``dtype`` and
    ``max_shard_size`` as for :func:`write_weights`."""
    from transformers import GenerationConfig

    from tapered_megatron.hf.configuration import TaperedConfig
    from tapered_megatron.hf.tokenization import write_hf_tokenizer

    out = Path(out)
    if tokenizer_model is not None:
        check_tokenizer(tokenizer_model, cfg)
    tmp = _prepare_out(out, overwrite)
    try:
        n_params = write_weights(tmp, cfg, state, dtype, max_shard_size)
        training = {
            "iteration": prov.iteration,
            "tokens": prov.consumed_samples * cfg.model.seq_len,
            "source": prov.source,
        }
        ids = special_ids(tokenizer_model)
        config = TaperedConfig.from_run_config(cfg, dtype=dtype, training=training, **ids)
        config.save_pretrained(str(tmp))
        GenerationConfig(**ids).save_pretrained(str(tmp))
        (tmp / "configuration_tapered.py").write_text(CONFIG_STUB)
        (tmp / "modeling_tapered.py").write_text(MODELING_STUB)
        tok_note = "none recorded (pass --tokenizer-model at export to include one)"
        if tokenizer_model is not None:
            from tapered_megatron.data.sample_corpus import sample_corpus_docs

            texts = sample_corpus_docs(TOKENIZER_CHECK_DOCS)
            bad = write_hf_tokenizer(tokenizer_model, tmp, cfg.model.seq_len, texts)
            name = Path(tokenizer_model).name
            tok_note = f"`{name}` (sentencepiece) and an identical fast `tokenizer.json`"
            if bad:
                tok_note = (
                    f"`{name}` (sentencepiece); the fast `tokenizer.json` differs from it on "
                    f"{len(bad)} check texts, first {bad[0][:40]!r}"
                )
                print(f"warning: {tok_note}", file=sys.stderr)
        shards = sorted(tmp.glob("model*.safetensors"))
        where = f"`{shards[0].name}`, unsharded"
        if len(shards) > 1:
            where = f"{len(shards)} shards `model-0000K-of-...safetensors` (`{WEIGHTS_INDEX}`)"
        card = model_card(cfg, prov, n_params, tok_note, f"{where}, {dtype}")
        (tmp / "README.md").write_text(card)
        write_manifest(tmp)
        _publish(tmp)
        if out.exists():
            _prepare_out(out, overwrite).rmdir()  # still an earlier export (checked again)
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    tag: str | None = None,
    tokenizer_model: str | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] = print,
    plugins: tuple[str, ...] = (),
    dtype: str = "float32",
    max_shard_size: int | str = MAX_SHARD_SIZE,
) -> Path:
    """Consolidate ``checkpoint`` (any layout) into the export directory ``out``. Input is
    checked (checkpoint, tag, tokenizer, ``out``) before anything is read or written; ``plugins``
    as for :func:`~tapered_megatron.checkpoint.consolidate.resolve_checkpoint`, ``dtype`` and
    ``max_shard_size`` as for :func:`write_weights`. Tensors stream from the checkpoint's
    universal copy when it has one (:func:`~tapered_megatron.checkpoint.consolidate.weights`)."""
    ref = resolve_checkpoint(checkpoint, tag, plugins)
    tok = tokenizer_model or run_tokenizer(ref.cfg)
    if tok is not None:
        check_tokenizer(tok, ref.cfg)
    check_weight_options(dtype, max_shard_size)
    shutil.rmtree(_prepare_out(Path(out), overwrite))  # fail on a bad --out before the work
    state = weights(ref)
    write_export(out, ref.cfg, state, Provenance.of(ref), tok, overwrite, dtype, max_shard_size)
    n_params = sum(p.numel() for p in build_model(ref.cfg, device="meta").parameters())
    log(
        f"exported {ref.tag_dir} ({ref.cfg.model.arch}, {n_params:,} parameters, iteration "
        f"{ref.iteration}) to {out}"
    )
    return Path(out)
