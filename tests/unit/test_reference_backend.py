"""ReferenceOps (minisarathi/backends/reference.py) against float64 NumPy, and every other backend against it.

(a) each op of ReferenceOps against the same op in float64, written another way (dense masks, slots from the
    block table position by position); (b) CpuOps and (c) the CUDA kernels on the emulator (float32), op by
    op against ReferenceOps on the same inputs; (d) the bundled model greedy-generating the same tokens on
    ReferenceOps as on CpuOps. The batches mix prefill chunks with decodes over scattered block tables, with
    GQA, a padding row (slot -1) and tables wider than any sequence needs.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

import numpy as np
import pytest

from minisarathi import LLM, SamplingParams
from minisarathi.backends import cuda_ops
from minisarathi.backends.base import interface_names
from minisarathi.backends.cpu.ops import CpuOps
from minisarathi.backends.devices import make_backend
from minisarathi.backends.reference import ReferenceOps
from minisarathi.batch import Batch, make_batch
from minisarathi.config import EngineConfig, ModelConfig, rope_cos_sin_table
from minisarathi.model.llama import LlamaModel
from minisarathi.model.loader import load_weights
from minisarathi.paths import default_model_dir
from minisarathi.testing import ScheduledChunk, build_batch

EPS = 1e-5
# (tokens already in the cache, new tokens) per sequence: prefill chunks from scratch and after a history,
# decodes after a history and at position 0.
RUNS = [(0, 9), (6, 5), (13, 1), (4, 1), (0, 1), (2, 3)]
# (query heads, KV heads, head_dim, block_size): GQA groups of 2 and 4 and MHA; head_dim 8 and 16 take CpuOps'
# native decode kernel, 32 its NumPy path and the emulator's decode_attention.cu; block size 1 puts every key
# in a block of its own.
SHAPES = [(4, 2, 8, 4), (8, 2, 32, 16), (2, 2, 16, 1)]
emulator_only = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="the CUDA emulator is x86-64 Linux only"
)


def mixed_batch(rng: np.random.Generator, block_size: int) -> tuple[Batch, int]:
    """RUNS over blocks scattered through a shuffled pool (a few spare), then one padding row as a decode
    bucket pads (token 0 at position 0 over block 0, slot -1); tables two blocks wider than needed (zeros)."""
    needs = [-(-(start + n) // block_size) for start, n in RUNS]
    pool = rng.permutation(sum(needs) + 3)
    tables = np.zeros((len(RUNS) + 1, max(needs) + 2), np.int32)  # int32[S, B]
    used = 0
    for s, need in enumerate(needs):
        tables[s, :need] = pool[used : used + need]
        used += need
    counts = [n for _, n in RUNS] + [1]
    ids = rng.integers(0, 50, sum(counts)).tolist()
    batch = make_batch(
        ids, [start for start, _ in RUNS] + [0], counts, tables, [True] * len(counts), block_size
    )
    batch.slot_mapping[-1] = -1
    return batch, len(pool)


@dataclass
class Case:
    """One set of host inputs for every op: float32, small, random."""

    table: np.ndarray  # float32[V, H] embedding table
    x: np.ndarray  # float32[T, H]
    residual: np.ndarray  # float32[T, H]
    norm_w: np.ndarray  # float32[H]
    lin_w: np.ndarray  # float32[N, H]
    lin_b: np.ndarray  # float32[N]
    lin_x2: np.ndarray  # float32[T, 320]: deep enough for CpuOps' packed matmul, where it runs
    lin_w2: np.ndarray  # float32[N, 320]
    gate_up: np.ndarray  # float32[T, 2I], a few very negative gates (exp overflows)
    qkv: np.ndarray  # float32[T, (Hq + 2 Hk) D]
    k_cache: np.ndarray  # float32[blocks, Hk, block_size, D], random: the history no step of the test wrote
    v_cache: np.ndarray
    cos_sin: np.ndarray  # float32[P, D]
    inv_freq: np.ndarray  # float32[D/2]
    batch: Batch
    heads: tuple[int, int, int]
    scale: float


def make_case(shape, seed: int = 0) -> Case:
    Hq, Hk, D, block_size = shape
    rng = np.random.default_rng(seed)
    batch, blocks = mixed_batch(rng, block_size)
    T, H, N, inter = batch.num_tokens, 48, 40, 24
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    gate_up = f(T, 2 * inter)
    gate_up[0, :3] = [-100.0, -1000.0, 90.0]
    inv_freq = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    return Case(
        f(50, H),
        f(T, H),
        f(T, H),
        f(H) + 1,
        f(N, H),
        f(N),
        f(T, 320),
        f(N, 320) / 10,
        gate_up,
        f(T, (Hq + 2 * Hk) * D),
        f(blocks, Hk, block_size, D),
        f(blocks, Hk, block_size, D),
        rope_cos_sin_table(inv_freq, 64),
        inv_freq,
        batch,
        (Hq, Hk, D),
        D**-0.5,
    )


def every_op(ops, c: Case) -> dict[str, np.ndarray]:
    """Each op of the interface run on `ops` from the case's host inputs; float32 NumPy copies, by name."""
    put = lambda a: ops.weight(np.array(a))  # noqa: E731  a copy: CpuOps.weight may hand back its input
    Hq, Hk, D = c.heads
    T = c.batch.num_tokens
    out = {"embedding": ops.embedding(put(c.table), c.batch.input_ids)}
    x, w = put(c.x), put(c.norm_w)
    out["rms_norm"] = ops.rms_norm(x, w, EPS)
    out["add_rms_norm"], out["add_rms_norm residual"] = ops.add_rms_norm(x, put(c.residual), w, EPS)
    out["linear"] = ops.linear(x, ops.linear_weight(put(c.lin_w)))
    out["linear + bias"] = ops.linear(x, ops.linear_weight(put(c.lin_w)), put(c.lin_b))
    out["linear K=320"] = ops.linear(put(c.lin_x2), ops.linear_weight(put(c.lin_w2)))
    out["silu_and_mul"] = ops.silu_and_mul(put(c.gate_up))
    out = {name: np.array(ops.to_numpy(a)) for name, a in out.items()}
    # RoPE and the cache writes, then attention over what they wrote and the random history before it
    qkv, k_cache, v_cache = put(c.qkv), put(c.k_cache), put(c.v_cache)
    q = qkv[:, : Hq * D].reshape(T, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hk) * D].reshape(T, Hk, D)
    v = qkv[:, (Hq + Hk) * D :].reshape(T, Hk, D)
    ops.upload_batch(c.batch)
    ops.rope_store_kv(
        q, k, v, k_cache, v_cache, c.batch.positions, c.batch.slot_mapping, ops.constant(c.cos_sin)
    )
    out["rope q"], out["k untouched"] = np.array(ops.to_numpy(q)), np.array(ops.to_numpy(k))
    out["k_cache"], out["v_cache"] = np.array(ops.to_numpy(k_cache)), np.array(ops.to_numpy(v_cache))
    out["paged_attention"] = np.array(
        ops.to_numpy(ops.paged_attention(q, k_cache, v_cache, c.batch, c.scale))
    )
    last = len(c.k_cache) - 1
    ops.copy_blocks([(k_cache, v_cache)], [0, last], [last - 1, 1])
    out["copy_blocks k"], out["copy_blocks v"] = (
        np.array(ops.to_numpy(k_cache)),
        np.array(ops.to_numpy(v_cache)),
    )
    return out


