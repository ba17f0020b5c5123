"""Build and load the native kernels at first use.

The library (qmatmul.cpp: the linear layers; attention.cpp: decode attention; elementwise.cpp:
SwiGLU, the GELU table and rope tables with llama.cpp's arithmetic) is compiled with the
machine's C++ compiler for this CPU (-march=native) and cached
under ``$SPECULANT_CACHE`` (default ``~/.cache/speculant``) by a hash of the source, the compiler
and the CPU flags, so a later start loads it in milliseconds. It is reached through ctypes: no
Python or torch headers, so it builds in a couple of seconds. When there is no compiler, or the
CPU lacks AVX-512 VNNI, `load()` returns None with the reason in `why_unavailable()`, and the
backend keeps torch's kernels (``SPECULANT_NATIVE=0`` makes it keep them anyway).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCES = [Path(__file__).with_name(name) for name in ("qmatmul.cpp", "attention.cpp", "elementwise.cpp")]
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


def _build(compiler: str) -> Path:
    key = hashlib.sha256()
    for source in SOURCES:
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


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.spk_abi_version.restype = ctypes.c_int
    lib.spk_set_threads.argtypes = [ctypes.c_int]
    lib.spk_threads.restype = ctypes.c_int
    lib.spk_supports.argtypes = [ctypes.c_int, i64]
    lib.spk_supports.restype = ctypes.c_int
    lib.spk_linear.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr]
    lib.spk_linear.restype = ctypes.c_int
    lib.spk_linear_prompt.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ptr]
    lib.spk_linear_prompt.restype = ctypes.c_int
    lib.spk_linear_mode.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    lib.spk_linear_mode.restype = ctypes.c_int
    lib.spk_prefault.argtypes = [ptr, i64]
    c_int, c_float = ctypes.c_int, ctypes.c_float
    lib.spk_attention_f16.argtypes = [ptr, i64, c_int, c_int, c_int, c_int, ptr, ptr, i64, i64, ptr, i64, c_float, ptr, c_int, i64]
    lib.spk_attention_f16.restype = c_int
    lib.spk_exp_check.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32]
    lib.spk_exp_check.restype = i64
    lib.spk_swiglu.argtypes = [ptr, ptr, ptr, i64, i64]
    lib.spk_swiglu.restype = None
    lib.spk_gelu_table.argtypes = [ptr]
    lib.spk_gelu_table.restype = None
    lib.spk_rope_table.argtypes = [ptr, i64, c_int, c_float, c_float, ptr, ptr]
    lib.spk_rope_table.restype = None
    lib.spk_rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, c_float]
    lib.spk_rms_norm.restype = None
    lib.spk_rope_apply.argtypes = [ptr, ptr, ptr, i64, i64, i64, c_int]
    lib.spk_rope_apply.restype = None
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
