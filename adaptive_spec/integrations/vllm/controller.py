"""The controller as a vLLM step sees it: one policy, per-request acceptance history, step timing.

This module owns the bookkeeping between a host that drafts at the end of a step and verifies at
the next (vLLM) and the policy protocol of `control/`. It imports nothing from vLLM, so it is tested
with numbers alone; `scheduler.py` feeds it from vLLM's scheduler.

Timeline of one vLLM step N (engine core, synchronous scheduling):
  schedule()              -> the controller chooses each request's k for the drafts proposed at the
                             end of step N (`choose`); the step's draft length is max k;
  execute_model()         -> the target verifies the drafts of step N-1, then the drafter proposes;
  update_from_output()    -> the controller records what step N verified (`finish_step`);
  update_draft_token_ids  -> each request's new drafts are cut to its chosen k (`draft_length`).
So a choice made at step N sees every outcome up to step N-1 (the drafts of step N-1 are being
verified while it is made): one step of lag, the price of drafting inside the forward pass. The
policy is told (`StepRecord.lag`), so it pairs each outcome with the choice that drafted it.

Stopping inside the step (`enable_stopping`): with a draft model the drafter asks `keep_drafting`
after each draft position of step N (inside execute_model, before update_from_output), with each
row's confidence; the policy's answers end rows early, and `draft_length` then gives what each row kept.

Timing: vLLM reports no split of a step, so the controller measures whole steps (schedule to
update_from_output) and hands them to the policy through `control.step_timing.whole_step_record`,
which attributes a whole step to the cost model's parts in the proportions the model predicts.
Steps that prefill any prompt carry no timing (a prefill is not a decode step's cost). The shared
cost model is handed every other step with each row's verified and drafting lengths and prices it
itself (`CostModel.fits_any_step`); for the per-cell correction, ragged steps that no profile cell
describes (a probe beside idle rows, a switch of K) carry no timing, and one where a few rows sit at
k = 0 beside rows at K is scaled to its cell (`step_timing.cell_equivalent`).
"""

from __future__ import annotations

import atexit
import itertools
import os
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ...control.cost_model import CostModel
from ...control.online_cost import cost_model_for, resolve_kind
from ...control.policy import (AcceptanceHistory, Policy, PolicyBase, PolicyError, RequestOutcome, RequestView,
                               StepRecord, adopt_stop_rule, ask_stop_rule, choose_ks)
from ...control.price_sweep import with_sweep
from ...control.registry import make_policy, with_tpot_target
from ...control.step_timing import (MIN_TIMED_CATCH_UP, STOP_MAX_BATCH, cell_equivalent, fits_any_step,
                                    mixed_step_seconds, whole_step_record)

POLICY_ENV = "ADAPTIVE_SPEC_VLLM_POLICY"
PROFILE_ENV = "ADAPTIVE_SPEC_VLLM_PROFILE"
COST_MODEL_ENV = "ADAPTIVE_SPEC_VLLM_COST_MODEL"
SAVE_LEARNED_ENV = "ADAPTIVE_SPEC_VLLM_SAVE_LEARNED"
CALIBRATE_ENV = "ADAPTIVE_SPEC_VLLM_CALIBRATE"
SLO_TPOT_ENV = "ADAPTIVE_SPEC_VLLM_SLO_TPOT"
SAVE_EVERY = 256  # newly learned steps between writes of the learned cost state
DEFAULT_POLICY = "goodput"
# Drafting steps in a row whose drafter never asked the stop rule before the controller stops
# counting on it (a drafter that cannot stop: probabilistic draft sampling, M-RoPE positions, ...).
MAX_UNASKED_STEPS = 3
DEFAULT_STOP_MAX_BATCH = STOP_MAX_BATCH  # the in-step rule's batch limit (`control.step_timing`)


