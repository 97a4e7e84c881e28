"""Float32 Linear layers on CPU through oneDNN instead of torch's default BLAS.

Why: torch's CPU build multiplies float32 matrices with MKL, and on the AMD EPYC machines this
project runs on MKL's small-M GEMM path is slow: a target forward over 2 query tokens cost 2x one
token and 9 tokens 3-4x, and a multi-token verify is what speculative decoding lives on. oneDNN's
matmul, which torch also ships, is used here with the weights where they are (no packing, no copy).
Side by side (Qwen2.5-Coder-1.5B, fp32, batch 1, 128 cached tokens, 2 threads; `adaptive-spec
profile linear`), ms for 1 / 2 / 9 query tokens: torch 503 / 1061 / 1810, oneDNN 421 / 730 / 790;
in earlier runs the same day (plain HF forwards): torch 411-496 / 866-994 / 1233-1630, oneDNN
259-311 / 469-666 / 607-680.

`use_onednn_linears(model)` switches every plain float32 `nn.Linear` on CPU to `OneDNNLinear`, a
subclass that only overrides `forward` (state dicts, `isinstance` and parameter counts are
unchanged); `use_torch_linears(model)` switches back. A layer falls back to `F.linear` for anything
oneDNN is not used for here (gradients, another device or dtype). The kernel changes rounding, not
the model: outputs are still exactly those of the model as it computes. (Like torch's kernel, it
rounds a 1-row call differently from a multi-row one, by about 2e-4 on these layers' outputs, so
greedy decoding by 1-token steps and by k-token verifies can part at near-ties, as before.)

`torch.ops.mkldnn._linear_pointwise` is a private op (torch's CPU inference compiler uses it); it is
probed once against `F.linear`, and where it is missing or disagrees nothing is switched.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

KERNELS = ("onednn", "torch")


class OneDNNLinear(torch.nn.Linear):
    """nn.Linear whose float32 CPU inference runs oneDNN's matmul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if x.requires_grad or weight.requires_grad and torch.is_grad_enabled() or x.device.type != "cpu" \
                or x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            return F.linear(x, weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, self.bias, "none", [], "")


@functools.cache
def onednn_available() -> bool:
    """Whether oneDNN's linear op exists here and agrees with F.linear on a probe."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        generator = torch.Generator().manual_seed(0)
        weight, bias = torch.randn(48, 40, generator=generator), torch.randn(48, generator=generator)
        x = torch.randn(3, 5, 40, generator=generator)
        got = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return bool(torch.allclose(got, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4))
    except (AttributeError, RuntimeError):
        return False


def use_onednn_linears(model: torch.nn.Module) -> int:
    """Switch `model`'s plain float32 CPU Linear layers to oneDNN; returns how many were switched
    (0 where oneDNN is unavailable). Subclasses of nn.Linear other than ours are left alone."""
    if not onednn_available():
        return 0
    switched = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32 \
                and module.weight.device.type == "cpu":
            module.__class__ = OneDNNLinear
            switched += 1
    return switched


def use_torch_linears(model: torch.nn.Module) -> int:
    """Undo `use_onednn_linears`; returns how many layers were switched back."""
    switched = 0
    for module in model.modules():
        if type(module) is OneDNNLinear:
            module.__class__ = torch.nn.Linear
            switched += 1
    return switched


def set_linear_kernel(model: torch.nn.Module, kernel: str) -> torch.nn.Module:
    """Apply `kernel` ("onednn" or "torch") to `model` in place and return it."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown linear kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    (use_onednn_linears if kernel == "onednn" else use_torch_linears)(model)
    return model


def linear_kernel(model: torch.nn.Module) -> str:
    """What runs the model's Linear layers: "onednn", "int8-dynamic" or "torch"."""
    kinds = {type(m) for m in model.modules()}
    if OneDNNLinear in kinds:
        return "onednn"
    if any(issubclass(kind, torch.ao.nn.quantized.dynamic.Linear) for kind in kinds):
        return "int8-dynamic"
    return "torch"


__all__ = ["KERNELS", "OneDNNLinear", "linear_kernel", "onednn_available", "set_linear_kernel",
           "use_onednn_linears", "use_torch_linears"]
