"""`adaptive-spec bench --engine vllm`: vLLM without speculation, vLLM's own draft-length schedules and
our policies, on the same prompts, side by side in one run.

Configurations:
  vllm-off        vLLM with no speculative decoding (its own engine: the target alone);
  vllm-static:K   vLLM's own dynamic mode with one K for every batch size;
  vllm-table      vLLM's batch-size table (`num_speculative_tokens_per_batch_size`), here the same
                  schedule as this project's `batch-table` preset: K = 4, 3, 2, 1 at batch 1, 2-3,
                  4-7, 8, and 0 above 8;
  any policy name (goodput, heuristic, ...) runs through the scheduler plug-in.
All speculative configurations share one engine (the draft model loaded once, `num_speculative_tokens`
= the largest K any of them uses); between runs the scheduler is switched, so they differ only in
who chooses the draft length. vllm-off needs an engine without a drafter and runs first, alone:
it is paired with the others prompt by prompt but not interleaved with them in time, so slow drift
of the machine between its pass and theirs lands in its ratios (and their intervals cannot see it).

Regimes: `--rate 0` (default) runs each prompt alone (batch 1), prompts interleaved across the
speculative configurations, their order rotated prompt by prompt (prompt 1: A B C, prompt 2: B C A,
...) so drift over a prompt hits all alike; `--rate R` replays one seeded Poisson arrival trace at R
requests/s through each configuration in turn (the order rotated pass by pass). `--repeats N` serves
the stream N times, pass r with sampling seeds shifted by r * requests; under load every pass replays
the same arrival trace, and a configuration's tokens/s is its tokens over the sum of its passes'
spans (first arrival to last token). Requests are fed
through vLLM's engine loop (`LLMEngine.add_request` / `step`) in this process, and every token is
time-stamped when its step returns: TTFT = first token - arrival, TPOT = (last - first) / (tokens - 1),
ITL = gaps between a request's successive steps that emitted tokens. Acceptance is counted by the
scheduler plug-in in every speculative configuration. With more than one workload (HumanEval and
ShareGPT prompts), each row also gives per-workload speed and TPOT, and every figure is compared with
vllm-off and with the best static configuration (vllm-off or a vllm-static:K) in the same scope.

Intervals (`adaptive_spec.results.comparisons`): each configuration's ratio to the best static one
and to vllm-off with a 95% paired bootstrap interval, `*` where it excludes 1.0. At batch 1 the pairs
are prompts and the ratio is of total tokens over total request seconds, the headline tok/s. Under
load the pairs are requests (request j of the same arrival trace in both configurations, the same
prompt), and the ratio is of total tokens over total request seconds (arrival to last token, summed):
tokens per request-second, how fast requests were served, not the span-based headline tok/s, which
has no per-request share to resample. The last stdout line is one JSON document; `--save` writes it
with per-request figures as a result file.
"""

from __future__ import annotations

import json
import platform
import random
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from ...assets import encode_prompt
from ...control.cost_model import CostModel
from ...control.online_cost import learned_summary, print_learned, resolve_kind
from ...control.price_sweep import sweep_summary, with_sweep
from ...control.registry import make_policy, with_tpot_target
from ...profiling.profile_file import load_profile
from ...results.comparisons import compare, format_intervals, rotated
from ...results.result_file import result_document, save_result
from .controller import ControllerSettings, LearnedStateSaver, SpecController
from .engine import EngineSpec, make_llm
from .profile import find_vllm_profile, start_line

VLLM_TABLE = [(1, 1, 4), (2, 3, 3), (4, 7, 2), (8, 8, 1), (9, 1024, 0)]
DEFAULT_CONFIGS = "vllm-off,vllm-static:3,vllm-static:5,vllm-table,goodput"


@dataclass
class RequestTiming:
    arrival: float
    workload: str = ""  # the prompt's source (humaneval, sharegpt, ...)
    token_times: list[float] = field(default_factory=list)  # one entry per emitted token
    event_times: list[float] = field(default_factory=list)  # one entry per step that emitted tokens
    index: int = 0  # the prompt (batch 1) or the request of the arrival trace (under load)
    repeat: int = 0  # the pass of --repeats


