"""Training data for drafters learned from a target (EAGLE3, MTP, DFlash heads): the corpus recipe
and the target's own states and predictions over it, collected to disk, resumably.

A trainer plugin (``speculant_add_trainers``) calls :func:`collect` with the target layers it needs
and reads the result back with :class:`Shards`; two trainers share one recipe and one on-disk format.

Recipe (no downloads): source files installed on this machine (:func:`default_sources`: the
Python standard library, and the Python and C/C++ header files of the installed packages; or
the caller's globs), taken in a fixed pseudo-random order (:func:`source_files`), cut into pieces
of at most ``piece_tokens`` tokens, each wrapped as a chat turn in the target's own template (a
user asking for the file, the assistant answering with the piece in a code block:
:func:`pieces`). The target reads each turn as prompt rows (the fast path: no decoding), and for
every position the shards keep

    tokens   int32 [N]                the text
    hidden   float16 [N, sum widths]  the target's hidden states of the requested layers,
                                      concatenated in the order asked (layer i: the output of
                                      target layer i, as ``Model.forward(hidden_layers=)`` gives
                                      it; i = n_layers: the final-normed state)
    top_ids  int32 [N, K]             the target's K most likely next tokens ...
    top_p    float16 [N, K]           ... and their probabilities (temperature 1)
    docs     int64 [n_docs + 1]       where each turn starts

in shards of about ``SHARD_TOKENS`` rows, each a directory of .npy files that appears whole or
not at all (memory-mapped when read). ``manifest.json`` lists the finished shards, how many
pieces they used, the layers and the caller's ``tag``; rerunning the same collection continues
after the last finished shard, and a directory collected for other layers or another tag is
refused rather than mixed. Directories written before this module (EAGLE3's ``taps.npy`` and
``"taps"`` manifests) read back the same way.

Helpers for trainers: :func:`split` (every 20th document held out), :func:`eog_ids` (the target's
end-of-generation tokens), :func:`target_tensor` (a target tensor dequantized), :func:`bf16_default`.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from speculant.distill import KINDS as ANSWER_KINDS
from speculant.recording import StateRecorder, read_back
from speculant.sources import default_sources, source_files

__all__ = ["ASKS", "LANGS", "RECIPES", "SHARD_TOKENS", "add_recipe_arguments", "recipe_options", "TOP_K", "Shards", "bf16_default", "collect", "default_sources", "eog_ids",
           "pieces", "source_files", "split", "read_back", "target_tensor", "training_threads"]

SHARD_TOKENS = 16384
RECIPES = ("read", "self")
TOP_K = 8
ASKS = ("Show me the source of `{name}`.", "Write `{name}`.", "What does `{name}` contain? Show the code.",
        "Print the next part of `{name}`.", "Give me the code of `{name}`, as it is.")
LANGS = {".py": "python", ".h": "c", ".hpp": "cpp", ".c": "c", ".cc": "cpp", ".cpp": "cpp", ".md": "markdown", ".rst": "rst"}


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


class _ShardWriter:
    def __init__(self, directory: Path, index: int):
        self.directory, self.index = directory, index
        self.tokens, self.hidden, self.top_ids, self.top_p, self.docs = [], [], [], [], [0]

    @property
    def n(self) -> int:
        return self.docs[-1]

    def add(self, tokens, hidden, top_ids, top_p):
        self.tokens.append(np.asarray(tokens, dtype=np.int32))
        self.hidden.append(hidden.to(torch.float16).numpy())
        self.top_ids.append(top_ids.to(torch.int32).numpy())
        self.top_p.append(top_p.to(torch.float16).numpy())
        self.docs.append(self.n + len(tokens))

    def close(self) -> str:
        name = f"shard-{self.index:05d}"
        tmp = self.directory / (name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        for key, parts in (("tokens", self.tokens), ("hidden", self.hidden), ("top_ids", self.top_ids), ("top_p", self.top_p)):
            np.save(tmp / f"{key}.npy", np.concatenate(parts))
        np.save(tmp / "docs.npy", np.asarray(self.docs, dtype=np.int64))
        final = self.directory / name
        if final.exists():  # written by a run that died before its manifest listed it
            shutil.rmtree(final)
        os.replace(tmp, final)  # a shard appears whole or not at all
        return name


def _manifest_layers(manifest: dict) -> list[int]:
    if "layers" in manifest:
        return list(manifest["layers"])
    return [t - 1 for t in manifest.get("taps", [])]  # EAGLE3's directories: the input of tap t is layer t-1's output


def collect(target, data_dir: str, n_tokens: int, globs: list[str], layers: tuple[int, ...], piece_tokens: int = 480,
            *, top_k: int = TOP_K, tag: dict | None = None, recipe: str = "read", answers: str | None = None,
            answer_batch: int = 8, answer_tokens: int = 384, answer_spec_types: str | None = None, answer_from: int = 0,
            answer_kind: str = "assist", log=print) -> dict:
    """Run `target` over the recipe's pieces until `data_dir` holds `n_tokens` rows; resumes.

    `layers`: the hidden states to keep, as ``Model.forward(hidden_layers=)`` numbers them (the
    output of layer i; ``target.info.n_layers`` is the final-normed state), concatenated in this
    order. `tag`: what the caller needs the data to be for (JSON values, e.g. EAGLE3's tap ids),
    kept in the manifest and checked on resume. Returns the manifest.

    `recipe`: "read", source files read back as chat turns (:func:`pieces`); "self", the target's
    own answers to requests built from those files (``speculant.distill``), written to `answers`
    (default ``data_dir/answers.jsonl``; a file several collections can share: answers already in
    it are read by the target again, new ones are kept as the target computes them while answering,
    ``speculant.recording``), with
    `answer_batch` requests decoding at once, at most `answer_tokens` tokens an answer, and the
    speculators `answer_spec_types` (a --spec-type list) to decode them sooner, from request
    `answer_from` of the recipe's order on (a later run adding requests an earlier head never saw),
    of the request kind `answer_kind` (``speculant.distill.KINDS``)."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}: one of {', '.join(RECIPES)}")
    directory = Path(data_dir)
    directory.mkdir(parents=True, exist_ok=True)
    manifest_path = directory / "manifest.json"
    tag = dict(tag or {})
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else \
        {"shards": [], "tokens": 0, "pieces": 0, "layers": list(layers), "top_k": top_k, "sources": globs, "recipe": recipe,
         **tag}
    if manifest.get("recipe", "read") != recipe:
        raise ValueError(f"{data_dir} holds the {manifest.get('recipe', 'read')!r} recipe's data, this collection wants {recipe!r}: "
                         "use another data directory")
    if _manifest_layers(manifest) != list(layers):
        raise ValueError(f"{data_dir} holds layers {_manifest_layers(manifest)}, this collection wants {list(layers)}: "
                         "use another data directory")
    for key, value in tag.items():
        if manifest.get(key) != value:
            raise ValueError(f"{data_dir} was collected with {key}={manifest.get(key)!r}, this one wants {value!r}: "
                             "use another data directory")
    if int(manifest.get("top_k", TOP_K)) != top_k:
        raise ValueError(f"{data_dir} holds the target's top {manifest.get('top_k')}, this collection wants {top_k}")
    if manifest["tokens"] >= n_tokens:
        return manifest
    files = source_files(globs)
    if not files:
        raise ValueError(f"no source files match {globs}")
    store = _Collection(directory, manifest, log)
    if recipe == "self":
        from speculant import distill

        answers = answers or str(directory / "answers.jsonl")
        manifest["answers"] = answers
        docs = distill.documents(answers) if Path(answers).exists() else iter(())
    else:
        docs = pieces(files, target.tokenizer, piece_tokens)
    # Documents already written (read-back pieces, or answers an earlier run or another
    # collection wrote): the target reads each again.
    context = target.new_context(4096)
    for k, (path, ids) in enumerate(docs):
        if store.tokens >= n_tokens:
            break
        if k < store.pieces:
            continue
        store.add(ids, *read_back(target, context, ids, layers, top_k))
    if recipe == "self" and store.tokens < n_tokens:
        # New answers: their states are kept as the target computes them while answering.
        recorder = StateRecorder(target, tuple(layers), top_k, store.add, rows=store.tokens)
        distill.answer(target, answers, n_tokens, globs, batch=answer_batch, max_tokens=answer_tokens,
                       spec_types=answer_spec_types, start=answer_from, kind=answer_kind, recorder=recorder, log=log)
        if recorder.recomputed:
            log(f"collect: {recorder.recomputed} answers read again (their states were not all kept while answering)")
    return store.close()


