"""Sampler against float64 NumPy references, exclusion invariants over many draws, and a chi-square fit.

The tests that go through `sample` run four times: on the NumPy Sampler (with its native inverse CDF where it
builds, and with NumPy's), and on the CUDA backend's GpuSampler with the kernels of cuda/sampling.cu on the
CPU emulator (same rule, same draws), once with one CTA per row and once with every row split over three CTAs
(the path of large vocabularies, forced on these small ones)."""

import logging
import platform

import numpy as np
import pytest

from minisarathi.backends.cpu import native_sampling
from minisarathi.sampler import Sampler, draw_uniforms, is_penalized, make_generator, stop_token_indexes
from minisarathi.sampling_params import SamplingParams as SP

V = 16
# chi-square critical values at p = 0.001 for 1..15 degrees of freedom
CHI2_CRIT_001 = [
    10.83,
    13.82,
    16.27,
    18.47,
    20.52,
    22.46,
    24.32,
    26.12,
    27.88,
    29.59,
    31.26,
    32.91,
    34.53,
    36.12,
    37.70,
]


def gpu_sampler_on_the_emulator(vocab_size, seed=0, eos_token_ids=()):
    from minisarathi.backends import cuda_ops
    from minisarathi.backends.gpu_sampling import GpuSampler

    return GpuSampler(cuda_ops.emulated(), vocab_size, seed, eos_token_ids)


def gpu_sampler_with_split_rows(vocab_size, seed=0, eos_token_ids=()):
    from minisarathi.backends import cuda_ops
    from minisarathi.backends.gpu_sampling import GpuSampler

    return GpuSampler(cuda_ops.emulated(), vocab_size, seed, eos_token_ids, ctas_per_row=3)


def sampler_without_the_native_cdf(vocab_size, seed=0, eos_token_ids=()):
    sampler = Sampler(vocab_size, seed, eos_token_ids)
    sampler._draw = sampler._inverse_cdf  # what runs where native_sampling.cpp cannot be built
    return sampler


# The emulated GPU sampler runs every test too, in the slow tier.
EMULATED = [
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the CUDA emulator is x86-64 Linux only"),
    pytest.mark.system,
]
NEEDS_NATIVE_CDF = pytest.mark.skipif(native_sampling.kernel(16, 4) is None, reason="no C++ compiler here")


# (id, Sampler(vocab_size, seed=0, eos_token_ids=()) or a GpuSampler on emulated kernels, marks)
SAMPLERS = [
    ("Sampler", Sampler, ()),
    ("sampler_without_the_native_cdf", sampler_without_the_native_cdf, ()),
    ("GpuSampler-emulated", gpu_sampler_on_the_emulator, EMULATED),
    ("GpuSampler-emulated-split-rows", gpu_sampler_with_split_rows, EMULATED),
]


@pytest.fixture(params=[pytest.param(make, id=name, marks=marks) for name, make, marks in SAMPLERS])
def make_sampler(request):
    return request.param


def with_samplers(params, split_rows):
    """(p, make_sampler) for every p and sampler, except that split rows (three emulated CTAs a row, the
    slowest case) take only the params at indexes `split_rows`: the split changes where a row's candidates
    are merged, not the filters, so the cases that combine the most filters cover it."""
    return [
        pytest.param(p, make, id=f"{name}-p{i}", marks=marks)
        for i, p in enumerate(params)
        for name, make, marks in SAMPLERS
        if make is not gpu_sampler_with_split_rows or i in split_rows
    ]


def draws(make_sampler, n: int) -> int:
    """n draws, or n/4 on the emulator, which runs every row's blocks thread by thread: 5,000 draws over 16
    tokens still fail the chi-square test where a token drawn 10% of the time is drawn 13%."""
    emulated = make_sampler in (gpu_sampler_on_the_emulator, gpu_sampler_with_split_rows)
    return n // 4 if emulated else n


def rand_logits(n, vocab=V, seed=0, scale=2.0):
    return (scale * np.random.default_rng(seed).standard_normal((n, vocab))).astype(np.float32)


def run(sampler, logits, params, generators=None, prompts=None, outputs=None):
    n = len(params)
    return sampler.sample(logits, params, generators or [None] * n, prompts or [[1]] * n, outputs or [[]] * n)