@dataclass(frozen=True)
class ControllerSettings:
    """Which policy, latency profile and cost model the plug-in uses.

    vLLM builds the scheduler from a class name, so a wrapper passes these through the environment:
    `ADAPTIVE_SPEC_VLLM_POLICY` (a policy name as `make_policy` takes it; default goodput),
    `ADAPTIVE_SPEC_VLLM_PROFILE` (a profile JSON file or a learned state; unset or 'none' = learn
    costs online), `ADAPTIVE_SPEC_VLLM_COST_MODEL` (cells, the default, or shared:
    `control.online_cost`) and `ADAPTIVE_SPEC_VLLM_SAVE_LEARNED` (a file the shared model's learned
    state is written to every `SAVE_EVERY` timed steps and at exit; implies shared) and
    `ADAPTIVE_SPEC_VLLM_CALIBRATE` (seconds of a start-up sweep of draft lengths on the first traffic,
    `control.price_sweep`; unset or 0 = none) and `ADAPTIVE_SPEC_VLLM_SLO_TPOT` (goodput's latency
    guard, milliseconds per output token, `--slo-tpot`; unset or 0 = none).
    """

    policy: str = DEFAULT_POLICY
    profile: str | None = None
    cost_model: str | None = None  # None: cells, or shared when save_learned is set
    save_learned: str | None = None
    calibrate: float = 0.0  # seconds of start-up sweep (0: none)
    slo_tpot: float = 0.0  # goodput's target milliseconds per output token (0: none)

    @classmethod
    def from_environment(cls, environ: dict | None = None) -> "ControllerSettings":
        environ = os.environ if environ is None else environ
        profile = environ.get(PROFILE_ENV) or None
        return cls(environ.get(POLICY_ENV) or DEFAULT_POLICY, None if profile in (None, "none") else profile,
                   environ.get(COST_MODEL_ENV) or None, environ.get(SAVE_LEARNED_ENV) or None,
                   _number(environ, CALIBRATE_ENV, "seconds"), _number(environ, SLO_TPOT_ENV, "milliseconds"))

    def environment(self) -> dict[str, str]:
        """The variables that reproduce these settings in a vLLM process."""
        env = {POLICY_ENV: self.policy, PROFILE_ENV: self.profile or "none"}
        if self.cost_model:
            env[COST_MODEL_ENV] = self.cost_model
        if self.save_learned:
            env[SAVE_LEARNED_ENV] = self.save_learned
        if self.calibrate:
            env[CALIBRATE_ENV] = repr(float(self.calibrate))
        if self.slo_tpot:
            env[SLO_TPOT_ENV] = repr(float(self.slo_tpot))
        return env

    @property
    def cost_model_kind(self) -> str:
        return resolve_kind(self.cost_model, bool(self.save_learned), kind_name=COST_MODEL_ENV,
                            save_name=SAVE_LEARNED_ENV)

    def build(self) -> tuple[Policy, CostModel | None]:
        """The policy and the cost model it reads (None for policies that read none).

        A missing or corrupt profile raises `ProfileError` naming the file; a bad policy name
        or cost model raises ValueError listing the known ones. An acceptance state saved beside the
        profile (`<profile>.acceptance.json`, written by `simulate --save-acceptance`) warm-starts
        goodput, as `--profile` does for this project's engine; a malformed one warns and is ignored."""
        built: list[CostModel] = []
        kind = self.cost_model_kind

        def cost_model() -> CostModel:  # loaded only for a policy that reads costs
            if self.profile is None:  # the shared model's generic shape is a whole-step host's, as vLLM's is
                model = CostModel.default() if kind == "cells" else cost_model_for(None, kind, whole_step=True)
            else:
                from ...profiling.profile_file import acceptance_path, load_acceptance, load_profile

                model = cost_model_for(load_profile(self.profile), kind)
                model.warm_start = load_acceptance(acceptance_path(self.profile))
            built.append(model)
            return model

        if self.profile is not None:  # fail at start-up, not at the first step that needs costs
            from ...profiling.profile_file import load_profile

            load_profile(self.profile)
        if self.calibrate < 0:
            raise ValueError(f"calibrate needs seconds >= 0, got {self.calibrate}")
        # a sweep for a policy that reads no costs is a clear error there
        policy = with_sweep(with_tpot_target(make_policy(self.policy, cost_model), self.slo_tpot), self.calibrate)
        return policy, (built[0] if built else None)

    def saver(self, cost_model: CostModel | None) -> "LearnedStateSaver | None":
        """What writes `save_learned` for this cost model (None when nothing is to be saved)."""
        if not self.save_learned or cost_model is None:
            return None
        from ...profiling.profile_file import load_profile

        prior = load_profile(self.profile) if self.profile is not None else None
        return LearnedStateSaver(cost_model, self.save_learned, prior)


