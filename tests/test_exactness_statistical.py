"""Statistical exactness at depth, through the public API.

Each sample is a whole 6-token continuation: the first token comes from prefill and the other five
from speculative steps, so the first step really drafts up to 4 tokens (the engine caps k at
remaining - 1), and later draft positions, rejections at position >= 2, the residuals there, and
penalties and constraints carried along a draft all shape the sample. The exact law of every
continuation is enumerated from the target's processed distributions (an 8-token vocabulary keeps
that to 8^6 sequences), and for each pair of adjacent positions (1-2, 2-3, ..., 5-6: joints of
the later positions, not only the first) a chi-square goodness-of-fit test compares the exact pair
law with `SAMPLES` engine samples per prompt (cells expected < 5 pooled). Batches mix two prompt
lengths and, with the `ragged` policy, rows of k = 2, 3 and 4 in every step; each test asserts
the k it meant really ran.

False-failure probability: each of 5 pair tables x 2 prompts rejects at p < ALPHA = 1e-4, over 9
sampling configurations (two grammars among them, one whose forced letters jump-forward takes), 2
n-gram configurations and 3 adaptive policies: 140 tests, so a correct engine fails any of them
with probability below 140 x 1e-4 = 1.4% (a union bound; the tables overlap, so the real figure is
lower). All seeds are fixed, so a run is reproducible. Four negative controls show the same tests
fail on real bugs: the recovered token sampled from the target instead of the residual after any
rejection, the same bug only at draft position >= 2, grammar masks taken at the committed state for
every drafted position (caught by the forbidden tokens it emits), and drafts after forced tokens
tested with misaligned uniforms.
"""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from adaptive_spec import NgramDrafter, PrefixConstraint, SamplingParams, SpecEngine
from adaptive_spec.control.step_cost import StepCostBase
from adaptive_spec.control import GoodputConfig, GoodputPolicy, PolicyBase, make_policy
from adaptive_spec.engine import engine as engine_module
from adaptive_spec.engine import processing
from adaptive_spec.sampling import rejection
from adaptive_spec.sampling.grammar import Grammar
from adaptive_spec.sampling.transforms import RowSettings, process_logits

from conftest import tiny_lm

VOCAB = 8  # small enough to enumerate every 6-token continuation (8^6 = 262,144)
LENGTH = 6  # prefill token + 5 speculative positions: the first step drafts up to k = 4
PROMPTS = ([3, 1], [5, 7, 2, 6, 4])
SAMPLES = 5000  # per prompt
ALPHA = 1e-4
RAGGED_KS = (2, 3, 4)  # the `ragged` policy's k per request, cycling: three k in every batch


def _even_after_odd(generated: tuple[int, ...]) -> list[int]:
    """A prefix-dependent constraint: after an odd token only even ones, else anything but 0."""
    if generated and generated[-1] % 2 == 1:
        return [t for t in range(VOCAB) if t % 2 == 0]
    return list(range(1, VOCAB))


