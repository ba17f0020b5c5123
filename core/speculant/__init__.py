"""speculant: a speculative-decoding microkernel.

The public API that plugins import. Everything else in the package is internal.
"""
from speculant.errors import LimitError, ModelFileError, SpeculantError
from speculant.hookspecs import hookimpl, hookspec
from speculant.types import Batch, Draft, DraftLimits, ForwardOutput, SequenceView
from speculant.model import Backend, Context, Model, ModelInfo, RecurrentContext
from speculant.context import KVCache

__all__ = [
    "Backend", "Batch", "Context", "Draft", "DraftLimits", "ForwardOutput", "KVCache", "LimitError",
    "Model", "ModelFileError", "ModelInfo", "RecurrentContext", "SequenceView", "SpeculantError",
    "hookimpl", "hookspec",
]
