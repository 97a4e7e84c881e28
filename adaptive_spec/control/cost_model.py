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

Interpolation (the grid's medians, per component):

1. Missing cells (a failed or skipped measurement) are filled from their neighbours: along query
   tokens, then context (or the nearest context's value), then batch.
2. Monotone where the measurements allow (``monotone="measured"``, the default): cost is made
   non-decreasing in context (more cached tokens never make a forward cheaper) by an isotonic
   least-squares fit plus a running maximum. Along batch and query tokens only noise-sized drops
   (at most ``noise_tolerance``, 5%) are pooled; larger repeatable drops are real and kept: CPU
   matrix kernels change algorithm with the number of rows (batch x query tokens). On the 2-core
   development CPU in fp32 the 1.5B target's forward costs ~295 ms for 1 row, ~610 for 2, ~840 for
   3 and ~530 for 4, so a 3-draft verify is *cheaper* than a 1- or 2-draft one; a model that forced
   monotonicity would hide the cheapest choices from the policy. ``monotone="all"`` instead makes
   cost non-decreasing along every axis (isotonic fits, which average noise out rather than
   ratchet it up, then running maxima, which keep monotonicity along the axes already done).
3. Inside the grid: piecewise linear along each axis (separably). Piecewise linear in query tokens
   keeps measured steps and knees. Off-grid batch sizes are interpolated linearly between the
   measured ones, which cannot know a kernel switch between them (on the CPU above, batch 3 at
   k = 0 is a 3-row forward, ~3x batch 1, while the line from batch 2 to 4 says ~2x): profile the
   batch sizes you serve, or let the online correction learn them.
4. Above the grid: linear from the last point with slope max(last segment, mean slope over the
   axis, 0), so a flat last segment does not predict free growth; extrapolation slopes are made
   non-decreasing along the other axes, so monotonicity holds outside the grid too. Below the grid
   in batch or query tokens: linear from the first segment, but never below proportional scaling
   ``v0 * x / x0`` (cost per unit of work only falls as work grows), hence never negative. Below the
   smallest context the smallest context's cost stands (a slight, conservative overestimate).

Fit error: ``loo_errors()`` holds out each measured grid cell in turn, rebuilds the grid without it
(steps 1-2), and compares the prediction with the measured median.

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

import bisect
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

__all__ = ["CostModel", "LooPoint", "LooReport", "Corrections"]

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
class LooPoint:
    """One held-out grid cell: its coordinates, measured median and the prediction without it."""

    component: str  # "target" or "draft"
    batch: int
    context: int
    query_tokens: int
    measured: float
    predicted: float

    @property
    def rel_error(self) -> float:
        return abs(self.predicted - self.measured) / self.measured


@dataclass(frozen=True)
class LooReport:
    """Leave-one-out errors over all measured grid cells of the target and the draft."""

    points: tuple[LooPoint, ...]

    def errors(self, component: str | None = None) -> np.ndarray:
        return np.array([p.rel_error for p in self.points if component in (None, p.component)], dtype=float)

    def median(self, component: str | None = None) -> float:
        errors = self.errors(component)
        return float(np.median(errors)) if errors.size else float("nan")

    @property
    def median_rel_error(self) -> float:
        """Median relative error over every held-out cell (target and draft together)."""
        return self.median()

    def summary(self) -> dict:
        out = {"points": len(self.points), "median_rel_error": self.median()}
        for component in ("target", "draft"):
            errors = self.errors(component)
            if errors.size:
                out[f"{component}_median_rel_error"] = float(np.median(errors))
                out[f"{component}_p90_rel_error"] = float(np.quantile(errors, 0.9))
                out[f"{component}_max_rel_error"] = float(errors.max())
        return out


@dataclass(frozen=True)
class Corrections:
    """A snapshot of the online correction: global factor and observation count per component."""

    target: float
    draft: float
    overhead: float
    observations: int


# ----------------------------------------------------------------------------- 1-D rules


def _interp_axis(xs: np.ndarray, values: np.ndarray, x: float) -> np.ndarray:
    """Evaluate along axis 0 of `values` (points at `xs`, increasing) at x, with the module's
    extrapolation rules. Works elementwise over the remaining axes."""
    n = len(xs)
    if n == 1:
        return values[0].copy()
    if xs[0] <= x <= xs[-1]:
        i = min(max(int(np.searchsorted(xs, x, side="right")) - 1, 0), n - 2)
        t = (x - xs[i]) / (xs[i + 1] - xs[i])
        return values[i] + t * (values[i + 1] - values[i])
    if x > xs[-1]:
        last = (values[-1] - values[-2]) / (xs[-1] - xs[-2])
        mean = (values[-1] - values[0]) / (xs[-1] - xs[0])
        slope = np.maximum(np.maximum(last, mean), 0.0)
        return values[-1] + slope * (x - xs[-1])
    first = np.maximum((values[1] - values[0]) / (xs[1] - xs[0]), 0.0)
    linear = values[0] - first * (xs[0] - x)
    return np.maximum(linear, values[0] * max(x, 0.0) / xs[0])


def _fill_line(xs: np.ndarray, line: np.ndarray) -> None:
    """Fill NaNs of one 1-D line in place from its finite points (needs >= 2 of them)."""
    finite = np.isfinite(line)
    if finite.sum() < 2 or finite.all():
        return
    px, py = xs[finite], line[finite]
    for i in np.flatnonzero(~finite):
        line[i] = float(_interp_axis(px, py, xs[i]))


def _hold_line(line: np.ndarray) -> None:
    """A line with exactly one finite value: every other cell takes it."""
    finite = np.isfinite(line)
    if finite.sum() == 1:
        line[~finite] = line[finite][0]


def _fill_missing(axes: Sequence[np.ndarray], values: np.ndarray) -> np.ndarray:
    """Fill NaN cells of a [batch, context, query] grid from their neighbours: along query tokens
    (interpolation or extrapolation from >= 2 points), then along context (the same, or the
    nearest context's value when it is the only one: context moves cost least), then along batch;
    whatever is left holds a single neighbour along any axis. Raises if nothing is finite."""
    values = values.copy()
    if not np.isfinite(values).any():
        raise ValueError("the grid has no measured cell")

    def lines(axis):
        moved = np.moveaxis(values, axis, -1)  # a view: filling it fills `values`
        return [moved[index] for index in np.ndindex(moved.shape[:-1])]

    for _ in range(3):
        if np.isfinite(values).all():
            break
        for line in lines(2):
            _fill_line(axes[2], line)
        for line in lines(1):
            _fill_line(axes[1], line)
            _hold_line(line)
        for line in lines(0):
            _fill_line(axes[0], line)
    for axis in (2, 1, 0):
        if np.isfinite(values).all():
            break
        for line in lines(axis):
            _hold_line(line)
    return values


def _isotonic(line: np.ndarray, tolerance: float = math.inf) -> np.ndarray:
    """Pool adjacent violators: the least-squares non-decreasing fit of a 1-D sequence when
    `tolerance` is infinite. With a finite `tolerance`, only drops of at most that fraction are
    pooled (noise); a larger drop between neighbouring blocks is kept as measured."""
    sums: list[float] = []
    counts: list[int] = []
    for value in line.tolist():
        sums.append(value)
        counts.append(1)
        while len(sums) > 1:
            left, right = sums[-2] / counts[-2], sums[-1] / counts[-1]
            if not (left > right and left - right <= tolerance * right):
                break
            total, count = sums.pop(), counts.pop()
            sums[-1] += total
            counts[-1] += count
    return np.repeat(np.array(sums) / np.array(counts), counts)


MONOTONE_MODES = ("measured", "all")


def _monotone(values: np.ndarray, mode: str = "measured", tolerance: float = 0.05) -> np.ndarray:
    """Make a [batch, context, query] grid non-decreasing where it should be.

    "all": non-decreasing along every axis: an isotonic (least-squares) fit along query tokens,
    context and batch in turn, which averages noise out instead of letting one high cell lift all
    later ones, then a running maximum along every axis, which guarantees the result.

    "measured" (default): non-decreasing in context in the same way (more cached tokens never make
    a forward cheaper). Along batch and query tokens only drops of at most `tolerance` (noise) are
    pooled; larger, repeatable drops are real and kept: CPU matrix kernels change algorithm with
    the number of rows (batch x query tokens), e.g. on the 2-core development machine a 4-token
    fp32 forward of the 1.5B target costs 530 ms where a 2-token one costs 610 and a 3-token one
    840. A model that hid that would steer a policy away from its cheapest choices.
    """
    if mode not in MONOTONE_MODES:
        raise ValueError(f"monotone must be one of {MONOTONE_MODES}, got {mode!r}")
    out = np.maximum(values, 0.0)
    strict = (0, 1, 2) if mode == "all" else (1,)
    for axis in (2, 1, 0):
        if out.shape[axis] > 1:
            limit = math.inf if axis in strict else tolerance
            out = np.apply_along_axis(_isotonic, axis, out, limit)
    for axis in strict:
        out = np.maximum.accumulate(out, axis=axis)
    return out


def _ragged_shares(ragged: Any) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """A profile's `ragged` section as batch -> (Ks, one drafting row's share); {} if absent."""
    if ragged is None:
        return {}
    cells = ragged.get("cells") if isinstance(ragged, Mapping) else None
    if not isinstance(cells, list):
        raise ValueError("a profile's ragged section must be a mapping with a list of cells")
    by_batch: dict[int, list[tuple[int, float]]] = {}
    for cell in cells:
        try:
            batch, k, share = int(cell["batch"]), int(cell["k"]), float(cell["share"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"a ragged cell needs batch, k and share, got {cell!r}") from None
        if batch < 2 or k < 1 or not 0.0 <= share <= 1.0:
            raise ValueError(f"a ragged cell needs batch >= 2, k >= 1 and a share in [0, 1], got {cell!r}")
        by_batch.setdefault(batch, []).append((k, share))
    return {b: (np.array([k for k, _ in sorted(v)], dtype=float), np.array([s for _, s in sorted(v)]))
            for b, v in by_batch.items()}


def _fit_linear(points: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """Least squares value = a + s * x with a, s >= 0."""
    pts = [(float(x), float(y)) for x, y in points if math.isfinite(y)]
    if not pts:
        return 0.0, 0.0
    xs = np.array([p[0] for p in pts])
    ys = np.array([p[1] for p in pts])
    if len(set(xs.tolist())) >= 2:
        s, a = np.polyfit(xs, ys, 1)
    elif xs[0] > 0:  # one K > 0 only: a per-token cost through the origin
        a, s = 0.0, float(ys.mean() / xs[0])
    else:
        a, s = float(ys.mean()), 0.0
    if s < 0:
        a, s = float(ys.mean()), 0.0
    if a < 0:
        a, s = 0.0, float((xs * ys).sum() / max((xs * xs).sum(), 1e-30))
    return max(float(a), 0.0), max(float(s), 0.0)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


# ----------------------------------------------------------------------------- grids


@dataclass(frozen=True)
class _Grid:
    """Raw medians of one component over batch x context x query tokens (NaN = not measured)."""

    batches: np.ndarray
    contexts: np.ndarray
    queries: np.ndarray
    raw: np.ndarray

    @property
    def axes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.batches, self.contexts, self.queries

    def fitted(self, raw: np.ndarray | None = None, monotone: str = "measured", tolerance: float = 0.05) -> np.ndarray:
        return _monotone(_fill_missing(self.axes, self.raw if raw is None else raw), monotone, tolerance)

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]], what: str) -> "_Grid":
        if not rows:
            raise ValueError(f"the profile has no {what} measurements")
        try:
            coords = [(int(r["batch"]), int(r["context"]), int(r["query_tokens"]), float(r["median"])) for r in rows]
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"a {what} row lacks batch/context/query_tokens/median: {error}") from None
        batches = np.array(sorted({c[0] for c in coords}), dtype=float)
        contexts = np.array(sorted({c[1] for c in coords}), dtype=float)
        queries = np.array(sorted({c[2] for c in coords}), dtype=float)
        if batches[0] < 1 or queries[0] < 1 or contexts[0] < 0:
            raise ValueError(f"{what} grid has batch or query tokens below 1 or a negative context")
        raw = np.full((len(batches), len(contexts), len(queries)), np.nan)
        for b, c, q, median in coords:
            if math.isfinite(median) and median > 0:
                raw[np.searchsorted(batches, b), np.searchsorted(contexts, c), np.searchsorted(queries, q)] = median
        return cls(batches, contexts, queries, raw)

    def loo(self, component: str, monotone: str = "measured", tolerance: float = 0.05) -> list[LooPoint]:
        points = []
        for index in zip(*np.nonzero(np.isfinite(self.raw))):
            held = self.raw.copy()
            held[index] = np.nan
            if not np.isfinite(held).any():
                continue
            predicted = float(self.fitted(held, monotone, tolerance)[index])
            b, c, q = (float(axis[i]) for axis, i in zip(self.axes, index))
            points.append(LooPoint(component, int(b), int(c), int(q), float(self.raw[index]), predicted))
        return points