def _tiny_tokenizer():
    """A byte-level tokenizer whose VOCAB tokens are 'a'..'g' and an end of sequence: small enough to
    enumerate, real enough for the grammar engine (its trie is built from the tokenizer itself)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE({c: i for i, c in enumerate("abcdefg")}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")
    assert len(tokenizer) == VOCAB
    return tokenizer


# 'a' is followed by one of b-d, 'f' by a or g; at least 7 units, so no end of sequence in 6 tokens
GRAMMAR = Grammar.regex("(a[b-d]|e|f[ag]|c)(a[b-d]|e|f[ag]|c){6,}")
# Every unit's letters after its first are forced ('a' -> b, 'c' -> d e, 'f' -> g): jump-forward takes
# them at the committed position and the drafts follow them in the same step.
FORCING_GRAMMAR = Grammar.regex("(ab|cde|fg|b)(ab|cde|fg|b){6,}")

CONFIGS = {
    "temperature-1": SamplingParams(temperature=1.0),
    "temperature-0.7-top-k": SamplingParams(temperature=0.7, top_k=4),
    "top-p": SamplingParams(top_p=0.8),
    "min-p": SamplingParams(min_p=0.15),
    "repetition-penalty": SamplingParams(repetition_penalty=1.8),
    "allowed-set": SamplingParams(allowed_token_ids=frozenset({0, 2, 3, 5, 7})),
    "prefix-constraint": SamplingParams(constraint=PrefixConstraint(_even_after_odd)),
    "grammar": SamplingParams(temperature=1.0, constraint=GRAMMAR.constraint(_tiny_tokenizer(), VOCAB)),
    "grammar-forcing": SamplingParams(temperature=1.0, constraint=FORCING_GRAMMAR.constraint(_tiny_tokenizer(), VOCAB)),
}


@pytest.fixture(scope="module")
def small_pair():
    """(target, draft) over VOCAB tokens with different seeds."""
    return tiny_lm(0, vocab=VOCAB), tiny_lm(1, vocab=VOCAB)


class RaggedPolicy(PolicyBase):
    """k = 2, 3, 4, 2, ... by request, so every batch verifies rows of three draft lengths."""

    name = "ragged"

    def __init__(self):
        self._k: dict[str, int] = {}

    def choose(self, requests):
        for request in requests:
            self._k.setdefault(request.request_id, RAGGED_KS[len(self._k) % len(RAGGED_KS)])
        return [self._k[r.request_id] for r in requests]


class CheapDrafting(StepCostBase):
    """A machine where drafting is nearly free, so goodput really speculates at this batch size and
    its in-step rule keeps drafting deep even on this tiny, unconfident draft."""

    def step_seconds_table(self, batch, context, k_max):
        return [1.0 + 0.001 * k for k in range(k_max + 1)]

    def observe(self, record):
        pass


# --- the exact law ------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def exact_law(target, prompt: tuple[int, ...], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every continuation with nonzero probability ([n, LENGTH] long) and its probability ([n] double),
    by enumerating the target's processed distributions level by level."""
    params = CONFIGS[name]
    sequences, mass = torch.zeros(1, 0, dtype=torch.long), torch.ones(1, dtype=torch.float64)
    for _ in range(LENGTH):
        probs = _next_token_probs(target, list(prompt), sequences, params).double()  # [n, VOCAB]
        mass = (mass[:, None] * probs).reshape(-1)
        sequences = torch.cat([sequences.repeat_interleave(VOCAB, dim=0),
                               torch.arange(VOCAB).repeat(len(sequences))[:, None]], dim=1)
        possible = mass > 0
        sequences, mass = sequences[possible], mass[possible]
    return sequences, mass


def _next_token_probs(target, prompt, prefixes: torch.Tensor, params) -> torch.Tensor:
    rows = len(prefixes)
    ids = torch.cat([torch.tensor(prompt).repeat(rows, 1), prefixes], dim=1)
    with torch.no_grad():
        logits = torch.cat([target(chunk).logits[:, -1] for chunk in ids.split(8192)])
    settings = RowSettings(*(torch.tensor([v] * rows) for v in (params.temperature, params.top_k, params.top_p,
                                                                  params.min_p, params.repetition_penalty)))
    seen = torch.zeros(rows, VOCAB, dtype=torch.bool).scatter_(1, ids, True)
    allowed = torch.ones(rows, VOCAB, dtype=torch.bool)
    if params.allowed_token_ids is not None:
        allowed[:] = False
        allowed[:, list(params.allowed_token_ids)] = True
    if params.constraint is not None:
        masks: dict[tuple[int, ...], torch.Tensor] = {}
        rows_allowed = []
        for prefix in prefixes.tolist():
            state = params.constraint.initial_state()
            for token in prefix:
                state = params.constraint.advance(state, token)
            here = params.constraint.allowed_tokens(state)
            if isinstance(here, torch.Tensor):  # a grammar gives a boolean mask
                here = here.nonzero().flatten().tolist()
            key = tuple(here)
            if key not in masks:
                masks[key] = torch.zeros(VOCAB, dtype=torch.bool)
                masks[key][list(key)] = True
            rows_allowed.append(masks[key])
        allowed &= torch.stack(rows_allowed)
    return process_logits(logits, settings, seen if params.repetition_penalty != 1 else None, allowed)[0]


def pair_table(sequences: torch.Tensor, weights: torch.Tensor, first: int) -> np.ndarray:
    """The joint law (or counts) of continuation positions (first, first + 1), flattened."""
    index = sequences[:, first] * VOCAB + sequences[:, first + 1]
    return torch.bincount(index, weights=weights, minlength=VOCAB * VOCAB).numpy()