class _Collection:
    """The shards being written into one data directory and its manifest: ``add`` a document's
    rows; a shard is closed (and the manifest, counting the documents it covers, rewritten)
    every SHARD_TOKENS rows and at ``close``. A run that dies loses only the open shard: the
    next one starts again after the last document the manifest counts."""

    def __init__(self, directory: Path, manifest: dict, log):
        self.directory, self.manifest, self.log = directory, manifest, log
        self.shard = _ShardWriter(directory, len(manifest["shards"]))
        self.open_pieces, self.t0, self.n0 = 0, time.time(), manifest["tokens"]

    @property
    def tokens(self) -> int:
        return self.manifest["tokens"] + self.shard.n

    @property
    def pieces(self) -> int:
        return self.manifest["pieces"] + self.open_pieces

    def add(self, ids, hidden, top_ids, top_p) -> None:
        self.shard.add(ids, hidden, top_ids, top_p)
        self.open_pieces += 1
        if self.shard.n >= SHARD_TOKENS:
            self._flush()
            rate = (self.manifest["tokens"] - self.n0) / (time.time() - self.t0)
            self.log(f"collect: {self.manifest['tokens']} tokens in {len(self.manifest['shards'])} shards ({rate:.0f} tokens/s)")

    def _flush(self) -> None:
        self.manifest["shards"].append(self.shard.close())
        self.manifest["tokens"] += self.shard.n
        self.manifest["pieces"] += self.open_pieces
        (self.directory / "manifest.json").write_text(json.dumps(self.manifest, indent=1))
        self.shard, self.open_pieces = _ShardWriter(self.directory, len(self.manifest["shards"])), 0

    def close(self) -> dict:
        if self.shard.n:
            self._flush()
        return self.manifest


