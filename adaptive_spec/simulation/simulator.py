"""A trace-driven simulator of the speculative engine: policies x traces x a cost profile, in seconds.

Pure Python + numpy, no torch. Replay semantics (one uniform per position, leading runs, caps) are
in `replay`; the oracle in `oracle`.

What it runs: the same policy objects the engine uses (`control.registry.make_policy`), shown the
same `RequestView`s and told the same `StepRecord`s, with step times from a cost model built from
a profile (`CostModel.from_profile`). Two fresh cost models per simulation: the policy's own (it
may correct it online through `observe`, as in the engine) and the simulator's clock, which is
never corrected. The clock may come from another profile (`clock_profile`): a policy run on a
machine its profile does not describe, learning the difference online as it would in a server.

Loop (mirrors `SpecEngine.step`):
  1. admit: closed loop (`batch_size=B`): B requests run concurrently and a finished one is replaced
     by the next while any remain; open loop (`rate=R`): Poisson arrivals at R requests/s (seeded),
     first come first served, at most `batch_size` running. Admission emits the trace's position 0
     and costs ``prefill_seconds_per_token * prompt length`` (default 0: prefill is not charged, so
     tokens/s is decode throughput; profiles time forwards of at most a few query tokens, and
     extrapolating them to a few hundred prompt tokens overestimated prefill ~2.6x on the 2-core
     CPU, where a measured 0.020 s per prompt token fits qwen-coder fp32);
  2. views: context = prompt length + emitted, remaining = trace length - emitted,
     max_k = min(max_k (16), remaining - 1); the policy chooses k_i, clamped to max_k;
  3. a policy that stops drafts inside the step (`keep_drafting`) is shown each drafting row's
     recorded draft confidence position by position, as in the engine's draft loop;
  4. the step costs draft(positions the loop ran) + verify(K = max kept k_i) + overhead, at the
     batch's longest context; each row replays its acceptances (see `replay.step`), its history
     records (k_i, accepted);
  5. the policy observes the StepRecord; finished requests leave.

`host="vllm"` imitates the vLLM plug-in instead (`integrations/vllm`), with vLLM's one-step lag: the
drafts a row proposes in step t are verified in step t + 1, so each step verifies the lengths
chosen one step before (clamped to what the row still needs) while the draft proposes the lengths
chosen now; the first step verifies nothing and each row's history records the lag. A step with
both sides costs the two sides' ragged prices weighed by `CostModel.drafting_weight` (`step_timing.mixed_step_seconds`: the
draft forwards follow this step's lengths, the verify the last step's); a ragged step (rows at
different k) costs `CostModel.ragged_step_seconds`. The plug-in stops drafts inside the step, by
default only in steps of one request (`VLLM_STOP_MAX_BATCH`; a vLLM profile times whole steps, so
a draft forward whose draft was dropped is charged as the increment of one more drafted position);
in larger batches each row drafts its k. A lazy draft skips rows at k = 0 and, before a row's next
step that drafts, catches up over every token it missed (the prompt, for a row that never drafted),
at the profile's `catch_up_seconds`, reported per row as `RequestView.draft_behind`.

What the policy's cost model is told mirrors `integrations.vllm.controller.finish_step`: a
catching-up step is not a step cost (one of at least `step_timing.MIN_TIMED_CATCH_UP` tokens
teaches its catch-up price instead: the step's time beyond the model's price of it). A cost model
that fits any step (the shared one, `fits_any_step`) learns every other step as it ran, lag,
raggedness and dropped drafts included; the per-cell one learns a step only where a profile cell
stands for it (`step_timing.cell_equivalent`, scaled to the cell) and no dropped draft ran. The
ceilings run without the lag (their schedules are per step, as in our engine).

Requests: the trace requests are cycled to reach `num_requests` (simulated request i replays trace
request i mod R with its own uniforms). Reports tokens/s (emitted tokens / simulated seconds),
latency percentiles (completion - arrival, seconds), acceptance rate (accepted / drafted), mean
acceptance length (tokens per request-step, bonus included), the k histogram (per request-step)
and the batch K histogram. `per_request=True` adds `requests`: per simulated request its trace
request, tokens, seconds (its share of the steps it was in, each step's time split evenly over its
rows, plus its own prefill: what `bench` charges a request in its closed loop), latency, and k and
accepted drafts per step, for paired comparisons between policies on the same requests.

`policy="oracle"`: at batch size 1 the hindsight-optimal schedule (exact; run through the loop so
every metric is reported); at batch size > 1 an upper bound on tokens/s (see `oracle`), reported
with ``"oracle": "upper-bound"`` and no latency percentiles.

Two more ceilings (`ceilings`), run through the loop at every batch size:
`policy="request-static-oracle"` (each request's best fixed k in hindsight; the report adds
``request_k_histogram``, requests per chosen k) and `policy="confidence-oracle"` (each step's
expected-goodput-maximising K from the trace's true acceptance probabilities). At batch size 1,
`policy="confidence-bound"`: the schedule of least expected time when acceptance is read off the
draft's recorded confidences through the best map in hindsight, every future confidence known in
advance (what the draft's confidence can buy a policy, at most).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from ..control.cost_model import CostModel
from ..control.online_cost import cost_model_for
from ..control.step_timing import (MIN_TIMED_CATCH_UP, STOP_MAX_BATCH, cell_equivalent, fits_any_step,
                                   mixed_step_seconds, whole_step_record)
from ..control.policy import (AcceptanceHistory, PolicyBase, RequestOutcome, RequestView, StepRecord, StopRule,
                              adopt_stop_rule, choose_ks, mean_acceptance_length, run_stop_rule)
from ..control.registry import make_policy
from . import replay
from .ceilings import ConfidenceOraclePolicy, expected_schedule, hindsight_calibration, request_static_policy
from .oracle import CostRows, SchedulePolicy, dp_schedule
from .price_error import ClockChange, PriceLog
from .trace_file import RequestTrace

__all__ = ["simulate", "cost_model_from", "DEFAULT_MAX_K", "CEILINGS"]

DEFAULT_MAX_K = 16  # the engine's default cap on any k
CEILINGS = ("oracle", "request-static-oracle", "confidence-oracle", "confidence-bound")  # policies the simulator builds itself
HOSTS = ("hf", "vllm")


def cost_model_from(profile: Mapping[str, Any] | CostModel | None, kind: str = "cells", host: str = "hf") -> CostModel:
    """A fresh, uncorrected cost model from a profile document (None: the generic shape, of whole
    steps for host "vllm"); `kind` picks the online correction (`control.online_cost.COST_MODELS`)."""
    if isinstance(profile, CostModel):
        raise TypeError("pass the profile document, not a CostModel: the simulator builds fresh ones")
    return cost_model_for(profile, kind, whole_step=host == "vllm")


@dataclass
class _Sim:
    index: int
    rid: str
    trace: RequestTrace
    run: np.ndarray
    arrival: float = 0.0
    t: int = 0
    history: AcceptanceHistory = field(default_factory=AcceptanceHistory)
    draft_seen: int = 0  # host "vllm": context tokens its lazy draft has run over
    pending: int = 0  # host "vllm": drafts proposed last step, verified in the next
    seconds: float = 0.0  # its share of the steps it was in, and its prefill
    latency: float = 0.0
    first_token: float = 0.0  # when its prefill emitted its first token
    ks: list[int] = field(default_factory=list)  # per step, with per_request
    accepted: list[int] = field(default_factory=list)


class _Clock:
    """Memoised (draft, verify, total) seconds of steps from an uncorrected model, and prefill seconds."""

    def __init__(self, cost_model: CostModel, prefill_seconds_per_token: float = 0.0):
        self.cm = cost_model
        self.prefill_rate = float(prefill_seconds_per_token)
        self._steps: dict[tuple[int, int, int, int], tuple[float, float, float]] = {}

    def step(self, b: int, c: int, k: int, positions: int | None = None) -> tuple[float, float, float]:
        """A step verifying k drafts per row after a draft loop of `positions` forwards (default k)."""
        positions = k if positions is None else positions
        key = (b, c, k, positions)
        hit = self._steps.get(key)
        if hit is None:
            d = self.cm.draft_seconds(b, c, positions) if positions else 0.0
            v = self.cm.target_seconds(b, c, k + 1)
            total = d + v + self.cm.overhead_seconds(b, k)
            hit = self._steps[key] = (d, v, total)
        return hit

    def switch(self, cost_model: CostModel) -> None:
        """The machine's costs change (a `ClockChange`)."""
        self.cm = cost_model
        self._steps.clear()

    def prefill(self, prompt_length: int) -> float:
        return self.prefill_rate * prompt_length


