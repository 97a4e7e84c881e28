"""Building a vLLM engine for this project's models: paths, speculative config, CPU-friendly settings.

Public vLLM entry points only (`vllm.LLM`, engine arguments); the internals stay in `scheduler.py`.
The settings here are the ones measured to work on a small CPU machine: eager mode, the engine core
in this process (so the scheduler plug-in can be reached), an explicit KV cache size in GiB instead
of a fraction of RAM, and float32 weights (greedy outputs then match plain decoding exactly).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ...assets import get_pair, resolve_model
from .controller import ControllerSettings

SCHEDULER_CLASS = "adaptive_spec.integrations.vllm.AdaptiveScheduler"


@dataclass(frozen=True)
class EngineSpec:
    """One vLLM engine: target, drafter ('ngram', a model name or directory, or None) and limits."""

    target: str
    drafter: str | None = None
    max_k: int = 6  # num_speculative_tokens: vLLM's cap on any k
    adaptive: bool = True  # run our scheduler plug-in
    settings: ControllerSettings = field(default_factory=ControllerSettings)
    dtype: str = "float32"
    max_model_len: int = 2048
    max_num_seqs: int = 16
    kv_cache_gib: int = 1
    seed: int = 0
    # None: vLLM binds its compute threads to the cores itself (fastest on a quiet machine). A number:
    # that many unbound threads; use 1 where other work shares the cores, because vLLM's spinning
    # thread barriers then stall (measured 14x slower with 2 threads next to one busy process).
    threads: int | None = None
    prefix_caching: bool = True

    @classmethod
    def for_pair(cls, pair: str, **options) -> "EngineSpec":
        named = get_pair(pair)
        return cls(target=named.target, drafter=named.draft, **options)

    def speculative_config(self) -> dict | None:
        if self.drafter is None or self.max_k == 0:
            return None
        if self.drafter == "ngram":
            return {"method": "ngram", "num_speculative_tokens": self.max_k,
                    "prompt_lookup_min": 2, "prompt_lookup_max": 5}
        return {"method": "draft_model", "model": resolve_model(self.drafter, progress=False),
                "num_speculative_tokens": self.max_k}

    def llm_kwargs(self) -> dict:
        kwargs = dict(model=resolve_model(self.target, progress=False), dtype=self.dtype, enforce_eager=True,
                      max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs, seed=self.seed,
                      async_scheduling=False, enable_prefix_caching=self.prefix_caching)
        spec = self.speculative_config()
        if spec is not None:
            kwargs["speculative_config"] = spec
            if self.adaptive:
                kwargs["scheduler_cls"] = SCHEDULER_CLASS
        return kwargs

    def environment(self) -> dict[str, str]:
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib)}
        if self.threads is not None:
            env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(self.threads),
                       NUMBA_NUM_THREADS=str(self.threads))  # the n-gram drafter's parallel loops
        return {**env, **self.settings.environment()}


def make_llm(spec: EngineSpec):
    """A `vllm.LLM` for `spec` in this process. Call under `if __name__ == "__main__":` in scripts:
    vLLM may spawn workers that re-import the main module."""
    os.environ.update(spec.environment())
    if spec.threads is not None:  # torch may be loaded already, after its thread count was read
        import torch

        torch.set_num_threads(spec.threads)
    from vllm import LLM

    from .patches import install

    install()  # also loaded by vLLM's plug-in entry point; here too, for an environment without it

    return LLM(**spec.llm_kwargs())
