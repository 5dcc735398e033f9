"""A model of one engine step's duration from its composition, fitted online from the engine's own steps.

    time = overhead + a * prefill_tokens + b * decode_seqs + c * prefill_attention + d * decode_attention

prefill_attention is the sum over the step's prefill tokens of their context length (the keys each one
attends to), decode_attention the sum of the decodes' context lengths: attention work grows with the
history, the linear layers with the token count. The coefficients are a least-squares fit, kept
non-negative (so that more work never predicts less time, which the budget search relies on), over a
sliding window of recent steps plus the start-up profile's steps, which keep the directions the recent
load does not exercise (e.g. prefill cost during a decode-only stretch) anchored.

Structured outputs add the masks of the step's constrained rows (minisarathi/structured.py), measured per row
and added where they lengthen the step: all of it on the CPU, where the engine thread computes them between
the forward and the sampling; under overlap (engine/overlap.py) the host computes them while the device runs
the forward, so only max(0, masks - forward) is added. The fit is of the steps less that share.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FEATURES = ("overhead", "prefill_tokens", "decode_seqs", "prefill_attention", "decode_attention")
WINDOW = 512  # recent steps the fit covers
REFIT_EVERY = 16  # steps between refits: a fit is cheap, but not free every step
OUTLIER_MADS = 5.0  # steps further than this many median absolute deviations (relative error) are outliers
OUTLIER_PASSES = 3  # fits at most per refit
EARLY_REFIT_SECONDS = 0.01  # a step at least this long ...
EARLY_REFIT_ERROR = 0.2  # ... that missed its prediction by this share of its time is refitted at once,
EARLY_REFIT_GAP = 4  # ... if at least this many steps came since the last fit (noisy steps miss often)
MASK_WEIGHT = 1 / 16  # of a step's mask time per row in the running average: a stalled step moves it little
# predicted / actual ratios: upper bucket edges of the prediction-error histogram
ERROR_BUCKETS = (0.5, 0.67, 0.8, 0.9, 0.95, 1.05, 1.1, 1.25, 1.5, 2.0, float("inf"))


@dataclass(slots=True)
class StepShape:
    """What a step computes, in the cost model's features (the overhead's feature is the constant 1)."""

    prefill_tokens: int = 0
    decode_seqs: int = 0
    prefill_attention: int = 0  # sum over prefill tokens of their context length (position + 1)
    decode_attention: int = 0  # sum over decodes of their context length
    constrained: int = 0  # rows that sample under a grammar: each computes and applies a mask

    def add_prefill(self, start: int, n: int) -> None:
        """n prompt tokens at positions start .. start + n - 1."""
        self.prefill_tokens += n
        self.prefill_attention += chunk_attention(start, n)

    def add_decode(self, context_len: int) -> None:
        self.decode_seqs += 1
        self.decode_attention += context_len


def chunk_attention(start: int, n: int) -> int:
    """Sum of the context lengths of n tokens at positions start .. start + n - 1."""
    return n * start + n * (n + 1) // 2


def step_shape(scheduled) -> StepShape:
    """The shape of a step from the scheduler's {sequence: tokens} before the step computes them. It runs
    every step over every scheduled sequence: local sums, not StepShape's methods (~0.1 us per sequence).
    A constrained row samples under a matcher: a decode, or the chunk that ends its prompt."""
    prefill_tokens = decodes = prefill_attention = decode_history = constrained = 0
    for seq, n in scheduled.items():
        start = seq.num_computed_tokens
        if n == 1 and start >= seq.num_prefill_tokens:  # a decode: its token sees the history and itself
            decodes += 1
            decode_history += start
            constrained += seq.matcher is not None
        else:
            prefill_tokens += n
            prefill_attention += n * start + n * (n + 1) // 2
            if seq.matcher is not None and start + n == seq.num_tokens:  # n > 1 forks here: n rows
                constrained += seq.params.n if seq.choices is None else 1
    return StepShape(prefill_tokens, decodes, prefill_attention, decode_history + decodes, constrained)


class CostModel:
    def __init__(
        self,
        window: int = WINDOW,
        refit_every: int = REFIT_EVERY,
        online: bool = True,
        overlapped: bool = False,
    ):
        """online: refit while steps are added (tbt_slo_ms mode sizes the steps with it); False: only collect
        them and fit when summary() is read, which keeps the fits off the step loop. overlapped: the engine
        overlaps the host with the device, so the masks are hidden behind the forward up to its time."""
        self.refit_every = refit_every
        self.online = online
        self.overlapped = overlapped
        self.mask_per_row = 0.0  # seconds: the measured mask time of a constrained row, a running average
        self._mask_steps = 0  # steps with a constrained row so far
        self._rows = np.zeros((window, len(FEATURES)))  # float64[window, features], a ring
        self._times = np.zeros(window)  # float64[window] seconds
        self._num_rows = 0  # rows written since the start
        self._anchor_rows = np.zeros((0, len(FEATURES)))  # the start-up profile's steps, always in the fit
        self._anchor_times = np.zeros(0)
        self._since_fit = 0
        self.coefficients: np.ndarray | None = None  # float64[features], seconds per unit; None: no fit yet
        self.num_fits = 0
        self.error_counts = [0] * len(ERROR_BUCKETS)  # predicted / actual, bucketed by ERROR_BUCKETS

    @property
    def fitted(self) -> bool:
        return self.coefficients is not None

    def add_profile(self, shapes: list[StepShape], seconds: list[float]) -> None:
        """Steps measured at start-up: kept in every fit, and fitted at once."""
        self._anchor_rows = np.vstack([self._anchor_rows, [_features(s) for s in shapes]])
        self._anchor_times = np.concatenate([self._anchor_times, seconds])
        self.fit()

    def add(
        self, shape: StepShape, seconds: float, predicted: float | None = None, mask_seconds: float = 0.0
    ) -> None:
        """One measured step (and what was predicted for it, for the error histogram; what its masks took);
        refits every few steps."""
        if shape.constrained:
            per_row = mask_seconds / shape.constrained
            self._mask_steps += 1  # the mean of the first steps, then a running average
            self.mask_per_row += max(MASK_WEIGHT, 1 / self._mask_steps) * (per_row - self.mask_per_row)
        i = self._num_rows % len(self._times)
        self._rows[i] = _features(shape)
        # the rest of the step stands for its forward, behind which an overlapped mask hides
        self._times[i] = seconds - self.added_mask_time(mask_seconds, seconds - mask_seconds)
        self._num_rows += 1
        self._since_fit += 1
        if predicted is not None and seconds > 0:
            ratio = predicted / seconds
            self.error_counts[next(k for k, edge in enumerate(ERROR_BUCKETS) if ratio <= edge)] += 1
        # the first fit as soon as the rows can determine every coefficient, then every refit_every steps, or
        # at once after a long step that missed its prediction by far (the load changed: follow it now)
        if not self.online:
            return
        missed = (
            predicted is not None
            and seconds >= EARLY_REFIT_SECONDS
            and self._since_fit >= EARLY_REFIT_GAP
            and abs(seconds - predicted) > EARLY_REFIT_ERROR * seconds
        )
        if (
            self._since_fit >= self.refit_every
            or missed
            or (not self.fitted and self._num_rows >= 2 * len(FEATURES))
        ):
            self.fit()

    def fit(self) -> None:
        """Fit, then fit again without the outliers: steps whose relative error is beyond OUTLIER_MADS median
        absolute deviations (a step stalled by another process on a shared machine would otherwise drag
        every coefficient up). The model predicts a step's typical time; the margin covers the tail."""
        n = min(self._num_rows, len(self._times))
        x = np.vstack([self._rows[:n], self._anchor_rows])
        y = np.concatenate([self._times[:n], self._anchor_times])
        self._since_fit = 0
        if not _determined(x):  # e.g. a time-limited profile without a decode shape: keep the fixed budget
            return
        keep = np.ones(len(y), dtype=bool)
        for _ in range(
            OUTLIER_PASSES
        ):  # a fit dragged by stalls mislabels some rows: trim again from the better one
            coefficients = _non_negative_least_squares(x[keep], y[keep])
            predicted = x @ coefficients
            relative = (y - predicted) / np.maximum(predicted, 1e-9)
            deviation = np.abs(relative - np.median(relative[keep]))
            inliers = deviation <= max(OUTLIER_MADS * np.median(deviation[keep]), 1e-9)
            if (inliers == keep).all() or inliers.sum() < len(FEATURES):
                break
            keep = inliers
        self.coefficients = coefficients
        self.num_fits += 1

    def predict(self, shape: StepShape) -> float | None:
        if self.coefficients is None:
            return None
        c = self.coefficients
        forward = float(
            c[0]
            + c[1] * shape.prefill_tokens
            + c[2] * shape.decode_seqs
            + c[3] * shape.prefill_attention
            + c[4] * shape.decode_attention
        )
        return forward + self.added_mask_time(self.mask_per_row * shape.constrained, forward)

    def added_mask_time(self, mask_seconds: float, forward_seconds: float) -> float:
        """What masks of mask_seconds add to a step whose forward takes forward_seconds."""
        return max(0.0, mask_seconds - forward_seconds) if self.overlapped else mask_seconds

    def prefill_time(self, start: int, n: int) -> float:
        """Predicted time n prompt tokens at positions start.. add to a step."""
        c = self.coefficients
        return float(c[1] * n + c[3] * chunk_attention(start, n))

    def max_prefill_tokens(self, start: int, seconds: float) -> int:
        """The most prompt tokens from position `start` whose added time stays within `seconds`:
        the largest n with (c3 / 2) n^2 + (c1 + c3 (start + 1/2)) n <= seconds."""
        if seconds <= 0:
            return 0
        c = self.coefficients
        a, b = c[3] / 2, c[1] + c[3] * (start + 0.5)
        if a <= 0 and b <= 0:
            return 1 << 30  # prefill predicted free: only the token budget limits it
        # the positive root in the form that does not cancel when a is tiny next to b (fits of ~1e-20 are
        # common); a = 0 gives seconds / b
        n = int(2 * seconds / (b + np.sqrt(b * b + 4 * a * seconds)))
        # float rounding at the boundary: step back until the exact prediction fits
        while n > 0 and self.prefill_time(start, n) > seconds:
            n -= 1
        return n

    def summary(self) -> dict:
        """Coefficients by feature name (None before the first fit), the mask time per constrained row, fits
        so far, and the error histogram."""
        if not self.online and self._since_fit:
            self.fit()
        coefficients = None if self.coefficients is None else dict(zip(FEATURES, self.coefficients.tolist()))
        return {
            "coefficients": coefficients,
            "mask_seconds_per_row": self.mask_per_row,
            "fits": self.num_fits,
            "error_histogram": {
                f"<={edge:g}": count for edge, count in zip(ERROR_BUCKETS, self.error_counts)
            },
        }


def _non_negative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """float64[features]: least squares with the most negative coefficient dropped until none is left (at most
    five small solves); columns are scaled to unit size first, as their magnitudes differ by ~10^6."""
    scale = np.abs(x).max(axis=0)
    active = np.flatnonzero(scale > 0)
    coefficients = np.zeros(x.shape[1])
    while len(active):
        solution = np.linalg.lstsq(x[:, active] / scale[active], y, rcond=None)[0]
        if (solution >= 0).all():
            coefficients[active] = solution / scale[active]
            break
        active = np.delete(active, np.argmin(solution))
    return coefficients


def _determined(x: np.ndarray) -> bool:
    """Whether the rows float64[rows, features] determine every coefficient: more rows than features and
    full rank (which needs a prefill step and a decode step among them)."""
    if len(x) <= x.shape[1]:
        return False
    scale = np.abs(x).max(axis=0)
    return bool((scale > 0).all()) and np.linalg.matrix_rank(x / scale) == x.shape[1]


def _features(shape: StepShape) -> tuple:
    return 1.0, shape.prefill_tokens, shape.decode_seqs, shape.prefill_attention, shape.decode_attention