def _requests(traces: Sequence[RequestTrace], num_requests: int, seed: int) -> list[_Sim]:
    out = []
    for i in range(num_requests):
        trace = traces[i % len(traces)]
        accepted = replay.realise(trace.accept_prob, replay.uniforms(seed, i, trace.length))
        out.append(_Sim(i, f"sim-{i}", trace, replay.leading_runs(accepted)))
    return out


def _stop_inside(rule: StopRule, running: list[_Sim], ks: list[int]) -> tuple[list[int], int]:
    """The draft loop with a policy's in-step rule, on the trace's recorded confidences:
    (drafts kept per row, positions the loop evaluated)."""

    def confidence(row: int, position: int) -> float | None:
        sim, j = running[row], running[row].t + position
        return float(sim.trace.draft_confidence[j]) if j < sim.trace.length else None

    return run_stop_rule(rule, ks, confidence)


def _step_seconds(clock: _Clock, b: int, context: int, verified: list[int], drafting: list[int] | None,
                  positions: int, ragged: bool) -> tuple[float, float, float]:
    """(draft, verify, total) seconds of a step. Our engine (`ragged` False): the (b, max verified)
    cell after a draft loop of `positions` forwards. The vLLM plug-in: its tokens' cost, a ragged
    step by the profile's ragged shares; with its one-step lag (`drafting`: the lengths drafted
    for the next step) the two sides' steps weighed as `step_timing.mixed_step_seconds` weighs them; a
    draft dropped past the kept lengths cost its forward, priced in a whole-step profile as the
    increment of a longer step."""
    batch_k = max(verified)
    draft_s, verify_s, total_s = clock.step(b, context, batch_k, positions if drafting is None else None)
    if not ragged:
        return draft_s, verify_s, total_s
    drafted = list(verified if drafting is None else drafting)
    kept = max(drafted, default=0)
    if positions > kept and not clock.cm.has_draft:  # forwards of dropped drafts
        drafted = [positions if k == kept else k for k in drafted]
    if drafting is None:
        total_s = clock.cm.ragged_step_seconds(b, context, drafted) if len(set(drafted)) > 1 else clock.step(b, context, max(drafted))[2]
    else:
        total_s = mixed_step_seconds(clock.cm, b, context, verified, drafted)
    if positions > kept and clock.cm.has_draft:
        total_s += clock.cm.draft_seconds(b, context, positions) - (clock.cm.draft_seconds(b, context, kept) if kept else 0.0)
    return draft_s, verify_s, total_s


