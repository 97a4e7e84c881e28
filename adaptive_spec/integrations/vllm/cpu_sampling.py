"""vLLM 0.32 on CPU: sampled speculation made exact again by a float-preserving expand.

vLLM's rejection sampler expands each request's temperature, top-k and top-p to its draft tokens
with `expand_batch_to_tokens`. On CPU that calls a C++ kernel through a wrapper
(`vllm/utils/cpu_triton_utils.py::_expand_kernel_impl`) that passes every tensor through an int64
conversion: for a float32 (or int32) output the kernel writes into a temporary int64 copy that is
thrown away, so the sampler divides the target's logits by uninitialised memory. Greedy batches
never expand, which is why greedy outputs stay right. Measured: with vLLM's own static k at
temperature 0.7 the speculative engine wrote garbled text and accepted 5-6% of drafts (67% greedy).

`install()` replaces the sampler's `expand_batch_to_tokens` by the same operation in plain torch
(`repeat_interleave`), which keeps the input's dtype. Only on CPU, only under the tested vLLM
versions; loaded by the plug-in entry point in every vLLM process, like `lazy_draft`.
"""

from __future__ import annotations

_state: dict = {}


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
    """[batch] -> [num_tokens]: x[i] repeated for request i's tokens (`cu_num_tokens` is cumulative);
    values equal to `replace_from` become `replace_to`, as vLLM's kernel does."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    expanded = torch.repeat_interleave(x, counts, output_size=num_tokens)
    if replace_from != replace_to:
        expanded = torch.where(expanded == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), expanded)
    return expanded


def install() -> bool:
    """Patch the rejection sampler (idempotent). False off CPU or under an untested vLLM."""
    from .fence import tested_vllm_installed

    if not tested_vllm_installed():
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.v1.sample import rejection_sampler

    if "original" not in _state:
        _state["original"] = rejection_sampler.expand_batch_to_tokens
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    return True


def uninstall() -> None:
    """Restore vLLM's own expand (tests use it as the negative control)."""
    if "original" in _state:
        from vllm.v1.sample import rejection_sampler

        rejection_sampler.expand_batch_to_tokens = _state["original"]


def installed() -> bool:
    try:
        from vllm.v1.sample import rejection_sampler
    except ImportError:
        return False
    return rejection_sampler.expand_batch_to_tokens is expand_batch_to_tokens