def add_vllm_bench_options(parser) -> None:
    group = parser.add_argument_group("vLLM engine (--engine vllm)")
    group.add_argument("--rate", type=float, default=0.0,
                       help="Poisson arrivals per second (0 = each prompt alone, batch 1)")
    group.add_argument("--num-requests", type=int, default=0,
                       help="requests in the Poisson trace (default: the prompts once)")
    group.add_argument("--max-k", type=int, default=0, help="num_speculative_tokens (default: the largest K used)")
    group.add_argument("--threads", type=int, default=None,
                       help="compute threads (default: vLLM binds all cores; use 1 on a shared machine)")
    group.add_argument("--max-num-seqs", type=int, default=16)
    group.add_argument("--save-steps", default=None, metavar="FILE",
                       help="write one JSON line per engine step of every configuration run through the "
                            "scheduler plug-in (rows' verified and drafting lengths, draft positions, "
                            "catch-up and prefill tokens, measured and predicted seconds); "
                            "`python -m adaptive_spec.results.steps FILE` summarises it")
    group.add_argument("--url", default=None,
                       help="drive a running OpenAI-compatible server instead (e.g. http://127.0.0.1:8000/v1); "
                            "--policies and the engine options then do not apply")
    group.add_argument("--api-key", default=None, help="with --url: the server's API key")
    group.add_argument("--model", default=None, help="with --url: the served model name (default: its only one)")


def run_vllm_bench(args, prompts, structured: str | None = None) -> int:
    """`prompts` may carry JSON schemas (vLLM's structured outputs then hold their requests to them);
    `structured` says what set them, for the result's settings."""
    if args.url:
        if args.save_steps:
            raise ValueError("--save-steps logs this process's engine steps; a server run with --url has none here")
        from .client_bench import run_client_bench

        return run_client_bench(args, prompts)
    configs = [c.strip() for c in args.policies.split(",") if c.strip()]
    pair = args.pair or ("qwen-coder" if not args.target else None)
    base = EngineSpec.for_pair(pair) if pair else EngineSpec(args.target, args.draft)
    if args.draft:
        base = EngineSpec(base.target, None if args.draft == "none" else args.draft)
    found = find_vllm_profile(EngineSpec(base.target, base.drafter, dtype=args.dtype, threads=args.threads))
    args.auto_profile = str(found) if found is not None else None
    if _profile_path(args):
        load_profile(_profile_path(args))  # a missing or corrupt profile fails before any model loads
    for config in configs:  # an unknown policy, or a lane's missing or corrupt start, too
        name, _, start = config.partition("@")
        if not name.startswith("vllm-"):
            make_policy(name, CostModel.default)
        if start.strip() not in ("", "none", "auto"):
            load_profile(start.strip())
    temperatures = [float(t) for t in args.temperatures.split(",")]
    if any(not c.startswith("vllm-") for c in configs):
        print(start_line(args.profile, _profile_path(args)), file=sys.stderr)
    speculative = [c for c in configs if c != "vllm-off"]
    goodput = any(c.partition("@")[0] == "goodput" for c in configs)
    max_k = args.max_k or max([_static_k(c) for c in speculative] + [4, 5 if goodput else 0])
    # No prefix caching: configurations run the same prompts in turn, and a later one must not find
    # its prompts already cached by an earlier one (that favoured later configurations' TTFT).
    common = dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs, threads=args.threads, seed=args.seed,
                  prefix_caching=False)
    tokenizer = _tokenizer(base.target)
    prompt_ids = [encode_prompt(tokenizer, p, chat=not args.no_chat) for p in prompts]
    workloads = [p.source for p in prompts]
    schemas = [p.json_schema for p in prompts]
    trace = _arrivals(args.rate, args.num_requests or len(prompt_ids), args.seed)
    rows = []
    if "vllm-off" in configs:
        llm = make_llm(EngineSpec(base.target, None, **common))
        rows += _run_configs(llm, ["vllm-off"], prompt_ids, workloads, schemas, trace, temperatures, args)
        del llm
        _collect()
    controllers: list[SpecController] = []
    if speculative:
        llm = make_llm(EngineSpec(base.target, base.drafter, max_k=max_k, **common))
        rows += _run_configs(llm, speculative, prompt_ids, workloads, schemas, trace, temperatures, args, controllers)
    if getattr(args, "save_steps", None):
        _save_steps(args.save_steps, controllers)
    _add_ratios(rows)
    _print_table(rows)
    print_learned(rows)
    per_request = [row.pop("prompts") for row in rows]
    intervals = {str(t): compare({r["config"]: p for r, p in zip(rows, per_request) if r["temperature"] == t})
                 for t in temperatures}
    print(format_intervals(intervals) if args.rate <= 0 else
          format_intervals(intervals, "total tokens / total request seconds (arrival to last token)", "requests"))
    document = {
        "engine": "vllm", "machine": _machine(),
        "settings": {"profile": _profile_path(args), "target": base.target, "drafter": base.drafter, "dtype": args.dtype, "max_k": max_k,
                     "prompts": [p.id for p in prompts], "max_new_tokens": args.max_new_tokens,
                     "rate": args.rate, "requests": len(trace), "threads": args.threads, "seed": args.seed,
                     "vllm_table": VLLM_TABLE, "repeats": args.repeats,
                     "structured": structured},
        "runs": rows,
        "intervals": intervals,  # temperature -> config -> paired ratios (see the module docstring)
    }
    if args.output_json:
        with open(args.output_json, "w") as handle:
            json.dump(document, handle, indent=1)
    if args.save:
        label = f"bench-vllm-{'batch1' if args.rate <= 0 else f'rate{args.rate:g}'}"
        runs = [{**row, "prompts": prompts} for row, prompts in zip(rows, per_request)]
        save_result(args.save, label, result_document("bench", args, {**document, "runs": runs}))
    if getattr(args, "save_learned", None):
        _save_learned(args, controllers)
    sys.stdout.write(json.dumps(document, sort_keys=True) + "\n")
    return 0