def _plugin_record(cost_model: CostModel | None, b: int, contexts: tuple, outcomes: list, verified: list[int],
                   drafting: list[int], positions: int, total_s: float, catch_up: float, behind: int,
                   lag: int) -> StepRecord:
    """What the vLLM plug-in tells its policy of a step (`integrations.vllm.controller.finish_step`):
    the whole step's time, through `step_timing.whole_step_record`. A step that caught up is not a
    step cost (one of at least `step_timing.MIN_TIMED_CATCH_UP` tokens teaches the catch-up price:
    its time beyond the model's price of the step). For a cost model that does not fit any step, a
    step that paid the forward of a dropped draft is untimed and a ragged one is timed only where
    its profile cell stands for it, scaled to that cell (`step_timing.cell_equivalent`)."""
    context = max(contexts)
    total = total_s
    if catch_up:
        if behind >= MIN_TIMED_CATCH_UP and cost_model is not None:
            cost_model.observe_catch_up(behind, total_s + catch_up - mixed_step_seconds(cost_model, b, context, verified, drafting))
        total = 0.0
    elif not fits_any_step(cost_model) and positions > max([*verified, *drafting]):
        total = 0.0
    else:
        total *= cell_equivalent(cost_model, b, context, verified, drafting)
    return whole_step_record(cost_model, batch_size=b, batch_k=max(verified), context_lengths=contexts,
                             outcomes=tuple(outcomes), total_seconds=total, lag=lag,
                             drafting=tuple(drafting) if lag else (), draft_positions=positions)


