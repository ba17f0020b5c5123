"""The screened output head: a greedy row's argmax without reading the whole head.

A greedy row (temperature 0, no logprobs, no grammar: `Batch.argmax_only`) needs only the index
of its largest logit. The output head is a large share of a decode step's memory traffic (the
1.5B's Q6_K head: 191 MB of about 1 GB), so the screen reads a Q4_K copy of it instead (131 MB)
and bounds how far each approximate logit a_v can be from the exact one:

    |exact_v - a_v| <= ||w_v - w4_v|| * ||x~|| + rounding              (Cauchy-Schwarz)

with x~ the row as the kernels quantize it (Q8_K: ||x~|| <= ||x|| + sqrt(k) max|x| / 254). A token
can be the argmax only if its upper bound reaches the best lower bound; those candidates get
their exact logits from the head's own rows, by the same kernel in the same mode as the full head
(a row's result does not depend on the rows computed with it), so the argmax, ties to the lowest
index, is the full head's bit for bit. The other entries of the row are -inf. Used for calls of up to
MAX_ROWS rows (1-2 with the AVX-512 kernels, all with the AVX2 ones).

Measured on the 1.5B, development text: a median of 31 candidates a row (p90 310, max about
10k). A Q3_K copy (100 MB) would bound nothing: its ||w - w3|| is 2.5 times larger, and every
token stayed a candidate.

The copy is built once per head (numpy, about 20 s for the 1.5B's on 2 cores) in a thread started
by the first greedy call, kept under $SPECULANT_CACHE/screens by a hash of the head's bytes (then
a start reads it back in about 0.5 s), and used as soon as it is ready; until then, and with
SPECULANT_SCREEN=0, greedy rows take the full head.
"""
from __future__ import annotations

import atexit
import hashlib
import math
import os
import threading
import weakref
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from speculant.gguf import dequantize, quantize_k
from speculant.logs import get_logger

from speculant_cpu import hugepages, native

log = get_logger(__name__)

SCREEN_QTYPE = Q.Q4_K
SCREEN_VERSION = 1  # in the cache key: a change to how the copy or its bounds are made
CHUNK_ROWS = 8192  # head rows requantized at a time (bounds the build's memory)
CAP = 16384  # candidates a row may keep; a row with more takes the full head
MAX_K = 16384  # the rounding slack below holds for rows up to this long
# Calls of up to this many rows take the screen, by the library's ISA. Decode reads the head from
# memory, and the copy is smaller. With AVX-512, from 3 rows the kernels' arithmetic, not the
# memory, sets the head's time, and the Q4_K copy's costs about what the head's does (the 1.5B,
# rows past 256 tokens: 1 row 5.43 -> 4.29 ms, 2 rows 5.69 -> 4.83, 3 rows 6.73 both, 4 rows 7.83
# -> 8.12, 16 rows 19.9 -> 20.4, 48 rows 49.6 -> 54.1). The AVX2 kernels do Q4_K's arithmetic
# faster than Q6_K's, so there the copy pays at every row count measured (without AVX-VNNI: 1 row
# 6.2-6.6 -> 5.0-5.1 ms, 4 rows 10.8-12.9 -> 9.4-10.9, 8 rows 23.9 -> 15.7, 16 rows 34.1 -> 29.3,
# 48 rows 82.7 -> 77.9).
MAX_ROWS = {"avx512": 2, "avx2": 64}
CACHE_MIN_VALUES = 1 << 24  # smaller heads are requantized at every load (milliseconds), not cached
# Relative slack per row: the two kernels' float rounding (a few ulps per block, 2^-24 each) on
# terms bounded by ||w|| ||x~|| and ||w4|| ||x~||, with room to spare.
REL_SLACK = 1e-4
ABS_SLACK = 1e-5


def _row_bytes(qtype: int, k: int) -> int:
    block, size = gguf.GGML_QUANT_SIZES[Q(qtype)]
    return k // block * size


def _cache_dir() -> Path:
    return native.cache_root() / "screens"