# --- running ------------------------------------------------------------------------------------
def _run_configs(llm, configs, prompt_ids, workloads, schemas, trace, temperatures, args,
                 kept: list | None = None) -> list[dict]:
    """Each configuration keeps one controller per temperature across all its prompts, as a server
    keeps its policy: what it learns (acceptance priors, online cost corrections) carries over.
    `kept` gathers the controllers, for --save-learned."""
    from .scheduler import scheduler_of

    scheduler = scheduler_of(llm) if configs != ["vllm-off"] else None
    _activate(scheduler, configs[0], _controller(configs[0]))
    _run(llm, [prompt_ids[0][:16]], [0.0], 0.0, 4, 0, schemas=schemas[:1])  # warm-up (a grammar compiles here)
    rows = []
    for temperature in temperatures:
        kind = resolve_kind(getattr(args, "cost_model", None), bool(getattr(args, "save_learned", None)))
        calibrate, slo_tpot = getattr(args, "calibrate", 0.0), getattr(args, "slo_tpot", 0.0)
        controllers = {c: _controller(c, _lane_profile(c, args), kind, calibrate, slo_tpot) for c in configs}
        for config, controller in controllers.items():
            if controller is not None and getattr(args, "save_steps", None):
                controller.step_log, controller.log_label = [], {"config": config, "temperature": temperature}
        if kept is not None:
            kept += [c for c in controllers.values() if c is not None]
        results = {c: [] for c in configs}
        repeats = getattr(args, "repeats", 1)
        if args.rate <= 0:  # batch 1: interleaved prompt by prompt, the order rotated
            for repeat in range(repeats):
                for index, ids in enumerate(prompt_ids):
                    turn = repeat * len(prompt_ids) + index
                    for config in rotated(configs, turn):
                        _activate(scheduler, config, controllers[config])
                        with _tagged(controllers[config], prompt=index, repeat=repeat):
                            results[config] += _passed(_run(llm, [ids], [0.0], temperature, args.max_new_tokens,
                                                            args.seed + turn, [workloads[index]], [schemas[index]]),
                                                       repeat, index)
                    print(f"[t={temperature} pass {repeat + 1}/{repeats} prompt {index + 1}/{len(prompt_ids)} done]",
                          file=sys.stderr)
        else:
            requests = [prompt_ids[i % len(prompt_ids)] for i in range(len(trace))]
            labels = [workloads[i % len(prompt_ids)] for i in range(len(trace))]
            held = [schemas[i % len(prompt_ids)] for i in range(len(trace))]
            for repeat in range(repeats):
                for config in rotated(configs, repeat):
                    _activate(scheduler, config, controllers[config])
                    with _tagged(controllers[config], repeat=repeat):
                        results[config] += _passed(_run(llm, requests, trace, temperature, args.max_new_tokens,
                                                        args.seed + repeat * len(trace), labels, held), repeat)
                    print(f"[{config} t={temperature} pass {repeat + 1}/{repeats} trace done]", file=sys.stderr)
        for config in configs:
            rows.append(_summary(config, temperature, results[config], controllers[config], args.rate))
    return rows


