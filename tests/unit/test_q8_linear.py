"""The Q8_0 matmul kernel (minisarathi/backends/cpu/q8_linear.py) against float64 NumPy on the dequantized
weight, on each of its paths; its batch invariance; the NumPy fallback; and the bundled Q8_0 GGUF model on
CpuOps (weights kept int8) against the same file on ReferenceOps (dequantized to float32)."""

from pathlib import Path

import numpy as np
import pytest

from minisarathi.backends.cpu import q8_linear
from minisarathi.backends.cpu.ops import CpuOps
from minisarathi.backends.cpu.q8_linear import Q8Weight, q8_weight
from minisarathi.config import ModelConfig
from minisarathi.model.llama import LINEAR_WEIGHTS, load_model
from minisarathi.model.loader import load_weights
from minisarathi.parallel.sharding import shard_weights
from minisarathi.quant.layouts import IntGroups
from minisarathi.testing import prefill_then_greedy, relative_error

ROOT = Path(__file__).parents[2]
Q8_0 = ROOT / "models" / "stories260K-gguf" / "stories260K-q8_0.gguf"
PROMPT = [1, 403, 407]  # "Once upon a time"
# K a multiple of 32 and not of 64, N around the 4-wide and 2-wide register tiles
SHAPES = [(1, 32), (5, 96), (37, 160), (64, 288), (130, 544)]
ROWS = [1, 7, 64]

needs_kernel = pytest.mark.skipif(q8_linear.kernel() is None, reason="no C++ compiler here")
ORDER = ["scalar", "avx2", "avx512"]


def paths() -> list[str]:
    """The kernel's paths this CPU runs: AVX-512 machines run the AVX2 and scalar ones too."""
    native = q8_linear.kernel()
    return [] if native is None else ORDER[: ORDER.index(native.best_isa) + 1]


