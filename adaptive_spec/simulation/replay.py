"""Replaying a trace's accept/reject process: the semantics every simulated policy and the oracle share.

Pure numpy, no torch.

Semantics (one simulated request replays one trace request of n generated positions):

* Position 0 is emitted by prefill (it is not a speculative step). Steps start at position t = 1.
* Every position t gets ONE uniform u_t, drawn from a generator seeded by (simulation seed,
  simulated request index): ``numpy.random.default_rng([seed, index]).random(n)``. A draft covering
  position t is accepted iff ``u_t < accept_prob_t``. The realisation is therefore fixed per
  simulated request, whatever the policy, its batch or its k schedule.
* A step at k starting at position t covers positions t .. t+k-1; it accepts the leading run of
  accepted positions, capped at k, then emits one more token (the recovered or bonus token), so the
  request advances by accepted + 1 positions (cut at the trace's end).
* k is capped like the engine does: k <= min(max_k, remaining - 1) with remaining = n - t.
* Stopping inside the step (`confidence:P`, goodput): the simulator shows the policy's
  `keep_drafting` the recorded draft_confidence of each covered position in turn; a row drafts (and
  can accept) only the positions before its first refusal. The recorded confidence is the draft's
  on the emitted prefix, which is the draft's own prefix up to its first rejected draft; past it
  the draft's real confidences differ, but those drafts are never accepted.

Why this is exact in distribution: given the emitted sequence, the event "position t was an
accepted draft" has probability min(target(x), draft(x)) / target(x) and depends only on that position's own
draws given its prefix, so the events are independent across positions; a k schedule only decides
which of them are looked at. (Greedy traces hold 0/1 values: replay is deterministic.)

Approximations: a request is replayed along its recorded output, so a request that stopped at an
end-of-sequence token has remaining = tokens left in the trace (the engine, not knowing the stop is
coming, may draft past it; that costs it at most the extra draft width). For the n-gram drafter the
trace holds per-position one-token lookups; a multi-token n-gram continuation is approximated by
those per-position lookups.
"""

from __future__ import annotations

import numpy as np

__all__ = ["uniforms", "realise", "leading_runs", "step", "expected_emitted_iid"]


def uniforms(seed: int, index: int, n: int) -> np.ndarray:
    """The per-position uniforms of simulated request `index`."""
    return np.random.default_rng([int(seed), int(index)]).random(n)


def realise(accept_prob: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Bool per position: would a draft covering it be accepted."""
    return u < accept_prob


def leading_runs(accepted: np.ndarray) -> np.ndarray:
    """run[t] = number of consecutive accepted positions starting at t (0 when t is rejected)."""
    n = len(accepted)
    index = np.arange(n)
    blocked = np.where(accepted, n, index)
    next_rejected = np.minimum.accumulate(blocked[::-1])[::-1]
    return (next_rejected - index).astype(np.int64)


def step(run: np.ndarray, t: int, k: int, n: int) -> tuple[int, int, int]:
    """One request's step at position t with k drafts: (drafted, accepted, emitted)."""
    accepted = min(k, int(run[t]))
    return k, accepted, min(accepted + 1, n - t)


def expected_emitted_iid(alpha: float, k: int) -> float:
    """Expected tokens per step at k drafts when every position is accepted with probability alpha:
    1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)."""
    if alpha >= 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)