def every_op_in_float64(c: Case) -> dict[str, np.ndarray]:
    """every_op's results computed in float64, each op written another way than ReferenceOps writes it."""
    Hq, Hk, D = c.heads
    b, T = c.batch, c.batch.num_tokens
    f64 = lambda a: np.array(a, np.float64)  # noqa: E731
    x, w = f64(c.x), f64(c.norm_w)
    norm = lambda h: h * w / np.sqrt((h**2).sum(1, keepdims=True) / h.shape[1] + EPS)  # noqa: E731
    residual = x + f64(c.residual)
    gate, up = np.split(f64(c.gate_up), 2, axis=1)
    out = {
        "embedding": f64(c.table)[b.input_ids],
        "rms_norm": norm(x),
        "add_rms_norm": norm(residual),
        "add_rms_norm residual": residual,
        "linear": x @ f64(c.lin_w).T,
        "linear + bias": x @ f64(c.lin_w).T + f64(c.lin_b),
        "linear K=320": f64(c.lin_x2) @ f64(c.lin_w2).T,
        "silu_and_mul": gate * (0.5 + 0.5 * np.tanh(gate / 2)) * up,
    }  # sigmoid(g) = (1 + tanh(g/2)) / 2
    qkv = f64(c.qkv)
    q, k, v = (
        qkv[:, a:z].reshape(T, -1, D)
        for a, z in ((0, Hq * D), (Hq * D, (Hq + Hk) * D), ((Hq + Hk) * D, None))
    )
    angle = b.positions[:, None, None].astype(np.float64) * f64(c.inv_freq)  # float64[T, 1, D/2]

    def rotated(h):  # pair by pair: (h_i, h_{i+D/2}) turned by the angle
        lo, hi = h[..., : D // 2], h[..., D // 2 :]
        return np.concatenate(
            [lo * np.cos(angle) - hi * np.sin(angle), hi * np.cos(angle) + lo * np.sin(angle)], -1
        )

    q, k_cache, v_cache = rotated(q), f64(c.k_cache), f64(c.v_cache)
    block_size = k_cache.shape[2]
    for t in range(T):
        if b.slot_mapping[t] >= 0:
            k_cache[b.slot_mapping[t] // block_size, :, b.slot_mapping[t] % block_size] = rotated(k)[t]
            v_cache[b.slot_mapping[t] // block_size, :, b.slot_mapping[t] % block_size] = v[t]
    out.update({"rope q": q, "k untouched": k, "k_cache": k_cache.copy(), "v_cache": v_cache.copy()})
    attention = np.zeros((T, Hq, D))
    for s in range(b.num_seqs):
        rows = np.arange(b.query_start[s], b.query_start[s + 1])
        ctx = b.context_lens[s]
        slots = [b.block_tables[s, j // block_size] * block_size + j % block_size for j in range(ctx)]
        keys = np.stack([k_cache[slot // block_size, :, slot % block_size] for slot in slots])  # [ctx, Hk, D]
        values = np.stack([v_cache[slot // block_size, :, slot % block_size] for slot in slots])
        later = np.arange(ctx)[None, :] > b.positions[rows][:, None]  # bool[rows, ctx]
        for h in range(Hq):
            scores = np.where(later, -np.inf, q[rows, h] @ keys[:, h * Hk // Hq].T * c.scale)
            p = np.exp(scores - scores.max(1, keepdims=True))
            attention[rows, h] = p / p.sum(1, keepdims=True) @ values[:, h * Hk // Hq]
    out["paged_attention"] = attention
    last = len(c.k_cache) - 1
    for cache in (k_cache, v_cache):
        cache[[last - 1, 1]] = cache[[0, last]].copy()
    out["copy_blocks k"], out["copy_blocks v"] = k_cache, v_cache
    return out


def mismatches(got: dict, want: dict, tol: float) -> list[str]:
    """The ops whose result is off by more than tol of its largest magnitude, or is not float32 [same
    shape]."""
    bad = []
    for name, expected in want.items():
        g = got[name]
        error = np.abs(g - expected).max() / max(np.abs(expected).max(), 1e-30)
        if g.dtype != np.float32 or g.shape != expected.shape or not error <= tol:
            bad.append(
                f"{name}: {g.dtype}{list(g.shape)} vs {list(expected.shape)}, relative error {error:.2e}"
            )
    return bad


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: "Hq%d-Hk%d-D%d-bs%d" % s)
def case(request) -> Case:
    return make_case(request.param)


@pytest.fixture(scope="module")
def reference(case) -> dict[str, np.ndarray]:
    return every_op(ReferenceOps(), case)


# (a) ReferenceOps against float64
# ------------------------------------------------------------------------------


def test_every_op_matches_float64(case, reference):
    bad = mismatches(reference, every_op_in_float64(case), 2e-6)
    assert not bad, "\n".join(bad)


def test_padding_token_stores_nothing_and_the_rest_of_the_cache_is_untouched(case, reference):
    block_size = case.k_cache.shape[2]
    stored = np.zeros(case.k_cache.shape[::2], bool)  # bool[blocks, block_size]
    for slot in case.batch.slot_mapping[case.batch.slot_mapping >= 0]:
        stored[slot // block_size, slot % block_size] = True
    assert case.batch.slot_mapping[-1] == -1 and stored.sum() == case.batch.num_tokens - 1
    for name, cache in (("k_cache", case.k_cache), ("v_cache", case.v_cache)):
        changed = (reference[name] != cache).any(axis=(1, 3))  # bool[blocks, block_size]
        assert not changed[~stored].any()


def test_block_table_entries_past_a_context_never_read(case, reference):
    """The tables' zero tails pointed at a block of NaN instead: no result changes (the contract's rule, held
    strictly here; CpuOps may read the tail and mask it, so it needs finite numbers there)."""
    b, block_size = case.batch, case.k_cache.shape[2]
    tables = b.block_tables.copy()
    nan_block = len(case.k_cache)
    for s in range(b.num_seqs):
        tables[s, -(-int(b.context_lens[s]) // block_size) :] = nan_block
    poisoned = Case(
        **{
            **vars(case),
            "k_cache": np.concatenate([case.k_cache, np.full_like(case.k_cache[:1], np.nan)]),
            "v_cache": np.concatenate([case.v_cache, np.full_like(case.v_cache[:1], np.nan)]),
            "batch": Batch(**{**vars(b), "block_tables": tables}),
        }
    )
    assert np.array_equal(every_op(ReferenceOps(), poisoned)["paged_attention"], reference["paged_attention"])


def test_upload_batch_takes_the_previous_steps_ids():
    batch = build_batch([ScheduledChunk([0], 3, [0], True), ScheduledChunk([5, 6], 0, [1], True)], 4)
    batch.previous_ids, batch.previous_rows, batch.previous_sources = (
        np.array([7, 8]),
        np.array([0]),
        np.array([1]),
    )
    assert ReferenceOps().upload_batch(batch) is None and batch.input_ids.tolist() == [8, 5, 6]


def test_has_the_whole_interface_and_is_a_device():
    ops = ReferenceOps()
    assert not [name for name in interface_names() if not hasattr(ops, name)]
    assert ops.free_memory_bytes() is None and ops.activation_dtype == np.float32
    assert isinstance(
        make_backend("reference", "bfloat16"), ReferenceOps
    )  # a checkpoint's dtype: float32 here
    with pytest.raises(ValueError, match="device 'reference' computes in float32"):
        make_backend("reference", "bfloat16", explicit_dtype=True)
    assert EngineConfig(device="reference").device == "reference"


# (b), (c) every other backend against ReferenceOps, op by op
# -----------------------------------------------------


def test_cpu_ops_match_the_reference(case, reference, blas_core):
    bad = mismatches(every_op(CpuOps(), case), reference, 1e-5)
    assert not bad, "\n".join(bad)


@emulator_only
def test_emulated_cuda_kernels_match_the_reference(case, reference):
    bad = mismatches(every_op(cuda_ops.emulated("float32"), case), reference, 1e-5)
    assert not bad, "\n".join(bad)


# (d) the bundled model
# ------------------------------------------------------------------------------------------

PROMPTS = ["Once upon a time", "Tom had a red ball. He", "Lily and Tom went to the park. They saw a big"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_bundled_model_generates_the_same_tokens_as_cpu_ops():
    """Through the engine (chunks of 8 tokens: prefill chunks and decodes share steps), device "reference"."""
    runs = {}
    for device in ("reference", "cpu"):
        llm = LLM(device=device, chunk_size=8, block_size=4, num_kv_blocks=64)
        runs[device] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert isinstance(llm.engine.model.ops, ReferenceOps) == (device == "reference")
    assert runs["reference"] == runs["cpu"]


def test_bundled_model_tells_llama2c_story_on_the_reference():
    """The 200-token greedy story from BOS of models/stories260K/README.md, llama2.c's: a golden that does not
    come from CpuOps."""
    readme = (default_model_dir() / "README.md").read_text()
    story = readme.split("```text\n", 1)[1].split("\n```", 1)[0]
    llm = LLM(device="reference", chunk_size=16, block_size=8, num_kv_blocks=32)
    (out,) = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    assert out.outputs[0].text == story


def test_bundled_model_logits_match_cpu_ops_over_mixed_steps():
    """A plain forward loop: three sequences prefilled in chunks of 5 beside the others' decodes, over blocks
    handed out in reverse; every step's logits within 1e-5 of CpuOps', greedy tokens the same."""
    config = ModelConfig.from_pretrained(default_model_dir())
    weights = load_weights(default_model_dir(), config)
    prompts = [[1, 403, 407, 261, 378, 10, 65, 2], [1, 9], [1, *range(300, 312)]]
    results = []
    for ops in (ReferenceOps(), CpuOps()):
        model, block_size = LlamaModel(config, weights, ops), 4
        cache = model.new_kv_cache(24, block_size)
        tables = [list(range(23 - 8 * s, 15 - 8 * s, -1)) for s in range(3)]  # 8 blocks each, reversed
        tokens, done, logits = [list(p) for p in prompts], [0, 0, 0], []
        while any(len(t) < 20 for t in tokens):
            chunks = [
                ScheduledChunk(t[d : d + 5], d, table, d + 5 >= len(t))
                for t, d, table in zip(tokens, done, tables)
                if len(t) < 20
            ]
            live = [s for s, t in enumerate(tokens) if len(t) < 20]
            step = model.forward(build_batch(chunks, block_size), cache)
            logits.append(step)
            for s, chunk in zip(live, chunks):
                done[s] += len(chunk.token_ids)
            for s, row in zip([s for s, chunk in zip(live, chunks) if chunk.sample], step):
                tokens[s].append(int(row.argmax()))
        results.append((tokens, np.concatenate(logits)))
    (ref_tokens, ref_logits), (np_tokens, np_logits) = results
    assert ref_tokens == np_tokens
    assert np.abs(np_logits - ref_logits).max() <= 1e-5 * np.abs(ref_logits).max()
