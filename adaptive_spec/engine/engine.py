"""The speculative engine: continuous batching, a per-request k from the policy, exact sampling.

One `step()`:
  1. admit waiting requests (each prefilled alone; prefill emits its first token);
  2. take each constrained request's forced tokens (jump-forward: the only token its grammar allows
     there, run after run), then ask the policy for each running request's k (clamped to what the
     request can use); forced tokens take no draft slot;
  3. draft max k tokens for the batch (skipped when every k is 0); check what the drafter returned;
  4. verify: one target forward over [last token, forced tokens, k drafts] per row;
  5. accept / recover / bonus by rejection sampling; emit, cut at stop tokens and budgets;
  6. roll caches back to the kept tokens, tell the policy, retire finished requests.

A step is a transaction per request. User code runs inside it (constraints, a drafter, a policy);
whatever it raises fails only the request it belongs to (a constraint) or switches off only what
broke (a drafter or policy: the engine goes on without speculation, exactly). Caches are rolled back
by counts of kept tokens, and every token a step emits reaches the caller.

The engine knows nothing of tokenizers or text: prompts and outputs are token ids.
"""

from __future__ import annotations

import itertools
import time
import warnings
from typing import Iterable, Sequence

import torch

from ..control.policy import (Policy, PolicyError, RequestOutcome, RequestView, StaticPolicy, StepRecord, adopt_stop_rule,
                              choose_ks, draft_stop_rule)
from ..control.registry import make_policy
from ..modeling.drafters import Draft, Drafter, ModelDrafter, check_draft, logits_width, trim_draft
from ..modeling.kv import RaggedKV, same_length_groups
from ..sampling.params import SamplingParams
from ..sampling.rejection import verify
from .processing import MAX_FORCED, ForcedRun, StepSampler, forced_run
from .request import GenerationResult, Request, RequestStats, StepOutput


