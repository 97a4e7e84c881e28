"""Paired bootstrap intervals over prompts for the speed of one configuration relative to another.

Pure numpy: no torch, no models, so benchmarks, the report and tests share one implementation.

Estimator. `bench` reports a configuration's tokens/s as its total generated tokens over its total
seconds (batch 1: the sum of the prompts' own times; closed loop: the summed step time, split
evenly over the requests each step served), so the ratio of configuration A to B here is the same
ratio of totals,

    R = (sum_i tokens_A[i] / sum_i seconds_A[i]) / (sum_i tokens_B[i] / sum_i seconds_B[i]),

not a mean of per-prompt ratios (which would weigh a 10-token answer like a 64-token one).

Pairing. Prompt i of A and prompt i of B were served on the same prompt (and, interleaved, at about
the same time), so a resample draws prompt indices and keeps both configurations' figures of each
drawn prompt together: what varies from prompt to prompt (length, how predictable it is) then
cancels in the ratio instead of widening the interval.

Interval. The percentile bootstrap: `resamples` draws of n prompts with replacement from an explicit
seeded `numpy.random.Generator`, R of each draw, and the 2.5% and 97.5% quantiles of those R. Like
any bootstrap it runs a little narrow at small n: on synthetic pairs with a known ratio
(`tests/test_bench_intervals.py`) the nominal 95% interval covered 91% at 16 prompts, 92% at 24 and
94% at 48. BCa (`scipy.stats.bootstrap(..., paired=True, method="BCa")`) did no better there (90%,
90%, 93%), so the simpler interval stays; read a bare exclusion of 1.0 at 16 prompts as about a
9%-level, not a 5%-level, call.

What it cannot see: drift shared by both configurations at the same moment (interleaving and
rotating the order handle that), and the choice of the reference itself: "the best static k" is
picked as the fastest on the same prompts, which biases ratios to it slightly below their truth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

DEFAULT_RESAMPLES = 4000
DEFAULT_LEVEL = 0.95
Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile


@dataclass(frozen=True)
class RatioInterval:
    """A point ratio of A to B and its bootstrap interval over `prompts` paired prompts."""

    ratio: float
    low: float
    high: float
    level: float
    prompts: int

    def excludes(self, value: float = 1.0) -> bool:
        return not self.low <= value <= self.high

    def as_dict(self) -> dict:
        return {"ratio": round(self.ratio, 4), "low": round(self.low, 4), "high": round(self.high, 4),
                "level": self.level, "prompts": self.prompts, "excludes_1": self.excludes(1.0)}


def excludes_one(interval: RatioInterval) -> bool:
    """Whether the interval says A and B differ in speed (its range leaves out a ratio of 1.0)."""
    return interval.excludes(1.0)


def ratio_of_totals(tokens_a, seconds_a, tokens_b, seconds_b) -> float:
    """(total tokens / total seconds of A) / (the same of B)."""
    return float((np.sum(tokens_a) / np.sum(seconds_a)) / (np.sum(tokens_b) / np.sum(seconds_b)))


def paired_ratio_interval(tokens_a: Sequence[float], seconds_a: Sequence[float],
                          tokens_b: Sequence[float], seconds_b: Sequence[float], *,
                          rng: np.random.Generator, resamples: int = DEFAULT_RESAMPLES,
                          level: float = DEFAULT_LEVEL) -> RatioInterval:
    """The ratio of A's tokens/s to B's (ratio of totals) with a paired percentile bootstrap interval;
    element i of every sequence belongs to prompt i."""
    columns = _columns(tokens_a, seconds_a, tokens_b, seconds_b)
    draws = _draws(len(columns[0]), rng, resamples)
    ta, sa, tb, sb = (column[draws].sum(axis=1) for column in columns)
    ratios = (ta / sa) / (tb / sb)
    return _interval(ratio_of_totals(*columns), ratios, level, len(columns[0]))


def rate_interval(tokens: Sequence[float], seconds: Sequence[float], *, rng: np.random.Generator,
                  resamples: int = DEFAULT_RESAMPLES, level: float = DEFAULT_LEVEL) -> RatioInterval:
    """One configuration's tokens/s (total tokens / total seconds) with a bootstrap interval over its
    prompts, for plots: unpaired, so it carries the prompts' own spread (wider than a paired ratio)."""
    tokens_column, seconds_column = _columns(tokens, seconds)
    draws = _draws(len(tokens_column), rng, resamples)
    rates = tokens_column[draws].sum(axis=1) / seconds_column[draws].sum(axis=1)
    return _interval(float(tokens_column.sum() / seconds_column.sum()), rates, level, len(tokens_column))


def paired_spread(tokens_a, seconds_a, tokens_b, seconds_b) -> float:
    """The per-prompt standard deviation of the log ratio of totals' influence terms,

        u_i = tokens_A[i]/mean(tokens_A) - seconds_A[i]/mean(seconds_A)
              - tokens_B[i]/mean(tokens_B) + seconds_B[i]/mean(seconds_B),

    so that sd(log R) ~ paired_spread / sqrt(n) (the delta method). With equal prompts it is the
    coefficient of variation of the per-prompt ratio, the spread a paired comparison has to beat."""
    ta, sa, tb, sb = _columns(tokens_a, seconds_a, tokens_b, seconds_b)
    influence = ta / ta.mean() - sa / sa.mean() - tb / tb.mean() + sb / sb.mean()
    return float(np.std(influence, ddof=1)) if len(influence) > 1 else float("nan")


def prompts_for_half_width(spread: float, half_width: float = 0.05, z: float = Z_95) -> int | None:
    """Prompts a 95% interval needs to be +-`half_width` wide (relative): n = (z * spread / half_width)^2.
    An interval that narrow excludes 1.0 for a true +half_width effect about half the time; twice the
    effect's size in half-widths (n four times larger) makes that about 98%."""
    if not spread > 0 or not math.isfinite(spread):
        return None
    return math.ceil((z * spread / half_width) ** 2)


def _columns(*sequences) -> list[np.ndarray]:
    columns = [np.asarray(sequence, dtype=float) for sequence in sequences]
    if len({len(column) for column in columns}) != 1 or len(columns[0]) == 0:
        raise ValueError(f"need equal, non-empty per-prompt figures, got lengths {[len(c) for c in columns]}")
    if any(np.sum(seconds) <= 0 for seconds in columns[1::2]):  # (tokens, seconds) pairs
        raise ValueError("a configuration's seconds sum to zero: no rate to compare")
    return columns


def _draws(prompts: int, rng: np.random.Generator, resamples: int) -> np.ndarray:
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    return rng.integers(0, prompts, size=(resamples, prompts))


def _interval(point: float, replicates: np.ndarray, level: float, prompts: int) -> RatioInterval:
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    tail = (1 - level) / 2
    low, high = np.quantile(replicates, [tail, 1 - tail])
    return RatioInterval(point, float(low), float(high), level, prompts)