class _Table:
    """Dense precomputed values rows[b][j] = tuple over the context grid for integer b in 1..B and
    j in 0..J, made monotone along `monotone_axes` (0 = batch, 1 = context, 2 = j); evaluation is a
    bisect and one blend.

    Beyond the table, values continue linearly: in context with slope ``hi[b][j]``, in j with
    ``jslope[b]`` and in b with ``bslope[j]`` (per context); all slopes are >= 0 and made
    non-decreasing along the other axes, so the continuation is monotone wherever the table is.
    Below the smallest context the smallest context's value stands (flat, conservative)."""

    __slots__ = ("contexts", "rows", "hi", "jslope", "bslope", "max_b", "max_j")

    def __init__(self, contexts: np.ndarray, dense: np.ndarray, monotone_axes: Sequence[int] = (0, 1, 2)):
        # dense: [B + 1, nc, J + 1] (batch index 0 mirrors batch 1)
        dense = np.maximum(np.asarray(dense, dtype=float), 0.0)
        for axis in monotone_axes:
            dense = np.maximum.accumulate(dense, axis=axis)
        self.contexts = [float(c) for c in contexts]
        self.max_b, self.max_j = dense.shape[0] - 1, dense.shape[2] - 1
        self.rows = [[tuple(float(v) for v in dense[b, :, j]) for j in range(dense.shape[2])] for b in range(dense.shape[0])]
        if len(self.contexts) >= 2:
            cs = np.asarray(contexts, dtype=float)
            last = (dense[:, -1, :] - dense[:, -2, :]) / (cs[-1] - cs[-2])
            mean = (dense[:, -1, :] - dense[:, 0, :]) / (cs[-1] - cs[0])
            hi = np.maximum(np.maximum(last, mean), 0.0)
            hi = np.maximum.accumulate(np.maximum.accumulate(hi, axis=0), axis=1)
        else:
            hi = np.zeros((dense.shape[0], dense.shape[2]))
        self.hi = hi.tolist()
        J, B = self.max_j, self.max_b
        jslope = dense[:, :, J] - dense[:, :, J - 1] if J >= 1 else np.zeros(dense.shape[:2])
        jslope = np.maximum.accumulate(np.maximum.accumulate(np.maximum(jslope, 0.0), axis=0), axis=1)  # [b, c]
        self.jslope = [tuple(row) for row in jslope.tolist()]
        bslope = dense[B, :, :] - dense[B - 1, :, :] if B >= 1 else np.zeros(dense.shape[1:])
        bslope = np.maximum.accumulate(np.maximum.accumulate(np.maximum(bslope, 0.0), axis=0), axis=1)  # [c, j]
        self.bslope = [tuple(col) for col in bslope.T.tolist()]

    def get(self, b: int, c: float, j: int) -> float:
        row = self.rows[b][j]
        cs = self.contexts
        if c >= cs[-1]:
            return row[-1] + self.hi[b][j] * (c - cs[-1])
        if c <= cs[0]:
            return row[0]
        i = bisect.bisect_right(cs, c)
        c0 = cs[i - 1]
        v0 = row[i - 1]
        return v0 + (c - c0) / (cs[i] - c0) * (row[i] - v0)

    def slope_at(self, slopes: tuple[float, ...], c: float) -> float:
        cs = self.contexts
        if c >= cs[-1]:
            return slopes[-1]
        if c <= cs[0]:
            return slopes[0]
        i = bisect.bisect_right(cs, c)
        t = (c - cs[i - 1]) / (cs[i] - cs[i - 1])
        return slopes[i - 1] + t * (slopes[i] - slopes[i - 1])

    def beyond(self, b: int, c: float, j: int) -> float:
        """Any (b, j), including past the table."""
        bb, jj = min(b, self.max_b), min(j, self.max_j)
        value = self.get(bb, c, jj)
        if j > jj:
            value += self.slope_at(self.jslope[bb], c) * (j - jj)
        if b > bb:
            value += self.slope_at(self.bslope[jj], c) * (b - bb)
        return value


