"""Which Linear kernel runs a model faster on this machine: oneDNN or torch's default, side by side.

    adaptive-spec profile linear --pair qwen-coder --query-tokens 1,2,4,9

Times one target forward of q query tokens over a cache of `context` tokens (the engine's own
`RaggedKV` path, as a verify step runs it) with each kernel, alternating kernels round by round in
one process so that both see the same machine state, and prints the median milliseconds and the
ratio torch / oneDNN per q (above 1: oneDNN is faster). The choice is `--cpu-linear` on every
command; oneDNN is the default because on the AMD EPYC machines this project was measured on it was
faster at every q (see `modeling/cpu_linear.py`); on other CPUs, check with this.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..modeling.cpu_linear import set_linear_kernel
from .profiler import _filled_kv, _time_forward, _vocab


def compare_linear_kernels(model: torch.nn.Module, query_tokens: Sequence[int], context: int = 128, batch: int = 1,
                           rounds: int = 5, seed: int = 0) -> list[dict]:  # fmt: skip
    """Per q: median seconds of a forward with each kernel and their ratio; leaves the model on oneDNN."""
    generator = torch.Generator().manual_seed(seed)
    kv = _filled_kv(model, batch, context, "random", generator)
    vocab = _vocab(model)
    samples: dict[tuple[str, int], list[float]] = {}
    for round_ in range(rounds + 1):  # round 0 warms both kernels up and is not kept
        for kernel in ("torch", "onednn") if round_ % 2 else ("onednn", "torch"):
            set_linear_kernel(model, kernel)
            for q in query_tokens:
                tokens = torch.randint(0, vocab, (batch, q), generator=generator)
                seconds = _time_forward(kv, tokens, logits_to_keep=q)
                if round_:
                    samples.setdefault((kernel, q), []).append(seconds)
    set_linear_kernel(model, "onednn")
    rows = []
    for q in query_tokens:
        torch_s, onednn_s = (float(np.median(samples[(kernel, q)])) for kernel in ("torch", "onednn"))
        rows.append({"query_tokens": q, "torch_ms": round(torch_s * 1e3, 1), "onednn_ms": round(onednn_s * 1e3, 1),
                     "torch_over_onednn": round(torch_s / onednn_s, 3)})
    return rows
