"""Slot files: llama-server's ``POST /slots/ID?action=save|restore|erase`` on the prompt cache.

A slot file holds a slot's kept state (its ``CachedPrompt``) in safetensors, a tensor format that
cannot run code when it is loaded (unlike pickle):

- ``tokens``: int32 [n], the tokens whose state the file holds;
- ``row_prompts``: int64 [k, 2], the entry's (first row, prompt length) runs, which tell the
  engine which rows a new request can reuse and still compute exactly as a cold start;
- ``k.L``, ``v.L``: the target's K and V rows of layer L (``KVCache.get_state``);
- ``spec.TYPE.NAME``: what speculator TYPE keeps for those rows (its ``export_state``; a drafter on
  hidden states cannot rebuild it from the tokens), with metadata ``spec.TYPE``, the state's key
  (what it is valid for: a speculator takes back only a state of its own key);
- metadata: ``format`` (``FORMAT``), the model it was saved from (``model``, ``architecture``,
  ``n_layers``, ``n_embd``, ``n_vocab``) and ``sha256``, a digest of the tensor data, since
  safetensors checks the header's shape but nothing of the data itself.

Files are read and written off the engine thread (in the app's executor); only taking a copy of
the state (``snapshot``) and installing one (``install``) run on it, through ``EngineWorker.call``.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import unicodedata
from typing import Any

import attrs
import torch

from speculant import SpeculatorState
from speculant_server.protocol import ApiError, bad

FORMAT = "speculant-slot-1"
NAME_MAX = 255  # bytes, as most file systems allow
MODEL_KEYS = ("model", "architecture", "n_layers", "n_embd", "n_vocab")
SPEC_PREFIX = "spec."  # tensor names and metadata keys of the speculators' states


class SlotFileError(Exception):
    """The file is not a slot file this server can restore (the app answers 400)."""


@attrs.define
class Snapshot:
    tokens: list[int]
    row_prompts: tuple[tuple[int, int], ...]
    state: dict[str, torch.Tensor]
    spec_states: dict[str, SpeculatorState] = attrs.field(factory=dict)


# --- names ----------------------------------------------------------------------------------------
def check_filename(name: Any) -> str:
    """`name` if it is a plain file name, else a 400: it can only ever name a file directly in the
    folder (no separators, not "." or "..", no control characters, at most NAME_MAX bytes)."""
    if name is None:
        raise bad("'filename' is required", param="filename")
    if not isinstance(name, str):
        raise bad(f"'filename' must be a string, got {type(name).__name__}", param="filename")
    if name in ("", ".", ".."):
        raise bad(f"'filename' must be a file name, got {name!r}", param="filename")
    if "/" in name or "\\" in name or (os.altsep and os.altsep in name):
        raise bad(f"'filename' must be a plain file name, without path separators: {name!r}", param="filename")
    if any(unicodedata.category(c) == "Cc" for c in name):
        raise bad(f"'filename' must not contain control characters: {name!r}", param="filename")
    try:
        n = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate from a JSON \\ud800 escape
        raise bad(f"'filename' is not valid Unicode: {name!r}", param="filename") from None
    if n > NAME_MAX:
        raise bad(f"'filename' is {n} bytes long, at most {NAME_MAX} are allowed", param="filename")
    return name


def path_in(folder: str, name: str) -> str:
    """The file `name` (from check_filename) in `folder`. The last check is a second line of
    defence: whatever the platform's path rules, the result is a direct child of the folder."""
    folder = os.path.abspath(folder)
    path = os.path.join(folder, name)
    if os.path.dirname(path) != folder or os.path.basename(path) != name or os.path.normpath(path) != path:
        raise bad(f"'filename' must be a plain file name: {name!r}", param="filename")
    return path


# --- what identifies the model ----------------------------------------------------------------------
def model_meta(model) -> dict[str, str]:
    info = getattr(model, "info", None)
    return {"model": os.path.basename(getattr(info, "path", "") or ""),
            "architecture": str(getattr(info, "architecture", "")),
            "n_layers": str(getattr(info, "n_layers", "")), "n_embd": str(getattr(info, "n_embd", "")),
            "n_vocab": str(getattr(info, "n_vocab", None) or model.tokenizer.n_vocab)}


