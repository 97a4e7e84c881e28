"""`adaptive-spec bench`: plain Hugging Face decoding, HF assisted generation and engine policies on
the same prompts, in one process, side by side.

Configurations: `hf-plain`, `hf-assisted`, `hf-heuristic` (Hugging Face's own implementations; the
assisted ones need a draft model) and any engine policies by name. `POLICY@START` starts that
policy's cost model from START instead of `--profile` (a profile or learned-state file, `none` or
`auto`; the acceptance warm start stays `--profile`'s), so one run compares starts that differ in
their costs alone: `goodput@none,goodput@profiles/mine.json`. A `+no-jump` suffix runs that lane's
engine without jump-forward (grammar-forced tokens are then drafted like any other), to measure it.

Stream: the prompts in the order the prompt options give them, or, with `--mix humaneval:8,sharegpt:8`,
one stream interleaving the workloads round robin in the order named (HumanEval 1, ShareGPT 1,
HumanEval 2, ...; a workload that runs out drops out), as one server would see them arrive. Prompt i
of the stream is sampled with seed `--seed` + i in every configuration.

What persists: per temperature, each engine configuration gets one policy object and one engine,
made before the stream starts and kept for all of it, as in a long-running server: what the policy
learns (goodput's acceptance prior, its online cost corrections) carries over from prompt to prompt
and workload to workload. Each temperature starts afresh, and warm-up (one short untimed run per
configuration, since first calls allocate and pick kernels) uses a throwaway engine and policy.

Regimes:
  batch 1 (default): prompts run one at a time, configurations interleaved prompt by prompt (every
    configuration on prompt 1, then on prompt 2, ...), so slow drift of a shared machine spreads over
    all configurations instead of biasing the last ones.
  --batch-size B: a closed loop per configuration: B requests in flight in the engine (continuous
    batching), each finished one replaced by the next of the stream; configurations interleaved step
    by step. tokens/s = generated tokens / the configuration's summed step time. Per workload, a
    step's time is split evenly over the requests it served. TPOT p50 / p99 (ms): per request, the
    whole time of its configuration's steps after its first, over the tokens they emitted.
    Hugging Face's `generate` cannot join and leave requests mid-batch, so its baselines are skipped.

Order: at batch 1 prompt i runs the configurations rotated by i (prompt 1: A B C, prompt 2: B C A,
...), and in the closed loop round r of steps starts at configuration r mod n, so each is first and
last equally often. `--repeats N` serves the whole stream N times (each pass with fresh sampling
seeds: pass r samples prompt i with seed `--seed` + r * prompts + i), the lanes kept throughout.

Ratios, per temperature: to `hf-plain` (batch 1), and to the best static k, where `off` and every
`static:K` in the run count as static: per workload to that workload's best static configuration,
overall to the best single static configuration over the whole stream. Below the table, each
configuration's ratio to the best static configuration and to `off`, with a 95% paired bootstrap
interval over the prompts (`adaptive_spec.results.intervals`; a prompt's passes are summed first),
marked `*` where the interval excludes 1.0. The last stdout line is one JSON document; `--save`
writes it with the machine, versions and per-prompt figures as a result file (`results.result_file`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import platform
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from ..control import make_policy, with_tpot_target
from ..control.price_sweep import sweep_summary, with_sweep
from ..control.online_cost import learned_summary, print_learned
from ..profiling.profile_file import load_profile
from ..results.comparisons import compare, format_intervals, rotated
from ..results.result_file import add_save_option, result_document, save_result
from ..control.policy import StaticPolicy
from ..engine import SpecEngine
from .common import (add_learning_options, add_model_options, add_prompt_options, add_structured_options,
                     cost_model_kind, draft_precision, encode_all, gather_mix, gather_prompts, prompt_grammars,
                     load_models, parse_mix, policy_factory, print_json_line, save_learned, stop_ids, summarize)
from ..integrations.vllm.bench import DEFAULT_CONFIGS as VLLM_DEFAULT_CONFIGS
from ..integrations.vllm.bench import add_vllm_bench_options, run_vllm_bench
from ..sampling.grammar import Grammar
from ..sampling.params import SamplingParams

DEFAULT_POLICIES = "off,static:1,static:2,static:3,static:4,static:5,static:6"
# Hugging Face's own decoding: plain, assisted with its default settings (20 draft tokens, constant
# schedule, confidence threshold 0.4), and assisted with its heuristic schedule from 5 (+2 / -1),
# reset per call ("heuristic_transient") so prompts do not leak state into each other.
HF_CONFIGS = {
    "hf-plain": {},
    "hf-assisted": {},
    "hf-heuristic": {"num_assistant_tokens": 5, "num_assistant_tokens_schedule": "heuristic_transient"},
}
WARMUP_TOKENS = 16


def add_bench_command(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="tokens/s of HF decoding and engine policies, side by side",
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_options(parser)
    add_prompt_options(parser)
    parser.add_argument("--mix", default=None, metavar="SOURCE:N,...",
                        help="one stream of workloads interleaved round robin, e.g. humaneval:8,sharegpt:8 "
                             "(sources: humaneval, sharegpt, prompts = the --prompts file); replaces "
                             "--humaneval/--sharegpt/--prompt")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="requests in flight per configuration (closed loop); above 1 the HF baselines are skipped")
    parser.add_argument("--policies", default=DEFAULT_POLICIES,
                        help="comma-separated engine policies; POLICY@START (a profile file, a learned state or "
                             "none) starts that lane's cost model there, so one run compares cost-model starts")
    parser.add_argument("--profile", default="auto",
                        help="latency profile for goodput: a file (a profile or a learned state), 'auto' or 'none'")
    add_learning_options(parser)
    add_structured_options(parser)
    parser.add_argument("--temperatures", default="0,0.7", help="comma-separated; 0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baselines")
    parser.add_argument("--output-json", default=None, help="write the full record here")
    parser.add_argument("--repeats", type=int, default=1, metavar="N",
                        help="serve the whole stream N times (fresh sampling seeds per pass); intervals sum a "
                             "prompt's passes")
    add_save_option(parser)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                        help="hf: this project's engine and Hugging Face; vllm: vLLM with and without the plug-in")
    add_vllm_bench_options(parser)


@dataclass(frozen=True)
class Arrival:
    """One prompt of the stream."""

    index: int  # place in the whole stream, all passes
    workload: str
    prompt_id: str
    ids: list[int]
    seed: int
    prompt_index: int = 0  # place in one pass: what intervals pair configurations on
    repeat: int = 0
    grammar: Grammar | None = None  # what its output must match (None: free text)


@dataclass
class Tally:
    """What one configuration did on one workload at one temperature."""

    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    results: list = field(default_factory=list)  # engine results, for acceptance figures
    # Closed loop: each request's seconds per output token after its first step (TPOT), over the
    # steps of its own configuration it was in (the configurations' steps interleave; each is timed alone).
    tpots: list = field(default_factory=list)


def run_bench(args) -> int:
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    mix = parse_mix(args.mix) if args.mix else None
    if mix is None and not (args.prompt or args.prompts or args.humaneval or args.sharegpt or args.structured):
        args.humaneval, args.sharegpt = 3, 3
    if mix:
        labelled = round_robin([[(name, prompt) for prompt in prompts] for name, prompts in gather_mix(args, mix)])
    else:
        labelled = [("prompts" if p.source == args.prompts else p.source, p) for p in gather_prompts(args)]
    grammars = prompt_grammars(args, [p for _, p in labelled])  # a malformed one fails before any model loads
    structured = _structured(args, grammars)
    if args.engine == "vllm":
        if any(g is not None and g.kind != "json_schema" for g in grammars):
            raise ValueError("bench --engine vllm holds requests to JSON schemas (--json-schema, --json or the "
                             "prompts' own); for regex, choice and grammar use --engine hf")
        cost_model_kind(args)  # a contradictory --cost-model / --save-learned fails before any model loads
        if args.batch_size != 1:
            raise ValueError("--batch-size is for --engine hf; with --engine vllm, load the engine with --rate R")
        if args.policies == DEFAULT_POLICIES:
            args.policies = VLLM_DEFAULT_CONFIGS
        prompts = [_with_schema(p, g) for (_, p), g in zip(labelled, grammars)]
        return run_vllm_bench(args, prompts if mix else _interleave_sources(prompts), structured)
    if args.save_steps:
        raise ValueError("--save-steps logs the steps of the vLLM scheduler plug-in (--engine vllm)")
    cost_model_kind(args)  # a contradictory --cost-model / --save-learned fails before any model loads
    for start in {lane_parts(p.strip())[1] for p in args.policies.split(",")} - {"", "none", "auto"}:
        load_profile(start)  # a missing or corrupt POLICY@FILE fails now, too
    loaded = load_models(args)
    encoded = encode_all([p for _, p in labelled], loaded.tokenizer, chat=not args.no_chat)
    one_pass = list(zip(labelled, encoded, grammars))
    stream = [Arrival(repeat * len(one_pass) + i, workload, prompt.id, ids, args.seed + repeat * len(one_pass) + i, i,
                      repeat, grammar)
              for repeat in range(args.repeats) for i, ((workload, prompt), ids, grammar) in enumerate(one_pass)]
    workloads = list(dict.fromkeys(a.workload for a in stream))
    stops = stop_ids(loaded.tokenizer, loaded.target)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    hf_configs = ["hf-plain"] + (["hf-assisted", "hf-heuristic"] if loaded.draft_model is not None else [])
    configs = [] if args.no_hf else hf_configs
    if configs and structured:
        print(f"[structured output: Hugging Face generate has no grammar here; skipping {', '.join(configs)}]",
              file=sys.stderr)
        configs = []
    if configs and args.batch_size > 1:
        print(f"[batch size {args.batch_size}: Hugging Face generate cannot replace finished requests "
              f"mid-batch; skipping {', '.join(configs)}]", file=sys.stderr)
        configs = []
    configs += [p.strip() for p in args.policies.split(",") if p.strip()]
    if not configs:
        raise ValueError("nothing to run: give --policies, or drop --no-hf")
    cost_model = policy_factory(args, loaded)
    lane_class = {name: (HFLane if name in HF_CONFIGS else EngineLane) for name in configs}
    for name in configs:  # warm-up on throwaway lanes: first calls allocate and pick kernels
        warm = lane_class[name](name, loaded, stops, args, 0.0, cost_model)
        warm.warm_up(stream[0].ids[:WARMUP_TOKENS], args.batch_size)

    rows, best_static, intervals, lanes_by_temperature = [], {}, {}, {}
    with tqdm(total=len(temperatures) * len(stream) * len(configs), desc="bench", file=sys.stderr) as progress:
        for temperature in temperatures:
            lanes = {name: lane_class[name](name, loaded, stops, args, temperature, cost_model) for name in configs}
            order = list(lanes.values())
            if args.batch_size == 1:
                for arrival in stream:
                    for one in rotated(order, arrival.index):
                        one.serve_alone(arrival)
                        progress.update()
            else:
                for one in order:
                    one.open(stream, args.batch_size)
                turn = 0
                while any(one.busy for one in order):
                    for one in rotated(order, turn):
                        if one.busy:
                            progress.update(one.step())
                    turn += 1
            measured = _rows(lanes, temperature, workloads, args.batch_size)
            best_static[str(temperature)] = _add_ratios(measured, {n for n, one in lanes.items() if one.static})
            intervals[str(temperature)] = compare({name: one.prompts for name, one in lanes.items()})
            lanes_by_temperature[temperature] = lanes
            rows += measured

    _print_table(rows, workloads)
    print(format_intervals(intervals))
    print_learned(rows)
    single = len(temperatures) == 1
    document = {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "threads": torch.get_num_threads()},
        "settings": {"target": loaded.target_name, "draft": loaded.draft_name, "dtype": args.dtype,
                     "draft_dtype": draft_precision(args), "prompts": [a.prompt_id for a in stream],
                     "workloads": [a.workload for a in stream], "mix": dict(mix) if mix else None,
                     "max_new_tokens": args.max_new_tokens, "top_p": args.top_p, "batch_size": args.batch_size,
                     "structured": structured,
                     "repeats": args.repeats},
        "runs": rows,
        # temperature -> config -> ratios to the best static configuration and to off, with paired
        # 95% bootstrap intervals over prompts (adaptive_spec.results.comparisons.compare).
        "intervals": intervals,
        # temperature -> scope ("overall" or a workload) -> the fastest static configuration there.
        "best_static": best_static,
        # One temperature: config -> tokens/s. Several: "config@temperature" -> tokens/s.
        "tokens_per_s": {(r["config"] if single else f"{r['config']}@{r['temperature']}"): r["tokens_per_s"]
                         for r in rows},
    }
    if args.output_json:
        with open(args.output_json, "w") as handle:
            json.dump(document, handle, indent=1)
    if args.save:
        _save(args, document, lanes_by_temperature, cost_model)
    save_learned(args, cost_model, loaded)
    print_json_line(document)
    return 0


def _save(args, document: dict, lanes_by_temperature: dict, cost_model) -> None:
    """The printed document as a result file, each run with its per-prompt figures and, for engine
    lanes, its steps: [batch, K, longest context, measured seconds, the profile's prediction]."""
    predictor = cost_model() if any(getattr(one, "steps", None) for lanes in lanes_by_temperature.values()
                                    for one in lanes.values()) else None
    runs = []
    for row in document["runs"]:
        lane = lanes_by_temperature[row["temperature"]][row["config"]]
        run = {**row, "prompts": lane.prompts}
        if getattr(lane, "steps", None):
            run["step_times"] = [step + [round(predictor.step_seconds(step[0], step[2], step[1]), 6) if predictor else None]
                            for step in lane.steps]
        runs.append(run)
    label = f"bench-hf-batch{args.batch_size}"
    save_result(args.save, label, result_document("bench", args, {**document, "engine": "hf", "runs": runs}))


class HFLane:
    """A Hugging Face baseline: stateless, one prompt at a time."""

    static = False

    def __init__(self, name: str, loaded, stops: tuple[int, ...], args, temperature: float, cost_model=None):
        self.assistant = None if name == "hf-plain" else loaded.draft_model
        self.schedule = HF_CONFIGS[name]
        self.loaded, self.stops, self.args, self.temperature = loaded, stops, args, temperature
        self.tallies: dict[str, Tally] = {}
        self.prompts: list[dict] = []  # per-prompt figures (see _prompt_record)

    def warm_up(self, ids: list[int], batch_size: int) -> None:
        self._generate(ids, 4, 0)

    def serve_alone(self, arrival: Arrival) -> None:
        started = time.perf_counter()
        tokens = self._generate(arrival.ids, self.args.max_new_tokens, arrival.seed)
        seconds = time.perf_counter() - started
        tally = self.tallies.setdefault(arrival.workload, Tally())
        tally.seconds += seconds
        tally.requests += 1
        tally.tokens += tokens
        self.prompts.append(_prompt_record(arrival, tokens, seconds))

    def _generate(self, ids: list[int], max_new_tokens: int, seed: int) -> int:
        torch.manual_seed(seed)
        sampling = dict(do_sample=True, temperature=self.temperature, top_p=self.args.top_p) \
            if self.temperature > 0 else dict(do_sample=False)
        stops = self.stops
        with torch.no_grad():
            out = self.loaded.target.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens, eos_token_id=list(stops) or None,
                pad_token_id=stops[0] if stops else None, assistant_model=self.assistant, **self.schedule, **sampling)
        return out.shape[1] - len(ids)


