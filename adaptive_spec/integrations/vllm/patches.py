"""What this project changes inside vLLM's processes, installed by vLLM's plug-in entry point
(`vllm.general_plugins`, loaded in every vLLM process, workers included) and by `engine.make_llm`.

- `lazy_draft`: a step at k = 0 skips the draft model (only under this project's scheduler);
- `cpu_sampling`: on CPU, the rejection sampler expands sampling parameters without losing floats.
Both are version-fenced and do nothing under an untested vLLM.
"""

from __future__ import annotations


def install() -> None:
    from . import cpu_sampling, lazy_draft

    lazy_draft.install()
    cpu_sampling.install()
