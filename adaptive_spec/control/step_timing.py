"""What a step costs when its host measures only the whole step.

Our engine times its draft and verify phases apart; vLLM's scheduler sees only whole steps (the
drafter runs inside the model runner's forward call). For such a host the step's total is split
into draft / verify / rest in the proportions the cost model predicts for that step, so the cost
model's online correction moves every part by the same measured ratio and its prediction for the
whole step converges to what was measured. Without a cost model the total is reported as verify
time (nothing reads the split then).
"""

from __future__ import annotations

from typing import Sequence

from .cost_model import CostModel
from .policy import RequestOutcome, StepRecord


def whole_step_record(cost_model: CostModel | None, *, batch_size: int, batch_k: int,
                      context_lengths: Sequence[int], outcomes: Sequence[RequestOutcome],
                      total_seconds: float, lag: int = 0) -> StepRecord:
    """A `StepRecord` for a step measured as one wall time (0 = untimed: a cost model learns nothing);
    `lag` as in `StepRecord`."""
    draft = verify = 0.0
    if total_seconds > 0 and cost_model is not None and context_lengths:
        context = max(context_lengths)
        parts = (cost_model.draft_seconds(batch_size, context, batch_k) if batch_k else 0.0,
                 cost_model.target_seconds(batch_size, context, batch_k + 1),
                 cost_model.overhead_seconds(batch_size, batch_k))
        scale = total_seconds / max(sum(parts), 1e-12)
        draft, verify = parts[0] * scale, parts[1] * scale
    elif total_seconds > 0:
        verify = total_seconds
    return StepRecord(batch_size=batch_size, batch_k=batch_k, context_lengths=tuple(context_lengths),
                      outcomes=tuple(outcomes), draft_seconds=draft, verify_seconds=verify,
                      total_seconds=total_seconds, lag=lag)
