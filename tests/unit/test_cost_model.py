"""The step cost model: least squares recovers known coefficients, stays non-negative, sizes chunks
exactly."""

import numpy as np
import pytest

from minisarathi.engine.cost_model import FEATURES, CostModel, StepShape, chunk_attention

# seconds: per step, per prefill token, per decode, per unit of prefill attention, per unit of decode
# attention
TRUE = np.array([4e-3, 1.1e-3, 0.4e-3, 2e-7, 5e-7])


def random_shapes(rng, n, decode_only=False):
    shapes = []
    for _ in range(n):
        shape = StepShape()
        for _ in range(int(rng.integers(0, 33))):
            shape.add_decode(int(rng.integers(1, 1500)))
        if not decode_only and rng.random() < 0.7:
            shape.add_prefill(int(rng.integers(0, 1500)), int(rng.integers(1, 512)))
        shapes.append(shape)
    return shapes


def true_time(shape, coefficients=TRUE):
    return float(
        coefficients
        @ [1, shape.prefill_tokens, shape.decode_seqs, shape.prefill_attention, shape.decode_attention]
    )


def test_recovers_known_coefficients_from_noisy_steps():
    rng = np.random.default_rng(0)
    model = CostModel()
    for shape in random_shapes(rng, 600):
        model.add(shape, true_time(shape) * (1 + rng.normal(0, 0.003)), model.predict(shape))
    assert model.fitted and model.num_fits >= 600 // 16
    np.testing.assert_allclose(model.coefficients, TRUE, rtol=0.05)
    summary = model.summary()
    assert list(summary["coefficients"]) == list(FEATURES)
    counts = summary["error_histogram"]
    assert sum(counts.values()) == 600 - 10  # predictions exist from the first fit, after 10 steps
    assert counts["<=1.05"] > 0.9 * sum(counts.values())  # 0.3% noise: nearly all within 5%


def test_an_offline_model_fits_only_when_read():
    """Outside tbt_slo_ms mode no fit runs in the step loop: the rows are fitted when summary() reads them."""
    rng = np.random.default_rng(1)
    model = CostModel(online=False)
    for shape in random_shapes(rng, 100):
        model.add(shape, true_time(shape), model.predict(shape))
    assert model.num_fits == 0 and not model.fitted
    assert model.summary()["coefficients"]["decode_attention"] == pytest.approx(TRUE[4])
    model.summary()
    assert model.num_fits == 1  # nothing new since: no second fit


def test_early_refits_are_rate_limited():
    """A noisy machine makes most long steps miss their prediction by 20%: refitting on each would put a fit
    in nearly every step. At most one early refit per EARLY_REFIT_GAP steps."""
    from minisarathi.engine.cost_model import EARLY_REFIT_GAP

    rng = np.random.default_rng(2)
    model = CostModel()
    for shape in random_shapes(rng, 16):
        model.add(shape, true_time(shape), model.predict(shape))
    fits = model.num_fits
    for k, shape in enumerate(random_shapes(rng, 32)):  # every step 30% over or under: each one "missed"
        model.add(shape, true_time(shape) * (1.3 if k % 2 else 0.7), model.predict(shape))
    assert model.num_fits - fits <= 32 // EARLY_REFIT_GAP + 32 // 16


def test_coefficients_stay_non_negative():
    rng = np.random.default_rng(1)
    truth = TRUE * [1, 1, 0, 1, 0]  # no cost per decode: noise alone would fit a negative one
    model = CostModel()
    for shape in random_shapes(rng, 200):
        model.add(shape, true_time(shape, truth) + rng.normal(0, 1e-3))
    assert (model.coefficients >= 0).all()
    np.testing.assert_allclose(model.coefficients[[1, 3]], truth[[1, 3]], rtol=0.1)


def test_profile_anchors_what_the_window_does_not_show():
    rng = np.random.default_rng(2)
    model = CostModel(window=64)
    profile = random_shapes(rng, 12)
    model.add_profile(profile, [true_time(s) for s in profile])
    np.testing.assert_allclose(model.coefficients, TRUE, rtol=1e-6)
    for shape in random_shapes(rng, 200, decode_only=True):  # a decode-only stretch fills the window
        model.add(shape, true_time(shape))
    np.testing.assert_allclose(model.coefficients, TRUE, rtol=1e-6)  # the prefill cost is still known


