"""What a step costs when its host measures only the whole step.

Our engine times its draft and verify phases apart; vLLM's scheduler sees only whole steps (the
drafter runs inside the model runner's forward call). For such a host the step's total is split
into draft / verify / rest in the proportions the cost model predicts for that step, so the cost
model's online correction moves every part by the same measured ratio and its prediction for the
whole step converges to what was measured. Without a cost model the total is reported as verify
time (nothing reads the split then).

A cost model that prices any step from its rows' lengths (`CostModel.fits_any_step`: the shared
model) is handed every decode step's raw time with those lengths (`StepRecord.drafting` where the
host drafts other lengths than it verified), ragged, lag-mismatched and stopped steps included. The
rest of this docstring is for one that does not (the per-cell correction).

Which steps a profile cell stands for (`cell_equivalent`): a steady step (every row verified K
drafts and drafts K again) is its (batch, K) cell. So is, once scaled, a step where a few rows sit
at k = 0 beside rows at K (a long prompt whose catch-up would not pay, a row near its end): where
those rows are always there, a host that timed only steady steps would never time a step at all,
and its policy would run on the profile's word for good. A step whose rows fill under
`MIN_FILLED_SHARE` of its K columns (a probe beside idle rows) or that switches K stays untimed: it
costs far less, or other than, any cell.
"""

from __future__ import annotations

from typing import Sequence

from .cost_model import CostModel
from .policy import RequestOutcome, StepRecord


MIN_FILLED_SHARE = 0.75  # drafted tokens over batch x K, below which a ragged step is not timed
# A lazy draft's catch-ups shorter than this many tokens (summed over rows) are not timed: their
# extra time is within a step's noise. Longer ones teach the cost model's catch-up price.
MIN_TIMED_CATCH_UP = 64
# The largest batch whose draft loop a whole-step host (vLLM) runs the in-step stop rule in by
# default. Measured on the 2-core CPU (vLLM, default pair): the stop gained 3-6% at batch 1 and lost
# about 5% under a load of 8 running requests, where the policy asked every drafting row for the
# longest draft and the loop ran as long as its longest row. Above it the policy chooses each k as
# for a host that cannot stop. The plug-in and the simulator's vLLM host both read it.
STOP_MAX_BATCH = 1


def fits_any_step(cost_model: object) -> bool:
    """Whether a cost model prices any step from its rows' lengths (`CostModel.fits_any_step`); a
    duck-typed one that does not say is taken to fit cells only."""
    return bool(getattr(cost_model, "fits_any_step", False))


def mixed_step_seconds(cost_model: CostModel, batch: int, context: float, verified: Sequence[int],
                       drafting: Sequence[int]) -> float:
    """A step that verified `verified` (per row) and drafts `drafting` for the next: the two sides'
    steps (`CostModel.ragged_step_seconds`) weighed by the cost model's `drafting_weight` (a profiled
    whole step verifies and drafts one length). The same lists give that step itself."""
    if list(verified) == list(drafting):
        return cost_model.ragged_step_seconds(batch, context, verified)
    weighing = getattr(cost_model, "drafting_weight", None)  # a cost model of one's own may not say: the mean
    weight = weighing(batch) if weighing is not None else 0.5
    return ((1 - weight) * cost_model.ragged_step_seconds(batch, context, verified)
            + weight * cost_model.ragged_step_seconds(batch, context, drafting))


def cell_equivalent(cost_model: CostModel | None, batch: int, context: float, verified: Sequence[int],
                    drafting: Sequence[int]) -> float:
    """The factor that turns a step's measured time into its (batch, K) cell's, 0 where no cell stands
    for it. `verified`: the drafts each row verified in the step; `drafting`: those it drafts for the
    next (the same list for a host that verifies its own step's drafts). A ragged step is scaled by the
    cell's cost over the model's price of that step (`mixed_step_seconds`: the profile's ragged
    shares, else the cell's own cost, as a policy prices such a step). 1 for a cost model that
    `fits_any_step` (it prices the step itself)."""
    if fits_any_step(cost_model):
        return 1.0
    K = max([*verified, *drafting], default=0)
    if set(verified) | set(drafting) <= {K}:
        return 1.0
    if cost_model is None or max(verified) != K or max(drafting) != K:
        return 0.0
    if min(sum(verified), sum(drafting)) < MIN_FILLED_SHARE * K * batch:
        return 0.0
    priced = mixed_step_seconds(cost_model, batch, context, verified, drafting)
    return cost_model.step_seconds(batch, context, K) / priced if priced > 0 else 0.0


def whole_step_record(cost_model: CostModel | None, *, batch_size: int, batch_k: int,
                      context_lengths: Sequence[int], outcomes: Sequence[RequestOutcome],
                      total_seconds: float, lag: int = 0, drafting: Sequence[int] = (),
                      draft_positions: int = 0) -> StepRecord:
    """A `StepRecord` for a step measured as one wall time (0 = untimed: a cost model learns nothing);
    `lag`, `drafting` and `draft_positions` as in `StepRecord`. For a cost model that does not
    `fits_any_step` the time is split into the parts of the (batch, batch_k) cell."""
    draft = verify = 0.0
    if fits_any_step(cost_model):
        pass  # the whole time, priced by the model from the rows' lengths
    elif total_seconds > 0 and cost_model is not None and context_lengths:
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
                      total_seconds=total_seconds, lag=lag, drafting=tuple(drafting),
                      draft_positions=draft_positions)
