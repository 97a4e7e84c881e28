"""What a policy reads of a cost model: one declared protocol instead of probing for attributes.

`CostModel` (and `online_cost.SharedCostModel`) implement all of it. A cost model of your own
subclasses `StepCostBase`, which gives every member but `step_seconds_table` its neutral meaning
(no draft timed apart, a step costs its longest draft whoever drafts, no catch-up, no uncertainty),
so the policy then prices every step by the table alone.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .policy import StepRecord

__all__ = ["StepCost", "StepCostBase", "check_step_cost"]


@runtime_checkable
class StepCost(Protocol):
    has_draft: bool  # False: a whole-step profile (vLLM) that times no draft forward apart

    def step_seconds_table(self, batch: int, context: float, k_max: int) -> list[float]:
        """Seconds of a uniform step at K = 0..k_max (batch rows, the batch's longest context)."""

    def draft_seconds(self, batch: int, context: float, k: int) -> float:
        """The draft loop's seconds for k positions (what a dropped draft's forward still costs)."""

    def drafting_share(self, batch: int, k: int, rows: float) -> float:
        """The share of the (batch, K) drafting increment paid when `rows` rows draft (1: all of it)."""

    def catch_up_seconds(self, tokens: int) -> float:
        """Seconds for a lazy draft to run over `tokens` context tokens it missed."""

    def price_spread(self, batch: int, k_max: int) -> list[float]:
        """One standard deviation of each K's price above K = 0's (0 where none is kept)."""

    def untimed_misfit(self, batch: int, k_max: int) -> list[float]:
        """Per K = 0..k_max, how far (relative) the price of a length no recent step timed may be off
        however sure the parameters are (a shape's misfit); 0 for lengths timed lately."""

    def observe(self, record: StepRecord) -> None:
        """Learn from one timed step."""


class StepCostBase:
    """The neutral defaults of `StepCost`; subclasses define `step_seconds_table`."""

    has_draft = True

    def step_seconds_table(self, batch: int, context: float, k_max: int) -> list[float]:
        raise NotImplementedError

    def draft_seconds(self, batch: int, context: float, k: int) -> float:
        return 0.0

    def drafting_share(self, batch: int, k: int, rows: float) -> float:
        return 1.0

    def catch_up_seconds(self, tokens: int) -> float:
        return 0.0

    def price_spread(self, batch: int, k_max: int) -> list[float]:
        return [0.0] * (int(k_max) + 1)

    def untimed_misfit(self, batch: int, k_max: int) -> list[float]:
        return [0.0] * (int(k_max) + 1)

    def observe(self, record: StepRecord) -> None:
        pass


def check_step_cost(cost_model: object) -> None:
    """TypeError naming what `cost_model` lacks of `StepCost`."""
    if not isinstance(cost_model, StepCost):
        members = ("has_draft", "step_seconds_table", "draft_seconds", "drafting_share", "catch_up_seconds",
                   "price_spread", "untimed_misfit", "observe")
        missing = [name for name in members if not hasattr(cost_model, name)]
        raise TypeError(f"a cost model must implement control.step_cost.StepCost (subclass StepCostBase for the "
                        f"defaults); {type(cost_model).__name__} lacks {', '.join(missing)}")
