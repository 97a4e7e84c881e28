"""`adaptive-spec profile --engine vllm`: time whole vLLM steps over batch size x context x draft length.

vLLM runs the drafter inside the model runner's forward call and exposes no split of a step, so each
cell is the wall time of a whole decoding step (schedule to output) with every request drafting K
tokens, verified K + 1 per request. The profile stores it where the cost model reads a step's verify
part: a `target` row with query_tokens = K + 1, and no draft or overhead rows (the cost model's small
stand-ins fill those). `CostModel.step_seconds(b, c, K)` then predicts the measured whole step; the
fingerprint names the engine (`"engine": "vllm"`, its version, the drafter).

The lazy draft's catch-up (`lazy_draft.py`: after steps at K = 0 the draft runs once over every
token it missed) is measured apart, as `draft_catch_up.seconds_per_token`: b requests whose
prompts hold c tokens decode `CATCH_UP_OFF_STEPS` steps at K = 0 and then draft; the step that
resumes drafting, less the mean of a K = 0 and a K = 1 step (it verifies as one and drafts as the
other), divided by the tokens the draft caught up on (prompts and skipped tokens, summed over rows).

Ragged steps (`ragged`): vLLM's step cost follows the tokens it runs, so a step where one row drafts
K beside B - 1 rows at k = 0 costs far less than the (B, K) cell. Measured at one context, side by
side with the uniform K = 0 and K = K steps of the same batch (the machine drifts between runs, a
ratio of adjacent runs much less): `share` = (ragged - uniform 0) / (uniform K - uniform 0), what
one drafting row pays of the whole batch's drafting increment. The cost model interpolates linearly
in drafted tokens between that one row and all B rows (`CostModel.ragged_step_seconds`).

How a cell is measured: b requests whose prompts hold c tokens run together under a fixed k = K
(the plug-in with a static policy); steps that prefill, or where a drafter proposed fewer than K
tokens, are dropped; the first `warmup` decoding steps are not kept. Prompts repeat a random
16-token pattern, so an n-gram drafter always has a match; acceptance does not change a step's cost.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from ...control.policy import StaticPolicy
from ...profiling.profile_file import FORMAT, SCHEMA_VERSION, machine_fingerprint, save_profile
from .controller import SpecController
from .engine import EngineSpec, make_llm

QUICK_GRID = {"batch_sizes": (1, 4), "contexts": (128, 512), "ks": (0, 1, 3, 5), "warmup": 2, "repeats": 6}
FULL_GRID = {"batch_sizes": (1, 2, 4, 8), "contexts": (128, 512, 1024), "ks": (0, 1, 2, 3, 4, 5, 6),
             "warmup": 3, "repeats": 10}
CATCH_UP_CELLS = ((1, 256), (4, 256))  # (batch, prompt tokens)
CATCH_UP_OFF_STEPS, CATCH_UP_ROUNDS = 8, 2
RAGGED_BATCH_SIZES, RAGGED_KS, RAGGED_CONTEXT, RAGGED_ROUNDS, RAGGED_STEPS = (4, 8), (1, 3, 5), 256, 2, 16


def find_vllm_profile(spec: EngineSpec, directory=None) -> Path | None:
    """`--profile auto` through vLLM (`profile_file.best_profile`, the rule our engine's `auto` uses):
    a vLLM profile or learned state in profiles/ for these target and draft names, this machine's
    (device, CPU, torch, threads as the engine runs them) first, then one of the same precision."""
    from ...profiling.profile_file import best_profile
    from ...resources import data_dir

    here = machine_fingerprint("cpu")
    here["threads"] = spec.threads or here["threads"]  # as `profile_vllm` records them
    wanted = ({"dtype": spec.dtype}, {"dtype": spec.dtype})
    return best_profile(directory or data_dir("profiles"), "vllm", spec.target, spec.drafter, here, wanted)


def start_line(requested: str, path: str | None) -> str:
    """What a command prints of its cost model's start: the profile or learned state it loads, or why
    none (`requested`: what --profile said)."""
    if path is None:
        why = "no vLLM profile for these models in profiles/" if requested == "auto" else "--profile none"
        return f"[{why}: goodput learns step costs online from the generic start]"
    from ...profiling.profile_file import is_learned, load_profile

    return f"[{'learned cost state' if is_learned(load_profile(path)) else 'latency profile'}: {path}]"


class _StepTimes:
    """A static policy that keeps the whole-step records it is shown."""

    def __init__(self, k: int):
        self.inner, self.name, self.records = StaticPolicy(k), f"profile-static:{k}", []

    def choose(self, requests):
        return self.inner.choose(requests)

    def observe(self, record):
        self.records.append(record)


def profile_vllm(spec: EngineSpec, grid: dict, name: str | None = None, progress=sys.stderr) -> dict:
    from vllm import SamplingParams

    from .scheduler import scheduler_of

    started = time.perf_counter()
    llm = make_llm(spec)
    scheduler = scheduler_of(llm)
    steps = grid["warmup"] + grid["repeats"] + 1
    rows, warnings = [], ["whole vLLM steps: draft and verify are not separable in vLLM, so each target row "
                          "(query_tokens = K + 1) holds a whole step with K drafts per request"]
    rng = np.random.default_rng(spec.seed)
    for batch in grid["batch_sizes"]:
        for context in grid["contexts"]:
            # A repeated random pattern: an n-gram drafter then always finds a match and drafts K.
            prompts = [{"prompt_token_ids": np.resize(rng.integers(100, 20000, size=16), context).tolist()}
                       for _ in range(batch)]
            for k in grid["ks"]:
                policy = _StepTimes(min(k, spec.max_k))
                scheduler.use_controller(SpecController(policy))
                # ignore_eos: every request runs the same number of steps
                params = SamplingParams(temperature=0, max_tokens=steps * (k + 1), ignore_eos=True)
                llm.generate(prompts, params, use_tqdm=False)
                kept = [r.total_seconds for r in policy.records
                        if r.total_seconds > 0 and r.batch_k == k and r.batch_size == batch]
                kept = kept[grid["warmup"]:grid["warmup"] + grid["repeats"]]
                if not kept:
                    warnings.append(f"no clean steps at batch {batch}, context {context}, K {k}")
                    continue
                rows.append(_row(batch, context, k + 1, kept))
                print(f"[batch {batch} context {context} K {k}: {rows[-1]['median'] * 1000:.0f} ms/step]",
                      file=progress)
    catch_up = measure_catch_up(llm, progress)  # None without a lazy draft model (n-gram drafting)
    ragged = measure_ragged(llm, [b for b in grid["batch_sizes"] if b > 1], [k for k in grid["ks"] if k > 0],
                            progress=progress)
    import vllm

    fingerprint = machine_fingerprint("cpu")
    fingerprint.update(engine="vllm", vllm_version=vllm.__version__, threads=spec.threads or fingerprint["threads"],
                       models={"target": {"name": spec.target, "dtype": spec.dtype},
                               "draft": {"name": spec.drafter, "dtype": spec.dtype}})
    return {
        "format": FORMAT, "schema_version": SCHEMA_VERSION,
        "name": name or f"vllm-{fingerprint['device']}-{spec.target}-{spec.dtype}",
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "elapsed_seconds": round(time.perf_counter() - started, 1),
        "fingerprint": fingerprint,
        "settings": {"engine": "vllm", "whole_steps": True, "warmup": grid["warmup"], "repeats": grid["repeats"],
                     "max_k": spec.max_k, "drafter": spec.drafter},
        "grid": {"batch_sizes": list(grid["batch_sizes"]), "contexts": list(grid["contexts"]),
                 "query_tokens": [k + 1 for k in grid["ks"]]},
        "target": rows, "draft": [], "overhead": [], "warnings": warnings,
        **({"draft_catch_up": catch_up} if catch_up else {}),
        **({"ragged": ragged} if ragged else {}),
    }


class _Scripted:
    """Fixed ks by row (in order of first appearance); stamps each choice (one per step)."""

    name = "profile-ragged"

    def __init__(self, ks: list[int]):
        self.ks, self.order, self.stamps, self.steps = ks, {}, [], []

    def choose(self, views):
        self.stamps.append(time.perf_counter())
        for view in views:
            self.order.setdefault(view.request_id, len(self.order))
        ks = [self.ks[self.order[view.request_id] % len(self.ks)] for view in views]
        # steady: the whole batch runs, and no drafting row catches up in this step
        self.steps.append(len(views) == len(self.ks) and not any(v.draft_behind for v, k in zip(views, ks) if k))
        return ks

    def observe(self, record):
        pass


def _median_step(llm, scheduler, prompts, ks: list[int], steps: int) -> float:
    from vllm import SamplingParams

    policy = _Scripted(ks)
    scheduler.use_controller(SpecController(policy))
    params = [SamplingParams(temperature=0, max_tokens=steps * (k + 1), ignore_eos=True) for k in ks]
    llm.generate(prompts, params, use_tqdm=False)
    seconds = np.diff(policy.stamps)  # seconds[i]: the step that began with choice i
    # The first steps prefill, catch up and verify drafts chosen under another pattern.
    kept = [s for s, steady, previous in zip(seconds[3:], policy.steps[3:], policy.steps[2:]) if steady and previous]
    return float(np.median(kept)) if kept else float("nan")


def measure_ragged(llm, batch_sizes, ks, context: int = RAGGED_CONTEXT, rounds: int = RAGGED_ROUNDS,
                   steps: int = RAGGED_STEPS, progress=sys.stderr) -> dict | None:
    """One drafting row's share of a batch's drafting increment (see the module docstring); None
    without a lazy draft model (vLLM's own draft upkeep runs every row at every step)."""
    from .scheduler import scheduler_of

    scheduler = scheduler_of(llm)
    if not scheduler.lazy_draft or not batch_sizes or not ks:
        return None
    rng = np.random.default_rng(2)
    cells = []
    for batch in batch_sizes:
        for k in ks:
            shares = []
            for _ in range(rounds):
                prompts = [{"prompt_token_ids": np.resize(rng.integers(100, 20000, size=16), context).tolist()}
                           for _ in range(batch)]
                off = _median_step(llm, scheduler, prompts, [0] * batch, steps)
                full = _median_step(llm, scheduler, prompts, [k] * batch, steps)
                one = _median_step(llm, scheduler, prompts, [k] + [0] * (batch - 1), steps)
                if full - off > 0.05 * off:  # an increment too small to split is left unmeasured
                    shares.append(min(max((one - off) / (full - off), 0.0), 1.0))
                print(f"[ragged batch {batch} K {k}: off {off * 1e3:.0f} ms, all {full * 1e3:.0f}, "
                      f"one row {one * 1e3:.0f}]", file=progress)
            if shares:
                cells.append({"batch": batch, "k": k, "share": float(np.median(shares)),
                              "shares": [round(x, 4) for x in shares]})
    if not cells:
        return None
    return {"context": context, "drafting_rows": 1, "cells": cells,
            "measured_utc": datetime.now(timezone.utc).isoformat(timespec="seconds")}


class _CatchUps:
    """Stands in for a cost model in the controller: keeps the catch-ups it is told of, predicts 0."""

    def __init__(self):
        self.seen: list[tuple[int, float]] = []  # (tokens, whole resume step seconds)

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        self.seen.append((tokens, seconds))

    def step_seconds(self, *args) -> float:
        return 0.0

    draft_seconds = target_seconds = overhead_seconds = ragged_step_seconds = step_seconds


def measure_catch_up(llm, progress=sys.stderr, cells=CATCH_UP_CELLS, off_steps=CATCH_UP_OFF_STEPS,
                     rounds=CATCH_UP_ROUNDS) -> dict | None:
    """Seconds per token of the lazy draft's catch-up (see the module docstring); None where the
    engine does not run the lazy draft (or no resume step was seen)."""
    from vllm import SamplingParams

    from .scheduler import scheduler_of
    from .upkeep_bench import OffThenOn

    scheduler = scheduler_of(llm)
    if not scheduler.lazy_draft:
        return None
    rng = np.random.default_rng(1)
    samples, kept = [], []
    for batch, context in cells:
        for _ in range(rounds):
            prompts = [{"prompt_token_ids": rng.integers(100, 20000, size=context).tolist()} for _ in range(batch)]
            policy, recorder = OffThenOn(off_steps, 1), _CatchUps()
            scheduler.use_controller(SpecController(policy, recorder))
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=off_steps + 8, ignore_eos=True),
                         use_tqdm=False)
            steps = np.diff(policy.stamps)  # steps[i]: the step that began with choice i
            resumes = [(tokens, seconds) for tokens, seconds in recorder.seen if tokens >= batch * context]
            if not resumes or len(steps) < off_steps + 4:
                continue
            tokens, seconds = resumes[0]
            own = (np.median(steps[2:off_steps - 1]) + np.median(steps[off_steps + 2:])) / 2
            samples.append(max(seconds - own, 0.0) / tokens)
            kept.append({"batch": batch, "context": context, "tokens": tokens, "resume_seconds": round(seconds, 4),
                         "own_seconds": round(float(own), 4)})
            print(f"[catch-up batch {batch}: {tokens} tokens, {samples[-1] * 1000:.2f} ms/token]", file=progress)
    if not samples:
        return None
    return {"seconds_per_token": float(np.median(samples)), "samples": [round(x, 7) for x in samples],
            "cells": kept, "off_steps": off_steps}


