#!/usr/bin/env python
"""tokenize.py against its limit, N x raw sentencepiece, measured in the same run; its memory.

Throughput (default): for the shipped sample corpus and a larger jsonl made by repeating it,
and for each worker count N, this times

* ``raw``: sentencepiece alone, one process, encoding the corpus' texts already in memory with
  its batch call (1,000 documents a call, ``num_threads=1``, the faster of list and numpy
  output): nothing but tokenizing;
* ``tokenize``: ``data_tools/tokenize.py --workers N --append-eod`` end to end as a subprocess
  (interpreter start, read, parse, encode, write .bin/.idx);

alternately ``--repeats`` times each (so both see the same spells of machine load), and prints
one JSON line per corpus and N with ``ratio = (raw / N) / tokenize`` from the best time of each
(goal >= 0.9 on the large input), the same ratio without the interpreter start
(``ratio_inner``), and ``cpu_efficiency`` = raw CPU s / tokenize.py CPU s (main + workers): the
ratio N idle cores would give. ``--baseline DIR`` times DIR's tokenize.py (an earlier
checkout) in the same rounds. A ``stages`` line splits one process' CPU time over the
pipeline's own functions (read, parse, encode, flatten + EOD, pickling for IPC, write).

Memory (``--memory-gb 0.25 1``): for each size, writes a synthetic corpus of that many GB in a
temporary folder (a quarter each plain jsonl, jsonl.zst, Parquet with one huge row group, and a
datasets-style Arrow file), tokenizes it with ``--workers N``, samples the resident memory of the
main process and its workers every 0.2 s (and their own peak counters), prints a JSON line, and
deletes the folder. ``--memory-tokenizer word`` uses a word-level sentencepiece model trained
from the sample corpus instead of its BPE model: the same pipeline with a ~4x cheaper encode,
for machines where a GB of BPE would take too long.

    python scripts/bench_tokenize.py --workers 1 2 --large-mb 40 [--baseline OLD_CHECKOUT]
    python scripts/bench_tokenize.py --workers 2 --memory-gb 0.25 1 --skip-throughput
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pickle
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from bench_common import ROOT, emit, stamp

from tapered_megatron.data import (
    IndexedDatasetWriter,
    load_tokenizer,
    prepare_sample_corpus,
    train_sentencepiece,
)
from tapered_megatron.data.preprocess import iter_texts, paragraphs, parse_chunk
from tapered_megatron.data.sample_corpus import sample_corpus_path
from tapered_megatron.data.sources import expand_inputs, read_chunks


def raw_encode(texts: list[str], model: str) -> tuple[float, float]:
    """Sentencepiece alone on in-memory texts, one process: ``(wall s, CPU s)``, the faster of
    its two outputs (Python lists, numpy arrays)."""
    sp = load_tokenizer(model).sp
    best = (float("inf"), float("inf"))
    for out_type in (int, "numpy"):
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(0, len(texts), 1000):
            sp.encode(texts[i : i + 1000], num_threads=1, out_type=out_type)
        best = min(best, (time.perf_counter() - t0, time.process_time() - c0))
    return best


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def tokenize_cmd(
    inputs: list[Path], model: str, workers: int, out: Path, repo: Path = ROOT
) -> list[str]:
    return [sys.executable, str(repo / "data_tools/tokenize.py"), "--input", *map(str, inputs),
            "--output-prefix", str(out), "--tokenizer-model", model, "--append-eod",
            "--workers", str(workers), "--no-progress", "--log-interval", "0"]  # fmt: skip


def run_tokenize(cmd: list[str], repo: Path = ROOT) -> tuple[float, float, dict]:
    env = {**os.environ, "PYTHONPATH": str(repo)}
    t0, c0 = time.perf_counter(), children_cpu()
    r = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    wall, cpu = time.perf_counter() - t0, children_cpu() - c0
    return wall, cpu, json.loads(r.stdout.strip().splitlines()[-1])


def stages(path: Path, model: str, out: Path) -> dict:
    """CPU seconds of each pipeline stage, run one after another in this process."""
    sp = load_tokenizer(model).sp
    t = dict.fromkeys(["read", "parse", "encode", "flatten_eod", "ipc_pickle", "write"], 0.0)
    writer = IndexedDatasetWriter(out, np.uint16)
    clock = time.process_time()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.process_time()
        t[stage] += now - clock
        clock = now

    for chunk in read_chunks(expand_inputs([str(path)])[0], ["text"]):
        lap("read")
        texts = parse_chunk(chunk.kind, chunk.payload, ["text"])[0]["text"]
        lap("parse")
        ids = sp.encode(texts, num_threads=1, out_type="numpy")
        lap("encode")
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        flat = np.insert(np.concatenate(ids).astype(np.uint16), np.cumsum(lengths), 2)
        lengths += 1
        lap("flatten_eod")
        pickle.loads(pickle.dumps(chunk.payload, 5))
        pickle.loads(pickle.dumps({"tokens": flat, "lengths": lengths}, 5))
        lap("ipc_pickle")
        writer.add_documents(flat, lengths)
        lap("write")
    writer.abort()
    share = {f"{k}_pct_of_encode": round(100 * v / t["encode"], 2) for k, v in t.items()}
    return {**{f"{k}_cpu_s": round(v, 3) for k, v in t.items()}, **share}


def startup_seconds() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import tapered_megatron.data.cli"], check=True)
    return time.perf_counter() - t0


def common() -> dict:
    return {
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        **stamp(),
    }


def write_large(lines: list[bytes], path: Path, mb: float, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "wb") as f:
        written = 0
        while written < mb * 1e6:
            block = lines[:]
            rng.shuffle(block)
            data = b"".join(block)
            f.write(data)
            written += len(data)


def throughput(args, model: str, lines: list[bytes], tmp: Path) -> None:
    sample = tmp / "sample.jsonl"
    sample.write_bytes(b"".join(lines))
    large = tmp / "large.jsonl"
    write_large(lines, large, args.large_mb)
    emit({"bench": "tokenize_startup", "import_s": round(startup_seconds(), 3), **common()})
    for name, path in (("sample", sample), ("large", large)):
        if name not in args.corpora:
            continue
        texts = [json.loads(line)["text"] for line in path.read_bytes().splitlines()]
        mb = path.stat().st_size / 1e6
        split = stages(path, model, tmp / "stages")
        emit({"bench": "tokenize_stages", "corpus": name, "mb": round(mb, 1), **split, **common()})
        for workers in args.workers:
            raws, runs, base = [], [], []
            for _ in range(args.repeats):  # alternate, so all see the same spells of load
                raws.append(raw_encode(texts, model))
                runs.append(run_tokenize(tokenize_cmd([path], model, workers, tmp / name)))
                if args.baseline:
                    cmd = tokenize_cmd([path], model, workers, tmp / name, args.baseline)
                    base.append(run_tokenize(cmd, args.baseline))
            raw, raw_cpu = min(r[0] for r in raws), min(r[1] for r in raws)
            wall, cpu = min(r[0] for r in runs), min(r[1] for r in runs)
            inner = min(r[2]["seconds"] for r in runs)
            summary, limit = runs[0][2], raw / workers
            row = {
                "bench": "tokenize",
                "corpus": name,
                "mb": round(mb, 1),
                "documents": summary["documents"]["text"],
                "tokens": summary["tokens"]["text"],
                "workers": workers,
                "raw_sp_1proc_s": round(raw, 2),
                "limit_s": round(limit, 2),
                "tokenize_wall_s": round(wall, 2),
                "tokenize_inner_s": round(inner, 2),
                "tokenize_mb_per_s": round(mb / wall, 2),
                "ratio": round(limit / wall, 3),
                "ratio_inner": round(limit / inner, 3),
                "raw_sp_cpu_s": round(raw_cpu, 2),
                "tokenize_cpu_s": round(cpu, 2),
                "cpu_efficiency": round(raw_cpu / cpu, 3),
                **common(),
            }
            if base:
                base_wall = min(r[0] for r in base)
                row["baseline"] = str(args.baseline)
                row["baseline_wall_s"] = round(base_wall, 2)
                row["baseline_ratio"] = round(limit / base_wall, 3)
                row["baseline_cpu_efficiency"] = round(raw_cpu / min(r[1] for r in base), 3)
            emit(row)


def write_synthetic(lines: list[bytes], folder: Path, gb: float) -> list[Path]:
    """About ``gb`` GB of text in four formats, a quarter each."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    quarter = gb * 1e9 / 4
    plain = folder / "a.jsonl"
    write_large(lines, plain, quarter / 1e6, seed=1)
    zst = folder / "b.jsonl.zst"
    write_large(lines, folder / "b.jsonl", quarter / 1e6, seed=2)
    with open(folder / "b.jsonl", "rb") as src, open(zst, "wb") as dst:
        zstandard.ZstdCompressor(level=1).copy_stream(src, dst)
    os.remove(folder / "b.jsonl")
    texts = [json.loads(line)["text"] for line in lines]
    rng = random.Random(3)
    parquet = folder / "c.parquet"
    schema = pa.schema([("text", pa.string())])
    with pq.ParquetWriter(parquet, schema) as w:  # one row group holding the whole quarter
        batches, written = [], 0
        while written < quarter:
            block = texts[:]
            rng.shuffle(block)
            batches.append(pa.record_batch([pa.array(block)], schema=schema))
            written += sum(len(t) for t in block)
        w.write_table(pa.Table.from_batches(batches), row_group_size=1 << 30)
        del batches
    arrow = folder / "d.arrow"
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
        written = 0
        while written < quarter:
            block = texts[:]
            rng.shuffle(block)
            for i in range(0, len(block), 1000):  # datasets' writer_batch_size
                w.write_batch(pa.record_batch([pa.array(block[i : i + 1000])], schema=schema))
            written += sum(len(t) for t in block)
    return [plain, zst, parquet, arrow]


