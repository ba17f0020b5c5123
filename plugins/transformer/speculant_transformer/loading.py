"""Reading hyperparameters and weights out of a GGUF file, with progress and clear errors.

A file must not load into a model that fails later, on the first request: every hyperparameter
is checked (an integer where one is needed, in range, the attention heads dividing evenly) and
every tensor's shape is checked against them, so that a broken file is one ModelFileError here.
"""
from __future__ import annotations

import math
from typing import Callable

from speculant import ModelFileError, ModelInfo


class WeightLoader:
    """Hands GGUF tensors to the backend and reports the bytes done to `progress`. With `shape`
    (PyTorch order: rows, columns), a tensor of another shape is a ModelFileError."""

    def __init__(self, gguf, backend, progress: Callable[[int], None] | None):
        self.gguf, self.backend, self.progress = gguf, backend, progress or (lambda n: None)

    def _get(self, name: str, optional: bool = False, shape: tuple[int, ...] | None = None):
        info = self.gguf.tensors.get(name)
        if info is None and not optional:
            raise ModelFileError(f"{self.gguf.path}: tensor '{name}' is missing")
        if info is not None:
            check_shape(self.gguf, info, shape)
            self.progress(info.data.nbytes)
        return info

    def _convert(self, convert, info):
        out = convert(info)
        if not getattr(out, "uses_mapping", False):  # the backend made its own copy
            self.gguf.release(info)
        return out

    def linear(self, name: str, bias: str | None = None, shape: tuple[int, int] | None = None):
        weight = self._get(name, shape=shape)
        b = self._get(bias, optional=True, shape=(weight.shape[0],)) if bias else None
        return self._convert(lambda w: self.backend.linear(w, b), weight)

    def joined_linear(self, names: list[str], shape: tuple[int, int]):
        """One linear layer over the rows of `names` (each of `shape`), where the file holds them
        back to back (GGUFFile.joined); None where it does not: load them one by one then."""
        joined = getattr(self.gguf, "joined", None)
        info = joined(names) if joined is not None else None
        if info is None:
            return None
        for name in names:
            check_shape(self.gguf, self.gguf.tensors[name], shape)
        self.progress(info.data.nbytes)
        return self._convert(lambda w: self.backend.linear(w, None), info)

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def tensor(self, name: str, shape: tuple[int, ...] | None = None):
        return self._convert(self.backend.tensor, self._get(name, shape=shape))

    def embedding(self, name: str, shape: tuple[int, int] | None = None):
        return self._convert(self.backend.embedding, self._get(name, shape=shape))


def check_shape(gguf, info, shape: tuple[int, ...] | None) -> None:
    if shape is not None and tuple(info.shape) != tuple(shape):
        raise ModelFileError(f"{gguf.path}: tensor '{info.name}' has shape {list(info.shape)}, expected "
                             f"{list(shape)} from the '{gguf.architecture}.*' hyperparameters")


_REQUIRED = object()


def _describe(value) -> str:
    if isinstance(value, list):
        return f"an array of {len(value)} values"
    if isinstance(value, str):
        return f"the string {value!r:.40}"
    return f"{type(value).__name__} {value!r:.40}"


def require(gguf, key: str):
    value = gguf.arch_key(key)
    if value is None:
        raise ModelFileError(f"{gguf.path}: metadata '{gguf.architecture}.{key}' is missing")
    return value


def hparam_int(gguf, key: str, default=_REQUIRED, minimum: int = 1) -> int:
    """An integer hyperparameter (`default` when absent; required without one), at least `minimum`."""
    value = gguf.arch_key(key)
    if value is None:
        if default is _REQUIRED:
            raise ModelFileError(f"{gguf.path}: metadata '{gguf.architecture}.{key}' is missing")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelFileError(f"{gguf.path}: metadata '{gguf.architecture}.{key}' must be an integer, "
                             f"got {_describe(value)}")
    if value < minimum:
        raise ModelFileError(f"{gguf.path}: metadata '{gguf.architecture}.{key}' must be at least {minimum}, got {value}")
    return value


def hparam_float(gguf, key: str, default: float) -> float:
    """A positive, finite number (`default` when absent)."""
    value = gguf.arch_key(key)
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelFileError(f"{gguf.path}: metadata '{gguf.architecture}.{key}' must be a number, got {_describe(value)}")
    if not (math.isfinite(value) and value > 0):
        raise ModelFileError(f"{gguf.path}: metadata '{gguf.architecture}.{key}' must be a positive number, got {value}")
    return float(value)


def attention_shape(gguf, n_embd: int) -> tuple[int, int, int]:
    """(n_head, n_kv_head, head_dim), checked: the query heads share the KV heads evenly, and the
    head size is even (rotary embeddings turn pairs) and, where not given, divides n_embd."""
    n_head = hparam_int(gguf, "attention.head_count")
    n_kv_head = hparam_int(gguf, "attention.head_count_kv", n_head)
    prefix = f"{gguf.path}: metadata '{gguf.architecture}.attention."
    if n_head % n_kv_head:
        raise ModelFileError(f"{prefix}head_count' ({n_head}) is not a multiple of 'head_count_kv' ({n_kv_head})")
    if gguf.arch_key("attention.key_length") is None and n_embd % n_head:
        raise ModelFileError(f"{prefix}head_count' ({n_head}) does not divide the embedding length ({n_embd}) "
                             f"and 'attention.key_length' is missing")
    head_dim = hparam_int(gguf, "attention.key_length", n_embd // n_head)
    if head_dim % 2:
        raise ModelFileError(f"{prefix}key_length' is {head_dim}: rotary embeddings need an even head size")
    value_length = hparam_int(gguf, "attention.value_length", head_dim)
    if value_length != head_dim:
        raise ModelFileError(f"{prefix}value_length' ({value_length}) differs from the key length ({head_dim}), "
                             f"which this architecture does not support")
    return n_head, n_kv_head, head_dim


def vocab_size(gguf, tokenizer, n_embd: int) -> int:
    """The rows of token_embd.weight, which must be [n_vocab, n_embd] and hold every token the
    tokenizer can produce (else a prompt would index past the embedding)."""
    embd = gguf.tensor("token_embd.weight")
    if len(embd.shape) != 2 or embd.shape[0] < 1:
        raise ModelFileError(f"{gguf.path}: tensor 'token_embd.weight' has shape {list(embd.shape)}, "
                             f"expected [n_vocab, {n_embd}]")
    check_shape(gguf, embd, (embd.shape[0], n_embd))
    n_vocab = embd.shape[0]
    n_tokens = getattr(tokenizer, "n_vocab", 0)
    if n_tokens > n_vocab:
        raise ModelFileError(f"{gguf.path}: the tokenizer has {n_tokens} tokens but 'token_embd.weight' "
                             f"has rows for {n_vocab}")
    return n_vocab


def model_info(gguf, n_vocab: int, n_embd: int, n_layers: int) -> ModelInfo:
    import os

    return ModelInfo(
        path=gguf.path, architecture=gguf.architecture, n_vocab=n_vocab, n_embd=n_embd, n_layers=n_layers,
        n_ctx_train=hparam_int(gguf, "context_length", 4096, minimum=0), file_bytes=os.path.getsize(gguf.path),
    )
