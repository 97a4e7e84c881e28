"""The hindsight oracle: the best k schedule for a realised trace, by dynamic programming.

Pure numpy, no torch. Uses the realisation of `replay` (one uniform per position), so the oracle
sees exactly what every policy sees.

Batch size 1 (exact). For one request with realised leading runs run(t) and step cost
cost(c, k) = CostModel.step_seconds(1, prompt_length + t, k):

    V(n) = 0,   V(t) = min over k in 0..min(max_k, n - t - 1) of  cost(prompt + t, k) + V(t + min(k, run(t)) + 1)

from t = n - 1 down to 1 (position 0 is prefill). V(1) is the least time any k schedule can spend
on the request's steps, and requests at batch size 1 run one after another, so the schedule that
follows the argmins gives the highest tokens/s (and the lowest latency of every request) that any
policy, causal or not, can reach on that realisation.

Batch size B > 1 (an upper bound on tokens/s, not a schedule). In the engine a step of b <= B rows
with longest context c and batch draft length K costs cost(b, c, K). Cost is non-decreasing in
context and in k, and every row i of the step has context c_i <= c and k_i <= K, so

    cost(b, c, K) = sum over rows i of cost(b, c, K) / b  >=  sum over rows i of g(c_i, k_i),
    g(c, k) = min over b' in 1..B of cost(b', c, k) / b'.

Summing over steps, the simulated time of ANY policy is at least sum over requests of W_i, where
W_i is the DP above with g in place of cost (each request gets the cheapest per-row share any batch
size could give it, and its own best k at every step). Contexts are rounded down to a multiple of
`context_quantum` (32) before the lookup, which only lowers g (cost is monotone in context), so the
bound stays valid. Tokens/s <= total tokens / (sum_i W_i + prefill time) (prefill is the same for every policy). The bound is loose where
batch sharing cannot really happen (the tail of a run, arrivals too sparse to fill batches) and
where requests in a batch would want different K.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..control.policy import RequestView, StepRecord

__all__ = ["dp_schedule", "CostRows", "SchedulePolicy"]


class CostRows:
    """Memoised rows [cost(k) for k = 0..max_k] per context, from a step-cost function.

    batch=1 gives exact step costs; `shared_up_to=B` gives g(c, k) = min over b <= B of cost(b, c, k) / b
    on contexts rounded down to `context_quantum`."""

    def __init__(self, cost_model, max_k: int, batch: int = 1, shared_up_to: int | None = None,
                 context_quantum: int = 32):
        self.cost_model, self.max_k = cost_model, max_k
        self.batch, self.shared = batch, shared_up_to
        self.quantum = context_quantum if shared_up_to else 1
        self._rows: dict[int, np.ndarray] = {}

    def __call__(self, context: int) -> np.ndarray:
        c = (int(context) // self.quantum) * self.quantum
        row = self._rows.get(c)
        if row is None:
            if self.shared:
                row = np.min([np.asarray(self.cost_model.step_seconds_table(b, c, self.max_k)) / b
                              for b in range(1, self.shared + 1)], axis=0)
            else:
                row = np.asarray(self.cost_model.step_seconds_table(self.batch, c, self.max_k), dtype=float)
            self._rows[c] = row
        return row


def dp_schedule(run: np.ndarray, prompt_length: int, cost_row: Callable[[int], np.ndarray],
                max_k: int) -> tuple[float, np.ndarray]:
    """(V(1), best k per position) for one realised request; see the module docstring."""
    n = len(run)
    value = np.zeros(n + 1)
    best = np.zeros(n, dtype=np.int64)
    for t in range(n - 1, 0, -1):
        m = min(max_k, n - t - 1)
        ks = np.arange(m + 1)
        candidates = cost_row(prompt_length + t)[: m + 1] + value[t + np.minimum(ks, run[t]) + 1]
        j = int(np.argmin(candidates))
        value[t], best[t] = candidates[j], j
    return float(value[1]) if n > 1 else 0.0, best


class SchedulePolicy:
    """Plays precomputed per-request schedules: k = schedule[request][position]. Only meaningful at
    batch size 1, where a schedule is a request's optimum (the simulator builds the hindsight one,
    `dp_schedule`, and the one of least expected time, `ceilings.expected_schedule`)."""

    def __init__(self, name: str, schedules: dict[str, tuple[int, np.ndarray]]):
        self.name = name
        self.schedules = schedules  # request id -> (prompt length, best k per position)

    def choose(self, requests: Sequence[RequestView]) -> list[int]:
        out = []
        for r in requests:
            prompt_length, best = self.schedules[r.request_id]
            out.append(int(best[r.context_length - prompt_length]))
        return out

    def observe(self, record: StepRecord) -> None:
        pass
