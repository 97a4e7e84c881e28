"""The speculation-length policy protocol and the fixed-k policies.

Layer 2: plain Python, no torch, so policies are cheap and testable with numbers alone.

Policies by name live in `registry.py`; this module holds the protocol and the fixed-k policy.

Each engine step the policy is shown one `RequestView` per running request and returns how many
tokens each should draft (0 = verify only its last token, i.e. no speculation). After the step it is
told what happened (`StepRecord`). Every host (our engine, the simulator, the vLLM plug-in) asks
through `choose_ks`, which validates the answer and clamps it to what each request can still use
(`RequestView.max_k`), so a policy never needs to know about budgets or context limits.

Words: a request's *cap* (`RequestView.max_k`) bounds its k; the batch's *draft length*
(`StepRecord.batch_k`) is the longest k any row drafted in a step.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence, runtime_checkable


@dataclass
class AcceptanceHistory:
    """What one request's speculative steps did so far (prefill excluded)."""

    k_per_step: list[int] = field(default_factory=list)  # drafts verified per step
    accepted_per_step: list[int] = field(default_factory=list)

    def record(self, k: int, accepted: int) -> None:
        self.k_per_step.append(k)
        self.accepted_per_step.append(accepted)

    @property
    def steps(self) -> int:
        return len(self.k_per_step)

    @property
    def drafted(self) -> int:
        return sum(self.k_per_step)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_step)

    @property
    def mean_acceptance_length(self) -> float:
        return mean_acceptance_length(self.accepted, self.steps) or 0.0


def mean_acceptance_length(accepted: int, steps: int) -> float | None:
    """Tokens emitted per speculative step, the recovered/bonus token included (vLLM's convention):
    (accepted drafts + one token per step) / steps. None when there were no steps."""
    return (accepted + steps) / steps if steps else None


@dataclass(frozen=True)
class RequestView:
    """What a policy may know about one running request when choosing its k."""

    request_id: str
    context_length: int  # prompt + generated tokens
    remaining_tokens: int  # tokens it may still emit
    max_k: int  # this request's cap: hosts clamp k to it
    history: AcceptanceHistory
    # Context tokens the draft model has not seen yet: a host whose draft skips rows at k = 0
    # (vLLM's lazy draft) runs it over them before the row's next step that drafts. Such a host
    # drafts for the rows given k > 0 alone.
    draft_behind: int = 0
    # Requests whose drafts are accepted alike share an acceptance prior: "" for free text,
    # "constrained" for a grammar's or a constraint's (its forced tokens are accepted for sure).
    group: str = ""


@dataclass(frozen=True)
class RequestOutcome:
    request_id: str
    k: int  # drafts verified
    accepted: int  # drafts accepted
    emitted: int  # tokens emitted this step (accepted + recovered/bonus, cut at a stop or budget)


@dataclass(frozen=True)
class StepRecord:
    """One engine step as the policy (and a cost model) sees it afterwards."""

    batch_size: int
    batch_k: int  # the batch's draft length K = max k_i (the draft loop ran K positions)
    context_lengths: tuple[int, ...]
    outcomes: tuple[RequestOutcome, ...]
    draft_seconds: float
    verify_seconds: float
    total_seconds: float
    # The draft loop's forwards: positions it evaluated (a row stopped inside the step still cost
    # the forward that showed its confidence) and the most context tokens a row fed before
    # drafting (1-2 normally; more after steps without speculation). 0 = not reported (then the
    # loop is taken to be batch_k positions after a usual catch-up).
    draft_positions: int = 0
    draft_catchup_tokens: int = 0
    # `choose` calls the host made after the one whose drafts this step verified: 0 where a host
    # verifies each choice before it chooses again (our engine, the simulator); 1 in vLLM, which
    # chooses the next step's draft lengths before it reports what this step verified; -1: the
    # verified drafts came from no `choose` call (nothing to match them with).
    lag: int = 0
    # What each row drafts in this step for the next one to verify, where that differs from what it
    # verified (vLLM: the step verifies the previous choice and drafts the next); empty = each row's
    # verified drafts (`outcomes[i].drafted`), as in a host that verifies its own step's drafts.
    drafting: tuple[int, ...] = ()
    # Of total_seconds, what the rows' constraint masks (grammars) took, drafted positions included.
    mask_seconds: float = 0.0
    # Tokens a grammar forced ahead of the drafts (jump-forward, summed over rows), verified in this
    # step's target forward beside them: the forward was wider than batch_k + 1, which no profiled
    # cell prices, so cost models learn the draft part of such a step only (`timed_step`).
    forced_tokens: int = 0


@runtime_checkable
class Policy(Protocol):
    name: str

    def choose(self, requests: Sequence[RequestView]) -> Sequence[int]: ...

    def observe(self, record: StepRecord) -> None: ...


