"""Zero-shot accuracy with the real lm-evaluation-harness (0.4.x), on an export or a checkpoint.

    python -m tapered_megatron.eval.zeroshot --model OUT|--checkpoint DIR [--tag T] \\
        [--tasks a,b] [--limit N] [--batch-size 8] [--include-path tasks/] --output DIR

Runs the harness's own ``hf`` backend on the export with this package's installed model classes
(``trust_remote_code`` off: no code from the export directory runs; a ``--checkpoint``
is exported to a temporary directory first, with ``--tokenizer-model`` or the run's tokenizer)
and writes ``DIR/zeroshot.json``::

    {"tasks": {"<task>": {"acc": float, "acc_norm": float | null, "n": int}},
     "average_acc": float, "items": {"<task>": "0110..."}, "model": "...", "limit": N | null}

(``items``: each item right (1) or wrong (0) by ``acc``, in document order, for item-level
paired tests.)

and the same as a Markdown table in ``DIR/zeroshot.md``. The default tasks are the local ones
shipped in ``tasks/`` (``tm_shakespeare_nextline``, multiple choice; ``tm_shakespeare_lastword``,
last-word cloze); any task the harness knows can be named, with its data found locally (see
README, "Zero-shot evaluation"). Nothing is downloaded: the Hugging Face offline switches are
set unless the environment sets them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from deepspeed.accelerator import get_accelerator

from tapered_megatron.eval.common import fail
from tapered_megatron.export.load import DTYPES, PLUGINS_HELP, ExportError, check_export
from tapered_megatron.models import ArchitectureError, load_plugins
from tapered_megatron.resources import resource

TASKS_DIR = resource("tasks")


def local_tasks(include_path: Path = TASKS_DIR) -> list[str]:
    """Names of the task definitions shipped in ``include_path`` (one ``*.yaml`` per task)."""
    return sorted(p.stem for p in include_path.glob("*.yaml"))


def run_harness(
    model_dir: str | Path,
    tasks: list[str],
    limit: int | None = None,
    batch_size: int | str = 8,
    device: str = "cpu",
    include_path: Path = TASKS_DIR,
    dtype: str = "float32",
) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` with the ``hf`` backend on an export, its weights in
    ``dtype``; the harness's results."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import tapered_megatron.hf  # noqa: F401 - the installed classes, never the export's code

    return lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={model_dir},trust_remote_code=False,dtype={dtype}",
        tasks=tasks,
        limit=limit,
        batch_size=batch_size,
        device=device,
        task_manager=TaskManager(include_path=str(include_path)),
    )


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    """``{"tasks": {task: {"acc", "acc_norm", "n"}}, "average_acc"}`` from harness results."""
    out = {}
    for task, metrics in sorted(results["results"].items()):
        if "acc,none" not in metrics:
            continue
        n = results.get("n-samples", {}).get(task, {})
        out[task] = {
            "acc": float(metrics["acc,none"]),
            "acc_norm": float(metrics["acc_norm,none"]) if "acc_norm,none" in metrics else None,
            "n": int(n.get("effective", n.get("original", 0))),
        }
    if not out:
        raise ExportError("the harness reported no accuracy for the requested tasks")
    average = sum(t["acc"] for t in out.values()) / len(out)
    return {"tasks": out, "average_acc": average}


def item_outcomes(results: dict[str, Any], tasks: dict[str, Any]) -> dict[str, str]:
    """Per task of ``tasks`` (a :func:`summarise` result's), whether each item was answered
    right: ``"0110..."`` in document order, from the harness's logged samples (item-level
    paired tests need them; a task without logged samples is left out)."""
    out = {}
    for task in tasks:
        samples = results.get("samples", {}).get(task)
        if samples:
            by_doc = {int(x["doc_id"]): x["acc"] for x in samples}
            out[task] = "".join("1" if by_doc[i] else "0" for i in sorted(by_doc))
    return out


def markdown(summary: dict[str, Any], model: str) -> str:
    """A Markdown table of a :func:`summarise` result."""

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.2f}"

    lines = [
        f"Zero-shot accuracy (%) of `{model}` (lm-evaluation-harness, `hf` backend)",
        "",
        "| task | acc | acc_norm | n |",
        "|---|---|---|---|",
    ]
    for task, m in summary["tasks"].items():
        lines.append(f"| {task} | {pct(m['acc'])} | {pct(m['acc_norm'])} | {m['n']} |")
    lines.append(f"| **average** | **{pct(summary['average_acc'])}** | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """The command line; see the module docstring."""
    ap = argparse.ArgumentParser(
        prog="python -m tapered_megatron.eval.zeroshot",
        description="Zero-shot accuracy with lm-evaluation-harness.",
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="export directory")
    src.add_argument("--checkpoint", help="training checkpoint directory (train.save_dir)")
    ap.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    ap.add_argument("--tokenizer-model", default=None, help="sentencepiece model (checkpoints)")
    ap.add_argument("--tasks", default=None, help="comma-separated (default: the local tasks)")
    ap.add_argument("--limit", type=int, default=None, help="items per task (default: all)")
    ap.add_argument("--batch-size", default="8", help="harness batch size (or 'auto')")
    ap.add_argument(
        "--device",
        default=get_accelerator().device_name(),
        help="torch device (default: DeepSpeed's accelerator, e.g. cuda on a GPU, else cpu)",
    )
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32", help="weights dtype")
    ap.add_argument("--include-path", default=str(TASKS_DIR), help="task definitions folder")
    ap.add_argument("--output", required=True, help="folder for zeroshot.json and zeroshot.md")
    ap.add_argument("--plugins", nargs="+", default=[], help=PLUGINS_HELP)
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    include = Path(a.include_path)
    tasks = a.tasks.split(",") if a.tasks else local_tasks(include)
    batch = a.batch_size if a.batch_size == "auto" else int(a.batch_size)
    out = Path(a.output)
    try:
        out.mkdir(parents=True, exist_ok=True)
        if not os.access(out, os.W_OK):
            raise ExportError(f"--output {out}: not writable")
        load_plugins(a.plugins)  # the harness's from_pretrained resolves model.arch in-process
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = a.model
            if a.checkpoint:
                from tapered_megatron.export.writer import export_checkpoint

                model_dir = export_checkpoint(
                    a.checkpoint,
                    Path(tmp) / "model",
                    a.tag,
                    a.tokenizer_model,
                    log=_stderr,
                    plugins=tuple(a.plugins),
                )
            else:
                check_export(a.model)
                if not (Path(a.model) / "tokenizer.json").is_file():
                    raise ExportError(
                        f"--model {a.model}: no tokenizer.json (export with --tokenizer-model)"
                    )
            results = run_harness(model_dir, tasks, a.limit, batch, a.device, include, a.dtype)
        summary = summarise(results)
        summary["items"] = item_outcomes(results, summary["tasks"])
    except (ExportError, ArchitectureError, OSError) as e:
        return fail(e)
    source = a.model or a.checkpoint
    summary.update(model=str(source), limit=a.limit)
    (out / "zeroshot.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "zeroshot.md").write_text(markdown(summary, str(source)))
    print(markdown(summary, str(source)))
    return 0


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