class EngineLane:
    """One engine configuration at one temperature: a policy and an engine kept for the whole stream,
    so the policy learns from every prompt before the next (see the module docstring)."""

    def __init__(self, name: str, loaded, stops: tuple[int, ...], args, temperature: float, cost_model):
        self.name, self.stops, self.args, self.temperature = name, stops, args, temperature
        spec, start, jump_forward = lane_parts(name)
        if start:  # this lane's cost model starts from its own profile (see the module docstring)
            cost_model = functools.partial(cost_model, profile=start)
        policy = with_tpot_target(make_policy(spec, cost_model), args.slo_tpot, only_goodput=True)
        self.policy = with_sweep(policy, args.calibrate, only_cost_readers=True)
        self.static = isinstance(self.policy, StaticPolicy)
        # A lane that never drafts runs without the draft, as plain decoding would: with it, every
        # request would pay the draft's prefill for nothing.
        drafter = None if self.static and self.policy.k == 0 else _own_drafter(loaded)
        self.engine = SpecEngine(loaded.target, drafter, policy=self.policy,
                                 max_batch_size=args.batch_size, seed=args.seed, jump_forward=jump_forward)
        self.tokenizer, self.vocab_size = loaded.tokenizer, loaded.target.config.vocab_size
        self.tallies: dict[str, Tally] = {}
        self.prompts: list[dict] = []  # per-prompt figures (see _prompt_record)
        self.steps: list[list] = []  # [batch, K, longest context, measured seconds] per engine step
        self._record_steps()
        self._seconds: dict[int, float] = {}  # closed loop: each request's share of its steps' time
        self._decoding: dict[int, list] = {}  # ... and [whole seconds, tokens] of its steps after its first
        self.peak_batch = 0  # most requests one step served
        self._stream: list[Arrival] = []
        self._next = self._in_flight = 0

    def warm_up(self, ids: list[int], batch_size: int) -> None:
        params = SamplingParams(temperature=0.0, max_new_tokens=4, seed=0, stop_token_ids=self.stops)
        self.engine.generate([ids] * batch_size, params)

    def serve_alone(self, arrival: Arrival) -> None:
        started = time.perf_counter()
        result = self.engine.generate([arrival.ids], self._params(arrival))[0]
        seconds = time.perf_counter() - started
        self._finish(arrival, result, seconds).seconds += seconds

    def _record_steps(self) -> None:
        """Log every step the engine reports to the policy, for predicted-vs-measured step times."""
        observe = self.policy.observe

        def logged(record):
            self.steps.append([record.batch_size, record.batch_k, max(record.context_lengths, default=0),
                               round(record.total_seconds, 6)])
            observe(record)

        self.policy.observe = logged

    # --- closed loop -------------------------------------------------------------------------
    def open(self, stream: list[Arrival], batch_size: int) -> None:
        self._stream, self._next, self._in_flight, self.batch_size = stream, 0, 0, batch_size

    @property
    def busy(self) -> bool:
        return self._next < len(self._stream) or self._in_flight > 0

    def step(self) -> int:
        """Top the batch up from the stream, run one engine step; returns how many requests finished."""
        started = time.perf_counter()
        while self._next < len(self._stream) and self._in_flight < self.batch_size:
            arrival = self._stream[self._next]
            self.engine.add_request(arrival.ids, self._params(arrival), request_id=str(arrival.index))
            self._next += 1
            self._in_flight += 1
        outputs = self.engine.step()
        seconds = time.perf_counter() - started
        served = {output.request_id for output in outputs}
        self.peak_batch = max(self.peak_batch, len(served))
        for request_id in served:
            index = int(request_id)
            self._tally(self._stream[index]).seconds += seconds / len(served)
            self._seconds[index] = self._seconds.get(index, 0.0) + seconds / len(served)
        for output in outputs:
            # its first step prefilled it and emitted its first tokens; each later one it waits for whole
            decoding = self._decoding.get(int(output.request_id))
            if decoding is None:
                self._decoding[int(output.request_id)] = [0.0, 0]
            else:
                decoding[0], decoding[1] = decoding[0] + seconds, decoding[1] + len(output.new_token_ids)
        finished = [output for output in outputs if output.finished]
        for output in finished:
            index = int(output.request_id)
            tally = self._finish(self._stream[index], output.result, self._seconds.pop(index, 0.0))
            decoding, tokens = self._decoding.pop(index, [0.0, 0])
            if tokens:
                tally.tpots.append(decoding / tokens)
                self.prompts[-1]["tpot_ms"] = round(1000 * decoding / tokens, 3)
            self._in_flight -= 1
        return len(finished)

    # --- helpers -----------------------------------------------------------------------------
    def _params(self, arrival: Arrival) -> SamplingParams:
        # compiled once per (grammar, tokenizer) and cached; each request gets its own matcher
        constraint = None if arrival.grammar is None else arrival.grammar.constraint(self.tokenizer, self.vocab_size)
        return SamplingParams(temperature=self.temperature, top_p=self.args.top_p if self.temperature > 0 else 1.0,
                              max_new_tokens=self.args.max_new_tokens, seed=arrival.seed, stop_token_ids=self.stops,
                              constraint=constraint)

    def _tally(self, arrival: Arrival) -> Tally:
        return self.tallies.setdefault(arrival.workload, Tally())

    def _finish(self, arrival: Arrival, result, seconds: float) -> Tally:
        if result.error:
            raise RuntimeError(f"{self.name}: prompt {arrival.prompt_id}: {result.error}")
        tally = self._tally(arrival)
        tally.requests += 1
        tally.tokens += len(result.token_ids)
        tally.results.append(result)
        stats = result.stats
        self.prompts.append(_prompt_record(arrival, len(result.token_ids), seconds, drafted=stats.drafted,
                                           accepted=stats.accepted, k_per_step=list(stats.k_per_step),
                                           accepted_per_step=list(stats.accepted_per_step), masks=stats.masks,
                                           mask_seconds=round(stats.mask_seconds, 6), forced=stats.forced))
        return tally


