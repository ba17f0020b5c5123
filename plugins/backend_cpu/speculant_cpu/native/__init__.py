"""Build and load the native kernels at first use.

The library (every .cpp here, one g++ call: linear.cpp and the files it calls for the linear
layers, attention.cpp for decode attention, elementwise.cpp for SwiGLU, the GELU table and rope
tables with llama.cpp's arithmetic; see docs/architecture.md) is compiled with the machine's C++
compiler for this CPU (-march=native) and cached
under ``$SPECULANT_CACHE`` (default ``~/.cache/speculant``) by a hash of the sources and headers,
the compiler and the CPU flags, so a later start loads it in milliseconds. It is reached through ctypes: no
Python or torch headers, so it builds in a couple of seconds. When there is no compiler, or the
CPU lacks AVX-512 VNNI, `load()` returns None with the reason in `why_unavailable()`, and the
backend keeps torch's kernels (``SPECULANT_NATIVE=0`` makes it keep them anyway).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.cpp"))  # every translation unit here is part of the library
HEADERS = sorted(HERE.glob("*.h"))    # spk.h (the C API) and the internal headers
ABI_VERSION = 5
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-pthread", "-Wno-maybe-uninitialized"]

_lib: ctypes.CDLL | None = None
_why: str | None = None
_tried = False


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("SPECULANT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "speculant")
    return Path(root) / "native"


def _source_files() -> list[Path]:
    """Every file the library is built from, all in the cache key: an edit to any rebuilds."""
    return [*SOURCES, *HEADERS]


def _build(compiler: str) -> Path:
    key = hashlib.sha256()
    for source in _source_files():
        key.update(source.name.encode())
        key.update(source.read_bytes())
    key.update(" ".join(FLAGS).encode())
    key.update(subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.encode())
    key.update(_cpu_flags().encode())
    target = _cache_dir() / f"libspk-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build to a temporary name and rename: concurrent first uses (test workers, servers) never
    # load a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    result = subprocess.run([compiler, *FLAGS, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True)
    if result.returncode != 0:
        os.unlink(tmp)
        first = next((l for l in result.stderr.splitlines() if "error" in l), result.stderr.strip()[:200])
        raise RuntimeError(f"compiling the native kernels failed: {first}")
    os.replace(tmp, target)
    return target


HEADER = Path(__file__).with_name("spk.h")
_CTYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "uint32_t": ctypes.c_uint32, "float": ctypes.c_float, "void": None}
_DECL = re.compile(r"^(\w+)\s+(spk_\w+)\((.*)\);", re.M)


def _ctype(decl: str):
    """A C parameter or return type of spk.h as ctypes: pointers as void*, the scalars by name."""
    decl = decl.strip()
    if "*" in decl:
        return ctypes.c_void_p
    return _CTYPES[decl.rsplit(" ", 1)[0] if " " in decl else decl]


def api() -> dict[str, tuple[object, list[object]]]:
    """spk.h's functions: name -> (restype, argtypes), those with a function-pointer parameter
    (for the library's own use) left out."""
    out = {}
    for ret, name, params in _DECL.findall(HEADER.read_text()):
        if "(*" in params:
            continue
        out[name] = (_CTYPES[ret], [_ctype(p) for p in params.split(",") if p.strip()])
    return out


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The ctypes signatures, from spk.h (the header the library is compiled against)."""
    for name, (restype, argtypes) in api().items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def load() -> ctypes.CDLL | None:
    """The native library, built on first use; None when it cannot be had here."""
    global _lib, _why, _tried
    if _tried:
        return _lib
    _tried = True
    if platform.machine().lower() not in ("x86_64", "amd64"):
        _why = f"native kernels are written for x86-64, this is {platform.machine()}"
        return None
    flags = _cpu_flags()
    if "avx512_vnni" not in flags or "avx512bw" not in flags:
        _why = "this CPU lacks AVX-512 VNNI"
        return None
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        _why = "no C++ compiler found (install g++ or set CXX)"
        return None
    try:
        lib = _bind(ctypes.CDLL(str(_build(compiler))))
    except (OSError, RuntimeError) as e:
        _why = str(e)
        return None
    if lib.spk_abi_version() != ABI_VERSION:
        _why = "the cached native library does not match this version"
        return None
    _lib = lib
    return lib


def why_unavailable() -> str | None:
    load()
    return _why