def _vllm_profile(path: str) -> dict:
    """An existing vLLM profile, to extend; ValueError for any other profile."""
    from ...profiling.profile_file import load_profile, profile_engine

    profile = dict(load_profile(path))
    if profile_engine(profile) != "vllm":
        raise ValueError(f"{path} is not a vLLM profile (its fingerprint names no vLLM engine)")
    return profile


def add_catch_up(path: str, spec: EngineSpec) -> dict:
    """Measure the catch-up on this machine and write it into an existing vLLM profile."""
    profile = _vllm_profile(path)
    llm = make_llm(spec)
    catch_up = measure_catch_up(llm)
    if catch_up is None:
        raise RuntimeError("no catch-up was measured: the engine has no lazy draft model")
    catch_up["measured_utc"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    profile["draft_catch_up"] = catch_up
    save_profile(profile, path)
    return catch_up


def add_ragged(path: str, pair: str) -> dict:
    """Measure ragged steps of `pair` on this machine, at the profile's batch sizes and Ks, and write
    them into an existing vLLM profile."""
    profile = _vllm_profile(path)
    grid = profile.get("grid", {})
    batch_sizes = [b for b in grid.get("batch_sizes", RAGGED_BATCH_SIZES) if b > 1]
    ks = [q - 1 for q in grid.get("query_tokens", [k + 1 for k in RAGGED_KS]) if q > 1]
    llm = make_llm(EngineSpec.for_pair(pair, max_k=max(ks, default=1)))
    ragged = measure_ragged(llm, batch_sizes, ks)
    if ragged is None:
        raise RuntimeError("no ragged step was measured: the engine has no lazy draft model")
    profile["ragged"] = ragged
    save_profile(profile, path)
    return ragged


def _row(batch: int, context: int, query_tokens: int, samples: list[float]) -> dict:
    q1, median, q3 = np.percentile(samples, [25, 50, 75])
    return {"batch": batch, "context": context, "query_tokens": query_tokens, "samples": [round(s, 6) for s in samples],
            "median": float(median), "iqr": float(q3 - q1), "rel_spread": float((q3 - q1) / median)}


def run_vllm_profile(args) -> int:
    """`profile --engine vllm`, from the profile command's parsed arguments."""
    grid = dict(QUICK_GRID if args.quick else FULL_GRID)
    for key, option in (("batch_sizes", "batch_sizes"), ("contexts", "contexts"), ("warmup", "warmup"),
                        ("repeats", "repeats")):
        if getattr(args, option, None):
            grid[key] = getattr(args, option)
    if getattr(args, "query_tokens", None):
        grid["ks"] = tuple(q - 1 for q in args.query_tokens)
    drafter = "ngram" if args.draft == "ngram" else args.draft
    if args.target:
        spec = EngineSpec(args.target, drafter, max_k=max(grid["ks"]) or 1, dtype=args.dtype,
                          threads=args.threads, seed=args.seed)
    else:
        spec = EngineSpec.for_pair(args.pair or "qwen-coder", max_k=max(grid["ks"]) or 1, dtype=args.dtype,
                                   threads=args.threads, seed=args.seed)
    profile = profile_vllm(spec, grid, args.name)
    from pathlib import Path

    out = Path(args.out) if args.out else Path("profiles") / f"{profile['name']}.json"
    save_profile(profile, out)
    print(json.dumps({"command": "profile", "ok": True, "engine": "vllm", "out": str(out),
                      "cells": len(profile["target"]), "elapsed_seconds": profile["elapsed_seconds"]}))
    return 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Add the lazy draft's catch-up or ragged steps to a vLLM profile.")
    parser.add_argument("--add-catch-up", metavar="PROFILE", help="the vLLM profile to extend with its catch-up")
    parser.add_argument("--add-ragged", metavar="PROFILE", help="the vLLM profile to extend with ragged steps")
    parser.add_argument("--pair", default="qwen-coder")
    options = parser.parse_args()
    if not (options.add_catch_up or options.add_ragged):
        parser.error("give --add-catch-up PROFILE or --add-ragged PROFILE")
    if options.add_catch_up:
        print(json.dumps(add_catch_up(options.add_catch_up, EngineSpec.for_pair(options.pair, max_k=1))))
    if options.add_ragged:
        print(json.dumps(add_ragged(options.add_ragged, options.pair)))
