"""Recording acceptance traces from real models (needs torch; imported lazily by the CLI).

1. Generate each prompt's output with the engine (`SpecEngine`, by default with the draft and
   `static:2`: speculative decoding is exact, so the output has the target's law, only faster).
2. Teacher-force the target and the draft once over prompt + output (one full forward each, no
   cache) to get the logits at every generated position; process both with the request's sampling
   settings through `process_logits` (the engine's transforms; each position with its own prefix
   for the repetition penalty).
3. Per generated position with emitted token x: ``accept_prob = min(target(x), draft(x)) / target(x)``
   (greedy: 1.0 iff the draft's processed argmax is x), ``draft_confidence`` = the draft's top raw
   softmax probability. For the n-gram drafter: accept_prob = 1.0 iff
   ``NgramDrafter().lookup(context so far, 1)`` proposes x (multi-token n-gram continuations are
   approximated by these per-position lookups), draft_confidence = 1.0.

A full forward rounds differently from the engine's cached forwards, so at a near-tie a greedy
target may prefer another token than the one emitted, or target(x) may come out 0 under top-p/top-k; such
positions are counted in the metadata (``teacher_forcing_mismatches``) and get accept_prob 0 when
target(x) = 0.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from ..engine import SpecEngine
from ..modeling.drafters import NgramDrafter
from ..sampling.params import SamplingParams
from ..sampling.transforms import RowSettings, process_logits
from .trace_file import Trace, make_trace

__all__ = ["record_trace", "position_stats"]


def _settings(params: SamplingParams, rows: int) -> RowSettings:
    full = lambda value, dtype: torch.full((rows,), value, dtype=dtype)  # noqa: E731
    return RowSettings(full(params.temperature, torch.float32), full(params.top_k, torch.long),
                       full(params.top_p, torch.float32), full(params.min_p, torch.float32),
                       full(params.repetition_penalty, torch.float32))


def _seen(prompt: Sequence[int], output: Sequence[int], vocab: int, params: SamplingParams) -> torch.Tensor | None:
    if params.repetition_penalty == 1:
        return None
    n = len(output)
    seen = torch.zeros(n, vocab, dtype=torch.bool)
    seen[:, torch.as_tensor(list(prompt))] = True
    for j in range(1, n):
        seen[j] = seen[j - 1]
        seen[j, output[j - 1]] = True
    return seen


@torch.no_grad()
def _logits(model: torch.nn.Module, prompt: Sequence[int], output: Sequence[int]) -> torch.Tensor:
    ids = torch.as_tensor([list(prompt) + list(output)])
    logits = model(input_ids=ids).logits[0]
    return logits[len(prompt) - 1 : len(prompt) + len(output) - 1].float()  # row j predicts output[j]


@torch.no_grad()
def position_stats(target: torch.nn.Module, draft, prompt: Sequence[int], output: Sequence[int],
                   params: SamplingParams) -> dict:
    """accept_prob and draft_confidence at every generated position of one request."""
    n = len(output)
    emitted = torch.as_tensor(list(output))
    target_logits = _logits(target, prompt, output)
    vocab = target_logits.shape[-1]
    seen = _seen(prompt, output, vocab, params)
    settings = _settings(params, n)
    target_probs, _ = process_logits(target_logits, settings, seen)
    target_at_emitted = target_probs[torch.arange(n), emitted]
    mismatches = (int((target_probs.argmax(-1) != emitted).sum()) if params.greedy
                  else int((target_at_emitted <= 0).sum()))
    if isinstance(draft, NgramDrafter):
        context = list(prompt)
        accept = []
        for token in output:
            accept.append(1.0 if draft.lookup(context, 1) == [int(token)] else 0.0)
            context.append(int(token))
        return {"accept_prob": accept, "draft_confidence": [1.0] * n, "mismatches": mismatches}
    draft_logits = _logits(draft, prompt, output)[:, :vocab]
    draft_probs, _ = process_logits(draft_logits, settings, seen)
    if params.greedy:
        accept = (draft_probs.argmax(-1) == emitted).double()
    else:
        draft_at_emitted = draft_probs[torch.arange(n), emitted]
        accept = torch.where(target_at_emitted > 0,
                             torch.minimum(target_at_emitted, draft_at_emitted) / target_at_emitted.clamp_min(1e-30),
                             torch.zeros_like(target_at_emitted)).double()
    confidence = torch.softmax(draft_logits, dim=-1).amax(-1).double()
    return {"accept_prob": accept.clamp(0, 1).tolist(), "draft_confidence": confidence.clamp(0, 1).tolist(),
            "mismatches": mismatches}


def record_trace(target: torch.nn.Module, draft, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                 prompt_ids: Sequence[str], meta: dict, *, policy: str = "static:2", max_batch_size: int = 4,
                 seed: int = 0, progress=None) -> Trace:
    """Generate with the engine, then teacher-force both models; returns a `Trace` (not saved)."""
    if draft is None:
        raise ValueError("recording a trace needs a draft model or the 'ngram' drafter (got --draft none)")
    started = time.perf_counter()
    engine = SpecEngine(target, draft, policy=policy, max_batch_size=max_batch_size, seed=seed)
    results = engine.generate([list(p) for p in prompts], list(params))
    generate_seconds = time.perf_counter() - started
    requests, mismatches = [], 0
    for index, (prompt, result, p, pid) in enumerate(zip(prompts, results, params, prompt_ids)):
        if result.error:
            raise ValueError(f"prompt {pid!r} failed to generate: {result.error}")
        stats = position_stats(target, draft, prompt, result.token_ids, p)
        mismatches += stats["mismatches"]
        requests.append({"prompt_id": pid, "prompt_length": len(prompt), "tokens": result.token_ids,
                         "accept_prob": stats["accept_prob"], "draft_confidence": stats["draft_confidence"]})
        if progress:
            progress(index + 1, len(prompts))
    first = params[0]
    full_meta = {
        "drafter": "ngram" if isinstance(draft, NgramDrafter) else "model",
        "dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
        "sampling": {"temperature": first.temperature, "top_k": first.top_k, "top_p": first.top_p,
                     "min_p": first.min_p, "repetition_penalty": first.repetition_penalty,
                     "max_new_tokens": first.max_new_tokens, "seed": seed,
                     "stop_token_ids": list(first.stop_token_ids)},
        "generation": {"engine_policy": policy, "max_batch_size": max_batch_size,
                       "seconds": round(generate_seconds, 2)},
        "teacher_forcing_mismatches": mismatches,
        "recording_seconds": round(time.perf_counter() - started, 2),
        **meta,
    }
    return make_trace(requests, full_meta)
