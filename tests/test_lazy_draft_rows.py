"""Cutting a vLLM draft step to the rows that draft (`integrations/vllm/lazy_draft._rows_subset`),
with stand-ins for vLLM's metadata: no vLLM needed, only its field names."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from adaptive_spec.integrations.vllm.draft_cache import DraftCacheTracker, Row
from adaptive_spec.integrations.vllm.lazy_draft import _rows_subset, _scatter_rows


@dataclass
class Metadata:  # the fields of vLLM 0.32's CommonAttentionMetadata that the cut reads or writes
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor | None = None
    is_prefilling: torch.Tensor | None = None
    seq_lens_cpu_upper_bound: torch.Tensor | None = None
    req_idx: object = None
    logits_indices_padded: torch.Tensor | None = None
    encoder_seq_lens: torch.Tensor | None = None
    dcp_local_seq_lens: torch.Tensor | None = None
    mm_req_doc_ranges: dict | None = None
    rswa_prefix_lens: torch.Tensor | None = None
    replayssm_decode_base_cpu: torch.Tensor | None = None
    _num_computed_tokens_cache: torch.Tensor | None = None
    _token_to_req_indices_cache: torch.Tensor | None = None


@dataclass
class Sampling:  # vLLM's SamplingMetadata as the draft's sampler reads it
    temperature: torch.Tensor | None


def batch():
    """Three rows: a 4-token prompt (row 0), a decoding row verifying 2 drafts (row 1, 3 tokens),
    a decoding row with none (row 2, 1 token). Token i carries id 100 + i and slot 1000 + i."""
    lengths = [4, 3, 1]
    starts = torch.tensor([0, 4, 7, 8], dtype=torch.int32)
    metadata = Metadata(starts.clone(), starts, torch.tensor([4, 20, 31]), 3, 8, 4, 31,
                        torch.arange(12).view(3, 4), torch.arange(1000, 1008), positions=torch.arange(8),
                        seq_lens_cpu_upper_bound=torch.tensor([4, 20, 31]))
    tokens = torch.arange(100, 108)
    kwargs = dict(target_token_ids=tokens, target_positions=torch.arange(8), target_hidden_states=tokens[:, None] * 1.0,
                  next_token_ids=torch.tensor([7, 8, 9]), token_indices_to_sample=torch.tensor([3, 5, 7]),
                  common_attn_metadata=metadata, sampling_metadata=Sampling(torch.tensor([0.0, 0.7, 1.0])),
                  num_rejected_tokens_gpu=torch.tensor([0, 1, 0]), mm_embed_inputs=None, slot_mappings={"x": 1})
    return kwargs, lengths


def test_the_cut_keeps_each_kept_rows_tokens_and_moves_its_sampled_index_with_it():
    kwargs, _ = batch()
    cut = _rows_subset(kwargs, [1, 2])
    metadata = cut["common_attn_metadata"]
    assert cut["target_token_ids"].tolist() == [104, 105, 106, 107]
    assert metadata.slot_mapping.tolist() == [1004, 1005, 1006, 1007]
    assert metadata.query_start_loc_cpu.tolist() == [0, 3, 4] and metadata.query_start_loc.tolist() == [0, 3, 4]
    assert metadata.num_reqs == 2 and metadata.num_actual_tokens == 4 and metadata.max_query_len == 3
    assert metadata.seq_lens.tolist() == [20, 31] and metadata.max_seq_len == 31
    assert metadata.block_table_tensor.tolist() == [[4, 5, 6, 7], [8, 9, 10, 11]]
    assert cut["token_indices_to_sample"].tolist() == [1, 3]  # row 1 samples its 2nd token, row 2 its only one
    assert cut["next_token_ids"].tolist() == [8, 9] and cut["num_rejected_tokens_gpu"].tolist() == [1, 0]
    assert cut["sampling_metadata"].temperature.tolist() == pytest.approx([0.7, 1.0])
    assert cut["target_hidden_states"][:, 0].tolist() == [104.0, 105.0, 106.0, 107.0]
    # the input is untouched: vLLM reads it again after the drafter
    assert kwargs["common_attn_metadata"].num_reqs == 3 and kwargs["target_token_ids"].numel() == 8


def test_a_batch_with_metadata_the_cut_does_not_know_is_left_whole():
    kwargs, _ = batch()
    kwargs["common_attn_metadata"].encoder_seq_lens = torch.tensor([1, 2, 3])
    assert _rows_subset(kwargs, [0]) is None
    kwargs, _ = batch()
    kwargs["mm_embed_inputs"] = ([], torch.zeros(8))
    assert _rows_subset(kwargs, [0]) is None


def test_drafts_of_the_kept_rows_land_in_their_rows_and_the_others_get_none_worth_reading():
    proposer = SimpleNamespace(_last_draft_probs=torch.ones(2, 3, 5))
    full = _scatter_rows(proposer, torch.tensor([[1, 2, 3], [4, 5, 6]]), [0, 2], 3)
    assert full.tolist() == [[1, 2, 3], [0, 0, 0], [4, 5, 6]]
    assert proposer._last_draft_probs.shape == (3, 3, 5)
    assert proposer._last_draft_probs[1].sum() == 0 and proposer._last_draft_probs[2].sum() == 15


def test_rows_left_out_of_a_drafting_step_are_counted_apart_from_skipped_steps():
    tracker = DraftCacheTracker(16)
    tracker.drafted([Row("a", 0, (1,)), Row("b", 0, (2,))])
    tracker.skipped([Row("b", 9, (2,))], whole_step=False)
    tracker.drafted([Row("a", 9, (1,))])
    assert tracker.stats.skipped_steps == 0 and tracker.stats.skipped_rows == 1
    assert tracker.catch_up_from(Row("a", 12, (1,))) == 12 and tracker.catch_up_from(Row("b", 12, (2,))) == 9