def chi_square_p_values(samples: torch.Tensor, law) -> list[float]:
    """One p-value per adjacent position pair of the continuation (cells expected < 5 pooled)."""
    sequences, mass = law
    p_values = []
    for first in range(LENGTH - 1):
        observed = pair_table(samples, torch.ones(len(samples), dtype=torch.float64), first)
        expected = pair_table(sequences, mass, first) * len(samples)
        if observed[expected == 0].sum():
            p_values.append(0.0)  # a pair the target cannot produce
            continue
        small = expected < 5
        if expected[small].sum() > 0:
            expected = np.append(expected[~small], expected[small].sum())
            observed = np.append(observed[~small], observed[small].sum())
        else:
            expected, observed = expected[~small], observed[~small]
        p_values.append(float(stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue))
    return p_values


# --- sampling through the engine ----------------------------------------------------------------

def sample_engine(target, draft, params: SamplingParams, policy, seed: int):
    """(per prompt, the sampled continuations [SAMPLES, LENGTH]; the results)."""
    params = SamplingParams(**{**params.__dict__, "max_new_tokens": LENGTH, "seed": None})
    engine = SpecEngine(target, draft, policy=policy, max_batch_size=2048, seed=seed)
    prompts = [list(p) for _ in range(SAMPLES) for p in PROMPTS]  # interleaved lengths
    results = engine.generate(prompts, params)
    for result in results:
        assert result.error is None, result.error
        assert len(result.token_ids) == LENGTH
    samples = [torch.tensor([r.token_ids for r in results[index::len(PROMPTS)]]) for index in range(len(PROMPTS))]
    return samples, results


def first_step_ks(results) -> Counter:
    return Counter(r.stats.k_per_step[0] for r in results if r.stats.k_per_step)


def assert_exact(target, name, samples, label):
    for prompt, prompt_samples in zip(PROMPTS, samples):
        p_values = chi_square_p_values(prompt_samples, exact_law(target, tuple(prompt), name))
        assert min(p_values) >= ALPHA, f"{label}, prompt {prompt}: chi-square p per position pair = {p_values}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_matches_target_distribution_at_depth(small_pair, name):
    target, draft = small_pair
    samples, results = sample_engine(target, draft, CONFIGS[name], RaggedPolicy(), seed=1000)
    ks = first_step_ks(results)
    # k = 2, 3 and 4 all really drafted (forced tokens take room in a 6-token budget, so fewer 4s there)
    assert set(ks) == set(RAGGED_KS) and min(ks.values()) > (SAMPLES // 25 if name == "grammar-forcing" else SAMPLES // 2)
    assert sum(r.stats.accepted for r in results) > 0
    if name == "grammar-forcing":  # jump-forward really ran, ahead of drafts that were also rejected
        assert sum(r.stats.forced for r in results) > SAMPLES
        assert sum(r.stats.drafted for r in results) > sum(r.stats.accepted for r in results)
    assert_exact(target, name, samples, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["temperature-0.7-top-k", "prefix-constraint"])
def test_ngram_drafter_matches_target_distribution_at_depth(small_pair, name):
    """Prompt lookup is a one-hot draft; it must be exact too."""
    target, _ = small_pair
    samples, results = sample_engine(target, NgramDrafter(max_ngram=2, min_ngram=1), CONFIGS[name], "static:4", seed=99)
    assert max(k for r in results for k in r.stats.k_per_step) == 4
    assert_exact(target, name, samples, f"ngram {name}")


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["goodput", "heuristic", "confidence:0.3"])
def test_adaptive_policies_stay_exact_at_depth(small_pair, policy):
    """k chosen online (goodput: from acceptance and costs before the draft, then from the draft's
    calibrated confidence position by position inside it; confidence: from the draft's own
    probabilities; heuristic: from each request's last outcome) must not bias the output."""
    target, draft = small_pair
    deep = GoodputConfig(min_row_survival=0.0)  # no row stops alone: the batch rule decides the depth
    chosen = GoodputPolicy(CheapDrafting(), deep) if policy == "goodput" else make_policy(policy)
    samples, results = sample_engine(target, draft, CONFIGS["temperature-0.7-top-k"], chosen, seed=5)
    assert max(k for r in results for k in r.stats.k_per_step) >= 3  # deep drafts really ran
    assert_exact(target, "temperature-0.7-top-k", samples, policy)


# --- negative controls: the test must catch real bugs -------------------------------------------

