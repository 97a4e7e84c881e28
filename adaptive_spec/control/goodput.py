"""The goodput policy: choose k per request and step to maximise expected emitted tokens per second.

For a batch of B requests with context c, and each candidate batch draft length K = 0..K_max:

    goodput(K) = sum_i E_i[emitted | k_i = min(K, cap_i)] / step_seconds(B, c, K)

where E_i comes from request i's acceptance estimator (`acceptance.py`) and step_seconds from the
cost model (a measured profile, corrected online from the engine's own step timings). The engine
drafts K tokens for the whole batch and verifies K + 1 per row in one dense forward, so a step's
cost depends on K, not on how the rows share it; a row that drafts fewer than K saves nothing, and
every row gets min(K, its cap). Requests still choose jointly: poorly accepted requests pull K
down, well accepted ones pull it up, and K = 0 (speculation off) wins whenever nothing pays.

K = 0 is never absorbing. A request's evidence ages while it does not draft, and the choice uses
optimistic rates (posterior mean + z standard deviations), so thin or stale evidence gets a chance.
On top, a request that has not drafted for `probe_interval` steps gets a one-token probe; the
interval doubles after each probe that did not switch drafting back on (up to `max_probe_interval`),
bounding the cost of probing a drafter that never pays.

Flapping guard: the batch's K changes only when the new best beats the current K's goodput by
more than `hysteresis`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from .acceptance import AcceptanceEstimator, AcceptancePrior, expected_emitted
from .policy import PolicyBase, RequestView, StepRecord


class StepCost(Protocol):
    def step_seconds_table(self, batch: int, context: float, k_max: int) -> list[float]: ...

    def observe(self, record: StepRecord) -> None: ...


@dataclass(frozen=True)
class GoodputConfig:
    max_k: int = 8
    hysteresis: float = 0.03
    exploration_z: float = 0.5
    request_decay: float = 0.9
    prior_strength: float = 2.0
    prior_rate: float = 0.6
    probe_interval: int = 8
    max_probe_interval: int = 128

    def __post_init__(self) -> None:
        checks = [
            (self.max_k >= 0, "max_k must be >= 0"),
            (0 <= self.hysteresis < 1, "hysteresis must be in [0, 1)"),
            (self.exploration_z >= 0, "exploration_z must be >= 0"),
            (0 < self.request_decay <= 1, "request_decay must be in (0, 1]"),
            (self.prior_strength > 0, "prior_strength must be > 0"),
            (0 < self.prior_rate < 1, "prior_rate must be in (0, 1)"),
            (1 <= self.probe_interval <= self.max_probe_interval, "need 1 <= probe_interval <= max_probe_interval"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"goodput policy: {message}")


@dataclass
class _RequestState:
    estimator: AcceptanceEstimator
    steps_off: int = 0
    probe_interval: int = 8
    probing: bool = False


@dataclass
class GoodputPolicy(PolicyBase):
    cost_model: StepCost
    config: GoodputConfig = field(default_factory=GoodputConfig)
    name: str = "goodput"

    def __post_init__(self) -> None:
        self.prior = AcceptancePrior(max_positions=max(self.config.max_k, 1), initial_rate=self.config.prior_rate)
        self._requests: dict[str, _RequestState] = {}
        self._batch_k = 0
        self.last_goodput: list[float] = []  # goodput per K at the last choice, for inspection

    def choose(self, requests: Sequence[RequestView]) -> list[int]:
        if not requests:
            return []
        states = self._states_for(requests)
        k_max = min(self.config.max_k, max(r.max_k for r in requests))
        if k_max == 0:
            return [0] * len(requests)
        context = max(r.context_length for r in requests)
        costs = self.cost_model.step_seconds_table(len(requests), context, k_max)
        gains = [0.0] * (k_max + 1)
        for request, state in zip(requests, states):
            rates = state.estimator.optimistic_rates(k_max, self.config.exploration_z)
            expected = _expected_prefix(rates, k_max)
            for k in range(k_max + 1):
                gains[k] += expected[min(k, request.max_k)]
        self.last_goodput = [gain / max(cost, 1e-12) for gain, cost in zip(gains, costs)]
        best = max(range(k_max + 1), key=self.last_goodput.__getitem__)
        current = min(self._batch_k, k_max)
        if self.last_goodput[best] <= self.last_goodput[current] * (1 + self.config.hysteresis):
            best = current
        self._batch_k = best
        if best == 0:
            return self._probes(requests, states)
        for state in states:
            state.probing = False
        return [min(best, r.max_k) for r in requests]

    def observe(self, record: StepRecord) -> None:
        self.cost_model.observe(record)
        for outcome in record.outcomes:
            state = self._requests.get(outcome.request_id)
            if state is None:
                continue
            state.estimator.update(outcome.k, outcome.accepted)
            if outcome.k:
                self.prior.update(outcome.k, outcome.accepted)
                state.steps_off = 0
                if not state.probing:  # drafting by choice: probing can start over from the base interval
                    state.probe_interval = self.config.probe_interval
            else:
                state.steps_off += 1

    # --- helpers -----------------------------------------------------------------------------
    def _states_for(self, requests: Sequence[RequestView]) -> list[_RequestState]:
        """States of the running requests; finished ones are dropped."""
        known = self._requests
        self._requests = {}
        for r in requests:
            self._requests[r.request_id] = known.get(r.request_id) or _RequestState(
                AcceptanceEstimator(self.prior, self.config.request_decay, self.config.prior_strength),
                probe_interval=self.config.probe_interval)
        return [self._requests[r.request_id] for r in requests]

    def _probes(self, requests: Sequence[RequestView], states: list[_RequestState]) -> list[int]:
        """K = 0 was chosen: one-token probes for requests that have not drafted for a while."""
        ks = []
        for request, state in zip(requests, states):
            due = state.steps_off >= state.probe_interval and request.max_k >= 1
            if due:
                if state.probing:  # the last probe did not bring drafting back: back off
                    state.probe_interval = min(2 * state.probe_interval, self.config.max_probe_interval)
                state.probing = True
            ks.append(1 if due else 0)
        return ks


def _expected_prefix(rates: list[float], k_max: int) -> list[float]:
    """[E(0), E(1), ..., E(k_max)] in one pass."""
    out, total, survive = [1.0], 1.0, 1.0
    for j in range(k_max):
        survive *= rates[j]
        total += survive
        out.append(total)
    return out


__all__ = ["GoodputConfig", "GoodputPolicy", "StepCost", "expected_emitted"]
