"""k = 0 without the draft model's upkeep: vLLM's draft-model proposer, patched to skip and catch up.

vLLM 0.32's `DraftModelProposer.propose` runs the draft over each step's new tokens even when the step
drafts nothing (`num_speculative_tokens == 0`), to keep the draft's KV cache in step. Under this
project's scheduler that step is skipped instead, and the draft catches up over the tokens it missed
in one forward pass just before the next step that drafts (`draft_cache.DraftCacheTracker` keeps the
positions). Drafts are only proposals, so this changes what is proposed at worst, never what is
emitted: vLLM's rejection sampler verifies every draft against the target.

Installed by `install()`, which `patches.install` calls in every vLLM process. It acts only in engines whose
scheduler is this project's (`--scheduler-cls adaptive_spec...`) and where `ADAPTIVE_SPEC_VLLM_LAZY_DRAFT`
is not `0`; every other engine runs vLLM's own method unchanged. Version-fenced like `scheduler.py`;
under an untested vLLM, `install()` does nothing.
"""

from __future__ import annotations

import os

LAZY_ENV = "ADAPTIVE_SPEC_VLLM_LAZY_DRAFT"
_RUNNER = "_adaptive_spec_runner"
_TRACKER = "_adaptive_spec_draft_cache"


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

    if getattr(DraftModelProposer, "_adaptive_spec_patched", False):
        return True
    original_init, original_propose = DraftModelProposer.__init__, DraftModelProposer.propose

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
    if num_speculative_tokens == 0:
        tracker.skipped(rows)
        proposer.num_speculative_tokens, proposer._last_draft_probs = 0, None
        return torch.empty(len(rows), 0, dtype=torch.int64, device=proposer.device)
    behind = [(index, tracker.catch_up_from(row)) for index, row in enumerate(rows)]
    behind = [(index, first) for index, first in behind if first < rows[index].start]
    if behind:
        catch_up(proposer, runner, metadata, [(index, first, rows[index].start) for index, first in behind])
        for index, first in behind:
            tracker.caught_up(rows[index], first)
    drafts = original_propose(proposer, num_speculative_tokens, **kwargs)
    tracker.drafted(rows)
    return drafts


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