# Bytes a token the speculators' states may add to a file, per value of the target's width: room
# for a few float32 rows (a hidden-state drafter keeps one float16 row a position).
SPEC_BYTES_PER_EMBD = 16


def max_file_bytes(context, n_embd: int = 0) -> int | None:
    """The largest file a state of this context can make (None: unknown), with room for the
    speculators' states of a target `n_embd` wide: files beyond it are not read into memory."""
    try:
        per_token = context.n_layers * context.n_kv_heads * (context.head_dim + (context.v_head_dim or context.head_dim))
        return context.max_tokens * (per_token * max(4, context.dtype.itemsize) + 4 + 16 + SPEC_BYTES_PER_EMBD * n_embd) + (1 << 20)
    except (AttributeError, TypeError):
        return None


# --- the engine thread's part -----------------------------------------------------------------------
def _idle(worker, slot: int) -> None:
    if worker.slots[slot] is not None:
        raise ApiError(409, f"slot {slot} is processing a request; try again once it is idle")


def snapshot(worker, slot: int) -> Snapshot:
    """A copy of the slot's kept state (engine thread)."""
    _idle(worker, slot)
    entry = worker.cache.slots[slot]
    if entry is None or not entry.tokens:
        raise bad(f"slot {slot} holds no prompt state to save (no request has finished on it since "
                  f"start-up, the last erase, or its last failed request)")
    n = len(entry.tokens)
    state = worker.engine.context.get_state(entry.seq_id)
    # A copy: the slot's next request may overwrite these rows while the file is being written.
    state = {k: v[:, :n].to("cpu", copy=True).contiguous() for k, v in state.items()}
    return Snapshot(list(entry.tokens), tuple(entry.row_prompts), state, worker.engine.speculator_states(entry))


def install(worker, slot: int, snap: Snapshot, filename: str) -> int:
    """Put a state read from a file into the slot (engine thread); its token count."""
    _idle(worker, slot)
    try:
        entry = worker.engine.adopt(snap.tokens, snap.row_prompts, snap.state, spec_states=snap.spec_states)
    except ValueError as e:
        raise bad(f"'{filename}' does not fit this server's model: {e}") from None
    worker.cache.put(slot, entry)
    return len(entry.tokens)


def erase(worker, slot: int) -> int:
    """Drop the slot's kept state (engine thread); how many tokens it held."""
    _idle(worker, slot)
    return worker.cache.erase(slot)


# --- files ------------------------------------------------------------------------------------------
def _payload(data: bytes) -> memoryview:
    """The tensor data of a safetensors file: what follows the 8-byte length and the JSON header."""
    n = int.from_bytes(data[:8], "little")
    return memoryview(data)[8 + n:]


def write(path: str, snap: Snapshot, meta: dict[str, str]) -> int:
    """Write the file through a temporary file in the same folder renamed over `path`, so that
    `path` is the old file or the whole new one, never a part; returns the bytes written."""
    from safetensors.torch import save

    tensors = {"tokens": torch.tensor(snap.tokens, dtype=torch.int32),
               "row_prompts": torch.tensor(snap.row_prompts, dtype=torch.int64).reshape(-1, 2), **snap.state}
    meta = {"format": FORMAT, **meta}
    for spec_type, saved in snap.spec_states.items():
        meta[f"{SPEC_PREFIX}{spec_type}"] = saved.key
        tensors.update({f"{SPEC_PREFIX}{spec_type}.{name}": t.contiguous() for name, t in saved.tensors.items()})
    # The digest covers the data, which goes in the header: serialize twice (the data part does
    # not depend on the metadata).
    digest = hashlib.sha256(_payload(save(tensors, meta))).hexdigest()
    data = save(tensors, {**meta, "sha256": digest})
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".slot-", suffix=".tmp", dir=folder)  # 0600: a state holds a prompt
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename too (not possible everywhere)
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return len(data)


