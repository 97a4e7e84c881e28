"""The scheduler plug-in inside a real vLLM engine (SmolLM2-135M with n-gram drafting, CPU).

Every test checks that what it names really ran: the plug-in is the engine's scheduler, drafts were
verified (or not), the policy was asked.
"""

from __future__ import annotations

import warnings

import pytest

from vllm_cases import PROMPTS, SMALL_MODEL, TEST_THREADS, require_vllm, sampling

require_vllm()

from vllm import SamplingParams  # noqa: E402

from adaptive_spec.control.cost_model import CostModel  # noqa: E402
from adaptive_spec.control.policy import StaticPolicy  # noqa: E402
from adaptive_spec.control.registry import make_policy  # noqa: E402
from adaptive_spec.integrations.vllm.controller import SpecController  # noqa: E402
from adaptive_spec.integrations.vllm.engine import EngineSpec  # noqa: E402
from adaptive_spec.integrations.vllm.scheduler import AdaptiveScheduler, scheduler_of  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.real_models]

NGRAM = EngineSpec(SMALL_MODEL, drafter="ngram", max_k=6, threads=TEST_THREADS)
GREEDY_PROMPTS = (PROMPTS["code"], PROMPTS["prose"], PROMPTS["repeat"], PROMPTS["list"])
GREEDY_TOKENS = 48


SAMPLED_PROMPTS, SAMPLED_SEEDS = (PROMPTS["code"], "Once upon a time, in a small town,"), (11, 12)


@pytest.fixture(scope="module", autouse=True)
def references_first(engines):
    """Every plain-vLLM reference before the first speculative engine: vLLM 0.32 cannot start a third
    engine in a process once its n-gram drafter has loaded (its kernel registry trips over a numba
    object), so each test module builds at most two engines, plain first."""
    engines.reference(SMALL_MODEL, GREEDY_PROMPTS, GREEDY_TOKENS)
    engines.reference(SMALL_MODEL, SAMPLED_PROMPTS, 32, temperature=0.8, seeds=SAMPLED_SEEDS)


class Recording:
    """Wraps a policy and logs every choice and every step record it is shown."""

    def __init__(self, inner):
        self.inner, self.name, self.log = inner, f"recording({inner.name})", []

    def choose(self, views):
        ks = list(self.inner.choose(views))
        self.log.append(("choose", [(v.request_id, v.max_k) for v in views], ks))
        return ks

    def observe(self, record):
        self.log.append(("observe", [(o.request_id, o.k, o.accepted) for o in record.outcomes]))
        self.inner.observe(record)


class FailsEveryOtherCall(StaticPolicy):
    """static:3, except that every second choice raises."""

    def __post_init__(self):
        super().__post_init__()
        self.calls = 0

    @property
    def name(self):
        return "fails-every-other-call"

    def choose(self, requests):
        self.calls += 1
        if self.calls % 2 == 0:
            raise RuntimeError("policy bug")
        return super().choose(requests)


def install(engines, policy, cost_model=None, sampled_speculation=False) -> AdaptiveScheduler:
    """The module's engine with `policy` in its scheduler (one engine serves every test, so each
    test states the sampling guard it runs under; False: sampled requests get no drafts)."""
    scheduler = scheduler_of(engines.get(NGRAM))
    scheduler.use_controller(SpecController(policy, cost_model))
    scheduler.sampled_speculation = sampled_speculation
    return scheduler


def greedy(engines, prompts=GREEDY_PROMPTS, max_tokens=GREEDY_TOKENS) -> list[list[int]]:
    outputs = engines.get(NGRAM).generate(list(prompts), SamplingParams(temperature=0, max_tokens=max_tokens))
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("policy", ["off", "static:3", "goodput", "heuristic", "batch-table", "ema-tiers"])
def test_greedy_outputs_equal_vllm_without_speculation(engines, policy):
    reference = engines.reference(SMALL_MODEL, GREEDY_PROMPTS, GREEDY_TOKENS)
    cost_model = CostModel.default()
    scheduler = install(engines, make_policy(policy, cost_model), cost_model)
    assert greedy(engines) == reference
    stats = scheduler.controller.stats
    assert stats.steps > 0
    if policy == "off":
        assert stats.drafted == 0
    else:
        assert stats.drafted > 0 and stats.accepted > 0, "speculation never ran"


def test_per_request_k_varies_within_a_step(engines):
    cost_model = CostModel.default()
    scheduler = install(engines, make_policy("goodput", cost_model), cost_model)
    greedy(engines)
    stats = scheduler.controller.stats
    assert stats.ragged_steps > 0, "no step verified different draft lengths for different requests"
    assert len([k for k, n in stats.verified_histogram.items() if n]) >= 3


