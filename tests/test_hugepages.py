"""The weights' copy in huge pages (speculant_cpu/hugepages.py): the same bytes, the same
results, the file's pages released, and nothing copied where huge pages are off."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from speculant.testing.tiny_gguf import quantize
from speculant_cpu import hugepages, native

lib = native.load()
pytestmark = pytest.mark.skipif(lib is None, reason=f"native kernels unavailable: {native.why_unavailable()}")


def linear_info(n=48, k=512, qtype=Q.Q4_K, seed=0):
    raw = quantize(np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32), qtype)
    return type("Info", (), {"data": raw, "qtype": qtype, "shape": (n, k)})()


def test_thp_mode_reads_the_bracketed_setting(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    for text, mode in (("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
                       ("always madvise [never]\n", "never")):
        setting.write_text(text)
        monkeypatch.setattr(hugepages, "THP_SETTING", setting)
        assert hugepages.thp_mode() == mode
        assert hugepages.enabled() == (mode != "never")
    monkeypatch.setattr(hugepages, "THP_SETTING", tmp_path / "absent")
    assert hugepages.thp_mode() == "" and not hugepages.enabled()


def test_environment_turns_the_copy_off(monkeypatch):
    monkeypatch.setenv("SPECULANT_HUGEPAGES", "0")
    assert not hugepages.enabled()
    assert hugepages.copy(np.zeros(10, np.uint8)) is None


@pytest.mark.parametrize("with_lib", [False, True])
def test_arena_copies_are_aligned_distinct_and_exact(with_lib):
    arena = hugepages.Arena()
    rng = np.random.default_rng(1)
    arrays = [rng.integers(0, 256, size, dtype=np.uint8) for size in (1, 1000, 3 << 20, 70, 80 << 20)]
    arrays.append(rng.standard_normal((33, 7)).astype(np.float32))
    copies = [arena.copy(a, lib if with_lib else None) for a in arrays]
    for a, c in zip(arrays, copies):
        assert c.dtype == a.dtype and c.shape == a.shape and np.array_equal(c, a)
        assert c.ctypes.data % hugepages.ALIGN == 0
    spans = sorted((c.ctypes.data, c.ctypes.data + c.nbytes) for c in copies)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no two copies overlap
    big = copies[4]  # larger than a block: a block of its own, from a 2 MiB boundary
    assert big.ctypes.data % hugepages.HUGE == 0


def test_native_linear_on_the_copy_gives_the_mapping_results(monkeypatch):
    from speculant_cpu.backend import CpuBackend, NativeLinear

    x = torch.from_numpy(np.random.default_rng(2).standard_normal((5, 512)).astype(np.float32))
    results = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("SPECULANT_HUGEPAGES", setting)
        monkeypatch.setattr(hugepages, "thp_mode", lambda: "madvise")
        info = linear_info()
        lin = CpuBackend().linear(info)
        assert isinstance(lin, NativeLinear)
        assert lin.uses_mapping == (setting == "0")  # a copy lets the loader release the file's pages
        assert (lin.raw is info.data) == (setting == "0")
        assert np.array_equal(lin.raw, info.data)
        results[setting] = torch.cat([lin(x[i : i + 1]) for i in range(len(x))] + [lin(x)])
    assert torch.equal(results["0"], results["1"])


@pytest.mark.skipif(hugepages.thp_mode() not in ("always", "madvise"), reason="the kernel has transparent huge pages off")
def test_blocks_are_marked_for_huge_pages():
    """The arena's blocks carry MADV_HUGEPAGE (smaps' VmFlags "hg"), so the kernel may back them
    with 2 MiB pages; whether it does depends on its free memory, so that is not asserted."""
    arena = hugepages.Arena()
    copy = arena.copy(np.ones(4 << 20, np.uint8))
    address = copy.ctypes.data
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    flags = None
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            if lo <= address < hi:
                flags = next(l for l in lines[i + 1 :] if l.startswith("VmFlags"))
                break
    assert flags is not None and " hg" in flags


def test_tied_embedding_reads_the_heads_copy(monkeypatch):
    """Where the output head and the token embedding are one table, the lookup reads the head's
    copy (the file's pages stay released) and gives the rows the map gives."""
    from speculant_cpu.backend import CpuBackend

    monkeypatch.setenv("SPECULANT_HUGEPAGES", "1")
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "madvise")
    backend = CpuBackend()
    info = linear_info(n=40, k=256, qtype=Q.Q6_K)
    head = backend.linear(info)
    table = backend.embedding(info)
    assert not head.uses_mapping and table.raw is head.raw
    other = backend.embedding(linear_info(n=40, k=256, qtype=Q.Q6_K, seed=3))  # untied: the map
    assert other.raw is not head.raw
    ids = torch.tensor([0, 7, 39, 7])
    monkeypatch.setenv("SPECULANT_HUGEPAGES", "0")
    assert torch.equal(table(ids), CpuBackend().embedding(info)(ids))
