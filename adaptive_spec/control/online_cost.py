"""A step-cost model whose few parameters are shared by every (batch, K, context) cell, fitted online.

Numpy only, like `cost_model`, whose profile tables it reuses as the *shape* of each component;
what it learns are corrections on a handful of parameters, so one timed cell moves the price of
every cell that shares them (today's `CostModel.observe` corrects each (batch, K) cell apart).

Opt-in: ``SharedCostModel.from_profile(profile)`` or ``SharedCostModel.default()`` answer the same
queries as `CostModel` (`step_seconds_table`, `ragged_step_seconds`, `drafting_share`, ...).

Model. Let T(b, c, q) be the profile's verify time (target forward of q query tokens per row plus
the verify-side processing), D(b, c, p) its draft-loop time for p positions (0 for p = 0), R(b, k)
its rest of the step, all as `CostModel` builds them (measured knees kept), and c0 the smallest
profiled context. Each component is the profile's value split into telescoping parts, each with
its own scale (the prior is every scale = 1, i.e. the profile itself):

    verify(b, c, K) = v_base * T(1, c0, 1)                          fixed part of a verify
                    + v_rows * [T(b, c0, 1) - T(1, c0, 1)]          what more rows add
                    + v_first * [T(b, c0, min(q, 2)) - T(b, c0, 1)] the first extra query token
                    + v_more * [T(b, c0, q) - T(b, c0, min(q, 2))]  the further ones (knees kept)
                    + v_ctx * [T(b, c, q) - T(b, c0, q)]            context (KV reads)
                      with q = K + 1;
    draft(b, c, p)  = d_base * D(1, c0, 1) + d_rows * [D(b, c0, 1) - D(1, c0, 1)]
                    + d_more * [D(b, c0, p) - D(b, c0, 1)] + d_ctx * [D(b, c, p) - D(b, c0, p)]  (p > 0);
    rest(b, k)      = r * R(b, k).

A whole-step profile (vLLM's, no draft grid) puts the draft inside T: v_first is then the price of
a step's first draft (draft launch + one position + one verify token) and v_more that of each
further one, so a K = 3 step teaches the K = 1 price through both, in proportion to the prior's
uncertainty, instead of copying K = 3's ratio onto K = 1.

Fit. A step gives up to three linear observations y = x . theta (draft, verify and the rest of
the step, each with its own features; a step timed only as a whole gives one, with the summed
features). Each is divided by its prior prediction s = x . 1, so theta is dimensionless and the
noise is relative. The estimate is a Bayesian linear update in information form with forgetting
toward the prior:

    L <- L0 + lam * (L - L0) + w * u u' / noise^2,     h <- L0 1 + lam * (h - L0 1) + w * u t / noise^2,
    theta = L^-1 h,        L0 = C^-1 / prior_sd^2,        u = x / s,  t = y / s,

with w the row's robust weight (below) and `noise` (0.02) the nominal relative timing noise. The
prior is theta ~ N(1, prior_sd^2 C): each part of the profile is trusted to `prior_sd` (0.3, i.e.
+-30%), which weighs as much as (noise / prior_sd)^2 (~0.004) steps made of that part alone
(`prior_weight`); C has 1 on its diagonal and `prior_correlation` (0.5) between the size parts of
one component (verify's base, rows, first and more; draft's base, rows and more; the context parts
are independent, KV reads being a mechanism of their own): a profile wrong about one draft length is likely wrong
about the others the same way, so where steps cannot tell two parts apart (one K timed only) they
move together. Data fades with `forgetting` lam (an effective memory of 1 / (1 - lam) = 200 steps);
the prior does not, so a direction no step excites keeps its value. `CostModel.default()`'s generic
shape is a guess, not a measurement, whose scale may be off by orders of magnitude: in
`SharedCostModel.default()` each component's prior mean becomes its first timed row's ratio
measured / predicted (the machine's scale, empirical Bayes), with prior_sd = 1 on that.

Any step (`fits_any_step`). A host's step need not be a cell: vLLM's rows verify the lengths
drafted a step before while drafting others (`StepRecord.drafting`), ragged, with drafts dropped
inside the step. A step timed as a whole is one row whose features are those of each side priced
as the host prices it (a ragged side: K = 0's features plus each length's drafting share of the
increment to its cell, `drafting_share`) weighed over the two sides (`CostModel.drafting_weight`), with the draft positions
run standing for dropped drafts; so every step teaches, none is discarded. An untimed step (time 0)
teaches nothing and does not age what was learned.

Untimed lengths. `untimed_misfit(b, K)` is the relative misfit (`untimed_misfit`, 0.15) a price
may have at lengths no step within the memory (1 / (1 - lam) learned steps) timed in b's
power-of-two batch class, 0 at the others: the posterior is sure of parameters that were never
told apart, so its spread understates what a never-timed length may be off by. Goodput's price
probe reads it (`GoodputPolicy._price_probe`).

Outliers. A row's standardized residual is z = (t - u . theta) / sqrt(sigma^2 + u' L^-1 u):
the noise sigma (an exponentially weighted RMS of recent residuals, floored at `sigma_floor`)
plus the parameters' own uncertainty, so early misses of a wrong prior are learned. Huber
weights: w = 1 for |z| <= huber, huber / |z| up to `reject`, 0 beyond (the step is counted in
`outliers` and not learned).

Drift. A two-sided CUSUM per observation kind on z clipped to +-`reject` (g+ = max(0, g+ + z - slack),
g- likewise; alarm at `cusum_threshold`, reset after) detects a sustained shift a single outlier
cannot raise. `cusum_slack` is 1 (standard error): a profile's shape never fits a machine exactly, and
with the slack at 0.5 a cell misfit by 1 standard error on every step alarmed every ~25 steps (3-6
alarms in a real run of 550 steps at batch 1, up to 65 in a simulated 2,000), each one dropping what
was learned; a real shift of a part by 30% is several standard errors and still alarms within a few steps; an alarm (counted in `shifts`) keeps only `shift_keep` of the data's information
(L <- L0 + shift_keep * (L - L0), theta unchanged; shift_keep = 0 by default), so the band
widens to the prior's and the new level is learned from the next steps. Rows rejected as outliers still feed the CUSUM: a shift looks like outliers first.

Uncertainty. `price_spread(b, K)` is the posterior sd of step(K) - step(0) (the difference of the two
steps' features through the parameters' covariance), which goodput's `cost_exploration_z` turns
into optimism on a length's price (`GoodputPolicy._optimistic`).

Queries are O(1): per batch size the c0 part of every component is cached and refreshed lazily
after an update (one version counter), and a query adds the context term from one table lookup.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .cost_model import _BASE_FLOOR, _USUAL_CATCHUP, Corrections, CostModel, timed_step
from .profile_tables import median

__all__ = ["SharedCostModel", "PARAMETERS", "cost_model_for", "resolve_kind", "learned_summary", "print_learned",
           "COST_MODELS", "LEARNED_KEY"]

SHARED = ("v_base", "v_rows", "v_first", "v_more", "v_ctx", "d_base", "d_rows", "d_more", "d_ctx", "r")
_V, _D, _R = slice(0, 5), slice(5, 9), slice(9, 10)
DEVIATION_K = 16  # per-length deviations for K (verify) and positions (draft) 1..DEVIATION_K
_VDEV, _DDEV = slice(10, 10 + DEVIATION_K), slice(10 + DEVIATION_K, 10 + 2 * DEVIATION_K)
PARAMETERS = SHARED + tuple(f"v_dev{k}" for k in range(1, DEVIATION_K + 1)) + tuple(f"d_dev{p}" for p in range(1, DEVIATION_K + 1))
_KINDS = ("draft", "verify", "rest")  # the CUSUM and noise scale are kept per observation kind
COST_MODELS = ("cells", "shared")
LEARNED_KEY = "learned"  # a profile document's section holding a saved `learned_state`


class SharedCostModel(CostModel):
    """`CostModel`'s profile shape with the online correction of the module docstring."""

    fits_any_step = True  # learns ragged, lag-mismatched and stopped steps through their features

    def __init__(self, *args: Any, prior_sd: float = 0.3, noise: float = 0.02, forgetting: float = 0.995,
                 sigma_floor: float = 0.01, huber: float = 2.5, reject: float = 6.0, cusum_threshold: float = 12.0,
                 shift_keep: float = 0.0, cusum_slack: float = 1.0, prior_correlation: float = 0.5, deviation_sd: float = 0.05,
                 deviation_correlation: float = 0.7, untimed_misfit: float = 0.15, **options: Any):
        if not prior_sd > 0 or not noise > 0 or not 0 < forgetting <= 1 or not 0 <= shift_keep <= 1:
            raise ValueError("need prior_sd > 0, noise > 0, 0 < forgetting <= 1 and 0 <= shift_keep <= 1")
        if not 0 <= prior_correlation < 1:
            raise ValueError("need 0 <= prior_correlation < 1")
        self.prior_correlation = float(prior_correlation)
        if not 0 < huber < reject:
            raise ValueError("need 0 < huber < reject")
        if not deviation_sd > 0 or not 0 <= deviation_correlation < 1:
            raise ValueError("need deviation_sd > 0 and 0 <= deviation_correlation < 1")
        self.deviation_correlation = float(deviation_correlation)
        if not untimed_misfit >= 0:
            raise ValueError("need untimed_misfit >= 0")
        self.misfit = float(untimed_misfit)
        self.prior_sd, self.noise, self.deviation_sd = float(prior_sd), float(noise), float(deviation_sd)
        self.forgetting, self.sigma_floor = float(forgetting), float(sigma_floor)
        self.huber, self.reject = float(huber), float(reject)
        self.cusum_threshold, self.shift_keep = float(cusum_threshold), float(shift_keep)
        if not cusum_slack >= 0:
            raise ValueError("need cusum_slack >= 0")
        self.cusum_slack = float(cusum_slack)
        super().__init__(*args, **options)

    @classmethod
    def default(cls, *, default_prior_sd: float = 1.0, default_deviation_sd: float = 0.5,
                **options: Any) -> "SharedCostModel":
        options.setdefault("prior_sd", default_prior_sd)
        options.setdefault("deviation_sd", default_deviation_sd)
        model = super().default(**options)
        model.reset_corrections()  # again, now that it is known to be the generic shape
        return model

    # --- state ------------------------------------------------------------------------------------
    def reset_corrections(self) -> None:
        super().reset_corrections()
        n = len(PARAMETERS)
        # prior covariance: prior_sd^2 with `prior_correlation` between the parts of one component;
        # the per-length deviations independent, deviation_sd^2 each
        covariance = np.zeros((n, n))
        for block in (slice(0, 4), slice(5, 8)):  # the context parts (KV reads) are a mechanism of their own
            covariance[block, block] = self.prior_correlation * self.prior_sd ** 2
        covariance[np.diag_indices(len(SHARED))] = self.prior_sd ** 2
        # neighbouring lengths' deviations are alike (a knee spans a few lengths): correlation
        # `deviation_correlation` ** |K - K'|, so a timed length tells its unseen neighbours too
        lengths = np.arange(DEVIATION_K)
        smooth = self.deviation_sd ** 2 * self.deviation_correlation ** np.abs(lengths[:, None] - lengths[None, :])
        for block in (_VDEV, _DDEV):
            covariance[block, block] = smooth
        self._prior_info = np.linalg.inv(covariance)
        self._info = self._prior_info.copy()
        self._prior_mean = np.zeros(n)
        self._prior_mean[: len(SHARED)] = 1.0
        self._info_mean = self._prior_info @ self._prior_mean
        self.theta = self._prior_mean.copy()
        # the generic shape's scale is unknown: its prior mean takes each component's first ratio
        self._unscaled = {0: _D, 1: _V, 2: _R} if self.is_default else {}
        self._cov = np.linalg.inv(self._info)
        self._sigma = np.full(len(_KINDS), 0.05)  # relative noise per kind, before any residual
        self._cusum = np.zeros((len(_KINDS), 2))
        self.outliers = 0  # steps with a row rejected (|z| beyond `reject`)
        self.shifts = 0  # CUSUM alarms
        self.resumed_steps = 0  # steps learned before this start (a loaded learned state)
        self._version = 0
        self._rows: dict[int, tuple] = {}
        self._bases: dict[int, tuple] = {}
        self._spreads: dict[int, tuple] = {}
        self._timed_at: dict[tuple[int, int], int] = {}  # (batch class, K) -> learned steps when last timed
        self._c0 = float(self._target.contexts[0])
        self._d0 = float(self._draft.contexts[0])

    def corrections(self) -> Corrections:
        """The scale of each component's fixed part (v_base, d_base, r), for a summary."""
        return Corrections(float(self.theta[0]), float(self.theta[5]), float(self.theta[9]), self.observations)

    @property
    def prior_weight(self) -> float:
        """The prior's weight in steps made of one part alone: (noise / prior_sd)^2."""
        return (self.noise / self.prior_sd) ** 2

    def parameters(self) -> dict[str, float]:
        """The shared scales and the per-length deviations that moved off 0."""
        return {name: float(value) for i, (name, value) in enumerate(zip(PARAMETERS, self.theta))
                if i < len(SHARED) or abs(value) > 1e-9}

    def learned_state(self) -> dict:
        """What was learned, as plain data: the estimate and its information (the prior's part
        included), for a later start on the same machine (`load_learned_state`)."""
        return {"kind": "shared", "source": self.source, "parameters": list(PARAMETERS),
                "theta": [float(v) for v in self.theta], "information": self._info.tolist(),
                "prior_mean": [float(v) for v in self._prior_mean],
                "prior_information": self._prior_info.tolist(),  # forgetting fades toward it
                "observations": int(self.observations), "outliers": int(self.outliers), "shifts": int(self.shifts)}

    def load_learned_state(self, state: Any) -> None:
        """Start from a `learned_state()` (the noise scale and the CUSUM start afresh); raises
        ValueError naming what is malformed."""
        if not isinstance(state, dict) or state.get("kind") != "shared":
            raise ValueError("a learned cost state must be a mapping with kind 'shared'")
        if state.get("parameters") != list(PARAMETERS):
            raise ValueError("a learned cost state must name this model's parameters, in order")
        n = len(PARAMETERS)
        try:
            theta = np.asarray(state["theta"], dtype=float)
            information = np.asarray(state["information"], dtype=float)
            prior_mean = np.asarray(state["prior_mean"], dtype=float)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"a learned cost state lacks theta/information/prior_mean: {error}") from None
        if theta.shape != (n,) or prior_mean.shape != (n,) or information.shape != (n, n):
            raise ValueError("a learned cost state's theta, prior_mean and information have the wrong shapes")
        prior_information = np.asarray(state.get("prior_information", self._prior_info), dtype=float)
        if prior_information.shape != (n, n):
            raise ValueError("a learned cost state's prior_information has the wrong shape")
        if not all(np.isfinite(a).all() for a in (theta, information, prior_mean, prior_information)):
            raise ValueError("a learned cost state holds non-finite numbers")
        self.theta, self._info, self._prior_mean = theta, information, prior_mean
        self._prior_info = prior_information
        self._info_mean = information @ theta
        self._unscaled = {}
        self.observations = self.resumed_steps = int(state.get("observations", 0))
        self._solve()

    # --- features ---------------------------------------------------------------------------------
    def _verify_features(self, b: int, c: float, q: int) -> np.ndarray:
        t = lambda bb, cc, qq: self._lookup(self._target, bb, cc, qq)  # noqa: E731
        c0 = self._c0
        one, rows_one, first, at_q, full = t(1, c0, 1), t(b, c0, 1), t(b, c0, min(q, 2)), t(b, c0, q), t(b, c, q)
        x = np.zeros(len(PARAMETERS))
        x[_V] = one, rows_one - one, first - rows_one, at_q - first, full - at_q
        if 1 <= q - 1 <= DEVIATION_K:
            x[_VDEV.start + q - 2] = full
        return x

    def _draft_features(self, b: int, c: float, p: int) -> np.ndarray:
        x = np.zeros(len(PARAMETERS))
        if p <= 0:
            return x
        d = lambda bb, cc, pp: self._lookup(self._draft, bb, cc, pp)  # noqa: E731
        c0 = self._d0
        one, rows_one, at_p, full = d(1, c0, 1), d(b, c0, 1), d(b, c0, p), d(b, c, p)
        x[_D] = one, rows_one - one, at_p - rows_one, full - at_p
        if p <= DEVIATION_K:
            x[_DDEV.start + p - 1] = full
        return x

    def _basis(self, b: int) -> tuple:
        """Per batch size, once: the features at c0 of every q (verify) and p (draft), the
        profile's value there, and which parameter scales each one's context part."""
        hit = self._bases.get(b)
        if hit is None:
            Q = self.max_query_tokens
            verify = np.array([self._verify_features(b, self._c0, q) if q else np.zeros(len(PARAMETERS)) for q in range(Q + 1)])
            draft = np.array([self._draft_features(b, self._d0, p) for p in range(Q)])
            v_dev = [_VDEV.start + q - 2 if 1 <= q - 1 <= DEVIATION_K else None for q in range(Q + 1)]
            d_dev = [_DDEV.start + p - 1 if 1 <= p <= DEVIATION_K else None for p in range(Q)]
            hit = self._bases[b] = (verify, verify[:, 0:4].sum(axis=1).tolist(), v_dev,
                                    draft, draft[:, 5:8].sum(axis=1).tolist(), d_dev)
        return hit

    def _row(self, b: int) -> tuple:
        """Per batch size, cached until the next update: for every q (verify) and p (draft) the
        prediction at c0, the profile's value at c0 and the context part's coefficient, so a query
        adds only the context term (one table lookup)."""
        hit = self._rows.get(b)
        if hit is not None and hit[0] == self._version:
            return hit
        theta = self.theta
        verify, v_base, v_dev, draft, d_base, d_dev = self._basis(b)
        v_ctx = [float(theta[4] + (theta[i] if i is not None else 0.0)) for i in v_dev]
        d_ctx = [float(theta[8] + (theta[i] if i is not None else 0.0)) for i in d_dev]
        hit = self._rows[b] = (self._version, (verify @ theta).tolist(), v_base, v_ctx,
                               (draft @ theta).tolist(), d_base, d_ctx)
        return hit

    # --- queries ----------------------------------------------------------------------------------
    def target_seconds(self, batch: int, context: float, query_tokens: int, *, forward_only: bool = False) -> float:
        if forward_only:
            return super().target_seconds(batch, context, query_tokens, forward_only=True)
        if batch < 1 or query_tokens < 1:
            raise ValueError(f"need batch >= 1 and query_tokens >= 1, got {batch}, {query_tokens}")
        b, q = int(batch), int(query_tokens)
        if q > self.max_query_tokens:
            return max(float(self._verify_features(b, float(context), q) @ self.theta), 0.0)
        _, v_at, v_base, v_ctx, _, _, _ = self._row(b)
        full = self._lookup(self._target, b, float(context), q)
        return max(v_at[q] + v_ctx[q] * (full - v_base[q]), 0.0)

    def draft_seconds(self, batch: int, context: float, k: int, *, forward_only: bool = False) -> float:
        if forward_only or k <= 0:
            return super().draft_seconds(batch, context, k, forward_only=True) if k > 0 else super().draft_seconds(batch, context, k)
        if batch < 1:
            raise ValueError(f"need batch >= 1, got {batch}")
        b, p = int(batch), int(k)
        if p >= self.max_query_tokens:
            return max(float(self._draft_features(b, float(context), p) @ self.theta), 0.0)
        _, _, _, _, d_at, d_base, d_ctx = self._row(b)
        full = self._lookup(self._draft, b, float(context), p)
        return max(d_at[p] + d_ctx[p] * (full - d_base[p]), 0.0)

    def overhead_seconds(self, batch: int, k: int = 0) -> float:
        if batch < 1 or k < 0:
            raise ValueError(f"need batch >= 1 and k >= 0, got {batch}, {k}")
        return max(self._rest_base(int(batch), int(k)) * float(self.theta[9]), 0.0)

    def price_spread(self, batch: int, k_max: int) -> list[float]:
        """The posterior standard deviation of step(K) - step(0) at the smallest profiled context,
        K = 0..k_max (seconds): sqrt(dx' Cov dx) with dx the difference of the two steps' features
        (draft of K positions, verify of K + 1 tokens, the rest). Large for a length no step has
        timed that shares little with those that were; cached per batch size until the next update."""
        b, k_max = int(batch), int(k_max)
        hit = self._spreads.get(b)
        if hit is None or hit[0] != self._version or len(hit[1]) <= k_max:
            verify, _, _, draft, _, _ = self._basis(b)
            Q = self.max_query_tokens
            upto = min(k_max, Q - 1)
            steps = verify[1:upto + 2] + draft[:upto + 1]
            steps[:, 9] = [self._rest_base(b, k) for k in range(upto + 1)]
            difference = steps - steps[0]
            spread = np.sqrt(np.maximum(np.einsum("ij,jk,ik->i", difference, self._cov, difference), 0.0)).tolist()
            spread += [spread[-1]] * (k_max - upto)  # beyond the profile's lengths: its last one's
            hit = self._spreads[b] = (self._version, spread)
        return hit[1][: k_max + 1]

    def untimed_misfit(self, batch: int, k_max: int) -> list[float]:
        """Per K = 0..k_max: `misfit` (0.15: the committed profiles' tables miss by 11-15% leave-one-
        out) for a length no step of a like batch size (same power of two) timed within the model's
        memory (1 / (1 - forgetting) learned steps), else 0. The posterior spread of such a length's
        price is only as good as the profile's shape: steps at K = 1 alone cannot tell a slower
        machine from a dearer draft, and may price K = 0 far off with a small spread. Goodput reads
        it to price a probe of that length (`GoodputPolicy._price_probe`)."""
        memory = 1.0 / (1.0 - self.forgetting) if self.forgetting < 1 else float("inf")
        group = int(batch).bit_length()
        return [0.0 if self.observations - self._timed_at.get((group, k), -math.inf) <= memory else self.misfit
                for k in range(int(k_max) + 1)]

    # --- learning ---------------------------------------------------------------------------------
    def observe(self, record: Any) -> None:
        """Learn from one engine step (a `StepRecord`); see the module docstring. A step timed only
        as a whole (no draft or verify part) is one row whatever its shape (`_step_features`)."""
        step = timed_step(record)
        if step is None:
            return
        b, k, c, draft, verify, total, positions, catchup = step
        rows: list[tuple[int, np.ndarray, float]] = []  # (kind, features, measured seconds)
        if not (draft > 0 or verify > 0):
            if total > 0:
                rows.append((1, self._step_features(b, c, record, positions).sum(axis=0), total))
        else:
            if positions > 0 and draft > 0:
                x = self._draft_features(b, c, positions)
                if catchup > _USUAL_CATCHUP:  # a long catch-up is its own cost, not the draft tokens'
                    expected = float(x @ self.theta)
                    self._catchup.append(max(draft - expected, 0.0) / (catchup - self.catchup_tokens))
                else:
                    rows.append((0, x, draft))
            if verify > 0:
                rows.append((1, self._verify_features(b, c, k + 1), verify))
            rest = total - draft - verify
            if total > 0 and rest >= 0:
                x = np.zeros(len(PARAMETERS))
                x[9] = self._rest_base(b, k)
                rows.append((2, x, max(rest, _BASE_FLOOR)))
        if not rows:
            return  # an untimed step teaches nothing, and fades nothing
        drafting = getattr(record, "drafting", ()) or ()
        for length in {int(record.batch_k), *([max(int(k) for k in drafting)] if drafting else [])}:
            self._timed_at[b.bit_length(), length] = self.observations
        self._forget()
        rejected = [self._learn(kind, x, y) for kind, x, y in rows]
        self.outliers += any(rejected)
        self._solve()
        self.observations += 1

    def _cell_features(self, b: int, c: float, k: int, positions: int) -> np.ndarray:
        """Draft, verify and rest features (one row each) of a uniform step at K = k whose draft
        loop ran `positions` forwards."""
        x = np.zeros((3, len(PARAMETERS)))
        x[0] = self._draft_features(b, c, positions)
        x[1] = self._verify_features(b, c, k + 1)
        x[2, 9] = self._rest_base(b, k)
        return x

    def _side_features(self, b: int, c: float, ks: list[int], positions: int) -> np.ndarray:
        """A step whose rows draft `ks`: the K = 0 step plus the drafting share of the increment to
        the (b, max ks) cell, as `ragged_step_seconds` prices it (share 1 without ragged shares)."""
        K = max(ks, default=0)
        cell = self._cell_features(b, c, K, max(positions, K))
        share = self.drafting_share(b, K, sum(ks) / K) if K else 1.0
        if share >= 1.0:
            return cell
        base = self._cell_features(b, c, 0, 0)
        return base + share * (cell - base)

    def _step_features(self, b: int, c: float, record: Any, positions: int) -> np.ndarray:
        """Features of any step from the lengths its rows verified (`outcomes[i].k`) and, where the
        host drafts other lengths in the same step (vLLM's one-step lag, `StepRecord.drafting`),
        those: uniform, ragged, lag-mismatched and stopped steps alike, none set aside. A
        lag-mismatched step costs its two sides' steps weighed by `drafting_weight` (it verifies one
        length and drafts another, where a profiled whole step does both at one), as the controller
        and the simulator price it (`step_timing.mixed_step_seconds`)."""
        verified = [int(o.k) for o in getattr(record, "outcomes", ())] or [int(record.batch_k)] * b
        drafting = [int(k) for k in getattr(record, "drafting", ())]
        if not drafting:
            return self._side_features(b, c, verified, positions)
        run = max(int(getattr(record, "draft_positions", 0) or 0), max(drafting))  # forwards the draft ran
        if run > max(drafting) and not self.has_draft:  # a whole-step shape prices a dropped draft's
            drafting = [run if k == max(drafting) else k for k in drafting]  # forward as a longer step
        weight = self.drafting_weight(b)
        return (1 - weight) * self._side_features(b, c, verified, max(verified)) + weight * self._side_features(b, c, drafting, run)

    def _forget(self) -> None:
        lam = self.forgetting
        if lam < 1:
            prior_mean = self._prior_info @ self._prior_mean
            self._info = self._prior_info + lam * (self._info - self._prior_info)
            self._info_mean = prior_mean + lam * (self._info_mean - prior_mean)

    def _learn(self, kind: int, x: np.ndarray, y: float) -> bool:
        """Fold one row in; True if it was rejected as an outlier."""
        scale = float(x @ self._prior_mean)  # the prior's prediction
        if not (scale > _BASE_FLOOR and math.isfinite(y)):
            return False
        u, target = x / scale, y / scale
        if self._unscaled:
            whole = bool(x[9]) and bool(x[_V].any())  # a step timed as a whole: every component at once
            for part in (_D, _V, _R) if whole else (self._unscaled.get(kind),):
                if part is not None and part in self._unscaled.values():
                    self._rescale_prior(part, target)
                    self._unscaled = {k: b for k, b in self._unscaled.items() if b != part}
        residual = target - float(u @ self.theta)
        sigma = max(float(self._sigma[kind]), self.sigma_floor)
        z = residual / math.sqrt(sigma * sigma + float(u @ self._cov @ u))
        self._track_shift(kind, z)
        size = abs(z)
        if size > self.reject:
            return True
        weight = 1.0 if size <= self.huber else self.huber / size
        precision = weight / self.noise ** 2
        self._info += precision * np.outer(u, u)
        self._info_mean += precision * u * target
        # noise scale: an exponentially weighted RMS of the learned rows' residuals
        self._sigma[kind] = math.sqrt(0.95 * self._sigma[kind] ** 2 + 0.05 * min(residual * residual, (self.reject * sigma) ** 2))
        return False

    def _rescale_prior(self, part: slice, ratio: float) -> None:
        """The generic shape's prior mean for one component: its first measured / predicted ratio
        (the theta of that component moves with it, the information is the prior's)."""
        ratio = min(max(ratio, 1e-3), 1e4)
        self._prior_mean[part] = ratio
        self.theta[part] = ratio
        # the prior sd is relative to the prior mean (prior_sd = 1: +-100%), and the deviations are in
        # the component's units: both scale with it
        deviations = {_V.start: _VDEV, _D.start: _DDEV}.get(part.start)
        for block in (part, deviations) if deviations is not None else (part,):
            for info in (self._prior_info, self._info):
                info[block, block] /= ratio * ratio
        self._info_mean = self._info @ self.theta
        self._cov = np.linalg.inv(self._info)

    def _track_shift(self, kind: int, z: float) -> None:
        clipped = min(max(z, -self.reject), self.reject)
        g = self._cusum[kind]
        g[0] = max(0.0, g[0] + clipped - self.cusum_slack)
        g[1] = max(0.0, g[1] - clipped - self.cusum_slack)
        if max(g) > self.cusum_threshold:
            g[:] = 0.0
            self.shifts += 1
            # keep the estimate, drop most of the data's information: the new level is learned fast
            self._info = self._prior_info + self.shift_keep * (self._info - self._prior_info)
            self._info_mean = self._info @ self.theta
            self._cov = np.linalg.inv(self._info)

    def _solve(self) -> None:
        self._cov = np.linalg.inv(self._info)
        self.theta = self._cov @ self._info_mean
        self._version += 1

    def draft_catchup_seconds(self, tokens: int) -> float | None:
        if not self._catchup:
            return None
        return median(self._catchup) * max(tokens - self.catchup_tokens, 0.0)