VLLM_STOP_MAX_BATCH = STOP_MAX_BATCH  # the vLLM plug-in's default ADAPTIVE_SPEC_VLLM_STOP_DRAFTS


def simulate(
    traces: Sequence[RequestTrace],
    profile: Mapping[str, Any],
    policy: str = "off",
    *,
    batch_size: int = 1,
    rate: float | None = None,
    num_requests: int | None = None,
    seed: int = 0,
    max_k: int = DEFAULT_MAX_K,
    prefill_seconds_per_token: float = 0.0,
    host: str = "hf",
    clock_profile: Mapping[str, Any] | None = None,
    warm_start: Mapping[str, Any] | None = None,
    per_request: bool = False,
    cost_model: str = "cells",
    clock_change: ClockChange | None = None,
    price_errors: bool = False,
) -> dict:
    """Simulate one policy; returns the report dict (see the module docstring). `clock_profile`: the
    machine the steps run on, when it is not the one `profile` (the policy's) describes.
    `warm_start`: a saved goodput state (`GoodputPolicy.state()`) that a policy built here by name
    starts from, as the engine's `--profile` loads it from beside a profile; None starts cold.
    `cost_model`: the policy's online correction ("cells" or "shared", `control.online_cost`);
    `profile` None gives the policy the generic shape (then `clock_profile` is the machine).
    `clock_change`: the clock's costs switch mid-run. `price_errors`: report the policy's relative
    price error of K = 1..6 against K = 0 per step (`price_error.PriceLog`)."""
    started = time.perf_counter()
    if not traces:
        raise ValueError("no trace requests to simulate")
    if batch_size < 1 or max_k < 0:
        raise ValueError(f"need batch_size >= 1 and max_k >= 0, got {batch_size}, {max_k}")
    if not prefill_seconds_per_token >= 0:
        raise ValueError(f"prefill_seconds_per_token must be >= 0, got {prefill_seconds_per_token}")
    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if host not in HOSTS:
        raise ValueError(f"host must be one of {', '.join(HOSTS)}, got {host!r}")
    n_req = int(num_requests if num_requests is not None else len(traces))
    if n_req < 1:
        raise ValueError(f"num_requests must be >= 1, got {n_req}")
    if profile is None and clock_profile is None:
        raise ValueError("without a profile for the policy, clock_profile must give the machine's costs")
    clock = _Clock(cost_model_from(clock_profile if clock_profile is not None else profile), prefill_seconds_per_token)
    ceiling = policy.strip().lower() if isinstance(policy, str) and policy.strip().lower() in CEILINGS else None
    if ceiling == "confidence-bound" and batch_size != 1:
        raise ValueError("confidence-bound is a schedule per request, defined at batch size 1")
    if ceiling:
        policy_obj = None
    else:
        policy_costs = cost_model_from(profile, cost_model, host)
        policy_costs.warm_start = dict(warm_start) if warm_start else None
        policy_obj = make_policy(policy, cost_model=policy_costs)
    sims = _requests(traces, n_req, seed)
    base = {"policy": ceiling or policy_obj.name, "batch_size": batch_size, "rate": rate,
            "num_requests": n_req, "seed": seed, "max_k": max_k,
            "prefill_seconds_per_token": prefill_seconds_per_token, "host": host}
    if clock_profile is not None:
        base["clock_profile"] = clock_profile.get("name")
    if cost_model != "cells":
        base["cost_model"] = cost_model
    if profile is None:
        base["policy_profile"] = None
    step_hook, log = None, None
    if price_errors and getattr(policy_obj, "cost_model", None) is not None:
        log = PriceLog(policy_obj.cost_model)
    if clock_change is not None or log is not None:
        def step_hook(step: int, b: int, context: int, emitted: int, seconds: float) -> None:
            if clock_change is not None and step == clock_change.step:
                clock.switch(cost_model_from(clock_change.profile))
            if log is not None:
                log.record(clock.cm, b, context, emitted, seconds)
    if warm_start and policy_obj is not None and hasattr(policy_obj, "load_state"):
        base["warm_start"] = True
    if ceiling == "oracle" and batch_size > 1:
        report = _oracle_bound(sims, clock, batch_size, max_k)
        report["wall_seconds"] = round(time.perf_counter() - started, 4)
        return {**base, **report}
    extra = {}
    if ceiling == "oracle":
        rows = CostRows(clock.cm, max_k, batch=1)
        policy_obj = SchedulePolicy("oracle", {s.rid: (s.trace.prompt_length, dp_schedule(s.run, s.trace.prompt_length, rows, max_k)[1])
                                               for s in sims})
        extra["oracle"] = "exact"
    elif ceiling == "confidence-bound":
        rows = CostRows(clock.cm, max_k, batch=1)
        calibrated = hindsight_calibration([t.draft_confidence for t in traces], [t.accept_prob for t in traces])
        policy_obj = SchedulePolicy(ceiling, {s.rid: (s.trace.prompt_length, expected_schedule(
            calibrated(s.trace.draft_confidence), s.trace.prompt_length, rows, max_k)[1]) for s in sims})
    elif ceiling == "request-static-oracle":
        policy_obj = request_static_policy(((s.rid, s.trace.prompt_length, s.run) for s in sims),
                                           CostRows(clock.cm, max_k, batch=batch_size), max_k)
        extra["request_k_histogram"] = {str(k): v for k, v in sorted(Counter(policy_obj.ks.values()).items())}
    elif ceiling == "confidence-oracle":
        policy_obj = ConfidenceOraclePolicy({s.rid: (s.trace.prompt_length, s.trace.accept_prob) for s in sims},
                                            lambda b, c, k: clock.step(b, c, k)[2])
    report = _loop(sims, clock, policy_obj, batch_size, rate, seed, max_k, lazy_draft=host == "vllm",
                   per_request=per_request, step_hook=step_hook, lag=host == "vllm" and ceiling is None)
    if log is not None:
        report["price_error"] = log.report(change_at=clock_change.step if clock_change is not None else None)
    if clock_change is not None:
        report["clock_change"] = {"step": clock_change.step, "profile": clock_change.profile.get("name")}
    if hasattr(policy_obj, "cost_model") and hasattr(policy_obj.cost_model, "shifts"):
        report["cost_model_events"] = {"outliers": policy_obj.cost_model.outliers, "shifts": policy_obj.cost_model.shifts}
    calibration = getattr(policy_obj, "calibration", None)
    if calibration is not None and hasattr(calibration, "report"):
        extra["calibration"] = calibration.report()  # predictions made before each outcome
    report.update(extra)
    report["wall_seconds"] = round(time.perf_counter() - started, 4)
    return {**base, **report}


