"""Sliding-window attention on the host backends: a query at position i sees keys j with i - window < j <= i
(transformers' sliding_window_overlay), on the reference, the CPU backend's NumPy decode and prefill paths and
the native decode kernel, against a dense float64 reference; block-table entries before every query's window
(freed blocks, -1) are never read."""

import numpy as np
import pytest

from minisarathi.backends.cpu import attention, native_attention
from minisarathi.backends.cpu.ops import CpuOps
from minisarathi.backends.reference import ReferenceOps
from minisarathi.testing import ScheduledChunk, build_batch

Hq, Hk, D, BLOCK_SIZE = 6, 2, 8, 4
# (history, new tokens): decodes deep past the window, a chunk that starts past it, one that straddles it,
# whole prompts shorter and longer than it, a chunk of several query tiles
RUNS = [(40, 1), (9, 1), (2, 1), (30, 7), (5, 9), (0, 23), (0, 3), (10, 140)]


def case(seed: int, window: int | None, drop: bool):
    """A batch over blocks scattered in a pool of random numbers and its queries; drop: the block-table
    entries that lie wholly before the first query's window are -1, as the block manager leaves them."""
    rng = np.random.default_rng(seed)
    needs = [-(-(h + n) // BLOCK_SIZE) for h, n in RUNS]
    pool = rng.permutation(sum(needs) + 3).tolist()
    tables = []
    for (h, _), need in zip(RUNS, needs):
        table = [pool.pop() for _ in range(need)]
        dead = 0 if window is None or not drop else max(0, (h - window + 1) // BLOCK_SIZE)
        tables.append([-1] * dead + table[dead:])
    batch = build_batch([ScheduledChunk([0] * n, h, t, True) for (h, n), t in zip(RUNS, tables)], BLOCK_SIZE)
    shape = (sum(needs) + 3, Hk, BLOCK_SIZE, D)
    k_cache, v_cache = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    q = (2 * rng.standard_normal((batch.num_tokens, Hq, D))).astype(np.float32)
    return batch, q, k_cache, v_cache


def dense(q, k_cache, v_cache, batch, scale, window):
    """float64[T, Hq, D]: each row over its visible keys, gathered key by key."""
    out = np.empty(q.shape)
    for s in range(batch.num_seqs):
        for t in range(batch.query_start[s], batch.query_start[s + 1]):
            p = int(batch.positions[t])
            keys = np.arange(0 if window is None else max(0, p - window + 1), p + 1)
            blocks = batch.block_tables[s][keys // BLOCK_SIZE]
            k = k_cache[blocks, :, keys % BLOCK_SIZE].astype(np.float64)  # [n, Hk, D]
            v = v_cache[blocks, :, keys % BLOCK_SIZE].astype(np.float64)
            for h in range(Hq):
                scores = k[:, h // (Hq // Hk)] @ (q[t, h].astype(np.float64) * scale)
                w = np.exp(scores - scores.max())
                out[t, h] = (w / w.sum()) @ v[:, h // (Hq // Hk)]
    return out


def backends(monkeypatch, name):
    if name == "reference":
        return ReferenceOps()
    if name == "cpu-numpy":
        monkeypatch.setattr(native_attention, "runs", lambda: False)
    elif native_attention.kernel() is None:
        pytest.skip("no native decode kernel here")
    return CpuOps()


@pytest.mark.parametrize("name", ["reference", "cpu-numpy", "cpu-native"])
@pytest.mark.parametrize("window", [1, 5, 12, 64])
def test_matches_dense_float64_with_freed_blocks(monkeypatch, name, window):
    ops = backends(monkeypatch, name)
    batch, q, k_cache, v_cache = case(window, window, drop=True)
    want = dense(q, k_cache, v_cache, batch, 0.4, window)
    got = ops.paged_attention(q.copy(), k_cache, v_cache, batch, 0.4, window)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    if window < 40:  # negative control: without the window the rows past it differ
        full = ops.paged_attention(q.copy(), k_cache, v_cache, case(window, window, False)[0], 0.4)
        assert np.abs(full - want).max() > 1e-2


def test_kept_decode_kv_and_groups(monkeypatch):
    """NumPy's decode K/V kept across steps and gathered group by group, both with the window's mask."""
    monkeypatch.setattr(native_attention, "runs", lambda: False)
    batch, q, k_cache, v_cache = case(3, 6, drop=True)
    want = dense(q, k_cache, v_cache, batch, 0.4, 6)
    for group_bytes in (1, 1 << 30):
        monkeypatch.setattr(attention, "DECODE_GROUP_BYTES", group_bytes)
        plan = attention.AttentionPlan(batch, *k_cache.shape)
        kept = attention.DecodeKV(
            k_cache, (np.zeros(k_cache.size, np.float32), np.zeros(k_cache.size, np.float32))
        )
        for decode_kv in (None, kept):
            got = attention.paged_attention(
                q, k_cache, v_cache, plan, attention.GatherBuffers(), 0.4, 6, decode_kv
            )
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
