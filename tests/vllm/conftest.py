"""vLLM test fixtures: one engine alive at a time, and plain-vLLM reference outputs cached per session.

These tests run in the second environment (`scripts/setup.sh --vllm` builds .venv-vllm); modules that
need vLLM skip themselves where it is not importable. Engines use one unbound compute thread: other
work may share the cores, and vLLM's spinning thread barriers stall badly when it does.
"""

from __future__ import annotations

import gc

import pytest

TEST_THREADS = 1
SMALL_MODEL = "smollm2-135m-instruct"  # the fastest registered model; n-gram drafting needs no partner

PROMPTS = {
    "code": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "prose": "Write a short poem about autumn leaves falling.",
    "repeat": ("Copy the text exactly.\nText: one two three four five six seven eight nine ten eleven twelve\n"
               "Copy: one two three four five six seven eight nine ten eleven twelve\nCopy:"),
    "list": "Repeat this list three times: apple, banana, cherry, date, elderberry, fig, grape.",
}


class EnginePool:
    """Holds at most one vLLM engine: asking for another spec closes the current one first."""

    def __init__(self):
        self.spec = None
        self.llm = None
        self.references: dict = {}

    def get(self, spec):
        from adaptive_spec.integrations.vllm.engine import make_llm

        if spec != self.spec:
            self.close()
            self.llm, self.spec = make_llm(spec), spec
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            self.llm = self.spec = None
            gc.collect()

    def reference(self, target: str, prompts: tuple[str, ...], max_tokens: int) -> list[list[int]]:
        """Greedy token ids from vLLM with no speculative decoding at all (cached per session)."""
        from vllm import SamplingParams

        from adaptive_spec.integrations.vllm.engine import EngineSpec

        key = (target, prompts, max_tokens)
        if key not in self.references:
            spec = EngineSpec(target, drafter=None, threads=TEST_THREADS)
            llm = self.get(spec)
            assert "speculative_config" not in spec.llm_kwargs()
            outputs = llm.generate(list(prompts), SamplingParams(temperature=0, max_tokens=max_tokens))
            self.references[key] = [list(o.outputs[0].token_ids) for o in outputs]
        return self.references[key]


@pytest.fixture(scope="session")
def engines():
    pool = EnginePool()
    yield pool
    pool.close()
