"""The 16-bit matmul kernel (minisarathi/backends/cpu/half_linear.py) bit for bit against a NumPy emulation of
its chain of float32 fused multiply-adds, on each of its paths that runs here; its batch invariance; the
NumPy fallback; CpuOps keeping bf16/fp16 matrices; and the bundled model in bf16 and fp16 on CpuOps against
the reference on the same rounded weights."""

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from minisarathi.backends.cpu import half_linear
from minisarathi.backends.cpu.half_linear import LANES, HalfWeight, half_weight
from minisarathi.backends.cpu.ops import CpuOps
from minisarathi.backends.devices import make_backend
from minisarathi.backends.reference import ReferenceOps
from minisarathi.config import ModelConfig
from minisarathi.dtypes import bf16_to_float32, convert, float32_to_bf16
from minisarathi.model.families import load_model
from minisarathi.model.llama import LINEAR_WEIGHTS, LlamaModel
from minisarathi.model.loader import CheckpointTensor, load_weights
from minisarathi.paths import default_model_dir
from minisarathi.testing import prefill_then_greedy, relative_error

DTYPES = ["bfloat16", "float16"]
ORDER = ["scalar", "avx2", "avx512"]
needs_kernel = pytest.mark.skipif(half_linear.kernel() is None, reason="no C++ compiler here")


def paths() -> list[str]:
    """The kernel's paths this CPU runs: AVX-512 machines run the AVX2 and scalar ones too."""
    native = half_linear.kernel()
    return [] if native is None else ORDER[: ORDER.index(native.best_isa) + 1]


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fma(a, b, c), correctly rounded, from float64 arithmetic: a * b is exact in float64, the sum
    is rounded to odd (TwoSum gives its exact error), and rounding to odd at 53 bits then to nearest at 24
    rounds correctly (Boldo and Melquiond), where a plain float64 sum would round twice."""
    with np.errstate(invalid="ignore"):  # infinite or NaN operands: s is already the answer
        p = a.astype(np.float64) * b.astype(np.float64)
        c = np.broadcast_to(c.astype(np.float64), p.shape)
        s = p + c
        bp = s - c
        e = (c - (s - bp)) + (p - bp)  # s + e == p + c exactly
    odd = (e != 0) & np.isfinite(e) & ((s.view(np.int64) & 1) == 0)
    s = np.where(odd, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def emulate(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float32[M, N]: the kernel's arithmetic, acc = fma(x[m, k], w[n, k], acc) from 0 for k in order."""
    acc = np.zeros((x.shape[0], w.shape[0]), np.float32)
    for k in range(x.shape[1]):
        acc = fma32(x[:, k : k + 1], w[None, :, k], acc)
    return acc