def learned_summary(model: Any) -> dict | None:
    """What a policy's cost model learned in a run, for a bench row: steps learned from; for the
    shared model the steps it set aside as outliers and the sustained shifts it detected."""
    if model is None or not hasattr(model, "observations"):
        return None
    shared = isinstance(model, SharedCostModel)
    return {"kind": "shared" if shared else "cells", "observations": int(model.observations),
            "outliers": int(model.outliers) if shared else None, "shifts": int(model.shifts) if shared else None}


def print_learned(rows: list[dict]) -> None:
    """One line per bench row that carries a `cost_model` summary (`learned_summary`)."""
    for row in rows:
        learned = row.get("cost_model")
        if learned:
            events = f", {learned['outliers']} outliers, {learned['shifts']} shifts" if learned["kind"] == "shared" else ""
            sweep = row.get("calibration")  # `price_sweep.sweep_summary`
            if sweep:
                events += f"; a start-up sweep of K = 0..{sweep['max_k']} took {sweep['steps']} of them"
            print(f"[{row['config']} at t={row['temperature']}: cost model {learned['kind']} learned from "
                  f"{learned['observations']} steps{events}]")


def resolve_kind(kind: str | None, saving: bool, *, kind_name: str = "--cost-model",
                 save_name: str = "--save-learned") -> str:
    """Which cost model to build: `kind` as asked; unset, shared when a learned state is to be saved
    (`saving`), else cells. An unknown kind, or cells while saving (the per-cell correction has no
    state), is a ValueError naming the settings as the user gave them (`kind_name`, `save_name`)."""
    if kind not in (None, *COST_MODELS):
        raise ValueError(f"{kind_name} must be one of {', '.join(COST_MODELS)}, got {kind!r}")
    if saving and kind == "cells":
        raise ValueError(f"{save_name} needs {kind_name} shared: the per-cell correction has no state to save")
    return kind or ("shared" if saving else "cells")


