"""Statistical exactness through the public API.

For each sampling configuration, the exact probability of every length-3 continuation is computed by
enumerating the target (12^3 = 1,728 sequences per prompt) with the processed distributions, and
21,000 samples are drawn through `SpecEngine`: k in {1, 3, 5} x 7,000, each batch mixing two prompt
lengths. A chi-square goodness-of-fit test (cells with expected count < 5 pooled) runs per (k, prompt).

False-failure probability: each test rejects at p < 1e-4; with 6 tests per configuration and 7
configurations, the chance that a correct engine fails any of them is below 42 x 1e-4 = 0.42%. All
seeds are fixed, so a run is reproducible. The negative control shows the same test does fail on a
classic bug (resampling from the target instead of the residual after a rejection).
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from adaptive_spec import PrefixConstraint, SamplingParams, SpecEngine
from adaptive_spec.engine import engine as engine_module
from adaptive_spec.sampling import rejection
from adaptive_spec.sampling.transforms import RowSettings, process_logits

VOCAB = 12
LENGTH = 3
PROMPTS = ([3, 1], [5, 9, 2, 7, 4])
SAMPLES_PER_K_AND_PROMPT = 3500
ALPHA = 1e-4


def _even_after_odd(generated: tuple[int, ...]) -> list[int]:
    """A prefix-dependent constraint: after an odd token only even ones, else anything but 0."""
    if generated and generated[-1] % 2 == 1:
        return [t for t in range(VOCAB) if t % 2 == 0]
    return list(range(1, VOCAB))


CONFIGS = {
    "temperature-1": SamplingParams(temperature=1.0),
    "temperature-0.7-top-k": SamplingParams(temperature=0.7, top_k=4),
    "top-p": SamplingParams(top_p=0.8),
    "min-p": SamplingParams(min_p=0.15),
    "repetition-penalty": SamplingParams(repetition_penalty=1.8),
    "allowed-set": SamplingParams(allowed_token_ids=frozenset({0, 2, 3, 5, 8, 11})),
    "prefix-constraint": SamplingParams(constraint=PrefixConstraint(_even_after_odd)),
}


def exact_distribution(target, prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(continuation) for every length-3 continuation, by enumerating the target."""
    settings = RowSettings(*(torch.tensor([v]) for v in (params.temperature, params.top_k, params.top_p,
                                                            params.min_p, params.repetition_penalty)))

    def step_probs(generated: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            logits = target(torch.tensor([prompt + list(generated)])).logits[:, -1]
        seen = torch.zeros(1, VOCAB, dtype=torch.bool)
        seen[0, prompt + list(generated)] = True
        allowed = torch.ones(1, VOCAB, dtype=torch.bool)
        if params.allowed_token_ids is not None:
            allowed[:] = False
            allowed[0, list(params.allowed_token_ids)] = True
        if params.constraint is not None:
            state = params.constraint.initial_state()
            for token in generated:
                state = params.constraint.advance(state, token)
            only = torch.zeros(1, VOCAB, dtype=torch.bool)
            only[0, list(params.constraint.allowed_tokens(state))] = True
            allowed &= only
        return process_logits(logits, settings, seen if params.repetition_penalty != 1 else None, allowed)[0][0]

    out = {}
    level = {(): 1.0}
    for _ in range(LENGTH):
        nxt = {}
        for prefix, mass in level.items():
            probs = step_probs(prefix).double()
            for token in torch.nonzero(probs).flatten().tolist():
                nxt[prefix + (token,)] = mass * float(probs[token])
        level = nxt
    out.update(level)
    return out


def chi_square_p_value(counts: Counter, expected_probs: dict, total: int) -> float:
    unexpected = sum(c for seq, c in counts.items() if seq not in expected_probs)
    if unexpected:
        return 0.0  # a sequence the target cannot produce
    expected = np.array([expected_probs[s] * total for s in expected_probs])
    observed = np.array([counts.get(s, 0) for s in expected_probs], dtype=float)
    small = expected < 5
    if small.any():  # pool sparse cells so the chi-square approximation holds
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    return float(stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


def sample_engine(target, draft, params: SamplingParams, k: int, seed: int) -> list[Counter]:
    params = SamplingParams(**{**params.__dict__, "max_new_tokens": LENGTH, "seed": None})
    engine = SpecEngine(target, draft, policy=f"static:{k}", max_batch_size=2048, seed=seed)
    prompts = [list(p) for _ in range(SAMPLES_PER_K_AND_PROMPT) for p in PROMPTS]  # interleaved lengths
    results = engine.generate(prompts, params)
    counts = [Counter() for _ in PROMPTS]
    for index, result in enumerate(results):
        assert result.error is None, result.error
        counts[index % len(PROMPTS)][tuple(result.token_ids)] += 1
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_matches_target_distribution(small_pair, name):
    target, draft = small_pair
    params = CONFIGS[name]
    exact = [exact_distribution(target, list(p), params) for p in PROMPTS]
    for prompt_exact in exact:
        assert abs(sum(prompt_exact.values()) - 1) < 1e-5
    drafted = 0
    for k in (1, 3, 5):
        counts = sample_engine(target, draft, params, k, seed=1000 + k)
        for prompt, prompt_counts, prompt_exact in zip(PROMPTS, counts, exact):
            p_value = chi_square_p_value(prompt_counts, prompt_exact, SAMPLES_PER_K_AND_PROMPT)
            assert p_value >= ALPHA, f"{name}, k={k}, prompt {prompt}: chi-square p = {p_value:.2e}"
        drafted += k
    assert drafted


@pytest.mark.slow
def test_statistical_test_catches_a_biased_engine(small_pair, monkeypatch):
    """Negative control: after a rejection, sample from the target instead of the residual."""
    target, draft = small_pair

    def biased_verify(draft_tokens, num_drafts, target_probs, draft_probs, accept_uniforms, final_uniforms):
        verdict = rejection.verify(draft_tokens, num_drafts, target_probs, draft_probs, accept_uniforms, final_uniforms)
        rows = torch.arange(len(num_drafts))
        from_target = rejection.sample_inverse_cdf(target_probs[rows, verdict.num_accepted], final_uniforms)
        tokens = torch.where(verdict.rejected, from_target, verdict.final_tokens)
        return rejection.Verdict(verdict.num_accepted, tokens, verdict.rejected)

    monkeypatch.setattr(engine_module, "verify", biased_verify)
    params = CONFIGS["temperature-1"]
    counts = sample_engine(target, draft, params, k=3, seed=7)
    p_value = chi_square_p_value(counts[0], exact_distribution(target, list(PROMPTS[0]), params), SAMPLES_PER_K_AND_PROMPT)
    assert p_value < ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("name", ["temperature-0.7-top-k", "prefix-constraint"])
def test_ngram_drafter_matches_target_distribution(small_pair, name):
    """Prompt lookup is a one-hot draft; it must be exact too (same test and threshold as above;
    2 tests x 2 prompts at p < 1e-4 each: false-failure probability below 0.04%)."""
    from adaptive_spec import NgramDrafter

    target, _ = small_pair
    params = CONFIGS[name]
    counts = sample_engine(target, NgramDrafter(max_ngram=2, min_ngram=1), params, k=3, seed=99)
    for prompt, prompt_counts in zip(PROMPTS, counts):
        p_value = chi_square_p_value(prompt_counts, exact_distribution(target, list(prompt), params),
                                     SAMPLES_PER_K_AND_PROMPT)
        assert p_value >= ALPHA, f"ngram {name}, prompt {prompt}: chi-square p = {p_value:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["goodput", "heuristic", "confidence:0.3"])
def test_adaptive_policies_stay_exact(small_pair, policy):
    """k chosen online (goodput: from acceptance and timing; confidence: from the draft's own
    probabilities) must not bias the output. 3 tests x 2 prompts at p < 1e-4: false-failure
    probability below 0.06%."""
    from adaptive_spec.control import GoodputPolicy, make_policy

    class CheapDrafting:  # a machine where drafting pays, so goodput really speculates at this batch size
        def step_seconds_table(self, batch, context, k_max):
            return [1.0 + 0.05 * k for k in range(k_max + 1)]

        def observe(self, record):
            pass

    target, draft = small_pair
    params = SamplingParams(**{**CONFIGS["temperature-0.7-top-k"].__dict__, "max_new_tokens": LENGTH})
    chosen = GoodputPolicy(CheapDrafting()) if policy == "goodput" else make_policy(policy)
    engine = SpecEngine(target, draft, policy=chosen, max_batch_size=2048, seed=5)
    prompts = [list(p) for _ in range(SAMPLES_PER_K_AND_PROMPT) for p in PROMPTS]
    results = engine.generate(prompts, params)
    assert sum(r.stats.drafted for r in results) > 0
    for index, (prompt, prompt_exact) in enumerate(zip(PROMPTS, [exact_distribution(target, list(p), params)
                                                                  for p in PROMPTS])):
        counts = Counter(tuple(r.token_ids) for r in results[index::len(PROMPTS)])
        p_value = chi_square_p_value(counts, prompt_exact, SAMPLES_PER_K_AND_PROMPT)
        assert p_value >= ALPHA, f"{policy}, prompt {prompt}: chi-square p = {p_value:.2e}"
