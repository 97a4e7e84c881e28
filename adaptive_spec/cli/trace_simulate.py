"""`adaptive-spec trace` (record acceptance traces from real models) and `adaptive-spec simulate`
(replay traces through a policy with a cost profile's step times). The last stdout line of each is
one JSON document.

    adaptive-spec trace --pair qwen-coder --prompts FILE.jsonl --max-new-tokens 64 --temperature 0 --out TRACE.csv
    adaptive-spec simulate --trace TRACE.csv --profile PROFILE.json --policy goodput --batch-size 4
    adaptive-spec simulate --trace TRACE.csv --profile PROFILE.json --policy static:2 --rate 2 --num-requests 1000
    adaptive-spec simulate --trace TRACE.csv --profile PROFILE.json --policy oracle
    adaptive-spec simulate --trace TRACE.csv --profile PROFILE.json --policies off,static:2,goodput,oracle
    adaptive-spec simulate --trace TRACE.csv --profile PROFILE.json --policies off,static:2,goodput --save results

With --policies the table is followed by each policy's ratio to the best static policy and to off,
with a 95% paired bootstrap interval over the simulated requests (all policies replay the same
requests with the same uniforms; a request's seconds are its share of the steps it was in). `--save`
writes a result file (`adaptive_spec.results.result_file`): the printed document with per-request
figures. Simulated seconds come from the profile, not a clock, so a saved simulation is not exposed
to timing contention on the machine that ran it.

Trace format, replay semantics, the oracle and the other ceilings: `adaptive_spec.simulation`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..results.comparisons import compare, format_intervals
from ..results.result_file import add_save_option, result_document, save_result
from .common import add_model_options, add_prompt_options, add_sampling_options, print_json_line
from .cost_options import add_cost_model_options, cost_model_options, load_profiles

__all__ = ["add_trace_commands", "run_trace", "run_simulate"]

CEILINGS_HELP = """ceilings (policy names the simulator builds from the traces themselves):
  oracle                 hindsight-best k per step from the realised outcomes (exact at batch 1, a bound above)
  request-static-oracle  each request's best fixed k in hindsight, run through the batch loop
  confidence-oracle      per step, the K of best expected goodput from the trace's true acceptance probabilities
  confidence-bound       batch 1: least expected time with acceptance read off the draft's confidence through
                         the best map in hindsight, future confidences known (what that signal can buy, at most)"""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the help, and the ceilings' epilog kept as written."""


def add_trace_commands(subparsers) -> None:
    trace = subparsers.add_parser("trace", help="record an acceptance trace (target output + per-position accept probabilities)",
                                  formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_options(trace)
    add_prompt_options(trace)
    add_sampling_options(trace)
    trace.add_argument("--out", required=True, help="trace file to write (CSV with a JSON header line)")
    trace.add_argument("--workload", default=None, help="a label stored in the metadata (default: from the prompt source)")
    trace.add_argument("--sharegpt-max-chars", type=int, default=1500, help="longest ShareGPT prompt, in characters")
    trace.add_argument("--gen-policy", default="static:2", help="engine policy used to generate the outputs (exact either way)")
    trace.add_argument("--gen-batch-size", type=int, default=4, help="engine batch size while generating")

    sim = subparsers.add_parser("simulate", help="replay traces through a policy with a profile's step costs",
                                formatter_class=_HelpFormatter, epilog=CEILINGS_HELP)
    sim.add_argument("--trace", action="append", required=True, help="trace file (repeatable; requests are pooled)")
    sim.add_argument("--profile", required=True,
                     help="cost profile JSON (see `adaptive-spec profile`); none = the policy starts from a generic "
                          "shape (needs --clock-profile)")
    sim.add_argument("--clock-profile", default=None, metavar="PROFILE",
                     help="time the steps with this profile instead (the machine the policy runs on, when --profile, "
                          "the policy's, describes another): how a foreign or stale profile fares, corrected online")
    sim.add_argument("--policy", default="goodput", help="a policy name (off, static:K, goodput, ...) or a ceiling (below)")
    sim.add_argument("--policies", default=None,
                     help="comma-separated policies and ceilings, run on the same requests and shown as a table "
                          "(replaces --policy)")
    sim.add_argument("--batch-size", type=int, default=None,
                     help="closed loop: concurrent requests (default 1); with --rate: the max batch size (default 64)")
    sim.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals, requests per second")
    sim.add_argument("--num-requests", type=int, default=None, help="requests to simulate (default: the traces' count)")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--save-acceptance", default=None, metavar="FILE",
                     help="after a goodput run, save its learned acceptance prior and calibration here; saved "
                          "as PROFILE's `<name>.acceptance.json`, `--profile auto` starts goodput from it")
    sim.add_argument("--warm-start", default="none", metavar="{none,auto,FILE}",
                     help="start goodput from a saved acceptance state, as the engine does from beside its profile: "
                          "auto = PROFILE's `<name>.acceptance.json` if there is one, FILE = that file (an error if it "
                          "is missing or malformed), none = learn from the usual prior")
    sim.add_argument("--max-k", type=int, default=16, help="cap on any k, as the engine's max_k")
    sim.add_argument("--host", choices=("auto", "hf", "vllm"), default="auto",
                     help="whose step loop to imitate: hf (this project's engine: stops drafts inside the step, the "
                          "draft keeps up at k = 0) or vllm (the plug-in: a lazy draft that catches up on what it missed "
                          "at the profile's catch-up cost, ragged steps at the profile's shares, dropped drafts' "
                          "forwards charged as kept ones); auto = the profile's engine")
    sim.add_argument("--prefill-seconds-per-token", type=float, default=0.0,
                     help="charge this per prompt token at admission (0: decode-only tokens/s; profiles do not "
                          "measure prefill; ~0.02 fits qwen-coder fp32 on a 2-core CPU)")
    add_save_option(sim)
    add_cost_model_options(sim)