def _resample_from_target_after_rejection(min_position: int):
    """A classic bug: after a rejection at draft position >= min_position, sample the recovered
    token from the target instead of the residual."""

    def biased_verify(draft_tokens, num_drafts, target_probs, draft_probs, accept_uniforms, final_uniforms):
        verdict = rejection.verify(draft_tokens, num_drafts, target_probs, draft_probs, accept_uniforms, final_uniforms)
        rows = torch.arange(len(num_drafts))
        from_target = rejection.sample_inverse_cdf(target_probs[rows, verdict.num_accepted], final_uniforms)
        buggy = verdict.rejected & (verdict.num_accepted >= min_position)
        return rejection.Verdict(verdict.num_accepted, torch.where(buggy, from_target, verdict.final_tokens),
                                 verdict.rejected)

    return biased_verify


@pytest.mark.slow
@pytest.mark.parametrize("min_position", [0, 2])
def test_statistical_test_catches_a_biased_engine(small_pair, monkeypatch, min_position):
    """Negative controls: the residual skipped after any rejection, and only at position >= 2."""
    target, draft = small_pair
    monkeypatch.setattr(engine_module, "verify", _resample_from_target_after_rejection(min_position))
    samples, results = sample_engine(target, draft, CONFIGS["temperature-1"], "static:4", seed=7)
    # the bug had occasions: rejections at position 2 or 3 of a 4-token draft
    assert sum(r.stats.accepted_per_step.count(2) + r.stats.accepted_per_step.count(3) for r in results) > SAMPLES // 4
    p_values = [p for prompt, prompt_samples in zip(PROMPTS, samples)
                for p in chi_square_p_values(prompt_samples, exact_law(target, tuple(prompt), "temperature-1"))]
    assert min(p_values) < ALPHA, p_values


@pytest.mark.slow
def test_statistical_test_catches_drafts_after_forced_tokens_tested_with_the_wrong_uniforms(small_pair, monkeypatch):
    """Negative control for jump-forward: each row's accept uniforms laid out from column 0 instead of
    after its forced tokens, so the forced tokens take the drafts' uniforms and the drafts after them
    get 0 (always accepted: the draft's law leaks into the output)."""
    target, draft = small_pair
    built = processing.StepSampler.__init__

    def misaligned(self, *args, **kwargs):
        built(self, *args, **kwargs)
        for row, m in enumerate(self.num_forced.tolist()):
            shifted = torch.zeros_like(self.accept_uniforms[row])
            shifted[: shifted.numel() - m] = self.accept_uniforms[row, m:]
            self.accept_uniforms[row] = shifted

    monkeypatch.setattr(processing.StepSampler, "__init__", misaligned)
    samples, results = sample_engine(target, draft, CONFIGS["grammar-forcing"], "static:4", seed=13)
    assert sum(r.stats.forced for r in results) > SAMPLES  # the bug had occasions
    p_values = [p for prompt, prompt_samples in zip(PROMPTS, samples)
                for p in chi_square_p_values(prompt_samples, exact_law(target, tuple(prompt), "grammar-forcing"))]
    assert min(p_values) < ALPHA, p_values


@pytest.mark.slow
def test_statistical_test_catches_grammar_masks_from_the_wrong_state(small_pair, monkeypatch):
    """Negative control for the grammar: every drafted position masked with the committed state's
    mask (the bug vLLM and SGLang each shipped once). Tokens the grammar forbids then get emitted,
    and the request fails when its committed state cannot advance through them."""
    target, draft = small_pair
    correct = processing.StepSampler._allowed_at
    monkeypatch.setattr(processing.StepSampler, "_allowed_at",
                        lambda self, row, position, drafts: correct(self, row, 0, drafts))
    params = SamplingParams(**{**CONFIGS["grammar"].__dict__, "max_new_tokens": LENGTH, "seed": None})
    engine = SpecEngine(target, draft, policy="static:4", max_batch_size=2048, seed=11)
    results = engine.generate([list(p) for _ in range(SAMPLES // 5) for p in PROMPTS], params)
    assert max(k for r in results for k in r.stats.k_per_step) == 4  # deep drafts, where the bug bites
    failed = [r for r in results if r.error is not None]
    # measured with these seeds: 1491 of 2000 requests emit a token the grammar forbids and fail
    assert len(failed) > len(results) // 4 and all("not allowed" in r.error for r in failed)
