"""Training data for a head: the target's own states and predictions over text, on disk.

Recipe (no downloads): source files installed on this machine (by default the Python standard
library, and the Python and C/C++ header files of the installed packages), cut into pieces of
at most `--piece-tokens` tokens, each wrapped as a chat turn in the target's own template (a
user asking for the file, the assistant answering with the piece in a code block). The target
reads each turn as prompt rows (the fast path: no decoding), and for every position we keep

    tokens   int32 [N]            the text
    taps     float16 [N, 3*H]     the target's states entering the head's three tap layers
    top_ids  int32 [N, K]         the target's K most likely next tokens ...
    top_p    float16 [N, K]       ... and their probabilities (temperature 1)
    docs     int64 [n_docs + 1]   where each turn starts

in shards of about `SHARD_TOKENS` rows, as .npy files (memory-mapped when training). The run
is resumable: `manifest.json` lists the finished shards and how many pieces were used; a
rerun continues after the last finished shard.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

from speculant import Batch

SHARD_TOKENS = 16384
TOP_K = 8
ASKS = ("Show me the source of `{name}`.", "Write `{name}`.", "What does `{name}` contain? Show the code.",
        "Print the next part of `{name}`.", "Give me the code of `{name}`, as it is.")
LANGS = {".py": "python", ".h": "c", ".hpp": "cpp", ".c": "c", ".cc": "cpp", ".cpp": "cpp", ".md": "markdown", ".rst": "rst"}


def default_sources() -> list[str]:
    """Globs of the files the default recipe reads: Python's standard library, then the packages
    installed beside it (their .py files, and C/C++ headers)."""
    std, site = sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]
    return [f"{std}/**/*.py", f"{site}/**/*.py", f"{site}/**/*.h"]


def source_files(globs: list[str]) -> list[str]:
    """Every matching file, in a fixed pseudo-random order (a hash of the path), so a rerun and
    another machine with the same files take them in the same order."""
    files = {os.path.realpath(f) for g in globs for f in glob.glob(g, recursive=True) if os.path.isfile(f)}
    files = [f for f in files if "/test" not in f and os.path.getsize(f) > 200]
    return sorted(files, key=lambda f: hashlib.sha256(f.encode()).hexdigest())


def pieces(files: list[str], tokenizer, piece_tokens: int):
    """(file, chat turn token ids) for each piece of each file, in order."""
    for i, path in enumerate(files):
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        lines, chunk = text.splitlines(keepends=True), ""
        name = "/".join(Path(path).parts[-2:])
        lang = LANGS.get(Path(path).suffix, "")
        chunks = []
        for line in lines:
            if len(chunk) + len(line) > piece_tokens * 3 and chunk:  # ~3 characters a token in code
                chunks.append(chunk)
                chunk = ""
            chunk += line[: piece_tokens * 3]
        if chunk.strip():
            chunks.append(chunk)
        for j, body in enumerate(chunks):
            ask = ASKS[(i + j) % len(ASKS)].format(name=name)
            ids = tokenizer.encode_chat([{"role": "user", "content": ask}, {"role": "assistant", "content": f"```{lang}\n{body}```"}],
                                        add_generation_prompt=False)[: piece_tokens + 64]
            if len(ids) >= 32:
                yield path, ids


class ShardWriter:
    def __init__(self, directory: Path, index: int):
        self.directory, self.index = directory, index
        self.tokens, self.taps, self.top_ids, self.top_p, self.docs = [], [], [], [], [0]

    @property
    def n(self) -> int:
        return self.docs[-1]

    def add(self, tokens, taps, top_ids, top_p):
        self.tokens.append(np.asarray(tokens, dtype=np.int32))
        self.taps.append(taps.to(torch.float16).numpy())
        self.top_ids.append(top_ids.to(torch.int32).numpy())
        self.top_p.append(top_p.to(torch.float16).numpy())
        self.docs.append(self.n + len(tokens))

    def close(self) -> str:
        name = f"shard-{self.index:05d}"
        tmp = self.directory / (name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        for key, parts in (("tokens", self.tokens), ("taps", self.taps), ("top_ids", self.top_ids), ("top_p", self.top_p)):
            np.save(tmp / f"{key}.npy", np.concatenate(parts))
        np.save(tmp / "docs.npy", np.asarray(self.docs, dtype=np.int64))
        os.replace(tmp, self.directory / name)  # a shard appears whole or not at all
        return name


def collect(target, data_dir: str, n_tokens: int, globs: list[str], taps: tuple[int, ...], piece_tokens: int = 480,
            log=print) -> dict:
    """Run `target` over the recipe's pieces until `data_dir` holds `n_tokens` rows; resumes.
    `taps`: the target layers whose input is kept (HF ids, as in the head's target_layers)."""
    directory = Path(data_dir)
    directory.mkdir(parents=True, exist_ok=True)
    manifest_path = directory / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else \
        {"shards": [], "tokens": 0, "pieces": 0, "taps": list(taps), "top_k": TOP_K, "sources": globs}
    if manifest["taps"] != list(taps):
        raise ValueError(f"{data_dir} holds taps {manifest['taps']}, this head wants {list(taps)}: use another --data")
    if manifest["tokens"] >= n_tokens:
        return manifest
    layers = tuple(sorted({t - 1 for t in taps}))
    files = source_files(globs)
    if not files:
        raise ValueError(f"no source files match {globs}")
    shard = ShardWriter(directory, len(manifest["shards"]))
    done_pieces, t0, n0 = manifest["pieces"], time.time(), manifest["tokens"]
    context = target.new_context(4096)
    for k, (path, ids) in enumerate(pieces(files, target.tokenizer, piece_tokens)):
        if k < done_pieces:
            continue
        out = target.forward(Batch.for_sequence(0, 0, ids, logits="all"), context, hidden_layers=layers)
        context.drop(0)
        probs = torch.softmax(out.logits.float(), dim=-1)
        top = probs.topk(TOP_K, dim=-1)
        shard.add(ids, torch.cat([out.hidden[t - 1] for t in taps], dim=-1), top.indices, top.values)
        done_pieces = k + 1
        if shard.n >= SHARD_TOKENS:
            manifest["shards"].append(shard.close())
            manifest["tokens"] += shard.n
            manifest["pieces"] = done_pieces
            manifest_path.write_text(json.dumps(manifest, indent=1))
            rate = (manifest["tokens"] - n0) / (time.time() - t0)
            log(f"collect: {manifest['tokens']} tokens in {len(manifest['shards'])} shards ({rate:.0f} tokens/s)")
            if manifest["tokens"] >= n_tokens:
                return manifest
            shard = ShardWriter(directory, len(manifest["shards"]))
    if shard.n:
        manifest["shards"].append(shard.close())
        manifest["tokens"] += shard.n
        manifest["pieces"] = done_pieces
        manifest_path.write_text(json.dumps(manifest, indent=1))
    return manifest


class Shards:
    """The finished shards of a data directory, memory-mapped."""

    def __init__(self, data_dir: str):
        directory = Path(data_dir)
        manifest = json.loads((directory / "manifest.json").read_text())
        self.shards = []
        for name in manifest["shards"]:
            d = directory / name
            self.shards.append({k: np.load(d / f"{k}.npy", mmap_mode="r") for k in ("tokens", "taps", "top_ids", "top_p", "docs")})
        self.manifest = manifest

    def documents(self) -> list[tuple[int, int, int]]:
        """(shard, start, end) of every document."""
        return [(i, int(s["docs"][j]), int(s["docs"][j + 1])) for i, s in enumerate(self.shards) for j in range(len(s["docs"]) - 1)]