def run_simulate(args) -> int:
    from ..profiling.profile_file import ProfileError, profile_engine
    from ..simulation import load_traces, simulate

    traces = load_traces(args.trace)
    profile, clock_profile, policy_profile = load_profiles(args)
    warm_start = _warm_start(args.warm_start, args.profile)
    batch = args.batch_size if args.batch_size is not None else (64 if args.rate is not None else 1)
    host = args.host if args.host != "auto" else profile_engine(profile)
    policies = [p.strip() for p in (args.policies or "").split(",") if p.strip()] or [args.policy]
    if args.save_acceptance:
        if args.policies or args.rate is not None:
            raise ValueError("--save-acceptance takes one goodput --policy, closed loop")
        policies = [_learning_policy(args.policy, profile, warm_start)]
    reports = []
    for policy in policies:
        try:
            report = simulate(traces, policy_profile, policy, batch_size=batch, rate=args.rate,
                              num_requests=args.num_requests, seed=args.seed, max_k=args.max_k,
                              prefill_seconds_per_token=args.prefill_seconds_per_token, host=host,
                              clock_profile=clock_profile, warm_start=warm_start,
                              per_request=bool(args.save or args.policies),
                              **cost_model_options(args, clock_profile or profile))
        except ProfileError as error:
            raise ValueError(str(error)) from None
        report["traces"] = list(args.trace)
        report["profile"] = profile.get("name")
        reports.append(report)
    if args.policies:
        print(f"batch={batch}{' rate=' + str(args.rate) if args.rate else ''}, {reports[0]['num_requests']} requests, "
              f"profile {profile.get('name')}, host {host}")
        _print_table(reports)
        per_request = [report.pop("requests", None) for report in reports]
        intervals = {"all": compare({r["policy"]: p for r, p in zip(reports, per_request) if p})}
        print(format_intervals(intervals, "total tokens / total simulated seconds", "requests"))
        document = {"traces": list(args.trace), "profile": profile.get("name"), "batch_size": batch,
                    "rate": args.rate, "runs": reports, "intervals": intervals,
                    "tokens_per_s": {r["policy"]: r["tokens_per_s"] for r in reports}}
        _save(args, document, per_request, host)
        print_json_line(document)
        return 0
    if args.save_acceptance:
        from ..profiling.profile_file import save_acceptance

        saved = save_acceptance(args.save_acceptance, policies[0].state(),
                                {"traces": [Path(t).name for t in args.trace], "profile": profile.get("name"),
                                 "policy": report["policy"], "batch_size": batch, "seed": args.seed})
        print(f"[acceptance state saved: {saved}]", file=sys.stderr)
    lat = ", ".join(f"p{q} {report[f'latency_p{q}']:.3f}s" for q in (50, 90, 99) if report.get(f"latency_p{q}") is not None)
    print(f"{report['policy']} batch={batch}{' rate=' + str(args.rate) if args.rate else ''}: "
          f"{report['tokens_per_s']} tokens/s over {report['num_requests']} requests"
          f"{' (upper bound)' if report.get('oracle') == 'upper-bound' else ''}; {lat}; "
          f"acceptance {report['acceptance_rate']}, mean acceptance length {report['mean_acceptance_length']}; "
          f"k histogram {report['k_histogram']}", file=sys.stderr)
    requests = report.pop("requests", None)
    _save(args, {**report, "runs": [dict(report)]}, [requests], host)
    print_json_line(report)
    return 0


def _save(args, document: dict, per_request: list, host: str) -> None:
    """With --save: the printed document as a result file, each run with its simulated requests."""
    if not args.save:
        return
    from ..simulation import load_trace

    temperatures = sorted({float(load_trace(path).meta.get("sampling", {}).get("temperature", 0)) for path in args.trace})
    runs = [{**run, "config": run["policy"], "temperature": temperatures[0] if len(temperatures) == 1 else None,
             **({"prompts": requests} if requests else {})} for run, requests in zip(document["runs"], per_request)]
    traces = "+".join(Path(path).stem for path in args.trace)
    label = f"simulate-{traces}-{host}-batch{runs[0]['batch_size']}" + (f"-rate{args.rate:g}" if args.rate else "")
    save_result(args.save, label, result_document("simulate", args, {**document, "runs": runs,
                                                                    "temperatures": temperatures}))