def _number(environ, name: str, unit: str) -> float:
    text = environ.get(name) or "0"
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number of {unit}, got {text!r}") from None


class LearnedStateSaver:
    """Writes a shared cost model's learned state (`profile_file.learned_profile`, engine "vllm") every
    `every` newly learned steps and at interpreter exit. vLLM's engine has no shutdown hook a
    scheduler sees, so the file is rewritten as it goes (atomically); a write that fails warns once
    and never stops the engine."""

    def __init__(self, model: CostModel, path: str, prior: dict | None, every: int = SAVE_EVERY):
        if not hasattr(model, "learned_state"):
            raise ValueError("only the shared cost model has a learned state to save")
        self.model, self.path, self.prior, self.every = model, path, prior, int(every)
        self.saved_at = model.observations  # a resumed state is on disk already
        self._warned = False
        atexit.register(self.save)

    def step(self) -> None:
        if self.model.observations - self.saved_at >= self.every:
            self.save()

    def save(self) -> bool:
        """Write now if anything was learned since the last write; True when written."""
        from ...profiling.profile_file import ProfileError, learned_profile, machine_fingerprint, save_profile

        if self.model.observations == self.saved_at:
            return False
        device = ((self.prior or {}).get("fingerprint") or {}).get("device") or "cpu"
        fingerprint = {**machine_fingerprint(device), "engine": "vllm"}
        models = ((self.prior or {}).get("fingerprint") or {}).get("models")
        if models:  # the prior's model names: what `--profile auto` matches a state by
            fingerprint["models"] = models
        try:
            save_profile(learned_profile(self.model, self.prior, fingerprint, whole_step=True), self.path)
        except (OSError, ProfileError) as error:
            if not self._warned:
                self._warned = True
                warnings.warn(f"cannot write the learned cost state to {self.path}: {error}", RuntimeWarning, stacklevel=2)
            return False
        self.saved_at = self.model.observations
        return True


@dataclass(frozen=True)
class RunningRequest:
    """What the host knows of one request when the controller chooses its next k."""

    request_id: str
    context_length: int  # tokens the request will hold when these drafts are verified
    remaining_tokens: int  # tokens it may still emit after the step in flight
    cap: int  # the most drafts the host can verify for it (configured length, budget, model length)
    draft_behind: int = 0  # context tokens its lazy draft has missed (caught up before it drafts again)
    group: str = ""  # its acceptance group (RequestView.group): "constrained" under structured outputs


@dataclass(frozen=True)
class VerifiedRequest:
    """What one request's step did, as the host saw it after the step."""

    request_id: str
    drafted: int  # drafts verified
    accepted: int
    emitted: int
    context_length: int


@dataclass
class ControllerStats:
    """What the controller saw, for tests and reports: evidence that k really varied."""

    steps: int = 0
    ragged_steps: int = 0  # steps whose verified drafts differed between requests
    zero_k_choices: int = 0  # request-steps the policy gave k = 0 while the request could draft
    policy_failures: int = 0
    stopped_early: int = 0  # request-steps whose drafts the in-step rule ended before their k
    k_histogram: Counter = field(default_factory=Counter)  # chosen k per request-step
    verified_histogram: Counter = field(default_factory=Counter)  # drafts verified per request-step
    drafted: int = 0
    accepted: int = 0


