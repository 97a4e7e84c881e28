"""oneDNN Linear layers on CPU (`modeling/cpu_linear.py`): same model, same outputs up to rounding,
exact speculative decoding on top, and the kernel in profiles."""

from __future__ import annotations

import copy

import pytest
import torch

from adaptive_spec import SamplingParams, SpecEngine
from adaptive_spec.modeling.cpu_linear import (
    OneDNNLinear,
    linear_kernel,
    onednn_available,
    set_linear_kernel,
    use_onednn_linears,
    use_torch_linears,
)
from adaptive_spec.modeling.loading import quantize_int8
from adaptive_spec.profiling.profile_file import check_fingerprint, model_fingerprint

from conftest import tiny_lm

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no usable oneDNN linear")


def onednn_copy(model):
    fast = copy.deepcopy(model)
    assert use_onednn_linears(fast) == sum(type(m) is torch.nn.Linear for m in model.modules()) > 0
    return fast


def test_switching_keeps_the_model_and_its_outputs():
    model = tiny_lm(3, vocab=64)
    fast = onednn_copy(model)
    assert linear_kernel(model) == "torch" and linear_kernel(fast) == "onednn"
    assert all(isinstance(m, torch.nn.Linear) for m in fast.modules() if isinstance(m, OneDNNLinear))
    assert fast.state_dict().keys() == model.state_dict().keys()
    ids = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = fast(ids).logits, model(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert use_torch_linears(fast) > 0 and linear_kernel(fast) == "torch"


def test_gradients_and_other_dtypes_fall_back_to_torch():
    layer = torch.nn.Linear(8, 4)
    reference = copy.deepcopy(layer)
    use_onednn_linears(layer)
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    with torch.no_grad():
        half = x.detach().double()
        torch.testing.assert_close(layer.double()(half), reference.double()(half))


def test_int8_and_bfloat16_layers_are_left_alone():
    quantized = quantize_int8(tiny_lm(4, vocab=64))
    assert use_onednn_linears(quantized) == 0 and linear_kernel(quantized) == "int8-dynamic"
    assert use_onednn_linears(tiny_lm(4, vocab=64).to(torch.bfloat16)) == 0


def test_unknown_kernel_is_refused_by_name():
    with pytest.raises(ValueError, match="linear kernel 'mkl'"):
        set_linear_kernel(tiny_lm(4), "mkl")


@pytest.mark.parametrize("k", [1, 3, 6])
def test_speculative_greedy_on_onednn_layers_equals_plain_decoding_on_them(k):
    target, draft = onednn_copy(tiny_lm(10, vocab=64)), onednn_copy(tiny_lm(11, vocab=64))
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11], [12], [30, 31, 30, 31, 30]]
    expected = []
    for prompt in prompts:
        out = target.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)
        expected.append(out[0, len(prompt):].tolist())
    results = SpecEngine(target, draft, policy=f"static:{k}").generate(prompts, SamplingParams(temperature=0, max_new_tokens=20))
    assert [r.token_ids for r in results] == expected
    assert max(max(r.stats.k_per_step, default=0) for r in results) == k, "the drafts of length k did not run"


def test_profiles_record_the_kernel_and_older_profiles_read_as_torch():
    model = tiny_lm(5, vocab=64)
    fast = onednn_copy(model)
    assert model_fingerprint(model)["linear_kernel"] == "torch"
    assert model_fingerprint(fast)["linear_kernel"] == "onednn"
    old = model_fingerprint(model)
    del old["linear_kernel"]  # a profile written before the field existed
    profile = {"fingerprint": {"models": {"target": old}}}
    assert check_fingerprint(profile, {"models": {"target": model_fingerprint(model)}}) == []
    with pytest.warns(Warning, match="linear_kernel: profile 'torch', here 'onednn'"):
        check_fingerprint(profile, {"models": {"target": model_fingerprint(fast)}})
