"""Greedy exactness on the real pretrained models, in fp32, against Hugging Face `generate`.

What is checked
---------------
* The default pair (Qwen2.5-Coder-1.5B-Instruct target, Qwen2.5-Coder-0.5B-Instruct draft) at
  policies ``off`` and ``static:1`` .. ``static:4`` reproduces ``target.generate(..., do_sample=False)``
  token for token on 3 HumanEval and 3 ShareGPT prompts (chat template applied).
* SmolLM2-135M-Instruct with the model-free `NgramDrafter` does the same at ``static:1`` .. ``static:4``.
* The two Qwen tokenizers are compatible; Qwen vs SmolLM2 is refused with the library's error.
* `check_greedy_match`, the comparison helper, is itself unit-tested on synthetic logits (no model).

The reference
-------------
Hugging Face `generate`, one prompt at a time (batch 1, no padding), ``max_new_tokens=32``. The end
of sequence is switched off on both sides so every prompt is compared on all 32 tokens: the reference
gets ``eos_token_id=None`` and the engine gets no stop tokens. The reference is also given an explicit
all-ones ``attention_mask``: without one, `generate` infers the mask as ``input_ids != pad_token_id``
as soon as the pad id is not an end-of-sequence id -- and with ``eos_token_id=None`` it never is. For
SmolLM2 the pad id is ``<|im_end|>`` (id 2), which every chat-template prompt contains, so the reference
would silently mask those prompt tokens (its logits moved by up to 4.8 in a measurement) and stop being
plain greedy decoding.

Numerical near-ties
-------------------
Even in fp32 a multi-token verification forward (or a ragged batch) rounds differently from one-token
steps, so two correct implementations can pick different tokens where the top two logits are nearly
equal. Measured on this project's machine (fp32, CPU, 6 prompts of these workloads, max over every
position and the whole vocabulary of ``|logit - logit of a plain full forward without cache|``):

===============================================  ============  =================
path                                             Qwen 1.5B     SmolLM2-135M
===============================================  ============  =================
HF `generate` (incremental cached decoding)      2.8e-05       6.4e-05
cached forward in blocks of 4 tokens             2.7e-05       7.7e-05
the engine's ragged KV batch (blocks of 1/2/5)   7.4e-05       6.7e-05
===============================================  ============  =================

So the worst single-path error is about 8e-5, and two such paths can flip a pair of tokens only if the
full-forward gap between them is below about 2 x 8e-5 = 1.6e-4. `TIE_TOL` = 1e-3 is about 12 times the
worst measured error (6 times the largest gap two paths could flip), loose enough for another CPU's
kernels and still 2 to 3 orders of magnitude below the top-two gaps that real greedy steps have.
`test_cached_decoding_error_is_far_below_the_tie_tolerance` re-measures the first row of that table on
the machine running the tests, so the tolerance stays justified there.

A divergence counts as a near-tie only if the full-forward top-two gap at the diverging position is at
most `TIE_TOL` AND the two diverging tokens are exactly those top two. The rest of that prompt's output is
then not compared (after the fork the two continuations legitimately differ). Anything else fails.

Running
-------
Every model test is marked ``real_models`` and ``slow`` and needs the models fetched into the default
cache (``adaptive-spec models fetch NAME``). A model that is not fetched skips its tests, except when the
environment variable ``CI`` is ``true``: CI's set-up fetches the models, so a missing one is a set-up bug
and the test fails. The whole file runs in about 4 minutes on 2 idle CPU cores (6 on a busy one), most
of it the 1.5B target (HF reference ~1.2 min, each engine policy ~25 s); prompts are the shortest
HumanEval problems and ShareGPT prompts of at most 100 tokens to keep it so.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import jsonschema
import pytest
import torch

from adaptive_spec import NgramDrafter, SamplingParams, SpecEngine
from adaptive_spec.assets import (
    FetchError,
    TokenizerMismatchError,
    check_tokenizers_compatible,
    encode_prompt,
    is_fetched,
    load_humaneval,
    load_sharegpt,
)
from adaptive_spec.assets.structured import load_structured
from adaptive_spec.modeling.loading import load_model
from adaptive_spec.sampling.grammar import Grammar

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
SMOLLM2 = "smollm2-135m-instruct"

NEW_TOKENS = 32
TIE_TOL = 1e-3  # absolute fp32 logit gap; see the module docstring for the measurement behind it
GREEDY = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS)  # no stop tokens: all 32 tokens

real_models = [pytest.mark.real_models, pytest.mark.slow]


# --------------------------------------------------------------------------- the comparison helper


@dataclass(frozen=True)
class NearTie:
    """A justified divergence: where it happened and how close the top two logits were."""

    index: int
    engine_token: int
    reference_token: int
    gap: float


def check_greedy_match(
    produced: Sequence[int],
    reference: Sequence[int],
    last_logits: Callable[[list[int]], torch.Tensor],
    *,
    tol: float = TIE_TOL,
    label: str = "",
) -> NearTie | None:
    """Compare an engine's greedy output with the reference, forgiving only numerical near-ties.

    `produced` and `reference` are generated token ids (prompt excluded) and must have the same length.
    Returns None when they are identical. At the first index i where they differ, calls
    `last_logits(reference[:i])` -- the target's fp32 logits at the last position of a plain full
    forward (no cache) over prompt + the common prefix -- and returns a `NearTie` when the two diverging
    tokens are exactly that position's top two logits and those are at most `tol` apart; the outputs
    after index i are then not compared. Otherwise raises AssertionError naming the index, both tokens,
    the top two and their gap.
    """
    prefix = f"{label}: " if label else ""
    if len(produced) != len(reference):
        raise AssertionError(f"{prefix}engine produced {len(produced)} tokens, the reference {len(reference)}")
    index = next((i for i, (a, b) in enumerate(zip(produced, reference)) if a != b), None)
    if index is None:
        return None
    logits = last_logits(list(reference[:index])).detach().double().flatten()
    top = torch.topk(logits, 2)
    top_ids, gap = top.indices.tolist(), float(top.values[0] - top.values[1])
    diverging = {int(produced[index]), int(reference[index])}
    message = (
        f"{prefix}engine and reference differ at generated index {index}: engine token {produced[index]}, "
        f"reference token {reference[index]}; full-forward top two are {top_ids} "
        f"(logits {top.values[0].item():.6f}, {top.values[1].item():.6f}; gap {gap:.3g}, tolerance {tol:g})"
    )
    if diverging != set(top_ids):
        raise AssertionError(message + " -- the diverging tokens are not the top two: not a numerical near-tie")
    if gap > tol:
        raise AssertionError(message + " -- the gap exceeds the tolerance: not a numerical near-tie")
    return NearTie(index, int(produced[index]), int(reference[index]), gap)


def test_check_greedy_match_on_synthetic_logits():
    """The helper alone: identical outputs, a justified tie, a large gap, a token outside the top two."""

    def logits_with(top: dict[int, float]) -> Callable[[list[int]], torch.Tensor]:
        seen = []

        def last_logits(prefix: list[int]) -> torch.Tensor:
            seen.append(prefix)
            logits = torch.full((8,), -5.0, dtype=torch.float64)
            for token, value in top.items():
                logits[token] = value
            return logits

        last_logits.seen = seen
        return last_logits

    reference = [1, 2, 3, 4, 4]
    untouched = logits_with({})
    assert check_greedy_match(reference, reference, untouched) is None
    assert untouched.seen == []  # no divergence, no forward

    tie = logits_with({3: 10.0, 6: 10.0 - 2e-4})
    # After the justified fork the rest is not compared (here it differs wildly).
    assert check_greedy_match([1, 2, 6, 0, 7], reference, tie) == NearTie(2, 6, 3, pytest.approx(2e-4, rel=1e-3))
    assert tie.seen == [[1, 2]]  # the logits were asked for prompt + the common prefix

    with pytest.raises(AssertionError, match=r"index 2.*gap 0\.5.*exceeds the tolerance"):
        check_greedy_match([1, 2, 6, 4, 4], reference, logits_with({3: 10.0, 6: 9.5}))
    with pytest.raises(AssertionError, match="not the top two"):  # engine token is third
        check_greedy_match([1, 2, 6, 4, 4], reference, logits_with({3: 10.0, 5: 10.0 - 1e-5, 6: 10.0 - 2e-5}))
    with pytest.raises(AssertionError, match="not the top two"):  # engine token is not even near
        check_greedy_match([1, 2, 0, 4, 4], reference, logits_with({3: 10.0, 6: 10.0 - 1e-5}))
    with pytest.raises(AssertionError, match="4 tokens"):
        check_greedy_match([1, 2, 3, 4], reference, untouched)


# --------------------------------------------------------------------------- models and workloads


def _missing(what: str, remedy: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what}; CI's set-up should have fetched it, so this is a set-up bug")
    pytest.skip(f"{what} ({remedy})")


def _load(name: str):
    if not is_fetched(name):
        _missing(f"model {name!r} is not fetched into the cache", f"run `adaptive-spec models fetch {name}`")
    model, tokenizer = load_model(name, "float32", progress=False)  # as the CLI runs it: oneDNN linears
    assert model.dtype == torch.float32
    return model, tokenizer


@pytest.fixture(scope="session")
def qwen_target():
    return _load(TARGET)


@pytest.fixture(scope="session")
def qwen_draft():
    return _load(DRAFT)


@pytest.fixture(scope="session")
def smollm2():
    return _load(SMOLLM2)


def workload(tokenizer) -> list[list[int]]:
    """3 HumanEval and 3 ShareGPT prompts, chat-template encoded. The shortest HumanEval problems (ties
    broken by id) and ShareGPT prompts of at most 100 tokens keep CPU prefill cheap."""
    try:
        humaneval = load_humaneval(progress=False)
        sharegpt = load_sharegpt(3, seed=0, tokenizer=tokenizer, max_prompt_tokens=100, progress=False)
    except (FetchError, OSError) as error:
        _missing(f"a prompt set could not be loaded ({error})", "it is downloaded into the cache on first use")
    encoded = sorted(((encode_prompt(tokenizer, p), p.id) for p in humaneval), key=lambda e: (len(e[0]), e[1]))
    return [ids for ids, _ in encoded[:3]] + [encode_prompt(tokenizer, p) for p in sharegpt]


@dataclass
class Reference:
    model: torch.nn.Module
    prompts: list[list[int]]
    tokens: list[list[int]]  # HF greedy continuation of each prompt, NEW_TOKENS long
    logits: list[torch.Tensor]  # the logits `generate` decoded from, for the first `keep_logits` prompts


def hf_reference(model, prompts: list[list[int]], keep_logits: int = 0) -> Reference:
    """Plain HF greedy decoding, one prompt at a time, EOS off (see the module docstring)."""
    tokens, logits = [], []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, output_logits=i < keep_logits, return_dict_in_generate=True)
        generated = out.sequences[0, len(prompt):].tolist()
        assert len(generated) == NEW_TOKENS, "the reference stopped early"
        tokens.append(generated)
        if i < keep_logits:
            logits.append(torch.cat(out.logits, dim=0))
    return Reference(model, prompts, tokens, logits)


def full_forward_last_logits(model, ids: list[int]) -> torch.Tensor:
    """fp32 logits at the last position of one plain forward, no cache."""
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0, -1]


@pytest.fixture(scope="module")
def qwen_reference(qwen_target):
    model, tokenizer = qwen_target
    return hf_reference(model, workload(tokenizer), keep_logits=2)


@pytest.fixture(scope="module")
def smollm2_reference(smollm2):
    model, tokenizer = smollm2
    return hf_reference(model, workload(tokenizer), keep_logits=6)


def assert_engine_matches(engine: SpecEngine, reference: Reference, label: str) -> list:
    """Run every prompt through one `generate` call and compare each with the reference."""
    results = engine.generate(reference.prompts, GREEDY)
    ties = []
    for i, (result, prompt, expected) in enumerate(zip(results, reference.prompts, reference.tokens)):
        assert result.error is None, f"{label} prompt {i}: {result.error}"
        assert result.finish_reason == "length" and result.prompt_token_ids == prompt
        tie = check_greedy_match(result.token_ids, expected,
                                 lambda prefix: full_forward_last_logits(reference.model, prompt + prefix),
                                 label=f"{label} prompt {i}")
        if tie is not None:
            ties.append((i, tie))
            warnings.warn(f"{label} prompt {i}: justified fp32 near-tie at generated index {tie.index} "
                          f"(engine {tie.engine_token}, reference {tie.reference_token}, gap {tie.gap:.3g})")
    return results


# --------------------------------------------------------------------------- the tests


@pytest.mark.real_models
@pytest.mark.slow
def test_tokenizer_compatibility(qwen_target, qwen_draft, smollm2):
    check_tokenizers_compatible(qwen_target[1], qwen_draft[1])  # same ids; only add_bos_token may differ
    with pytest.raises(TokenizerMismatchError, match="different vocabularies"):
        check_tokenizers_compatible(qwen_target[1], smollm2[1])
    # The engine refuses a draft whose logits width differs from the target's.
    with pytest.raises(ValueError, match="vocabularies differ"):
        SpecEngine(qwen_target[0], smollm2[0], policy="static:2")


@pytest.mark.real_models
@pytest.mark.slow
def test_cached_decoding_error_is_far_below_the_tie_tolerance(qwen_reference, smollm2_reference):
    """Re-measure on this machine the fp32 error that `TIE_TOL` is a multiple of: the logits HF's cached
    decoding produced vs one plain full forward over prompt + the generated tokens."""
    for reference in (qwen_reference, smollm2_reference):
        for prompt, generated, decoded in zip(reference.prompts, reference.tokens, reference.logits):
            with torch.no_grad():
                full = reference.model(torch.tensor([prompt + generated[:-1]]), use_cache=False).logits[0]
            error = (full[len(prompt) - 1:] - decoded).abs().max().item()
            assert error < TIE_TOL / 5, f"fp32 cached-vs-full logit error {error:.3g} is too close to TIE_TOL"


@pytest.mark.real_models
@pytest.mark.slow
@pytest.mark.parametrize("policy", ["off", "static:1", "static:2", "static:3", "static:4"])
def test_default_pair_matches_hf_greedy(qwen_target, qwen_draft, qwen_reference, policy):
    engine = SpecEngine(qwen_target[0], qwen_draft[0], policy=policy)
    results = assert_engine_matches(engine, qwen_reference, f"qwen pair {policy}")
    drafted = [r.stats.drafted for r in results]
    assert all(d == 0 for d in drafted) if policy == "off" else all(d > 0 for d in drafted)


@pytest.mark.real_models
@pytest.mark.slow
@pytest.mark.parametrize("policy", ["static:1", "static:2", "static:3", "static:4"])
def test_smollm2_with_ngram_drafter_matches_hf_greedy(smollm2, smollm2_reference, policy):
    engine = SpecEngine(smollm2[0], NgramDrafter(), policy=policy)
    results = assert_engine_matches(engine, smollm2_reference, f"smollm2 + ngram {policy}")
    assert sum(r.stats.drafted for r in results) > 0, "the n-gram drafter never proposed: nothing was verified"


# --------------------------------------------------------------------------- structured output


@pytest.mark.real_models
@pytest.mark.slow
def test_default_pair_writes_json_that_validates_under_eight_schemas(qwen_target, qwen_draft):
    """The structured workload's eight schemas (nested objects, arrays, enums, integers, numbers,
    booleans, string patterns), one real prompt each, decoded in one batch beside a free-text row.
    With k = 3 really drafted and jump-forward on, every answer is JSON that `jsonschema` validates,
    ended by the grammar (not the token budget), and equals constrained greedy decoding without
    speculation or jump-forward token for token (forgiving only near-ties of the masked logits, as
    above); the free row is untouched."""
    (model, tokenizer), (draft, _) = qwen_target, qwen_draft
    prompts = load_structured(8)
    assert len({json.dumps(p.json_schema, sort_keys=True) for p in prompts}) == 8
    ids = [encode_prompt(tokenizer, p) for p in prompts] + [encode_prompt(tokenizer, "Name three colours.")]
    stops = (tokenizer.eos_token_id,)
    grammars = [Grammar.json_schema(p.json_schema) for p in prompts]
    params = [SamplingParams(temperature=0, max_new_tokens=96, stop_token_ids=stops,
                             constraint=g.constraint(tokenizer, model.config.vocab_size)) for g in grammars]
    params.append(SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=stops))
    # the reference is plain constrained decoding: no drafts and no jump-forward
    runs = {policy: SpecEngine(model, draft, policy=policy, max_batch_size=len(ids),
                               jump_forward=policy != "off").generate(ids, params)
            for policy in ("off", "static:3")}
    plain, speculative = runs["off"], runs["static:3"]
    assert max(k for r in speculative for k in r.stats.k_per_step) == 3  # k = 3 was drafted, not capped
    assert sum(r.stats.forced for r in speculative) > 0 and sum(r.stats.forced for r in plain) == 0
    assert sum(r.stats.accepted for r in speculative[:-1]) > 0
    for prompt, grammar, prompt_ids, fast, slow in zip(prompts, grammars, ids, speculative, plain):
        assert fast.error is None and slow.error is None, (prompt.id, fast.error, slow.error)
        assert fast.finish_reason == "stop", f"{prompt.id}: the grammar did not end it ({len(fast.token_ids)} tokens)"
        value = json.loads(tokenizer.decode(fast.token_ids, skip_special_tokens=True))
        jsonschema.validate(value, prompt.json_schema)
        assert fast.stats.masks > 0 and fast.stats.mask_seconds > 0  # the mask work was counted
        _assert_same_constrained_greedy(model, grammar.constraint(tokenizer, model.config.vocab_size),
                                        prompt_ids, fast.token_ids, slow.token_ids, prompt.id)
    assert speculative[-1].token_ids == plain[-1].token_ids and speculative[-1].stats.masks == 0


def _assert_same_constrained_greedy(model, constraint, prompt, produced, reference, label):
    """Equal token for token, or diverging first at a near-tie of the grammar-masked logits."""
    n = min(len(produced), len(reference))

    def masked_logits(prefix):
        state = constraint.initial_state()
        for token in prefix:
            state = constraint.advance(state, token)
        logits = full_forward_last_logits(model, prompt + prefix)
        return logits.masked_fill(~constraint.allowed_tokens(state), float("-inf"))

    tie = check_greedy_match(produced[:n], reference[:n], masked_logits, label=label)
    if tie is None:
        assert len(produced) == len(reference), f"{label}: one output stops {abs(len(produced) - len(reference))} early"
    else:
        warnings.warn(f"{label}: justified fp32 near-tie under the grammar at index {tie.index} (gap {tie.gap:.3g})")