def enabled() -> bool:
    return os.environ.get("SPECULANT_SCREEN", "1").strip() not in ("0", "false", "no", "off")


class Cancelled(Exception):
    """The process is exiting: the copy's build stops between chunks and writes nothing."""


class Screen:
    """The Q4_K copy of one head and each row's bound factor q_v (||w_v - w4_v|| plus slack)."""

    def __init__(self, q4: np.ndarray, qv: np.ndarray):
        self.q4, self.qv = q4, np.ascontiguousarray(qv, dtype=np.float32)


def build_screen(raw: np.ndarray, qtype: int, n: int, k: int, cancel: threading.Event | None = None) -> Screen:
    """Requantize the head (raw: its GGUF rows, n x row bytes) to Q4_K and bound each row;
    raises Cancelled between chunks once `cancel` is set."""
    raw = raw.reshape(n, -1)
    q4 = np.empty((n, _row_bytes(SCREEN_QTYPE, k)), np.uint8)
    qv = np.empty(n, np.float32)
    for r0 in range(0, n, CHUNK_ROWS):
        if cancel is not None and cancel.is_set():
            raise Cancelled
        r1 = min(n, r0 + CHUNK_ROWS)
        w = dequantize(raw[r0:r1], Q(qtype), (r1 - r0, k)).numpy()
        q4[r0:r1] = quantize_k(w, SCREEN_QTYPE)
        w4 = dequantize(q4[r0:r1], SCREEN_QTYPE, (r1 - r0, k)).numpy()
        w64, w464 = w.astype(np.float64), w4.astype(np.float64)
        bound = np.sqrt(((w64 - w464) ** 2).sum(1)) + REL_SLACK * (np.sqrt((w64 ** 2).sum(1)) + np.sqrt((w464 ** 2).sum(1)))
        b32 = bound.astype(np.float32)
        qv[r0:r1] = np.where(b32 < bound, np.nextafter(b32, np.float32(np.inf)), b32)  # rounded up
    return Screen(q4, qv)


def load_or_build(raw: np.ndarray, qtype: int, n: int, k: int, cancel: threading.Event | None = None) -> Screen:
    """The cached screen of these bytes, or a new one (then cached)."""
    if n * k < CACHE_MIN_VALUES:
        return build_screen(raw, qtype, n, k, cancel)
    h = hashlib.blake2b(digest_size=16)
    h.update(f"v{SCREEN_VERSION} {int(qtype)} {n} {k}".encode())
    h.update(memoryview(np.ascontiguousarray(raw).reshape(-1)))
    path = _cache_dir() / f"{h.hexdigest()}.npz"
    try:
        with np.load(path) as f:
            q4, qv = f["q4"], f["qv"]
        if q4.shape == (n, _row_bytes(SCREEN_QTYPE, k)) and q4.dtype == np.uint8 and qv.shape == (n,):
            return Screen(q4, qv)
    except Exception:  # noqa: BLE001 - absent, truncated or foreign: build it again
        pass
    screen = build_screen(raw, qtype, n, k, cancel)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(tmp, q4=screen.q4, qv=screen.qv)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache costs a rebuild next time, nothing else
        log.warning("screen_cache_unwritable", path=str(path), error=str(e))
    return screen


