"""Measure what model forwards and engine steps cost on this machine, and write a profile.

How the timings are taken (everything the cost model reads comes from here):

* Target forwards: for each (batch, context) a `RaggedKV` (the engine's only way of running a
  model) holds a cache of `context` slots for `batch` rows; then for each number of query tokens q
  one `RaggedKV.forward` of a dense [batch, q] block with ``logits_to_keep=0`` (the verify forward
  keeps every position's logits), timed with the clock read after a device synchronisation on GPUs.
  After each sample the cache is cut back to `context` slots, so every sample sees the same cache.
* Draft forwards: the same with ``logits_to_keep=1`` (the draft keeps only the last position) for
  q in ``draft_query_tokens`` (1 = one drafted token, 2 = a catch-up of the previous step's
  recovered and bonus tokens).
* The cache is filled with random keys and values by default (``cache_fill="random"``): latency
  does not depend on the values, and a real prefill of 8 x 2048 tokens would cost minutes on a CPU.
  ``cache_fill="prefill"`` runs a real prefill of random tokens instead.
* Warm-up: a few probe forwards per model before anything is timed (they also calibrate the
  up-front time estimate), one untimed forward on every new cache, and ``warmup`` untimed
  forwards per cell. Then ``repeats`` timed forwards per cell; the profile keeps every sample, the
  median and the interquartile range, and warns where IQR / median > ``spread_warn``.
* Engine overhead: real `SpecEngine` steps (static policy, K in ``overhead_ks``, default sampling
  settings, random prompts) with *stand-in* models: one-layer, 64-wide models with the profiled
  models' vocabulary, on the same device and dtype. Forward hooks time every model forward inside
  each step (with synchronisation on GPUs); what is left of the step's draft phase, verify phase
  and remainder is the overhead (sampling over the vocabulary, the accept test, bookkeeping),
  which depends on batch size, K and vocabulary, not on depth. Not captured: the occasional cache
  compaction, whose cost grows with the real model's cache; the online correction absorbs it.
* Random weights: `resolve_config` / `random_model` build a model from a config alone (a named
  architecture, a config.json, or inline JSON), so large architectures can be profiled where
  their weights are absent.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..modeling.kv import RaggedKV
from .profile_file import FORMAT, SCHEMA_VERSION, machine_fingerprint, model_fingerprint

__all__ = [
    "NAMED_ARCHITECTURES",
    "ProfileSettings",
    "QUICK_SETTINGS",
    "profile_models",
    "resolve_config",
    "random_model",
    "load_pretrained",
    "estimate_seconds",
]

# Public config values of the Qwen2.5 family, from each model's config.json on the Hugging Face
# hub (Qwen/Qwen2.5-{0.5B,1.5B,3B,7B,14B,32B,72B}); the Instruct and Coder variants of a size
# share the architecture. Fields not listed take the transformers Qwen2Config defaults.
_QWEN_COMMON = {"model_type": "qwen2", "hidden_act": "silu", "rope_theta": 1000000.0,
                "max_position_embeddings": 32768, "use_sliding_window": False}  # fmt: skip
NAMED_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {**_QWEN_COMMON, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True, "rms_norm_eps": 1e-6},
    "qwen2.5-1.5b": {**_QWEN_COMMON, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True, "rms_norm_eps": 1e-6},
    "qwen2.5-3b": {**_QWEN_COMMON, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                   "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936,
                   "tie_word_embeddings": True, "rms_norm_eps": 1e-6},
    "qwen2.5-7b": {**_QWEN_COMMON, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                   "tie_word_embeddings": False, "rms_norm_eps": 1e-6},
    "qwen2.5-14b": {**_QWEN_COMMON, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48,
                    "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
                    "tie_word_embeddings": False, "rms_norm_eps": 1e-5},
    "qwen2.5-32b": {**_QWEN_COMMON, "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
                    "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
                    "tie_word_embeddings": False, "rms_norm_eps": 1e-5},
    "qwen2.5-72b": {**_QWEN_COMMON, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 152064,
                    "tie_word_embeddings": False, "rms_norm_eps": 1e-5},
    # A tiny model for tests and smoke runs (not a real architecture).
    "tiny-qwen2": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                   "max_position_embeddings": 4096, "tie_word_embeddings": False},
}  # fmt: skip


@dataclass(frozen=True)
class ProfileSettings:
    """What to measure and how. Times are seconds."""

    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    contexts: tuple[int, ...] = (128, 512, 2048)
    query_tokens: tuple[int, ...] = tuple(range(1, 10))
    draft_query_tokens: tuple[int, ...] = (1, 2)
    overhead_ks: tuple[int, ...] = (0, 1, 2, 4)
    warmup: int = 1
    repeats: int = 5
    overhead_steps: int = 8  # timed engine steps per (batch, K), after 2 untimed ones
    spread_warn: float = 0.2
    cache_fill: str = "random"  # or "prefill"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "contexts", "query_tokens", "draft_query_tokens"):
            values = getattr(self, name)
            if not values or any(int(v) < 1 for v in values):
                raise ValueError(f"{name} needs one or more integers >= 1, got {values!r}")
        if any(int(k) < 0 for k in self.overhead_ks):
            raise ValueError(f"overhead_ks must be >= 0, got {self.overhead_ks!r}")
        if self.repeats < 1 or self.warmup < 0 or self.overhead_steps < 1:
            raise ValueError("repeats and overhead_steps must be >= 1, warmup >= 0")
        if self.cache_fill not in ("random", "prefill"):
            raise ValueError(f"cache_fill must be 'random' or 'prefill', got {self.cache_fill!r}")


# The --quick grid: under 3 minutes for the default pair (1.5B + 0.5B, fp32) on a 2-core CPU.
QUICK_SETTINGS = ProfileSettings(
    batch_sizes=(1, 2, 4), contexts=(128, 1024), query_tokens=(1, 2, 3, 4, 6, 9),
    draft_query_tokens=(1, 2), overhead_ks=(0, 1, 3), warmup=0, repeats=3, overhead_steps=5,
)  # fmt: skip


# ----------------------------------------------------------------------------- models


def resolve_config(spec: str | dict):
    """A transformers config from a named architecture (`NAMED_ARCHITECTURES`, case-insensitive,
    "Qwen/" prefix and "-Instruct"/"-Coder" variants accepted), a config.json file, a model
    directory holding one, inline JSON, or a dict."""
    from transformers import AutoConfig

    if isinstance(spec, dict):
        data = dict(spec)
    else:
        text = str(spec).strip()
        key = text.lower().split("/")[-1].replace("-instruct", "").replace("-coder", "").replace("_", "-")
        if key in NAMED_ARCHITECTURES:
            data = dict(NAMED_ARCHITECTURES[key])
        elif text.startswith("{"):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"inline config JSON is malformed: {error}") from None
        elif os.path.isdir(text) or os.path.isfile(text):
            path = os.path.join(text, "config.json") if os.path.isdir(text) else text
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, json.JSONDecodeError) as error:
                raise ValueError(f"cannot read config {path!r}: {error}") from None
        else:
            raise ValueError(f"unknown architecture {spec!r}: give one of {', '.join(NAMED_ARCHITECTURES)}, "
                             "a config.json path, or inline JSON")  # fmt: skip
    model_type = data.pop("model_type", None)
    if not model_type:
        raise ValueError(f"config {spec!r} has no model_type")
    for key in ("architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype"):
        data.pop(key, None)
    return AutoConfig.for_model(model_type, **data)


def random_model(config, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> torch.nn.Module:
    """A model with random weights built straight on `device` (latency does not depend on weights)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def load_pretrained(name_or_path: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
                    progress: bool = True, cache_dir: str | None = None) -> torch.nn.Module:  # fmt: skip
    """A registered model name (fetched into the cache if needed) or a local directory; the
    tokenizer is not loaded (profiling needs none)."""
    from transformers import AutoModelForCausalLM

    from ..assets.fetch import resolve_model

    path = resolve_model(name_or_path, cache_dir=cache_dir, progress=progress)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def _text_config(model: torch.nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _vocab(model: torch.nn.Module) -> int:
    from ..modeling.drafters import logits_width

    return logits_width(model)


# ----------------------------------------------------------------------------- timing


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _filled_kv(model: torch.nn.Module, batch: int, context: int, mode: str, generator: torch.Generator) -> RaggedKV:
    """A RaggedKV whose `batch` rows each hold `context` cached tokens."""
    kv = RaggedKV(model)
    config = _text_config(model)
    device = _device_of(model)
    if mode == "prefill":
        vocab = _vocab(model)
        kv.forward(torch.randint(0, vocab, (batch, context), generator=generator), logits_to_keep=1)
        return kv
    from transformers import DynamicCache

    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(model.parameters()).dtype
    cache = DynamicCache()
    shape = (batch, heads, context, head_dim)
    for layer in range(config.num_hidden_layers):
        if device.type == "cpu":
            keys = torch.randn(shape, generator=generator).to(dtype)
            values = torch.randn(shape, generator=generator).to(dtype)
        else:  # generated where they live: no host-side copies of a large cache
            keys = torch.randn(shape, device=device, dtype=dtype)
            values = torch.randn(shape, device=device, dtype=dtype)
        cache.update(keys, values, layer)
    kv.cache = cache
    kv.valid = torch.ones(batch, context, dtype=torch.bool)
    return kv


def _truncate(kv: RaggedKV, slots: int) -> None:
    """Drop every slot past `slots` (what the timed forward appended)."""
    for layer in kv.cache.layers:
        layer.keys = layer.keys[..., :slots, :]
        layer.values = layer.values[..., :slots, :]
    kv.valid = kv.valid[:, :slots]


def _time_forward(kv: RaggedKV, tokens: torch.Tensor, logits_to_keep: int) -> float:
    device = _device_of(kv.model)
    since = kv.num_slots
    _sync(device)
    started = time.perf_counter()
    kv.forward(tokens, logits_to_keep=logits_to_keep)
    _sync(device)
    elapsed = time.perf_counter() - started
    _truncate(kv, since)
    return elapsed


def _stats(samples: Sequence[float]) -> dict:
    values = np.asarray(samples, dtype=float)
    median = float(np.median(values))
    iqr = float(np.percentile(values, 75) - np.percentile(values, 25))
    spread = iqr / median if median > 0 else float("inf")
    return {"median": _sig(median), "iqr": _sig(iqr), "rel_spread": _sig(spread)}


def _sig(value: float) -> float:
    return float(f"{value:.6g}")


def _round(values: Sequence[float]) -> list[float]:
    return [_sig(v) for v in values]


# ----------------------------------------------------------------------------- engine overhead


class _ForwardClock:
    """Adds up the wall time of a module's forwards (synchronised on GPUs) via hooks."""

    def __init__(self, model: torch.nn.Module):
        self.device = _device_of(model)
        self.total = 0.0
        self._started = 0.0
        self._handles = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]

    def _pre(self, module, args):
        _sync(self.device)
        self._started = time.perf_counter()

    def _post(self, module, args, output):
        _sync(self.device)
        self.total += time.perf_counter() - self._started

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class _RecordingPolicy:
    """Static k; resets the forward clocks at each choice and keeps each step's split."""

    def __init__(self, k: int, clocks: Sequence[_ForwardClock | None]):
        self.k, self.clocks, self.rows = k, clocks, []
        self.name = f"profile:{k}"

    def choose(self, requests):
        for clock in self.clocks:
            if clock is not None:
                clock.total = 0.0
        return [self.k] * len(requests)

    def observe(self, record) -> None:
        draft_clock, target_clock = self.clocks
        draft_fwd = draft_clock.total if draft_clock is not None else 0.0
        self.rows.append((max(record.draft_seconds - draft_fwd, 0.0),
                          max(record.verify_seconds - target_clock.total, 0.0),
                          max(record.total_seconds - record.draft_seconds - record.verify_seconds, 0.0)))  # fmt: skip


