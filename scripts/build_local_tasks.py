"""Build the local zero-shot tasks under ``tasks/data/`` from the shipped Shakespeare sample.

    python scripts/build_local_tasks.py [--items 300] [--seed 0]

Items come only from the documents the quickstart does not train on: the valid and test parts
of its split ``969,30,1`` of ``data/sample/corpus.jsonl.gz`` (public domain, see
``data/sample/README.md``). Two tasks, deterministic for a seed:

* ``tm_shakespeare_nextline.jsonl`` (multiple choice, acc / acc_norm): a speech's speaker and
  its first lines; choose the speech's next line among four (the true one and three lines
  of other held-out speeches).
* ``tm_shakespeare_lastword.jsonl`` (last-word cloze like LAMBADA, acc / perplexity): a speaker
  and up to four lines of verse, the final word held out (trailing punctuation dropped).
* ``tm_shakespeare_wordorder.jsonl`` (two choices, acc): a speaker and up to three lines, then
  the next line as written or its words shuffled. Chance is 50 %; a model that learned which
  words follow which scores clearly above it even at the reproduction's small scale, so
  differences between its models can show (the task definition lives in ``tasks/reproduction/``
  and is not one of the default local tasks).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tapered_megatron.data import split_ranges  # noqa: E402
from tapered_megatron.data.sample_corpus import sample_corpus_docs  # noqa: E402

QUICKSTART_SPLIT = "969,30,1"
HEADING = re.compile(r"[A-Z][A-Z .'-]*\.")
LAST_WORD = re.compile(r"^(.*\S)\s+([A-Za-z]{3,})[.,;:!?]*$", re.S)


def speeches(docs: list[str]) -> list[tuple[str, list[str]]]:
    """``(speaker heading, lines)`` of every speech with at least three lines."""
    out = []
    for doc in docs:
        for para in doc.split("\n\n"):
            lines = [line.strip() for line in para.split("\n") if line.strip()]
            if len(lines) >= 4 and HEADING.fullmatch(lines[0]):
                out.append((lines[0], lines[1:]))
    return out


def nextline_items(sp: list[tuple[str, list[str]]], n: int, rng: random.Random) -> list[dict]:
    """Multiple choice: which line comes next in this speech?"""
    pool = [line for _, lines in sp for line in lines if len(line) >= 20]
    items = []
    for i in rng.sample(range(len(sp)), len(sp)):
        head, lines = sp[i]
        k = rng.randint(2, len(lines) - 1)
        answer = lines[k]
        if len(answer) < 20:
            continue
        own = set(lines)
        wrong = []
        while len(wrong) < 3:
            cand = rng.choice(pool)
            if cand not in own and cand not in wrong:
                wrong.append(cand)
        label = rng.randrange(4)
        choices = [*wrong[:label], answer, *wrong[label:]]
        context = "\n".join([head, *lines[max(0, k - 4) : k]])
        items.append({"context": context, "choices": choices, "label": label})
        if len(items) == n:
            break
    return items


def lastword_items(sp: list[tuple[str, list[str]]], n: int, rng: random.Random) -> list[dict]:
    """Cloze: the last word of a passage of verse."""
    items = []
    for i in rng.sample(range(len(sp)), len(sp)):
        head, lines = sp[i]
        end = rng.randint(2, len(lines))
        m = LAST_WORD.match("\n".join(lines[max(0, end - 4) : end]))
        if m is None:
            continue
        items.append({"context": f"{head}\n{m.group(1)}", "target": m.group(2)})
        if len(items) == n:
            break
    return items


def wordswap_items(sp: list[tuple[str, list[str]]], n: int, rng: random.Random) -> list[dict]:
    """Two choices: a line of a speech as written, or with two neighbouring words swapped."""
    items = []
    for i in rng.sample(range(len(sp)), len(sp)):
        head, lines = sp[i]
        k = rng.randint(1, len(lines) - 1)
        words = lines[k].split()
        j = rng.randrange(max(1, len(words) - 1))
        if len(words) < 6 or words[j].lower() == words[j + 1].lower():
            continue
        swapped = [*words[:j], words[j + 1], words[j], *words[j + 2 :]]
        label = rng.randrange(2)
        choices = [" ".join(swapped), lines[k]] if label else [lines[k], " ".join(swapped)]
        context = "\n".join([head, *lines[max(0, k - 3) : k]])
        items.append({"context": context, "choices": choices, "label": label})
        if len(items) == n:
            break
    return items


def lastchoice_items(cloze: list[dict], rng: random.Random) -> list[dict]:
    """Four choices: the held-out last word of each cloze item, or one of three other items'
    (so every choice is a word that ends a line of the play)."""
    targets = sorted({x["target"] for x in cloze})
    items = []
    for x in cloze:
        wrong = rng.sample([t for t in targets if t.lower() != x["target"].lower()], 3)
        label = rng.randrange(4)
        choices = [*wrong[:label], x["target"], *wrong[label:]]
        items.append({"context": x["context"], "choices": choices, "label": label})
    return items


def main(argv: list[str] | None = None) -> int:
    """Write both task files (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=300, help="items per task (at most)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "tasks" / "data"))
    a = ap.parse_args(argv)
    docs = sample_corpus_docs()
    start = split_ranges(QUICKSTART_SPLIT, len(docs))[1][0]  # first valid document
    sp = speeches(docs[start:])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cloze = lastword_items(sp, a.items, random.Random(a.seed + 1))
    for name, items in (
        ("tm_shakespeare_nextline", nextline_items(sp, a.items, random.Random(a.seed))),
        ("tm_shakespeare_lastword", cloze),
        ("tm_shakespeare_wordswap", wordswap_items(sp, a.items, random.Random(a.seed + 2))),
        ("tm_shakespeare_lastchoice", lastchoice_items(cloze, random.Random(a.seed + 3))),
    ):
        text = "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items)
        (out / f"{name}.jsonl").write_text(text, encoding="utf-8")
        print(f"{out / name}.jsonl: {len(items)} items from documents {start}:{len(docs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
