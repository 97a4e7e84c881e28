"""k = 0 without the draft model's upkeep: vLLM's draft-model proposer, patched to skip and catch up.

vLLM 0.32's `DraftModelProposer.propose` runs the draft over each step's new tokens even when the step
drafts nothing (`num_speculative_tokens == 0`), to keep the draft's KV cache in step, and in a step
that drafts it drafts for every row, whatever k the row was given. Under this project's scheduler the
draft runs only over the rows the scheduler asks drafts of (`DRAFT_ROWS`, a set of request ids it
puts on the step's `SchedulerOutput`; every row where it is absent): the others, and every row of a
step at K = 0, are skipped. A skipped row's draft catches up over the tokens it missed in one
forward pass just before the next step that drafts for it (`draft_cache.DraftCacheTracker` keeps
the positions). That spares a row at k = 0 both its draft forwards and, for a prompt prefilled in a
step that drafts, the draft's prefill of that prompt. Drafts are only proposals, so this changes what
is proposed at worst, never what is emitted: vLLM's rejection sampler verifies every draft against
the target.

Stopping inside the draft loop: where the scheduler puts a stop rule on the step's output
(`STOP_RULE`, the policy's `keep_drafting` keyed by request id), each draft position's tokens are
taken as vLLM takes them (the argmax of the draft's logits) together with each row's confidence
(the top probability of those raw logits), and the rule answers per row: draft on, keep this
draft and stop, or drop it and stop. Once no row drafts on, the loop ends there (vLLM's loop is left
by an exception caught in `propose`, so the draft forwards after it never run) and the scheduler
cuts each row's drafts to what it kept. Only for greedy drafting (vLLM's default
`draft_sample_method`) with the target's vocabulary and one draft per forward; elsewhere every
row drafts its full length.

Installed by `install()`, which `patches.install` calls in every vLLM process. It acts only in engines whose
scheduler is this project's (`--scheduler-cls adaptive_spec...`) and where `ADAPTIVE_SPEC_VLLM_LAZY_DRAFT`
is not `0`; every other engine runs vLLM's own method unchanged. Version-fenced like `scheduler.py`;
under an untested vLLM, `install()` does nothing.
"""

from __future__ import annotations

import os

LAZY_ENV = "ADAPTIVE_SPEC_VLLM_LAZY_DRAFT"
DRAFT_ROWS = "adaptive_spec_draft_rows"  # on a SchedulerOutput: ids of the requests to draft for
_RUNNER = "_adaptive_spec_runner"
_TRACKER = "_adaptive_spec_draft_cache"
_WANTED = "_adaptive_spec_draft_rows"  # on the proposer: the step's DRAFT_ROWS, None = every row
STOP_RULE = "adaptive_spec_stop_rule"  # on a SchedulerOutput: (position, {id: confidence}) -> {id: answer}
_RULE = "_adaptive_spec_stop_rule"  # on the proposer: the step's STOP_RULE
_STOPPER = "_adaptive_spec_stopper"  # on the proposer while a propose call can stop
# Attention metadata fields this module cannot cut to a subset of rows: where one is set, every row drafts.
_UNCUT_FIELDS = ("logits_indices_padded", "encoder_seq_lens", "dcp_local_seq_lens", "mm_req_doc_ranges",
                 "rswa_prefix_lens", "replayssm_decode_base_cpu")


def enabled_for(scheduler_cls) -> bool:
    """Whether an engine built with this scheduler class runs the lazy draft upkeep."""
    if scheduler_cls is None:
        return False
    name = scheduler_cls if isinstance(scheduler_cls, str) else f"{scheduler_cls.__module__}.{scheduler_cls.__qualname__}"
    return name.startswith("adaptive_spec.") and os.environ.get(LAZY_ENV, "1") != "0"


