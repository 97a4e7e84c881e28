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

It also replaces `sample_recovered_tokens`, which in every sampled step of a speculative engine
draws exponential noise over the whole [batch, vocabulary], though only rows with drafts read it:
on the 2-core CPU, 41-43 ms a step at batch 8 (Qwen's 151,936 tokens), about 5% of a step, paid
even in steps where no row drafts. The replacement draws it for the rows with drafts alone (each
from its request's generator where it has one, as vLLM does) and skips a step without drafts.
Each drafted row's noise is still independent Exp(1), so the recovered tokens keep their law;
seeded requests draw exactly what vLLM draws for them.
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


def sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
                            target_probs, sampling_metadata, device, use_fp64_gumbel=False):
    """vLLM's `sample_recovered_tokens`, with noise only for the rows that drafted (see above)."""
    import torch

    from vllm.v1.sample import rejection_sampler

    recovered = torch.empty_like(draft_token_ids)
    if not any(num_draft_tokens):
        return recovered
    q = torch.ones((len(num_draft_tokens), target_probs.shape[-1]),
                   dtype=torch.float64 if use_fp64_gumbel else torch.float32, device=device)
    generators = sampling_metadata.generators
    for row, drafted in enumerate(num_draft_tokens):
        if drafted > 0:
            q[row].exponential_(generator=generators.get(row))
    rejection_sampler._sample_recovered_tokens(recovered, cu_num_draft_tokens, draft_token_ids, draft_probs,
                                               target_probs, q.reciprocal(), max_spec_len=max_spec_len)
    return recovered


_PATCHED = {"expand_batch_to_tokens": expand_batch_to_tokens, "sample_recovered_tokens": sample_recovered_tokens}


def install() -> bool:
    """Patch the rejection sampler (idempotent). False off CPU or under an untested vLLM."""
    from .fence import tested_vllm_installed

    if not tested_vllm_installed():
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.v1.sample import rejection_sampler

    if "originals" not in _state:
        _state["originals"] = {name: getattr(rejection_sampler, name) for name in _PATCHED}
    for name, replacement in _PATCHED.items():
        setattr(rejection_sampler, name, replacement)
    return True


def uninstall() -> None:
    """Restore vLLM's own functions (tests use them as the negative control)."""
    if "originals" in _state:
        from vllm.v1.sample import rejection_sampler

        for name, original in _state["originals"].items():
            setattr(rejection_sampler, name, original)


def installed() -> bool:
    try:
        from vllm.v1.sample import rejection_sampler
    except ImportError:
        return False
    return all(getattr(rejection_sampler, name) is replacement for name, replacement in _PATCHED.items())
