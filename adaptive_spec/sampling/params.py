"""Sampling parameters and the constraint protocol.

This module owns *what* a request asks for; how it turns logits into a distribution lives in
`transforms.py`. Everything here is validated at construction, so an impossible setting is a
`ValueError` naming the field before any model runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Hashable, Protocol, Sequence, runtime_checkable


# Temperatures and repetition penalties divide logits in float32; outside this range the result
# overflows or underflows for ordinary logits, so such values are refused rather than sampled as NaN.
COMPUTABLE = (1e-30, 1e30)


@runtime_checkable
class Constraint(Protocol):
    """A prefix-dependent token constraint (a grammar, a regex automaton, a JSON schema ...).

    The engine never mutates a constraint. It threads an immutable *state* through it:
    `advance` returns a new state, so drafted positions can be checked hypothetically while the
    request's committed state moves only on emitted tokens.
    """

    def initial_state(self) -> Hashable: ...

    def allowed_tokens(self, state: Hashable) -> Collection[int]:
        """Token ids allowed next. An empty collection means the request cannot continue."""
        ...

    def advance(self, state: Hashable, token_id: int) -> Hashable: ...


class PrefixConstraint:
    """Adapts a plain function `allowed(generated_ids) -> token ids` to the `Constraint` protocol.

    The state is the tuple of generated ids, so the function sees exactly the tokens emitted so
    far (prompt excluded) plus, at a drafted position, the drafts before it.
    """

    def __init__(self, allowed: Callable[[tuple[int, ...]], Collection[int]]):
        self._allowed = allowed

    def initial_state(self) -> tuple[int, ...]:
        return ()

    def allowed_tokens(self, state: tuple[int, ...]) -> Collection[int]:
        return self._allowed(state)

    def advance(self, state: tuple[int, ...], token_id: int) -> tuple[int, ...]:
        return state + (token_id,)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Transforms apply in this order (see `transforms.process_logits`):
    repetition penalty -> allowed-token set and constraint masks -> temperature -> top-k -> top-p
    -> min-p. `temperature == 0` is greedy: the processed distribution is one-hot on the argmax of
    the penalised, masked logits.

    top_k = 0, top_p = 1, min_p = 0 and repetition_penalty = 1 switch that transform off; a top_k
    at least the vocabulary size keeps every token. temperature (when not 0) and
    repetition_penalty must lie in `COMPUTABLE`.
    seed = None draws the request's seed from the engine's own generator.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 64
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    allowed_token_ids: frozenset[int] | None = None
    constraint: Constraint | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"SamplingParams: {message}")

        need(_finite(self.temperature) and (self.temperature == 0 or COMPUTABLE[0] <= self.temperature <= COMPUTABLE[1]),
             f"temperature must be 0 (greedy) or in [{COMPUTABLE[0]:g}, {COMPUTABLE[1]:g}], got {self.temperature!r}")
        need(_integer(self.top_k) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        need(_finite(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        need(_finite(self.min_p) and 0 <= self.min_p < 1, f"min_p must be in [0, 1), got {self.min_p!r}")
        need(_finite(self.repetition_penalty) and COMPUTABLE[0] <= self.repetition_penalty <= COMPUTABLE[1],
             f"repetition_penalty must be in [{COMPUTABLE[0]:g}, {COMPUTABLE[1]:g}], got {self.repetition_penalty!r}")
        need(_integer(self.max_new_tokens) and self.max_new_tokens >= 1,
             f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        need(self.seed is None or _integer(self.seed), f"seed must be an integer or None, got {self.seed!r}")
        # Normalise collections so the object stays hashable and immutable.
        object.__setattr__(self, "stop_token_ids", _token_tuple(self.stop_token_ids, "stop_token_ids"))
        if self.allowed_token_ids is not None:
            allowed = frozenset(_token_tuple(self.allowed_token_ids, "allowed_token_ids"))
            need(len(allowed) > 0, "allowed_token_ids is empty: no token could ever be generated")
            object.__setattr__(self, "allowed_token_ids", allowed)
        need(self.constraint is None or isinstance(self.constraint, Constraint),
             "constraint must implement initial_state / allowed_tokens / advance")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if a token id named by these params lies outside the vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("allowed_token_ids", self.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} holds ids outside the vocabulary of {vocab_size}: {sorted(bad)[:5]}")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_tuple(ids: Sequence[int] | Collection[int], name: str) -> tuple[int, ...]:
    if isinstance(ids, int):
        ids = (ids,)
    out = tuple(ids)
    for token in out:
        if not _integer(token) or token < 0:
            raise ValueError(f"SamplingParams: {name} must hold non-negative integer token ids, got {token!r}")
    return out