def _warm_start(choice: str, profile_path: str) -> dict | None:
    """The goodput state `--warm-start` names (see its help)."""
    from ..profiling.profile_file import acceptance_path, load_acceptance

    if choice == "none":
        return None
    path = acceptance_path(profile_path) if choice == "auto" else Path(choice)
    if choice == "auto" and not path.is_file():
        print(f"[no acceptance state beside the profile ({path.name}): goodput starts cold]", file=sys.stderr)
        return None
    if not path.is_file():
        raise ValueError(f"--warm-start: no such file {str(path)!r}")
    state = load_acceptance(path)
    if state is None:
        raise ValueError(f"--warm-start: {str(path)!r} is not an acceptance state (see --save-acceptance)")
    print(f"[acceptance warm start: {path}]", file=sys.stderr)
    return state


def _learning_policy(spec: str, profile: dict, warm_start: dict | None):
    """The policy object of a --save-acceptance run: it must have a state to save (learned on top of
    `warm_start`, if given)."""
    from ..control import make_policy
    from ..simulation.simulator import cost_model_from

    policy = make_policy(spec, cost_model=cost_model_from(profile))
    if not hasattr(policy, "state"):
        raise ValueError(f"--save-acceptance needs a policy that learns acceptance (goodput), not {spec!r}")
    if warm_start:
        policy.load_state(warm_start)
    return policy


def _print_table(reports: list[dict]) -> None:
    header = (f"{'policy':<22} {'tok/s':>9} {'accept':>7} {'len':>6} {'p50 s':>8} {'p99 s':>8} "
              f"{'TPOT p50':>9} {'p99 ms':>7}")
    print(header)
    print("-" * len(header))
    for r in reports:
        note = "  (upper bound)" if r.get("oracle") == "upper-bound" else ""
        print(f"{r['policy']:<22} {_cell(r['tokens_per_s'], 9)} {_cell(r['acceptance_rate'], 7)} "
              f"{_cell(r['mean_acceptance_length'], 6)} {_cell(r['latency_p50'], 8)} {_cell(r['latency_p99'], 8)} "
              f"{_ms(r.get('tpot_p50'), 9)} {_ms(r.get('tpot_p99'), 7)}{note}")


def _ms(seconds, width: int) -> str:
    return f"{seconds * 1000:>{width}.0f}" if isinstance(seconds, (int, float)) else f"{'-':>{width}}"


def _cell(value, width: int) -> str:
    return f"{value:>{width}.3f}" if isinstance(value, (int, float)) else f"{'-':>{width}}"


def run_trace(args) -> int:
    from ..assets import load_sharegpt
    from .common import draft_precision, encode_all, gather_prompts, load_models, sampling_params, stop_ids

    prompts = []
    if args.prompt or args.prompts or args.humaneval:
        sharegpt, args.sharegpt = args.sharegpt, 0
        prompts += gather_prompts(args)
        args.sharegpt = sharegpt
    if args.sharegpt:
        prompts += load_sharegpt(args.sharegpt, seed=args.seed, max_prompt_chars=args.sharegpt_max_chars)
    if not prompts:
        raise ValueError("no prompts: give --prompt, --prompts FILE.jsonl, --humaneval N or --sharegpt N")
    from ..simulation.recorder import record_trace
    from ..simulation.trace_file import save_trace

    loaded = load_models(args)
    ids = encode_all(prompts, loaded.tokenizer, chat=not args.no_chat)
    stops = stop_ids(loaded.tokenizer, loaded.target)
    params = [sampling_params(args, stops, seed=args.seed + i) for i in range(len(ids))]
    sources = sorted({p.source for p in prompts})
    meta = {"target": loaded.target_name, "draft": loaded.draft_name,
            "workload": args.workload or "+".join(sources), "prompt_sources": sources,
            "chat_template": not args.no_chat, "cpu_linear": args.cpu_linear}
    if loaded.draft_model is not None:  # the draft's precision moves its confidences and acceptance
        meta["draft_dtype"] = draft_precision(args)
    trace = record_trace(loaded.target, loaded.draft, ids, params, [p.id for p in prompts], meta,
                         policy=args.gen_policy, max_batch_size=args.gen_batch_size, seed=args.seed,
                         progress=lambda i, n: print(f"teacher-forced {i}/{n}", file=sys.stderr))
    path = save_trace(trace, args.out)
    summary = trace.summary()
    print(f"wrote {path}: {summary['requests']} requests, {summary['positions']} positions, "
          f"mean accept_prob {summary['mean_accept_prob']}", file=sys.stderr)
    print_json_line({"out": str(path), **summary, "teacher_forcing_mismatches": trace.meta["teacher_forcing_mismatches"],
                     "recording_seconds": trace.meta["recording_seconds"]})
    return 0