class PolicyBase:
    """Defaults for the optional parts of the protocol; our policies derive from it.

    Stopping inside the step: the k a policy chooses is each row's most. While the draft runs,
    hosts that can (our engine, the simulator, the vLLM plug-in with a draft model) call
    `keep_drafting(position, confidences)` at each draft position with every drafting row's
    confidence there (the draft model's top probability, softmax of its raw logits), after the
    forward that produced it and before the next one. The answer per row: True keeps the draft and
    drafts on, KEEP_LAST keeps it and stops there (no further forward for that row), False drops it
    and stops. A rule that looks at the draft only, so exactness is untouched. The default rule
    keeps a draft while its confidence is at least `min_draft_confidence` (0: always). Policies not
    derived from this class draft exactly their k.
    """

    min_draft_confidence: float = 0.0
    # Set True by a host that calls keep_drafting while drafting (our engine and the simulator do),
    # so a policy may ask for more drafts than it expects to keep.
    host_stops_drafts: bool = False

    def keep_drafting(self, position: int, confidences: Sequence[float | None]) -> list[bool | int]:
        """confidences[i]: row i's confidence at draft `position` (0-based), None where row i is
        not drafting there (its k is reached or it stopped). Answers: True, KEEP_LAST or False."""
        floor = self.min_draft_confidence
        return [c is not None and c >= floor for c in confidences]

    def observe(self, record: StepRecord) -> None:
        pass


class PolicyError(RuntimeError):
    """A policy raised or returned something unusable; hosts then run the step without speculation."""


KEEP_LAST = 2  # keep_drafting's answer for "keep this draft, draft no further" (True drafts on)
StopRule = Callable[[int, Sequence[float | None]], Sequence[bool | int]]


def draft_stop_rule(policy: Policy) -> StopRule | None:
    """The policy's in-step stopping rule, or None when it has none (it drafts exactly its k)."""
    if not isinstance(policy, PolicyBase):
        return None
    if type(policy).keep_drafting is PolicyBase.keep_drafting and policy.min_draft_confidence <= 0:
        return None
    return policy.keep_drafting


def adopt_stop_rule(policy: Policy) -> StopRule | None:
    """For a host that stops drafts inside the step: tell the policy so, return its rule (or None)."""
    if isinstance(policy, PolicyBase):
        policy.host_stops_drafts = True
    return draft_stop_rule(policy)


def ask_stop_rule(rule: StopRule, position: int, confidences: Sequence[float | None]) -> list[int]:
    """Call a stop rule and check its answer: one of False (0), True (1) or KEEP_LAST (2) per row,
    0 wherever the row was not shown. Raises PolicyError like `choose_ks`."""
    try:
        answer = list(rule(position, confidences))
    except Exception as error:
        raise PolicyError(f"policy raised {type(error).__name__} in keep_drafting: {error}") from error
    if len(answer) != len(confidences):
        raise PolicyError(f"keep_drafting returned {len(answer)} answers for {len(confidences)} rows")
    if any(a not in (False, True, KEEP_LAST) for a in answer):
        raise PolicyError(f"keep_drafting must answer True, False or KEEP_LAST per row, got {answer[:8]}")
    return [int(a) if c is not None else 0 for a, c in zip(answer, confidences)]


def run_stop_rule(rule: StopRule, ks: Sequence[int],
                  confidence: Callable[[int, int], float | None]) -> tuple[list[int], int]:
    """A draft loop without a model, for hosts that replay or imitate drafting: asks `rule` at each
    position, showing row i the value `confidence(i, position)` while it still drafts (None ends
    that row: no draft there). Returns (drafts kept per row, positions the loop ran)."""
    kept, drafting, positions = [0] * len(ks), [k > 0 for k in ks], 0
    for position in range(max(ks, default=0)):
        shown = [confidence(row, position) if drafting[row] and position < k else None for row, k in enumerate(ks)]
        drafting = [c is not None for c in shown]
        if not any(drafting):
            break
        positions += 1
        for row, answer in enumerate(ask_stop_rule(rule, position, shown)):
            kept[row] += answer > 0
            drafting[row] = answer == 1  # KEEP_LAST keeps this draft and stops
    return kept, positions


def choose_ks(policy: Policy, views: Sequence[RequestView]) -> list[int]:
    """Ask the policy for each request's k, validate, and clamp to [0, view.max_k].

    The one place every host asks a policy, so a simulated step cannot drift from a real one.
    Raises PolicyError (with the policy's own exception as cause) for an exception, a wrong number
    of choices, or a choice that is not an integer.
    """
    if not views:
        return []
    name = policy.name
    try:
        chosen = list(policy.choose(views))
    except Exception as error:
        raise PolicyError(f"policy {name!r} raised {type(error).__name__}: {error}") from error
    if len(chosen) != len(views):
        raise PolicyError(f"policy {name!r} returned {len(chosen)} choices for {len(views)} requests")
    ks = []
    for k, view in zip(chosen, views):
        if isinstance(k, bool) or not isinstance(k, numbers.Integral):
            raise PolicyError(f"policy {name!r} returned {k!r} for request {view.request_id}; k must be an integer")
        ks.append(max(0, min(int(k), view.max_k)))
    return ks


@dataclass
class StaticPolicy(PolicyBase):
    """The same k for every request at every step. k = 0 is plain decoding through the engine."""

    k: int

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or self.k < 0:
            raise ValueError(f"static policy needs an integer k >= 0, got {self.k!r}")

    @property
    def name(self) -> str:
        return "off" if self.k == 0 else f"static:{self.k}"

    def choose(self, requests: Sequence[RequestView]) -> list[int]:
        return [self.k] * len(requests)
