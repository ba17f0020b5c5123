"""The backend contract: every kernel against a float64 reference, and batch invariance.

The reference is the definition: weights dequantized exactly as gguf-py does (speculant's
dequantize is bit-equal to it), the math in float64 torch on the CPU. Weights come from a real
GGUF file written here, one tensor per GGUF type the loader accepts, so a backend sees exactly
what it sees when loading a model.

Stated tolerances (relative L2 error of a kernel's output, class attributes):

=============  =======  =================================================================
kernel         rtol     why
=============  =======  =================================================================
linear         2e-2     bf16 or q8 activations, bf16 weights: each ~2^-9 relative, 256 inputs
embedding      5e-3     a row stored in bf16 at most
tensor         1e-6     norm weights are float32 (exact)
attention      2e-3     fp16 q/k/v with float32 accumulation
=============  =======  =================================================================

Batch invariance is exact: a row's result may not depend on the rows computed with it (the
engine's temperature-0 exactness rests on it), so it is compared bit for bit.

A backend whose device is missing raises ``speculant.DeviceUnavailable`` from its constructor;
its tests are skipped with that reason.
"""
from __future__ import annotations


import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter

from speculant.errors import DeviceUnavailable
from speculant.gguf.quants import SUPPORTED_TYPES, dequantize
from speculant.testing.tiny_gguf import quantize

QTYPES = sorted((q.name for q in SUPPORTED_TYPES), key=lambda n: Q[n].value)
IN_FEATURES = 256  # a multiple of every block size (K-quants: 256)
OUT_FEATURES = (64, 40)  # a multiple of 16 and not (the CPU backend packs int4 only for the first)
N_EMBD_ROWS = 96


