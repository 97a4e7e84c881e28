"""Request state and the result types the engine hands back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

import torch

from ..control.policy import AcceptanceHistory, mean_acceptance_length
from ..sampling.params import SamplingParams


@dataclass(frozen=True)
class RequestStats:
    """Speculation statistics of one request. The first token comes from prefill and is not a step.

    mean_acceptance_length counts the recovered/bonus token: tokens emitted per speculative step.
    """

    drafted: int
    accepted: int
    steps: int
    k_per_step: tuple[int, ...]
    accepted_per_step: tuple[int, ...]
    # Constraint masks (a grammar's): how many the steps computed, drafted positions included, and
    # the seconds they took (the constraint's own work: moving its state, building the mask).
    masks: int = 0
    mask_seconds: float = 0.0
    # Tokens taken by jump-forward (the grammar allowed only them), emitted without a draft slot.
    forced: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return mean_acceptance_length(self.accepted, self.steps) or 0.0


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids, prompt excluded
    finish_reason: str  # "length" | "stop" | "error" | "aborted"
    error: str | None
    stats: RequestStats


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    error: str | None = None
    result: GenerationResult | None = None  # the whole request, once finished


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    tokens: list[int]  # prompt + generated
    policy_key: str = ""  # what policies know the request by: unique for the engine's life, even if ids are reused
    constraint_state: Hashable | None = None
    seen: torch.Tensor | None = None  # [vocab] bool, only with a repetition penalty
    allowed: torch.Tensor | None = None  # [vocab] bool from allowed_token_ids, or None
    history: AcceptanceHistory = field(default_factory=AcceptanceHistory)
    masks: int = 0  # constraint masks computed for it, and their seconds (see RequestStats)
    mask_seconds: float = 0.0
    forced: int = 0  # tokens emitted by jump-forward (see RequestStats)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.generated)

    def fail(self, message: str) -> None:
        self.finish_reason, self.error = "error", message

    def result(self) -> GenerationResult:
        h = self.history
        stats = RequestStats(h.drafted, h.accepted, h.steps, tuple(h.k_per_step), tuple(h.accepted_per_step),
                             self.masks, self.mask_seconds, self.forced)
        return GenerationResult(self.request_id, list(self.prompt), self.generated, self.finish_reason or "aborted",
                                self.error, stats)
