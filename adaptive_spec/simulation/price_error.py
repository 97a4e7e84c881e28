"""What a controller's cost model gets wrong about the host it runs on, for the simulator.

Hosts whose true costs differ from what the controller was given:

* `scaled_profile(profile, draft=1.3, verify_per_token=0.8)`: a profile document with the draft's
  times (draft grid and draft-side overhead) scaled by `draft`, and each verify's cost above its
  one-token verify scaled by `verify_per_token`:

      T'(b, c, q) = T(b, c, 1) + verify_per_token * (T(b, c, q) - T(b, c, 1)),

  measured per (batch, context) where the grid has q = 1 (the verify-side overhead's per-token
  slope likewise). A whole-step profile (vLLM's, no draft grid) holds the draft inside T: there
  the increment above T(b, c, 1) is scaled by draft * verify_per_token.
* `ClockChange(step, profile)`: the simulator's clock switches to another profile's costs after
  `step` steps (a machine that got slower mid-trace).

`PriceLog` records, after every step, the controller's relative price error of K = 1..k_max
against K = 0 at the step's batch size and context:

    error(K) = [pred(K) / pred(0)] / [true(K) / true(0)] - 1,

where pred is the policy's cost model and true the simulator's clock (uniform steps), and reports
the largest |error| over K per step, with summaries after a warm-up.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

__all__ = ["scaled_profile", "ClockChange", "PriceLog", "parse_scaling"]


def scaled_profile(profile: Mapping[str, Any], draft: float = 1.0, verify_per_token: float = 1.0) -> dict:
    """A copy of `profile` (a document) with scaled draft and per-token verify costs (see above)."""
    if not (draft > 0 and verify_per_token > 0):
        raise ValueError(f"scales must be > 0, got draft={draft}, verify_per_token={verify_per_token}")
    out = copy.deepcopy(dict(profile))
    increment = verify_per_token if out.get("draft") else draft * verify_per_token  # whole steps hold the draft
    for row in out.get("draft") or ():
        row["median"] = float(row["median"]) * draft
    single = {(int(r["batch"]), int(r["context"])): float(r["median"])
              for r in out.get("target") or () if int(r["query_tokens"]) == 1}
    for row in out.get("target") or ():
        one = single.get((int(row["batch"]), int(row["context"])))
        if one is not None and int(row["query_tokens"]) > 1:
            row["median"] = one + increment * (float(row["median"]) - one)
    by_batch_k0 = {int(r["batch"]): float(r["verify_extra"]) for r in out.get("overhead") or () if int(r["k"]) == 0}
    for row in out.get("overhead") or ():
        row["draft_extra"] = float(row["draft_extra"]) * draft
        base = by_batch_k0.get(int(row["batch"]))
        if base is not None and int(row["k"]) > 0:
            row["verify_extra"] = base + increment * (float(row["verify_extra"]) - base)
    if draft != 1.0 or verify_per_token != 1.0:
        out["name"] = f"{out.get('name', 'profile')}*draft{draft:g}*verify-token{verify_per_token:g}"
    return out


def parse_scaling(text: str) -> dict[str, float]:
    """'draft=1.3,verify-token=0.8' -> {'draft': 1.3, 'verify_per_token': 0.8}."""
    names = {"draft": "draft", "verify-token": "verify_per_token"}
    out = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, _, value = part.partition("=")
        if key.strip() not in names:
            raise ValueError(f"a scaling is draft=X or verify-token=X, comma-separated; got {part!r}")
        out[names[key.strip()]] = float(value)
    return out


@dataclass(frozen=True)
class ClockChange:
    step: int  # the clock runs on `profile` from the step after this many
    profile: Mapping[str, Any]


class PriceLog:
    """Per step: max over K = 1..k_max of |relative price error against K = 0| (see the docstring)."""

    def __init__(self, policy_costs: Any, k_max: int = 6):
        self.costs, self.k_max = policy_costs, int(k_max)
        self.errors: list[float] = []
        self.tokens: list[int] = []  # per step: tokens emitted and seconds, for goodput over a span
        self.seconds: list[float] = []

    def record(self, clock_model: Any, batch: int, context: int, emitted: int = 0, seconds: float = 0.0) -> None:
        self.tokens.append(int(emitted))
        self.seconds.append(float(seconds))
        pred = self.costs.step_seconds_table(batch, context, self.k_max)
        true = [clock_model.step_seconds(batch, context, k) for k in range(self.k_max + 1)]
        if pred[0] <= 0 or true[0] <= 0:
            return
        ratios = (np.asarray(pred) / pred[0]) / (np.asarray(true) / true[0]) - 1.0
        self.errors.append(float(np.abs(ratios[1:]).max()))

    def report(self, warm_up: int = 300, change_at: int | None = None, every: int = 100) -> dict:
        errors = np.asarray(self.errors)
        out: dict[str, Any] = {"k_max": self.k_max, "steps": int(errors.size),
                               "max_rel_error_by_step": {str(i): round(float(errors[i]), 4)
                                                         for i in range(0, errors.size, every)}}
        after = errors[warm_up:change_at] if change_at is not None else errors[warm_up:]
        if after.size:
            out[f"after_{warm_up}"] = {"mean": round(float(after.mean()), 4), "p90": round(float(np.quantile(after, 0.9)), 4),
                                       "max": round(float(after.max()), 4)}
        if change_at is not None and errors.size > change_at:
            later = errors[change_at:]
            over = np.flatnonzero(later > 0.03)
            out["change_at"] = change_at
            # steps after the change until the error stays within 3% (None: it never did)
            out["steps_to_3pct"] = 0 if over.size == 0 else (int(over[-1]) + 1 if over[-1] + 1 < later.size else None)
            tail = later[warm_up:]
            if tail.size:
                out[f"after_change_{warm_up}"] = {"mean": round(float(tail.mean()), 4), "max": round(float(tail.max()), 4)}
            seconds = sum(self.seconds[change_at + warm_up:])
            # goodput from `warm_up` steps after the change on, to compare with an informed run's
            out[f"tokens_per_s_from_change_{warm_up}"] = round(sum(self.tokens[change_at + warm_up:]) / seconds, 4) if seconds else None
        return out