def random_q8(n: int, k: int, seed: int) -> Q8Weight:
    rng = np.random.default_rng(seed)
    values = rng.integers(-128, 128, (n, k), dtype=np.int8)
    scale = (rng.random((n, k // 32)) * 0.02 + 1e-3).astype(np.float16)  # as a Q8_0 block's d
    return q8_weight(IntGroups(values, scale, 32, 8, (n, k), "Q8_0"))


def reference_and_bound(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x @ w.T in float64, and the error bound of a float32 sum of K products in any order: K u sum |x w|."""
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = x.shape[1] * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64))
    return ref, bound + 1e-30


def test_dequantize_is_the_layouts():
    w = random_q8(9, 96, 0)
    layout = IntGroups(w.values, w.scale.astype(np.float16), 32, 8, w.shape, "Q8_0")
    assert np.array_equal(w.dequantize(), layout.dequantize())


@needs_kernel
@pytest.mark.parametrize("isa", ORDER)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_kernel_matches_float64(isa, n, k, m):
    if isa not in paths():
        pytest.skip(f"this CPU has no {isa}")
    w = random_q8(n, k, n * k)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    got = q8_linear.kernel().matmul(x, w, isa)
    ref, bound = reference_and_bound(x, w.dequantize())
    assert got.shape == (m, n) and got.dtype == np.float32
    assert (np.abs(got - ref) <= bound).all()


@needs_kernel
@pytest.mark.parametrize("isa", ORDER)
def test_a_rows_result_is_the_same_in_any_batch(isa):
    if isa not in paths():
        pytest.skip(f"this CPU has no {isa}")
    native, w = q8_linear.kernel(), random_q8(67, 224, 1)
    x = np.random.default_rng(2).standard_normal((64, 224)).astype(np.float32)
    whole = native.matmul(x, w, isa)
    for rows in (slice(5, 6), slice(0, 7), slice(3, 64), slice(61, 64)):
        assert np.array_equal(native.matmul(x[rows], w, isa), whole[rows]), rows


@needs_kernel
def test_the_default_path_is_the_widest():
    native, w = q8_linear.kernel(), random_q8(8, 64, 3)
    x = np.random.default_rng(4).standard_normal((3, 64)).astype(np.float32)
    assert np.array_equal(native.matmul(x, w), native.matmul(x, w, paths()[-1]))


def test_numpy_fallback_matches_float64(monkeypatch):
    monkeypatch.setattr(q8_linear, "kernel", lambda: None)
    w = random_q8(37, 160, 5)
    x = np.random.default_rng(6).standard_normal((7, 160)).astype(np.float32)
    ref, bound = reference_and_bound(x, w.dequantize())
    assert (np.abs(q8_linear.matmul(x, w) - ref) <= bound).all()


@pytest.fixture(scope="module")
def models():
    pytest.importorskip("gguf")
    return load_model(Q8_0, "cpu"), load_model(Q8_0, "reference")


def test_q8_0_linear_weights_stay_int8_on_cpu(models):
    cpu, reference = models
    assert isinstance(cpu.ops, CpuOps)
    kept = quantized = 0
    for layer in cpu.layers:
        for name in sorted(LINEAR_WEIGHTS - {"down_proj"}):  # ffn_down is F16 in the file (172 columns)
            w = getattr(layer, name)
            assert isinstance(w, Q8Weight), name
            kept += w.nbytes
            quantized += 4 * w.values.size  # its bytes in float32
    assert 0.25 <= kept / quantized <= 0.29  # int8 values + a float32 scale per 32
    assert isinstance(cpu.embed_tokens, Q8Weight)  # the table too; embedding widens only the rows asked for
    ids = np.array([3, 0, 3, 511])
    rows = cpu.ops.embedding(cpu.embed_tokens, ids)
    assert np.array_equal(rows, cpu.embed_tokens.dequantize()[ids]) and rows.dtype == np.float32
    assert all(isinstance(layer.qkv_proj, np.ndarray) for layer in reference.layers)


def test_q8_0_model_on_cpu_equals_the_reference(models):
    cpu, reference = models
    prompt = list(range(1, 200, 3))  # 67 rows: whole register tiles and a remainder
    got, got_ids = prefill_then_greedy(cpu, prompt, 32)
    want, want_ids = prefill_then_greedy(reference, prompt, 32)
    assert relative_error(got, want) < 1e-5  # float32 sums in another order over the same weights
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-4
    assert np.array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    assert got_ids == want_ids
    assert prefill_then_greedy(cpu, PROMPT, 48)[1] == prefill_then_greedy(reference, PROMPT, 48)[1]


def test_sharding_widens_q8_0_tensors():
    pytest.importorskip("gguf")
    config = ModelConfig.from_pretrained(Q8_0)
    weights = load_weights(Q8_0, config)
    assert weights["layers.0.qkv_proj"].dtype == "quantized"
    full = np.asarray(weights["layers.0.gate_up_proj"])
    half = shard_weights(weights, config, 0, 2)["layers.0.gate_up_proj"]
    inter = config.intermediate_size
    assert half.dtype == "float32"
    assert np.array_equal(half.data, np.concatenate([full[: inter // 2], full[inter : inter + inter // 2]]))


def test_the_kernel_takes_every_8_bit_group_32_matrix_and_nothing_else():
    """GPTQ's 8-bit symmetric form is Q8_0's (int8 values, a scale per 32 columns): it runs here too; a 6-bit
    group-16 matrix (Q6_K) does not."""
    rng = np.random.default_rng(5)
    values = rng.integers(-128, 128, (8, 64), dtype=np.int8)
    x = rng.standard_normal((3, 64), dtype=np.float32)
    gptq = IntGroups(values, rng.random((8, 2), dtype=np.float32), 32, 8, (8, 64), "GPTQ")
    assert q8_linear.runs(gptq)
    assert relative_error(q8_linear.matmul(x, q8_weight(gptq)), x @ gptq.dequantize().T) < 1e-5
    q6 = IntGroups(values // 4, rng.random((8, 4), dtype=np.float32), 16, 6, (8, 64), "Q6_K")
    assert not q8_linear.runs(q6)
    with pytest.raises(ValueError, match="groups of 32"):
        q8_weight(q6)