def values(stored: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values of 16-bit storage, widened here independently of the kernel's module."""
    return bf16_to_float32(stored) if dtype == "bfloat16" else stored.astype(np.float32)


def random_case(m: int, n: int, k: int, dtype: str, seed: int):
    """x float32[M, K], the weight's 16-bit storage [N, K] and its float32 values."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), dtype=np.float32)
    stored = convert(rng.standard_normal((n, k), dtype=np.float32), "float32", dtype)
    return x, stored, values(stored, dtype)


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_fma_emulation_rounds_once():
    """Against exact rational arithmetic, on random triples and on one a float64 sum would round twice:
    c + 2**-24 - 2**-70 lies just below the midpoint between c and its successor."""
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(300).astype(np.float32) * 2.0 ** rng.integers(-30, 30, 300) for _ in "abc")
    one = np.float32(1 + 2**-23)
    a = np.append(a, one).astype(np.float32)
    b = np.append(b, np.float32(2**-24 - 2**-47)).astype(np.float32)
    c = np.append(c, one).astype(np.float32)
    got = fma32(a, b, c)
    for ai, bi, ci, g in zip(a, b, c, got):
        exact = Fraction(float(ai)) * Fraction(float(bi)) + Fraction(float(ci))
        near = np.float32(float(exact))
        candidates = [near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, np.float32(-np.inf))]
        best = min(candidates, key=lambda f: (abs(Fraction(float(f)) - exact), int(f.view(np.uint32)) & 1))
        assert g == best, (ai, bi, ci)
    naive = ((a.astype(np.float64) * b + c).astype(np.float32))[-1]
    assert got[-1] == one and naive != one  # the case a plain float64 sum gets wrong


# rows around the 6-row (AVX2) and 12-row (AVX-512) tiles; outputs around the 16-wide panel and the 4, 3, 2
# panel tiles; K past the 256-deep K block (used from 7 rows); 530 outputs cross a group of panels
SHAPES = [(1, 1, 1), (1, 67, 300), (2, 50, 257), (3, 33, 7), (5, 16, 256), (7, 17, 513), (13, 100, 260)]


@needs_kernel
@pytest.mark.parametrize("isa", ORDER)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [*SHAPES, (8, 530, 300)])
def test_kernel_is_the_emulated_chain_bit_for_bit(isa, dtype, m, n, k):
    if isa not in paths():
        pytest.skip(f"this CPU has no {isa}")
    x, stored, w = random_case(m, n, k, dtype, m * 1000 + n + k)
    got = half_linear.kernel().matmul(x, half_weight(stored, dtype), isa)
    assert got.dtype == np.float32 and got.flags.c_contiguous
    assert bits_equal(got, emulate(x, w))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_16_bit_pattern_widens_exactly(dtype):
    """All 65536 weights, each its own output of 1 * w + 0: subnormals, infinities, signed zeros; a NaN
    stays a NaN."""
    stored = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)[:, None]  # [65536, 1]
    stored = stored if dtype == "bfloat16" else stored.view(np.float16)
    x = np.ones((1, 1), np.float32)
    want = emulate(x, values(stored, dtype))
    nan = np.isnan(want)
    for isa in paths():
        got = half_linear.kernel().matmul(x, half_weight(stored, dtype), isa)
        assert np.array_equal(np.isnan(got), nan), isa
        assert bits_equal(got[~nan], want[~nan]), isa


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_result_is_the_same_in_any_batch_and_on_any_path(dtype):
    x, stored, _ = random_case(33, 77, 300, dtype, 1)
    w = half_weight(stored, dtype)
    native = half_linear.kernel()
    whole = native.matmul(x, w, threads=1)
    for isa in paths():
        for threads in (1, 2, 3):  # threads split the panel groups (np.empty: one left out would show)
            assert bits_equal(native.matmul(x, w, isa, threads), whole), (isa, threads)
        for batch in (1, 2, 7, 16, 33):
            for start in range(0, 33, batch):
                rows = slice(start, min(start + batch, 33))
                assert bits_equal(native.matmul(x[rows], w, isa), whole[rows]), (isa, batch, start)


@needs_kernel
def test_negative_controls_are_caught():
    """The bit-for-bit check above fails for a wrong widening and for another summation order."""
    x, stored, w = random_case(7, 40, 600, "bfloat16", 2)
    kernel_out = half_linear.kernel().matmul(x, half_weight(stored, "bfloat16"))
    as_fp16 = stored.view(np.float16).astype(np.float32)  # the bits read as the other format
    assert not bits_equal(kernel_out, emulate(x, np.nan_to_num(as_fp16)))
    assert not bits_equal(kernel_out, x @ w.T)  # BLAS's order: within float32 rounding, not the same bits
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    assert np.abs(kernel_out - ref).max() <= 600 * 2.0**-24 * (np.abs(x) @ np.abs(w).T).max()


def test_numpy_fallback_matches_float64(monkeypatch):
    monkeypatch.setattr(half_linear, "kernel", lambda: None)
    x, stored, w = random_case(7, 37, 160, "float16", 3)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = 160 * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)) + 1e-30
    assert (np.abs(half_linear.matmul(x, half_weight(stored, "float16")) - ref) <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_panels_widen_and_take_rows(dtype):
    _, stored, w = random_case(1, 37, 20, dtype, 4)
    placed = half_weight(stored, dtype)
    assert placed.shape == (37, 20) and placed.panels.shape == (3, 20, LANES)
    assert placed.panels.ctypes.data % 64 == 0 and not placed.panels[2, :, 37 - 2 * LANES :].any()
    assert placed.nbytes == 3 * 20 * LANES * 2
    assert bits_equal(placed.widen(), w)
    ids = np.array([36, 0, 17, 17, 5])
    assert bits_equal(np.take(placed, ids, axis=0), w[ids])  # CpuOps.embedding's call
    with pytest.raises(IndexError, match=r"row ids must be in \[0, 37\)"):
        placed.take(np.array([37]), axis=0)
    with pytest.raises(ValueError, match="along axis 0"):
        np.take(placed, ids)


def test_wider_weights_round_to_nearest_even():
    w32 = np.random.default_rng(5).standard_normal((18, 9), dtype=np.float32)
    assert np.array_equal(half_weight(w32, "bfloat16").widen(), bf16_to_float32(float32_to_bf16(w32)))
    assert np.array_equal(half_weight(w32, "float16").widen(), w32.astype(np.float16).astype(np.float32))
    bf16 = CheckpointTensor("bfloat16", float32_to_bf16(w32))
    assert np.array_equal(half_weight(bf16, "float16").widen(), np.asarray(bf16).astype(np.float16))


def test_bad_weights_are_refused():
    with pytest.raises(ValueError, match="beyond float16's range"), np.errstate(over="ignore"):
        half_weight(np.full((2, 3), 1e5, np.float32), "float16")
    with pytest.raises(ValueError, match="a HalfWeight's dtype must be bfloat16 or float16, got 'float32'"):
        half_weight(np.ones((2, 3), np.float32), "float32")
    with pytest.raises(
        ValueError, match=r"a HalfWeight is a matrix, got a float32 tensor of shape \[2, 3, 4\]"
    ):
        half_weight(np.ones((2, 3, 4), np.float32), "bfloat16")
    with pytest.raises(ValueError, match="array dtype must be float32, float16 or bfloat16"):
        half_weight(np.ones((2, 3), np.int32), "bfloat16")
    with pytest.raises(ValueError, match="weight dtype must be one of"):
        CpuOps("int8")
    if half_linear.kernel() is not None:
        with pytest.raises(ValueError, match="x: 4 input features, the weight takes 3"):
            w = half_weight(np.ones((2, 3), np.float32), "float16")
            half_linear.kernel().matmul(np.ones((1, 4), np.float32), w)


def test_cpu_ops_keep_matrices_in_16_bits():
    w = np.ones((32, 16), np.float32)
    for dtype in DTYPES:
        ops = make_backend("cpu", dtype, explicit_dtype=True)
        placed = ops.weight(CheckpointTensor("float32", w))
        assert (
            isinstance(placed, HalfWeight) and placed.dtype == dtype and ops.linear_weight(placed) is placed
        )
        norm = ops.weight(CheckpointTensor(dtype, convert(np.ones(16, np.float32), "float32", dtype)))
        assert isinstance(norm, np.ndarray) and norm.dtype == np.float32
        assert np.array_equal(
            ops.linear(np.ones((3, 16), np.float32), placed), np.full((3, 32), 16, np.float32)
        )
    assert isinstance(CpuOps().weight(CheckpointTensor("bfloat16", float32_to_bf16(w))), np.ndarray)


def test_a_bf16_checkpoint_stays_its_own_bits_on_cpu():
    """dtype auto is the checkpoint's: its matrices are kept as stored, no rounding, half float32's bytes."""
    path = Path(__file__).parents[1] / "golden" / "llama_gqa_bf16"
    model = load_model(path, "cpu")
    assert model.ops.weight_dtype == "bfloat16"
    stored = load_weights(path, model.config)
    for name in LINEAR_WEIGHTS:
        w = getattr(model.layers[1], name)
        assert isinstance(w, HalfWeight) and np.array_equal(w.widen(), np.asarray(stored[f"layers.1.{name}"]))
    assert model.lm_head.nbytes == 2 * model.config.vocab_size * model.config.hidden_size
    assert load_model(path, "cpu", "float32").ops.weight_dtype == "float32"


def rounded(weights, dtype: str) -> dict:
    """The checkpoint's matrices as `dtype` CheckpointTensors (what CpuOps converts them to), the rest as
    they are."""
    return {
        name: CheckpointTensor(dtype, convert(t.data, t.dtype, dtype)) if len(t.shape) == 2 else t
        for name, t in weights.items()
    }


@pytest.mark.parametrize("dtype", DTYPES)
def test_bundled_model_in_16_bits_gives_the_references_tokens(dtype):
    """The float32 checkpoint converted at load (--dtype bfloat16 or float16) against the reference on the
    same rounded weights, under two chunk sizes."""
    path = default_model_dir()
    cpu = load_model(path, "cpu", dtype)
    assert all(
        isinstance(getattr(layer, name), HalfWeight) for layer in cpu.layers for name in LINEAR_WEIGHTS
    )
    assert isinstance(cpu.embed_tokens, HalfWeight) and cpu.lm_head is cpu.embed_tokens  # tied: one table
    config = ModelConfig.from_pretrained(path)
    reference = LlamaModel(config, rounded(load_weights(path, config), dtype), ReferenceOps())
    prompt = list(range(1, 200, 3))  # 67 rows: whole register tiles and a remainder
    for chunk_size in (None, 16):
        got, got_ids = prefill_then_greedy(cpu, prompt, 32, chunk_size=chunk_size)
        want, want_ids = prefill_then_greedy(reference, prompt, 32, chunk_size=chunk_size)
        assert relative_error(got, want) < 1e-5  # float32 sums in another order over the same weights
        assert got_ids == want_ids
    assert (
        prefill_then_greedy(cpu, [1, 403, 407], 48)[1] == prefill_then_greedy(reference, [1, 403, 407], 48)[1]
    )