class SpecController:
    """Asks one policy for each request's k and tells it what each step did.

    `choose` never raises for a policy's fault: a `PolicyError` makes that step run without
    speculation (every k = 0) and warns once; requests are untouched, so outputs stay exact.
    """

    def __init__(self, policy: Policy, cost_model: CostModel | None = None,
                 clock: Callable[[], float] = time.perf_counter, saver: LearnedStateSaver | None = None):
        self.policy = policy
        self.cost_model = cost_model
        self.saver = saver  # writes the cost model's learned state as it goes (--save-learned)
        self.clock = clock
        self.stats = ControllerStats()
        self._histories: dict[str, AcceptanceHistory] = {}
        # What the policy knows a request by: unique per admission, since vLLM may reuse an id
        # once its request has left, and a policy must not hand the newcomer the old one's state.
        self._keys: dict[str, str] = {}
        self._admissions = itertools.count()
        self._chosen: dict[str, int] = {}
        self._step_started: float | None = None
        self._warned = False
        # Which policy.choose call chose the drafts a step verifies (the previous step's): the lag.
        self._calls = 0
        self._this_call: int | None = None
        self._verified_call: int | None = None
        # Stopping inside the step (None: the drafter drafts each row's k)
        self._stop_rule = None
        self._stop_max_batch: int | None = None  # None: every batch size
        self._stopping = False  # whether this step's drafter asks the rule
        self._kept: dict[str, int] | None = None  # per request, drafts kept this step once the rule was asked
        self._live: set[str] = set()
        self._positions = 0  # draft positions the rule was asked about this step
        self._unasked_steps = 0
        # A list to keep one entry per step in (`step_entry`: bench --save-steps), or None.
        self.step_log: list[dict] | None = None
        self.log_label: dict = {}  # what each logged step is tagged with when saved (its configuration)
        self._step_finished: float | None = None  # when the last logged step's time was read

    # --- before a step -------------------------------------------------------------------------
    def start_step(self) -> None:
        self._step_started = self.clock()

    def choose(self, requests: Sequence[RunningRequest]) -> dict[str, int]:
        """k per request id for the drafts proposed in this step (0 where the policy fails)."""
        views = [RequestView(self._key(r.request_id), r.context_length, max(r.remaining_tokens, 0), max(r.cap, 0),
                             self._histories.setdefault(r.request_id, AcceptanceHistory()), max(r.draft_behind, 0),
                             r.group)
                 for r in requests]
        self._verified_call, self._this_call = self._this_call, None
        if views:  # choose_ks asks the policy only for a non-empty batch
            self._calls += 1
            self._this_call = self._calls
        self._stopping = self._stop_rule is not None and (self._stop_max_batch is None
                                                          or len(views) <= self._stop_max_batch)
        if self._stop_rule is not None and isinstance(self.policy, PolicyBase):
            self.policy.host_stops_drafts = self._stopping  # it chooses each k knowing whether it may stop
        try:
            ks = choose_ks(self.policy, views)
        except PolicyError as error:
            self._fail(error)
            ks = [0] * len(views)
        self._chosen = {request.request_id: k for request, k in zip(requests, ks)}
        self._kept, self._live, self._positions = None, {r for r, k in self._chosen.items() if k > 0}, 0
        self.stats.k_histogram.update(ks)
        self.stats.zero_k_choices += sum(1 for view, k in zip(views, ks) if k == 0 and view.max_k > 0)
        return dict(self._chosen)

    def draft_length(self, request_id: str) -> int:
        """How many of a request's new drafts to keep (0 for a request the controller was not asked about)."""
        if self._kept is not None:
            return self._kept.get(request_id, 0)
        return self._chosen.get(request_id, 0)

    # --- inside the draft loop -----------------------------------------------------------------
    def enable_stopping(self, max_batch: int | None = None) -> bool:
        """For a drafter that will call `keep_drafting` at each draft position of a step that
        `stops_drafts`: tell the policy (it may then ask for more drafts than it expects to keep) and
        return whether it has a rule to ask. `max_batch`: only in steps of at most that many
        decoding requests (None: every step)."""
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 or None, got {max_batch}")
        self._stop_rule, self._stop_max_batch = adopt_stop_rule(self.policy), max_batch
        return self._stop_rule is not None

    @property
    def stops_drafts(self) -> bool:
        """Whether the drafts chosen last (this step's) are to be drafted asking `keep_drafting`."""
        return self._stopping

    def keep_drafting(self, position: int, confidences: dict[str, float]) -> dict[str, int]:
        """The policy's answer per drafting request at draft `position`: 1 draft on, 2 keep this draft and
        stop (KEEP_LAST), 0 drop it and stop. `confidences` maps request id to the draft's confidence
        there. A policy that fails ends every row's drafts (that step runs without speculation)."""
        if not self._stopping:
            return dict.fromkeys(confidences, 1)
        if self._kept is None:
            self._kept = dict.fromkeys(self._chosen, 0)
        self._positions = max(self._positions, position + 1)
        order = list(self._chosen)
        shown = [confidences.get(r) if r in self._live and position < self._chosen[r] else None for r in order]
        try:
            answers = ask_stop_rule(self._stop_rule, position, shown)
        except PolicyError as error:
            self._fail(error)
            self._kept, self._live = dict.fromkeys(self._chosen, 0), set()
            return dict.fromkeys(confidences, 0)
        out = {}
        for request_id, confidence, answer in zip(order, shown, answers):
            if confidence is None:
                self._live.discard(request_id)
                continue
            self._kept[request_id] += answer > 0
            if answer != 1:
                self._live.discard(request_id)
                self.stats.stopped_early += self._kept[request_id] < self._chosen[request_id]
            out[request_id] = answer
        return out

    # --- after a step --------------------------------------------------------------------------
    def finish_step(self, verified: Sequence[VerifiedRequest], timed: bool = True, observe: bool = True,
                    catch_up_tokens: int = 0, prefill_tokens: int = 0) -> StepRecord | None:
        """Record each request's outcome and tell the policy (unless `observe` is False: another scheduler
        chose this step's k); `timed` = the step was a pure decode step, so its wall time is a step cost.
        `catch_up_tokens`: context tokens the lazy draft caught up on in this step (summed over rows).
        Such a step's time is not a step cost: what it took beyond one goes to the cost model as
        catch-up time, when the catch-up was long enough to stand out of a step's noise.
        `prefill_tokens`: prompt tokens computed in this step (for the step log alone)."""
        started, self._step_started = self._step_started, None
        self._check_stops_were_asked()
        if not verified:
            return None
        now = self.clock()
        wall = now - started if started is not None else 0.0
        total = wall if timed else 0.0
        if catch_up_tokens:
            if total > 0 and catch_up_tokens >= MIN_TIMED_CATCH_UP and self.cost_model is not None:
                self.cost_model.observe_catch_up(catch_up_tokens, total - self._step_without_catch_up(verified))
            total = 0.0
        else:
            total *= self._cell_scale(verified)
        outcomes = []
        for request in verified:
            history = self._histories.setdefault(request.request_id, AcceptanceHistory())
            history.record(request.drafted, request.accepted)
            outcomes.append(RequestOutcome(self._key(request.request_id), request.drafted, request.accepted,
                                           request.emitted))
        lag = self._calls - self._verified_call if self._verified_call is not None else -1
        drafting = tuple(self.draft_length(r.request_id) for r in verified)
        record = whole_step_record(
            self.cost_model, batch_size=len(verified), batch_k=max(r.drafted for r in verified),
            context_lengths=tuple(r.context_length for r in verified), outcomes=tuple(outcomes), total_seconds=total,
            lag=lag, drafting=drafting, draft_positions=max(self._positions, *drafting))
        self.stats.steps += 1
        self.stats.ragged_steps += len({r.drafted for r in verified}) > 1
        self.stats.verified_histogram.update(r.drafted for r in verified)
        self.stats.drafted += sum(r.drafted for r in verified)
        self.stats.accepted += sum(r.accepted for r in verified)
        if self.step_log is not None:
            self.step_log.append(self._step_entry(verified, record, started, wall, catch_up_tokens, prefill_tokens))
            self._step_finished = now
        if not observe:
            return record
        try:
            self.policy.observe(record)
        except Exception as error:  # a policy is an optimisation: it must never take vLLM's engine down
            self._fail(PolicyError(f"policy {self.policy.name!r} raised {type(error).__name__} in observe: {error}"))
        if self.saver is not None:
            self.saver.step()
        return record

    def _step_entry(self, verified: Sequence[VerifiedRequest], record: StepRecord, started: float | None,
                    wall: float, catch_up_tokens: int, prefill_tokens: int) -> dict:
        """One step as `bench --save-steps` keeps it, priced by the cost model before it learns the
        step: the lengths each row verified and drafts, what the draft ran, the wall time (`seconds`,
        schedule to the end of the step's bookkeeping; a prefill's is not priced), what the cost model was handed (`learned`, 0 =
        untimed) and the engine loop's time since the previous step ended (`between`)."""
        context = max(r.context_length for r in verified)
        drafting = list(record.drafting) if self._calls else None  # None: vLLM's own schedule chose
        predicted = None
        if self.cost_model is not None and drafting is not None and not prefill_tokens:
            predicted = mixed_step_seconds(self.cost_model, len(verified), context, [r.drafted for r in verified], drafting)
        # the engine loop outside the step, since the last logged step's time was read
        between = started - self._step_finished if started is not None and self._step_finished is not None else None
        return {"step": self.stats.steps, "batch": len(verified), "context": context,
                "verified": [r.drafted for r in verified], "accepted": [r.accepted for r in verified],
                "drafting": drafting, "draft_positions": record.draft_positions,
                "catch_up_tokens": int(catch_up_tokens), "prefill_tokens": int(prefill_tokens),
                "seconds": wall, "learned": record.total_seconds, "predicted": predicted, "between": between}

    def _cell_scale(self, verified: Sequence[VerifiedRequest]) -> float:
        """What turns this step's time into its profile cell's (`step_timing.cell_equivalent`), 0 where
        none stands for it. vLLM's cost follows the tokens a step runs, not its longest draft, so a
        probe at k = 4 beside seven rows at 0 costs far less than the cell of its longest draft: timed
        into that cell it would make K = 4 look cheap for the whole batch."""
        if fits_any_step(self.cost_model):
            return 1.0  # it prices every step from the rows' lengths, dropped drafts included
        verified_ks = [r.drafted for r in verified]
        drafting_ks = [self.draft_length(r.request_id) for r in verified]
        if self._kept is not None and self._positions > max(verified_ks + drafting_ks):
            return 0.0  # a draft dropped past K still cost its forward: no cell holds that step
        context = max(r.context_length for r in verified)
        return cell_equivalent(self.cost_model, len(verified), context, verified_ks, drafting_ks)

    def _check_stops_were_asked(self) -> None:
        """A step that drafted without the drafter asking the rule means the drafter cannot stop; after
        a few, tell the policy so (it then chooses each K as a host that drafts exactly k)."""
        if not self._stopping or (not self._live and self._kept is None):
            return
        self._unasked_steps = 0 if self._kept is not None else self._unasked_steps + 1
        if self._unasked_steps >= MAX_UNASKED_STEPS:
            self._stop_rule, self._stopping = None, False
            if isinstance(self.policy, PolicyBase):
                self.policy.host_stops_drafts = False
            warnings.warn("the drafter never asked the policy's in-step rule; drafts now run their full k",
                          RuntimeWarning, stacklevel=3)

    def _step_without_catch_up(self, verified: Sequence[VerifiedRequest]) -> float:
        """The predicted step: it verified the previous step's drafts and drafted this step's
        (`step_timing.mixed_step_seconds`)."""
        context = max(r.context_length for r in verified)
        return mixed_step_seconds(self.cost_model, len(verified), context, [r.drafted for r in verified],
                                  [self.draft_length(r.request_id) for r in verified])

    def _fail(self, error: PolicyError) -> None:
        self.stats.policy_failures += 1
        if not self._warned:
            self._warned = True
            warnings.warn(f"{error}; steps where it fails run without speculation (outputs stay exact)",
                          RuntimeWarning, stacklevel=3)

    def forget(self, live_request_ids) -> None:
        """Drop the histories and policy keys of requests that left."""
        live = set(live_request_ids)
        for request_id in [r for r in self._histories if r not in live]:
            del self._histories[request_id]
        for request_id in [r for r in self._keys if r not in live]:
            del self._keys[request_id]

    def _key(self, request_id: str) -> str:
        if request_id not in self._keys:
            self._keys[request_id] = f"{request_id}#{next(self._admissions)}"
        return self._keys[request_id]
