"""Peer engines' speculation-length rules behind our `Policy` protocol, for like-for-like comparison.

- `HFHeuristicPolicy` ("heuristic"): Hugging Face assisted generation's heuristic schedule, per request
  (named so that `bench` can keep "hf-heuristic" for Hugging Face's own implementation):
  start at `start`; after a step, +2 if every draft was accepted, else -1; never below `floor`.
  With floor 0 a request at k = 0 drafts one token every `probe_interval` steps, so k = 0 is
  never absorbing (a full accept there climbs back by the same +2 rule).
- `ConfidencePolicy` ("confidence:P"): draft up to `max_k`, but stop a row's draft at the first
  position where the draft model's top probability (softmax of its raw logits) is below P
  (llama.cpp's p_min, DISCO-like). Exact: the stopping rule looks only at the draft.
- `EmaTiersPolicy`: an EMA of the batch's mean accepted length (SGLang-style adaptive mode) picks
  the smallest tier t with t >= ema + 1 (the next tier up from what is being accepted), largest tier
  if none; EMA weight `alpha` per step.
- `BatchTablePolicy`: k read from a batch-size table (vLLM / TensorRT-LLM schedules): the entry of
  the largest listed batch size <= the current one; 0 above `off_above`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .policy import PolicyBase, RequestView, StepRecord


@dataclass
class HFHeuristicPolicy(PolicyBase):
    start: int = 5
    floor: int = 1
    probe_interval: int = 8
    name: str = "heuristic"

    def __post_init__(self) -> None:
        if not 0 <= self.floor <= self.start:
            raise ValueError(f"heuristic needs 0 <= floor <= start, got floor={self.floor}, start={self.start}")
        if self.probe_interval < 1:
            raise ValueError(f"heuristic needs probe_interval >= 1, got {self.probe_interval}")
        self._k: dict[str, int] = {}
        self._steps_off: dict[str, int] = {}

    def choose(self, requests: Sequence[RequestView]) -> list[int]:
        self._k = {r.request_id: self._k.get(r.request_id, self.start) for r in requests}
        self._steps_off = {r.request_id: self._steps_off.get(r.request_id, 0) for r in requests}
        return [self._k[r.request_id] or int(self._steps_off[r.request_id] >= self.probe_interval) for r in requests]

    def observe(self, record: StepRecord) -> None:
        for outcome in record.outcomes:
            rid = outcome.request_id
            if rid not in self._k:
                continue
            if outcome.k:
                grow = outcome.accepted == outcome.k
                self._k[rid] = max(self.floor, self._k[rid] + (2 if grow else -1))
                self._steps_off[rid] = 0
            elif self._k[rid] == 0:
                self._steps_off[rid] += 1


@dataclass
class ConfidencePolicy(PolicyBase):
    min_draft_confidence: float = 0.4
    max_k: int = 8

    def __post_init__(self) -> None:
        if not 0 <= self.min_draft_confidence < 1 or self.max_k < 1:
            raise ValueError("confidence policy needs 0 <= P < 1 and max_k >= 1")

    @property
    def name(self) -> str:
        return f"confidence:{self.min_draft_confidence:g}"

    def choose(self, requests: Sequence[RequestView]) -> list[int]:
        return [self.max_k] * len(requests)


@dataclass
class EmaTiersPolicy(PolicyBase):
    tiers: tuple[int, ...] = (1, 3, 7)
    alpha: float = 0.2
    initial_accepted: float = 1.0
    name: str = "ema-tiers"

    def __post_init__(self) -> None:
        self.tiers = tuple(sorted(int(t) for t in self.tiers))
        if not self.tiers or self.tiers[0] < 0 or not 0 < self.alpha <= 1:
            raise ValueError("ema-tiers needs non-negative tiers and 0 < alpha <= 1")
        self.ema = self.initial_accepted

    def choose(self, requests: Sequence[RequestView]) -> list[int]:
        k = next((t for t in self.tiers if t >= self.ema + 1), self.tiers[-1])
        return [k] * len(requests)

    def observe(self, record: StepRecord) -> None:
        drafted = [o for o in record.outcomes if o.k]
        if drafted:
            mean = sum(o.accepted for o in drafted) / len(drafted)
            self.ema = (1 - self.alpha) * self.ema + self.alpha * mean


@dataclass
class BatchTablePolicy(PolicyBase):
    table: dict[int, int] = field(default_factory=lambda: {1: 4, 2: 3, 4: 2, 8: 1})
    off_above: int = 8
    name: str = "batch-table"

    def __post_init__(self) -> None:
        self.table = {int(b): int(k) for b, k in self.table.items()}
        if not self.table or min(self.table) < 1 or min(self.table.values()) < 0:
            raise ValueError("batch-table needs batch sizes >= 1 and k >= 0")

    def choose(self, requests: Sequence[RequestView]) -> list[int]:
        batch = len(requests)
        if batch > self.off_above:
            return [0] * batch
        listed = [b for b in self.table if b <= batch]
        k = self.table[max(listed)] if listed else self.table[min(self.table)]
        return [k] * batch
