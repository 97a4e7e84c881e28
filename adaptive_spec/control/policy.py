"""The speculation-length policy protocol and the fixed-k policies.

Layer 2: plain Python, no torch, so policies are cheap and testable with numbers alone.

Policies by name live in `registry.py`; this module holds the protocol and the fixed-k policy.

Each engine step the policy is shown one `RequestView` per running request and returns how many
tokens each should draft (0 = verify only its last token, i.e. no speculation). After the step it is
told what happened (`StepRecord`). The engine clamps the choice to what the request can still use
(`RequestView.max_k`), so a policy never needs to know about budgets or context limits.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class RequestView:
    """What a policy may know about one running request when choosing its k."""

    request_id: str
    context_length: int  # prompt + generated tokens
    remaining_tokens: int  # tokens it may still emit
    max_k: int  # the engine will clamp k to this
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
    max_k: int  # the batch's draft-loop length K = max k_i
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

    # Optional: `min_draft_confidence: float`. When set, the engine stops a row's draft at the first
    # position where the draft model's top probability (softmax of its raw logits) is below it.


@dataclass
class StaticPolicy:
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

    def observe(self, record: StepRecord) -> None:
        pass
