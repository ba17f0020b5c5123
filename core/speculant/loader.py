"""Load a model: open the GGUF file, pick the architecture plugin and the backend, show progress."""
from __future__ import annotations

import os
import sys
import threading

from gguf import GGMLQuantizationType

from tqdm import tqdm

from speculant.errors import ModelFileError, SpeculantError
from speculant.gguf.file import open_gguf, shown
from speculant.gguf.quants import SUPPORTED_TYPES
from speculant.model import Model
from speculant.plugins import Registry, default_registry

INDEX_TYPES = frozenset(GGMLQuantizationType[n] for n in ("I8", "I16", "I32", "I64"))


def load_model(path: str, backend: str = "cpu", registry: Registry | None = None, progress: bool = True,
               threads: int | None = None) -> Model:
    """The model at `path` on the named backend plugin, built as ``cls()`` or, with `threads`
    (the -t option), ``cls(threads=threads)``."""
    registry = registry or default_registry()
    gguf = open_gguf(path)
    arch = gguf.architecture
    if not arch:
        raise ModelFileError(f"{path}: metadata 'general.architecture' is missing")
    if ("architecture", arch) not in registry.entries:
        known = ", ".join(registry.names("architecture")) or "none installed"
        raise ModelFileError(f"{path}: architecture {shown(arch)} is not supported (supported: {known})")
    for t in gguf.tensors.values():
        # Integer tensors are index tables (an EAGLE3 head's d2t) that the architecture reads itself.
        if t.qtype not in SUPPORTED_TYPES and t.qtype not in INDEX_TYPES:
            supported = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
            raise ModelFileError(f"{path}: tensor '{t.name}' has type {t.qtype.name}, which is not supported (supported: {supported})")
    builder = registry.get("architecture", arch)
    cls = registry.get("backend", backend)
    device = cls() if threads is None else cls(threads=threads)
    total = sum(t.data.nbytes for t in gguf.tensors.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {os.path.basename(path)}",
              disable=not progress, file=sys.stderr, leave=False) as bar:
        try:
            model = builder(gguf, device, bar.update)
        except SpeculantError:
            raise
        except (ArithmeticError, LookupError, TypeError, ValueError, RecursionError) as e:
            # The architecture checks what it reads; a file that slips past its checks must still
            # be one line (and exit 2), not a traceback. Backend failures (out of memory, a
            # device error) are not the file's and pass through.
            raise ModelFileError(f"{path}: cannot build a {shown(arch)} model from this file "
                                 f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
    return model


_once: dict[tuple, Model] = {}
_once_lock = threading.Lock()


def load_model_once(path: str, backend: str = "cpu", threads: int | None = None, what: str = "model") -> Model:
    """The model at `path`, loaded once per process and shared: for speculators that load a
    model of their own (a draft model, a drafter head), which a benchmark or a server builds
    afresh for every run while the weights have no per-run state (their contexts do). Keyed by
    the file's identity (real path, mtime, size), the backend and `threads`, so a changed file
    loads again. `what` names the file in the one-line error when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise SpeculantError(f"{path}: cannot read the {what}: {e.strerror or e}") from None
    key = (os.path.realpath(path), st.st_mtime_ns, st.st_size, backend, threads)
    with _once_lock:  # two servers' engines starting at once build it once
        model = _once.get(key)
        if model is None:
            try:
                model = load_model(path, backend=backend, progress=sys.stderr.isatty(), threads=threads)
            except OSError as e:
                raise SpeculantError(f"{path}: cannot read the {what}: {e.strerror or e}") from None
            _once[key] = model
    return model
