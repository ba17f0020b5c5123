"""speculant.context.KVCache: the per-sequence K/V buffers behind every transformer forward."""
import pytest
import torch

from speculant import Context, KVCache, LimitError

N_LAYERS, N_KV, HEAD_DIM = 3, 2, 4


def cache(max_tokens=1024, **kw) -> KVCache:
    return KVCache(N_LAYERS, N_KV, HEAD_DIM, max_tokens, **kw)


def rows(start: int, n: int, layer: int = 0, seq: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [n_kv_heads, n, head_dim] whose values encode (seq, layer, position, head, dim)."""
    pos = torch.arange(start, start + n, dtype=torch.float32)[None, :, None]
    head = torch.arange(N_KV, dtype=torch.float32)[:, None, None]
    dim = torch.arange(HEAD_DIM, dtype=torch.float32)[None, None, :]
    k = seq * 1e5 + layer * 1e4 + pos * 10 + head + dim / 8  # exact in float32 for what the tests use
    return k, -k


def append(c: KVCache, seq: int, toks: int) -> None:
    """What a model's forward does for `toks` new rows of sequence `seq`."""
    start = c.length(seq)
    c.reserve(seq, start + toks)
    for layer in range(N_LAYERS):
        k, v = rows(start, toks, layer, seq)
        c.write(layer, seq, start, k, v)
    c.commit(seq, start + toks)


def stored(c: KVCache, seq: int, layer: int = 0):
    s = c.seqs[seq]
    return s.k[layer][:, : s.length], s.v[layer][:, : s.length]


def test_is_a_truncatable_context():
    c = cache()
    assert isinstance(c, Context) and c.state_kind == "kv"
    assert c.length(0) == 0 and c.length(12345) == 0  # unknown sequences are empty
    c.truncate(7, 3)  # no-ops on unknown sequences
    c.drop(7)
    assert c.seqs == {}


def test_reserve_write_commit_length():
    c = cache()
    c.reserve(0, 5)
    assert c.length(0) == 0  # reserving makes room, it does not add tokens
    cap = c.seqs[0].capacity
    assert cap >= 5 and all(t.shape == (N_KV, cap, HEAD_DIM) and t.dtype == torch.float32 for t in c.seqs[0].k + c.seqs[0].v)
    for layer in range(N_LAYERS):
        k, v = rows(0, 5, layer)
        kc, vc = c.write(layer, 0, 0, k, v)
        # write returns views of the whole sequence up to the last written row
        assert torch.equal(kc, k) and torch.equal(vc, v)
        assert kc.data_ptr() == c.seqs[0].k[layer].data_ptr()
    assert c.length(0) == 0  # not before commit
    c.commit(0, 5)
    assert c.length(0) == 5
    append(c, 0, 3)
    assert c.length(0) == 8
    for layer in range(N_LAYERS):
        k, v = stored(c, 0, layer)
        want_k, want_v = rows(0, 8, layer)
        assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_write_returns_cache_including_earlier_rows():
    c = cache()
    append(c, 0, 4)
    c.reserve(0, 6)
    k, v = rows(4, 2, layer=1)
    kc, vc = c.write(1, 0, 4, k, v)
    want_k, want_v = rows(0, 6, layer=1)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_growth_keeps_data_and_doubles():
    c = cache(max_tokens=10_000)
    append(c, 0, 200)
    cap0 = c.seqs[0].capacity
    ptr0 = c.seqs[0].k[0].data_ptr()
    append(c, 0, cap0 - 200)  # exactly full: no growth
    assert c.seqs[0].capacity == cap0 and c.seqs[0].k[0].data_ptr() == ptr0
    append(c, 0, 1)  # one more: reallocated with (at least) double capacity
    assert c.seqs[0].capacity >= 2 * cap0
    assert c.length(0) == cap0 + 1
    for layer in range(N_LAYERS):
        k, v = stored(c, 0, layer)
        want_k, want_v = rows(0, cap0 + 1, layer)
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
    # a big reservation at once gets what it asks for
    c.reserve(1, 3000)
    assert c.seqs[1].capacity >= 3000


def test_growth_is_capped_at_max_tokens():
    c = cache(max_tokens=300)
    append(c, 0, 256)
    append(c, 0, 44)
    assert c.length(0) == 300 and c.seqs[0].capacity == 300
    k, _ = stored(c, 0)
    assert torch.equal(k, rows(0, 300)[0])


def test_growth_after_truncate_keeps_only_kept_rows():
    c = cache(max_tokens=10_000)
    append(c, 0, 250)
    c.truncate(0, 100)
    append(c, 0, 400)  # grows; rows 100.. are rewritten
    assert c.length(0) == 500
    k, v = stored(c, 0, 2)
    # rows 100..499 were written by the second append at positions 100..499 -> same encoding
    assert torch.equal(k, rows(0, 500, 2)[0]) and torch.equal(v, rows(0, 500, 2)[1])


def test_truncate_moves_length_without_copying():
    c = cache()
    append(c, 0, 10)
    before = [(t.data_ptr(), t.shape) for t in c.seqs[0].k + c.seqs[0].v]
    kept = stored(c, 0)[0][:, :6].clone()
    c.truncate(0, 6)
    assert c.length(0) == 6
    assert [(t.data_ptr(), t.shape) for t in c.seqs[0].k + c.seqs[0].v] == before  # same storage
    assert torch.equal(stored(c, 0)[0], kept)
    # appending after a truncate overwrites in place, still the same storage
    c.reserve(0, 8)
    k, v = torch.full((N_KV, 2, HEAD_DIM), 7.0), torch.full((N_KV, 2, HEAD_DIM), 8.0)
    kc, vc = c.write(0, 0, 6, k, v)
    c.commit(0, 8)
    assert [(t.data_ptr(), t.shape) for t in c.seqs[0].k + c.seqs[0].v] == before
    assert torch.equal(kc[:, :6], kept) and torch.equal(kc[:, 6:], k) and torch.equal(vc[:, 6:], v)
    assert c.length(0) == 8


def test_truncate_bounds():
    c = cache()
    append(c, 0, 10)
    c.truncate(0, 50)  # longer than the sequence: nothing changes
    assert c.length(0) == 10
    c.truncate(0, -3)  # clamped to empty
    assert c.length(0) == 0
    c.truncate(0, 5)  # truncate never extends
    assert c.length(0) == 0
    append(c, 0, 3)
    assert torch.equal(stored(c, 0)[0], rows(0, 3)[0])


def test_drop_forgets_the_sequence():
    c = cache()
    append(c, 0, 10)
    append(c, 1, 4)
    c.drop(0)
    assert c.length(0) == 0 and 0 not in c.seqs and c.length(1) == 4
    c.drop(0)  # twice is fine
    append(c, 0, 2)  # a new sequence under the old id starts empty
    assert c.length(0) == 2 and torch.equal(stored(c, 0)[0], rows(0, 2)[0])


def test_limit_error_past_max_tokens():
    c = cache(max_tokens=16)
    c.reserve(0, 16)  # exactly the context is fine
    with pytest.raises(LimitError, match="16"):
        c.reserve(0, 17)
    append(c, 1, 10)
    with pytest.raises(LimitError):
        append(c, 1, 7)
    assert c.length(1) == 10  # a refused reservation leaves the sequence as it was
    assert torch.equal(stored(c, 1)[0], rows(0, 10, seq=1)[0])


def test_many_sequences_are_independent():
    c = cache(max_tokens=4096)
    lengths = {s: 3 + 37 * s % 300 for s in range(12)}
    for step in range(4):  # interleaved appends of different sizes
        for s, n in lengths.items():
            append(c, s, n // 4 + (n % 4 if step == 3 else 0))
    assert {s: c.length(s) for s in lengths} == lengths
    c.truncate(3, 1)
    c.drop(5)
    append(c, 3, 2)
    for s, n in lengths.items():
        if s == 5:
            assert c.length(5) == 0
            continue
        want = n if s != 3 else 3
        assert c.length(s) == want
        for layer in range(N_LAYERS):
            k, v = stored(c, s, layer)
            # each sequence's rows carry its own id: nothing leaked between sequences
            assert torch.equal(k, rows(0, want, layer, s)[0]), (s, layer)
            assert torch.equal(v, rows(0, want, layer, s)[1])
    # separate storage per sequence
    ptrs = {c.seqs[s].k[0].data_ptr() for s in c.seqs}
    assert len(ptrs) == len(c.seqs)


def test_dtype_and_v_head_dim():
    c = cache(dtype=torch.bfloat16, v_head_dim=6)
    c.reserve(0, 3)
    s = c.seqs[0]
    assert s.k[0].dtype == torch.bfloat16 and s.k[0].shape[-1] == HEAD_DIM and s.v[0].shape[-1] == 6
    kc, vc = c.write(0, 0, 0, torch.ones(N_KV, 3, HEAD_DIM), torch.ones(N_KV, 3, 6))
    assert kc.dtype == vc.dtype == torch.bfloat16 and vc.shape == (N_KV, 3, 6)