def _loop(sims: list[_Sim], clock: _Clock, policy, batch_size: int, rate: float | None, seed: int,
          max_k: int, lazy_draft: bool = False, per_request: bool = False, step_hook=None, lag: bool = False) -> dict:
    if rate is not None:
        gaps = np.random.default_rng([int(seed), 2**31 - 1]).exponential(1.0 / rate, len(sims))
        for sim, arrival in zip(sims, np.cumsum(gaps)):
            sim.arrival = float(arrival)
    pending = deque(sims)
    running: list[_Sim] = []
    now = 0.0
    emitted_total = drafted = accepted_total = request_steps = steps = 0
    k_hist: Counter = Counter()
    batch_k_hist: Counter = Counter()
    latencies = []
    token_seconds = []  # per request past its first token: time per output token (TPOT)
    prefill_seconds = catch_up_seconds = 0.0
    observe = policy.observe
    host_costs = getattr(policy, "cost_model", None)  # what the host scales a ragged step's time by
    stop_rule = adopt_stop_rule(policy)  # None for rule-free policies and the ceilings
    while running or pending:
        # 1. admit
        while pending and len(running) < batch_size and (rate is None or pending[0].arrival <= now):
            sim = pending.popleft()
            if rate is None:
                sim.arrival = now
            cost = clock.prefill(sim.trace.prompt_length)
            now += cost
            prefill_seconds += cost
            sim.seconds += cost
            sim.t, sim.first_token = 1, now
            emitted_total += 1
            if sim.trace.length <= 1:
                sim.latency = now - sim.arrival
                latencies.append(sim.latency)
            else:
                running.append(sim)
        if not running:
            now = max(now, pending[0].arrival)
            continue
        # 2. choose
        views = []
        for sim in running:
            remaining = sim.trace.length - sim.t
            context = sim.trace.prompt_length + sim.t
            views.append(RequestView(sim.rid, context, remaining, max(0, min(max_k, remaining - 1)), sim.history,
                                     draft_behind=context - sim.draft_seen if lazy_draft else 0))
        # the vLLM plug-in runs the in-step rule only in small batches (its DEFAULT_STOP_MAX_BATCH)
        stopping = stop_rule is not None and (not lazy_draft or len(views) <= VLLM_STOP_MAX_BATCH)
        if lazy_draft and isinstance(policy, PolicyBase):
            policy.host_stops_drafts = stopping
        ks = choose_ks(policy, views)
        b = len(running)
        contexts = tuple(v.context_length for v in views)
        context = max(contexts)
        if lag:  # this step verifies the drafts chosen a step ago and drafts what was chosen now
            verified = [min(sim.pending, max(0, min(max_k, sim.trace.length - sim.t - 1))) for sim in running]
        else:
            positions = max(ks)
            if stopping and positions:
                ks, positions = _stop_inside(stop_rule, running, ks)
            verified = ks
        # 3. replay
        outcomes = []
        finished = []
        for row, (sim, k) in enumerate(zip(running, verified)):
            n = sim.trace.length
            k_eff, acc, emitted = replay.step(sim.run, sim.t, k, n)
            sim.history.record(k_eff, acc)
            sim.t += emitted
            outcomes.append(RequestOutcome(sim.rid, k_eff, acc, emitted))
            if per_request:
                sim.ks.append(k_eff)
                sim.accepted.append(acc)
            emitted_total += emitted
            drafted += k_eff
            accepted_total += acc
            k_hist[k_eff] += 1
            if sim.t >= n:
                finished.append(row)
        if lag:  # the new drafts start where this step left each row (a finished row drafts none)
            ks = [max(0, min(k, sim.trace.length - sim.t - 1)) for sim, k in zip(running, ks)]
            positions = max(ks)
            if stopping and positions:
                ks, positions = _stop_inside(stop_rule, running, ks)
            for sim, k in zip(running, ks):
                sim.pending = k
        drafting = ks if lag else verified
        for sim, k in zip(running, drafting):
            if k and lazy_draft:  # the draft ran over this row's context (the new tokens it reads as it drafts next)
                sim.draft_seen = sim.trace.prompt_length + sim.t
        batch_k = max(verified)
        draft_s, verify_s, total_s = _step_seconds(clock, b, context, verified, drafting if lag else None,
                                                   positions, ragged=lazy_draft)
        behind = sum(v.draft_behind for v, k in zip(views, drafting) if k)  # a lazy draft catches up first
        catch_up = clock.cm.catch_up_seconds(behind) if behind else 0.0
        catch_up_seconds += catch_up
        request_steps += b
        steps += 1
        batch_k_hist[batch_k] += 1
        now += total_s + catch_up
        for sim in running:
            sim.seconds += (total_s + catch_up) / b
        if lazy_draft:
            record = _plugin_record(host_costs, b, contexts, outcomes, verified, drafting, positions,
                                    total_s, catch_up, behind, lag=(1 if steps > 1 else -1) if lag else 0)
        else:
            record = StepRecord(batch_size=b, batch_k=batch_k, context_lengths=contexts, outcomes=tuple(outcomes),
                                draft_seconds=draft_s, verify_seconds=verify_s, total_seconds=total_s,
                                draft_positions=positions)
        observe(record)
        if step_hook is not None:  # a mid-run clock change, the policy's price errors
            step_hook(steps, b, max(contexts), sum(o.emitted for o in outcomes), total_s + catch_up)
        if finished:
            for row in finished:
                sim = running[row]
                sim.latency = now - sim.arrival
                latencies.append(sim.latency)
                token_seconds.append((now - sim.first_token) / (sim.trace.length - 1))
            gone = set(finished)
            running = [s for row, s in enumerate(running) if row not in gone]
    lat = np.asarray(latencies)
    extra = {"requests": [_request_figures(sim) for sim in sims]} if per_request else {}
    return {**extra,
        "generated_tokens": int(emitted_total),
        "simulated_seconds": round(now, 6),
        "prefill_seconds": round(prefill_seconds, 6),
        "catch_up_seconds": round(catch_up_seconds, 6),
        "tokens_per_s": round(emitted_total / now, 4) if now > 0 else None,
        "steps": steps,
        "request_steps": request_steps,
        "drafted": int(drafted),
        "accepted": int(accepted_total),
        "acceptance_rate": round(accepted_total / drafted, 4) if drafted else None,
        "mean_acceptance_length": _rounded(mean_acceptance_length(accepted_total, request_steps)),
        "latency_p50": round(float(np.percentile(lat, 50)), 6),
        "latency_p90": round(float(np.percentile(lat, 90)), 6),
        "latency_p99": round(float(np.percentile(lat, 99)), 6),
        **_tpot_figures(token_seconds),
        "k_histogram": {str(k): int(v) for k, v in sorted(k_hist.items())},
        "batch_k_histogram": {str(k): int(v) for k, v in sorted(batch_k_hist.items())},
    }