def install() -> bool:
    """Patch vLLM's draft-model proposer (idempotent). False where the installed vLLM is untested."""
    from .fence import tested_vllm_installed

    if not tested_vllm_installed():
        return False
    from vllm.v1.spec_decode.draft_model import DraftModelProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(DraftModelProposer, "_adaptive_spec_patched", False):
        return True
    original_init, original_propose = DraftModelProposer.__init__, DraftModelProposer.propose
    original_sample = DraftModelProposer._sample_draft_tokens
    original_step_propose = GPUModelRunner.propose_draft_token_ids

    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        # The proposer is not given the scheduler's output: hand it the rows to draft for, and the stop rule.
        setattr(self.drafter, _WANTED, getattr(scheduler_output, DRAFT_ROWS, None))
        setattr(self.drafter, _RULE, getattr(scheduler_output, STOP_RULE, None))
        return original_step_propose(self, scheduler_output, *args, **kwargs)

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        stopper = getattr(self, _STOPPER, None)
        if stopper is None:
            return original_sample(self, hidden_states, sampling_metadata)
        return stopper.sample(self, hidden_states), None

    def __init__(self, *args, runner=None, **kwargs):
        original_init(self, *args, runner=runner, **kwargs)
        setattr(self, _RUNNER, runner)  # vLLM does not keep it; the catch-up reads its token ids

    def propose(self, num_speculative_tokens, *args, **kwargs):
        runner = getattr(self, _RUNNER, None)
        positions = kwargs.get("target_positions")
        if (runner is None or positions is None or positions.dim() != 1 or args
                or not enabled_for(self.vllm_config.scheduler_config.scheduler_cls)):
            return original_propose(self, num_speculative_tokens, *args, **kwargs)
        return _lazy_propose(self, runner, original_propose, num_speculative_tokens, kwargs)

    DraftModelProposer.__init__, DraftModelProposer.propose = __init__, propose
    DraftModelProposer._sample_draft_tokens = _sample_draft_tokens
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids  # the CPU runner inherits it
    DraftModelProposer._adaptive_spec_patched = True
    return True


def tracker_of(proposer):
    """The proposer's `DraftCacheTracker` (None before its first lazy step)."""
    return getattr(proposer, _TRACKER, None)


def _lazy_propose(proposer, runner, original_propose, num_speculative_tokens: int, kwargs: dict):
    import torch

    from .draft_cache import DraftCacheTracker

    metadata = kwargs["common_attn_metadata"]
    tracker = tracker_of(proposer)
    if tracker is None:
        tracker = DraftCacheTracker(proposer.block_size)
        setattr(proposer, _TRACKER, tracker)
    rows = _rows(proposer, runner, metadata, kwargs["target_positions"])
    tracker.forget(runner.requests)
    wanted = getattr(proposer, _WANTED, None)
    drafting = [index for index, row in enumerate(rows) if wanted is None or row.request_id in wanted]
    if num_speculative_tokens and 0 < len(drafting) < len(rows):
        sub_kwargs = _rows_subset(kwargs, drafting)
        if sub_kwargs is None:  # a batch this module cannot cut: vLLM's way, every row drafts
            drafting = list(range(len(rows)))
    if num_speculative_tokens == 0 or not drafting:
        tracker.skipped(rows)
        proposer.num_speculative_tokens, proposer._last_draft_probs = 0, None
        return torch.empty(len(rows), 0, dtype=torch.int64, device=proposer.device)
    behind = [(index, tracker.catch_up_from(rows[index])) for index in drafting]
    behind = [(index, first) for index, first in behind if first < rows[index].start]
    if behind:
        catch_up(proposer, runner, metadata, [(index, first, rows[index].start) for index, first in behind])
        for index, first in behind:
            tracker.caught_up(rows[index], first)
    step_kwargs = kwargs if len(drafting) == len(rows) else sub_kwargs
    rule = getattr(proposer, _RULE, None)
    if rule is not None and _can_stop(proposer, step_kwargs["sampling_metadata"]):
        stopper = _Stopper(rule, [rows[index].request_id for index in drafting], num_speculative_tokens)
        drafts = _propose_with_stops(proposer, original_propose, num_speculative_tokens, step_kwargs, stopper)
    else:
        drafts = original_propose(proposer, num_speculative_tokens, **step_kwargs)
    if len(drafting) < len(rows):
        drafts = _scatter_rows(proposer, drafts, drafting, len(rows))
        chosen = set(drafting)
        tracker.skipped([row for index, row in enumerate(rows) if index not in chosen], whole_step=False)
    tracker.drafted([rows[index] for index in drafting])
    return drafts


class _DraftsDone(Exception):
    """No row drafts on: leaves vLLM's draft loop before its next forward."""