class Shards:
    """The finished shards of one data directory or several (a trainer mixing recipes), memory-
    mapped: ``shards[i]`` maps "tokens", "hidden", "top_ids", "top_p" and "docs" to arrays;
    ``layers`` and ``manifest`` as collected (the first directory's manifest). Directories
    holding other layers or another top-k than the first are refused."""

    KEYS = ("tokens", "hidden", "top_ids", "top_p", "docs")

    def __init__(self, data_dir: str | list[str]):
        dirs = [data_dir] if isinstance(data_dir, (str, os.PathLike)) else list(data_dir)
        self.shards = []
        for i, one in enumerate(dirs):
            directory = Path(one)
            manifest = json.loads((directory / "manifest.json").read_text())
            if i == 0:
                self.manifest, self.layers = manifest, _manifest_layers(manifest)
            elif (_manifest_layers(manifest), manifest.get("top_k", TOP_K)) != (self.layers, self.manifest.get("top_k", TOP_K)):
                raise ValueError(f"{one} holds layers {_manifest_layers(manifest)} (top {manifest.get('top_k', TOP_K)}), "
                                 f"{dirs[0]} layers {self.layers} (top {self.manifest.get('top_k', TOP_K)}): they cannot be mixed")
            for name in manifest["shards"]:
                d = directory / name
                files = {k: d / f"{k}.npy" for k in self.KEYS}
                if not files["hidden"].exists():  # written before this module, by EAGLE3's trainer
                    files["hidden"] = d / "taps.npy"
                self.shards.append({k: np.load(f, mmap_mode="r") for k, f in files.items()})

    def documents(self) -> list[tuple[int, int, int]]:
        """(shard, start, end) of every document."""
        return [(i, int(s["docs"][j]), int(s["docs"][j + 1])) for i, s in enumerate(self.shards) for j in range(len(s["docs"]) - 1)]