def _standin(vocab: int, dtype: torch.dtype, device: str, seed: int) -> torch.nn.Module:
    config = resolve_config({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": vocab,
                             "max_position_embeddings": 4096, "tie_word_embeddings": False})  # fmt: skip
    model = random_model(config, dtype=dtype, device=device, seed=seed)
    model.generation_config.eos_token_id = None
    return model


def measure_overhead(vocab: int, with_draft: bool, batch_sizes: Sequence[int], ks: Sequence[int], steps: int,
                     dtype: torch.dtype, device: str, seed: int = 0,
                     on_step: Callable[[], None] | None = None) -> list[dict]:  # fmt: skip
    """Engine overhead per (batch, K) from real SpecEngine steps with stand-in models."""
    from ..engine.engine import SpecEngine
    from ..sampling.params import SamplingParams

    target = _standin(vocab, dtype, device, seed)
    draft = _standin(vocab, dtype, device, seed + 1) if with_draft else None
    target_clock = _ForwardClock(target)
    draft_clock = _ForwardClock(draft) if draft is not None else None
    generator = torch.Generator().manual_seed(seed)
    rows = []
    try:
        for batch in batch_sizes:
            for k in ks if with_draft else [0]:
                policy = _RecordingPolicy(int(k), (draft_clock, target_clock))
                engine = SpecEngine(target, draft, policy, max_k=max(int(k), 1), max_batch_size=batch, seed=seed)
                for _ in range(batch):
                    prompt = torch.randint(0, vocab, (32,), generator=generator).tolist()
                    engine.add_request(prompt, SamplingParams(max_new_tokens=(steps + 3) * (int(k) + 1) + 4))
                for _ in range(steps + 2):
                    engine.step()
                    if on_step is not None:
                        on_step()
                timed = policy.rows[2:] or policy.rows
                columns = list(zip(*timed))
                row = {"batch": int(batch), "k": int(k), "steps": len(timed)}
                for name, values in zip(("draft_extra", "verify_extra", "rest"), columns):
                    row[name] = _sig(float(np.median(values)))
                    row[f"{name}_samples"] = _round(values)
                rows.append(row)
    finally:
        target_clock.remove()
        if draft_clock is not None:
            draft_clock.remove()
    return rows


