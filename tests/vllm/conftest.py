"""vLLM test fixtures: one engine alive at a time, and plain-vLLM reference outputs cached per session.

These tests run in the second environment (`scripts/setup.sh --vllm` builds .venv-vllm); modules that
need vLLM skip themselves where it is not importable. Engines use one unbound compute thread: other
work may share the cores, and vLLM's spinning thread barriers stall badly when it does.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap

import pytest

os.environ.setdefault("NUMBA_NUM_THREADS", "1")  # read when numba loads, before any engine starts

from vllm_cases import TEST_THREADS, sampling


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

    def reference(self, target: str, prompts: tuple[str, ...], max_tokens: int,
                  temperature: float = 0.0, seeds: tuple[int, ...] | None = None,
                  in_child: bool = False) -> list[list[int]]:
        """Token ids from vLLM with no speculative decoding at all (cached per session). `in_child`:
        computed in a child process, so a large model's memory is surely returned before the next
        engine loads (memory freed inside this process is not all given back)."""
        from adaptive_spec.integrations.vllm.engine import EngineSpec

        key = (target, prompts, max_tokens, temperature, seeds)
        if key not in self.references and in_child:
            self.references[key] = greedy_in_child(target, prompts, max_tokens)
        if key not in self.references:
            spec = EngineSpec(target, drafter=None, threads=TEST_THREADS)
            llm = self.get(spec)
            assert "speculative_config" not in spec.llm_kwargs()
            outputs = llm.generate(list(prompts), sampling(len(prompts), max_tokens, temperature, seeds))
            self.references[key] = [list(o.outputs[0].token_ids) for o in outputs]
        return self.references[key]


def greedy_in_child(target: str, prompts: tuple[str, ...], max_tokens: int) -> list[list[int]]:
    code = textwrap.dedent(f"""
        import json, sys
        from vllm import SamplingParams
        from adaptive_spec.integrations.vllm.engine import EngineSpec, make_llm
        if __name__ == "__main__":
            llm = make_llm(EngineSpec({target!r}, drafter=None, threads={TEST_THREADS}))
            outputs = llm.generate(json.loads(sys.stdin.read()), SamplingParams(temperature=0, max_tokens={max_tokens}))
            print("REFERENCE", json.dumps([list(o.outputs[0].token_ids) for o in outputs]))
    """)
    result = subprocess.run([sys.executable, "-c", code], input=json.dumps(list(prompts)), capture_output=True,
                            text=True, timeout=900)
    lines = [line for line in result.stdout.splitlines() if line.startswith("REFERENCE ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    return json.loads(lines[-1][len("REFERENCE "):])


@pytest.fixture(scope="session")
def engines():
    pool = EnginePool()
    yield pool
    pool.close()