class SpecEngine:
    """Exact speculative decoding over a Hugging Face causal LM.

    target: a transformers causal LM. draft: a causal LM sharing the target's tokenizer, a
    `Drafter`, or None (no speculation possible; every k is 0). policy: a name ("off", "static:K",
    "goodput", ...; see `control.registry`) or a `Policy` object. max_k caps any k a policy picks; max_batch_size bounds running requests (the
    rest wait, first come first served). seed feeds the generator that seeds requests without one.
    jump_forward: take the tokens a grammar forces without drafting them (exact either way; off
    only to measure what it gives).
    """

    def __init__(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module | Drafter | None = None,
        policy: str | Policy = "off",
        *,
        max_k: int = 16,
        max_batch_size: int = 64,
        seed: int = 0,
        jump_forward: bool = True,
    ):
        self.target = target.eval()
        self.vocab_size = logits_width(target)
        # Everything a step creates lives here: the device of the target's logits.
        self.device = next(target.parameters()).device
        if draft is None or isinstance(draft, Drafter):
            self.drafter: Drafter | None = draft
        elif isinstance(draft, torch.nn.Module):
            self.drafter = ModelDrafter(draft)
        else:
            raise ValueError(f"draft must be a causal LM, a Drafter (see modeling.drafters.DrafterBase) or None, "
                             f"got {type(draft).__name__}")
        if self.drafter is not None and self.drafter.vocab_size not in (None, self.vocab_size):
            raise ValueError(
                f"draft and target vocabularies differ: the draft produces {self.drafter.vocab_size} logits, "
                f"the target {self.vocab_size}; speculative decoding needs one shared tokenizer"
            )
        self.policy = make_policy(policy)
        adopt_stop_rule(self.policy)  # this engine stops drafts inside the step
        if max_k < 0 or max_batch_size < 1:
            raise ValueError("max_k must be >= 0 and max_batch_size >= 1")
        self.max_k = max_k if self.drafter is not None else 0
        self.max_batch_size = max_batch_size
        self.jump_forward = jump_forward
        self._seeds = torch.Generator().manual_seed(seed)
        self._ids = itertools.count()
        self._serials = itertools.count()
        self._kv = RaggedKV(target)
        self.max_positions = getattr(target.config, "max_position_embeddings", None)
        # Sliding-window models: a request (plus one step's drafts) must fit in the window.
        windows = [self._kv.attention_window, self.drafter.attention_window if self.drafter else None]
        self.attention_window = min((w for w in windows if w), default=None)
        self._running: list[Request] = []
        self._waiting: list[Request] = []
        self._drafter_error: str | None = None
        self.policy_error: str | None = None
        self._warned: set[str] = set()

    # --- the serving-loop API ----------------------------------------------------------------
    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request; raises ValueError naming the problem if it cannot be served."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if any(r.request_id == request_id for r in self._waiting + self._running):
            raise ValueError(f"request id {request_id!r} is already in use")
        self._waiting.append(self._new_request(request_id, prompt, params))
        return request_id

    def abort(self, request_id: str) -> GenerationResult | None:
        """Stop a request; its tokens so far come back with finish_reason "aborted"."""
        for queue in (self._waiting, self._running):
            for row, request in enumerate(queue):
                if request.request_id == request_id:
                    request.finish_reason = "aborted"
                    if queue is self._running:
                        self._retire([row])
                    else:
                        queue.pop(row)
                    return request.result()
        return None

    @property
    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    @property
    def drafter_error(self) -> str | None:
        """Why speculation was switched off for good (a drafter that raised), or None."""
        return self._drafter_error

    def step(self) -> list[StepOutput]:
        outputs = self._admit()
        if not self._running:
            return outputs
        started = time.perf_counter()
        forced = self._forced_runs()
        ks = self._choose_k(forced)
        sampler = StepSampler(self._running, ks, self.vocab_size, self.device, forced)
        draft, draft_seconds = self._draft(ks, sampler)
        outputs += self._verify_and_emit(draft, sampler, started, draft_seconds)
        return outputs

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Run prompts to completion. A prompt that cannot be served comes back with `error` set;
        the others are unaffected."""
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} SamplingParams")
        entries: list[Request | GenerationResult] = []
        for prompt, p in zip(prompts, params_list):
            request_id = f"gen-{next(self._ids)}"
            try:
                self.add_request(prompt, p, request_id)
                entries.append(self._waiting[-1])
            except ValueError as error:
                entries.append(_rejected(request_id, prompt, str(error)))
        while any(isinstance(e, Request) and e.finish_reason is None for e in entries):
            self.step()
        return [e.result() if isinstance(e, Request) else e for e in entries]

    # --- step phases -------------------------------------------------------------------------
    def _admit(self) -> list[StepOutput]:
        """Prefill waiting requests; prompts of equal length share one forward (no padding)."""
        room = self.max_batch_size - len(self._running)
        joining, self._waiting = self._waiting[:room], self._waiting[room:]
        outputs = []
        groups = [[joining[i] for i in group] for group in same_length_groups([r.prompt for r in joining])]
        while groups:
            requests = groups.pop(0)
            try:
                kv, verdict, errors = self._prefill(requests)
            except Exception as error:
                if len(requests) > 1:  # find the request at fault: retry each alone
                    groups[:0] = [[request] for request in requests]
                    continue
                request = requests[0]
                request.fail(f"prefill failed: {type(error).__name__}: {error}")
                outputs.append(_output(request, []))
                continue
            for request, token, error in zip(requests, verdict.final_tokens.tolist(), errors):
                if error:
                    request.fail(error)
                else:
                    self._emit(request, [token])
                outputs.append(_output(request, request.generated))
            live = [row for row, r in enumerate(requests) if r.finish_reason is None]
            kv.select_rows(live)
            self._kv.append_rows(kv)
            self._running += [requests[row] for row in live]
            if self.drafter is not None and self._drafter_error is None:
                self._guard_drafter(lambda: self.drafter.add_requests([requests[row].prompt for row in live]))
        return outputs

    def _prefill(self, requests: list[Request]):
        kv = RaggedKV(self.target)
        logits = kv.forward([r.prompt for r in requests], logits_to_keep=1)  # [rows, 1, vocab]
        sampler = StepSampler(requests, [0] * len(requests), self.vocab_size, self.device)
        verdict, errors = self._sample_final(sampler, logits, _no_draft(len(requests), self.device))
        _count_masks(requests, sampler)
        return kv, verdict, errors

    def _forced_runs(self) -> list[ForcedRun | None]:
        """Each row's jump-forward tokens, leaving room in its budget for one sampled token."""
        if not self.jump_forward:
            return [None] * len(self._running)
        return [forced_run(r, min(MAX_FORCED, r.remaining - 1), self.vocab_size) for r in self._running]

    def _choose_k(self, forced: Sequence[ForcedRun | None]) -> list[int]:
        if self.max_k == 0 or self._drafter_error is not None:
            return [0] * len(self._running)
        ahead = [len(run.tokens) if run is not None else 0 for run in forced]  # the policy sees each row past its forced tokens
        caps = [min(self.max_k, r.remaining - m - 1) for r, m in zip(self._running, ahead)]
        room = self.drafter.max_positions
        if room:  # a row's context plus its drafts must fit the drafter's positions
            caps = [min(cap, room - len(r.tokens) - m) for r, cap, m in zip(self._running, caps, ahead)]
        views = [RequestView(r.policy_key, len(r.tokens) + m, r.remaining - m, max(cap, 0), r.history,
                             group="constrained" if r.params.constraint is not None else "")
                 for r, cap, m in zip(self._running, caps, ahead)]
        try:
            return choose_ks(self.policy, views)
        except PolicyError as error:
            self._switch_policy_off(str(error))
            return [0] * len(self._running)

    def _draft(self, ks: list[int], sampler: StepSampler) -> tuple[Draft | None, float]:
        """The checked draft, or None when nothing was proposed (every k is 0, or the drafter failed)."""
        if max(ks) == 0:
            return None, 0.0
        started = time.perf_counter()
        contexts = [r.tokens + list(forced) for r, forced in zip(self._running, sampler.forced)]
        limits = torch.as_tensor(ks)
        sample = sampler.draft_sampler(limits, draft_stop_rule(self.policy))
        draft = self._guard_drafter(lambda: self.drafter.propose(contexts, ks, sample))
        if sampler.stop_error is not None:  # the drafts made before it stand (they are exact)
            self._switch_policy_off(sampler.stop_error)
        if draft is not None:
            draft, problem = check_draft(draft, ks, self.vocab_size, self.device)
            if problem:
                self._warn_once("draft", f"the drafter returned an unusable draft ({problem}); such rows verify "
                                "without drafts (warned once)")
            else:  # rows stopped inside the step: verify only the columns some row drafted
                draft = trim_draft(draft)
        return draft, time.perf_counter() - started

    def _verify_and_emit(self, draft: Draft | None, sampler: StepSampler, started: float,
                         draft_seconds: float) -> list[StepOutput]:
        proposed = draft is not None  # a stateful drafter must hear back about every proposal
        drafted = draft.num_drafted.cpu() if proposed else torch.zeros(len(self._running), dtype=torch.long)
        width = int(draft.tokens.shape[1]) if proposed else 0  # the drafter's K, forced tokens apart
        forced = sampler.num_forced  # [rows]: verified first, accepted for sure unless the target fails there
        draft = sampler.verified(draft) or _no_draft(len(self._running), self.device)
        verify_started = time.perf_counter()
        before = self._kv.lengths
        last = torch.as_tensor([[r.tokens[-1]] for r in self._running], device=self.device)
        # Row i holds its last token and its own drafts; the columns past them are holes.
        columns = torch.arange(draft.tokens.shape[1] + 1, device=self.device)
        real = columns[None, :] <= draft.num_drafted[:, None]
        try:
            logits = self._kv.forward(torch.cat([last, draft.tokens], dim=1), real=real)  # [rows, K + 1, vocab]
        except BaseException:
            if proposed:  # the target failed, not a request: leave the drafter as if nothing was drafted
                self._guard_drafter(lambda: self.drafter.accept(torch.zeros(len(self._running), dtype=torch.long)))
            raise
        verdict, errors = self._sample_final(sampler, logits, draft)
        verify_seconds = time.perf_counter() - verify_started
        _count_masks(self._running, sampler)

        # Commit. Nothing below raises for one request's sake: a failing row keeps the drafts
        # accepted before its failure (plain decoding had emitted them) and then fails alone.
        outputs, outcomes, finished = [], [], []
        kept = verdict.num_accepted.cpu()  # forced tokens and drafts the target kept
        for row, request in enumerate(self._running):
            m, k = int(forced[row]), int(drafted[row])
            accepted = max(int(kept[row]) - m, 0)  # of the drafter's own tokens: what the policy learns
            drafts = draft.tokens[row, : int(kept[row])].tolist()
            new = self._emit(request, drafts if errors[row] else drafts + [int(verdict.final_tokens[row])],
                             sampler.states_along(row, int(kept[row])))
            request.forced += min(m, len(new))
            if not errors[row]:
                request.history.record(k, accepted)
            elif request.finish_reason is None:
                request.fail(errors[row])
            outcomes.append(RequestOutcome(request.policy_key, k, accepted, len(new)))
            outputs.append(_output(request, new))
            if request.finish_reason is not None:
                finished.append(row)
        self._kv.truncate(before + 1 + kept)
        if proposed and self._drafter_error is None:  # its contexts held the forced tokens: it hears of its drafts
            self._guard_drafter(lambda: self.drafter.accept((kept - forced).clamp(min=0)))
        record = StepRecord(
            batch_size=len(self._running), batch_k=width,
            context_lengths=tuple(len(r.tokens) for r in self._running), outcomes=tuple(outcomes),
            draft_seconds=draft_seconds, verify_seconds=verify_seconds, total_seconds=time.perf_counter() - started,
            draft_positions=draft.positions if proposed else 0,
            draft_catchup_tokens=draft.catchup_tokens if proposed else 0,
            mask_seconds=sum(sampler.mask_seconds), forced_tokens=int(forced.sum()),
        )
        try:
            self.policy.observe(record)
        except Exception as error:
            self._switch_policy_off(f"policy {self.policy.name!r} raised {type(error).__name__} in observe: {error}")
        self._retire(finished)
        return outputs

    # --- helpers -----------------------------------------------------------------------------
    def _sample_final(self, sampler: StepSampler, logits: torch.Tensor, draft: Draft):
        """Process target logits and run the accept test.

        Returns (verdict, errors): errors[row] names why a row cannot go on. A failed target
        position has probability zero everywhere, so no draft there is accepted and the row
        fails exactly when its emitted sequence reaches that position; the drafts accepted before
        it stand.
        """
        target = sampler.probs(logits, draft.tokens, 0, draft.num_drafted)
        verdict = verify(draft.tokens, draft.num_drafted, target.probs, draft.probs,
                         sampler.accept_uniforms[:, : draft.tokens.shape[1]], sampler.final_uniforms)
        rows = torch.arange(logits.shape[0], device=logits.device)
        stuck = target.failed[rows, verdict.num_accepted].tolist()
        accepted = verdict.num_accepted.tolist()
        errors = [target.reasons[row, accepted[row]] if stuck[row] else None for row in range(len(stuck))]
        return verdict, errors

    def _emit(self, request: Request, tokens: list[int], states: Sequence = ()) -> list[int]:
        """Append tokens to a request, cut at its first stop token or its budget. states[i], where
        given, is the constraint state after tokens[: i + 1], made already by the step's sampler."""
        emitted = []
        for token in tokens[: request.remaining]:
            emitted.append(token)
            if token in request.params.stop_token_ids:
                request.finish_reason = "stop"
                break
        request.tokens.extend(emitted)
        if request.seen is not None:
            request.seen[emitted] = True
        constraint = request.params.constraint
        if constraint is not None:
            for index, token in enumerate(emitted):  # the constraint's state moves on emitted tokens only
                try:
                    request.constraint_state = (states[index] if index < len(states)
                                                else constraint.advance(request.constraint_state, token))
                except Exception as error:  # the token stands (plain decoding emitted it too); the request ends
                    request.fail(f"the constraint raised {type(error).__name__} in advance: {error}")
                    return emitted
        if request.finish_reason is None and request.remaining == 0:
            request.finish_reason = "length"
        return emitted

    def _retire(self, rows: list[int]) -> None:
        if not rows:
            return
        leaving = set(rows)
        keep = [row for row in range(len(self._running)) if row not in leaving]
        self._running = [self._running[row] for row in keep]
        self._kv.select_rows(keep)
        if self.drafter is not None and self._drafter_error is None:
            self._guard_drafter(lambda: self.drafter.keep_rows(keep))

    def _switch_policy_off(self, message: str) -> None:
        """A policy that raised is replaced by `off` for this engine: slower, never wrong."""
        self.policy_error = message
        self.policy = StaticPolicy(0)
        warnings.warn(f"{message}; speculation is off for this engine from now on, outputs remain exact",
                      RuntimeWarning, stacklevel=4)

    def _warn_once(self, topic: str, message: str) -> None:
        if topic not in self._warned:
            self._warned.add(topic)
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    def _guard_drafter(self, call):
        """Run a drafter call; on failure switch speculation off for good (outputs stay exact)."""
        try:
            return call()
        except Exception as error:  # a drafter is an optimisation: never let it take requests down
            self._drafter_error = f"{type(error).__name__}: {error}"
            warnings.warn(f"drafter failed ({self._drafter_error}); speculation is off for this engine "
                          "from now on, and outputs remain exact", RuntimeWarning, stacklevel=3)
            return None

    def _new_request(self, request_id: str, prompt: Sequence[int], params: SamplingParams) -> Request:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id}: params must be SamplingParams, got {type(params).__name__}")
        prompt = list(prompt)
        if not prompt:
            raise ValueError(f"request {request_id}: the prompt is empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError(f"request {request_id}: the prompt must be a list of integer token ids")
        outside = [t for t in prompt if not 0 <= t < self.vocab_size]
        if outside:
            raise ValueError(f"request {request_id}: token id {outside[0]} is outside the vocabulary "
                             f"(0..{self.vocab_size - 1})")
        try:
            params.check_vocab(self.vocab_size)
        except ValueError as error:
            raise ValueError(f"request {request_id}: {error}") from None
        if self.max_positions and len(prompt) + params.max_new_tokens > self.max_positions:
            raise ValueError(f"request {request_id}: prompt ({len(prompt)} tokens) plus max_new_tokens "
                             f"({params.max_new_tokens}) exceeds the model's context of {self.max_positions}")
        if self.attention_window and len(prompt) + params.max_new_tokens + self.max_k + 1 > self.attention_window:
            raise ValueError(f"request {request_id}: prompt ({len(prompt)} tokens) plus max_new_tokens "
                             f"({params.max_new_tokens}) and max_k ({self.max_k}) exceeds the sliding attention "
                             f"window of {self.attention_window}, which this engine does not yet support")
        constraint_state = None
        if params.constraint is not None:
            try:
                constraint_state = params.constraint.initial_state()
            except Exception as error:
                raise ValueError(f"request {request_id}: the constraint's initial_state raised "
                                 f"{type(error).__name__}: {error}") from error
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seeds))
        request = Request(request_id, prompt, params, torch.Generator().manual_seed(seed), list(prompt),
                          policy_key=f"{request_id}#{next(self._serials)}", constraint_state=constraint_state)
        if params.repetition_penalty != 1:
            request.seen = torch.zeros(self.vocab_size, dtype=torch.bool)
            request.seen[prompt] = True
        if params.allowed_token_ids is not None:
            request.allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
            request.allowed[list(params.allowed_token_ids)] = True
        return request


def _no_draft(rows: int, device: torch.device) -> Draft:
    return Draft(torch.zeros(rows, 0, dtype=torch.long, device=device), None,
                 torch.zeros(rows, dtype=torch.long, device=device))


def _output(request: Request, new: list[int]) -> StepOutput:
    finished = request.finish_reason is not None
    return StepOutput(request.request_id, new, finished, request.finish_reason, request.error,
                      request.result() if finished else None)


def _rejected(request_id: str, prompt: Iterable, message: str) -> GenerationResult:
    return GenerationResult(request_id, list(prompt) if isinstance(prompt, (list, tuple)) else [], [], "error",
                            message, RequestStats(0, 0, 0, (), ()))


def _count_masks(requests: Sequence[Request], sampler: StepSampler) -> None:
    """Add a step's constraint-mask work (drafting and verifying) to each request's tally."""
    for request, masks, seconds in zip(requests, sampler.masks, sampler.mask_seconds):
        request.masks += masks
        request.mask_seconds += seconds
