"""The goodput policy: per request and step, the k that maximises expected emitted tokens per second.

Two decisions per step, both maximising the step's expected goodput

    goodput(K) = sum_i E_i[emitted | min(K, k_i)] / step_seconds(B, c, K)

over the batch's draft length K (the engine drafts and verifies K columns for the whole batch, so a
step's cost follows K; `cost_model` gives step_seconds from a measured profile, corrected online).

1. Before drafting (`choose`): whether to draft at all, and how far. E_i uses request i's acceptance estimator
   (`acceptance.py`: per-position rates learned from its outcomes, optimistic by `exploration_z`
   posterior deviations). K = 0, speculation off, wins whenever nothing pays; otherwise every row
   may draft up to `max_k` (its cap), and decision 2 ends the draft. A host that cannot stop a
   draft inside the step (`host_stops_drafts` False, e.g. the vLLM plug-in with n-gram drafts)
   gets the best K.
2. Inside the step (`keep_drafting`, called at each draft position with each drafting row's draft
   confidence, after the forward that produced it): drop that draft and stop, keep it and stop
   (KEEP_LAST: no further forward), or keep it and draft on. A row's chance that every draft so far survives is the
   product of its calibrated acceptance probabilities (`calibration.py`: a logistic fit of the
   draft's confidence, shared by the drafter's requests, with a per-request offset); positions
   not drafted yet use the estimator's rates. Every final length J from the current position to
   the largest k is compared, not just the next one: on CPUs verify cost is not monotone in K (a
   3-draft verify can be cheaper than a 2-draft one), and stopping at the first knee would miss the
   cheaper length behind it. The forwards already run are part of every option's cost. Once steps
   have been timed, options are scored as expected tokens minus (recent tokens/s) x seconds, the
   long-run form of the same objective: a ratio within one step would count its sunk draft time
   against stopping and keep drafting past the point where the time earns more in the next step.
   Rows whose survival falls below `min_row_survival` stop alone (a row of padding costs the draft
   nothing). At batch 1 (once steps are timed, and where a step is long enough that it costs under
   1% of one) a longer ending is valued with the option to stop at a later position
   (`stopping.py`, backward induction over the row's own recent confidences): a fixed-length
   forecast at the mean undervalues drafting on when the next draft's confidence will tell.

Forecast correction (batch > 1, `forecast_correction`): the estimator learns only from drafts the
in-step rule kept, which it picked for their confidence, so `choose` forecasts more than drafting
then earns (on prose at batch 64, realised goodput of drafting steps was ~0.83 of the forecast, and
drafting lost to K = 0). `choose` scales its drafting options by realised / forecast goodput of
recent steps that drafted by choice (`forecast_scale`); while the batch does not draft the
correction fades, so it cannot hold K = 0. At batch 1 the option-valued in-step rule already prices
stopping, and there the correction measured worse, so it is off.

K = 0 is never absorbing:
- evidence ages while a request does not draft (estimator decay), so its optimism grows back;
- a request that has not drafted for `probe_interval` steps gets a probe of `probe_k` drafts
  (0 = the length that costs least per informative token on the profiled machine: positions up to
  the first rejection inform, those after it do not); the interval doubles after each probe that
  did not bring drafting back, up to the interval at which probing a useless drafter costs
  `probe_budget` (3%) of the time spent without speculation (never above `max_probe_interval`),
  which bounds how long a drafter that has become good again waits;
- probes share their step: a step's verify follows its longest draft, so the rows at k = 0 that
  have nothing to catch up probe beside a due probe at its length (and back off with it), and the
  in-step rule keeps other rows' drafts up to a probe's length, where dropping them saves nothing;
- at batch > 1 a step of probes alone (no row drafts by choice) costs the whole batch, so such
  steps also back off for the batch (`_batch_may_probe`): arrivals, each with its own fresh
  interval, would otherwise make a batch whose drafter does not pay probe every `probe_interval`;
- a probe whose drafts were all accepted is read as a changed regime: the request's old evidence is
  dropped, its interval reset, and it probes again on the next step, so drafting resumes at once
  and goes on until the new evidence makes it pay by itself (or a probe fails). In a step of probes
  alone this holds only if every probe was full or the step emitted what its time would have at
  K = 0 (`_full_probes`): at batch 64 a mediocre drafter's 1-draft probes always have some chance
  successes, which would chain probe steps without end;
- the shared prior forgets at 0.98 per outcome, so a bad phase fades from it within ~50 outcomes.
The draft cache's catch-up after steps without speculation is timed as its own cost in the cost
model (not folded into the per-token draft cost). In our engine it is a token or two per row plus
those emitted at K = 0, and is not charged to the decision that resumes drafting. A host whose draft
skips K = 0 steps entirely (vLLM's lazy draft) reports per row the tokens its draft has missed
(`RequestView.draft_behind`: the whole prompt, for a request that has never drafted) and drafts for
the rows given k > 0 alone. A row that drafts again catches up first, at the cost model's
`catch_up_seconds`. That is an investment in the row's drafting for the rest of the request, so
`choose` charges it spread over the steps the row has left at each K, and at each K only the rows
whose added tokens pay for their own charge draft (`_drafting_rows`): a prompt whose draft prefill
its few remaining tokens cannot repay stays at k = 0 while the rows beside it draft. A probe of a
row that does not draft pays its whole catch-up, so it waits until its request's time without
speculation covers that at `probe_budget`.

Where a step's cost follows its drafted tokens rather than its longest draft (vLLM, whose lazy draft
runs for the drafting rows alone; the cost model's `drafting_share`, from a profile's measured
ragged steps), `price_ragged_steps` prices drafting per row: the first drafting row pays its share
of the batch's drafting increment, each further row its own part, so at each K only the rows whose
tokens pay for their part draft (`_drafting_rows`) and a probe costs the batch one row's share.
Otherwise (the default) every row drafts for free once one does.

Warm start: `state()` / `load_state()` carry the prior and the calibration across processes (the
CLI keeps them beside the profile).

Hosts that choose the next step's draft lengths before they report this step's outcomes (vLLM)
say so in `StepRecord.lag`: each outcome is matched to the choice that drafted it (its probe, its
confidences for the calibration), and a row whose drafts are still unverified is not probed again.

Price probes (`price_probe_horizon`): a cost model that can say which lengths' prices no recent
step timed (`untimed_misfit`: the shared model, per power-of-two batch class) may have `choose` run
such a length for one step where the expected gain of knowing its price over the horizon beats
what the step gives up (`_price_probe`, a value-of-information rule, never a blind epsilon).
Under vLLM's lag a batch drafting at K = 1 never times a K = 0 step, so without it a model that
learned only K = 1 can stay sure of a wrong K = 0 price.

Flapping guard: the decision before drafting changes K only when the new best beats the current
K's goodput by more than `hysteresis`, unless staying at the current K would need a catch-up.

Latency guard (batch > 1, `_token_seconds_cap`): every row of a step waits for the whole step, so a
row that drafts little pays for its neighbours' long drafts in time per token (the step's seconds
over the tokens it emits). Goodput alone would make a chat request beside code requests slower per
token than without speculation, at no gain to the batch's throughput that the row notices. So each
option before drafting, each ending inside the step and each acceptance probe is held to a cap on
every row's expected seconds per token: `tpot_target` seconds where set (`--slo-tpot`), else
`latency_factor` times the step at K = 0 (where a row emits one token). A price probe, one rare
step, may pass it (see `choose`). Among the options within the cap the best
goodput wins; where none is within it, the one whose slowest row is fastest. At batch 1 the cap never
binds (the row's seconds per token are the inverse of the step's goodput, which the policy maximises
already). The cap is on the decode step as the cost model prices it: a step that prefills a prompt
beside the rows, or a host's time between steps, is beyond what the choice of k can bound.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from .acceptance import AcceptanceEstimator, AcceptancePrior, expected_emitted
from .calibration import ConfidenceCalibration, RequestOffset
from .policy import KEEP_LAST, PolicyBase, RequestView, StepRecord
from .step_cost import StepCost, check_step_cost
from .stopping import continuation_values, decide

_RECENT = 32  # draft confidences kept per request (and, pooled, per policy) for option stopping
_OWN = 8  # a request uses its own once it has this many; before, the pool's
_QUANTILES = 8  # the sample of next-draft acceptance is cut to this many quantiles


@dataclass(frozen=True)
class GoodputConfig:
    max_k: int = 12
    hysteresis: float = 0.03
    exploration_z: float = 0.5
    cost_exploration_z: float = 0.3  # optimism on uncertain step prices (`_optimistic`)
    # Steps a probe of an untimed length's price serves (`_price_probe`): the shared cost model's
    # memory, 1 / (1 - forgetting); 0 never probes a price.
    price_probe_horizon: int = 200
    request_decay: float = 0.9
    prior_strength: float = 2.0
    prior_rate: float = 0.6
    probe_interval: int = 8
    max_probe_interval: int = 128
    probe_k: int = 0  # 0 = cheapest per informative token from the cost model
    probe_budget: float = 0.03  # probes of a useless drafter cost at most this share of the time at k = 0
    stop_inside_step: bool = True
    min_row_survival: float = 0.05
    option_stopping: bool = True  # at batch 1, value drafting on with the option to stop later (stopping.py)
    option_min_step_seconds: float = 0.05  # ... when a step takes this long: its tables cost ~0.3 ms a step
    price_catch_up: bool = True  # charge a lazy draft's catch-up (RequestView.draft_behind); False ignores it
    # Price drafting per row where the cost model knows ragged steps (vLLM profiles with `ragged`
    # shares): only rows whose tokens pay for their part draft. Off by default: simulated under
    # Poisson load it drafted more and earned less than pricing every step by its longest draft.
    price_ragged_steps: bool = False
    # At batch > 1, scale the drafting options in `choose` by how their forecasts have come out
    # (`forecast_scale`); each step's evidence decays by `forecast_decay`.
    forecast_correction: bool = True
    forecast_decay: float = 0.9
    # The latency guard (module docstring): every row's expected seconds per token in a step of
    # batch > 1 at most `tpot_target` seconds if set, else `latency_factor` x the step at K = 0
    # (None: no guard).
    tpot_target: float | None = None
    latency_factor: float | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.max_k >= 0, "max_k must be >= 0"),
            (0 <= self.hysteresis < 1, "hysteresis must be in [0, 1)"),
            (self.exploration_z >= 0, "exploration_z must be >= 0"),
            (self.cost_exploration_z >= 0, "cost_exploration_z must be >= 0"),
            (self.price_probe_horizon >= 0, "price_probe_horizon must be >= 0"),
            (0 < self.request_decay <= 1, "request_decay must be in (0, 1]"),
            (self.prior_strength > 0, "prior_strength must be > 0"),
            (0 < self.prior_rate < 1, "prior_rate must be in (0, 1)"),
            (1 <= self.probe_interval <= self.max_probe_interval, "need 1 <= probe_interval <= max_probe_interval"),
            (self.probe_k >= 0, "probe_k must be >= 0 (0 = automatic)"),
            (0 < self.probe_budget <= 1, "probe_budget must be in (0, 1]"),
            (0 <= self.min_row_survival < 1, "min_row_survival must be in [0, 1)"),
            (self.option_min_step_seconds >= 0, "option_min_step_seconds must be >= 0"),
            (0 < self.forecast_decay < 1, "forecast_decay must be in (0, 1)"),
            (self.tpot_target is None or self.tpot_target > 0, "tpot_target must be > 0 seconds (None: no target)"),
            (self.latency_factor is None or self.latency_factor >= 1, "latency_factor must be >= 1 (None: no guard)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"goodput policy: {message}")


@dataclass
class _RequestState:
    estimator: AcceptanceEstimator
    offset: RequestOffset
    steps_off: int = 0
    probe_interval: int = 8
    probing: bool = False
    resume: bool = False  # its last probe was fully accepted: probe again on the next step
    confidences: deque = field(default_factory=lambda: deque(maxlen=_RECENT))  # its recent draft confidences


@dataclass
class _Row:
    """One row of the step being drafted."""

    state: _RequestState
    limit: int  # most drafts this row may make
    rates: list[float]  # estimator rates for positions not drafted yet
    probe_k: int = 0  # > 0: a probe, which keeps this many drafts whatever the forecast
    probe_bar: float = 0.0  # in a step of probes alone: the tokens it must emit to pay for itself
    confidences: list[float] = field(default_factory=list)
    survival: float = 1.0  # P(every kept draft accepted)
    expected: float = 1.0  # E[emitted] with the kept drafts
    drafting: bool = True
    kept: bool | int = False  # the last answer about this row


@dataclass
class GoodputPolicy(PolicyBase):
    cost_model: StepCost
    config: GoodputConfig = field(default_factory=GoodputConfig)
    name: str = "goodput"

    def __post_init__(self) -> None:
        check_step_cost(self.cost_model)
        positions = max(self.config.max_k, 1)
        self.prior = AcceptancePrior(max_positions=positions, initial_rate=self.config.prior_rate)
        # Requests of another acceptance group (RequestView.group: a grammar's forced tokens are
        # accepted for sure) learn a prior of their own, started from this one when first seen.
        self.group_priors: dict[str, AcceptancePrior] = {}
        self.calibration = ConfidenceCalibration(positions=positions)
        self._requests: dict[str, _RequestState] = {}
        self._batch_k = 0
        self._step: list[_Row] = []  # the step being drafted, in the order `choose` saw it
        # Rows per request of the choices whose outcomes have not been observed, oldest first: one
        # where a host verifies each choice before choosing again, two in vLLM (`StepRecord.lag`).
        self._unobserved: deque = deque(maxlen=4)
        self._forecasts: deque = deque(maxlen=4)  # beside it: each choice's forecast goodput, if it drafted by choice
        self._forecast_seen = [0.0, 0.0]  # decayed sums of (realised, forecast) goodput of drafting steps
        self._costs: list[float] = []  # step_seconds per K for the step being drafted
        self._cap: float | None = None  # the latency guard's cap on a row's seconds per token this step
        self._batch: tuple[int, float] = (1, 0.0)  # its batch size and context
        self.last_goodput: list[float] = []  # goodput per K at the last choice, for inspection
        self.rate_ema: float | None = None  # tokens per predicted second of recent steps
        self._pool: deque = deque(maxlen=2 * _RECENT)  # recent draft confidences of all requests
        self._options: tuple | None = None  # option-stopping tables of the step being drafted
        # Steps since the batch last ran probes alone, and the interval such steps wait (batch > 1).
        self._since_probe_step, self._probe_step_interval = 0, self.config.probe_interval
        self.price_probes = 0  # choices of a batch K to time an untimed length's price (`_price_probe`)

    # --- decision 1: draft at all? -----------------------------------------------------------
    def choose(self, requests: Sequence[RequestView]) -> list[int]:
        self._step, self._options, self._cap = [], None, None
        self._unobserved.append({})  # first, so a choice that fails still keeps outcomes in step
        self._forecasts.append(None)
        if not requests:
            return []
        states = self._states_for(requests)
        k_max = min(self.config.max_k, max(r.max_k for r in requests))
        if k_max == 0:
            return [0] * len(requests)
        context = max(r.context_length for r in requests)
        self._batch = (len(requests), context)
        self._costs = costs = self.cost_model.step_seconds_table(len(requests), context, k_max)
        expected = [_expected_prefix(state.estimator.optimistic_rates(k_max, self.config.exploration_z), k_max)
                    for state in states]
        seconds_per_behind = self._catch_up_rate(requests)
        shares = self._row_shares(len(requests), k_max)
        priced = self._optimistic(costs, len(requests), k_max)
        options = [_drafting_rows(k, requests, expected, priced[0], priced[k], seconds_per_behind, shares[k])
                   for k in range(k_max + 1)]
        self.last_goodput = [goodput for goodput, _, _ in options]
        if self.config.forecast_correction and len(requests) > 1:
            scale = self.forecast_scale()
            self.last_goodput[1:] = [goodput * scale for goodput in self.last_goodput[1:]]
        self._cap = cap = self._token_seconds_cap(len(requests), costs[0])
        within = list(range(k_max + 1))
        if cap is not None:
            # Tokens at the estimators' means: optimism explores, a bound must not lean on it. A
            # catch-up counts as `options` charges it, spread over the drafting rows' remaining
            # steps: it is paid once, and a row's time per token is its time over all its tokens.
            means = [_expected_prefix(state.estimator.rates(k_max), k_max) for state in states]
            slowest = [_slowest_row(costs[k] + catch_up, rows, requests, means, k)
                       for k, (_, rows, catch_up) in enumerate(options)]
            within = [k for k in within if slowest[k] <= cap] or [min(within, key=slowest.__getitem__)]
        best = max(within, key=self.last_goodput.__getitem__)
        current = min(self._batch_k, k_max)
        # Hysteresis spares the cost of flapping where no option prices it. A move that needs a
        # catch-up has that cost priced in (staying at a K that needs one is not free either), so
        # neither end of such a move is protected: a lazy draft's K = 0 would otherwise hold every
        # row whose drafting pays by less than the hysteresis, and those rows never learn it pays more.
        protected = not options[current][2] and not options[best][2]
        if (protected and current in within
                and self.last_goodput[best] <= self.last_goodput[current] * (1 + self.config.hysteresis)):
            best = current
        # a price probe times a length in one step: not one no row would draft, nor one whose rows must
        # first catch up (that cost is paid in full for one step's evidence; acceptance probes resume them).
        # It may pass the latency guard's cap for that step: held to it, a batch never times the long
        # lengths whose prices teach the shared model what drafting costs at this batch size.
        probe = self._price_probe(best, len(requests), k_max,
                                  {k for k, (_, rows, catch_up) in enumerate(options) if k == 0 or (rows and not catch_up)})
        if probe != best:
            best = probe
            self.price_probes += 1
        self._batch_k = best
        drafting = set(options[best][1])
        if drafting:
            self._forecasts[-1] = options[best][0]  # unscaled: the scale learns how raw forecasts come out
        # A probe of a row that does not draft makes that row catch up, in full.
        probe_catch_up = [0.0 if index in drafting else seconds_per_behind * r.draft_behind
                          for index, r in enumerate(requests)]
        # What a probe costs the batch: one row's share of the drafting increment where the host's
        # step follows its drafted tokens (vLLM), the whole increment where it follows its longest draft.
        probe_costs = [costs[0]] + [costs[0] + (cost - costs[0]) * share[0] for cost, share in zip(costs[1:], shares[1:])]
        # Under the latency guard a probe may lengthen the step only as far as a row emitting one
        # token stays within the cap (a probe up to the batch's own drafting length adds nothing).
        longest = len(probe_costs) - 1
        if cap is not None:
            longest = max(best if drafting else 0, max((k for k, c in enumerate(probe_costs) if c <= cap), default=0))
        probes = (self._probes(requests, states, probe_costs[:longest + 1], probe_catch_up, drafting)
                  if longest else [0] * len(requests))
        # A step of probes alone pays for itself if it emits what its time would have at K = 0.
        bar = len(requests) * probe_costs[max(probes)] / costs[0] if not drafting and any(probes) and costs[0] > 0 else 0.0
        upper = k_max if self.config.stop_inside_step and self.host_stops_drafts else best
        ks = [max(min(upper, r.max_k), probe) if index in drafting else probe
              for index, (r, probe) in enumerate(zip(requests, probes))]
        self._step = [_Row(state, k, state.estimator.rates(k) if k else [], probe_k=probe, probe_bar=bar if probe else 0.0)
                      for state, k, probe in zip(states, ks, probes)]
        self._unobserved[-1] = dict(zip((r.request_id for r in requests), self._step))
        return ks

    # --- decision 2: keep this draft, and draft on? -----------------------------------------
    def keep_drafting(self, position: int, confidences: Sequence[float | None]) -> list[bool | int]:
        rows = self._step
        if len(rows) != len(confidences):  # not the step this policy chose: keep what is shown
            return [c is not None for c in confidences]
        shown, pool, predict = [], self._pool, self.calibration.predict
        for row, confidence in zip(rows, confidences):
            if confidence is None or not row.drafting:
                row.drafting = False
                continue
            seen = float(confidence)
            row.confidences.append(seen)
            row.state.confidences.append(seen)
            pool.append(seen)
            shown.append((row, row.survival * predict(confidence, position, row.state.offset)))
        if not shown:
            return [False] * len(rows)
        deciding = [(row, survival) for row, survival in shown if row.probe_k <= position]
        if not deciding or not self.config.stop_inside_step:
            verdict = True
        elif len(rows) == 1 and self.rate_ema is not None and self._options_pay():
            verdict = self._option_ending(position, *deciding[0])
        else:
            verdict = self._best_ending(position, deciding)
        for row, survival in shown:
            if row.probe_k > position:  # a probe keeps its drafts whatever the forecast: that is how it learns
                answer = True if position + 1 < row.probe_k else KEEP_LAST
            elif survival < self.config.min_row_survival:
                answer = False
            else:
                answer = verdict
            row.kept, row.drafting = answer, answer is True
            if answer:
                row.survival, row.expected = survival, row.expected + survival
        return [row.kept if confidence is not None else False for row, confidence in zip(rows, confidences)]

    def _best_ending(self, position: int, shown: list[tuple[_Row, float]]) -> bool | int:
        """Drop the draft at `position` (False), keep it and stop (KEEP_LAST), or draft on (True):
        whichever ending J of the step (J = position, position + 1, or any longer) is worth most.
        The forwards run so far are paid whatever J is."""
        top = min(max(row.limit for row, _ in shown), len(self._costs) - 1)
        fixed = sum(row.expected for row in self._step if not row.drafting) + sum(row.expected for row, _ in shown)
        # added[e]: expected tokens the shown rows add by keeping e drafts from `position` on;
        # least[e]: the fewest tokens any row of the step then expects (for the latency guard).
        added = [0.0] * (max(top - position, 0) + 1)
        # the rows of the step outside `shown` (stopped ones, and probes still protected) expect what they kept
        still = {id(row) for row, _ in shown}
        least = [min([row.expected for row in self._step if id(row) not in still], default=math.inf)] * len(added)
        for row, survival in shown:
            rates, last, limit = row.rates, len(row.rates) - 1, row.limit
            total, survive = 0.0, survival
            least[0] = min(least[0], row.expected)
            for e in range(1, len(added)):
                j = position + e - 1  # the draft this adds
                if j < limit:
                    if j > position:
                        survive *= rates[j if j < last else last]
                    total += survive
                added[e] += total
                least[e] = min(least[e], row.expected + total)
        # A probe drafting on keeps the step's verify at least that long: shorter endings save nothing.
        floor = max([row.probe_k for row in self._step if row.drafting and row.probe_k > position], default=0)
        cost = [self._step_cost(position, max(position + e, floor)) for e in range(len(added))]
        if self.rate_ema is not None:  # long-run rate: tokens minus what their time could earn elsewhere
            value = [gain - self.rate_ema * seconds for gain, seconds in zip(added, cost)]
        else:
            value = [(fixed + gain) / max(seconds, 1e-12) for gain, seconds in zip(added, cost)]
        endings = range(len(value))
        if self._cap is not None:  # the latency guard: every row's seconds per token within the cap
            slowest = [seconds / tokens for seconds, tokens in zip(cost, least)]
            endings = [e for e in endings if slowest[e] <= self._cap] or [min(endings, key=slowest.__getitem__)]
        best = max(endings, key=value.__getitem__)
        return False if best == 0 else KEEP_LAST if best == 1 else True

    def _options_pay(self) -> bool:
        return self.config.option_stopping and self._costs[0] >= self.config.option_min_step_seconds

    def _option_ending(self, position: int, row: _Row, survival: float) -> bool | int:
        """One row: the ending with the best long-run value, drafting on valued with the option
        to stop at a later position (`stopping.py`)."""
        if self._options is None:
            limit = max(min(row.limit, len(self._costs) - 1), 1)
            drop = [self._step_cost(j, j) for j in range(limit)]
            keep = [self._step_cost(j, j + 1) for j in range(limit)]
            recent = row.state.confidences if len(row.state.confidences) >= _OWN else self._pool
            sample = _quantiles(list(recent) or [self.config.prior_rate], _QUANTILES)
            acceptance = self.calibration.predict_table(sample, limit, row.state.offset)
            self._options = (drop, keep, continuation_values(drop, keep, acceptance, self.rate_ema))
        drop, keep, continuation = self._options
        j = min(position, len(drop) - 1)
        answer = decide(survival, j, drop, keep, continuation[j], self.rate_ema)
        return (False, KEEP_LAST, True)[answer]

    def _step_cost(self, position: int, final: int) -> float:
        """The step's cost if it verifies `final` drafts, having run the draft forwards of
        positions 0..position already (a dropped draft's forward is still paid)."""
        cost = self._costs[final]
        if final <= position and not self.cost_model.has_draft:
            # a profile of whole steps (vLLM) times no draft forward apart: a dropped draft is
            # charged as a kept one (an overcharge by the verify's share of the step's increment)
            cost = self._costs[min(position + 1, len(self._costs) - 1)]
        elif final <= position:
            batch, context = self._batch
            draft_seconds = self.cost_model.draft_seconds
            cost += draft_seconds(batch, context, position + 1) - draft_seconds(batch, context, final)
        return cost

    # --- learning ----------------------------------------------------------------------------
    def observe(self, record: StepRecord) -> None:
        # The rate is in the cost model's seconds (its prediction for the step just run), the unit
        # the in-step rule compares it with; the model itself follows the measured times.
        if self._costs and record.outcomes:
            predicted = self._costs[min(record.batch_k, len(self._costs) - 1)]
            if predicted > 0:
                rate = sum(o.emitted for o in record.outcomes) / predicted
                self.rate_ema = rate if self.rate_ema is None else 0.9 * self.rate_ema + 0.1 * rate
        self.cost_model.observe(record)
        # the rows of the choice whose drafts this step verified (see StepRecord.lag)
        lag = record.lag
        step = self._unobserved[-1 - lag] if 0 <= lag < len(self._unobserved) else {}
        forecast = self._forecasts[-1 - lag] if 0 <= lag < len(self._forecasts) else None
        if lag >= 0:
            while len(self._unobserved) > lag:
                self._unobserved.popleft()
            while len(self._forecasts) > lag:
                self._forecasts.popleft()
        self._learn_forecast(forecast, record)
        full = self._full_probes(step, record.outcomes)
        for outcome in record.outcomes:
            state = self._requests.get(outcome.request_id)
            if state is None:
                continue
            row = step.get(outcome.request_id)
            probe_k = row.probe_k if row is not None else 0
            if row is not None:
                self._learn_calibration(row, outcome.k, outcome.accepted)
            good_probe = outcome.request_id in full
            if good_probe:
                state.estimator.forget()  # the drafter agrees again: the bad phase is over
                state.resume = True
            state.estimator.update(outcome.k, outcome.accepted)
            if outcome.k:
                state.estimator.prior.update(outcome.k, outcome.accepted)
                state.steps_off = 0
                if not probe_k or good_probe:
                    # drafting by choice, or a good probe: probing starts over from the base interval
                    state.probing = False
                    state.probe_interval = self.config.probe_interval
            else:
                state.steps_off += 1
        if not self._unobserved:
            self._step = []

    @staticmethod
    def _full_probes(step: dict, outcomes) -> set[str]:
        """The requests whose probe was fully accepted and counts as the drafter agreeing again.

        In a step of probes alone (`probe_bar`), where every row probes at once and the batch pays
        for it, a full probe counts only if every probe was full or the step paid for itself: at
        batch 64 some of a mediocre drafter's one-draft probes are always accepted by chance, and
        counting them would chain probe steps that cost the batch more than it gains, without end."""
        full, probes, bar = set(), 0, 0.0
        for outcome in outcomes:
            row = step.get(outcome.request_id)
            if row is None or not row.probe_k:
                continue
            probes, bar = probes + 1, max(bar, row.probe_bar)
            if outcome.k and outcome.accepted >= min(row.probe_k, outcome.k):
                full.add(outcome.request_id)
        if bar and len(full) < probes and sum(o.emitted for o in outcomes) < bar:
            return set()
        return full

    def forecast_scale(self) -> float:
        """Realised over forecast goodput of recent steps that drafted by choice (1 before any),
        within [0.5, 1.25]: what `choose` scales its drafting options by at batch > 1."""
        realised, forecast = self._forecast_seen
        return min(max(realised / forecast, 0.5), 1.25) if forecast > 0 else 1.0

    def _learn_forecast(self, forecast: float | None, record: StepRecord) -> None:
        """A ratio of decayed sums, not a mean of ratios: a step's realised goodput is noisy, and
        the sums weigh each step by its forecast. A step with jump-forward tokens emitted more than
        any draft length was forecast to, so it is not learned. While the batch does not draft by
        choice nothing is learned, so the realised sum relaxes toward the forecast one at the same
        rate: the correction fades, as an estimator's evidence does, and cannot hold K = 0 for good."""
        decay, seen = self.config.forecast_decay, self._forecast_seen
        if forecast is not None and record.total_seconds > 0 and record.outcomes and not record.forced_tokens:
            realised = sum(o.emitted for o in record.outcomes) / record.total_seconds
            seen[0], seen[1] = decay * seen[0] + realised, decay * seen[1] + forecast
        elif forecast is None and seen[1] > 0:
            seen[0] = decay * seen[0] + (1 - decay) * seen[1]

    def _learn_calibration(self, row: _Row, k: int, accepted: int) -> None:
        """Positions up to the first rejection were tested; those after it were not."""
        for position, confidence in enumerate(row.confidences[: min(k, accepted + 1)]):
            self.calibration.update(confidence, position, position < accepted, row.state.offset)

    # --- warm start --------------------------------------------------------------------------
    def state(self) -> dict:
        state = {"prior": self.prior.state(), "calibration": self.calibration.state()}
        if self.group_priors:
            state["group_priors"] = {group: prior.state() for group, prior in self.group_priors.items()}
        return state

    def load_state(self, state: dict) -> None:
        """Start from a saved prior and calibration (see `state`); raises ValueError if malformed."""
        if not isinstance(state, dict) or "prior" not in state or "calibration" not in state:
            raise ValueError("a goodput warm-start state needs 'prior' and 'calibration'")
        self.prior.load_state(state["prior"])
        self.calibration.load_state(state["calibration"])
        for group, saved in (state.get("group_priors") or {}).items():
            self._prior_of(str(group)).load_state(saved)

    # --- helpers -----------------------------------------------------------------------------
    def _token_seconds_cap(self, batch: int, base_seconds: float) -> float | None:
        """The latency guard's cap on a row's expected seconds per token (None: no guard, or batch 1)."""
        if batch <= 1:
            return None
        if self.config.tpot_target is not None:
            return self.config.tpot_target
        factor = self.config.latency_factor
        return None if factor is None or base_seconds <= 0 else factor * base_seconds

    def _states_for(self, requests: Sequence[RequestView]) -> list[_RequestState]:
        """States of the running requests; finished ones are dropped."""
        known = self._requests
        self._requests = {}
        for r in requests:
            self._requests[r.request_id] = known.get(r.request_id) or _RequestState(
                AcceptanceEstimator(self._prior_of(r.group), self.config.request_decay, self.config.prior_strength),
                self.calibration.new_offset(), probe_interval=self.config.probe_interval)
        return [self._requests[r.request_id] for r in requests]

    def _prior_of(self, group: str) -> AcceptancePrior:
        if not group:
            return self.prior
        if group not in self.group_priors:
            self.group_priors[group] = copy.deepcopy(self.prior)
        return self.group_priors[group]

    def _row_shares(self, batch: int, k_max: int) -> list[tuple[float, float]]:
        """Per K: (one drafting row's share of the batch's drafting increment, each further row's),
        from the cost model's `drafting_share`; (1, 0) where a step costs its longest draft."""
        share = self.cost_model.drafting_share
        if not self.config.price_ragged_steps or batch <= 1:
            return [(1.0, 0.0)] * (k_max + 1)
        out = [(1.0, 0.0)]
        for k in range(1, k_max + 1):
            one = share(batch, k, 1.0)
            out.append((one, max(share(batch, k, 2.0) - one, 0.0)))
        return out

    def _optimistic(self, costs: list[float], batch: int, k_max: int) -> list[float]:
        """Each K's price above K = 0's lowered by `cost_exploration_z` of its uncertainty (the cost
        model's `price_spread`; 0 for a per-cell correction): a length whose price no step has pinned
        down is tried while its optimistic price would win, and its timed steps then shrink the
        spread. Optimism as for acceptance (`exploration_z`); no random probing."""
        z = self.config.cost_exploration_z
        if not z:
            return costs
        widths = self.cost_model.price_spread(batch, k_max)
        return [costs[0]] + [costs[0] + max(cost - costs[0] - z * width, 0.0) for cost, width in zip(costs[1:], widths[1:])]

    def _price_probe(self, best: int, batch: int, k_max: int, allowed: set[int]) -> int:
        """The batch K to run: `best`, or a length whose price no recent step timed when knowing it is
        worth more than one step of it costs (value of information, not an epsilon). With relative
        misfit s of that length's price (`untimed_misfit`) and its goodput short of the best's by a
        share d, the expected gain per step of learning it is s phi(d/s) - d (1 - Phi(d/s)) (it turns
        out better with that chance, by that much); the probe runs where `price_probe_horizon` steps
        of that gain beat the d it costs once. The most valuable `allowed` length wins. Why it matters:
        vLLM verifies a step's drafts a step later, so a batch that drafts at K = 1 never times a
        K = 0 step, and a model that learned only K = 1 may price K = 0 far off while sure of it."""
        horizon = self.config.price_probe_horizon
        if not horizon:
            return best
        misfit = self.cost_model.untimed_misfit(batch, k_max)
        top = self.last_goodput[best]
        if top <= 0 or not any(misfit):
            return best
        worth = {}
        for k, spread in enumerate(misfit):
            if k == best or spread <= 0 or k not in allowed:
                continue
            short = max(top - self.last_goodput[k], 0.0) / top
            ratio = short / spread
            gain = spread * math.exp(-0.5 * ratio * ratio) / math.sqrt(2 * math.pi) - short * 0.5 * math.erfc(ratio / math.sqrt(2))
            if horizon * gain > short:
                worth[k] = horizon * gain - short
        return max(worth, key=worth.get) if worth else best

    def _catch_up_rate(self, requests: Sequence[RequestView]) -> float:
        """Seconds per context token a lazy draft missed (0 when no row is behind or nothing prices it)."""
        if not self.config.price_catch_up or not any(r.draft_behind for r in requests):
            return 0.0
        return self.cost_model.catch_up_seconds(1)  # linear in tokens

    def _probes(self, requests: Sequence[RequestView], states: list[_RequestState], costs: list[float],
                catch_ups: Sequence[float], drafting: set[int]) -> list[int]:
        """Probe lengths (0 = none) for requests that have not drafted for a while, whether the
        batch drafts or not (a drafting batch may still have dropped their drafts inside the step).
        `catch_ups[i]`: what a probe of request i would add in draft catch-up; such a probe waits until
        its request's share of the time spent without speculation pays for it at `probe_budget`.

        Probes share their step: a step's cost follows its longest draft, so once one row probes,
        every other row outside `drafting` whose probe adds no catch-up probes beside it at the same
        length, for nothing. Probing rows one at a time would make the whole batch pay a drafting
        step for each row's probe (at batch 6 on the vLLM CPU profile a 1-draft step costs 1.7x
        one without), and the back-off, counted per row, would not bound what the batch pays."""
        due, lengths, chained = [], [], []
        # Where a host chooses again before it reports a step (vLLM), a row whose drafts are still
        # unverified waits for their outcome: probing it again would read the wait as a failed probe.
        in_flight = {request_id for step in list(self._unobserved)[:-1] for request_id, row in step.items() if row.limit}
        for request, state, catch_up in zip(requests, states, catch_ups):
            if request.request_id in in_flight:
                due.append(False)
                lengths.append(0)
                continue
            # After a fully accepted probe the next probe is due at once: probes chain until the
            # evidence they add makes drafting pay by itself.
            row_due = (state.resume or state.steps_off >= state.probe_interval) and request.max_k >= 1
            own_length = min(self._probe_length(state, costs), request.max_k) if row_due else 0
            # A probe that needs a catch-up probes alone, and waits until the row's time without
            # speculation pays at the budget for all the batch pays for it: the catch-up and the
            # probe's own step. A row's share of a batch step is 1 / batch of it, so the batch's
            # probes together stay within the budget.
            spent = catch_up + costs[own_length] - costs[0]
            if row_due and catch_up and spent > self.config.probe_budget * state.steps_off * costs[0] / len(requests):
                row_due = False
            chained.append(row_due and state.resume)
            state.resume = False
            due.append(row_due)
            lengths.append(own_length)
        if not self._batch_may_probe(due, chained, lengths, costs, bool(drafting)):
            return [0] * len(requests)
        if any(due):
            length = max(k for k, row_due in zip(lengths, due) if row_due)
            for index, (request, catch_up) in enumerate(zip(requests, catch_ups)):
                if (not due[index] and index not in drafting and not catch_up and request.max_k >= 1
                        and request.request_id not in in_flight):
                    due[index], lengths[index] = True, min(length, request.max_k)
        for state, row_due, k in zip(states, due, lengths):
            if row_due:
                if state.probing:  # the last probe did not bring drafting back: back off
                    state.probe_interval = min(2 * state.probe_interval, self._longest_interval(costs, k))
                state.probing = True
        return [k if row_due else 0 for k, row_due in zip(lengths, due)]

    def _batch_may_probe(self, due: list[bool], chained: list[bool], lengths: list[int], costs: list[float],
                         drafting: bool) -> bool:
        """Whether the rows due may probe in a step that has no drafting row (batch > 1).

        Such a step costs the whole batch, and every row has its own interval, reset as it joins:
        arrivals alone would make a batch whose drafter does not pay probe every `probe_interval`
        steps (a 1-draft step costs 1.7-2.2x one without on the CPU profiles). So these steps back
        off for the batch as a row's probes do for it, from `probe_interval` up to the interval
        where they cost `probe_budget` of the time without speculation; drafting by choice resets
        it. Probes chained after a probe that counted (`_full_probes`) go at once. At batch 1 the
        row's own back-off is the batch's."""
        self._since_probe_step += 1
        if drafting:
            self._probe_step_interval = self.config.probe_interval
        if drafting or not any(due) or len(due) == 1:
            return True
        if not any(chained):
            if self._since_probe_step < self._probe_step_interval:
                return False
            length = max(k for k, row_due in zip(lengths, due) if row_due)
            self._probe_step_interval = min(2 * self._probe_step_interval, self._longest_interval(costs, length))
        self._since_probe_step = 0
        return True

    def _longest_interval(self, costs: list[float], k: int) -> int:
        """The back-off's ceiling: long enough that probing a useless drafter costs at most
        `probe_budget` of the time spent without speculation, never above `max_probe_interval`."""
        extra = max(costs[k] - costs[0], 0.0)
        steps = math.ceil(extra / (self.config.probe_budget * max(costs[0], 1e-12)))
        return max(self.config.probe_interval, min(steps, self.config.max_probe_interval))

    def _probe_length(self, state: _RequestState, costs: list[float]) -> int:
        """`probe_k`, or the k >= 1 with the least extra cost per informative draft: drafts up to
        and including the first rejection tell whether the drafter agrees, the rest tell nothing."""
        if self.config.probe_k:
            return self.config.probe_k
        rates = state.estimator.rates(len(costs) - 1)
        best, best_price, informative, survive = 1, float("inf"), 0.0, 1.0
        for k in range(1, len(costs)):
            informative += survive  # position k is tried iff drafts 1..k-1 were accepted
            survive *= max(rates[k - 1], 0.5)  # a probe is a bet on recovery: assume at least even odds
            price = (costs[k] - costs[0]) / informative
            if price < best_price:
                best, best_price = k, price
        return best


def _drafting_rows(k: int, requests: Sequence[RequestView], expected: list[list[float]], base: float, cost: float,
                   seconds_per_behind: float, share: tuple[float, float] = (1.0, 0.0)) -> tuple[float, list[int], float]:
    """At batch draft length k: the goodput, the rows that draft, and the catch-up seconds they add.

    `base` is the step at K = 0 and `cost` the step with every row drafting k. Where the host's step
    follows its drafted tokens (vLLM: `share` = (s1, per_row) from the cost model), the first drafting
    row pays s1 of the increment and each further row per_row of it, in proportion to its drafts;
    where it follows its longest draft, (1, 0), one row pays it all and the others draft for nothing.
    A row whose lazy draft is behind (`draft_behind`) also pays its catch-up; one catch-up buys the
    row's drafting for the rest of the request, so it is spread over the steps the row has left at
    this k: a row near its end does not resume. The goodput is a ratio of sums, tokens over seconds,
    so the best set of drafting rows is a prefix of the rows in order of tokens added per second
    added; every prefix is scored (the first row's fixed share makes drafting all-or-some)."""
    tokens = sum(rows[0] for rows in expected)
    if k == 0:
        return tokens / max(base, 1e-12), [], 0.0
    increment = max(cost - base, 0.0)
    first, per_row = increment * share[0], increment * share[1]
    if not per_row and not seconds_per_behind:
        # Every row drafts for free once one does (the common case): the prefix scan below, in
        # row order, without building and sorting the candidates.
        seconds, adding, best, best_n = max(base + first, 1e-12), [], None, 0
        for index, (request, rows) in enumerate(zip(requests, expected)):
            added = rows[k if k < request.max_k else request.max_k] - rows[0]
            if added > 0:
                tokens += added
                adding.append(index)
                if best is None or tokens / seconds > best:
                    best, best_n = tokens / seconds, len(adding)
        if best is None:
            return tokens / max(cost, 1e-12), [], 0.0
        return best, adding[:best_n], 0.0
    candidates = []
    for index, (request, rows) in enumerate(zip(requests, expected)):
        own_k = min(k, request.max_k)
        added = rows[own_k] - rows[0]
        if added <= 0:
            continue
        charge = 0.0
        if request.draft_behind and seconds_per_behind:
            charge = seconds_per_behind * request.draft_behind / max(request.remaining_tokens / rows[own_k], 1.0)
        extra = per_row * own_k / k + charge
        candidates.append((added / extra if extra > 0 else math.inf, added, extra, charge, index))
    if not candidates:
        return tokens / max(cost, 1e-12), [], 0.0
    candidates.sort(key=lambda c: c[0], reverse=True)
    seconds, catch_up, best = base + first - per_row, 0.0, None  # the first row's per_row is in `first`
    for n, (_, added, extra, charge, _) in enumerate(candidates, start=1):
        tokens, seconds, catch_up = tokens + added, seconds + extra, catch_up + charge
        goodput = tokens / max(seconds, 1e-12)
        if best is None or goodput > best[0]:
            best = (goodput, n, catch_up)
    return best[0], sorted(c[4] for c in candidates[:best[1]]), best[2]


def _slowest_row(seconds: float, drafting: list[int], requests: Sequence[RequestView], expected: list[list[float]],
                 k: int) -> float:
    """A step of `seconds` at batch draft length k: the most seconds per expected token of any row
    (a row outside `drafting` emits one token)."""
    chosen = set(drafting)
    least = min(rows[min(k, request.max_k)] if index in chosen else rows[0]
                for index, (request, rows) in enumerate(zip(requests, expected)))
    return seconds / max(least, 1e-12)


def _quantiles(values: list[float], count: int) -> list[float]:
    """`count` evenly spaced quantiles (midpoints) of `values`, or all of them if fewer."""
    ordered = sorted(values)
    if len(ordered) <= count:
        return ordered
    return [ordered[int((i + 0.5) * len(ordered) / count)] for i in range(count)]


def _expected_prefix(rates: list[float], k_max: int) -> list[float]:
    """[E(0), E(1), ..., E(k_max)] in one pass."""
    out, total, survive = [1.0], 1.0, 1.0
    for j in range(k_max):
        survive *= rates[j]
        total += survive
        out.append(total)
    return out


__all__ = ["GoodputConfig", "GoodputPolicy", "StepCost", "expected_emitted"]