def _tpot_figures(token_seconds: list[float]) -> dict:
    """TPOT percentiles in seconds over the requests that emitted more than one token."""
    if not token_seconds:
        return {"tpot_p50": None, "tpot_p99": None}
    return {f"tpot_p{q}": round(float(np.percentile(token_seconds, q)), 6) for q in (50, 99)}


def _request_figures(sim: _Sim) -> dict:
    return {"index": sim.index, "prompt_id": sim.trace.prompt_id, "trace": sim.trace.label, "tokens": int(sim.trace.length),
            "seconds": round(sim.seconds, 6), "tokens_per_s": round(sim.trace.length / sim.seconds, 3) if sim.seconds > 0 else None,
            "latency": round(sim.latency, 6), "drafted": int(sum(sim.ks)), "accepted": int(sum(sim.accepted)),
            "k_per_step": sim.ks, "accepted_per_step": sim.accepted}


def _oracle_bound(sims: list[_Sim], clock: _Clock, batch_size: int, max_k: int) -> dict:
    rows = CostRows(clock.cm, max_k, shared_up_to=batch_size)
    total = 0.0
    tokens = drafted = accepted = request_steps = 0
    k_hist: Counter = Counter()
    prefill_seconds = 0.0
    for sim in sims:
        n, p = sim.trace.length, sim.trace.prompt_length
        value, best = dp_schedule(sim.run, p, rows, max_k)
        total += value
        tokens += n
        prefill_seconds += clock.prefill(p)
        t = 1
        while t < n:  # walk the schedule for its statistics
            k = int(best[t])
            k, acc, emitted = replay.step(sim.run, t, k, n)
            drafted, accepted, request_steps = drafted + k, accepted + acc, request_steps + 1
            k_hist[k] += 1
            t += emitted
    seconds = total + prefill_seconds
    return {
        "oracle": "upper-bound",
        "generated_tokens": int(tokens),
        "simulated_seconds": round(seconds, 6),
        "prefill_seconds": round(prefill_seconds, 6),
        "tokens_per_s": round(tokens / seconds, 4) if seconds > 0 else None,
        "request_steps": request_steps,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "mean_acceptance_length": _rounded(mean_acceptance_length(accepted, request_steps)),
        "latency_p50": None, "latency_p90": None, "latency_p99": None, "tpot_p50": None, "tpot_p99": None,
        "k_histogram": {str(k): int(v) for k, v in sorted(k_hist.items())},
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
