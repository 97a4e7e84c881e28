"""`adaptive-spec generate`: stream completions, then report speed and acceptance."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from ..control import make_policy, with_tpot_target
from ..control.price_sweep import sweep_summary, with_sweep
from ..engine import SpecEngine
from .common import (add_model_options, add_policy_options, add_prompt_options, add_sampling_options,
                     add_structured_options, cost_model_kind, encode_all, gather_prompts, prompt_grammars,
                     load_models, policy_factory, print_json_line, sampling_params, save_learned, stop_ids, summarize)

DEFAULT_PROMPT = "Write a Python function that checks whether a string is a palindrome, with a docstring."


def add_generate_command(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate text with exact speculative decoding",
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_options(parser)
    add_prompt_options(parser, default_prompt=DEFAULT_PROMPT)
    add_sampling_options(parser)
    add_policy_options(parser, default="goodput")
    add_structured_options(parser)
    parser.add_argument("--no-jump-forward", action="store_true",
                        help="draft the tokens a grammar forces like any other, instead of taking them without a "
                             "draft slot (outputs are exact either way; for measuring what jump-forward gives)")
    parser.add_argument("--max-batch-size", type=int, default=8, help="requests decoded together")
    parser.add_argument("--output-json", default=None, help="write per-prompt ids, text and stats here")


def run_generate(args) -> int:
    prompts = gather_prompts(args)
    cost_model_kind(args)  # a contradictory --cost-model / --save-learned fails before any model loads
    grammars = prompt_grammars(args, prompts)  # a malformed one fails before any model loads
    loaded = load_models(args)
    tokenizer = loaded.tokenizer
    prompt_ids = encode_all(prompts, tokenizer, chat=not args.no_chat)
    params = sampling_params(args, stop_ids(tokenizer, loaded.target))
    # compiled once per grammar (cached); each request gets its own matcher from it
    constraints = [None if grammar is None else grammar.constraint(tokenizer, loaded.target.config.vocab_size)
                   for grammar in grammars]
    cost_model = policy_factory(args, loaded)
    policy = with_sweep(with_tpot_target(make_policy(args.policy, cost_model), args.slo_tpot), args.calibrate)
    engine = SpecEngine(loaded.target, loaded.draft, policy=policy, max_batch_size=args.max_batch_size,
                        seed=args.seed, jump_forward=not args.no_jump_forward)
    stream = len(prompts) == 1
    results, errors = {}, {}
    for index, (prompt, ids, constraint) in enumerate(zip(prompts, prompt_ids, constraints)):
        request_id = prompt.id if prompt.id not in results and prompt.id not in errors else f"{prompt.id}-{index}"
        try:
            engine.add_request(ids, dataclasses.replace(params, seed=args.seed + index, constraint=constraint),
                               request_id)
            results[request_id] = None
        except ValueError as error:
            errors[request_id] = str(error)
            print(f"error: {error}", file=sys.stderr)

    print(f"[{loaded.target_name} + {loaded.draft_name}, policy {engine.policy.name}, "
          f"{len(results)} prompt(s)]", file=sys.stderr)
    started = time.perf_counter()
    streamed_ids, streamed_text = [], ""
    while engine.has_unfinished:
        for out in engine.step():
            if stream and out.new_token_ids:  # decode the whole text so multi-token characters come out whole
                streamed_ids += out.new_token_ids
                text = tokenizer.decode(streamed_ids, skip_special_tokens=True)
                sys.stdout.write(text[len(streamed_text):])
                sys.stdout.flush()
                streamed_text = text
            if out.finished:
                results[out.request_id] = out.result
                if out.error:
                    print(f"\nerror in {out.request_id}: {out.error}", file=sys.stderr)
                if not stream:
                    text = tokenizer.decode(out.result.token_ids, skip_special_tokens=True)
                    print(f"\n--- {out.request_id} ({out.finish_reason}, {len(out.result.token_ids)} tokens)\n{text}")
    seconds = time.perf_counter() - started
    if stream:
        sys.stdout.write("\n")
    finished = [r for r in results.values() if r is not None]
    summary = summarize(finished, seconds)
    summary.update(policy=engine.policy.name, target=loaded.target_name, draft=loaded.draft_name,
                   prompt_errors=len(errors))
    sweep = sweep_summary(engine.policy)
    if sweep:
        summary["calibration"] = sweep
        took = "still sweeping" if sweep["seconds"] is None else f"{sweep['seconds']} s"
        print(f"[calibration: swept K = 0..{sweep['max_k']} over {sweep['steps']} steps ({took})]", file=sys.stderr)
    print(f"\n{summary['generated_tokens']} tokens in {seconds:.1f} s = {summary['tokens_per_s']} tokens/s; "
          f"acceptance rate {summary['acceptance_rate']}; mean acceptance length "
          f"{summary['mean_acceptance_length']} (bonus token included)", file=sys.stderr)
    if args.output_json:
        records = [_record(r, tokenizer) for r in finished]
        records += [{"request_id": rid, "error": message, "token_ids": [], "text": ""} for rid, message in errors.items()]
        with open(args.output_json, "w") as handle:
            json.dump({"summary": summary, "results": records}, handle, indent=1)
    save_learned(args, cost_model, loaded)
    print_json_line(summary)
    return 1 if errors or summary["errors"] else 0


def _record(result, tokenizer) -> dict:
    stats = result.stats
    return {
        "request_id": result.request_id, "token_ids": result.token_ids,
        "text": tokenizer.decode(result.token_ids, skip_special_tokens=True),
        "finish_reason": result.finish_reason, "error": result.error,
        "stats": {"drafted": stats.drafted, "accepted": stats.accepted, "steps": stats.steps,
                  "acceptance_rate": stats.acceptance_rate, "mean_acceptance_length": stats.mean_acceptance_length,
                  "k_per_step": list(stats.k_per_step), "accepted_per_step": list(stats.accepted_per_step),
                  "forced": stats.forced},
    }