class _Stopper:
    """One propose call's draft positions, shown to the stop rule as they come."""

    def __init__(self, rule, request_ids: list[str], length: int):
        self.rule, self.request_ids, self.length = rule, request_ids, length
        self.live = [True] * len(request_ids)
        self.tokens: list = []  # per position: the batch's draft tokens

    def sample(self, proposer, hidden_states):
        """vLLM's greedy draft tokens at the next position, after asking the rule about them."""
        import torch

        logits = proposer.model.compute_logits(hidden_states)
        tokens = logits.argmax(dim=-1)
        confidences = torch.softmax(logits.float(), dim=-1).amax(dim=-1).tolist()
        position = len(self.tokens)
        self.tokens.append(tokens)
        shown = {request_id: confidence for request_id, confidence, live
                 in zip(self.request_ids, confidences, self.live) if live}
        try:
            answers = self.rule(position, shown)
        except Exception:  # an optimisation must not take vLLM's engine down: stop here, drafts so far stand
            answers = {}
        self.live = [live and answers.get(request_id) == 1 for request_id, live in zip(self.request_ids, self.live)]
        if not any(self.live) and position + 1 < self.length:
            raise _DraftsDone
        return tokens


def _can_stop(proposer, sampling_metadata) -> bool:
    """Whether this proposer's draft tokens are the argmax of the draft's own logits, one position a forward."""
    greedy = not getattr(proposer, "_enable_probabilistic_draft_probs", False) or sampling_metadata.all_greedy
    return (greedy and not getattr(proposer, "parallel_drafting", False)
            and not getattr(proposer, "use_heterogeneous_vocab", False)
            and not getattr(proposer, "use_local_argmax_reduction", False))


def _propose_with_stops(proposer, original_propose, num_speculative_tokens: int, kwargs: dict, stopper: _Stopper):
    import torch

    setattr(proposer, _STOPPER, stopper)
    try:
        return original_propose(proposer, num_speculative_tokens, **kwargs)
    except _DraftsDone:
        return torch.stack(stopper.tokens, dim=1)
    finally:
        setattr(proposer, _STOPPER, None)


def _rows_subset(kwargs: dict, keep: list[int]) -> dict | None:
    """`propose`'s arguments cut to the batch rows `keep` (in order), or None where they cannot be."""
    import dataclasses

    import torch

    metadata = kwargs["common_attn_metadata"]
    if kwargs.get("mm_embed_inputs") is not None or any(getattr(metadata, name, None) is not None
                                                        for name in _UNCUT_FIELDS):
        return None
    starts = metadata.query_start_loc_cpu.long()
    device = metadata.query_start_loc.device
    rows_cpu = torch.tensor(keep, dtype=torch.long)
    lengths = (starts[1:] - starts[:-1])[rows_cpu]
    tokens_cpu = torch.cat([torch.arange(int(starts[row]), int(starts[row + 1])) for row in keep])
    query_start = torch.zeros(len(keep) + 1, dtype=metadata.query_start_loc_cpu.dtype)
    torch.cumsum(lengths, 0, out=query_start[1:])
    rows, tokens = rows_cpu.to(device), tokens_cpu.to(device)

    def per_row(tensor):
        return None if tensor is None else tensor[rows.to(tensor.device)]

    upper = per_row(metadata.seq_lens_cpu_upper_bound)
    req_idx = None if metadata.req_idx is None else metadata.req_idx[keep]
    sub_metadata = dataclasses.replace(
        metadata, query_start_loc=query_start.to(device), query_start_loc_cpu=query_start,
        seq_lens=per_row(metadata.seq_lens), num_reqs=len(keep), num_actual_tokens=int(lengths.sum()),
        max_query_len=int(lengths.max()), max_seq_len=int(upper.max()) if upper is not None else metadata.max_seq_len,
        block_table_tensor=per_row(metadata.block_table_tensor), slot_mapping=metadata.slot_mapping[tokens],
        positions=None if metadata.positions is None else metadata.positions[tokens],
        is_prefilling=per_row(metadata.is_prefilling), seq_lens_cpu_upper_bound=upper, req_idx=req_idx,
        _num_computed_tokens_cache=None, _token_to_req_indices_cache=None)
    sampled = kwargs["token_indices_to_sample"]
    if sampled is not None:
        if sampled.shape[0] != len(starts) - 1:
            return None
        # each row's index into the flat token list, moved to where the row now starts
        sampled = sampled[rows] - starts[rows_cpu].to(device, sampled.dtype) + query_start[:-1].to(device, sampled.dtype)
    sampling = kwargs["sampling_metadata"]
    if sampling.temperature is not None:  # the draft's sampler reads the temperature alone
        sampling = dataclasses.replace(sampling, temperature=sampling.temperature[rows])
    rejected, hidden = kwargs.get("num_rejected_tokens_gpu"), kwargs.get("target_hidden_states")
    return dict(kwargs, target_token_ids=kwargs["target_token_ids"][tokens],
                target_positions=kwargs["target_positions"][tokens],
                target_hidden_states=None if hidden is None else hidden[tokens],
                next_token_ids=kwargs["next_token_ids"][rows], token_indices_to_sample=sampled,
                common_attn_metadata=sub_metadata, sampling_metadata=sampling,
                num_rejected_tokens_gpu=None if rejected is None else rejected[rows], slot_mappings=None)