@contextmanager
def _tagged(controller: SpecController | None, **tags):
    """Tag the steps a controller logs meanwhile (--save-steps) with the prompt / pass they served."""
    log = getattr(controller, "step_log", None)
    start = len(log) if log is not None else 0
    try:
        yield
    finally:
        for entry in (log or [])[start:]:
            entry.update(tags)


def _save_steps(path: str, controllers: list[SpecController]) -> None:
    """--save-steps: every logged step of every configuration, one JSON line each."""
    logged = [c for c in controllers if c.step_log is not None]
    with open(path, "w") as handle:
        for controller in logged:
            for entry in controller.step_log:
                handle.write(json.dumps({**controller.log_label, **entry}) + "\n")
    print(f"[steps: {sum(len(c.step_log) for c in logged)} of {len(logged)} configurations -> {path}]", file=sys.stderr)


def _passed(timings: list[RequestTiming], repeat: int, index: int | None = None) -> list[RequestTiming]:
    """Label a run's timings with its pass (and, at batch 1, its prompt)."""
    for timing in timings:
        timing.repeat = repeat
        if index is not None:
            timing.index = index
    return timings


def _run(llm, prompts, arrivals, temperature, max_tokens, seed, labels=None, schemas=None) -> list[RequestTiming]:
    """Feed requests at their arrival offsets through vLLM's engine loop; time-stamp every token.
    `schemas[i]`, where given, holds request i to that JSON schema through vLLM's structured outputs."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    schemas = schemas or [None] * len(prompts)
    params = [SamplingParams(temperature=temperature, top_p=1.0, max_tokens=max_tokens, seed=seed + i,
                             structured_outputs=_structured_outputs(schemas[i]))
              for i in range(len(prompts))]
    timings: dict[str, RequestTiming] = {}
    seen: dict[str, int] = {}
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and arrivals[pending[0]] <= now:
            i = pending.pop(0)
            request_id = f"bench-{time.monotonic_ns()}-{i}"
            engine.add_request(request_id, {"prompt_token_ids": prompts[i]}, params[i])
            timings[request_id] = RequestTiming(start + arrivals[i], labels[i] if labels else "", index=i)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(arrivals[pending[0]] - now, 0.05)))
            continue
        outputs = engine.step()
        stamp = time.perf_counter()
        for output in outputs:
            count = len(output.outputs[0].token_ids)
            new = count - seen.get(output.request_id, 0)
            if new > 0:
                seen[output.request_id] = count
                timing = timings[output.request_id]
                timing.token_times += [stamp] * new
                timing.event_times.append(stamp)
    return list(timings.values())


def _structured_outputs(schema: dict | None):
    """vLLM's form of a JSON schema (`{}`: any JSON), with no free whitespace, as our engine writes JSON."""
    if schema is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if not schema:
        return StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def _controller(config: str, profile: str | None = None, cost_model: str | None = None,
                calibrate: float = 0.0, slo_tpot: float = 0.0) -> SpecController | None:
    if config == "vllm-off":
        return None
    if config.startswith("vllm-"):
        return SpecController(make_policy("off"))  # vLLM chooses; this one only counts acceptance
    name = config.partition("@")[0]
    policy, model = ControllerSettings(name, profile, cost_model).build()  # as the plug-in builds it in a server
    policy = with_tpot_target(policy, slo_tpot, only_goodput=True)
    return SpecController(with_sweep(policy, calibrate, only_cost_readers=True), model)


def _lane_profile(config: str, args) -> str | None:
    """`POLICY@START`: this lane's cost model starts from START (a profile or learned state, `auto`
    as --profile auto finds one, `none`: generic), so one run compares starts on the same prompts;
    else --profile's."""
    start = config.partition("@")[2].strip()
    if not start:
        return _profile_path(args)
    return _resolve(start, args)


