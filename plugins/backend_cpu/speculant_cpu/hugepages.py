"""Weights the native kernels stream, copied into memory backed by transparent huge pages.

A decode step reads every weight once, from memory: its speed is the memory's. The file's map
is made of 4 KiB pages, and a hardware prefetcher stops at each page's end (and each page is a
TLB entry); 2 MiB pages let a stream run on. Measured on a Zen 4 (2 cores), the same kernel over
the same bytes, alternated in one process: the 1.5B's Q4_K gate/up matrices 27.6 -> 30.0 GB/s,
its Q6_K down matrices 30.2 -> 32.5, its 1536 x 1536 ones 26.1 -> 28.2 (docs/benchmarks.md,
fortieth run).

Copies go into blocks of anonymous private memory, 2 MiB-aligned, marked MADV_HUGEPAGE before
they are first touched (the kernel's THP setting "madvise" or "always"); each copy 64-byte
aligned inside a block. Where the kernel has THP off ("never"), or with SPECULANT_HUGEPAGES=0,
nothing is copied and the kernels read the file's map as before. Resident memory stays about
the same: the loader releases the file's pages of each tensor copied (its page cache, shared
and reclaimable, may keep them). The copy costs load time where fresh 2 MiB pages are slow to
fault: in a Firecracker guest whose freed memory goes back to the host, loading the 1.5B took
3.5-4.9 s against 1.3-1.5 (on bare metal a gigabyte of huge pages faults in a fraction of a
second); a one-row decode step ran 4-12% faster (fortieth run).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
from pathlib import Path

import numpy as np

HUGE = 2 << 20
BLOCK = 64 << 20  # a block holds many matrices; a larger one gets a block of its own size
ALIGN = 64
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The kernel's transparent huge page setting: "always", "madvise", "never", or "" where it
    has none (another OS, or no such file)."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else ""


def enabled() -> bool:
    if os.environ.get("SPECULANT_HUGEPAGES", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


class Arena:
    """Bump allocation of copies in huge-page blocks. Blocks live as long as the arena; a copy
    keeps its arena alive (numpy's base chain reaches the block's mmap)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._block: mmap.mmap | None = None
        self._next = 0  # offset of the next copy in the current block
        self._end = 0

    def _new_block(self, nbytes: int) -> None:
        size = max(BLOCK, -(-nbytes // HUGE) * HUGE)
        block = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(block))
        start = -base % HUGE  # the first 2 MiB boundary: only aligned 2 MiB ranges can be huge pages
        block.madvise(mmap.MADV_HUGEPAGE, start, size)
        self._block, self._next, self._end = block, start, start + size

    def copy(self, data: np.ndarray, lib=None) -> np.ndarray:
        """`data`'s bytes in the arena, as an array of its dtype and shape; copied by the native
        library's threads where `lib` is given (spk_copy)."""
        data = np.ascontiguousarray(data)
        with self._lock:
            if self._block is None or self._next + data.nbytes > self._end:
                self._new_block(data.nbytes)
            offset = self._next
            self._next = -(-(offset + data.nbytes) // ALIGN) * ALIGN
            block = self._block
        out = np.frombuffer(block, dtype=data.dtype, count=data.size, offset=offset).reshape(data.shape)
        if lib is not None and data.nbytes:
            lib.spk_copy(out.ctypes.data, data.ctypes.data, data.nbytes)
        else:
            np.copyto(out, data)
        return out


_arena: Arena | None = None
_arena_lock = threading.Lock()


def copy(data: np.ndarray, lib=None) -> np.ndarray | None:
    """`data` copied into the process's huge-page arena (by `lib`'s threads where given), or
    None where huge pages are off."""
    global _arena
    if not enabled():
        return None
    with _arena_lock:
        if _arena is None:
            _arena = Arena()
    return _arena.copy(data, lib)