def write_weights(path: str) -> str:
    """A GGUF file with linear weights, biases, embeddings and norm weights of every type."""
    rng = np.random.default_rng(0)
    w = GGUFWriter(path, "contract")
    for q in QTYPES:
        for out in OUT_FEATURES:
            x = (rng.standard_normal((out, IN_FEATURES)) / 16).astype(np.float32)
            data = quantize(x, q)
            w.add_tensor(f"linear.{q}.{out}", data, raw_dtype=Q[q] if data.dtype == np.uint8 else None)
        x = rng.standard_normal((N_EMBD_ROWS, IN_FEATURES)).astype(np.float32)
        data = quantize(x, q)
        w.add_tensor(f"embd.{q}", data, raw_dtype=Q[q] if data.dtype == np.uint8 else None)
    for out in OUT_FEATURES:
        w.add_tensor(f"bias.{out}", rng.standard_normal(out).astype(np.float32))
    for q in ("F32", "F16", "BF16"):
        x = (1 + 0.1 * rng.standard_normal(IN_FEATURES)).astype(np.float32)
        data = quantize(x, q)
        w.add_tensor(f"norm.{q}", data, raw_dtype=Q[q] if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference(info) -> torch.Tensor:
    return dequantize(info.data, info.qtype, info.shape).double()


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of the whole output, ||got - ref|| / ||ref|| (per row it would punish
    the rounding of rows that happen to sum to almost nothing)."""
    return float((got.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def attention_reference(q, k, v, positions, scale, window):
    q, k, v = q.double(), k.double(), v.double()
    n_rows, n_head, _ = q.shape
    group = n_head // k.shape[0]
    out = torch.empty(n_rows, n_head, v.shape[-1], dtype=torch.float64)
    for i, p in enumerate(positions.tolist()):
        lo = max(0, p + 1 - window) if window else 0
        for h in range(n_head):
            kh, vh = k[h // group, lo : p + 1], v[h // group, lo : p + 1]
            out[i, h] = torch.softmax(kh @ q[i, h] * scale, 0) @ vh
    return out


# (rows, n_cached, window): a decode row, a verification batch with and without a sliding
# window, and prompt chunks longer than 128 rows (the CPU backend's batched path).
ATTENTION_CASES = [(1, 7, 0), (5, 20, 0), (5, 20, 4), (16, 40, 0), (130, 130, 0), (140, 150, 8)]


class BackendContract:
    """Base class of the backend contract. Parametrized by ``backend_name``."""

    #: backends this class tests; None: every installed one (or those --speculant-plugin selects)
    backends: tuple[str, ...] | None = None

    LINEAR_RTOL = 2e-2
    EMBEDDING_RTOL = 5e-3
    TENSOR_RTOL = 1e-6
    ATTENTION_RTOL = 2e-3

    @pytest.fixture
    def backend_class(self, speculant_registry, backend_name):
        return speculant_registry.get("backend", backend_name)

    @pytest.fixture
    def backend(self, backend_class, backend_name):
        try:
            return backend_class()
        except DeviceUnavailable as e:
            pytest.skip(f"backend '{backend_name}': {e}")

    @pytest.fixture
    def weights(self, speculant_backend_weights):
        return speculant_backend_weights

    def inputs(self, backend, *shape, seed=0):
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(backend.device)

    # --- kernels against the reference ---------------------------------------------------------
    def test_device_and_kv_dtype(self, backend):
        assert isinstance(backend.device, torch.device), "backend.device must be a torch.device"
        assert isinstance(backend.kv_dtype, torch.dtype) and backend.kv_dtype.is_floating_point
        assert isinstance(backend.name, str) and backend.name

    @pytest.mark.parametrize("qtype", QTYPES)
    def test_linear_matches_reference(self, backend, weights, qtype):
        for out in OUT_FEATURES:
            w, b = weights[f"linear.{qtype}.{out}"], weights[f"bias.{out}"]
            x = self.inputs(backend, 7, IN_FEATURES)
            for bias in (None, b):
                y = backend.linear(w, bias)(x)
                assert y.dtype == torch.float32 and y.shape == (7, out) and y.device.type == backend.device.type
                ref = x.cpu().double() @ reference(w).T + (0 if bias is None else reference(b))
                err = rel_error(y.cpu(), ref)
                assert err <= self.LINEAR_RTOL, f"{qtype} [{out}x{IN_FEATURES}] bias={bias is not None}: " \
                                                f"relative error {err:.2e} > {self.LINEAR_RTOL}"

    @pytest.mark.parametrize("qtype", QTYPES)
    def test_linear_is_batch_invariant(self, backend, weights, qtype):
        """Each row equals itself computed in any other batch, bit for bit."""
        for out in OUT_FEATURES:
            lin = backend.linear(weights[f"linear.{qtype}.{out}"], weights[f"bias.{out}"])
            x = self.inputs(backend, 35, IN_FEATURES, seed=1)
            full = lin(x).cpu()
            for start, n in ((0, 1), (3, 1), (0, 2), (5, 3), (2, 16), (1, 17), (0, 33)):
                part = lin(x[start : start + n]).cpu()
                assert torch.equal(part, full[start : start + n]), \
                    f"{qtype} [{out}x{IN_FEATURES}]: rows {start}..{start + n - 1} alone differ from the same rows in a batch of 35"

    @pytest.mark.parametrize("qtype", QTYPES)
    def test_embedding_matches_reference(self, backend, weights, qtype):
        w = weights[f"embd.{qtype}"]
        ids = torch.tensor([0, 5, 5, N_EMBD_ROWS - 1, 17])
        y = backend.embedding(w)(ids.to(backend.device))
        assert y.dtype == torch.float32 and y.shape == (len(ids), IN_FEATURES)
        err = rel_error(y.cpu(), reference(w)[ids])
        assert err <= self.EMBEDDING_RTOL, f"{qtype}: relative error {err:.2e} > {self.EMBEDDING_RTOL}"

    @pytest.mark.parametrize("qtype", ["F32", "F16", "BF16"])
    def test_tensor_matches_reference(self, backend, weights, qtype):
        w = weights[f"norm.{qtype}"]
        y = backend.tensor(w)
        assert y.dtype == torch.float32 and tuple(y.shape) == tuple(w.shape)
        err = rel_error(y.cpu(), reference(w))
        assert err <= self.TENSOR_RTOL, f"{qtype}: relative error {err:.2e} > {self.TENSOR_RTOL}"

    @pytest.mark.parametrize("rows,n_cached,window", ATTENTION_CASES)
    def test_attention_matches_reference(self, backend, rows, n_cached, window):
        n_head, n_kv, head_dim = 4, 2, 32
        q = self.inputs(backend, rows, n_head, head_dim, seed=2)
        k = self.inputs(backend, n_kv, n_cached, head_dim, seed=3).to(backend.kv_dtype)
        v = self.inputs(backend, n_kv, n_cached, head_dim, seed=4).to(backend.kv_dtype)
        positions = torch.arange(n_cached - rows, n_cached)
        scale = head_dim ** -0.5
        y = backend.attention(q, k, v, positions.to(backend.device), scale, window)
        assert y.dtype == torch.float32 and y.shape == (rows, n_head, head_dim)
        err = rel_error(y.cpu(), attention_reference(q.cpu(), k.cpu().float(), v.cpu().float(), positions, scale, window))
        assert err <= self.ATTENTION_RTOL, f"rows={rows} n_cached={n_cached} window={window}: " \
                                           f"relative error {err:.2e} > {self.ATTENTION_RTOL}"

    @pytest.mark.parametrize("window", [0, 4])
    def test_attention_rows_are_independent(self, backend, window):
        """A verification batch's row equals the same row decoded alone, bit for bit."""
        n_head, n_kv, head_dim, n_cached, rows = 4, 2, 32, 24, 9
        q = self.inputs(backend, rows, n_head, head_dim, seed=5)
        k = self.inputs(backend, n_kv, n_cached, head_dim, seed=6).to(backend.kv_dtype)
        v = self.inputs(backend, n_kv, n_cached, head_dim, seed=7).to(backend.kv_dtype)
        positions = torch.arange(n_cached - rows, n_cached).to(backend.device)
        full = backend.attention(q, k, v, positions, 0.2, window).cpu()
        for i in range(rows):
            alone = backend.attention(q[i : i + 1], k[:, : n_cached - rows + i + 1], v[:, : n_cached - rows + i + 1],
                                      positions[i : i + 1], 0.2, window).cpu()
            assert torch.equal(alone[0], full[i]), f"row {i} alone (cache cut after it) differs from the row in a batch of {rows}"

    # --- the suite itself ------------------------------------------------------------------------
    def test_contract_declarations(self, backend_class):
        """contract_xfail names real contract tests, each with a reason."""
        names = {n for n in dir(BackendContract) if n.startswith("test_")}
        for name, reason in getattr(backend_class, "contract_xfail", {}).items():
            assert name in names, f"contract_xfail names '{name}', which is not a contract test ({', '.join(sorted(names))})"
            assert isinstance(reason, str) and reason.strip(), f"contract_xfail['{name}'] needs a reason"

    def test_contract_is_complete(self):
        missing = [n for n in dir(BackendContract) if n.startswith("test_") and not callable(getattr(type(self), n, None))]
        assert not missing, f"contract tests removed: {missing}"