def data_rows(data_dirs: list[str]) -> int:
    """Rows of target states in these data directories together (a trainer's --data and its
    --mix directories), as their manifests count them."""
    return sum(int(json.loads((Path(d) / "manifest.json").read_text())["tokens"]) for d in data_dirs)


def held_out_by_directory(data_dirs: list[str], held_every: int = 20) -> tuple[Shards, dict[str, list]]:
    """The shards of these directories (a trainer's --data then its --mix) and, per directory,
    its documents that such a training run holds out (``split`` over all of them together): a
    script scores a head on each recipe's held-out text apart."""
    shards = Shards(data_dirs)
    _, held = split(shards.documents(), held_every)
    # Shards keeps the directories' shards in order: which directory each shard index came from
    owner = [d for d in data_dirs for _ in json.loads((Path(d) / "manifest.json").read_text())["shards"]]
    return shards, {d: [doc for doc in held if owner[doc[0]] == d] for d in data_dirs}


def split(docs: list, held_every: int = 20) -> tuple[list, list]:
    """(training documents, held-out documents): every `held_every`-th one is held out."""
    train = [d for i, d in enumerate(docs) if i % held_every != held_every - 1]
    held = [d for i, d in enumerate(docs) if i % held_every == held_every - 1]
    return train, held


def eog_ids(path: str) -> list[int]:
    """The end-of-generation token ids of the GGUF at `path` (a draft vocabulary keeps them)."""
    from speculant.gguf import read_gguf_metadata

    meta = read_gguf_metadata(path)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    ids = [meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    ids += [i for i, t in enumerate(tokens) if t in ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<eos>")]
    return [int(i) for i in ids if i is not None]


def target_tensor(path: str, name: str) -> torch.Tensor | None:
    """The tensor `name` of the GGUF at `path`, dequantized to float32 (PyTorch order), or None."""
    from speculant.gguf import dequantize, open_gguf

    t = open_gguf(path).tensors.get(name)
    return None if t is None else dequantize(t.data, t.qtype, t.shape)


def draft_vocabulary(shards: Shards, docs: list, n_draft: int, n_vocab: int, always: list[int]) -> np.ndarray:
    """A drafter's vocabulary: the `n_draft` tokens the target predicts most often (top-1) on
    `docs`, with `always` (end-of-generation tokens) in, sorted (its ``d2t``)."""
    counts = np.zeros(n_vocab, dtype=np.int64)
    for s, a, b in docs:
        np.add.at(counts, np.asarray(shards.shards[s]["top_ids"][a:b, 0]), 1)
    counts[[t for t in always if 0 <= t < n_vocab]] = counts.max() + 1
    chosen = np.argsort(-counts, kind="stable")[:n_draft]
    return np.sort(chosen).astype(np.int64)


def target_to_draft(d2t: np.ndarray, n_target_vocab: int) -> torch.Tensor:
    """The inverse of a draft vocabulary: each target token's draft index, -1 where it has none."""
    t2d = torch.full((n_target_vocab,), -1, dtype=torch.long)
    t2d[torch.from_numpy(d2t)] = torch.arange(len(d2t))
    return t2d


def top1_cross_entropy(lp: torch.Tensor, top1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The hard term of a drafter's loss: per row, the cross-entropy of the log-probabilities
    `lp` [..., V] against the target's top-1 `top1` [...] (a column of `lp`, or -1 where the
    drafter's vocabulary lacks it), and the mask of the rows that have one (the others: 0).
    Greedy drafts are accepted only where the drafter's argmax is the target's top-1, which the
    soft loss against the target's top-K pursues only indirectly; `--top1-weight` mixes this in."""
    ok = top1 >= 0
    ce = -lp.gather(-1, top1.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return ce * ok, ok


def add_top1_weight_argument(p) -> None:
    """The trainers' `--top1-weight W`: loss = (1 - W) * soft + W * hard (see top1_cross_entropy)."""
    from speculant.options import float_where

    p.add_argument("--top1-weight", type=float_where("a number from 0 to 1", lambda w: 0 <= w <= 1), default=0.0, metavar="W",
                   help="mix in the cross-entropy against the target's top-1: (1-W) * soft + W * hard (default 0)")


def init_from_head(modules: dict, head_path: str) -> np.ndarray:
    """Copy a trained head's tensors (dequantized) into `modules` (GGUF tensor name -> the
    torch module whose ``weight`` it is) and return the head's draft vocabulary (``d2t``):
    fine-tuning starts where that head's training ended. Every named tensor must be in the file
    with the module's shape."""
    from speculant.gguf import dequantize, open_gguf

    g = open_gguf(head_path)
    if "d2t" not in g.tensors:
        raise ValueError(f"{head_path}: the head has no draft vocabulary (d2t) to start from")
    d2t = np.asarray(g.tensors["d2t"].data, dtype=np.int64).reshape(-1).copy()
    with torch.no_grad():
        for name, module in modules.items():
            t = g.tensors.get(name)
            if t is None:
                raise ValueError(f"{head_path}: no tensor {name} to start from")
            w = dequantize(t.data, t.qtype, t.shape)
            if tuple(w.shape) != tuple(module.weight.shape):
                raise ValueError(f"{head_path}: {name} is {tuple(w.shape)}, this training's head wants "
                                 f"{tuple(module.weight.shape)} (the head's own shape options and target)")
            module.weight.copy_(w)
    return d2t


def training_threads(threads: int | None) -> int:
    """Give torch the cores for training (`threads`, default every core this process may use) and
    return how many. Loading the target leaves torch one thread (the CPU backend's kernels bring
    their own, see speculant_cpu), so a trainer that loaded it to collect data would otherwise
    train on one core."""
    if not threads:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, threads))
    return torch.get_num_threads()


def bf16_default() -> bool:
    """Whether bfloat16 autocast pays off for training here: where the CPU computes bf16 dot
    products natively (AVX-512 BF16 or AMX)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def add_recipe_arguments(p) -> None:
    """The data options every trainer shares (beside --data, --source, --tokens)."""
    p.add_argument("--recipe", choices=RECIPES, default="read",
                   help="read: source files read back as chat turns (default); self: the target's own greedy answers "
                        "to requests built from those files (speculant.distill), generated first")
    p.add_argument("--answers", default=None,
                   help="with --recipe self: the answers file to write or reuse (default DATA/answers.jsonl); "
                        "collections for different layers can share one")
    p.add_argument("--answer-batch", type=int, default=8, help="with --recipe self: requests decoded at once (default 8)")
    p.add_argument("--answer-tokens", type=int, default=384, help="with --recipe self: tokens an answer at most (default 384)")
    p.add_argument("--answer-spec-type", default=None, metavar="TYPES",
                   help="with --recipe self: speculators to decode the answers with (a --spec-type list, e.g. "
                        "suffix,ngram-simple; the answers are the same, sooner where they copy the request)")
    p.add_argument("--answer-from", type=int, default=0, metavar="N",
                   help="with --recipe self: answer the requests from the N-th of the recipe's fixed order on (default 0), "
                        "e.g. past those an earlier head was trained on")
    p.add_argument("--answer-kind", choices=ANSWER_KINDS, default="assist",
                   help="with --recipe self: assist (work on given code or data, default), scratch (code written from "
                        "a description) or tasks (everyday programming tasks from a catalog); one kind to an answers file")
    p.add_argument("--mix", action="append", default=[], metavar="DIR",
                   help="another data directory, already collected for the same layers, to train on as well (repeatable)")


def recipe_options(args) -> dict:
    """`collect`'s keywords from the options of :func:`add_recipe_arguments`."""
    return {"recipe": args.recipe, "answers": args.answers, "answer_batch": args.answer_batch, "answer_tokens": args.answer_tokens,
            "answer_spec_types": args.answer_spec_type, "answer_from": args.answer_from,
            "answer_kind": args.answer_kind}
