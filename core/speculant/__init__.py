"""speculant: a speculative-decoding microkernel.

The public API that plugins import. Everything else in the package is internal.
"""
from speculant.errors import DeviceUnavailable, LimitError, ModelFileError, SpeculantError
from speculant.hookspecs import hookimpl, hookspec
from speculant.constraint import Constraint
from speculant.types import Batch, Draft, DraftLimits, DraftRequest, ForwardOutput, SequenceView, SpeculatorState
from speculant.model import (Backend, BackendKernels, Context, DecoderLayerSpec, LayerRows, Model, ModelInfo, RecurrentContext,
                             backend_kernel)
from speculant.context import KVCache
from speculant.hybrid import Checkpoint, HybridCache, kv_layers
from speculant.options import float_where, int_in

__all__ = [
    "Backend", "BackendKernels", "Batch", "Checkpoint", "Constraint", "Context", "DecoderLayerSpec", "DeviceUnavailable", "Draft", "DraftLimits", "DraftRequest", "ForwardOutput", "HybridCache", "KVCache", "LayerRows", "LimitError",
    "Model", "ModelFileError", "ModelInfo", "RecurrentContext", "SequenceView", "SpeculantError",
    "SpeculatorConfig", "SpeculatorState", "backend_kernel", "float_where", "hookimpl", "hookspec", "int_in", "kv_layers", "load_model",
    "load_model_once",
]


def __getattr__(name: str):
    # load_model(path, backend="cpu", progress=True) -> Model, for plugins that load a model of
    # their own (a draft model); imported on first use so `import speculant` stays light.
    if name in ("load_model", "load_model_once"):  # load_model_once: shared by every run of a process
        import speculant.loader

        return getattr(speculant.loader, name)
    if name == "SpeculatorConfig":  # what a speculator class is built with: cls(config)
        from speculant.speculator import SpeculatorConfig

        return SpeculatorConfig
    raise AttributeError(f"module 'speculant' has no attribute {name!r}")