class ScreenedHead:
    """Greedy rows' logits from a NativeLinear head (see the module docstring)."""

    def __init__(self, head, background: bool = True):
        self.head = head
        self.lib = head.lib
        self.n, self.k = head.out_features, head.in_features
        self.screen: Screen | None = None
        self.error: str | None = None
        self.max_rows = MAX_ROWS["avx512" if self.lib.spk_isa() == 1 else "avx2"]
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._build, name="speculant-screen", daemon=True)
        _building.add(self)
        if not background:
            self._build()

    def start(self) -> None:
        """Build or load the copy in a thread, once: at the first greedy call, so that a model
        never decoded greedily (a draft model, a training run) costs nothing."""
        if self.screen is None and self.error is None and self._thread.ident is None:
            self._thread.start()

    @staticmethod
    def worth_it(head) -> bool:
        """A copy pays where it is smaller than the head and the bound's slack holds."""
        k = head.in_features
        return (head.bias is None and k % 256 == 0 and k <= MAX_K
                and _row_bytes(SCREEN_QTYPE, k) < head.raw.nbytes // head.out_features)

    def _build(self) -> None:
        try:
            screen = load_or_build(self.head.raw, self.head.qtype, self.n, self.k, self._cancel)
            q4 = hugepages.copy(screen.q4, self.lib)  # streamed at every greedy decode step, as the weights
            if q4 is None:
                self.lib.spk_prefault(screen.q4.ctypes.data, screen.q4.nbytes)
            else:
                screen.q4 = q4
            self.screen = screen
            log.info("screen_ready", rows=self.n, mbytes=round(screen.q4.nbytes / 1e6, 1))
        except Cancelled:
            self.error = "cancelled: the process is exiting"
        except Exception as e:  # noqa: BLE001 - the full head keeps working without it
            self.error = f"{type(e).__name__}: {e}"
            log.warning("screen_failed", error=self.error)

    def stop(self) -> None:
        """Stop a build in progress (at exit) and wait for its thread."""
        self._cancel.set()
        if self._thread.is_alive():
            self._thread.join()

    def wait(self) -> bool:
        self.start()
        if self._thread.is_alive():
            self._thread.join()
        return self.screen is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """Logits [rows, n] whose argmax is the full head's, -inf off the candidates; None while
        the screen is not ready or for rows it cannot bound (non-finite values). Inside the
        head's `batch` scope: each row's candidates are computed in its own kind, as the head
        would compute the row."""
        screen = self.screen
        if screen is None:
            self.start()
            return None
        if x.shape[0] > self.max_rows:
            return None
        kinds = self.head.backend.row_kinds
        if kinds is not None and len(kinds) != x.shape[0]:
            return None
        x = x.to(torch.float32).contiguous()
        if not bool(torch.isfinite(x).all()):
            return None
        m = x.shape[0]
        approx = torch.empty(m, self.n)
        if self.lib.spk_linear(int(SCREEN_QTYPE), screen.q4.ctypes.data, self.n, self.k, x.data_ptr(), m, approx.data_ptr()):
            return None
        amax = x.abs().amax(1).double()
        xb = (x.double().norm(dim=1) + math.sqrt(self.k) * amax / 254) * (1 + 1e-6)
        x_bound = xb.float().numpy()
        idx = np.empty((m, CAP), np.int32)
        counts = np.empty(m, np.int64)
        self.lib.spk_screen_select(approx.data_ptr(), m, self.n, screen.qv.ctypes.data, x_bound.ctypes.data, ABS_SLACK,
                                   idx.ctypes.data, CAP, counts.ctypes.data)
        out = torch.full((m, self.n), -math.inf)
        weights = self.head.raw.reshape(self.n, -1)
        for i in range(m):
            kind = np.array([kinds[i] if kinds is not None else 0], np.uint8)
            c = int(counts[i])
            rows = weights if c < 0 else np.ascontiguousarray(weights[idx[i, :c]])
            nrows = self.n if c < 0 else c
            y = torch.empty(nrows)
            if self.lib.spk_linear_prompt(self.head.qtype, rows.ctypes.data, nrows, self.k, x[i].data_ptr(), 1, y.data_ptr(),
                                          kind.ctypes.data):
                return None
            if c < 0:
                out[i] = y
            else:
                out[i, torch.from_numpy(idx[i, :c].astype(np.int64))] = y
        return out


# Heads whose copy may be building. A daemon thread still inside numpy or torch when the
# interpreter finalizes is ended from under C++ frames, and the process aborts ("terminate called
# without an active exception", exit 134): a short `speculant generate` ended that way whenever
# the copy was not yet cached. At exit each build stops at its next chunk (within about a
# second) and is joined, before finalization.
_building: "weakref.WeakSet[ScreenedHead]" = weakref.WeakSet()


@atexit.register
def _stop_builds() -> None:
    for head in list(_building):
        head.stop()