def _scatter_rows(proposer, drafts, keep: list[int], batch: int):
    """A subset's drafts (and draft probabilities) placed in their batch rows. The other rows get
    token 0 and zero probability: the scheduler cuts their drafts to none, so neither is ever read."""
    import torch

    rows = torch.tensor(keep, dtype=torch.long, device=drafts.device)
    full = torch.zeros((batch,) + tuple(drafts.shape[1:]), dtype=drafts.dtype, device=drafts.device)
    full[rows] = drafts
    probs = getattr(proposer, "_last_draft_probs", None)
    if probs is not None:
        full_probs = torch.zeros((batch,) + tuple(probs.shape[1:]), dtype=probs.dtype, device=probs.device)
        full_probs[rows.to(probs.device)] = probs
        proposer._last_draft_probs = full_probs
    return full


def _rows(proposer, runner, metadata, positions) -> list:
    from .draft_cache import Row

    count = metadata.num_reqs
    starts = positions[metadata.query_start_loc[:count].long()].tolist()
    block_size = proposer.block_size
    tables = metadata.block_table_tensor
    return [Row(request_id, start, tuple(tables[index, :start // block_size + 1].tolist()))
            for index, (request_id, start) in enumerate(zip(runner.input_batch.req_ids[:count], starts))]


def catch_up(proposer, runner, metadata, spans: list[tuple[int, int, int]]) -> None:
    """Run the draft over positions [first, end) of each listed batch row, writing its KV cache.

    Spans longer than the step token budget go in pieces, in order; rows are batched per piece."""
    limit = proposer.max_num_tokens
    pieces = [(row, start, min(start + limit, end)) for row, first, end in spans for start in range(first, end, limit)]
    while pieces:
        batch, total, rest = [], 0, []
        for row, start, end in pieces:
            # a row's next piece waits for the forward that writes the piece before it
            if total + end - start <= limit and all(row != other for other, _, _ in batch):
                batch.append((row, start, end))
                total += end - start
            else:
                rest.append((row, start, end))
        _forward(proposer, runner, metadata, batch)
        pieces = rest


def _forward(proposer, runner, metadata, pieces: list[tuple[int, int, int]]) -> None:
    import numpy as np
    import torch
    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backend import CommonAttentionMetadata

    device, block_size = proposer.device, proposer.block_size
    tokens = np.concatenate([runner.input_batch.token_ids_cpu[row, start:end] for row, start, end in pieces])
    positions = torch.cat([torch.arange(start, end, dtype=torch.int64) for _, start, end in pieces])
    lengths = torch.tensor([end - start for _, start, end in pieces], dtype=torch.int32)
    query_start = torch.zeros(len(pieces) + 1, dtype=torch.int32)
    torch.cumsum(lengths, 0, out=query_start[1:])
    seq_lens = torch.tensor([end for _, _, end in pieces], dtype=torch.int32)
    rows = torch.tensor([row for row, _, _ in pieces], dtype=torch.int64)
    table = metadata.block_table_tensor[rows.to(metadata.block_table_tensor.device)]
    owner = torch.repeat_interleave(torch.arange(len(pieces)), lengths.long())
    slots = (table.cpu()[owner, positions // block_size].long() * block_size + positions % block_size).to(device)
    count = int(lengths.sum())
    piece_metadata = CommonAttentionMetadata(
        query_start_loc=query_start.to(device), query_start_loc_cpu=query_start, seq_lens=seq_lens.to(device),
        num_reqs=len(pieces), num_actual_tokens=count, max_query_len=int(lengths.max()),
        max_seq_len=int(seq_lens.max()), block_table_tensor=table, slot_mapping=slots, causal=True,
        seq_lens_cpu_upper_bound=seq_lens, positions=positions.to(device))
    input_ids = torch.from_numpy(tokens.astype(np.int64)).to(device)
    if getattr(proposer, "use_heterogeneous_vocab", False):
        input_ids = proposer.vocab_mapping.map_target_to_draft_ids(input_ids)
    _, per_layer = proposer.build_per_group_and_layer_attn_metadata(piece_metadata)
    with set_forward_context(per_layer, proposer.vllm_config, num_tokens=count,
                             slot_mapping=proposer._get_slot_mapping(count, slots)):
        proposer.model(input_ids=input_ids.int(), positions=positions.to(device), inputs_embeds=None)
