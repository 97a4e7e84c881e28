"""Sampled speculation inside vLLM on CPU keeps the output law once the sampler's expand is fixed.

A statistical test with fixed seeds: the same copying prompt sampled (temperature 1.0, top-k 50,
top-p 0.95, so all three expanded parameters matter) by plain vLLM and by vLLM verifying n-gram
drafts under the plug-in; the joint law of generated tokens 2-5 (positions the drafts cover) is
compared by a chi-square test of homogeneity at alpha = 0.001, which is the probability of a false
failure when both laws are equal. Negative control: with the temperature doubled at verified
positions only, the same test must reject. (At temperature 0.8 the copied tokens keep more than
top-p's 0.95 of the mass even when doubled, so that control changed no outcome: measured, identical
counts. At 1.0 doubling cuts acceptance from 99% to about 40%.)
"""

from __future__ import annotations

from collections import Counter

import pytest

from vllm_cases import PROMPTS, SMALL_MODEL, TEST_THREADS, p_value, require_vllm

require_vllm()

from vllm import SamplingParams  # noqa: E402

from adaptive_spec.control.policy import StaticPolicy  # noqa: E402
from adaptive_spec.integrations.vllm import cpu_sampling  # noqa: E402
from adaptive_spec.integrations.vllm.controller import SpecController  # noqa: E402
from adaptive_spec.integrations.vllm.engine import EngineSpec  # noqa: E402
from adaptive_spec.integrations.vllm.scheduler import sampled_speculation_is_exact, scheduler_of  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.real_models]

NGRAM = EngineSpec(SMALL_MODEL, drafter="ngram", max_k=4, threads=TEST_THREADS)
SAMPLES, MAX_TOKENS, ALPHA = 400, 6, 0.001


def params(seeds):
    return [SamplingParams(temperature=1.0, top_k=50, top_p=0.95, max_tokens=MAX_TOKENS, seed=seed) for seed in seeds]


def window(outputs) -> Counter:
    return Counter(tuple(o.outputs[0].token_ids[1:5]) for o in outputs)


@pytest.fixture(scope="module")
def plain(engines) -> Counter:
    spec = EngineSpec(SMALL_MODEL, drafter=None, threads=TEST_THREADS)
    return window(engines.get(spec).generate([PROMPTS["repeat"]] * SAMPLES, params(range(SAMPLES)), use_tqdm=False))


def speculative(engines) -> tuple[Counter, object]:
    llm = engines.get(NGRAM)
    scheduler = scheduler_of(llm)
    scheduler.use_controller(SpecController(StaticPolicy(3)))
    scheduler.sampled_speculation = True
    seeds = range(SAMPLES, 2 * SAMPLES)  # independent of the plain run's draws
    return window(llm.generate([PROMPTS["repeat"]] * SAMPLES, params(seeds), use_tqdm=False)), scheduler


def test_the_fix_is_installed_with_an_engine_on_cpu_and_lifts_the_guard(plain):
    """Building an engine installs it (vLLM's plug-in entry point, and `make_llm` itself)."""
    assert cpu_sampling.installed() and sampled_speculation_is_exact()


def test_the_fixed_expand_matches_the_kernels_contract():
    import torch

    cumulative = torch.tensor([2, 5, 6], dtype=torch.int32)
    floats = cpu_sampling.expand_batch_to_tokens(torch.tensor([0.5, 0.0, 2.0]), cumulative, 6, replace_from=0, replace_to=1)
    assert floats.dtype == torch.float32 and floats.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, 2.0]
    ints = cpu_sampling.expand_batch_to_tokens(torch.tensor([7, 8, 9], dtype=torch.int32), cumulative, 6)
    assert ints.dtype == torch.int32 and ints.tolist() == [7, 7, 8, 8, 8, 9]


def test_sampled_outputs_with_drafts_verified_follow_plain_vllms_law(engines, plain):
    counts, scheduler = speculative(engines)
    stats = scheduler.controller.stats
    assert stats.drafted > SAMPLES and stats.accepted > 0, "the drafts were not verified"
    assert p_value(plain, counts) > ALPHA