def _dense(axes: Sequence[np.ndarray], fitted: np.ndarray, max_b: int, qs: Sequence[float]) -> np.ndarray:
    """[max_b + 1, nc, len(qs)] values at integer batches 1..max_b and the given query tokens."""
    out = np.zeros((max_b + 1, len(axes[1]), len(qs)))
    for b in range(1, max_b + 1):
        plane = _interp_axis(axes[0], fitted, float(b))  # [nc, nq]
        moved = np.moveaxis(plane, 1, 0)  # [nq, nc]
        for j, q in enumerate(qs):
            out[b, :, j] = _interp_axis(axes[2], moved, float(q))
    out[0] = out[1]
    return out


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
        self.factor_global = _median(recent)
        cell = self.cells.get(key)
        if cell is None:
            cell = self.cells[key] = _Cell(self.cell_window)
        cell.ratios.append((self.count, ratio))
        cell.last = self.count
        cell.median = _median([r for _, r in cell.ratios])
        start = cell.ratios[0][0]
        span = [r for n, r in self.history if n >= start]
        cell.shape = cell.median / _median(span) if span else 1.0

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
                factor = _median([self._own_factor(cell) for distance, cell in learned if distance == nearest])
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
    return (b, k, float(max(record.context_lengths)), float(record.draft_seconds), float(record.verify_seconds),
            float(record.total_seconds), positions, int(getattr(record, "draft_catchup_tokens", 0) or 0))


