"""Reading hyperparameters and weights out of a GGUF file, with progress and clear errors."""
from __future__ import annotations

from typing import Callable

from speculant import ModelFileError, ModelInfo


class WeightLoader:
    """Hands GGUF tensors to the backend and reports the bytes done to `progress`."""

    def __init__(self, gguf, backend, progress: Callable[[int], None] | None):
        self.gguf, self.backend, self.progress = gguf, backend, progress or (lambda n: None)

    def _get(self, name: str, optional: bool = False):
        info = self.gguf.tensors.get(name)
        if info is None and not optional:
            raise ModelFileError(f"{self.gguf.path}: tensor '{name}' is missing")
        if info is not None:
            self.progress(info.data.nbytes)
        return info

    def _convert(self, convert, info):
        out = convert(info)
        if not getattr(out, "uses_mapping", False):  # the backend made its own copy
            self.gguf.release(info)
        return out

    def linear(self, name: str, bias: str | None = None):
        weight = self._get(name)
        b = self._get(bias, optional=True) if bias else None
        return self._convert(lambda w: self.backend.linear(w, b), weight)

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def tensor(self, name: str):
        return self._convert(self.backend.tensor, self._get(name))

    def embedding(self, name: str):
        return self._convert(self.backend.embedding, self._get(name))


def require(gguf, key: str):
    value = gguf.arch_key(key)
    if value is None:
        raise ModelFileError(f"{gguf.path}: metadata '{gguf.architecture}.{key}' is missing")
    return value


def model_info(gguf, n_vocab: int, n_embd: int, n_layers: int) -> ModelInfo:
    import os

    return ModelInfo(
        path=gguf.path, architecture=gguf.architecture, n_vocab=n_vocab, n_embd=n_embd, n_layers=n_layers,
        n_ctx_train=int(gguf.arch_key("context_length", 4096)), file_bytes=os.path.getsize(gguf.path),
    )
