"""A start-up sweep of draft lengths on live traffic, so the cost model times every length at the live
context before the policy prices them (`--calibrate SECONDS`).

Layer 2: plain Python, no torch.

Why: a cost model started from no profile (or from another machine's) learns only the lengths its
policy chooses, and a policy that prices long drafts too high never chooses them. Through vLLM at
batch 1 (default pair, 2-core CPU) a controller started from no profile drafted 1.5 tokens a step
over its first quarter of 32 prompts against 2.4 for one started from a profile measured that hour,
and caught up only in the last quarter. Price probes (`GoodputPolicy._price_probe`) time one untimed
length at a time, and at batch 1 the in-step rule cuts a probe short where the untimed price says.

What: for its first `seconds` (whole sweeps, at least one) `PriceSweep` answers `choose` itself:
every row drafts K = 0, 1, ..., max_k in turn (max_k: the policy's up to `SWEEP_MAX_K`, 8, or the
first batch's cap if less), each held for `hold` steps (so a host that verifies a
step late, vLLM, has steps whose verified and drafted lengths agree), capped at what each row can
use, and the in-step rule keeps every draft. The draft length never changes what is emitted, only
how fast, so outputs keep their law; what the sweep costs is paid in the run's own figures. Every
step's record reaches the wrapped policy, which learns costs (its cost model) and acceptance from
it; one whose verified drafts the sweep chose arrives with lag -1 (no choice of the policy drafted
them), so the policy pairs no outcome with a choice it did not make. After the sweep the wrapper
passes everything through.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

from .policy import Policy, PolicyBase, RequestView, StepRecord, draft_stop_rule

__all__ = ["PriceSweep", "DEFAULT_HOLD", "with_sweep", "sweep_summary"]

DEFAULT_HOLD = 3  # steps per length: under vLLM's one-step lag the last hold - 1 verify what they draft
DEFAULT_MAX_K = 6  # for a policy that names no max_k
# The longest length a sweep times unless asked: goodput may draft 12, but each swept length costs
# three steps, and lengths past 8 are rare and share their neighbours' shape (the shared model's
# per-length deviations are correlated), so a sweep of 0..8 prices them too.
SWEEP_MAX_K = 8


class PriceSweep(PolicyBase):
    """`policy` with a start-up sweep of draft lengths 0..max_k (module docstring)."""

    def __init__(self, policy: Policy, seconds: float, *, max_k: int | None = None, hold: int = DEFAULT_HOLD,
                 clock: Callable[[], float] = time.perf_counter):
        if not seconds > 0:
            raise ValueError(f"--calibrate needs seconds > 0, got {seconds}")
        if hold < 1:
            raise ValueError(f"hold must be >= 1, got {hold}")
        if getattr(policy, "cost_model", None) is None:
            raise ValueError(f"--calibrate: policy {getattr(policy, 'name', policy)!r} reads no step costs; "
                             "there is nothing to calibrate")
        self._fit_to_host = max_k is None  # the first batch's cap may shorten the sweep
        config_k = getattr(getattr(policy, "config", None), "max_k", None)
        self.max_k = int(max_k if max_k is not None else
                         min(config_k, SWEEP_MAX_K) if config_k is not None else DEFAULT_MAX_K)
        if self.max_k < 1:
            raise ValueError(f"a sweep needs max_k >= 1, got {self.max_k}")
        self.policy, self.seconds, self.hold, self.clock = policy, float(seconds), int(hold), clock
        self.sweep_steps = 0  # steps the sweep chose
        self.sweep_seconds: float | None = None  # how long it ran, once it ended
        self._started: float | None = None
        self._calls = 0  # non-empty choose calls (the host's count, which `StepRecord.lag` is relative to)
        self._swept: set[int] = set()  # which of them the sweep answered

    # --- what hosts and reports read of the policy -------------------------------------------------
    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def schedule(self) -> list[int]:
        """One sweep's draft lengths, step by step: 0..max_k, each `hold` times."""
        return [k for k in range(self.max_k + 1) for _ in range(self.hold)]

    @property
    def sweeping(self) -> bool:
        return self.sweep_seconds is None

    @property
    def host_stops_drafts(self) -> bool:
        return bool(getattr(self.policy, "host_stops_drafts", False))

    @host_stops_drafts.setter
    def host_stops_drafts(self, value: bool) -> None:
        if isinstance(self.policy, PolicyBase):
            self.policy.host_stops_drafts = value

    def __getattr__(self, name: str) -> Any:  # cost_model, config, state, price_probes, ...
        if name == "policy":
            raise AttributeError(name)
        return getattr(self.policy, name)

    # --- the protocol --------------------------------------------------------------------------------
    def choose(self, requests: Sequence[RequestView]) -> list[int]:
        if not requests:
            return list(self.policy.choose(requests)) if not self.sweeping else []
        self._calls += 1
        steps_per_sweep = (self.max_k + 1) * self.hold
        if self.sweeping and self._started is not None and self.sweep_steps % steps_per_sweep == 0:
            elapsed = self.clock() - self._started
            if elapsed >= self.seconds:
                self.sweep_seconds = elapsed
        if not self.sweeping:
            return self.policy.choose(requests)
        if self._started is None:
            self._started = self.clock()
            longest = max(r.max_k for r in requests)  # the host's cap (vLLM's num_speculative_tokens)
            if self._fit_to_host and 1 <= longest < self.max_k:
                self.max_k = longest
        k = (self.sweep_steps // self.hold) % (self.max_k + 1)
        self.sweep_steps += 1
        self._swept.add(self._calls)
        return [min(k, max(r.max_k, 0)) for r in requests]

    def keep_drafting(self, position: int, confidences: Sequence[float | None]) -> list[bool | int]:
        rule = None if self.sweeping else draft_stop_rule(self.policy)
        if rule is None:  # the sweep (or a policy without a rule) keeps every draft up to its k
            return [c is not None for c in confidences]
        return rule(position, confidences)

    def observe(self, record: StepRecord) -> None:
        if record.lag >= 0 and (self._calls - record.lag) in self._swept:
            self._swept.discard(self._calls - record.lag)
            record = dataclasses.replace(record, lag=-1)  # drafts no choice of the policy made
        self.policy.observe(record)


def with_sweep(policy: Policy, seconds: float, *, only_cost_readers: bool = False) -> Policy:
    """`policy` behind a `PriceSweep` of `seconds` (0: `policy` itself). A policy that reads no step
    costs is a ValueError, or, with `only_cost_readers` (a bench lane beside others), left as it is."""
    if not seconds:
        return policy
    if only_cost_readers and getattr(policy, "cost_model", None) is None:
        return policy
    return PriceSweep(policy, seconds)


def sweep_summary(policy: Any) -> dict | None:
    """What a policy's start-up sweep did, for a command's summary (None without one): the steps it
    chose, the lengths it swept, and its seconds (None while it still runs)."""
    if not isinstance(policy, PriceSweep):
        return None
    seconds = round(policy.sweep_seconds, 2) if policy.sweep_seconds is not None else None
    return {"steps": policy.sweep_steps, "max_k": policy.max_k, "seconds": seconds}
