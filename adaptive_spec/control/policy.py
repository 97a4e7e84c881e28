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
from typing import Protocol, Sequence, runtime_checkable


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


@runtime_checkable
class Policy(Protocol):
    name: str

    def choose(self, requests: Sequence[RequestView]) -> Sequence[int]: ...

    def observe(self, record: StepRecord) -> None: ...


class PolicyBase:
    """Defaults for the optional parts of the protocol; our policies derive from it.

    min_draft_confidence: when > 0, the engine stops a row's draft at the first position where the
    draft model's top probability (softmax of its raw logits) is below it. A rule that looks at the
    draft only, so exactness is untouched. Policies not derived from this class get 0.
    """

    min_draft_confidence: float = 0.0

    def observe(self, record: StepRecord) -> None:
        pass


class PolicyError(RuntimeError):
    """A policy raised or returned something unusable; hosts then run the step without speculation."""


def draft_confidence_floor(policy: Policy) -> float:
    return float(policy.min_draft_confidence) if isinstance(policy, PolicyBase) else 0.0


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