def lane_parts(name: str) -> tuple[str, str, bool]:
    """`POLICY[@START][+no-jump]` -> (policy, start or "", jump-forward on)."""
    base, plus, modifier = name.rpartition("+")
    jump_forward = not (plus and modifier == "no-jump")
    spec, _, start = (name if jump_forward else base).partition("@")
    return spec, start.strip(), jump_forward


def _prompt_record(arrival: Arrival, tokens: int, seconds: float, **figures) -> dict:
    """One prompt's figures in one configuration. Closed loop: seconds = its share of the steps it was in."""
    return {"index": arrival.prompt_index, "repeat": arrival.repeat, "prompt_id": arrival.prompt_id,
            "workload": arrival.workload, "tokens": tokens, "seconds": round(seconds, 6),
            "tokens_per_s": round(tokens / seconds, 3) if seconds > 0 else None, **figures}


def _own_drafter(loaded):
    """A draft model is shared (each engine wraps it in its own cache); a drafter object keeps
    per-request state, and engines of a closed loop run side by side, so each gets its own copy."""
    if loaded.draft is None or loaded.draft_model is not None:
        return loaded.draft
    return copy.deepcopy(loaded.draft)


def _rows(lanes: dict, temperature: float, workloads: list[str], batch_size: int) -> list[dict]:
    rows = []
    for name, lane in lanes.items():
        tallies = [lane.tallies.get(w, Tally()) for w in workloads]
        merged = Tally(sum(t.requests for t in tallies), sum(t.tokens for t in tallies),
                       sum(t.seconds for t in tallies), [r for t in tallies for r in t.results],
                       [x for t in tallies for x in t.tpots])
        row = {"config": name, "temperature": temperature, **_figures(merged),
               "workloads": {w: _figures(t) for w, t in zip(workloads, tallies)}}
        if batch_size > 1:
            row["peak_batch"] = lane.peak_batch
        learned = learned_summary(getattr(getattr(lane, "policy", None), "cost_model", None))
        if learned:
            row["cost_model"] = learned
        sweep = sweep_summary(getattr(lane, "policy", None))
        if sweep:
            row["calibration"] = sweep
        rows.append(row)
    return rows


