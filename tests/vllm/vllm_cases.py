"""What the vLLM tests share: prompts, the small model, and whether vLLM is really importable."""

from __future__ import annotations

import importlib.util
from collections import Counter

import pytest


def require_vllm() -> None:
    """Skip the calling module unless vLLM is installed. (This folder is named like the package, so a
    bare `import vllm` can find the folder itself as a namespace package where vLLM is absent.)"""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin in (None, "namespace"):
        pytest.skip("vLLM is not installed here (scripts/setup.sh --vllm builds .venv-vllm)", allow_module_level=True)


TEST_THREADS = 1
SMALL_MODEL = "smollm2-135m-instruct"  # the fastest registered model; n-gram drafting needs no partner

PROMPTS = {
    "code": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "prose": "Write a short poem about autumn leaves falling.",
    "repeat": ("Copy the text exactly.\nText: one two three four five six seven eight nine ten eleven twelve\n"
               "Copy: one two three four five six seven eight nine ten eleven twelve\nCopy:"),
    "list": "Repeat this list three times: apple, banana, cherry, date, elderberry, fig, grape.",
}


def sampling(count: int, max_tokens: int, temperature: float = 0.0, seeds: tuple[int, ...] | None = None):
    from vllm import SamplingParams

    if seeds is None:
        return SamplingParams(temperature=temperature, max_tokens=max_tokens)
    return [SamplingParams(temperature=temperature, top_p=0.95, max_tokens=max_tokens, seed=seed) for seed in seeds]


def p_value(first: Counter, second: Counter) -> float:
    """Chi-square homogeneity; categories with fewer than 10 draws over both samples are pooled."""
    common = [key for key in first.keys() | second.keys() if first[key] + second[key] >= 10]
    table = [[counts[key] for key in common] + [sum(counts.values()) - sum(counts[key] for key in common)]
             for counts in (first, second)]
    if table[0][-1] + table[1][-1] == 0:
        table = [row[:-1] for row in table]
    assert len(table[0]) >= 3, "too few categories for the test to mean anything"
    from scipy.stats import chi2_contingency

    return chi2_contingency(table)[1]