def test_speculation_turns_off_on_prose_and_comes_back_when_it_pays(engines):
    """n-gram drafts on freshly sampled prose rarely match: goodput chooses k = 0 for requests that
    could draft; on a copying task the same policy object drafts again and its drafts are accepted."""
    cost_model = CostModel.default()
    policy = Recording(make_policy("goodput", cost_model))
    install(engines, policy, cost_model, sampled_speculation=True)  # about the policy, not the CPU guard
    prose = ["The history of the city begins with", "My favourite memory of summer is",
             "Scientists have recently discovered that", "In the quiet village, the old baker"]
    engines.get(NGRAM).generate(prose, SamplingParams(temperature=1.0, max_tokens=96, seed=1))
    prose_choices = [entry for entry in policy.log if entry[0] == "choose"]
    assert any(all(k == 0 for k in ks) and all(cap > 0 for _, cap in views) for _, views, ks in prose_choices), \
        "speculation was never switched off on prose"
    turned_off_at = len(policy.log)

    # Three copying requests in turn: the prose phase leaves the policy backed off by an amount that
    # varies from run to run (vLLM's sampled speculation on CPU is not deterministic, see
    # `sampled_speculation_is_exact`), and one short copy (about 10 tokens) can end before drafting resumes.
    for _ in range(3):
        greedy(engines, prompts=(PROMPTS["repeat"],), max_tokens=64)
    later = policy.log[turned_off_at:]
    assert any(max(entry[2], default=0) > 0 for entry in later if entry[0] == "choose")
    accepted = sum(accepted for entry in later if entry[0] == "observe" for _, _, accepted in entry[1])
    assert accepted >= 4, "speculation did not come back where it pays"


@pytest.mark.parametrize("policy", ["off", "static:3", "goodput"])
def test_with_the_sampling_guard_on_sampled_outputs_equal_vllm_without_speculation(engines, policy):
    """With the guard on (the default where vLLM's sampler is not known to be exact), the plug-in gives
    sampled requests no drafts, so with a seed, under any policy, two runs give the same tokens as
    vLLM without speculation, token for token. Control: with the guard lifted the same drafting
    policy does verify drafts, so it is the guard that keeps them out. (That sampled speculation is
    exact on CPU with `cpu_sampling`'s fix is tested statistically in test_vllm_cpu_sampling.py.)"""
    prompts, seeds = SAMPLED_PROMPTS, SAMPLED_SEEDS
    reference = engines.reference(SMALL_MODEL, prompts, 32, temperature=0.8, seeds=seeds)
    assert len({tuple(tokens) for tokens in reference}) == 2
    for _ in range(2):
        cost_model = CostModel.default()
        scheduler = install(engines, make_policy(policy, cost_model), cost_model)
        outputs = engines.get(NGRAM).generate(list(prompts), sampling(2, 32, 0.8, seeds))
        assert [list(o.outputs[0].token_ids) for o in outputs] == reference
        assert scheduler.controller.stats.steps > 0 and scheduler.controller.stats.drafted == 0
    if policy == "static:3":
        scheduler = install(engines, make_policy("static:3"), sampled_speculation=True)
        engines.get(NGRAM).generate([PROMPTS["repeat"]], sampling(1, 32, 0.8, (5,)))
        assert scheduler.controller.stats.drafted > 0, "control: without the guard static:3 drafts"


def test_a_failing_policy_runs_those_steps_without_speculation_and_corrupts_nothing(engines):
    reference = engines.reference(SMALL_MODEL, GREEDY_PROMPTS, GREEDY_TOKENS)
    policy = Recording(FailsEveryOtherCall(3))
    scheduler = install(engines, policy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert greedy(engines) == reference
    ours = [w for w in caught if "fails-every-other-call" in str(w.message)]
    assert len(ours) == 1 and "without speculation" in str(ours[0].message)
    stats = scheduler.controller.stats
    assert stats.policy_failures >= 5 and stats.accepted > 0
    # A choice that failed gave k = 0: the drafts it governed are verified one step later.
    observes = [i for i, entry in enumerate(policy.log) if entry[0] == "observe"]
    failed_steps = 0
    for step, index in enumerate(observes[:-1]):
        chose = [entry for entry in policy.log[observes[step - 1] + 1 if step else 0:index] if entry[0] == "choose"]
        if not chose:  # the wrapped policy raised: no choice was logged in this step
            failed_steps += 1
            verified_next = policy.log[observes[step + 1]][1]
            assert all(k == 0 for _, k, _ in verified_next)
    assert failed_steps >= 3


def test_on_cpu_the_sampling_guard_is_on_exactly_when_vllms_sampler_is_unfixed(engines):
    from vllm.platforms import current_platform

    from adaptive_spec.integrations.vllm import cpu_sampling
    from adaptive_spec.integrations.vllm.scheduler import sampled_speculation_is_exact

    assert current_platform.is_cpu() and cpu_sampling.installed() and sampled_speculation_is_exact()
    cpu_sampling.uninstall()
    try:
        assert not sampled_speculation_is_exact()
    finally:
        cpu_sampling.install()
