"""The ``profile`` command: measure this machine into a profile file, or summarise one.

    adaptive-spec profile --pair qwen-coder --quick --out profiles/NAME.json
    adaptive-spec profile --target-config Qwen2.5-7B --draft-config Qwen2.5-0.5B --device cuda --dtype bfloat16
    adaptive-spec profile show profiles/NAME.json
    adaptive-spec profile linear --pair qwen-coder      # oneDNN vs torch's Linear kernel, side by side

``profile`` and ``profile run`` are the same command. The main command line registers the group
with ``add_profile_commands(subparsers)`` and calls ``run_profile(args)`` when
``args.command == "profile"``; ``python -m adaptive_spec.profiling.cli`` runs it on its own.
Every command's last stdout line is one JSON document; progress and warnings go to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

__all__ = ["add_profile_commands", "run_profile", "main", "parse_int_list"]


def parse_int_list(text: str) -> tuple[int, ...]:
    """"1,2,4" or "1-9" or "1-4,6,9" -> sorted unique integers."""
    values: set[int] = set()
    try:
        for part in str(text).split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part[1:]:
                lo, hi = part.split("-", 1)
                lo_i, hi_i = int(lo), int(hi)
                if hi_i < lo_i:
                    raise ValueError
                values.update(range(lo_i, hi_i + 1))
            else:
                values.add(int(part))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like '1,2,4' or '1-9', got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    return tuple(sorted(values))


def add_profile_commands(subparsers) -> argparse.ArgumentParser:
    """Register ``profile [run] ...`` and ``profile show PROFILE`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "profile", help="measure this machine's step costs into a profile, or summarise a profile",
        description="Time target and draft forwards over batch x context x query tokens, and the engine's "
                    "overhead, into a profile file (`profile` or `profile run`); or summarise one and its "
                    "cost model's leave-one-out error (`profile show PROFILE`).",
    )  # fmt: skip
    p.add_argument("profile_action", nargs="?", choices=("run", "show", "linear"), default="run",
                   metavar="{run,show,linear}",
                   help="run (default) measures; show summarises PROFILE; linear times the target's forwards "
                        "with oneDNN's and torch's Linear kernels side by side (--query-tokens, first of "
                        "--contexts and --batch-sizes, --repeats rounds)")
    p.add_argument("profile_path", nargs="?", metavar="PROFILE", help="the profile file to show")
    models = p.add_argument_group("models (default: --pair qwen-coder)")
    models.add_argument("--pair", default=None, help="a registered target/draft pair, e.g. qwen-coder")
    models.add_argument("--target", default=None, help="a registered model name or a local model directory")
    models.add_argument("--draft", default=None, help="a registered model name or a local model directory")
    models.add_argument("--target-config", default=None,
                        help="random weights from a config: a named architecture (Qwen2.5-0.5B/1.5B/3B/7B/14B/32B/72B), "
                             "a config.json path or inline JSON")
    models.add_argument("--draft-config", default=None, help="random-weights draft, as --target-config")
    models.add_argument("--no-draft", action="store_true", help="profile the target only")
    models.add_argument("--cache-dir", default=None, help="model cache directory (for registered names)")
    grid = p.add_argument_group("grid (--quick picks a small one; explicit options override it)")
    grid.add_argument("--quick", action="store_true", help="a small grid: under 3 minutes for the default pair on a 2-core CPU")
    grid.add_argument("--batch-sizes", type=parse_int_list, default=None, help="e.g. 1,2,4,8")
    grid.add_argument("--contexts", type=parse_int_list, default=None, help="e.g. 128,512,2048")
    grid.add_argument("--query-tokens", type=parse_int_list, default=None, help="e.g. 1-9")
    grid.add_argument("--draft-query-tokens", type=parse_int_list, default=None, help="default 1,2 (decode, catch-up)")
    grid.add_argument("--overhead-ks", type=parse_int_list, default=None, help="draft lengths K for the overhead runs")
    grid.add_argument("--warmup", type=int, default=None, help="untimed forwards per cell")
    grid.add_argument("--repeats", type=int, default=None, help="timed forwards per cell")
    grid.add_argument("--overhead-steps", type=int, default=None, help="timed engine steps per overhead run")
    grid.add_argument("--spread-warn", type=float, default=None, help="warn where IQR/median exceeds this (0.2)")
    grid.add_argument("--cache-fill", choices=("random", "prefill"), default=None,
                      help="fill the KV cache with random values (default) or a real prefill")
    run = p.add_argument_group("machine and output")
    run.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    run.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    run.add_argument("--cpu-linear", choices=("onednn", "torch"), default="onednn",
                     help="what runs float32 Linear layers on CPU, as `generate --cpu-linear` (default onednn)")
    run.add_argument("--draft-dtype", choices=("auto", "same", "int8"), default="auto",
                     help="int8: dynamically quantised draft (CPU); same: the target's precision; auto: as "
                          "`generate` runs the draft by default (int8 on a CPU under a float32 target)")
    run.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--out", default=None, help="output file (default profiles/<name>.json)")
    run.add_argument("--name", default=None, help="the profile's name (default from device, threads, model, dtype)")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                     help="vllm: time whole vLLM steps (batch x context x K) with the scheduler plug-in")
    show = p.add_argument_group("show")
    show.add_argument("--strict", action="store_true",
                      help="show: exit with an error if the profile was measured on another kind of machine")
    return p


# ----------------------------------------------------------------------------- helpers


def _error(message: str, code: int = 2) -> int:
    print(f"adaptive-spec profile: error: {message}", file=sys.stderr)
    print(json.dumps({"command": "profile", "ok": False, "error": message}))
    return code


def _settings(args):
    from .profiler import QUICK_SETTINGS, ProfileSettings

    base = QUICK_SETTINGS if args.quick else ProfileSettings()
    changes = {}
    for name in ("batch_sizes", "contexts", "query_tokens", "draft_query_tokens", "overhead_ks", "warmup",
                 "repeats", "overhead_steps", "spread_warn", "cache_fill"):  # fmt: skip
        value = getattr(args, name, None)
        if value is not None:
            changes[name] = value
    changes["seed"] = args.seed
    return replace(base, **changes)


def _load_models(args, dtype, device):
    """(target, draft, target_name, draft_name, random_weights)."""
    from ..assets.registry import get_pair
    from ..modeling.cpu_linear import set_linear_kernel
    from ..modeling.loading import quantize_int8
    from .profiler import load_pretrained, random_model, resolve_config

    progress = not args.quiet

    def pretrained(name):
        return load_pretrained(name, dtype=dtype, device=device, progress=progress, cache_dir=args.cache_dir)

    random_weights = False
    pair = None
    if args.pair or not (args.target or args.target_config):
        pair = get_pair(args.pair or "qwen-coder")
    if args.target_config:
        target = random_model(resolve_config(args.target_config), dtype, device, args.seed)
        target_name, random_weights = str(args.target_config), True
    else:
        target_name = args.target or pair.target
        target = pretrained(target_name)
    draft, draft_name = None, None
    if not args.no_draft:
        if args.draft_config:
            draft = random_model(resolve_config(args.draft_config), dtype, device, args.seed + 1)
            draft_name, random_weights = str(args.draft_config), True
        elif args.draft and args.draft.lower() != "none":
            draft_name = args.draft
            draft = pretrained(draft_name)
        elif pair is not None and not args.draft:
            draft_name = pair.draft
            draft = pretrained(draft_name)
    draft_dtype = getattr(args, "draft_dtype", "same")
    if draft_dtype == "auto":  # what generate and bench run by default (cli.common.draft_precision)
        draft_dtype = "int8" if str(device) == "cpu" and args.dtype == "float32" else "same"
    if draft is not None and draft_dtype == "int8":
        if str(device) != "cpu":
            raise ValueError("--draft-dtype int8 is dynamic quantisation, which runs on the CPU only")
        draft = quantize_int8(draft.float()).eval()
    for model in (target, draft):  # as the engine runs them (modeling.loading)
        if model is not None:
            set_linear_kernel(model, args.cpu_linear)
    return target, draft, target_name, draft_name, random_weights


def _run(args) -> int:
    import torch

    from ..control.cost_model import CostModel
    from .profile_file import ProfileError, save_profile
    from .profiler import _format_seconds, profile_models

    if args.profile_path is not None:
        return _error(f"unexpected argument {args.profile_path!r} (did you mean `profile show {args.profile_path}`?)")
    started = time.perf_counter()
    try:
        settings = _settings(args)
    except ValueError as error:
        return _error(str(error))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        return _error("--device cuda was asked for but no GPU is available")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    try:
        target, draft, target_name, draft_name, random_weights = _load_models(args, dtype, device)
    except (ValueError, OSError) as error:
        return _error(str(error))
    loaded = time.perf_counter() - started
    profile = profile_models(target, draft, settings, name=args.name, target_name=target_name, draft_name=draft_name,
                             random_weights=random_weights, progress=not args.quiet)  # fmt: skip
    out = Path(args.out) if args.out else Path("profiles") / f"{profile['name']}.json"
    try:
        save_profile(profile, out)
    except (OSError, ProfileError) as error:
        return _error(f"cannot write profile {str(out)!r}: {error}")
    model = CostModel.from_profile(profile)
    loo = model.loo_errors()
    elapsed = time.perf_counter() - started
    print(f"wrote {out} ({out.stat().st_size / 1e3:.0f} kB): {len(profile['target'])} target and "
          f"{len(profile['draft'])} draft cells, {len(profile['overhead'])} overhead runs; "
          f"profiling took {_format_seconds(profile['elapsed_seconds'])} (total {_format_seconds(elapsed)} "
          f"with {_format_seconds(loaded)} loading models); leave-one-out median relative error "
          f"{loo.median_rel_error:.1%}")  # fmt: skip
    print(json.dumps({
        "command": "profile", "ok": True, "out": str(out), "name": profile["name"],
        "profiling_seconds": profile["elapsed_seconds"], "total_seconds": round(elapsed, 1),
        "target_cells": len(profile["target"]), "draft_cells": len(profile["draft"]),
        "warnings": len(profile["warnings"]), "loo_median_rel_error": _num(loo.median_rel_error),
    }))  # fmt: skip
    return 0


def _num(value: float):
    return None if value is None or not math.isfinite(value) else round(float(value), 6)


def _show(args) -> int:
    from ..control.cost_model import CostModel
    from ..control.online_cost import cost_model_for
    from .profile_file import (ProfileError, ProfileMismatchWarning, check_fingerprint, is_learned, load_profile,
                               machine_fingerprint)

    if not args.profile_path:
        return _error("`profile show` needs a PROFILE file")
    path = args.profile_path
    learned = None
    try:
        profile = load_profile(path)
        if is_learned(profile):  # a learned state: the shared model it resumes, beside its shape
            learned = cost_model_for(profile)
            if profile["learned"].get("shape") == "generic":
                return _show_generic_learned(path, profile, learned)
        model = CostModel.from_profile(profile)
    except ProfileError as error:
        return _error(str(error))
    except ValueError as error:
        return _error(f"profile {path!r} cannot give a cost model: {error}")
    fp = profile["fingerprint"]
    print(f"profile   {profile.get('name')}  ({path}, created {profile.get('created_utc', '?')}, "
          f"{profile.get('elapsed_seconds', '?')} s to measure)")  # fmt: skip
    print(f"machine   {fp.get('device')} {fp.get('device_name')!s}, {fp.get('threads')} threads, "
          f"torch {fp.get('torch_version')}, dtype {fp.get('dtype')}")  # fmt: skip
    for role, m in (fp.get("models") or {}).items():
        if m:
            weights = "random weights" if m.get("random_weights") else "trained weights"
            print(f"{role:<9} {m.get('name')} ({m.get('architecture')}, {_count(m.get('parameters'))} parameters, "
                  f"{m.get('dtype')}, {weights}, config {m.get('config_hash')})")  # fmt: skip
    for component in ("target", "draft"):
        g = model.grid(component)
        if g:
            print(f"grid      {component}: batch {g['batch_sizes']} x context {g['contexts']} x query tokens {g['query_tokens']}")
    spreads = [row.get("rel_spread", 0.0) for name in ("target", "draft") for row in profile.get(name) or []]
    threshold = (profile.get("settings") or {}).get("spread_warn", 0.2)
    high = sum(1 for s in spreads if s > threshold)
    print(f"spread    IQR/median: median {_pct(spreads, 50)}, p90 {_pct(spreads, 90)}, max {_pct(spreads, 100)}; "
          f"{high} of {len(spreads)} cells above {threshold}")  # fmt: skip
    rows = sorted(profile["target"], key=lambda r: (r["batch"], r["context"], r["query_tokens"]))
    context0 = min(r["context"] for r in rows)
    for b in sorted({r["batch"] for r in rows}):
        line = "  ".join(f"q{r['query_tokens']}={r['median'] * 1e3:.0f}" for r in rows if r["batch"] == b and r["context"] == context0)
        print(f"target ms batch {b} context {context0}: {line}")
    if profile.get("draft"):
        one = sorted((r for r in profile["draft"] if r["query_tokens"] == 1), key=lambda r: (r["batch"], r["context"]))
        print("draft ms per token (q=1): " + "  ".join(f"b{r['batch']}/c{r['context']}={r['median'] * 1e3:.0f}" for r in one))
    for row in profile.get("overhead") or []:
        print(f"overhead  batch {row['batch']} K {row['k']}: draft-side {row['draft_extra'] * 1e3:.1f} ms, "
              f"verify-side {row['verify_extra'] * 1e3:.1f} ms, rest {row['rest'] * 1e3:.1f} ms")  # fmt: skip
    loo = model.loo_errors()
    summary = loo.summary()
    print(f"cost model leave-one-out relative error: median {loo.median_rel_error:.1%} over {summary['points']} cells"
          + "".join(f"; {c} median {summary[f'{c}_median_rel_error']:.1%}, p90 {summary[f'{c}_p90_rel_error']:.1%}"
                    for c in ("target", "draft") if f"{c}_median_rel_error" in summary))  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProfileMismatchWarning)
        try:
            differences = check_fingerprint(profile, machine_fingerprint(fp.get("device") or "cpu"),
                                            strict=args.strict, source=path)  # fmt: skip
        except ProfileError as error:
            return _error(str(error), code=3)
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    print(f"this machine: {'matches the profile' if not differences else 'differs: ' + '; '.join(differences)}")
    if learned is not None:
        _print_learned(profile, learned, model)
    print(json.dumps({
        **(_learned_summary(learned) if learned is not None else {}),
        "command": "profile show", "ok": True, "profile": str(path), "name": profile.get("name"),
        "device": fp.get("device"), "device_name": fp.get("device_name"), "threads": fp.get("threads"),
        "target": ((fp.get("models") or {}).get("target") or {}).get("name"),
        "draft": ((fp.get("models") or {}).get("draft") or {}).get("name"),
        "target_cells": len(profile["target"]), "draft_cells": len(profile.get("draft") or []),
        "high_spread_cells": high, "max_rel_spread": _num(max(spreads)) if spreads else None,
        "loo_points": summary["points"],
        "loo_median_rel_error": _num(loo.median_rel_error),
        "loo_target_median_rel_error": _num(summary.get("target_median_rel_error")),
        "loo_draft_median_rel_error": _num(summary.get("draft_median_rel_error")),
        "machine_matches": not differences,
    }))  # fmt: skip
    return 0


def _print_learned(profile: dict, learned, measured=None) -> None:
    """A learned state's parameters, and its step prices against its shape's (the profile's)."""
    section = profile["learned"]
    scales = "  ".join(f"{name} {value:.3f}" for name, value in learned.parameters().items())
    print(f"learned   {learned.observations} steps online from {section.get('from')} "
          f"(saved {section.get('created_utc', '?')}): {scales}")
    context = learned.grid("target")["contexts"][0]
    for batch in learned.grid("target")["batch_sizes"][:4]:
        now = [f"{1e3 * t:.0f}" for t in learned.step_seconds_table(int(batch), context, 6)]
        shape = "" if measured is None else ", profile " + "/".join(
            f"{1e3 * t:.0f}" for t in measured.step_seconds_table(int(batch), context, 6))
        spread = "/".join(f"{1e3 * t:.0f}" for t in learned.price_spread(int(batch), 6)[1:])
        print(f"step ms   batch {int(batch)} context {int(context)}, K = 0..6: learned {'/'.join(now)}{shape}; "
              f"uncertain by +-{spread} (1 sd above K = 0, K = 1..6)")


def _learned_summary(learned) -> dict:
    return {"learned_steps": int(learned.observations), "learned_parameters": learned.parameters()}


def _show_generic_learned(path: str, profile: dict, learned) -> int:
    """`profile show` of a learned state that started from the generic shape (no measured tables)."""
    fp = profile["fingerprint"]
    print(f"profile   {profile.get('name')}  ({path}): a learned state of the generic shape, no measured tables")
    print(f"machine   {fp.get('device')} {fp.get('device_name')!s}, {fp.get('threads')} threads, "
          f"torch {fp.get('torch_version')}")  # fmt: skip
    _print_learned(profile, learned)
    print(json.dumps({"command": "profile show", "ok": True, "profile": str(path), "name": profile.get("name"),
                      "device": fp.get("device"), "device_name": fp.get("device_name"),
                      "threads": fp.get("threads"), **_learned_summary(learned)}))
    return 0


def _count(n) -> str:
    if not isinstance(n, (int, float)):
        return "?"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


def _pct(values, q) -> str:
    import numpy as np

    return f"{float(np.percentile(values, q)):.2f}" if values else "n/a"


def _linear(args) -> int:
    import torch

    from ..assets.registry import get_pair
    from .kernels import compare_linear_kernels
    from .profiler import load_pretrained, random_model, resolve_config

    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.target_config or args.target or get_pair(args.pair or "qwen-coder").target
    try:
        model = (random_model(resolve_config(args.target_config), seed=args.seed) if args.target_config
                 else load_pretrained(name, progress=not args.quiet, cache_dir=args.cache_dir))
    except (ValueError, OSError) as error:
        return _error(str(error))
    queries = args.query_tokens or (1, 2, 4, 9)
    context, batch = (args.contexts or (128,))[0], (args.batch_sizes or (1,))[0]
    rows = compare_linear_kernels(model, queries, context=context, batch=batch, rounds=args.repeats or 5, seed=args.seed)
    print(f"{name}, batch {batch}, context {context}, {torch.get_num_threads()} threads, float32: "
          f"median ms per forward, kernels alternating round by round")
    print(f"{'q':>3} {'torch':>9} {'onednn':>9} {'torch/onednn':>13}")
    for row in rows:
        print(f"{row['query_tokens']:>3} {row['torch_ms']:>9.1f} {row['onednn_ms']:>9.1f} {row['torch_over_onednn']:>13.2f}")
    print(json.dumps({"command": "profile linear", "ok": True, "model": name, "batch": batch, "context": context,
                      "threads": torch.get_num_threads(), "rows": rows}))
    return 0


def run_profile(args) -> int:
    """Run `profile [run]`, `profile show` or `profile linear` from parsed arguments; returns the exit code."""
    if getattr(args, "profile_action", "run") == "show":
        return _show(args)
    if args.profile_action == "linear":
        return _linear(args)
    if getattr(args, "engine", "hf") == "vllm":
        from ..integrations.vllm.profile import run_vllm_profile

        return run_vllm_profile(args)
    return _run(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="adaptive-spec")
    sub = parser.add_subparsers(dest="command")
    add_profile_commands(sub)
    args = parser.parse_args(argv)
    if args.command != "profile":
        parser.print_help()
        return 2
    return run_profile(args)


if __name__ == "__main__":
    sys.exit(main())
