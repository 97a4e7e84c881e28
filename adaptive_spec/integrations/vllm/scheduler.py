"""The engine core's side of the plug-in: a `Scheduler` subclass that runs our controller.

vLLM's scheduler is not a public API, so this module is fenced to the versions it was tested with
(`fence.TESTED_VERSIONS`) and refuses others at import with a message saying what to do. The only
other module touching vLLM internals is `lazy_draft.py` (the model runner's side); the rest goes
through `controller.py` (no vLLM) or vLLM's public entry points.

Hooks used (vLLM 0.32, synchronous scheduling, which the CPU platform forces):
- `schedule()`: after vLLM schedules the step, the controller chooses each decoding request's k and
  the step's draft length is set to the largest (`SchedulerOutput.num_spec_tokens_to_schedule`, the
  field vLLM's own batch-size table sets; the drafter proposes that many tokens at the end of the step).
- `update_draft_token_ids()`: each request's new drafts are cut to its k before vLLM stores them.
  Shortening drafts is all the plug-in does to a request, so outputs are vLLM's own (exactness is
  vLLM's rejection sampler's, unchanged).
- `update_from_output()`: what the step verified: drafts scheduled per request and tokens sampled
  (accepted drafts + one), and the step's wall time.
The configured `num_speculative_tokens` is the cap on any k: vLLM sizes its buffers by it.
On CPU, sampled requests get no drafts unless vLLM's sampler is fixed (`sampled_speculation_is_exact`).
With a draft model, the draft runs only for the rows given k > 0 (`lazy_draft.py`, worker side; the
scheduler names them on the step's output), so a step at K = 0 skips it altogether; the scheduler
counts per request the tokens the draft has missed, shows them to the policy and reports the step
that catches the draft up, whose time is not a decode step's. There the policy's in-step rule also
runs inside the draft loop (`STOP_RULE` on the step's output) in steps of at most
`ADAPTIVE_SPEC_VLLM_STOP_DRAFTS` decoding requests (default 1; 0 never, `all` every step): after
each draft position it may end a row's drafts, and the drafter ends the loop once no row drafts on.
"""

from __future__ import annotations

import os

import vllm

from .fence import TESTED_VERSIONS, UnsupportedVLLMVersion, check_vllm_version  # noqa: F401 (re-exported)

check_vllm_version(vllm.__version__)

from vllm.platforms import current_platform  # noqa: E402  (after the fence on purpose)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup  # noqa: E402

from . import cpu_sampling  # noqa: E402
from .controller import (DEFAULT_STOP_MAX_BATCH, ControllerSettings, RunningRequest, SpecController,  # noqa: E402
                         VerifiedRequest)
from .lazy_draft import DRAFT_ROWS, STOP_RULE  # noqa: E402
from .lazy_draft import enabled_for as lazy_draft_enabled_for  # noqa: E402

STOP_ENV = "ADAPTIVE_SPEC_VLLM_STOP_DRAFTS"  # the largest batch the in-step rule runs in; 0 never, all always


def stop_max_batch(value: str | None) -> int | None:
    """`ADAPTIVE_SPEC_VLLM_STOP_DRAFTS` read: unset = DEFAULT_STOP_MAX_BATCH, `all` = None (every batch)."""
    if value is None or not value.strip():
        return DEFAULT_STOP_MAX_BATCH
    if value.strip().lower() == "all":
        return None
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise ValueError(f"{STOP_ENV} must be a batch size >= 0 or 'all', got {value!r}")
    return number


def sampled_speculation_is_exact() -> bool:
    """Whether this platform's vLLM keeps the output law when it verifies drafts of sampled
    (temperature > 0) requests. On CPU only with `cpu_sampling`'s fix installed (the plug-in's entry
    point and `make_llm` install it): vLLM 0.32's CPU `expand` loses float sampling parameters, so its
    rejection sampler divides the target's logits by uninitialised memory. Where this is False the
    plug-in gives sampled requests no drafts: exact, at the speed of k = 0. Greedy requests never
    expand sampling parameters (their outputs equal plain vLLM's either way)."""
    return not current_platform.is_cpu() or cpu_sampling.installed()


