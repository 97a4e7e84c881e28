"""The default pair (Qwen2.5-Coder 1.5B target, 0.5B draft model, float32) through vLLM with the
plug-in: greedy outputs equal vLLM without speculation, token for token."""

from __future__ import annotations

import pytest

from vllm_cases import PROMPTS, TEST_THREADS, require_vllm, sampling

require_vllm()

from adaptive_spec.assets import get_pair  # noqa: E402
from adaptive_spec.control.cost_model import CostModel  # noqa: E402
from adaptive_spec.control.registry import make_policy  # noqa: E402
from adaptive_spec.integrations.vllm.controller import SpecController  # noqa: E402
from adaptive_spec.integrations.vllm.engine import EngineSpec  # noqa: E402
from adaptive_spec.integrations.vllm.scheduler import scheduler_of  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.real_models, pytest.mark.slow]

PROMPTS_USED = (PROMPTS["code"], PROMPTS["prose"], PROMPTS["list"])
MAX_TOKENS = 32


def test_greedy_outputs_with_the_draft_model_equal_vllm_without_speculation(engines):
    pair = get_pair("qwen-coder")
    reference = engines.reference(pair.target, PROMPTS_USED, MAX_TOKENS, in_child=True)
    spec = EngineSpec.for_pair("qwen-coder", max_k=5, threads=TEST_THREADS)
    assert spec.speculative_config()["method"] == "draft_model"
    scheduler = scheduler_of(engines.get(spec))
    for policy in ("goodput", "static:3"):
        cost_model = CostModel.default()
        scheduler.use_controller(SpecController(make_policy(policy, cost_model), cost_model))
        outputs = engines.get(spec).generate(list(PROMPTS_USED), sampling(len(PROMPTS_USED), MAX_TOKENS))
        assert [list(o.outputs[0].token_ids) for o in outputs] == reference, policy
        stats = scheduler.controller.stats
        assert stats.drafted > 0 and stats.accepted > 0, f"{policy}: the draft model never drafted"
