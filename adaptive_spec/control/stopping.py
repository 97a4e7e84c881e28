"""When to stop one row's draft: the value of drafting on, counting the option to stop later.

Layer 2: numpy only, no models.

After the forward that produced draft j, a row may drop it (verify j drafts), keep it and stop
(verify j + 1), or keep it and draft on, deciding again at j + 1 once that draft's confidence is
seen. Scoring "draft on" as if the step then ran to a fixed length undervalues it: the next draft
may come back unsure and the row would stop there, so its cost is only paid in full when it pays.
Backward induction over the row's remaining positions gives the real value.

Values are long-run: expected tokens minus `rate` (tokens per second the stream earns) times the
step's seconds. With s the probability that every draft kept so far (draft j included) is accepted,

    W_j(s) = max(-rate * drop_cost[j],  s - rate * keep_cost[j],  s + C_j(s))
    C_j(s) = mean over q of W_{j+1}(s * q)

where q ranges over a sample of calibrated acceptance probabilities the row's next draft may show.
W is convex and piecewise linear in s; it is kept on a grid of s and interpolated.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

GRID = np.linspace(0.0, 1.0, 33)


def continuation_values(drop_cost: Sequence[float], keep_cost: Sequence[float],
                        next_acceptance: Sequence[Sequence[float]], rate: float) -> list[np.ndarray | None]:
    """C_j on GRID for each position j of a row that may make len(drop_cost) drafts (None at the
    last position, where drafting on is not allowed).

    drop_cost[j]: the step's seconds if draft j is dropped (forwards 0..j paid, j drafts verified);
    keep_cost[j]: if it is kept and the row stops (j + 1 verified);
    next_acceptance[j]: acceptance probabilities draft j may have (used for j >= 1).
    """
    positions = len(drop_cost)
    if len(keep_cost) != positions or len(next_acceptance) < positions:
        raise ValueError("need a drop cost, a keep cost and an acceptance sample per position")
    out: list[np.ndarray | None] = [None] * positions
    following: np.ndarray | None = None  # W_{j+1} on GRID
    for j in range(positions - 1, -1, -1):
        if following is not None:
            q = np.asarray(next_acceptance[j + 1], dtype=float)
            out[j] = np.interp(np.outer(GRID, q), GRID, following).mean(axis=1)
        best = np.maximum(GRID - rate * keep_cost[j], -rate * drop_cost[j])
        following = best if out[j] is None else np.maximum(best, GRID + out[j])
    return out


def decide(s: float, j: int, drop_cost: Sequence[float], keep_cost: Sequence[float],
           continuation: np.ndarray | None, rate: float) -> int:
    """0: drop draft j, 1: keep it and stop, 2: keep it and draft on."""
    options = [-rate * drop_cost[j], s - rate * keep_cost[j]]
    if continuation is not None:
        options.append(s + float(np.interp(s, GRID, continuation)))
    return max(range(len(options)), key=options.__getitem__)


__all__ = ["GRID", "continuation_values", "decide"]