def _structured(args, grammars: list) -> str | None:
    """What constrained the requests: the option as typed, or how many prompts carried their own
    schema (None: free text, --free-text included)."""
    for option in ("json_schema", "regex", "choice", "grammar"):
        if getattr(args, option, None) is not None:
            return f"--{option.replace('_', '-')} {getattr(args, option)}"
    if getattr(args, "json", False):
        return "--json"
    own = sum(g is not None for g in grammars)
    return f"own json_schema ({own} of {len(grammars)} prompts)" if own else None


def _with_schema(prompt, grammar):
    """The prompt as vLLM's bench sends it: carrying the JSON schema its requests are held to."""
    schema = None if grammar is None else json.loads(grammar.source)
    return dataclasses.replace(prompt, json_schema=schema)


def _figures(tally: Tally) -> dict:
    figures = {"requests": tally.requests, "tokens": tally.tokens, "seconds": round(tally.seconds, 3),
               "tokens_per_s": round(tally.tokens / tally.seconds, 3) if tally.seconds > 0 else None}
    if tally.results:
        stats = summarize(tally.results, tally.seconds)
        figures.update(acceptance_rate=stats["acceptance_rate"], mean_acceptance_length=stats["mean_acceptance_length"])
        masks, mask_seconds = sum(r.stats.masks for r in tally.results), sum(r.stats.mask_seconds for r in tally.results)
        if masks:  # a grammar's cost: per mask computed, per token emitted, and its share of the time
            figures.update(masks=masks, mask_ms_per_mask=round(1000 * mask_seconds / masks, 4),
                           mask_ms_per_token=round(1000 * mask_seconds / max(tally.tokens, 1), 4),
                           mask_share=round(mask_seconds / tally.seconds, 5) if tally.seconds > 0 else None,
                           forced_share=round(sum(r.stats.forced for r in tally.results) / max(tally.tokens, 1), 4))
    if tally.tpots:
        figures.update({f"tpot_p{q}_ms": round(1000 * float(np.percentile(tally.tpots, q)), 2) for q in (50, 99)})
    return figures


