"""The answers of an answers file past those an earlier training already read, as a new answers file.

    python scripts/answers_tail.py heads/distill/answers-scratch-....jsonl.gz 181902 scratch-tail.jsonl

A training with ``--tokens N`` reads the file's documents in file order until N rows of target
states are collected (the document that crosses N included). This writes the documents after
that one, so ``speculant train ... --recipe self --answers TAIL --tokens ROWS`` (ROWS: the count
printed here) reads back exactly the answers a fine-tune from that training's head has not seen,
and stops there (it never goes on to answer new requests).
"""
from __future__ import annotations

import argparse
import gzip
import json
from itertools import accumulate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("answers", help="an answers file (.jsonl or .jsonl.gz)")
    p.add_argument("rows", type=int, help="rows the earlier training collected from it (its --tokens)")
    p.add_argument("out", help="the tail's answers file (.jsonl)")
    args = p.parse_args()
    opener = gzip.open if args.answers.endswith(".gz") else open
    with opener(args.answers, "rt") as f:
        lines = [line for line in f if line.strip()]
    sizes = [len(row["prompt"]) + len(row["answer"]) for row in map(json.loads, lines)]
    # collect checks the count before each document, so the one that reaches `rows` was read
    cut = next((k + 1 for k, seen in enumerate(accumulate(sizes)) if seen >= args.rows), len(lines))
    with open(args.out, "w") as f:
        f.writelines(lines[cut:])
    tail, rows = len(lines) - cut, sum(sizes[cut:])
    print(f"{args.out}: {tail} answers after the first {cut}, {rows} rows")


if __name__ == "__main__":
    main()