# ----------------------------------------------------------------------------- the profile run


def _cells(settings: ProfileSettings, with_draft: bool) -> list[tuple[str, int, int, int]]:
    cells = []
    for b in settings.batch_sizes:
        for c in settings.contexts:
            cells += [("target", b, c, q) for q in settings.query_tokens]
            if with_draft:
                cells += [("draft", b, c, q) for q in settings.draft_query_tokens]
    return cells


def _probe(model: torch.nn.Module, settings: ProfileSettings, generator: torch.Generator, logits_to_keep: int,
           max_q: int) -> dict:  # fmt: skip
    """A few forwards that warm the model up and calibrate the time estimate."""
    vocab = _vocab(model)
    c0, c1 = min(settings.contexts), max(settings.contexts)
    b1 = max(settings.batch_sizes)
    kv = _filled_kv(model, 1, c0, "random", generator)
    small = [_time_forward(kv, torch.randint(0, vocab, (1, 1), generator=generator), logits_to_keep) for _ in range(2)]
    kv = _filled_kv(model, b1, c0, "random", generator)
    big = _time_forward(kv, torch.randint(0, vocab, (b1, max_q), generator=generator), logits_to_keep)
    long = small[-1]
    if c1 > c0:
        kv = _filled_kv(model, 1, c1, "random", generator)
        long = _time_forward(kv, torch.randint(0, vocab, (1, 1), generator=generator), logits_to_keep)
    del kv
    return {"small": min(small), "big": big, "long": long, "b1": b1, "q1": max_q, "c0": c0, "c1": c1}