def test_with_the_temperature_of_verified_positions_doubled_the_same_test_rejects(engines, plain, monkeypatch):
    """Negative control: a sampler that is wrong only where drafts are verified (temperature 2.0
    instead of 1.0 there) must be caught by the test above. (vLLM's own CPU expand is no reliable
    control: it leaves its output unwritten, and that memory may still hold right values from a
    previous call, see the next test.)"""
    from vllm.v1.sample import rejection_sampler

    def doubled_temperature(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        expanded = cpu_sampling.expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from, replace_to)
        return expanded * 2 if replace_to == 1 else expanded  # the temperature call replaces 0 by 1

    monkeypatch.setattr(rejection_sampler, "expand_batch_to_tokens", doubled_temperature)
    counts, scheduler = speculative(engines)
    assert scheduler.controller.stats.drafted > SAMPLES
    assert p_value(plain, counts) <= ALPHA, "the test cannot tell a wrong sampler from a right one"


def test_vllms_own_cpu_expand_leaves_a_float_output_unwritten(plain):
    """The bug the fix is for: fresh float values never reach the output of vLLM's CPU expand."""
    import torch

    original = cpu_sampling._state["originals"]["expand_batch_to_tokens"]
    values = torch.tensor([0.123, 4.56], dtype=torch.float32)
    expanded = original(values, torch.tensor([2, 5], dtype=torch.int32), 5)
    assert expanded.tolist() != pytest.approx([0.123, 0.123, 4.56, 4.56, 4.56])


def recovered_counts(sample, target_probs, draws: int, seed: int) -> Counter:
    """(position, recovered token) counts of `draws` calls on one ragged step: row 0 drafted
    nothing, row 1 one token, row 2 two."""
    import torch
    from types import SimpleNamespace

    torch.manual_seed(seed)
    cumulative, drafts = torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([2, 1, 4], dtype=torch.int32)
    draft_probs = torch.tensor([[0.1, 0.1, 0.6, 0.1, 0.05, 0.05], [0.2, 0.5, 0.1, 0.1, 0.05, 0.05],
                                [0.05, 0.05, 0.1, 0.1, 0.6, 0.1]])
    counts = Counter()
    for _ in range(draws):
        tokens = sample(2, [0, 1, 2], cumulative, drafts, draft_probs, target_probs, SimpleNamespace(generators={}), "cpu")
        counts.update(enumerate(tokens.tolist()))
    return counts


TARGET = [[0.3, 0.2, 0.1, 0.2, 0.1, 0.1], [0.1, 0.1, 0.3, 0.2, 0.2, 0.1], [0.25, 0.25, 0.1, 0.2, 0.1, 0.1]]


def test_recovered_tokens_drawn_for_drafted_rows_alone_keep_vllms_law(plain):
    """Statistical, alpha = 0.001 (the false-failure probability): 3,000 draws of the replacement
    against 3,000 of vLLM's own on a step where one row drafted nothing. Negative control: vLLM's own
    on another target law (the residual law moves) must be rejected by the same test."""
    import torch

    original = cpu_sampling._state["originals"]["sample_recovered_tokens"]
    target = torch.tensor(TARGET)
    ours = recovered_counts(cpu_sampling.sample_recovered_tokens, target, 3000, seed=0)
    theirs = recovered_counts(original, target, 3000, seed=1)
    assert p_value(ours, theirs) > ALPHA
    moved = torch.tensor([TARGET[0], TARGET[2], TARGET[1]])
    assert p_value(ours, recovered_counts(original, moved, 3000, seed=2)) <= ALPHA, "the test cannot tell laws apart"


def test_a_step_without_drafts_draws_no_noise(plain):
    """vLLM draws exponential noise over [batch, vocabulary] even when no row drafted; the
    replacement draws none (the generator's state is untouched) and recovers nothing."""
    import torch
    from types import SimpleNamespace

    args = (1, [0, 0], torch.tensor([0, 0], dtype=torch.int32), torch.empty(0, dtype=torch.int32), None,
            torch.empty(0, 8), SimpleNamespace(generators={}), "cpu")
    before = torch.get_rng_state()
    assert cpu_sampling.sample_recovered_tokens(*args).numel() == 0
    assert torch.equal(torch.get_rng_state(), before)
    cpu_sampling._state["originals"]["sample_recovered_tokens"](*args)
    assert not torch.equal(torch.get_rng_state(), before), "control: vLLM's own draws for nothing"
