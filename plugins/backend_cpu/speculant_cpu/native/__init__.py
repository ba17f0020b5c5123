"""Build and load the native kernels at first use.

The library (every .cpp here, one g++ call: linear.cpp and the files it calls for the linear
layers, attention.cpp for decode attention, elementwise.cpp for SwiGLU, the GELU table and rope
tables with llama.cpp's arithmetic; see docs/architecture.md) is compiled with the machine's C++
compiler for one instruction set, and cached under ``$SPECULANT_CACHE`` (default
``~/.cache/speculant``) by a hash of the sources and headers, the flags, the compiler and the CPU
flags, so a later start loads it in milliseconds. The instruction sets (``SPECULANT_ISA``, default
the best this CPU has):

- ``avx512``: ``-march=native`` on a CPU with AVX-512 VNNI (and AMX where it has it;
  ``SPECULANT_AMX=0`` keeps the kernels off it);
- ``avx2``: ``-march=haswell`` on a CPU with AVX2, FMA, F16C and BMI2, plus ``-mavxvnni`` where
  the CPU has AVX-VNNI;
- ``avx2-novnni``: ``avx2`` without AVX-VNNI even where the CPU has it.

Every ISA computes the same bits (docs/architecture.md), so any of them can be built and tested
on one box: an AVX-512 machine runs all three. It is reached through ctypes: no Python or torch
headers, so it builds in a couple of seconds. When there is no compiler, or the CPU has none of
these, `load()` returns None with the reason in `why_unavailable()`, and the backend keeps
torch's kernels (``SPECULANT_NATIVE=0`` makes it keep them anyway).
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
ABI_VERSION = 10
FLAGS = ["-O3", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-pthread", "-Wno-maybe-uninitialized"]
ISAS = ("avx512", "avx2", "avx2-novnni")  # best first
ISA_IDS = {1: "avx512", 2: "avx2", 3: "avx2-novnni"}  # spk_isa() -> what was built (avx2 on a CPU without AVX-VNNI is 3)

_libs: dict[str, ctypes.CDLL | None] = {}
_whys: dict[str, str | None] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _cpu_has(flags: str, *names: str) -> bool:
    words = set(flags.split())
    return all(n in words for n in names)


def isa_flags(isa: str, cpu_flags: str | None = None) -> list[str] | None:
    """The compiler's target flags for `isa` on this CPU, or None where the CPU cannot run it."""
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
    if isa == "avx512":
        return ["-march=native"] if _cpu_has(flags, "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c") else None
    if isa in ("avx2", "avx2-novnni"):
        if not _cpu_has(flags, "avx2", "fma", "f16c", "bmi2"):
            return None
        # -march=haswell: AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE, which every AVX2 x86 CPU has
        return ["-march=haswell"] + (["-mavxvnni"] if isa == "avx2" and _cpu_has(flags, "avx_vnni") else [])
    raise ValueError(f"unknown ISA {isa!r}: one of {', '.join(ISAS)}")


def available_isas() -> list[str]:
    """The ISAs this CPU can run, best first."""
    return [isa for isa in ISAS if isa_flags(isa) is not None]


def selected_isa() -> str | None:
    """SPECULANT_ISA, or the best ISA this CPU has (None: none)."""
    chosen = os.environ.get("SPECULANT_ISA", "").strip().lower()
    if chosen:
        return chosen
    have = available_isas()
    return have[0] if have else None


def cache_root() -> Path:
    """$SPECULANT_CACHE, default ~/.cache/speculant: the backend's caches live under it."""
    return Path(os.environ.get("SPECULANT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "speculant"))


def _cache_dir() -> Path:
    return cache_root() / "native"


def _source_files() -> list[Path]:
    """Every file the library is built from, all in the cache key: an edit to any rebuilds."""
    return [*SOURCES, *HEADERS]


def _build(compiler: str, target: list[str]) -> Path:
    flags = [*FLAGS, *target]
    key = hashlib.sha256()
    for source in _source_files():
        key.update(source.name.encode())
        key.update(source.read_bytes())
    key.update(" ".join(flags).encode())
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
    result = subprocess.run([compiler, *flags, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True)
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


def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The native library for `isa` (default: selected_isa()), built on first use; None when it
    cannot be had here. Each ISA's library is loaded once per process; several can be loaded side
    by side (the tests compare them)."""
    if isa is None:
        isa = selected_isa()
    if isa is None:
        _whys[None] = "this CPU has neither AVX-512 VNNI nor AVX2 with FMA and F16C"
        return None
    if isa not in _libs:
        _libs[isa], _whys[isa] = _load(isa)
    return _libs[isa]


def _load(isa: str) -> tuple[ctypes.CDLL | None, str | None]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"native kernels are written for x86-64, this is {platform.machine()}"
    if isa not in ISAS:
        return None, f"SPECULANT_ISA={isa!r} is not one of {', '.join(ISAS)}"
    target = isa_flags(isa)
    if target is None:
        need = "AVX-512 VNNI" if isa == "avx512" else "AVX2, FMA, F16C and BMI2"
        return None, f"this CPU lacks {need} (SPECULANT_ISA={isa})"
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        return None, "no C++ compiler found (install g++ or set CXX)"
    try:
        lib = _bind(ctypes.CDLL(str(_build(compiler, target))))
    except (OSError, RuntimeError) as e:
        return None, str(e)
    if lib.spk_abi_version() != ABI_VERSION:
        return None, "the cached native library does not match this version"
    return lib, None


def isa_of(lib: ctypes.CDLL) -> str:
    """The ISA a loaded library was built for (avx2 without AVX-VNNI reads avx2-novnni)."""
    return ISA_IDS[lib.spk_isa()]


def why_unavailable(isa: str | None = None) -> str | None:
    if isa is None:
        isa = selected_isa()
    load(isa)
    return _whys.get(isa)