def reference_probs(logits, p: SP) -> np.ndarray:
    """float64 softmax(logits / T), then min-p, top-k, top-p on the renormalized top-k set."""
    z = logits.astype(np.float64) / p.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    probs[probs < p.min_p * probs.max()] = 0
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    if 0 < p.top_k < len(probs):
        probs[order[p.top_k :]] = 0
    probs /= probs.sum()
    mass = 0.0
    for t in order:
        if mass >= p.top_p:
            probs[t] = 0
        mass += probs[t]
    return probs / probs.sum()


def reference_penalties(logits, p: SP, prompt, output):
    x = logits.astype(np.float64).copy()
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


def test_greedy_is_argmax_with_ties_to_lowest_id(make_sampler):
    logits = rand_logits(64)
    logits[5, [3, 9, 11]] = 100.0
    out = run(make_sampler(V), logits, [SP(temperature=0)] * 64)
    assert out.token_ids.dtype == np.int64
    assert out.token_ids.tolist() == logits.argmax(axis=1).tolist() and out.token_ids[5] == 3
    assert out.logprobs == [None] * 64


def test_greedy_fast_path_agrees_with_the_full_path():
    """A batch of plain greedy rows takes one argmax; the same rows next to one that needs the full path
    (here a sampled row) get the same tokens, ties included."""
    logits = rand_logits(8)
    logits[2, [4, 7]] = 50.0
    greedy = run(Sampler(V), logits, [SP(temperature=0)] * 8).token_ids
    mixed = run(
        Sampler(V), np.concatenate([logits, logits[:1]]), [SP(temperature=0)] * 8 + [SP(temperature=1)]
    )
    assert greedy.dtype == mixed.token_ids.dtype == np.int64
    assert greedy.tolist() == mixed.token_ids[:8].tolist() == logits.argmax(axis=1).tolist()
    assert greedy[2] == 4


def test_greedy_path_masks_only_where_the_argmax_is_not_allowed_yet():
    """Greedy rows under min_tokens take the fast path, which masks a row only when its plain argmax is a stop
    or EOS id: random batches (the banned ids made most likely in half the rows, F-order logits as the NumPy
    linear may hand them on) against the masked reference and against the full path (the same rows beside a
    sampled one)."""
    rng = np.random.default_rng(12)
    masked_rows = 0
    for _ in range(100):
        n = int(rng.integers(1, 9))
        params = [
            SP(
                temperature=0,
                min_tokens=int(rng.integers(0, 4)),
                max_tokens=8,
                ignore_eos=bool(rng.integers(2)),
                stop_token_ids=rng.integers(0, V + 3, rng.integers(0, 4)).tolist(),
            )
            for _ in range(n)
        ]
        outputs = [[1] * int(rng.integers(0, 4)) for _ in range(n)]
        logits = rand_logits(n, seed=int(rng.integers(1 << 30)))
        for row, p in enumerate(params[::2]):
            logits[2 * row, [t for t in [*p.stop_token_ids, 2] if t < V]] += 20
        reference = np.where(masked_by_rows(params, outputs, (2,), V), -np.inf, logits).argmax(axis=1)
        fast = (
            Sampler(V, eos_token_ids=(2,))
            .sample(np.asfortranarray(logits), params, [None] * n, [[1]] * n, outputs)
            .token_ids
        )
        full = (
            Sampler(V, eos_token_ids=(2,))
            .sample(
                np.concatenate([logits, logits[:1]]),
                params + [SP()],
                [None] * (n + 1),
                [[1]] * (n + 1),
                outputs + [[]],
            )
            .token_ids
        )
        assert fast.dtype == np.int64
        assert fast.tolist() == reference.tolist() == full[:n].tolist()
        masked_rows += int((reference != logits.argmax(axis=1)).sum())
    assert masked_rows > 30  # rows whose plain argmax was not allowed yet


