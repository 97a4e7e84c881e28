"""A profile's grid of medians as dense, queryable tables: the shape `cost_model.CostModel` prices from.

Numpy only. A profile (see `adaptive_spec.profiling`) holds medians of timed forwards over batch size x
context length x query tokens; `Grid` holds one component's, `Grid.fitted` applies the rules below,
`dense_table` makes every batch size up to a limit explicit, and `Table` answers lookups.

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

Fit error: ``CostModel.loo_errors()`` holds out each measured grid cell in turn, rebuilds the grid without it
(steps 1-2), and compares the prediction with the measured median.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

__all__ = ["Grid", "Table", "dense_table", "LooPoint", "LooReport", "MONOTONE_MODES", "median", "fit_linear",
           "ragged_shares", "interp_axis"]


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


# ----------------------------------------------------------------------------- 1-D rules


def interp_axis(xs: np.ndarray, values: np.ndarray, x: float) -> np.ndarray:
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
        line[i] = float(interp_axis(px, py, xs[i]))


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


def ragged_shares(ragged: Any) -> dict[int, tuple[np.ndarray, np.ndarray]]:
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


def fit_linear(points: Iterable[tuple[float, float]]) -> tuple[float, float]:
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


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


# ----------------------------------------------------------------------------- grids


@dataclass(frozen=True)
class Grid:
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
    def from_rows(cls, rows: Sequence[Mapping[str, Any]], what: str) -> "Grid":
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


class Table:
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


def dense_table(axes: Sequence[np.ndarray], fitted: np.ndarray, max_b: int, qs: Sequence[float]) -> np.ndarray:
    """[max_b + 1, nc, len(qs)] values at integer batches 1..max_b and the given query tokens."""
    out = np.zeros((max_b + 1, len(axes[1]), len(qs)))
    for b in range(1, max_b + 1):
        plane = interp_axis(axes[0], fitted, float(b))  # [nc, nq]
        moved = np.moveaxis(plane, 1, 0)  # [nq, nc]
        for j, q in enumerate(qs):
            out[b, :, j] = interp_axis(axes[2], moved, float(q))
    out[0] = out[1]
    return out
