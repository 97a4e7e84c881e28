"""What one engine step costs on this machine: a cost model fitted from a profile, corrected online.

Layer 2: numpy only (no torch, no scipy at query time), so policies can ask it thousands of times a
step. A *profile* (see `adaptive_spec.profiling`) is plain data: medians of timed model forwards
over a grid of batch size x context length x query tokens, for the target and the draft, and
engine-overhead measurements per batch size and draft length K. This module turns it into times.

What the model predicts, in the engine's own accounting (`StepRecord`):

* ``target_seconds(b, c, q)``: the verify phase of a step whose rows each feed q = K + 1 tokens:
  the target forward (measured on the grid) plus the verify-side processing (turning the logits into
  distributions and the accept test; measured as engine overhead, linear in q per batch size).
* ``draft_seconds(b, c, k)``: the whole draft loop of a step with K = k: one catch-up forward of
  ``catchup_tokens`` tokens (a row's draft cache misses the recovered/bonus token of the previous
  step: 1 token, or 2 when all drafts were accepted; the default 1.5 sits between) then k - 1
  one-token forwards, plus the draft-side sampling. 0 for k = 0: no draft phase runs.
* ``overhead_seconds(b, k)``: the rest of the step (choosing k, emitting, cache bookkeeping).
* ``step_seconds(b, c, k) = draft_seconds(b, c, k) + target_seconds(b, c, k + 1) + overhead_seconds(b, k)``.

Context: the engine reports one context length per request; the model is always asked with the
batch's *longest* one (``max(record.context_lengths)``), because every row attends over the cache's
full width, which is at least the longest row.

Interpolation and fit error: `profile_tables` (the grid's medians made dense tables, knees kept).

Online correction (``observe``): for each component (draft, target, overhead) the engine's measured
time is divided by the profile's prediction, giving a ratio r. Two robust, bounded-window estimates:

* a global factor G: the median of the component's last ``window`` (default 8) ratios. A uniform
  change (a stale or foreign profile, a noisy neighbour, a different clock) is fully absorbed after
  ``window // 2 + 1`` steps, and a single outlier step cannot move it past its neighbours' ratios;
* a per-cell factor for the cell (batch size, K) of the step: the median of the cell's last
  ``cell_window`` (5) ratios. Once a cell has ``min_cell_obs`` (3) ratios it replaces G for that
  cell while fresh (observed within the component's last ``2 * window`` observations); when stale
  it becomes G times the cell's shape (its median over G's median across the same span of steps),
  so a shape error the profile made (say a knee it missed) is remembered while later drift moves
  with G;
* a cell not learned yet takes the factor of its nearest learned cells of the same kind (drafting,
  K > 0, or not; G before any). A profile that is wrong about one draft length at a batch size is
  likely wrong about the lengths beside it, and taking them at the profile's word makes a policy try
  each in turn at the measured price; and G, pooled over both kinds, is wrong for the kind a policy
  has stopped running (vLLM skips the draft at K = 0, so the kinds' errors differ).

The draft component is keyed by the positions the draft loop evaluated (`StepRecord.draft_positions`:
a draft stopped inside the step still ran the forward that showed its confidence). A step whose
draft cache caught up on more than 2 tokens (after steps without speculation) does not feed the
draft correction: its extra time is a prefill-like cost of its own, kept as a per-token median
(`draft_catchup_seconds`), so a probe after a long pause cannot make draft tokens look expensive.

A host whose draft skips steps at K = 0 (vLLM's lazy draft) pays instead, before its next step that
drafts, one draft pass over every token its rows missed, summed over the rows: a prefill-like cost
linear in those tokens. ``catch_up_seconds(tokens)`` prices it: from the profile's measured seconds
per missed token (``draft_catch_up.seconds_per_token``) until the host has timed catch-ups of its own
(``observe_catch_up``), then the median of the last ``window`` of those; 0 where neither is known.

A host whose step cost follows the tokens it runs (vLLM, where the draft runs for the drafting rows
alone) has a cheaper step when only some rows draft. A vLLM profile may hold, per (batch, K), the
share of the batch's drafting increment one drafting row pays (``ragged``: measured side by side
with the uniform steps). ``ragged_step_seconds(b, c, ks)`` then prices a step whose rows draft ks
as the K = 0 step plus the (b, K = max ks) increment times

    share(n) = s1 + (1 - s1) * (n - 1) / (b - 1),    n = sum(ks) / K  (drafting rows, in tokens),

linear in drafted tokens between one row (s1) and all b rows (1). s1 is interpolated linearly over
the measured batch sizes (s1 = 1 at batch 1) and K (held outside). On the 2-core CPU at batch 8
s1 is about 0.4-0.5: the draft forwards (one per position, whatever the rows) are most of it. Without
``ragged`` data a step costs its (b, K) cell whoever drafts, as before.

A cell therefore converges after ``min_cell_obs`` of its own observations, every other cell after
``window // 2 + 1`` observations of the component. With no profile at all, ``CostModel.default()``
starts from a conservative generic shape (verify cost growing with every token, a draft token
costing 0.3 of a target token) and the same rule learns the machine's scale and shape online.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import numpy as np

from .profile_tables import (MONOTONE_MODES, Grid, LooPoint, LooReport, Table, dense_table, fit_linear, interp_axis,
                             median, ragged_shares)

__all__ = ["CostModel", "LooPoint", "LooReport", "Corrections"]  # the table types re-exported from profile_tables

# Bases below these floors are treated as the floor when forming online ratios.
_BASE_FLOOR = 1e-6
_RATIO_CLIP = (1e-3, 1e4)
# Without overhead or draft measurements in a profile, these stand in (seconds).
_DEFAULT_REST = 1e-3
_DEFAULT_DRAFT_TOKEN = 1e-4
# A draft cache misses 1 token after a step, 2 after a fully accepted one; more means steps
# without speculation came before (see `CostModel.observe`).
_USUAL_CATCHUP = 2


# ----------------------------------------------------------------------------- result types


@dataclass(frozen=True)
class Corrections:
    """A snapshot of the online correction: global factor and observation count per component."""

    target: float
    draft: float
    overhead: float
    observations: int


# ----------------------------------------------------------------------------- online correction


class _Cell:
    __slots__ = ("ratios", "last", "median", "shape")

    def __init__(self, window: int):
        self.ratios: deque[tuple[int, float]] = deque(maxlen=window)
        self.last = 0
        self.median = 1.0
        self.shape = 1.0


class _Correction:
    """Windowed-median multiplicative correction of one component (see the module docstring)."""

    def __init__(self, window: int, cell_window: int, min_cell_obs: int):
        self.window, self.cell_window, self.min_cell_obs = window, cell_window, min_cell_obs
        self.fresh = 2 * window
        self.history: deque[tuple[int, float]] = deque(maxlen=max(64, 8 * window))
        self.count = 0
        self.factor_global = 1.0
        self.cells: dict[tuple[int, int], _Cell] = {}
        self._borrowed: dict[tuple[int, int], float] = {}  # factors of unlearned cells, until the next update

    def update(self, key: tuple[int, int], ratio: float) -> None:
        if not math.isfinite(ratio):
            return
        ratio = min(max(ratio, _RATIO_CLIP[0]), _RATIO_CLIP[1])
        self._borrowed.clear()
        self.count += 1
        self.history.append((self.count, ratio))
        recent = [r for _, r in list(self.history)[-self.window:]]
        self.factor_global = median(recent)
        cell = self.cells.get(key)
        if cell is None:
            cell = self.cells[key] = _Cell(self.cell_window)
        cell.ratios.append((self.count, ratio))
        cell.last = self.count
        cell.median = median([r for _, r in cell.ratios])
        start = cell.ratios[0][0]
        span = [r for n, r in self.history if n >= start]
        cell.shape = cell.median / median(span) if span else 1.0

    def factor(self, key: tuple[int, int]) -> float:
        cell = self.cells.get(key)
        if cell is None or len(cell.ratios) < self.min_cell_obs:
            return self._borrowed_factor(key)
        return self._own_factor(cell)

    def _own_factor(self, cell: _Cell) -> float:
        if self.count - cell.last < self.fresh:
            return cell.median
        return self.factor_global * cell.shape

    def _borrowed_factor(self, key: tuple[int, int]) -> float:
        """An unlearned cell takes the factor of its nearest learned cells of the same kind (K > 0 or
        K = 0), nearest in batch size (by ratio) first, then in K; G before any. A profile that was
        wrong about one draft length at a batch size is likely wrong about its neighbours, and a policy
        that took every unlearned cell at the profile's word would try each length in turn at the
        measured price (vLLM at batch 8: K = 1 cost 1.5x its profile, and K = 2, 3 were tried next).
        Kinds are kept apart: vLLM skips the draft at K = 0, and G, pooled over both, is wrong for
        either once one dominates the steps."""
        factor = self._borrowed.get(key)
        if factor is None:
            batch, k = key
            learned = [((abs(math.log2(b / batch)), abs(j - k)), cell) for (b, j), cell in self.cells.items()
                       if len(cell.ratios) >= self.min_cell_obs and (j > 0) == (k > 0)]
            if learned:
                nearest = min(distance for distance, _ in learned)
                factor = median([self._own_factor(cell) for distance, cell in learned if distance == nearest])
            else:
                factor = self.factor_global
            self._borrowed[key] = factor
        return factor


# ----------------------------------------------------------------------------- the model


def timed_step(record: Any) -> tuple[int, int, float, float, float, float, int, int] | None:
    """What an engine step (a `StepRecord`) tells a cost model: (batch, K, longest context, draft,
    verify and total seconds, draft positions run, catch-up tokens); None for a step of no rows."""
    b = int(record.batch_size)
    if b < 1 or not record.context_lengths:
        return None
    k = int(record.batch_k)
    positions = int(getattr(record, "draft_positions", 0) or k)  # a stopped draft still ran its forwards
    verify, total = float(record.verify_seconds), float(record.total_seconds)
    if getattr(record, "forced_tokens", 0):  # its verify held forced tokens too: only the draft is a cell's
        verify = total = 0.0
    return (b, k, float(max(record.context_lengths)), float(record.draft_seconds), verify,
            total, positions, int(getattr(record, "draft_catchup_tokens", 0) or 0))


class CostModel:
    """Step-time predictions for (batch, context, k) from a profile, corrected online.

    Build it with `CostModel.from_profile(profile_dict)` or `CostModel.default()` (no profile).
    All times are seconds. Queries are pure Python over precomputed tables (a few microseconds).
    The model is not thread-safe: one engine, one cost model.
    """

    # Whether `observe` prices any step itself from its rows' lengths (`StepRecord.outcomes`,
    # `.drafting`), so a whole-step host hands it the raw time of every step; False: a host times
    # only steps a (batch, K) cell stands for, scaled to it (`step_timing.cell_equivalent`).
    fits_any_step = False
    # What a lag-mixed step (rows verify one length and draft another: vLLM) costs of its drafting
    # side's step, the rest being its verifying side's, per batch size (`drafting_weight`; others:
    # `drafting_side`). Replayed over the real vLLM step logs of the 2-core CPU
    # (`results.price_replay`), 0.95 priced batch-1 mixed steps within 3.1% (median) against 12% for
    # the mean of the sides (the draft loop is nearly all of a step there: ~105 ms a drafted position
    # against ~5 ms a verified draft); under load (batch 2-8) 0.5-0.75 fitted alike (3.9-4.0%).
    drafting_side = 0.5
    drafting_side_by_batch: Mapping[int, float] = MappingProxyType({1: 0.95})

    def drafting_weight(self, batch: int) -> float:
        """The drafting side's weight in a lag-mixed step of `batch` rows (`step_timing.mixed_step_seconds`)."""
        return self.drafting_side_by_batch.get(int(batch), self.drafting_side)

    def __init__(
        self,
        target: Grid,
        draft: Grid | None,
        overhead_rows: Sequence[Mapping[str, Any]] = (),
        *,
        catchup_tokens: float = 1.5,
        catch_up_per_token: float | None = None,
        monotone: str = "measured",
        noise_tolerance: float = 0.05,
        window: int = 8,
        cell_window: int = 5,
        min_cell_obs: int = 3,
        max_batch: int | None = None,
        max_query_tokens: int | None = None,
        source: str = "profile",
    ):
        if window < 1 or cell_window < 1 or min_cell_obs < 1:
            raise ValueError("window, cell_window and min_cell_obs must be >= 1")
        self.source = source
        self.is_default = False  # True for CostModel.default(): a generic shape, not a measurement
        # Acceptance learned with these models before (saved beside the profile; see
        # `profiling.profile_file.load_acceptance`): a policy that learns acceptance may start from it.
        self.warm_start: dict | None = None
        self.catchup_tokens = float(catchup_tokens)
        if catch_up_per_token is not None and not (math.isfinite(catch_up_per_token) and catch_up_per_token >= 0):
            raise ValueError(f"catch_up_per_token must be a finite number >= 0, got {catch_up_per_token!r}")
        self.catch_up_per_token = catch_up_per_token  # measured by the profile; None = not measured
        self.ragged_shares: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # batch -> (Ks, one row's share)
        if monotone not in MONOTONE_MODES:
            raise ValueError(f"monotone must be one of {MONOTONE_MODES}, got {monotone!r}")
        self.monotone, self.noise_tolerance = monotone, float(noise_tolerance)
        self._target_grid, self._draft_grid = target, draft
        self._overhead_rows = tuple(overhead_rows)
        self._windows = (window, cell_window, min_cell_obs)
        grid_b = [target.batches[-1]] + ([draft.batches[-1]] if draft is not None else [])
        self.max_batch = int(max_batch or max(64, 2 * int(max(grid_b))))
        self.max_query_tokens = int(max_query_tokens or max(33, 2 * int(target.queries[-1]) + 1))
        self._build()
        self.reset_corrections()

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def from_profile(cls, profile: Mapping[str, Any] | Any, **options: Any) -> "CostModel":
        """From a profile document (the parsed JSON of `adaptive_spec.profiling`, or an object with
        a `.data` mapping). Raises ValueError naming what is missing or malformed."""
        data = getattr(profile, "data", profile)
        if not isinstance(data, Mapping):
            raise ValueError(f"a profile must be a mapping (parsed JSON), got {type(data).__name__}")
        target = Grid.from_rows(data.get("target") or (), "target")
        draft_rows = data.get("draft") or ()
        draft = Grid.from_rows(draft_rows, "draft") if draft_rows else None
        name = data.get("name") or "profile"
        catch_up = data.get("draft_catch_up") or {}
        if not isinstance(catch_up, Mapping) or not isinstance(catch_up.get("seconds_per_token", 0.0), (int, float)):
            raise ValueError("a profile's draft_catch_up must be a mapping with a number seconds_per_token")
        options.setdefault("catch_up_per_token", catch_up.get("seconds_per_token"))
        model = cls(target, draft, data.get("overhead") or (), source=str(name), **options)
        model.ragged_shares = ragged_shares(data.get("ragged"))
        return model

    @classmethod
    def default(cls, **options: Any) -> "CostModel":
        """A safe start with no profile: a generic, conservative shape whose scale (and, per cell,
        shape) the online correction learns. Verify cost grows 15% per extra token in the batch,
        a draft token costs 0.3 of a one-token verify, context adds up to ~50% at 8k tokens."""
        batches = np.array([1, 2, 4, 8, 16, 32, 64], dtype=float)
        contexts = np.array([128, 8192], dtype=float)
        queries = np.arange(1, 17, dtype=float)
        t0 = 0.02
        b, c, q = np.meshgrid(batches, contexts, queries, indexing="ij")
        target = t0 * (1 + 0.15 * (b * q - 1)) * (1 + c / 16384)
        draft = 0.3 * target[:, :, :2]
        overhead = [{"batch": int(x), "k": 0, "draft_extra": 0.0, "verify_extra": 0.0, "rest": 5e-4 + 5e-5 * x}
                    for x in batches]  # fmt: skip
        options.setdefault("source", "default")
        model = cls(Grid(batches, contexts, queries, target), Grid(batches, contexts, queries[:2], draft),
                   overhead, **options)  # fmt: skip
        model.is_default = True
        return model

    def _build(self) -> None:
        B, Q = self.max_batch, self.max_query_tokens
        # Target forward: j = query tokens (index 0 unused).
        tgt = self._target_grid
        fit = {"monotone": self.monotone, "tolerance": self.noise_tolerance}
        strict = (0, 1, 2) if self.monotone == "all" else (1,)  # table axes: batch, context, j
        target_fwd = dense_table(tgt.axes, tgt.fitted(**fit), B, [max(j, 1) for j in range(Q + 1)])
        # Overhead coefficients per integer batch.
        dx_a, dx_s, vx_a, vx_s, r_a, r_s = self._overhead_coefficients(B)
        qs = np.arange(Q + 1, dtype=float)
        verify_extra = vx_a[:, None] + vx_s[:, None] * np.maximum(qs - 1, 0)[None, :]  # [B+1, Q+1]
        self._target_fwd = Table(tgt.contexts, target_fwd, strict)
        self._target = Table(tgt.contexts, target_fwd + verify_extra[:, None, :], strict)
        # Draft: j = k (0..Q-1).
        K = Q - 1
        ks = np.arange(K + 1, dtype=float)
        if self._draft_grid is not None:
            dg = self._draft_grid
            pair = dense_table(dg.axes, dg.fitted(**fit), B, [min(self.catchup_tokens, dg.queries[-1]) if dg.queries[-1] > 1 else 1.0, 1.0])
            catch, one = pair[:, :, 0:1], pair[:, :, 1:2]
            fwd = np.where(ks[None, None, :] > 0, catch + np.maximum(ks - 1, 0)[None, None, :] * one, 0.0)
            contexts = dg.contexts
        else:
            contexts = np.array([0.0])
            fwd = np.broadcast_to(_DEFAULT_DRAFT_TOKEN * ks[None, None, :], (B + 1, 1, K + 1)).copy()
        extra = np.where(ks[None, :] > 0, dx_a[:, None] + dx_s[:, None] * ks[None, :], 0.0)  # [B+1, K+1]
        draft_strict = tuple(sorted(set(strict) | {2}))  # every extra drafted token adds a forward
        self._draft_fwd = Table(contexts, fwd, draft_strict)
        self._draft = Table(contexts, fwd + extra[:, None, :], draft_strict)
        self._rest = [[float(r_a[b] + r_s[b] * k) for k in range(K + 1)] for b in range(B + 1)]
        self._rest_slope = [float(r_s[b]) for b in range(B + 1)]

    def _overhead_coefficients(self, B: int) -> tuple[np.ndarray, ...]:
        rows = self._overhead_rows
        if not rows:
            zeros = np.zeros(B + 1)
            return zeros, zeros, zeros, zeros, np.full(B + 1, _DEFAULT_REST), zeros
        by_batch: dict[int, list[tuple[int, float, float, float]]] = {}
        for row in rows:
            try:
                entry = (int(row["k"]), float(row["draft_extra"]), float(row["verify_extra"]), float(row["rest"]))
                by_batch.setdefault(int(row["batch"]), []).append(entry)
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(f"an overhead row lacks batch/k/draft_extra/verify_extra/rest: {error}") from None
        batches = np.array(sorted(by_batch), dtype=float)
        coef = np.zeros((len(batches), 6))
        for i, b in enumerate(batches):
            entries = by_batch[int(b)]
            coef[i, 0:2] = fit_linear((k, d) for k, d, _, _ in entries if k > 0)
            coef[i, 2:4] = fit_linear((k, v) for k, _, v, _ in entries)
            coef[i, 4:6] = fit_linear((k, r) for k, _, _, r in entries)
        coef = np.maximum.accumulate(coef, axis=0)  # monotone in batch
        dense = np.zeros((B + 1, 6))
        for b in range(1, B + 1):
            dense[b] = np.maximum(interp_axis(batches, coef, float(b)), 0.0)
        dense[0] = dense[1]
        return tuple(dense[:, i] for i in range(6))

    # --- queries -----------------------------------------------------------------------------
    def target_seconds(self, batch: int, context: float, query_tokens: int, *, forward_only: bool = False) -> float:
        """The verify phase: one target forward of `query_tokens` per row (plus verify-side
        processing unless `forward_only`), online correction included unless `forward_only`."""
        if batch < 1 or query_tokens < 1:
            raise ValueError(f"need batch >= 1 and query_tokens >= 1, got {batch}, {query_tokens}")
        table = self._target_fwd if forward_only else self._target
        value = self._lookup(table, int(batch), float(context), int(query_tokens))
        if forward_only:
            return value
        return value * self._tc.factor((int(batch), int(query_tokens) - 1))

    def draft_seconds(self, batch: int, context: float, k: int, *, forward_only: bool = False) -> float:
        """The whole draft loop for K = k (catch-up forward + k - 1 one-token forwards, plus the
        draft-side sampling unless `forward_only`); 0 for k = 0."""
        if k <= 0:
            if k < 0:
                raise ValueError(f"k must be >= 0, got {k}")
            return 0.0
        if batch < 1:
            raise ValueError(f"need batch >= 1, got {batch}")
        table = self._draft_fwd if forward_only else self._draft
        value = self._lookup(table, int(batch), float(context), int(k))
        if forward_only:
            return value
        return value * self._dc.factor((int(batch), int(k)))

    def overhead_seconds(self, batch: int, k: int = 0) -> float:
        """The step's time outside the draft and verify phases."""
        if batch < 1 or k < 0:
            raise ValueError(f"need batch >= 1 and k >= 0, got {batch}, {k}")
        return self._rest_base(int(batch), int(k)) * self._oc.factor((int(batch), int(k)))

    def step_seconds(self, batch: int, context: float, k: int) -> float:
        """draft_seconds(k) + target_seconds(k + 1) + overhead_seconds(k)."""
        return self.draft_seconds(batch, context, k) + self.target_seconds(batch, context, k + 1) + self.overhead_seconds(batch, k)

    def step_seconds_table(self, batch: int, context: float, k_max: int) -> list[float]:
        """step_seconds for k = 0..k_max, in one call."""
        return [self.step_seconds(batch, context, k) for k in range(k_max + 1)]

    def price_spread(self, batch: int, k_max: int) -> list[float]:
        """The uncertainty (one standard deviation, seconds) of each K's step price above K = 0's,
        K = 0..k_max: 0 here, where a per-cell correction keeps no uncertainty (see
        `online_cost.SharedCostModel.price_spread`)."""
        return [0.0] * (int(k_max) + 1)

    def untimed_misfit(self, batch: int, k_max: int) -> list[float]:
        """0 for every K: the per-cell correction prices no length by another's evidence (see
        `online_cost.SharedCostModel.untimed_misfit`)."""
        return [0.0] * (int(k_max) + 1)

    def ragged_step_seconds(self, batch: int, context: float, ks: Sequence[int]) -> float:
        """A step whose rows draft `ks` (one per row, `batch` rows): see the module docstring."""
        K = max(ks, default=0)
        full = self.step_seconds(batch, context, K)
        share = self.drafting_share(batch, K, sum(ks) / K if K else 0.0)
        if share >= 1.0:
            return full
        base = self.step_seconds(batch, context, 0)
        return base + max(full - base, 0.0) * share

    def drafting_share(self, batch: int, k: int, rows: float) -> float:
        """What `rows` drafting rows (in drafted tokens over K) pay of the (batch, K) increment."""
        if k <= 0 or rows <= 0:
            return 0.0
        if batch <= 1 or rows >= batch or not self.ragged_shares:
            return 1.0
        one = self._one_row_share(batch, k)
        return one + (1.0 - one) * (rows - 1.0) / (batch - 1.0)

    def _one_row_share(self, batch: int, k: int) -> float:
        per_batch = sorted(self.ragged_shares.items())
        batches = np.array([1.0] + [float(b) for b, _ in per_batch])
        shares = np.array([1.0] + [float(np.interp(k, ks, values)) for _, (ks, values) in per_batch])
        return float(np.interp(batch, batches, shares))  # held beyond the largest measured batch

    def _lookup(self, table: Table, b: int, c: float, j: int) -> float:
        if b <= table.max_b and j <= table.max_j:
            return table.get(b, c, j)
        return table.beyond(b, c, j)

    def _rest_base(self, b: int, k: int) -> float:
        bb = min(b, self.max_batch)
        row = self._rest[bb]
        value = row[k] if k < len(row) else row[-1] + self._rest_slope[bb] * (k - len(row) + 1)
        if b > bb:
            value *= b / bb
        return value

    # --- online correction -------------------------------------------------------------------
    def observe(self, record: Any) -> None:
        """Learn from one engine step (a `StepRecord`): per-component ratio of measured to
        profile time, folded into the windowed medians described in the module docstring."""
        step = timed_step(record)
        if step is None:
            return
        b, k, c, draft, verify, total, positions, catchup = step
        key = (b, k)
        if k > 0 and draft > 0:
            base = self._lookup(self._draft, b, c, positions)
            if catchup > _USUAL_CATCHUP:  # a long catch-up is its own cost, not the draft tokens'
                expected = base * self._dc.factor((b, positions))
                self._catchup.append(max(draft - expected, 0.0) / (catchup - self.catchup_tokens))
            else:
                self._dc.update((b, positions), draft / max(base, _BASE_FLOOR))
        if verify > 0:
            base = self._lookup(self._target, b, c, k + 1)
            self._tc.update(key, verify / max(base, _BASE_FLOOR))
        rest = total - draft - verify
        if total > 0 and rest >= 0:
            self._oc.update(key, max(rest, _BASE_FLOOR) / max(self._rest_base(b, k), _BASE_FLOOR))
        self.observations += 1

    def draft_catchup_seconds(self, tokens: int) -> float | None:
        """Extra draft time of a catch-up of `tokens` context tokens (after steps without
        speculation) over the usual 1-2, from the catch-ups timed online; None before any."""
        if not self._catchup:
            return None
        return median(self._catchup) * max(tokens - self.catchup_tokens, 0.0)

    def catch_up_seconds(self, tokens: int) -> float:
        """Seconds for a lazy draft to run over `tokens` context tokens it missed (summed over rows):
        timed online once the host has reported catch-ups, else the profile's figure, else 0."""
        if tokens <= 0:
            return 0.0
        if self._lazy_catch_up:
            return median(self._lazy_catch_up) * tokens
        return (self.catch_up_per_token or 0.0) * tokens

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """A host timed a catch-up: `seconds` beyond the step's own cost for `tokens` missed tokens."""
        if tokens > 0 and math.isfinite(seconds):
            self._lazy_catch_up.append(max(seconds, 0.0) / tokens)

    def reset_corrections(self) -> None:
        """Forget everything learned online (back to the profile)."""
        self._catchup: deque[float] = deque(maxlen=self._windows[0])  # seconds per catch-up token
        self._lazy_catch_up: deque[float] = deque(maxlen=self._windows[0])  # seconds per missed token
        window, cell_window, min_cell_obs = self._windows
        self._tc = _Correction(window, cell_window, min_cell_obs)
        self._dc = _Correction(window, cell_window, min_cell_obs)
        self._oc = _Correction(window, cell_window, min_cell_obs)
        self.observations = 0

    def corrections(self) -> Corrections:
        return Corrections(self._tc.factor_global, self._dc.factor_global, self._oc.factor_global, self.observations)

    # --- fit quality -------------------------------------------------------------------------
    def loo_errors(self) -> LooReport:
        """Leave-one-out over every measured grid cell of the target and the draft forwards."""
        points = self._target_grid.loo("target", self.monotone, self.noise_tolerance)
        if self._draft_grid is not None and not self.is_default:
            points += self._draft_grid.loo("draft", self.monotone, self.noise_tolerance)
        return LooReport(tuple(points))

    @property
    def has_draft(self) -> bool:
        return self._draft_grid is not None

    def grid(self, component: str = "target") -> dict:
        """The measured grid axes of a component ("target" or "draft")."""
        grid = self._target_grid if component == "target" else self._draft_grid
        if grid is None:
            return {}
        return {"batch_sizes": [int(x) for x in grid.batches], "contexts": [int(x) for x in grid.contexts],
                "query_tokens": [int(x) for x in grid.queries]}  # fmt: skip

    def __repr__(self) -> str:
        g = self.grid()
        return (f"CostModel(source={self.source!r}, batches={g['batch_sizes']}, contexts={g['contexts']}, "
                f"query_tokens={g['query_tokens']}, draft={self.has_draft}, observations={self.observations})")