def _add_ratios(rows: list[dict], static: set[str]) -> dict[str, str]:
    """Set ratio_to_hf_plain and ratio_to_best_static overall (best static over the whole stream) and
    per workload (that workload's best static); returns scope -> the best static configuration."""
    best_names = {}
    for scope in ["overall"] + list(rows[0]["workloads"]):
        figures = {r["config"]: (r if scope == "overall" else r["workloads"][scope]) for r in rows}
        plain = figures.get("hf-plain", {}).get("tokens_per_s")
        statics = [name for name in figures if name in static and figures[name]["tokens_per_s"]]
        best = max(statics, key=lambda name: figures[name]["tokens_per_s"], default=None)
        if best:
            best_names[scope] = best
        for name, f in figures.items():
            if f["tokens_per_s"] is None:
                continue
            if plain:
                f["ratio_to_hf_plain"] = round(f["tokens_per_s"] / plain, 3)
            if best:
                f["ratio_to_best_static"] = round(f["tokens_per_s"] / figures[best]["tokens_per_s"], 3)
    return best_names


def _print_table(rows: list[dict], workloads: list[str]) -> None:
    header = (f"{'temp':>5} {'config':<14} {'workload':<10} {'tokens':>7} {'sec':>8} {'tok/s':>8} {'x hf':>6} "
              f"{'x stat':>6} {'accept':>7} {'len':>6} {'TPOT50':>7} {'TPOT99':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        scopes = [("all", r)] + ([(w, r["workloads"][w]) for w in workloads] if len(workloads) > 1 else [])
        for label, f in scopes:
            print(f"{r['temperature'] if label == 'all' else '':>5} {r['config'] if label == 'all' else '':<14} "
                  f"{label:<10} {f['tokens']:>7} {f['seconds']:>8.2f} {_cell(f['tokens_per_s'], 8)} "
                  f"{_cell(f.get('ratio_to_hf_plain'), 6)} {_cell(f.get('ratio_to_best_static'), 6)} "
                  f"{_cell(f.get('acceptance_rate'), 7)} {_cell(f.get('mean_acceptance_length'), 6)} "
                  f"{_cell(f.get('tpot_p50_ms'), 7, 0)} {_cell(f.get('tpot_p99_ms'), 7, 0)}")


def _cell(value, width: int, digits: int = 2) -> str:
    return f"{value:>{width}.{digits}f}" if isinstance(value, (int, float)) else f"{'-':>{width}}"


def round_robin(queues: list[list]) -> list:
    """First of each queue, then the second of each, ...; a queue that runs out drops out."""
    return [queue[i] for i in range(max(map(len, queues), default=0)) for queue in queues if i < len(queue)]


def _interleave_sources(prompts):
    """HumanEval, ShareGPT, HumanEval, ...: so a trace or a cut-short run mixes code and prose."""
    by_source: dict[str, list] = {}
    for prompt in prompts:
        by_source.setdefault(prompt.source, []).append(prompt)
    return round_robin(list(by_source.values()))
