"""Build a target and a drafter from names, with a precision per model.

Precisions: "float32" (the exact default), "bfloat16", and "int8" (dynamic int8 quantisation of
every Linear layer, CPU only, meant for the draft). bf16 and int8 change the numerics: a k-token
verification pass rounds differently from a 1-token pass, so greedy output may differ from plain
fp32 decoding at near-ties. They never change the sampling law: the engine still emits exactly the
distribution of the (bf16 or int8) target it runs.

Float32 models on CPU run their Linear layers through oneDNN by default (`cpu_linear.py`: about
1.6x faster per decoded token and 2x per multi-token verify than torch's default BLAS on the CPUs
measured); `cpu_linear="torch"` keeps torch's own kernel.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..assets import check_tokenizers_compatible, get_pair, load_model_and_tokenizer
from .cpu_linear import KERNELS, set_linear_kernel
from .drafters import Drafter, NgramDrafter

PRECISIONS = ("float32", "bfloat16", "int8")


@dataclass
class LoadedPair:
    target: torch.nn.Module
    draft: torch.nn.Module | Drafter | None  # what SpecEngine takes: a draft model, a drafter, or None
    tokenizer: object  # the target's tokenizer; the draft is fed the same ids
    target_name: str
    draft_name: str  # a model name, "ngram" or "none"

    @property
    def draft_model(self) -> torch.nn.Module | None:
        return self.draft if isinstance(self.draft, torch.nn.Module) else None


def load_model(name: str, precision: str = "float32", progress: bool = True, cpu_linear: str = "onednn"):
    """(model, tokenizer) for a registry name, local directory or hub id, in `precision`, its float32
    Linear layers run by `cpu_linear` ("onednn" or "torch")."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if cpu_linear not in KERNELS:
        raise ValueError(f"unknown linear kernel {cpu_linear!r}; choose one of {', '.join(KERNELS)}")
    model, tokenizer = load_model_and_tokenizer(name, dtype="bfloat16" if precision == "bfloat16" else "float32",
                                                progress=progress)
    if precision == "int8":
        model = quantize_int8(model)
    return set_linear_kernel(model, cpu_linear).eval(), tokenizer


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Dynamic int8 quantisation of every Linear layer (CPU). torch 2.13 marks `torch.ao.quantization`
    and the quantised-tensor constructors deprecated (their successor lives in the separate torchao
    package) but still ships them; the project pins torch, so the warnings are silenced here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*", category=UserWarning)
        warnings.filterwarnings("ignore", message=".*torch.ao.quantization.*", category=DeprecationWarning)
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


def load_pair(
    pair: str | None = None,
    target: str | None = None,
    draft: str | None = None,
    target_precision: str = "float32",
    draft_precision: str = "float32",
    progress: bool = True,
    cpu_linear: str = "onednn",
) -> LoadedPair:
    """Load a named pair, or a target with a draft model name, "ngram" or "none".

    Tokenizer compatibility between two models is checked, not assumed.
    """
    if pair is not None:
        named = get_pair(pair)
        target, draft = target or named.target, draft or named.draft
    if target is None:
        raise ValueError("name a pair or a target model")
    draft = draft or "none"
    target_model, tokenizer = load_model(target, target_precision, progress, cpu_linear)
    if draft == "none":
        draft_part = None
    elif draft == "ngram":
        draft_part = NgramDrafter()
    else:
        draft_part, draft_tokenizer = load_model(draft, draft_precision, progress, cpu_linear)
        check_tokenizers_compatible(tokenizer, draft_tokenizer)
    return LoadedPair(target_model, draft_part, tokenizer, target, draft)
