"""Two more ceilings beside the hindsight oracle, each a policy object run through the simulator's loop.

Pure numpy, no torch. The hindsight oracle (`oracle`) knows every realised acceptance and may change
k at every position, so a policy's distance to it mixes three gaps: not knowing the future, not
knowing each request's acceptance level, and not adapting within a request. These two ceilings
separate them. Both play through the normal loop, so every metric is reported and the batch
semantics hold (a step costs cost(b, longest context, K = max k_i)).

``request-static-oracle``: each request runs one fixed k_i for its whole life, chosen in hindsight
(on its realised leading runs) as

    k_i = argmin over k in 0..max_k of  sum over the steps of request i replayed at static k of
          cost(B, prompt + t, min(k, n - t - 1)) / B

where B is the simulated batch size (closed loop; the max batch size with `rate`). That is the
request's own replayed time if every step of its life were a full batch of B rows at its k (its
per-row share of such steps). At B = 1 this is the request's exact time, and (closed loop) requests
run one after another, so request-static-oracle beats (or ties) every static k on tokens/s. At B > 1 we
take the step cost at B rather than at batch 1 because the best k shrinks with batch size (a
verify of B (k + 1) tokens costs relatively more than one of k + 1): batch-1 costs would choose
latency-regime k's for a throughput regime. It stays a hindsight choice, not an optimum: rows of
different k_i share steps costed at their max k, so at B > 1 it can fall below the best single
static k, which is what it measures (one k per request versus one k for everyone). Ties go to the
smaller k.

``confidence-oracle`` (the calibrated-confidence oracle): knows the TRUE per-position acceptance
probabilities the trace recorded (``accept_prob``), not the realised outcomes. Each step, for the
running requests i at positions t_i with caps cap_i (`RequestView.max_k`), it picks

    K = argmax over K in 0..max cap_i of  sum_i E_i(min(K, cap_i)) / cost(b, c, K),
    E_i(k) = 1 + sum over m = 1..k of  p_i[t_i] p_i[t_i + 1] ... p_i[t_i + m - 1]

(expected tokens emitted by a step of k drafts) with b rows, c the longest context, and cost the
simulator's uncorrected cost model; every row then drafts min(K, cap_i) (E_i never decreases in k,
so giving a row fewer drafts than K cannot raise the step's expected goodput). It is myopic:
it maximises each step's expected goodput, not the expected total time. With 0/1 probabilities
(greedy traces) it knows the outcomes, E_i(k) = min(k, run_i) + 1, and at batch 1 it comes close
to the hindsight oracle, which it cannot beat (that one is the exact optimum over all schedules).
Ties go to the smaller K.

``confidence-bound`` (batch 1): what the draft's confidence can buy, at most. A policy that reads
the draft's confidence learns a map from confidence to acceptance and sees each draft's confidence
only after paying the draft forward that shows it. This ceiling is given both for free: the best
map in hindsight (`hindsight_calibration`: the mean acceptance probability of the simulated
traces' positions in each confidence bin, fit on those very positions) and every future
confidence before the step starts. With acceptance so estimated it plays the schedule of least
expected time (`expected_schedule`). It is no strict bound, since a policy could read signals other
than the confidence, or learn a finer map, but in the simulator the confidence is the only signal
a policy sees, and a policy that saw the draws themselves would be the hindsight oracle. On greedy
traces, where the confidence oracle knows the outcomes, it is the ceiling that says how far the
draft's own signal can take a policy.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from ..control.policy import RequestView, StepRecord

__all__ = ["static_seconds", "request_static_policy", "RequestStaticPolicy", "ConfidenceOraclePolicy",
           "expected_schedule", "hindsight_calibration"]


def static_seconds(run: np.ndarray, prompt_length: int, cost_row: Callable[[int], np.ndarray],
                   max_k: int) -> np.ndarray:
    """Seconds of one request's steps replayed at each static k = 0..max_k, k capped per step at
    n - t - 1 as hosts cap it (`cost_row(context)[k]` is one step's cost)."""
    runs = run.tolist()
    n = len(runs)
    out = np.zeros(max_k + 1)
    for k in range(max_k + 1):
        t, total = 1, 0.0
        while t < n:
            kk = min(k, n - t - 1)
            total += cost_row(prompt_length + t)[kk]
            t += min(kk, runs[t]) + 1
        out[k] = total
    return out


class RequestStaticPolicy:
    """Plays a fixed k per request (k_i chosen by `request_static_policy`)."""

    name = "request-static-oracle"

    def __init__(self, ks: Mapping[str, int]):
        self.ks = dict(ks)  # request id -> its static k

    def choose(self, requests: Sequence[RequestView]) -> list[int]:
        return [self.ks[r.request_id] for r in requests]

    def observe(self, record: StepRecord) -> None:
        pass


def request_static_policy(requests: Iterable[tuple[str, int, np.ndarray]], cost_row: Callable[[int], np.ndarray],
                          max_k: int) -> RequestStaticPolicy:
    """Each (request id, prompt length, realised leading runs) gets the static k with the least
    replayed time under `cost_row` (see the module docstring)."""
    return RequestStaticPolicy({rid: int(np.argmin(static_seconds(run, prompt_length, cost_row, max_k)))
                                for rid, prompt_length, run in requests})


class ConfidenceOraclePolicy:
    """Maximises each step's expected goodput from the true per-position acceptance probabilities."""

    name = "confidence-oracle"

    def __init__(self, requests: Mapping[str, tuple[int, np.ndarray]], step_seconds: Callable[[int, int, int], float]):
        self.requests = dict(requests)  # request id -> (prompt length, accept_prob per position)
        self.step_seconds = step_seconds  # (batch, context, K) -> seconds

    def choose(self, requests: Sequence[RequestView]) -> list[int]:
        caps = [r.max_k for r in requests]
        top = max(caps)
        if top == 0:
            return [0] * len(requests)
        expected = np.zeros(top + 1)  # sum over rows of E_i(min(K, cap_i)), K = 0..top
        for r, cap in zip(requests, caps):
            prompt_length, probs = self.requests[r.request_id]
            t = r.context_length - prompt_length
            row = np.cumsum(np.cumprod(probs[t:t + cap]))
            expected[1:cap + 1] += row
            expected[cap + 1:] += row[-1] if cap else 0.0
        expected += len(requests)  # the recovered or bonus token
        b, c = len(requests), max(r.context_length for r in requests)
        seconds = np.array([self.step_seconds(b, c, k) for k in range(top + 1)])
        best = int(np.argmax(expected / seconds))
        return [min(best, cap) for cap in caps]

    def observe(self, record: StepRecord) -> None:
        pass


def expected_schedule(accept_prob: np.ndarray, prompt_length: int, cost_row: Callable[[int], np.ndarray],
                      max_k: int) -> tuple[float, np.ndarray]:
    """(expected seconds of one request's steps, best k per position) when a draft covering position
    t is accepted with probability accept_prob[t], independently of the others (as `replay` draws it):

        V(n) = 0,   V(t) = min over k of  cost(prompt + t, k) + sum over m = 0..k of P_t,k(m) V(t + m + 1)

    P_t,k(m) is the chance a step of k drafts from t accepts exactly m of them. Since the draws are
    independent, the position a request has reached is all a policy that does not see them can use:
    none expects less time. With 0/1 probabilities (greedy traces) this is `oracle.dp_schedule`.
    With S_m = accept_prob[t] ... accept_prob[t + m - 1], the sum for k + 1 drafts is the one for k
    plus S_(k+1) (V(t + k + 2) - V(t + k + 1)), so each position costs one pass over its k."""
    probs = np.asarray(accept_prob, dtype=float)
    n = len(probs)
    value = np.zeros(n + 1)
    best = np.zeros(n, dtype=np.int64)
    for t in range(n - 1, 0, -1):
        m = min(max_k, n - t - 1)
        survive = np.cumprod(probs[t:t + m])  # S_1 .. S_m
        future = value[t + 1] + np.concatenate(([0.0], np.cumsum(survive * np.diff(value[t + 1:t + m + 2]))))
        candidates = cost_row(prompt_length + t)[: m + 1] + future
        j = int(np.argmin(candidates))
        value[t], best[t] = candidates[j], j
    return float(value[1]) if n > 1 else 0.0, best


def hindsight_calibration(confidences: Sequence[np.ndarray], accept_probs: Sequence[np.ndarray],
                          bins: int = 20) -> Callable[[np.ndarray], np.ndarray]:
    """The map from a draft's confidence to its acceptance probability that fits these requests best
    in hindsight: quantile bins of the confidence over their positions 1.. (position 0 comes from
    prefill) and each bin's mean acceptance probability. Returns the map, for arrays of confidences."""
    conf = np.concatenate([np.asarray(c, dtype=float)[1:] for c in confidences])
    acc = np.concatenate([np.asarray(a, dtype=float)[1:] for a in accept_probs])
    if not len(conf):
        return lambda values: np.zeros(len(values))
    edges = np.unique(np.quantile(conf, np.linspace(0, 1, bins + 1))[1:-1])  # inner edges

    def locate(values: np.ndarray) -> np.ndarray:
        return np.searchsorted(edges, np.asarray(values, dtype=float), side="right")

    where = locate(conf)
    means = np.array([acc[where == b].mean() if np.any(where == b) else 0.0 for b in range(len(edges) + 1)])
    return lambda values: means[locate(values)]
