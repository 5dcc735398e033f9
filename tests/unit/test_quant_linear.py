"""The quantized matmul (minisarathi/backends/cpu/quant_linear.py) against float64 NumPy on the dequantized
weights, for every compact form, on every path this CPU runs, with negative controls; the compact forms
bit for bit against the layouts; the AVX-512 paths compiled apart; and the NumPy fallback.

The bound: the kernel rounds each activation x to x^ = s * q, q = round(x / s), s = max|x of its block of
32| / 127, so |x - x^| <= s / 2 and |sum_k x_k w_k - sum_k x^_k w_k| <= sum over blocks of s / 2 * sum |w|
of the block. Float32 rounding adds at most (K / 32 + 8) float32 units (2^-24 each, doubled for the scale
products) of the sum of the magnitudes of the terms summed (|scale * code * x^|, and |minimum * x^|)."""

import shutil
import subprocess

import numpy as np
import pytest

from minisarathi.backends.cpu import quant_linear
from minisarathi.backends.cpu.native import cpu_library_path
from minisarathi.backends.cpu.quant_linear import ORDER, QuantWeight, quant_weight
from minisarathi.quant import kquants
from minisarathi.quant.layouts import GgmlType, IntGroups, Stacked, UintGroups, from_gguf, pack_low

ROWS = [1, 3, 17, 128]
COLUMNS = [32, 96, 160, 288]  # multiples of 32 and not of 64 (the AVX-512 path's odd last block)
KQUANT_COLUMNS = [256, 768]  # K-quants' super-blocks of 256
OUTPUTS = [1, 5, 18]  # around the register tiles' 2 and 4 outputs

needs_kernel = pytest.mark.skipif(quant_linear.kernel() is None, reason="no C++ compiler here")


def paths() -> list[str]:
    native = quant_linear.kernel()
    return [] if native is None else ORDER[: ORDER.index(native.best_isa) + 1]


