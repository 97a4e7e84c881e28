"""`adaptive-spec bench`: plain Hugging Face decoding, HF assisted generation and engine policies on
the same prompts, in one process, side by side.

Configurations: `hf-plain`, `hf-assisted`, `hf-heuristic` (Hugging Face's own implementations; the
assisted ones need a draft model) and any engine policies by name.

Regime: batch size 1 (the latency regime where speculation can pay), prompts run one at a time.
Runs are interleaved prompt by prompt (every configuration on prompt 1, then on prompt 2, ...), so
slow drift of a shared machine spreads over all configurations instead of biasing the last ones.
Each configuration is warmed up once on a short untimed run. Ratios are to `hf-plain` measured in
the same run. The last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch
from tqdm import tqdm

from ..control import make_policy
from ..engine import SpecEngine
from .common import (add_model_options, add_prompt_options, encode_all, gather_prompts, load_models,
                     policy_factory, print_json_line, stop_ids, summarize)
from ..integrations.vllm.bench import DEFAULT_CONFIGS as VLLM_DEFAULT_CONFIGS
from ..integrations.vllm.bench import add_vllm_bench_options, run_vllm_bench
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


def add_bench_command(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="tokens/s of HF decoding and engine policies, side by side",
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_options(parser)
    add_prompt_options(parser)
    parser.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated engine policies")
    parser.add_argument("--profile", default="auto", help="latency profile for goodput: a file, 'auto' or 'none'")
    parser.add_argument("--temperatures", default="0,0.7", help="comma-separated; 0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baselines")
    parser.add_argument("--output-json", default=None, help="write the full record here")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                        help="hf: this project's engine and Hugging Face; vllm: vLLM with and without the plug-in")
    add_vllm_bench_options(parser)


def run_bench(args) -> int:
    if not (args.prompt or args.prompts or args.humaneval or args.sharegpt):
        args.humaneval, args.sharegpt = 3, 3
    prompts = gather_prompts(args)
    if args.engine == "vllm":
        if args.policies == DEFAULT_POLICIES:
            args.policies = VLLM_DEFAULT_CONFIGS
        return run_vllm_bench(args, _interleave_sources(prompts))
    loaded = load_models(args)
    prompt_ids = encode_all(prompts, loaded.tokenizer, chat=not args.no_chat)
    stops = stop_ids(loaded.tokenizer, loaded.target)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    hf_configs = ["hf-plain"] + (["hf-assisted", "hf-heuristic"] if loaded.draft_model is not None else [])
    configs = [] if args.no_hf else hf_configs
    configs += [p.strip() for p in args.policies.split(",") if p.strip()]

    cost_model = policy_factory(args, loaded)
    runners = {name: _runner(name, loaded, stops, args, cost_model) for name in configs}
    for name, run in runners.items():  # warm-up: first calls allocate and pick kernels
        run(prompt_ids[0][:16], 0.0, 4, 0)

    rows = []
    total = len(temperatures) * len(prompts) * len(configs)
    with tqdm(total=total, desc="bench", file=sys.stderr) as progress:
        for temperature in temperatures:
            measured = {name: {"tokens": 0, "seconds": 0.0, "results": []} for name in configs}
            for index, ids in enumerate(prompt_ids):
                for name in configs:
                    started = time.perf_counter()
                    tokens, result = runners[name](ids, temperature, args.max_new_tokens, args.seed + index)
                    measured[name]["seconds"] += time.perf_counter() - started
                    measured[name]["tokens"] += tokens
                    if result is not None:
                        measured[name]["results"].append(result)
                    progress.update()
            base = measured.get("hf-plain")
            for name in configs:
                m = measured[name]
                row = {"config": name, "temperature": temperature, "tokens": m["tokens"],
                       "seconds": round(m["seconds"], 3), "tokens_per_s": round(m["tokens"] / m["seconds"], 3)}
                if m["results"]:
                    stats = summarize(m["results"], m["seconds"])
                    row.update(acceptance_rate=stats["acceptance_rate"],
                               mean_acceptance_length=stats["mean_acceptance_length"])
                if base:
                    row["ratio_to_hf_plain"] = round(row["tokens_per_s"] / (base["tokens"] / base["seconds"]), 3)
                rows.append(row)

    _print_table(rows)
    single = len(temperatures) == 1
    document = {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "threads": torch.get_num_threads()},
        "settings": {"target": loaded.target_name, "draft": loaded.draft_name, "dtype": args.dtype,
                     "draft_dtype": args.draft_dtype or args.dtype, "prompts": [p.id for p in prompts],
                     "max_new_tokens": args.max_new_tokens, "top_p": args.top_p, "batch_size": 1},
        "runs": rows,
        # One temperature: config -> tokens/s. Several: "config@temperature" -> tokens/s.
        "tokens_per_s": {(r["config"] if single else f"{r['config']}@{r['temperature']}"): r["tokens_per_s"]
                         for r in rows},
    }
    if args.output_json:
        with open(args.output_json, "w") as handle:
            json.dump(document, handle, indent=1)
    print_json_line(document)
    return 0


def _runner(name: str, loaded, stops: tuple[int, ...], args, cost_model):
    """A callable (ids, temperature, max_new_tokens, seed) -> (generated tokens, GenerationResult | None).

    An engine policy is built once per configuration and kept across prompts, as in a long-running
    server: what it learns (acceptance priors, online cost corrections) carries over."""
    if name in HF_CONFIGS:
        assistant = None if name == "hf-plain" else loaded.draft_model
        schedule = HF_CONFIGS[name]

        def run_hf(ids, temperature, max_new_tokens, seed):
            torch.manual_seed(seed)
            sampling = dict(do_sample=True, temperature=temperature, top_p=args.top_p) if temperature > 0 else \
                dict(do_sample=False)
            with torch.no_grad():
                out = loaded.target.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                             max_new_tokens=max_new_tokens, eos_token_id=list(stops) or None,
                                             pad_token_id=stops[0] if stops else None, assistant_model=assistant,
                                             **schedule, **sampling)
            return out.shape[1] - len(ids), None

        return run_hf

    policy = make_policy(name, cost_model)

    def run_engine(ids, temperature, max_new_tokens, seed):
        engine = SpecEngine(loaded.target, loaded.draft, policy=policy, seed=seed)
        params = SamplingParams(temperature=temperature, top_p=args.top_p if temperature > 0 else 1.0,
                                max_new_tokens=max_new_tokens, seed=seed, stop_token_ids=stops)
        result = engine.generate([ids], params)[0]
        if result.error:
            raise RuntimeError(f"{name}: {result.error}")
        return len(result.token_ids), result

    return run_engine


def _print_table(rows: list[dict]) -> None:
    header = f"{'temp':>5} {'config':<14} {'tokens':>7} {'sec':>8} {'tok/s':>8} {'x hf':>6} {'accept':>7} {'len':>6}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['temperature']:>5} {r['config']:<14} {r['tokens']:>7} {r['seconds']:>8.2f} {r['tokens_per_s']:>8.2f} "
              f"{_cell(r.get('ratio_to_hf_plain'), 6)} {_cell(r.get('acceptance_rate'), 7)} "
              f"{_cell(r.get('mean_acceptance_length'), 6)}")


def _cell(value, width: int) -> str:
    return f"{value:>{width}.2f}" if isinstance(value, (int, float)) else f"{'-':>{width}}"


def _interleave_sources(prompts):
    """HumanEval, ShareGPT, HumanEval, ...: so a trace or a cut-short run mixes code and prose."""
    by_source: dict[str, list] = {}
    for prompt in prompts:
        by_source.setdefault(prompt.source, []).append(prompt)
    queues = list(by_source.values())
    return [queue[i] for i in range(max(map(len, queues))) for queue in queues if i < len(queue)]