def cost_model_for(profile: Any, kind: str = "cells", *, whole_step: bool = False, **options: Any) -> CostModel:
    """A fresh cost model of `kind` ("cells": `CostModel`'s per-cell correction; "shared": the
    shared-parameter model above) from a profile document, or the generic shape for None.
    `whole_step`: the generic shape for a host that times whole steps (vLLM): it claims no draft
    forward timed apart (`has_draft` False), as a vLLM profile does, so a policy charges a dropped
    draft as the step increment the host charges, not as the generic draft forward alone.

    A document with a `learned` section (`profiling.profile_file.learned_profile`: a shared model's
    state saved after a run) gives the shared model, resumed where that run ended, whatever `kind`
    says: the state is that model's. Its shape is the document's tables, or the generic one."""
    if kind not in COST_MODELS:
        raise ValueError(f"cost model must be one of {', '.join(COST_MODELS)}, got {kind!r}")
    learned = profile.get(LEARNED_KEY) if isinstance(profile, Mapping) else None
    if learned is not None:
        return _resume(profile, learned, **options)
    cls = SharedCostModel if kind == "shared" else CostModel
    if profile is not None:
        return cls.from_profile(profile, **options)
    return _generic(cls, whole_step, **options)


def _generic(cls, whole_step: bool, **options: Any) -> CostModel:
    model = cls.default(**options)
    if whole_step:
        model._draft_grid = None  # the draft table stays (the shape's draft part); has_draft reads the grid
    return model


def _resume(document: Mapping, learned: Any, **options: Any) -> SharedCostModel:
    """The shared model of a saved `learned` section; ValueError naming what is malformed."""
    if not isinstance(learned, Mapping) or learned.get("shape") not in ("profile", "generic"):
        raise ValueError("a profile's 'learned' section must be a mapping with shape 'profile' or 'generic'")
    if learned["shape"] == "generic":
        model = _generic(SharedCostModel, bool(learned.get("whole_step")), **options)
    else:
        model = SharedCostModel.from_profile(document, **options)
    model.load_learned_state(learned.get("state"))
    return model