def test_max_prefill_tokens_is_the_largest_chunk_within_the_time():
    model = CostModel()
    model.coefficients = TRUE.copy()
    rng = np.random.default_rng(3)
    for _ in range(200):
        start, seconds = int(rng.integers(0, 4000)), float(rng.uniform(0, 0.5))
        n = model.max_prefill_tokens(start, seconds)
        assert model.prefill_time(start, n) <= seconds < model.prefill_time(start, n + 1)
    assert model.max_prefill_tokens(0, -1.0) == 0
    assert chunk_attention(3, 2) == 4 + 5


@pytest.mark.parametrize("attention", [1e-20, 1e-22, 1e-24, 0.0])
def test_max_prefill_tokens_with_a_vanishing_attention_coefficient(attention):
    """NNLS often leaves the attention cost at ~1e-20: the textbook root (-b + sqrt(b^2 + 4as)) / 2a cancels
    to 0 there, where ~141 tokens fit."""
    model = CostModel()
    model.coefficients = np.array([1e-3, 7.1e-5, 1e-4, attention, 1e-9])
    for start, seconds in [(0, 0.01), (300, 0.01), (4000, 0.0371), (0, 1e-6)]:
        n = model.max_prefill_tokens(start, seconds)
        assert model.prefill_time(start, n) <= seconds < model.prefill_time(start, n + 1)
    assert model.max_prefill_tokens(0, 0.01) == 140


@pytest.mark.parametrize("window", [8, 64])
def test_the_window_follows_a_change_of_load(window):
    """Only the latest `window` steps count: after the machine gets 2x slower, the fit follows."""
    rng = np.random.default_rng(4)
    model = CostModel(window=window, refit_every=4)
    for shape in random_shapes(rng, 100):
        model.add(shape, true_time(shape))
    for shape in random_shapes(rng, window):
        model.add(shape, 2 * true_time(shape))
    model.fit()
    np.testing.assert_allclose(model.coefficients, 2 * TRUE, rtol=1e-6)


def test_stalled_steps_do_not_drag_the_fit():
    """1 step in 20 stalled 5-50x by another process: the fit equals the one over the other steps alone,
    where plain least squares over all of them is far off."""
    rng = np.random.default_rng(5)
    model, clean = CostModel(), CostModel()
    stalled_rows = []
    for shape in random_shapes(rng, 400):
        seconds = true_time(shape) * (1 + rng.normal(0, 0.003))
        if rng.random() < 0.05:
            seconds *= rng.uniform(5, 50)
            stalled_rows.append(shape)
        else:
            clean.add(shape, seconds)
        model.add(shape, seconds)
    model.fit()
    clean.fit()
    np.testing.assert_allclose(model.coefficients, clean.coefficients, rtol=0.01)
    np.testing.assert_allclose(model.coefficients, TRUE, rtol=0.15)
    assert len(stalled_rows) > 10
    x, y = model._rows[:400], model._times[:400]
    plain = np.linalg.lstsq(x, y, rcond=None)[0]
    assert np.abs(plain / TRUE - 1).max() > 0.5


def test_an_underdetermined_fit_is_not_used():
    """Five coefficients need more than five rows of full rank, with a prefill and a decode step among them:
    fewer (a time-limited profile) leave the model unfitted, so the scheduler keeps the fixed budget."""
    rng = np.random.default_rng(6)
    model = CostModel()
    few = random_shapes(rng, 5)
    model.add_profile(few, [true_time(s) for s in few])
    assert not model.fitted
    decodes = random_shapes(rng, 20, decode_only=True)
    only_decodes = CostModel()
    only_decodes.add_profile(decodes, [true_time(s) for s in decodes])
    assert not only_decodes.fitted
    more = random_shapes(rng, 7)
    model.add_profile(more, [true_time(s) for s in more])
    np.testing.assert_allclose(model.coefficients, TRUE, rtol=1e-6)