def read(path: str, filename: str, meta: dict[str, str], n_vocab: int, max_bytes: int | None) -> tuple[Snapshot, int]:
    """A slot file's state, checked to be whole and of this model; and its size in bytes.
    SlotFileError names what is wrong; OSError (FileNotFoundError, ...) as open() raises it."""
    from safetensors.torch import load

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if max_bytes is not None and size > max_bytes:
            raise SlotFileError(f"'{filename}' is not a slot file of this server: it has {size} bytes, "
                                f"more than any state of this model and context ({max_bytes})")
        data = f.read()
    try:
        tensors = load(data)
        header = json.loads(bytes(data[8:8 + int.from_bytes(data[:8], "little")]))
    except Exception as e:  # safetensors' own error, or anything its checks let through
        raise SlotFileError(f"'{filename}' is not a slot file (not a readable safetensors file: "
                            f"{_one_line(e)})") from None
    saved = header.get("__metadata__") or {}
    if saved.get("format") != FORMAT:
        found = f"format {saved['format']!r}" if "format" in saved else "no format"
        raise SlotFileError(f"'{filename}' is not a slot file this server reads ({found}; expected {FORMAT!r})")
    differ = [f"{k} {saved.get(k)!r}, not {meta[k]!r}" for k in MODEL_KEYS if saved.get(k) != meta[k]]
    if differ:
        raise SlotFileError(f"'{filename}' was saved from another model: " + "; ".join(differ))
    if hashlib.sha256(_payload(data)).hexdigest() != saved.get("sha256"):
        raise SlotFileError(f"'{filename}' is corrupted: its tensor data does not match its checksum")
    return _snapshot_of(tensors, filename, n_vocab, saved), size


def _snapshot_of(tensors: dict[str, torch.Tensor], filename: str, n_vocab: int, meta: dict) -> Snapshot:
    def corrupt(why: str) -> SlotFileError:
        return SlotFileError(f"'{filename}' is corrupted: {why}")

    tokens, runs = tensors.get("tokens"), tensors.get("row_prompts")
    if tokens is None or runs is None:
        raise corrupt("it has no 'tokens' or no 'row_prompts' tensor")
    if tokens.dtype != torch.int32 or tokens.dim() != 1 or len(tokens) == 0:
        raise corrupt(f"'tokens' must be a non-empty int32 vector, it is {tokens.dtype} {list(tokens.shape)}")
    if int(tokens.min()) < 0 or int(tokens.max()) >= n_vocab:
        raise corrupt(f"'tokens' holds ids outside the vocabulary (0 to {n_vocab - 1})")
    if runs.dtype != torch.int64 or runs.dim() != 2 or runs.shape[1] != 2 or runs.shape[0] == 0:
        raise corrupt(f"'row_prompts' must be int64 [k, 2] with k >= 1, it is {runs.dtype} {list(runs.shape)}")
    row_prompts = tuple((int(a), int(n)) for a, n in runs.tolist())
    starts = [a for a, _ in row_prompts]
    if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] > len(tokens) \
            or any(n < 1 for _, n in row_prompts):
        raise corrupt("'row_prompts' is not a list of runs from row 0 in increasing order")
    spec_states: dict[str, SpeculatorState] = {}
    for key, value in meta.items():  # the speculators' states: what they hold is theirs to check
        if key.startswith(SPEC_PREFIX) and isinstance(value, str):
            spec_type = key[len(SPEC_PREFIX):]
            prefix = f"{SPEC_PREFIX}{spec_type}."
            spec_states[spec_type] = SpeculatorState(value, {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
    state = {k: v for k, v in tensors.items() if k not in ("tokens", "row_prompts") and not k.startswith(SPEC_PREFIX)}
    if any(not v.is_floating_point() for v in state.values()):
        raise corrupt("a K or V tensor is not floating point")
    return Snapshot(tokens.tolist(), row_prompts, state, spec_states)


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__