def tree_memory(root: int) -> tuple[int, int]:
    """``(sum of current RSS, sum of peak RSS)`` in bytes over ``root`` and its descendants."""
    pids, rss, hwm = [root], 0, 0
    while pids:
        pid = pids.pop()
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            for task in os.listdir(f"/proc/{pid}/task"):
                children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
                pids.extend(int(c) for c in children)
        except (FileNotFoundError, ProcessLookupError):
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss += int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm += int(line.split()[1]) * 1024
    return rss, hwm


def sample_memory(p: subprocess.Popen, peak: dict) -> None:
    """Keep the largest memory sums of ``p``'s process tree in ``peak`` until it exits."""
    while p.poll() is None:
        rss, hwm = tree_memory(p.pid)
        peak["rss"], peak["hwm"] = max(peak["rss"], rss), max(peak["hwm"], hwm)
        time.sleep(0.2)


def memory(args, model: str, lines: list[bytes], tmp: Path) -> None:
    if args.memory_tokenizer == "word" and args.memory_gb:  # same pipeline, ~4x faster encode
        texts = iter_texts([str(sample_corpus_path())])
        model = train_sentencepiece(
            paragraphs(texts), tmp / "word", 8192, "word", byte_fallback=False, num_threads=1
        )
    for gb in args.memory_gb:
        folder = tmp / f"mem{gb}"
        folder.mkdir()
        try:
            inputs = write_synthetic(lines, folder, gb)
            on_disk = sum(p.stat().st_size for p in inputs)
            cmd = tokenize_cmd(inputs, model, args.workers[-1], folder / "out")
            t0 = time.perf_counter()
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            peak = {"rss": 0, "hwm": 0}
            sampler = threading.Thread(target=sample_memory, args=(p, peak))
            sampler.start()
            try:
                out, err = p.communicate()
            finally:
                p.kill()  # no-op once it has exited; a stopped benchmark leaves no tokenizer
                sampler.join()
            if p.returncode:
                raise RuntimeError(err)
            s = json.loads(out.strip().splitlines()[-1])
            row = {
                "bench": "tokenize_memory",
                "gb_text": round(s["input_bytes"] / 1e9, 3),
                "gb_on_disk": round(on_disk / 1e9, 3),
                "inputs": [p.name for p in inputs],
                "documents": s["documents"]["text"],
                "tokens": s["tokens"]["text"],
                "workers": args.workers[-1],
                "tokenizer": f"{args.memory_tokenizer} 8192",
                "seconds": round(time.perf_counter() - t0, 1),
                "peak_rss_sum_mib": round(peak["rss"] / 2**20, 1),
                "peak_hwm_sum_mib": round(peak["hwm"] / 2**20, 1),
                "bound_mib": 1024,
                **common(),
            }
            emit(row)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--large-mb", type=float, default=40.0, help="size of the generated jsonl")
    ap.add_argument("--repeats", type=int, default=2)
    corpora = ["sample", "large"]
    ap.add_argument("--corpora", nargs="+", choices=corpora, default=corpora)
    ap.add_argument("--memory-gb", type=float, nargs="*", default=[], help="synthetic sizes")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument(
        "--memory-tokenizer",
        choices=["bpe", "word"],
        default="bpe",
        help="memory runs: the sample BPE model, or a word model trained here (faster encode)",
    )
    ap.add_argument(
        "--baseline", type=Path, help="another checkout: its tokenize.py timed alongside"
    )
    ap.add_argument("--cache-dir", default=str(ROOT / ".cache/tapered_megatron"))
    ap.add_argument("--tmp", default=None, help="folder for generated inputs (default: system)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: still clean up
    model, _ = prepare_sample_corpus(args.cache_dir)
    lines = gzip.decompress(sample_corpus_path().read_bytes()).splitlines(keepends=True)
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        if not args.skip_throughput:
            throughput(args, model, lines, Path(tmp))
        memory(args, model, lines, Path(tmp))


if __name__ == "__main__":
    main()