def _cell_estimate(probe: dict, b: int, c: int, q: int) -> float:
    span = max(probe["b1"] * probe["q1"] - 1, 1)
    base = probe["small"] + max(probe["big"] - probe["small"], 0.0) * (b * q - 1) / span
    if probe["c1"] > probe["c0"]:
        base += max(probe["long"] - probe["small"], 0.0) * b * (c - probe["c0"]) / (probe["c1"] - probe["c0"])
    return base


def estimate_seconds(probes: dict, settings: ProfileSettings, with_draft: bool) -> dict[tuple, float]:
    """Estimated seconds per cell (all its warm-up and timed forwards; a cache's first cell also
    carries that cache's warm-up forward)."""
    runs = settings.warmup + settings.repeats
    out = {}
    for cell in _cells(settings, with_draft):
        first = cell[3] == (settings.query_tokens if cell[0] == "target" else settings.draft_query_tokens)[0]
        out[cell] = (runs + first) * _cell_estimate(probes[cell[0]], *cell[1:])
    return out


def profile_models(
    target: torch.nn.Module,
    draft: torch.nn.Module | None = None,
    settings: ProfileSettings = ProfileSettings(),
    *,
    name: str | None = None,
    target_name: str | None = None,
    draft_name: str | None = None,
    random_weights: bool = False,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Time `target` (and `draft`) over the settings' grid and return the profile document."""
    log = log or (lambda message: print(f"[adaptive-spec] {message}", file=sys.stderr, flush=True))
    started = time.perf_counter()
    target.eval()
    device = _device_of(target)
    dtype = next(target.parameters()).dtype
    if draft is not None:
        draft.eval()
        if _device_of(draft) != device:
            raise ValueError(f"target on {device} but draft on {_device_of(draft)}: put both on one device")
    generator = torch.Generator().manual_seed(settings.seed)
    with_draft = draft is not None
    models = {"target": target, "draft": draft}

    # Probes: warm-up and the up-front time estimate.
    max_q = max(settings.query_tokens)
    with torch.no_grad():
        probes = {"target": _probe(target, settings, generator, 0, max_q)}
        if with_draft:
            probes["draft"] = _probe(draft, settings, generator, 1, max(settings.draft_query_tokens))
    estimates = estimate_seconds(probes, settings, with_draft)
    overhead_runs = len(settings.batch_sizes) * (len(settings.overhead_ks) if with_draft else 1)
    overhead_estimate = overhead_runs * (settings.overhead_steps + 2) * (0.01 + 2e-8 * _vocab(target) * max(settings.batch_sizes))
    total_estimate = sum(estimates.values()) + overhead_estimate
    log(f"profiling {len(estimates)} cells ({sum(1 for c in estimates if c[0] == 'target')} target, "
        f"{sum(1 for c in estimates if c[0] == 'draft')} draft) x {settings.warmup}+{settings.repeats} forwards "
        f"and {overhead_runs} engine-overhead runs; estimated time {_format_seconds(total_estimate)}")  # fmt: skip

    from tqdm.auto import tqdm

    bar = tqdm(total=round(total_estimate, 1), disable=not progress, file=sys.stderr, unit="s",
               bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}")  # fmt: skip
    rows: dict[str, list[dict]] = {"target": [], "draft": []}
    notes: list[str] = []
    try:
        with torch.no_grad():
            for b in settings.batch_sizes:
                for c in settings.contexts:
                    for component in ("target", "draft") if with_draft else ("target",):
                        model = models[component]
                        queries = settings.query_tokens if component == "target" else settings.draft_query_tokens
                        keep = 0 if component == "target" else 1
                        vocab = _vocab(model)
                        try:
                            kv = _filled_kv(model, b, c, settings.cache_fill, generator)
                        except (RuntimeError, MemoryError) as error:  # e.g. out of memory at a large cell
                            notes.append(f"{component} batch {b} context {c}: skipped ({type(error).__name__}: {error})")
                            log(notes[-1])
                            for q in queries:
                                bar.update(estimates[(component, b, c, q)])
                            continue
                        # One untimed forward on every new cache (first touches of its memory).
                        _time_forward(kv, torch.randint(0, vocab, (b, queries[0]), generator=generator), keep)
                        for q in queries:
                            bar.set_description(f"{component} b={b} ctx={c} q={q}")
                            try:
                                samples = []
                                for n in range(settings.warmup + settings.repeats):
                                    tokens = torch.randint(0, vocab, (b, q), generator=generator)
                                    elapsed = _time_forward(kv, tokens, keep)
                                    if n >= settings.warmup:
                                        samples.append(elapsed)
                            except (RuntimeError, MemoryError) as error:
                                notes.append(f"{component} batch {b} context {c} q {q}: skipped "
                                             f"({type(error).__name__}: {error})")  # fmt: skip
                                log(notes[-1])
                                bar.update(estimates[(component, b, c, q)])
                                continue
                            stats = _stats(samples)
                            if stats["rel_spread"] > settings.spread_warn:
                                notes.append(f"high spread: {component} batch {b} context {c} q {q}: "
                                             f"IQR/median {stats['rel_spread']:.2f} > {settings.spread_warn}")  # fmt: skip
                            rows[component].append({"batch": b, "context": c, "query_tokens": q, **stats,
                                                    "samples": _round(samples)})  # fmt: skip
                            bar.update(estimates[(component, b, c, q)])
                        del kv
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
        bar.set_description("engine overhead")
        step_share = overhead_estimate / max(overhead_runs * (settings.overhead_steps + 2), 1)
        overhead = measure_overhead(_vocab(target), with_draft, settings.batch_sizes, settings.overhead_ks,
                                    settings.overhead_steps, dtype, str(device), settings.seed,
                                    on_step=lambda: bar.update(step_share))  # fmt: skip
    finally:
        bar.close()
    high = [n for n in notes if n.startswith("high spread")]
    if high:
        log(f"{len(high)} cell(s) had IQR/median above {settings.spread_warn}: the machine may be busy; "
            f"consider re-running when it is quiet")  # fmt: skip

    fingerprint = machine_fingerprint(str(device))
    fingerprint["dtype"] = str(dtype).replace("torch.", "")
    fingerprint["models"] = {"target": model_fingerprint(target, target_name, random_weights)}
    if with_draft:  # no draft: no key (readers may do models.get("draft", {}))
        fingerprint["models"]["draft"] = model_fingerprint(draft, draft_name, random_weights)
    grid = {
        "batch_sizes": list(settings.batch_sizes), "contexts": list(settings.contexts),
        "query_tokens": list(settings.query_tokens),
        "draft_query_tokens": list(settings.draft_query_tokens) if with_draft else [],
        "overhead_ks": list(settings.overhead_ks) if with_draft else [0],
    }  # fmt: skip
    settings_out = {k: v for k, v in asdict(settings).items() if k not in grid}
    settings_out.update(device=str(device), estimated_seconds=round(total_estimate, 1),
                        timing="RaggedKV.forward, target logits_to_keep=0, draft logits_to_keep=1",
                        overhead_method="SpecEngine steps with one-layer stand-in models of the same vocabulary; "
                                        "step phases minus hooked forward time")  # fmt: skip
    return {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "name": name or _default_name(fingerprint),
        "created_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "elapsed_seconds": round(time.perf_counter() - started, 1),
        "fingerprint": fingerprint,
        "settings": settings_out,
        "grid": grid,
        "warnings": notes,
        "target": rows["target"],
        "draft": rows["draft"],
        "overhead": overhead,
    }


def _default_name(fingerprint: dict) -> str:
    target = fingerprint["models"]["target"]["name"]
    return f"{fingerprint['device']}-{fingerprint['threads']}t-{os.path.basename(str(target))}-{fingerprint['dtype']}"


def _format_seconds(seconds: float) -> str:
    seconds = int(math.ceil(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