def _save_learned(args, controllers: list[SpecController]) -> None:
    """--save-learned: the learned state of the cost model that learned the most steps in the run."""
    models = [c.cost_model for c in controllers if hasattr(c.cost_model, "learned_state")]
    models = [m for m in models if m.observations > m.resumed_steps]
    if not models:
        print(f"[--save-learned: no policy learned step costs in this run; {args.save_learned} not written]",
              file=sys.stderr)
        return
    model = max(models, key=lambda m: m.observations - m.resumed_steps)
    path = _profile_path(args)
    LearnedStateSaver(model, args.save_learned, load_profile(path) if path else None).save()
    print(f"[learned cost state: {model.observations - model.resumed_steps} steps this run, {model.outliers} outliers, "
          f"{model.shifts} shifts -> {args.save_learned}]", file=sys.stderr)


def _activate(scheduler, config: str, controller: SpecController | None) -> None:
    if scheduler is None:
        return
    scheduler.use_controller(controller)
    if config.startswith("vllm-"):
        scheduler.use_vllm_schedule(VLLM_TABLE if config == "vllm-table" else [(1, 1024, _static_k(config))])


# --- numbers ------------------------------------------------------------------------------------
def _summary(config, temperature, timings, controller, rate) -> dict:
    tokens = sum(len(t.token_times) for t in timings)
    if rate > 0:  # each pass's span, first arrival to last token, summed over passes
        seconds = sum(_span([t for t in timings if t.repeat == repeat]) for repeat in {t.repeat for t in timings})
    else:  # batch 1: the sum of the requests' own times
        seconds = sum(_request_seconds(t) for t in timings)
    stats = controller.stats if controller is not None else None
    drafted, accepted = (stats.drafted, stats.accepted) if stats else (0, 0)
    steps = sum(stats.verified_histogram.values()) if stats else 0
    row = {"config": config, "temperature": temperature, "regime": f"poisson@{rate}/s" if rate > 0 else "batch-1",
           "requests": len(timings), "tokens": tokens, "seconds": round(seconds, 3),
           "tokens_per_s": round(tokens / seconds, 3) if seconds > 0 else None, **_latencies(timings),
           "prompts": [_request_record(t) for t in timings]}  # taken off the row before printing
    sweep = sweep_summary(getattr(controller, "policy", None))
    learned = learned_summary(getattr(controller, "cost_model", None))
    if learned:  # None for vllm-off and the vllm-* lanes (their controllers only count acceptance)
        row["cost_model"] = learned
    if sweep:
        row["calibration"] = sweep
    if drafted:
        row["acceptance_rate"] = round(accepted / drafted, 4)
    if steps:
        row["mean_acceptance_length"] = round((accepted + steps) / steps, 4)
    workloads = sorted({t.workload for t in timings if t.workload})
    if len(workloads) > 1:
        # Per workload, tokens per second of the requests' own time (arrival to last token): at batch 1
        # the same measure as tokens_per_s; under load, how fast that workload's requests were served.
        row["workloads"] = {}
        for workload in workloads:
            mine = [t for t in timings if t.workload == workload]
            own = sum(_request_seconds(t) for t in mine)
            count = sum(len(t.token_times) for t in mine)
            row["workloads"][workload] = {"requests": len(mine), "tokens": count,
                                          "tokens_per_request_s": round(count / own, 3) if own > 0 else None,
                                          **_latencies(mine, ("tpot",))}
    return row


def _span(timings: list[RequestTiming]) -> float:
    ends = [t.token_times[-1] for t in timings if t.token_times]
    return max(ends) - min(t.arrival for t in timings) if ends else 0.0


def _request_record(timing: RequestTiming) -> dict:
    """One request's figures for a result file: tokens over its own time, arrival to last token."""
    tokens, seconds = len(timing.token_times), _request_seconds(timing)
    record = {"index": timing.index, "repeat": timing.repeat, "workload": timing.workload, "tokens": tokens,
              "seconds": round(seconds, 6), "tokens_per_s": round(tokens / seconds, 3) if seconds > 0 else None}
    if timing.token_times:
        record["ttft_ms"] = round(1000 * (timing.token_times[0] - timing.arrival), 2)
    if tokens > 1:
        record["tpot_ms"] = round(1000 * (timing.token_times[-1] - timing.token_times[0]) / (tokens - 1), 2)
    return record


def _request_seconds(timing: RequestTiming) -> float:
    return timing.token_times[-1] - timing.arrival if timing.token_times else 0.0