class AdaptiveScheduler(Scheduler):
    """vLLM's scheduler with the speculation length chosen per request and per step by a policy.

    Use: `vllm serve MODEL --speculative-config '{...}' --scheduler-cls
    adaptive_spec.integrations.vllm.AdaptiveScheduler`, with the policy and profile in the
    environment (see `ControllerSettings`).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if getattr(self.scheduler_config, "async_scheduling", False):
            raise ValueError("adaptive_spec's scheduler needs synchronous scheduling (--no-async-scheduling)")
        settings = ControllerSettings.from_environment()
        policy, cost_model = settings.build()
        self.controller = SpecController(policy, cost_model, saver=settings.saver(cost_model))
        self.vllm_lookup: list[int] | None = None  # set by `use_vllm_schedule`: vLLM decides, we only record
        self.sampled_speculation = sampled_speculation_is_exact()  # False: sampled requests get no drafts
        self._output_before: dict[str, int] = {}
        # With a draft model, steps at K = 0 skip the draft (`lazy_draft.py`); the step that drafts next
        # also runs the draft over the tokens every row missed, a cost the policy is shown per row
        # (`RunningRequest.draft_behind`) and the controller times apart from the step's own.
        spec = self.vllm_config.speculative_config
        self.lazy_draft = bool(spec is not None and spec.uses_draft_model() and lazy_draft_enabled_for(type(self)))
        self._enable_stopping()
        self._draft_seen: dict[str, int] = {}  # per request: context tokens its draft has run over
        self._catch_up_tokens = 0  # what this step's draft runs over beyond its rows' own tokens

    # --- switching between our controller and vLLM's own schedules (benchmarks) ------------------
    def use_controller(self, controller: SpecController) -> None:
        self.controller, self.vllm_lookup = controller, None
        self._enable_stopping()

    def _enable_stopping(self) -> None:
        """The lazy draft asks the policy's in-step rule (greedy drafts from a draft model only)."""
        max_batch = stop_max_batch(os.environ.get(STOP_ENV))
        if self.lazy_draft and max_batch != 0:
            self.controller.enable_stopping(max_batch)

    def use_vllm_schedule(self, per_batch_size: list[tuple[int, int, int]]) -> None:
        """Let vLLM's own dynamic mode choose (a `num_speculative_tokens_per_batch_size` table)."""
        self.vllm_lookup = build_dynamic_sd_schedule_lookup(
            per_batch_size, vllm_max_batch_size=self.scheduler_config.max_num_seqs,
            vllm_num_speculative_tokens=self.num_spec_tokens)

    # --- hooks ----------------------------------------------------------------------------------
    def schedule(self, *args, **kwargs):
        self.controller.start_step()
        output = super().schedule(*args, **kwargs)
        self._output_before = {req_id: self.requests[req_id].num_output_tokens
                               for req_id in output.num_scheduled_tokens}
        if not self.num_spec_tokens:
            return output
        if self.vllm_lookup is not None:
            batch = len(output.num_scheduled_tokens)
            output.num_spec_tokens_to_schedule = self.vllm_lookup[min(batch, len(self.vllm_lookup) - 1)] if batch else 0
        else:
            decoding = [self._running_request(self.requests[req_id], output) for req_id in output.num_scheduled_tokens
                        if not self.requests[req_id].is_prefill_chunk]
            ks = self.controller.choose(decoding)
            output.num_spec_tokens_to_schedule = max(ks.values(), default=0)
        self._catch_up_tokens = 0
        if self.lazy_draft and output.num_spec_tokens_to_schedule:
            drafting = list(output.num_scheduled_tokens)  # vLLM's schedule drafts for every row
            if self.vllm_lookup is None:
                # ours drafts for the rows given k > 0 alone: the others skip the draft, prompt included
                drafting = [req_id for req_id, k in ks.items() if k > 0]
                setattr(output, DRAFT_ROWS, frozenset(drafting))
                if self.controller.stops_drafts:
                    setattr(output, STOP_RULE, self.controller.keep_drafting)
            # The draft runs over each drafting row's missed tokens, then over this step's own.
            for req_id in drafting:
                self._catch_up_tokens += self._draft_behind(self.requests[req_id], output)
                self._draft_seen[req_id] = self.requests[req_id].num_computed_tokens
        return output

    def _draft_behind(self, request, output) -> int:
        """Tokens the lazy draft would run over for this request in this step beyond a decoding row's
        own (its token and drafts): those it missed at K = 0, and a prompt prefilled in this step,
        whose draft prefill is the same cost (0 without a lazy draft). vLLM counts this step's tokens
        as computed once it is scheduled; drafts rejected in the step that last drafted make this an
        undercount of at most that step's drafts."""
        if not self.lazy_draft:
            return 0
        own = 1 + len(output.scheduled_spec_decode_tokens.get(request.request_id, ()))
        return max(request.num_computed_tokens - self._draft_seen.get(request.request_id, 0) - own, 0)

    def update_draft_token_ids(self, draft_token_ids) -> None:
        if self.vllm_lookup is None:
            for index, req_id in enumerate(draft_token_ids.req_ids):
                keep = self.controller.draft_length(req_id)
                drafts = draft_token_ids.draft_token_ids[index]
                if len(drafts) > keep:
                    draft_token_ids.draft_token_ids[index] = list(drafts[:keep])
        super().update_draft_token_ids(draft_token_ids)

    def update_from_output(self, scheduler_output, model_runner_output):
        verified = []
        sampled = model_runner_output.sampled_token_ids
        prefill_tokens = 0
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            index = model_runner_output.req_id_to_index.get(req_id)
            if request is None or index is None or not sampled:
                continue
            tokens = len(sampled[index])
            scheduled_drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id, ())
            # a step that computed prompt tokens: its time is not a decode step's cost
            prefill_tokens += max(scheduler_output.num_scheduled_tokens[req_id] - 1 - len(scheduled_drafts), 0)
            drafts = [t for t in scheduled_drafts if t >= 0]  # -1 marks a placeholder, not a draft
            if not tokens:
                continue  # a non-final prefill chunk samples nothing
            budget = request.max_tokens - self._output_before.get(req_id, request.num_output_tokens)
            verified.append(VerifiedRequest(req_id, len(drafts), max(tokens - 1, 0), min(tokens, max(budget, 0)),
                                            request.num_tokens))
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self.controller.finish_step(verified, timed=not prefill_tokens, observe=self.vllm_lookup is None,
                                    catch_up_tokens=self._catch_up_tokens, prefill_tokens=prefill_tokens)
        self.controller.forget(self.requests)
        for req_id in [r for r in self._draft_seen if r not in self.requests]:
            del self._draft_seen[req_id]
        return outputs

    # --- views ----------------------------------------------------------------------------------
    def _running_request(self, request, output) -> RunningRequest:
        """The request as it will be when the drafts proposed in this step are verified: one more
        token (this step emits at least one), and room for k drafts plus their bonus token."""
        remaining = request.max_tokens - request.num_output_tokens - 1
        room = self.max_model_len - request.num_tokens - 2
        cap = min(self.num_spec_tokens, remaining - 1, room)
        if not self.sampled_speculation and _samples(request):
            cap = 0
        group = "constrained" if getattr(request, "structured_output_request", None) is not None else ""
        return RunningRequest(request.request_id, request.num_tokens + 1, remaining, cap,
                              self._draft_behind(request, output), group)


def _samples(request) -> bool:
    """The request samples (temperature above vLLM's greedy threshold) rather than decoding greedily."""
    params = getattr(request, "sampling_params", None)
    return params is not None and (params.temperature or 0.0) >= 1e-5  # vLLM's own threshold


def scheduler_of(llm) -> AdaptiveScheduler:
    """The scheduler of an in-process `vllm.LLM` (needs VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if not isinstance(scheduler, AdaptiveScheduler):
        raise RuntimeError("no in-process AdaptiveScheduler: build the LLM with scheduler_cls=AdaptiveScheduler "
                           "and VLLM_ENABLE_V1_MULTIPROCESSING=0")
    return scheduler