def random_layout(kind: str, n: int, k: int, seed: int):
    """A layout of `kind` [n, k]: from random weights through the GGUF quantizers and converters (the
    K-quants' scales factor), or with random codes and scales (AWQ-like, GPTQ-like: scales that do not)."""
    rng = np.random.default_rng(seed)
    if kind in ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"):
        weights = rng.standard_normal((n, k), dtype=np.float32)
        return from_gguf("w", GgmlType[kind], kquants.quantize(weights, kind))
    if kind == "GPTQ-8":  # a group of 128 columns, float32 scales
        values = rng.integers(-128, 128, (n, k), dtype=np.int8)
        return IntGroups(values, rng.random((n, k // 128), dtype=np.float32) * 0.01, 128, 8, (n, k), "GPTQ")
    if kind == "Q6-random":  # int 6-bit values whose float32 scales have no int8 x float32 factoring
        values = rng.integers(-32, 32, (n, k), dtype=np.int8)
        return IntGroups(values, rng.standard_normal((n, k // 16), dtype=np.float32), 16, 6, (n, k), "Q6_K")
    bits = 5 if kind == "uint5-random" else 4
    codes = rng.integers(0, 2**bits, (n, k), dtype=np.uint8)
    high = np.packbits((codes >> 4) & 1, axis=-1, bitorder="little") if bits == 5 else None
    scale = rng.random((n, k // 32), dtype=np.float32) * 0.02
    minimum = rng.random((n, k // 32), dtype=np.float32) * 0.1
    return UintGroups(pack_low(codes), high, scale, minimum, bits, (n, k), "AWQ")


ANY_COLUMNS = ["Q8_0", "Q4_0", "GPTQ-8", "Q6-random", "uint4-random", "uint5-random"]
KQUANTS = ["Q4_K", "Q5_K", "Q6_K"]
CASES = [(kind, k) for kind in ANY_COLUMNS for k in COLUMNS if kind != "GPTQ-8" or k % 128 == 0]
CASES += [(kind, k) for kind in KQUANTS for k in KQUANT_COLUMNS] + [("GPTQ-8", 384)]


def magnitudes(layout) -> np.ndarray:
    """float64[N, K]: per weight, the magnitude of the terms the kernel sums for it (|scale * code| plus
    |minimum| for UintGroups; |w| for IntGroups)."""
    if isinstance(layout, Stacked):
        return np.concatenate([magnitudes(p) for p in layout.parts])
    w = np.abs(layout.dequantize().astype(np.float64))
    if isinstance(layout, UintGroups):
        n, k = w.shape
        codes = layout.codes().reshape(n, k // 32, 32).astype(np.float64)
        scale, minimum = layout.scale.astype(np.float64), layout.minimum.astype(np.float64)
        w = (np.abs(scale)[..., None] * codes + np.abs(minimum)[..., None]).reshape(n, k)
    return w


def reference_and_bound(x: np.ndarray, layout) -> tuple[np.ndarray, np.ndarray]:
    """x @ w.T in float64 on the exact activations, and the kernel's error bound (the module docstring)."""
    w = layout.dequantize().astype(np.float64)
    m, k = x.shape
    step = np.abs(x).reshape(m, k // 32, 32).max(axis=2).astype(np.float64) / 127  # float64[M, K / 32]
    half_steps = np.repeat(step / 2, 32, axis=1) * (1 + 2.0**-20)  # the scale's own rounding
    rounding = half_steps @ np.abs(w).T
    terms = (np.abs(x).astype(np.float64) + half_steps) @ magnitudes(layout).T
    return x.astype(np.float64) @ w.T, rounding + 2 * (k / 32 + 8) * 2.0**-24 * terms + 1e-30


@pytest.mark.parametrize("kind,k", CASES)
def test_compact_form_dequantizes_as_the_layout(kind, k):
    layout = random_layout(kind, 6, k, 0)
    w = quant_weight(layout)
    assert np.array_equal(w.dequantize(), layout.dequantize())
    assert np.array_equal(w.rows(np.array([5, 0, 5])), layout.dequantize()[[5, 0, 5]])


def test_kquant_scales_are_kept_factored_and_others_per_group():
    """K-quant scales (and minimums) as int8 x float32 per 256 columns, as in the file; scales that have
    no such factoring (Q4_0's fp16 per 32, random ones) stay float32 per group; Q8_0's stay fp16."""
    for kind, factored in [
        ("Q4_K", True),
        ("Q5_K", True),
        ("Q6_K", True),
        ("Q4_0", False),
        ("Q6-random", False),
    ]:
        (part,) = quant_weight(random_layout(kind, 4, 512, 1)).parts
        assert (part.scale_sub is not None) == factored, kind
        assert part.scale.shape[1] == (512 // 256 if factored else 512 // part.group), kind
    # bytes a weight: Q4_K's file has 144 per 256 weights (4.5 bits), Q6_K's 210 (6.56 bits)
    assert quant_weight(random_layout("Q4_K", 4, 512, 1)).nbytes / (4 * 512) == 0.5 + 2 / 32 + 8 / 256
    assert quant_weight(random_layout("Q6_K", 4, 512, 1)).nbytes / (4 * 512) == 0.75 + 1 / 16 + 4 / 256
    # Q8_0's fp16 scales stay fp16 (34 bytes per 32 weights, as the file); GPTQ-8's float32 ones stay float32
    q8 = quant_weight(random_layout("Q8_0", 4, 512, 1))
    assert q8.parts[0].scale.dtype == np.float16 and q8.nbytes / (4 * 512) == 34 / 32
    assert quant_weight(random_layout("GPTQ-8", 4, 512, 1)).parts[0].scale.dtype == np.float32


@needs_kernel
@pytest.mark.parametrize("isa", ORDER)
@pytest.mark.parametrize("kind,k", CASES)
def test_kernel_within_the_activation_rounding_bound(isa, kind, k):
    if isa not in paths():
        pytest.skip(f"this CPU does not run the {isa} path")
    native = quant_linear.kernel()
    for n in OUTPUTS:
        layout = random_layout(kind, n, k, n)
        w = quant_weight(layout)
        x = np.random.default_rng(k).standard_normal((max(ROWS), k), dtype=np.float32)
        ref, bound = reference_and_bound(x, layout)
        for m in ROWS:
            got = native.matmul(x[:m], w, isa)
            assert got.shape == (m, n) and got.dtype == np.float32
            assert (np.abs(got - ref[:m]) <= bound[:m]).all(), (n, m)


@needs_kernel
@pytest.mark.parametrize("isa", ORDER)
def test_a_stacked_weight_is_its_parts_side_by_side(isa):
    if isa not in paths():
        pytest.skip(f"this CPU does not run the {isa} path")
    parts = [
        random_layout("Q4_K", 5, 512, 2),
        random_layout("Q6_K", 3, 512, 3),
        random_layout("Q8_0", 2, 512, 4),
    ]
    stacked = Stacked(tuple(parts))
    w = quant_weight(stacked)
    assert [p.kind for p in w.parts] == ["uint4", "int6", "int8"]
    x = np.random.default_rng(5).standard_normal((17, 512), dtype=np.float32)
    native = quant_linear.kernel()
    got = native.matmul(x, w, isa, threads=1)
    assert np.array_equal(got, np.concatenate([native.matmul(x, quant_weight(p), isa) for p in parts], 1))
    for threads in (2, 3):  # each thread takes a share of every part
        assert np.array_equal(native.matmul(x, w, isa, threads), got)
    ref, bound = reference_and_bound(x, stacked)
    assert (np.abs(got - ref) <= bound).all()


@needs_kernel
@pytest.mark.parametrize("isa", ORDER)
@pytest.mark.parametrize(
    "kind,k",  # factored and per-group scales; an odd count of blocks (AVX2's last pair is half)
    [("Q4_K", 512), ("Q6_K", 512), ("Q8_0", 512), ("uint5-random", 512), ("Q6-random", 288), ("Q4_0", 288)],
)
def test_a_row_gives_the_same_bits_in_any_batch(isa, kind, k):
    if isa not in paths():
        pytest.skip(f"this CPU does not run the {isa} path")
    w = quant_weight(random_layout(kind, 19, k, 6))
    x = np.random.default_rng(7).standard_normal((37, k), dtype=np.float32)
    native = quant_linear.kernel()
    full = native.matmul(x, w, isa, threads=1)
    for start, stop in [(0, 1), (5, 8), (13, 37)]:
        for threads in (1, 2, 3):  # threads split the outputs (np.empty: one left out would show)
            assert np.array_equal(native.matmul(x[start:stop], w, isa, threads), full[start:stop])


@needs_kernel
@pytest.mark.parametrize(
    "kind,field",
    [("Q4_K", "scale_sub"), ("Q4_K", "minimum"), ("Q6_K", "scale"), ("Q8_0", "scale"), ("Q4_0", "minimum")],
)
def test_a_corrupt_factor_breaks_the_bound(kind, field):
    """Negative control: one scale or minimum of the compact form changed, the kernel leaves the bound
    (for the outputs of that row), so the bound is tight enough to see a wrong factor."""
    layout = random_layout(kind, 4, 512, 8)
    x = np.random.default_rng(9).standard_normal((17, 512), dtype=np.float32)
    ref, bound = reference_and_bound(x, layout)
    native = quant_linear.kernel()
    for isa in paths():
        w = quant_weight(
            random_layout(kind, 4, 512, 8)
        )  # afresh: the compact form shares the layout's arrays
        assert (np.abs(native.matmul(x, w, isa) - ref) <= bound).all()
        array = getattr(w.parts[0], field)
        array[0, 0] = array[0, 0] * 2 + (1 if array.dtype == np.int8 else 0.05)
        bad = np.abs(native.matmul(x, w, isa) - ref) > bound
        assert bad[:, 0].any() and not bad[:, 1:].any(), isa


@needs_kernel
def test_paths_this_cpu_lacks_are_refused_and_bad_shapes_too():
    native = quant_linear.kernel()
    w = quant_weight(random_layout("Q4_K", 3, 256, 0))
    for isa in ORDER[ORDER.index(native.best_isa) + 1 :]:
        with pytest.raises(ValueError, match="cannot run"):
            native.matmul(np.zeros((1, 256), np.float32), w, isa)
    with pytest.raises(ValueError, match="input features"):
        native.matmul(np.zeros((1, 224), np.float32), w)
    with pytest.raises(RuntimeError, match="bad arguments"):
        native.matmul(np.zeros((1, 256), np.float32), w, threads=0)


def test_the_numpy_fallback_uses_exact_activations(monkeypatch):
    """MINISARATHI_QUANT_LINEAR=0 (kernel() None): NumPy on the dequantized weight, within float32
    rounding of the exact product (no activation rounding)."""
    monkeypatch.setattr(quant_linear, "kernel", lambda: None)
    layout = random_layout("Q5_K", 7, 512, 10)
    x = np.random.default_rng(11).standard_normal((9, 512), dtype=np.float32)
    ref = x.astype(np.float64) @ layout.dequantize().astype(np.float64).T
    bound = 512 * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(layout.dequantize()).T.astype(np.float64))
    assert (np.abs(quant_linear.matmul(x, quant_weight(layout)) - ref) <= bound).all()


def test_what_stays_compact():
    rng = np.random.default_rng(12)
    assert quant_linear.runs(random_layout("Q6_K", 2, 256, 0))
    assert quant_linear.runs(Stacked((random_layout("Q4_K", 2, 256, 0), random_layout("Q6_K", 2, 256, 0))))
    odd = IntGroups(
        rng.integers(-8, 8, (2, 64), dtype=np.int8), np.ones((2, 2), np.float32), 32, 4, (2, 64), "x"
    )
    assert not quant_linear.runs(odd)  # 4-bit signed values: no form here (none of the sources makes it)
    with pytest.raises(ValueError, match="no compact CPU form"):
        quant_weight(odd)
    assert isinstance(quant_weight(random_layout("Q4_0", 2, 64, 0)), QuantWeight)


@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("objdump") is None, reason="no g++/objdump")
def test_each_path_uses_its_own_instructions(tmp_path):
    """The AVX-512 paths compile (they cannot run on every machine that runs the tests), also under global
    -mavx512* flags; the VNNI tiles use vpdpbusd, the AVX-512BW ones maddubs and no VNNI instruction, the
    AVX2 ones no zmm register."""
    # The library the backend loads (built once, cached), and a build under global flags that checks only
    # that the source compiles there: -O0 to an object (the intrinsics still inline) is a fifth of the time.
    library = cpu_library_path(quant_linear.SOURCE, quant_linear.FLAGS, "the quantized matmul")
    global_flags = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-O0", "-c"]
    subprocess.run(
        ["g++", *quant_linear.FLAGS, *global_flags, str(quant_linear.SOURCE), "-o", str(tmp_path / "q.o")],
        check=True,
    )
    listing = subprocess.run(
        ["objdump", "-d", "-C", "--no-show-raw-insn", str(library)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    functions = {}
    for chunk in listing.split("\n\n"):
        head, _, body = chunk.partition(">:\n")
        if "::tile<" in head:
            functions[head] = body
    groups = {
        ns: [b for h, b in functions.items() if f"{ns}::tile<" in h]
        for ns in ("avx2", "avx512", "avx512_vnni")
    }
    assert all(groups.values()), {ns: len(b) for ns, b in groups.items()}
    assert all("zmm" not in b for b in groups["avx2"])
    assert all("vpmaddubsw" in b and "vpdpbusd" not in b for b in groups["avx512"])
    assert all("vpdpbusd" in b for b in groups["avx512_vnni"])