def _latencies(timings, names=("ttft", "tpot", "itl")) -> dict:
    values = {
        "ttft": [t.token_times[0] - t.arrival for t in timings if t.token_times],
        "tpot": [(t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1)
                 for t in timings if len(t.token_times) > 1],
        "itl": [b - a for t in timings for a, b in zip(t.event_times, t.event_times[1:])],
    }
    out = {}
    for name in names:
        if values[name]:
            out[f"{name}_p50_ms"] = round(1000 * float(np.percentile(values[name], 50)), 1)
            out[f"{name}_p99_ms"] = round(1000 * float(np.percentile(values[name], 99)), 1)
    return out


def _add_ratios(rows) -> None:
    """Ratios to vLLM without speculation and to the best static configuration (vllm-off and every
    vllm-static:K run), overall and per workload, at each temperature."""
    for temperature in {r["temperature"] for r in rows}:
        here = [r for r in rows if r["temperature"] == temperature]
        _compare({r["config"]: r for r in here}, "tokens_per_s")
        for workload in {w for r in here for w in r.get("workloads", {})}:
            _compare({r["config"]: r["workloads"][workload] for r in here if workload in r.get("workloads", {})},
                     "tokens_per_request_s")


def _compare(figures: dict[str, dict], key: str) -> None:
    """One scope's figures by configuration: add each one's ratios of `key` to vllm-off and to the
    fastest static configuration."""
    speeds = {config: f[key] for config, f in figures.items() if f.get(key)}
    statics = {c: s for c, s in speeds.items() if c == "vllm-off" or c.startswith("vllm-static:")}
    best = max(statics, key=statics.get, default=None)
    for config, speed in speeds.items():
        if "vllm-off" in speeds:
            figures[config]["ratio_to_vllm_off"] = round(speed / speeds["vllm-off"], 3)
        if best:
            figures[config]["best_static"] = best
            figures[config]["ratio_to_best_static"] = round(speed / statics[best], 3)


def _print_table(rows) -> None:
    columns = (("x off", "ratio_to_vllm_off", 6), ("x best", "ratio_to_best_static", 6), ("TTFT50", "ttft_p50_ms", 7),
               ("TPOT50", "tpot_p50_ms", 7), ("TPOT99", "tpot_p99_ms", 7), ("ITL50", "itl_p50_ms", 7),
               ("ITL99", "itl_p99_ms", 7), ("accept", "acceptance_rate", 7))
    header = f"{'temp':>5} {'config':<16} {'tokens':>7} {'tok/s':>8} " + " ".join(f"{t:>{w}}" for t, _, w in columns)
    print(header)
    print("-" * len(header))

    def line(temperature, name, tokens, speed, figures):
        cells = " ".join(f"{figures[key]:>{w}.2f}" if isinstance(figures.get(key), (int, float)) else f"{'-':>{w}}"
                         for _, key, w in columns)
        print(f"{temperature:>5} {name:<16} {tokens:>7} {speed or 0:>8.2f} {cells}")

    for r in rows:
        line(r["temperature"], r["config"], r["tokens"], r["tokens_per_s"], r)
        for workload, figures in r.get("workloads", {}).items():  # tok/s here: per request-second
            line("", f"  {workload}", figures["tokens"], figures["tokens_per_request_s"], figures)


def _resolve(profile: str, args) -> str | None:
    if profile == "none":
        return None
    return getattr(args, "auto_profile", None) if profile == "auto" else profile


def _profile_path(args) -> str | None:
    """--profile as a vLLM profile file for our policies' cost model (its acceptance state beside
    it, if any, warm-starts goodput): 'auto' the one `find_vllm_profile` picked, 'none' learn costs
    online from the generic start."""
    return _resolve(args.profile, args)


def _static_k(config: str) -> int:
    if config.startswith("vllm-static:"):
        return int(config.split(":", 1)[1])
    return max(k for _, _, k in VLLM_TABLE) if config == "vllm-table" else 0


def _arrivals(rate: float, count: int, seed: int) -> list[float]:
    if rate <= 0:
        return [0.0] * count
    rng, now, out = random.Random(seed), 0.0, []
    for _ in range(count):
        out.append(now)
        now += rng.expovariate(rate)
    return out


def _tokenizer(target: str):
    from transformers import AutoTokenizer

    from ...assets import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(target, progress=False))


def _machine() -> dict:
    import os

    import torch
    import vllm

    return {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "vllm": vllm.__version__}


def _collect() -> None:
    import gc

    gc.collect()
