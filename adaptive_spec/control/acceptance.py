"""Online acceptance estimation: per request, per drafted position, with a shared prior.

Model. The j-th draft of a step is accepted with conditional probability a_j (given drafts 1..j-1
were). A step that drafted k and accepted m tells us: positions 1..m succeeded, position m+1 failed
(if m < k), positions after m+1 were not tried. Expected tokens emitted by a step at k, counting
the recovered/bonus token:

    E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j          (= (1 - a^(k+1)) / (1 - a) for one rate a)

Estimator. Each position j keeps Beta pseudo-counts: `successes_j + prior_strength * prior_j` over
`trials_j + prior_strength`. The prior is what this drafter achieves across requests
(`AcceptancePrior`), so a new request starts from it. Forgetting: every step, observed or not,
multiplies the request's own counts by `decay`, so an estimate follows content that shifts (prose
to code) and, while a request does not draft, drifts back toward the prior with growing
uncertainty; that is what keeps k = 0 from being absorbing (see `optimistic_rates`).
Positions beyond the longest ever tried share the last tried position's counts.

Plain Python and math: microseconds per update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def expected_emitted(rates: list[float], k: int) -> float:
    """E[tokens emitted | k drafts] for per-position conditional rates (bonus token included)."""
    total, survive = 1.0, 1.0
    for j in range(k):
        survive *= rates[min(j, len(rates) - 1)]
        total += survive
    return total


@dataclass
class AcceptancePrior:
    """Population acceptance per position, learned across all requests with slow forgetting."""

    max_positions: int = 16
    initial_rate: float = 0.6
    decay: float = 0.98  # per update: the last ~50 outcomes, so a past regime fades
    pseudo_trials: float = 2.0  # weight of `initial_rate` before any data
    successes: list[float] = field(default_factory=list)
    trials: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.successes:
            self.successes = [self.initial_rate * self.pseudo_trials] * self.max_positions
            self.trials = [self.pseudo_trials] * self.max_positions

    def rates(self) -> list[float]:
        return [s / t for s, t in zip(self.successes, self.trials)]

    def update(self, k: int, accepted: int) -> None:
        for j in range(min(k, accepted + 1, self.max_positions)):
            self.successes[j] = self.successes[j] * self.decay + (1.0 if j < accepted else 0.0)
            self.trials[j] = self.trials[j] * self.decay + 1.0

    def state(self) -> dict:
        return {"successes": list(self.successes), "trials": list(self.trials)}

    def load_state(self, state: dict, max_trials: float = 20.0) -> None:
        """Start from saved counts, scaled down to at most `max_trials` per position so that this
        process's own outcomes soon outweigh them."""
        try:
            successes = [float(x) for x in state["successes"]]
            trials = [float(x) for x in state["trials"]]
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"acceptance prior state lacks or mangles a field: {error}") from None
        if not trials or len(successes) != len(trials) or not all(0 <= s <= t for s, t in zip(successes, trials)):
            raise ValueError("acceptance prior state needs 0 <= successes <= trials, one pair per position")
        for j in range(self.max_positions):
            s, t = successes[min(j, len(trials) - 1)], trials[min(j, len(trials) - 1)]
            scale = min(1.0, max_trials / t) if t > 0 else 0.0
            if t > 0:
                self.successes[j], self.trials[j] = s * scale, t * scale


@dataclass
class AcceptanceEstimator:
    """One request's acceptance, per drafted position."""

    prior: AcceptancePrior
    decay: float = 0.9  # per step: about the last 10 steps dominate
    prior_strength: float = 2.0  # the prior counts as this many trials
    successes: list[float] = field(default_factory=list)
    trials: list[float] = field(default_factory=list)

    def update(self, k: int, accepted: int) -> None:
        """Record one step (k = 0 steps only age the evidence)."""
        self.successes = [s * self.decay for s in self.successes]
        self.trials = [t * self.decay for t in self.trials]
        tried = min(k, accepted + 1)
        while len(self.trials) < tried:
            self.successes.append(0.0)
            self.trials.append(0.0)
        for j in range(tried):
            self.successes[j] += 1.0 if j < accepted else 0.0
            self.trials[j] += 1.0

    def rates(self, k_max: int) -> list[float]:
        """Posterior mean a_j for j = 1..k_max."""
        return self._posterior(k_max)[0]

    def optimistic_rates(self, k_max: int, z: float = 1.0) -> list[float]:
        """Posterior mean plus z standard deviations: larger where evidence is thin or stale."""
        means, trials = self._posterior(k_max)
        sqrt = math.sqrt
        return [min(1.0, mean + z * sqrt(mean * (1 - mean) / (n + 1))) for mean, n in zip(means, trials)]

    def forget(self) -> None:
        """Drop this request's own evidence (back to the prior): its drafter's regime changed."""
        self.successes, self.trials = [], []

    def evidence(self) -> float:
        """Effective trials at the first position (decays while the request does not draft)."""
        return self.trials[0] if self.trials else 0.0

    def _posterior(self, k_max: int) -> tuple[list[float], list[float]]:
        """Per position 1..k_max: the posterior mean and its trials (own + prior). One pass over
        lists padded with their last entry: policies ask this for every request at every step."""
        prior, strength = self.prior.rates(), self.prior_strength
        own_s, own_t = (self.successes, self.trials) if self.trials else ([0.0], [0.0])
        prior, own_s, own_t = _padded(prior, k_max), _padded(own_s, k_max), _padded(own_t, k_max)
        trials = [t + strength for t in own_t]
        return [(s + strength * p) / n for s, p, n in zip(own_s, prior, trials)], trials


def _padded(values: list[float], length: int) -> list[float]:
    """The first `length` values, the last one repeated where there are fewer."""
    return values[:length] if len(values) >= length else values + [values[-1]] * (length - len(values))