class CostModel:
    """Step-time predictions for (batch, context, k) from a profile, corrected online.

    Build it with `CostModel.from_profile(profile_dict)` or `CostModel.default()` (no profile).
    All times are seconds. Queries are pure Python over precomputed tables (a few microseconds).
    The model is not thread-safe: one engine, one cost model.
    """

    def __init__(
        self,
        target: _Grid,
        draft: _Grid | None,
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
        target = _Grid.from_rows(data.get("target") or (), "target")
        draft_rows = data.get("draft") or ()
        draft = _Grid.from_rows(draft_rows, "draft") if draft_rows else None
        name = data.get("name") or "profile"
        catch_up = data.get("draft_catch_up") or {}
        if not isinstance(catch_up, Mapping) or not isinstance(catch_up.get("seconds_per_token", 0.0), (int, float)):
            raise ValueError("a profile's draft_catch_up must be a mapping with a number seconds_per_token")
        options.setdefault("catch_up_per_token", catch_up.get("seconds_per_token"))
        model = cls(target, draft, data.get("overhead") or (), source=str(name), **options)
        model.ragged_shares = _ragged_shares(data.get("ragged"))
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
        model = cls(_Grid(batches, contexts, queries, target), _Grid(batches, contexts, queries[:2], draft),
                   overhead, **options)  # fmt: skip
        model.is_default = True
        return model

    def _build(self) -> None:
        B, Q = self.max_batch, self.max_query_tokens
        # Target forward: j = query tokens (index 0 unused).
        tgt = self._target_grid
        fit = {"monotone": self.monotone, "tolerance": self.noise_tolerance}
        strict = (0, 1, 2) if self.monotone == "all" else (1,)  # table axes: batch, context, j
        target_fwd = _dense(tgt.axes, tgt.fitted(**fit), B, [max(j, 1) for j in range(Q + 1)])
        # Overhead coefficients per integer batch.
        dx_a, dx_s, vx_a, vx_s, r_a, r_s = self._overhead_coefficients(B)
        qs = np.arange(Q + 1, dtype=float)
        verify_extra = vx_a[:, None] + vx_s[:, None] * np.maximum(qs - 1, 0)[None, :]  # [B+1, Q+1]
        self._target_fwd = _Table(tgt.contexts, target_fwd, strict)
        self._target = _Table(tgt.contexts, target_fwd + verify_extra[:, None, :], strict)
        # Draft: j = k (0..Q-1).
        K = Q - 1
        ks = np.arange(K + 1, dtype=float)
        if self._draft_grid is not None:
            dg = self._draft_grid
            pair = _dense(dg.axes, dg.fitted(**fit), B, [min(self.catchup_tokens, dg.queries[-1]) if dg.queries[-1] > 1 else 1.0, 1.0])
            catch, one = pair[:, :, 0:1], pair[:, :, 1:2]
            fwd = np.where(ks[None, None, :] > 0, catch + np.maximum(ks - 1, 0)[None, None, :] * one, 0.0)
            contexts = dg.contexts
        else:
            contexts = np.array([0.0])
            fwd = np.broadcast_to(_DEFAULT_DRAFT_TOKEN * ks[None, None, :], (B + 1, 1, K + 1)).copy()
        extra = np.where(ks[None, :] > 0, dx_a[:, None] + dx_s[:, None] * ks[None, :], 0.0)  # [B+1, K+1]
        draft_strict = tuple(sorted(set(strict) | {2}))  # every extra drafted token adds a forward
        self._draft_fwd = _Table(contexts, fwd, draft_strict)
        self._draft = _Table(contexts, fwd + extra[:, None, :], draft_strict)
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
            coef[i, 0:2] = _fit_linear((k, d) for k, d, _, _ in entries if k > 0)
            coef[i, 2:4] = _fit_linear((k, v) for k, _, v, _ in entries)
            coef[i, 4:6] = _fit_linear((k, r) for k, _, _, r in entries)
        coef = np.maximum.accumulate(coef, axis=0)  # monotone in batch
        dense = np.zeros((B + 1, 6))
        for b in range(1, B + 1):
            dense[b] = np.maximum(_interp_axis(batches, coef, float(b)), 0.0)
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

    def _lookup(self, table: _Table, b: int, c: float, j: int) -> float:
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
        return _median(self._catchup) * max(tokens - self.catchup_tokens, 0.0)

    def catch_up_seconds(self, tokens: int) -> float:
        """Seconds for a lazy draft to run over `tokens` context tokens it missed (summed over rows):
        timed online once the host has reported catch-ups, else the profile's figure, else 0."""
        if tokens <= 0:
            return 0.0
        if self._lazy_catch_up:
            return _median(self._lazy_catch_up) * tokens
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
