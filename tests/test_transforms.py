"""Sampling transforms against Hugging Face's logits processors, and parameter validation."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
    TopKLogitsWarper, TopPLogitsWarper,
)

from adaptive_spec import SamplingParams
from adaptive_spec.sampling.transforms import RowSettings, process_logits


def settings(**kw):
    values = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0) | kw
    return RowSettings(*(torch.tensor([values[name]]) for name in
                         ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")))


def hf_probs(logits, prefix, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, penalty=1.0):
    chain = LogitsProcessorList()
    if penalty != 1:
        chain.append(RepetitionPenaltyLogitsProcessor(penalty))
    chain.append(TemperatureLogitsWarper(temperature))
    if top_k:
        chain.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        chain.append(TopPLogitsWarper(top_p))
    if min_p:
        chain.append(MinPLogitsWarper(min_p))
    return torch.softmax(chain(torch.tensor([prefix]), logits.clone()), dim=-1)


@pytest.mark.parametrize("kw", [
    dict(temperature=0.7), dict(top_k=5), dict(top_p=0.6), dict(min_p=0.2), dict(penalty=1.5),
    dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, penalty=1.2),
])
def test_matches_hugging_face_processors(kw):
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 50, generator=generator) * 3
    prefix = [3, 7, 7, 20]
    ours_kw = {("repetition_penalty" if k == "penalty" else k): v for k, v in kw.items()}
    seen = torch.zeros(1, 50, dtype=torch.bool)
    seen[0, prefix] = True
    ours, empty = process_logits(logits, settings(**ours_kw), seen if "penalty" in kw else None)
    theirs = hf_probs(logits, prefix, **kw)
    assert not empty.any()
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def test_greedy_is_one_hot_on_the_masked_argmax():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0]])
    allowed = torch.tensor([[True, False, True, True]])
    probs, _ = process_logits(logits, settings(temperature=0.0), allowed=allowed)
    assert probs.tolist() == [[0.0, 0.0, 0.0, 1.0]]


def test_mask_that_allows_nothing_is_flagged_empty():
    probs, empty = process_logits(torch.zeros(2, 4), RowSettings(*(torch.tensor([v, v]) for v in (1.0, 0, 1.0, 0.0, 1.0))),
                                  allowed=torch.tensor([[False] * 4, [True] * 4]))
    assert empty.tolist() == [True, False]
    assert probs[0].sum() == 0 and abs(float(probs[1].sum()) - 1) < 1e-6


def test_rows_carry_their_own_settings():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 3)
    rows = RowSettings(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([2, 0, 0]), torch.tensor([1.0, 1.0, 1.0]),
                       torch.tensor([0.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 1.0]))
    probs, _ = process_logits(logits, rows)
    assert (probs[0, :2] == 0).all() and probs[1].tolist() == [0, 0, 0, 1.0]
    torch.testing.assert_close(probs[2], torch.softmax(logits[2], -1))


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.2), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(min_p=1.0), "min_p"), (dict(min_p=-0.1), "min_p"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(seed=1.5), "seed"),
])
def test_impossible_parameters_are_named(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)