def test_seeded_rows_do_not_depend_on_the_batch(make_sampler):
    logits = rand_logits(1, seed=3)[0]
    p = SP(temperature=0.9, top_p=0.95, seed=7)

    def tokens_of_seeded_row(position, companions, engine_seed):
        sampler, gen = make_sampler(V, seed=engine_seed), make_generator(7)
        tokens = []
        for step in range(30):
            params = [SP(temperature=1.3, top_k=3)] * companions
            params.insert(position, p)
            gens = [make_generator(step)] * (companions // 2) + [None] * (companions - companions // 2)
            gens.insert(position, gen)
            batch = rand_logits(companions + 1, seed=100 + step)
            batch[position] = logits
            tokens.append(int(run(sampler, batch, params, gens).token_ids[position]))
        return tokens

    alone = tokens_of_seeded_row(0, 0, engine_seed=0)
    assert len(set(alone)) > 1
    assert tokens_of_seeded_row(3, 5, engine_seed=1) == alone
    assert tokens_of_seeded_row(6, 6, engine_seed=2) == alone


def test_one_uniform_per_seeded_step(make_sampler):
    gen = make_generator(11)
    run(make_sampler(V), rand_logits(1), [SP(seed=11)], [gen])
    expected = make_generator(11)
    expected.random()
    assert gen.random() == expected.random()


def test_draw_order_and_masks_shared_with_the_gpu_sampler():
    """The rule GpuSampler imports: unseeded rows take the shared generator's draws in row order (one call),
    seeded rows one draw each from their own; stop and EOS ids masked until min_tokens."""
    shared, own = make_generator(1), make_generator(2)
    u = draw_uniforms(shared, [None, own, None])
    unseeded, seeded = make_generator(1).random(2), make_generator(2).random()
    assert u.tolist() == [unseeded[0], seeded, unseeded[1]]
    params = [
        SP(min_tokens=2, stop_token_ids=[7, 99]),
        SP(min_tokens=2, ignore_eos=True, stop_token_ids=[3]),
        SP(min_tokens=1),
    ]
    assert stop_token_indexes(params, [[5], [], [5]], np.array([2]), V).tolist() == [7, V + 3, 2]
    assert [
        is_penalized(p)
        for p in (SP(), SP(repetition_penalty=1.1), SP(frequency_penalty=0.5), SP(presence_penalty=-1))
    ] == [False, True, True, True]


def masked_by_rows(params, output_ids, eos, vocab):
    """bool[N, vocab], the reference: each row's ids looked at one by one."""
    masked = np.zeros((len(params), vocab), bool)
    for row, (p, out) in enumerate(zip(params, output_ids)):
        if len(out) < p.min_tokens:
            for t in [*p.stop_token_ids, *(() if p.ignore_eos else eos)]:
                if t < vocab:
                    masked[row, t] = True
    return masked


@pytest.mark.parametrize("eos", [(), (2,), (2, 5, 2)])
def test_stop_token_indexes_are_what_each_row_may_not_sample_yet(eos):
    """Random mixed batches (rows before and past min_tokens, with and without ignore_eos, stop ids repeated
    or beyond the vocabulary) against the row-by-row reference; masking every row's ids regardless of
    min_tokens (the negative control) differs from it."""
    rng = np.random.default_rng(len(eos))
    controls = 0
    for _ in range(200):
        n = int(rng.integers(1, 9))
        params = [
            SP(
                min_tokens=int(rng.integers(0, 5)),
                max_tokens=8,
                ignore_eos=bool(rng.integers(2)),
                stop_token_ids=rng.integers(0, V + 4, rng.integers(0, 6)).tolist(),
            )
            for _ in range(n)
        ]
        outputs = [[1] * int(rng.integers(0, 5)) for _ in range(n)]
        expected = masked_by_rows(params, outputs, eos, V)
        flat = stop_token_indexes(params, outputs, np.array(eos, np.int64), V)
        assert flat.dtype == np.int64
        got = np.zeros(n * V, bool)
        got[flat] = True
        np.testing.assert_array_equal(got.reshape(n, V), expected)
        regardless = masked_by_rows(
            [
                SP(min_tokens=8, max_tokens=8, ignore_eos=p.ignore_eos, stop_token_ids=p.stop_token_ids)
                for p in params
            ],
            [[]] * n,
            eos,
            V,
        )
        controls += not np.array_equal(regardless, expected)
    assert controls > 50


def test_masked_logits_equal_the_reference_in_mixed_batches(make_sampler):
    """Through sample() with logprobs (the masked logits decide the token, the raw ones the logprobs): rows
    whose highest logits are stop or EOS ids take the best allowed token only before min_tokens."""
    rng = np.random.default_rng(4)
    logits = rand_logits(6, seed=9)
    params = [
        SP(
            temperature=0,
            logprobs=2,
            min_tokens=int(rng.integers(0, 4)),
            max_tokens=8,
            ignore_eos=bool(rng.integers(2)),
            stop_token_ids=rng.integers(0, V + 2, 4).tolist(),
        )
        for _ in range(6)
    ]
    outputs = [[1] * int(rng.integers(0, 4)) for _ in range(6)]
    for row, p in enumerate(params):  # the stop ids and EOS most likely
        logits[row, [t for t in [*p.stop_token_ids, 2] if t < V]] += 20
    reference = np.where(masked_by_rows(params, outputs, (2,), V), -np.inf, logits)
    out = make_sampler(V, eos_token_ids=(2,)).sample(logits, params, [None] * 6, [[1]] * 6, outputs)
    assert out.token_ids.tolist() == reference.argmax(axis=1).tolist()
    raw = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(
        [lps[0][1] for lps in out.logprobs], raw[np.arange(6), out.token_ids], atol=1e-5
    )
    assert out.token_ids.tolist() != logits.argmax(axis=1).tolist()  # some rows masked
    assert any(not masked_by_rows([p], [o], (2,), V).any() for p, o in zip(params, outputs))  # some not


def test_the_stop_mask_follows_the_batch_step_after_step():
    """The NumPy Sampler keeps the last step's mask while the same params are under min_tokens in the same
    rows: step after step (rows passing min_tokens, rows reordered, a request replaced by one with the same
    settings but other stop ids, the caller's list changed in place) the masked rows take the reference's
    tokens."""
    rng = np.random.default_rng(8)
    sampler = Sampler(V, eos_token_ids=(2,))

    def request(stops):
        return SP(temperature=0, logprobs=0, min_tokens=3, max_tokens=8, stop_token_ids=stops)

    params = [request([7]), request([9]), request([11, 12]), SP(temperature=0, logprobs=0)]
    outputs = [[], [1], [1, 1], []]
    checked = 0
    for step in range(12):
        if step == 4:
            params[1] = request([13])  # the same settings, other stop ids, in the same list
        if step == 7:
            order = [2, 0, 3, 1]
            params, outputs = [params[i] for i in order], [outputs[i] for i in order]
        logits = rand_logits(4, seed=step)
        for row, p in enumerate(params):  # the banned ids most likely
            logits[row, [t for t in [*p.stop_token_ids, 2] if t < V]] += 20 + rng.random()
        out = sampler.sample(logits, params, [None] * 4, [[1]] * 4, outputs)
        reference = np.where(masked_by_rows(params, outputs, (2,), V), -np.inf, logits).argmax(axis=1)
        assert out.token_ids.tolist() == reference.tolist(), step
        checked += int((reference != logits.argmax(axis=1)).sum())
        outputs = [o + [1] if step % 3 == 2 else o for o in outputs]  # rows pass min_tokens now and then
    assert checked > 15


def test_unseeded_rows_follow_the_engine_seed(make_sampler):
    logits, params = rand_logits(32), [SP(temperature=1.0)] * 32
    a, b, c = make_sampler(V, seed=5), make_sampler(V, seed=5), make_sampler(V, seed=6)
    first = run(a, logits, params).token_ids
    assert first.tolist() == run(b, logits, params).token_ids.tolist()
    assert first.tolist() != run(c, logits, params).token_ids.tolist()


@pytest.mark.parametrize(
    ("p", "make_sampler"),
    with_samplers(
        [
            SP(top_k=3),
            SP(top_p=0.5),
            SP(min_p=0.2),
            SP(top_k=5, top_p=0.7, temperature=0.7),
            SP(top_k=1, temperature=2.0),
            SP(top_p=0.3, min_p=0.05, temperature=1.5),
            SP(top_p=1e-6),
        ],
        split_rows={3, 5, 6},
    ),
)
def test_filters_never_return_excluded_tokens(p, make_sampler):
    n = draws(make_sampler, 6000)
    logits = np.repeat(rand_logits(4, seed=1), n // 4, axis=0)
    out = run(make_sampler(V, seed=2), logits, [p] * n).token_ids
    for row in range(4):
        allowed = reference_probs(logits[row * (n // 4)], p) > 0
        drawn = out[row * (n // 4) : (row + 1) * (n // 4)]
        assert allowed[drawn].all()
        likely = reference_probs(logits[row * (n // 4)], p) > 0.02
        assert np.isin(np.flatnonzero(likely), drawn).all()


def large_vocab_case():
    # vocab above the nucleus candidate count, so both the partial and the full-sort paths run
    vocab, n = 3000, 16
    logits = rand_logits(n, vocab, seed=4, scale=1.0)
    logits[: n // 2] *= 8  # peaked rows: the nucleus is among the top candidates
    params = [SP(top_p=0.9), SP(top_k=40, top_p=0.8), SP(top_k=2000), SP(top_k=1500, top_p=0.95)] * (n // 4)
    return vocab, logits, params


def test_large_vocab_draws_stay_in_the_reference_set(make_sampler):
    vocab, logits, params = large_vocab_case()
    for trial in range(3):
        out = run(make_sampler(vocab, seed=trial), logits, params).token_ids
        for i, p in enumerate(params):
            assert reference_probs(logits[i], p)[out[i]] > 0


def test_large_vocab_top_k_and_top_p_match_reference():
    vocab, logits, params = large_vocab_case()
    sampler = Sampler(vocab)
    top_k, top_p = np.array([p.top_k or vocab for p in params]), np.array([p.top_p for p in params])
    kept = sampler._top_k_top_p(np.exp(logits - logits.max(axis=1, keepdims=True)), top_k, top_p)
    for i, p in enumerate(params):
        assert ((kept[i] > 0) == (reference_probs(logits[i], p) > 0)).all(), i


def inverse_cdfs(vocab):
    """Sampler(vocab)'s inverse CDF in NumPy, and the native one (None where it cannot be built)."""
    sampler = Sampler(vocab)
    return sampler._inverse_cdf, native_sampling.kernel(vocab, sampler._cdf_block)


@pytest.mark.parametrize(
    "implementation",
    [0, pytest.param(1, id="native", marks=NEEDS_NATIVE_CDF)],
    ids=lambda i: "numpy" if i == 0 else "native",
)
def test_inverse_cdf_matches_a_full_running_sum(implementation):
    vocab, n = 64, 5000  # blocks of 8 tokens
    inverse_cdf = inverse_cdfs(vocab)[implementation]
    rng = np.random.default_rng(12)
    probs = rng.random((n, vocab)).astype(np.float32) * (rng.random((n, vocab)) < 0.3)
    probs[:, 0] = 0  # leading and trailing zeros in every row
    probs[:, -9:] = 0
    probs[:10, 8:] = 0  # rows whose only kept tokens are in the first block
    probs[:, 5] += 0.01  # every row keeps a token, as the filters guarantee
    u = rng.random(n)
    u[:3] = 0.0
    u[3:6] = np.nextafter(1.0, 0)
    drawn = inverse_cdf(probs, u)
    cdf = np.cumsum(probs.astype(np.float64), axis=1)
    expected = [np.searchsorted(cdf[i], u[i] * cdf[i, -1], side="right") for i in range(n)]
    expected[3:6] = [np.flatnonzero(probs[i])[-1] for i in range(3, 6)]
    assert drawn.tolist() == expected
    assert (probs[np.arange(n), drawn] > 0).all()
    # A wide range of magnitudes: the block's own running sum ends below the block's sum.
    row = np.array(
        [
            [
                1.1205673e-12,
                6.0346647e-04,
                2.6465859e-08,
                1.4253071e-09,
                2.5853273e-01,
                1.8554821e-12,
                3.3386619e-05,
                1.6383106e-12,
                3.8373475e-08,
                5.6326015e-09,
                9.2066988e-12,
                2.5019434e-03,
                7.2830080e-06,
                8.4729793e-12,
                5.3215086e-01,
                2.1325310e-11,
            ]
        ],
        np.float32,
    )
    row = np.concatenate([np.zeros((1, 48), np.float32), row], axis=1)  # 64 tokens: blocks of 8
    assert inverse_cdf(row, np.array([np.nextafter(1.0, 0)])).tolist() == [63]


def targets_on_boundaries(probs, block, rng):
    """u (float64[R]) placing each row's target u * mass exactly on a running sum of NumPy's inverse CDF (a
    block's or a token's inside the block), where a sum one ulp off would pick another token; NaN where none
    was found."""
    rows = len(probs)
    block_cdf = probs.reshape(rows, -1, block).sum(axis=2, dtype=np.float64).cumsum(axis=1)  # as _inverse_cdf
    u = np.full(rows, np.nan)
    for i in range(rows):
        b = int(rng.integers(block_cdf.shape[1]))
        if rng.random() < 0.5:
            boundary = block_cdf[i, b]
        else:
            before = block_cdf[i, b - 1] if b else 0.0
            boundary = (
                before
                + np.cumsum(probs[i, b * block : (b + 1) * block], dtype=np.float64)[rng.integers(block)]
            )
        guess = boundary / block_cdf[i, -1]
        for candidate in (guess, np.nextafter(guess, 0), np.nextafter(guess, 2)):
            if candidate < 1 and candidate * block_cdf[i, -1] == boundary:
                u[i] = candidate
                break
    return u


@NEEDS_NATIVE_CDF
@pytest.mark.parametrize(
    "vocab", [15, 16, 64, 512, 4096, 32000, 65536]
)  # blocks of 1, 4, 8, 16, 64, 128, 256
def test_native_inverse_cdf_picks_numpys_tokens_bit_for_bit(vocab):
    """Targets placed exactly on NumPy's running sums, so that a block sum or running sum one ulp off (another
    summation order) picks another token: nudging u by one ulp changes the pick in many rows (the control),
    the native kernel in none. Rows span wide magnitudes and hold zeros, as after top-k, top-p and min-p."""
    numpy_cdf, native_cdf = inverse_cdfs(vocab)
    rng = np.random.default_rng(vocab)
    rows = max(64, 400_000 // vocab)
    z = (rng.standard_normal((rows, vocab)) * rng.choice([1.0, 8.0, 30.0], (rows, 1))).astype(np.float32)
    probs = np.exp(z - z.max(axis=1, keepdims=True))
    probs *= rng.random((rows, vocab)) < rng.random((rows, 1))
    probs[np.arange(rows), rng.integers(vocab, size=rows)] = 1  # every row keeps a token
    u = targets_on_boundaries(probs, Sampler(vocab)._cdf_block, rng)
    found = ~np.isnan(u)
    assert found.mean() > 0.5
    probs, u = probs[found], u[found]
    expected = numpy_cdf(probs, u)
    assert native_cdf(probs, u).tolist() == expected.tolist()
    assert (numpy_cdf(probs, np.nextafter(u, 0)) != expected).mean() > 0.3
    random_u = rng.random(len(u))
    assert native_cdf(probs, random_u).tolist() == numpy_cdf(probs, random_u).tolist()


@pytest.fixture
def fresh_library():
    native_sampling._library.cache_clear()
    yield
    native_sampling._library.cache_clear()


def test_native_cdf_turned_off_or_without_a_compiler_falls_back_to_numpy(
    monkeypatch, tmp_path, caplog, fresh_library
):
    logits, params = rand_logits(32, seed=2), [SP(temperature=1.0)] * 32
    expected = run(sampler_without_the_native_cdf(V, seed=3), logits, params).token_ids.tolist()
    monkeypatch.setenv("MINISARATHI_CPU_SAMPLING", "0")
    native_sampling._library.cache_clear()
    assert native_sampling.kernel(V, 4) is None
    sampler = Sampler(V, seed=3)
    assert (
        sampler._draw == sampler._inverse_cdf and run(sampler, logits, params).token_ids.tolist() == expected
    )
    native_sampling._library.cache_clear()
    monkeypatch.delenv("MINISARATHI_CPU_SAMPLING")
    monkeypatch.setenv("MINISARATHI_CACHE_DIR", str(tmp_path))  # nothing built yet
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="minisarathi.backends.cpu.native_sampling"):
        sampler = Sampler(V, seed=3)
    assert "native inverse CDF off" in caplog.text and "no-such-compiler" in caplog.text
    assert (
        sampler._draw == sampler._inverse_cdf and run(sampler, logits, params).token_ids.tolist() == expected
    )


def test_seeded_and_shared_streams_pick_the_reference_tokens():
    """Through sample(), mixed batches (greedy, unseeded and seeded rows, several temperatures) over steps:
    each sampled row takes the token where a float64 running sum of its softmax passes u times its mass, u
    drawn as the rule says (the shared generator's draws in row order, one call a step; a seeded row's from
    its own). A changed draw, draw order or mapping picks other tokens."""
    vocab, rng = 512, np.random.default_rng(21)
    temperatures = [0, 1.0, 0.7, 1.0, 0, 1.3, 1.0, 1.0, 0.5]
    seeds = [None, None, 5, None, None, 9, None, 13, None]
    own = {i: make_generator(s) for i, s in enumerate(seeds) if s is not None}
    reference_own = {i: make_generator(s) for i, s in enumerate(seeds) if s is not None}
    sampler, shared = Sampler(vocab, seed=3), make_generator(3)
    params = [SP(temperature=t, seed=s) for t, s in zip(temperatures, seeds)]
    sampled_differently = 0
    for step in range(40):
        logits = (rng.standard_normal((len(params), vocab)) * 2).astype(np.float32)
        got = run(sampler, logits, params, [own.get(i) for i in range(len(params))]).token_ids.tolist()
        unseeded = [i for i, t in enumerate(temperatures) if t and seeds[i] is None]
        shared_u = dict(zip(unseeded, shared.random(len(unseeded))))
        for i, t in enumerate(temperatures):
            if not t:
                assert got[i] == logits[i].argmax()
                continue
            u = shared_u[i] if seeds[i] is None else reference_own[i].random()
            z = logits[i].astype(np.float64) / t
            cdf = np.cumsum(np.exp(z - z.max()))
            assert got[i] == np.searchsorted(cdf, u * cdf[-1], side="right"), (step, i)
            sampled_differently += got[i] != logits[i].argmax()
    assert sampled_differently > 100


class FixedDraw:
    """Stands in for a request's generator: always draws u."""

    def __init__(self, u):
        self.u = u

    def random(self):
        return self.u


def test_extreme_draws_stay_inside_the_kept_set(make_sampler):
    logits = np.zeros((2, V), np.float32)
    logits[:, 7:9] = 3.0  # top-2 in the middle: tokens at both ends are excluded
    params = [SP(top_k=2, seed=0)] * 2
    out = run(make_sampler(V), logits, params, [FixedDraw(0.0), FixedDraw(np.nextafter(1.0, 0))])
    assert out.token_ids.tolist() == [7, 8]


@pytest.mark.parametrize(
    ("p", "make_sampler"),
    with_samplers(
        [SP(), SP(temperature=0.6, top_k=6), SP(temperature=1.4, top_p=0.8, min_p=0.02)], split_rows={2}
    ),
)
def test_frequencies_fit_the_distribution(p, make_sampler):
    n = draws(make_sampler, 20000)
    logits = rand_logits(1, seed=9)
    expected = reference_probs(logits[0], p) * n
    drawn = run(make_sampler(V, seed=3), np.repeat(logits, n, axis=0), [p] * n).token_ids
    counts = np.bincount(drawn, minlength=V)
    kept = expected > 0
    assert counts[~kept].sum() == 0
    chi2 = (((counts - expected) ** 2)[kept] / expected[kept]).sum()
    assert chi2 < CHI2_CRIT_001[kept.sum() - 2]


def test_penalties_match_reference():
    rng = np.random.default_rng(5)
    n = 6
    logits = rand_logits(n, seed=6)
    prompts = [rng.integers(0, V, 10).tolist() for _ in range(n)]
    outputs = [rng.integers(0, V, k).tolist() for k in (0, 1, 5, 9, 20, 3)]
    params = [
        SP(repetition_penalty=1.3, temperature=0),
        SP(frequency_penalty=0.7, temperature=0),
        SP(presence_penalty=-1.1, temperature=0),
        SP(repetition_penalty=0.8, frequency_penalty=-0.4, presence_penalty=1.5, temperature=0),
        SP(repetition_penalty=2.0, presence_penalty=2.0),
        SP(),
    ]
    sampler = Sampler(V)
    penalized = sampler._apply_penalties(logits, params, prompts, outputs)
    for i, p in enumerate(params):
        expected = reference_penalties(logits[i], p, prompts[i], outputs[i])
        np.testing.assert_allclose(penalized[i], expected, rtol=1e-6, atol=1e-6)
    greedy = run(sampler, logits[:4], params[:4], None, prompts[:4], outputs[:4]).token_ids
    expected = [reference_penalties(logits[i], params[i], prompts[i], outputs[i]).argmax() for i in range(4)]
    assert greedy.tolist() == expected
    assert (logits == rand_logits(n, seed=6)).all()  # the caller's logits are untouched


def test_min_tokens_masks_eos_and_stop_ids(make_sampler):
    logits = np.zeros((4, V), np.float32)
    logits[:, 2] = 10  # EOS
    logits[:, 7] = 9  # a stop token id
    logits[:, 4] = 8
    params = [SP(temperature=0, min_tokens=3, stop_token_ids=[7, 99])] * 2 + [
        SP(temperature=0, min_tokens=3, ignore_eos=True, stop_token_ids=[7]),
        SP(temperature=0, min_tokens=2),
    ]
    outputs = [[5, 5], [5, 5, 5], [5], [5, 5]]
    out = make_sampler(V, eos_token_ids=(2,)).sample(logits, params, [None] * 4, [[1]] * 4, outputs)
    assert out.token_ids.tolist() == [4, 2, 2, 2]


def test_logprobs_are_raw_log_softmax(make_sampler):
    logits = rand_logits(5, seed=8)
    logits[0, [1, 6]] = 5.0  # a tie: ranked by lowest id
    params = [
        SP(temperature=0, logprobs=3),
        SP(logprobs=0, repetition_penalty=1.7, temperature=0.5),
        SP(temperature=0),
        SP(logprobs=V, top_k=2, seed=1),
        SP(logprobs=20, presence_penalty=2.0),
    ]
    out = run(make_sampler(V), logits, params, None, [[0, 1, 2]] * 5, [[3, 4]] * 5)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True))
    for i, p in enumerate(params):
        if p.logprobs is None:
            assert out.logprobs[i] is None and out.ranks[i] is None
            continue
        entries = out.logprobs[i]
        k = min(p.logprobs, V)
        assert len(entries) == 1 + k and entries[0][0] == out.token_ids[i]
        order = sorted(range(V), key=lambda t: (-ref[i, t], t))[:k]
        assert [t for t, _ in entries[1:]] == order
        np.testing.assert_allclose([lp for _, lp in entries], ref[i, [t for t, _ in entries]], atol=1e-6)
        assert out.ranks[i] == 1 + int((ref[i] > ref[i, out.token_ids[i]]).sum())
    assert [t for t, _ in out.logprobs[0][1:]] == [1, 6, int(np.argsort(-ref[0])[2])]


def test_bad_shapes():
    sampler = Sampler(V)
    with pytest.raises(ValueError, match="logits"):
        run(sampler, rand_logits(2, vocab=V + 1), [SP()] * 2)
    with pytest.raises(ValueError, match="logits"):
        run(sampler, rand_logits(3), [SP()] * 2)
    with pytest.raises(ValueError, match="generators"):
        sampler.sample(rand_logits(2), [SP()] * 2, [None], [[1]] * 2, [[]] * 2)


def test_logit_bias_moves_the_choice_but_not_the_raw_logprobs(make_sampler):
    logits = rand_logits(4, seed=9)
    top = logits.argmax(axis=1)
    params = [
        SP(temperature=0, logit_bias={7: 100.0}),
        SP(temperature=0, logit_bias={int(top[1]): -100.0}),
        SP(temperature=0, logprobs=1, logit_bias={"3": 50}),
        SP(temperature=0.7, seed=2, logit_bias={5: -100}),
    ]
    out = run(make_sampler(V), logits, params, [None, None, None, make_generator(2)])
    second = np.argsort(-logits[1], kind="stable")[1]
    assert out.token_ids.tolist()[:3] == [7, second, 3] and out.token_ids[3] != 5
    ref = logits[2].astype(np.float64) - np.log(np.exp(logits[2].astype(np.float64)).sum())
    assert out.logprobs[2][0][0] == 3 and out.logprobs[2][0][1] == pytest.approx(ref[3], abs=1e-6)  # raw
    biased = [SP(temperature=1.0, logit_bias={t: -100 for t in range(V // 2)})] * 200
    draws = run(make_sampler(V, seed=4), np.repeat(rand_logits(1, seed=3), 200, axis=0), biased).token_ids
    assert (draws >= V // 2).all()


@pytest.mark.parametrize(
    "bias, message",
    [
        ({-1: 1.0}, "logit_bias token id"),
        ({"x": 1.0}, "logit_bias token id"),
        ({1: 101}, r"\[-100, 100\]"),
        ({1: float("nan")}, "logit_bias value"),
        ([1, 2], "map of token id"),
    ],
)
def test_bad_logit_bias(bias, message):
    with pytest.raises(ValueError, match=message):
        SP(logit_bias=bias)
