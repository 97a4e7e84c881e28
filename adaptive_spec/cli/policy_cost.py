"""`adaptive-spec policy-cost`: how long a policy's decision takes, per request per step.

Drives `choose`, the in-step `keep_drafting` calls (one per drafted position, as our engine makes
them) and `observe` with synthetic requests (i.i.d. acceptance, draft confidences uniform in
[0.3, 1]) at several batch sizes and reports microseconds per request per step; the decision must
stay well under 1% of a step. With `--profile` the policy plans with that machine's costs (its
choices, and so its work, follow them) and each figure is also given as a share of the profile's
one-token step at that batch size; the synthetic steps report the profile's times to `observe`.
"""

from __future__ import annotations

import argparse
import random
import time

from ..control import (AcceptanceHistory, CostModel, RequestOutcome, RequestView, StepRecord, adopt_stop_rule,
                       make_policy, run_stop_rule)
from ..control.online_cost import COST_MODELS, cost_model_for
from ..profiling.profile_file import load_profile
from .common import print_json_line


def add_policy_cost_command(subparsers) -> None:
    parser = subparsers.add_parser("policy-cost", help="microseconds per request per step of a policy's decision",
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--policy", default="goodput")
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--acceptance", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default=None, help="a profile JSON: plan with its costs, report shares of its step")
    parser.add_argument("--cost-model", choices=COST_MODELS, default="cells",
                        help="the online correction the policy's cost model runs (its observe is timed too)")


def run_policy_cost(args) -> int:
    rng = random.Random(args.seed)
    profile = load_profile(args.profile) if args.profile else None  # a ProfileError is a user error in main
    reference = CostModel.from_profile(profile) if profile else None  # uncorrected: the step a share is of
    results, shares = {}, {}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        costs = cost_model_for(profile, args.cost_model) if profile else None
        policy = make_policy(args.policy, cost_model=costs)
        stop_rule = adopt_stop_rule(policy)
        histories = [AcceptanceHistory() for _ in range(batch)]
        elapsed = 0.0
        for step in range(args.steps):
            views = [RequestView(f"r{i}", 200 + step, 500, 8, histories[i]) for i in range(batch)]
            started = time.perf_counter()
            ks = policy.choose(views)
            chose = time.perf_counter()
            if stop_rule is not None and max(ks):
                ks, seconds = _draft_with(stop_rule, ks, rng)
                elapsed += seconds
            outcomes = []
            for i, k in enumerate(ks):
                accepted = next((j for j in range(k) if rng.random() > args.acceptance), k)
                outcomes.append(RequestOutcome(f"r{i}", k, accepted, accepted + 1))
            k = max(ks)
            total = costs.step_seconds(batch, 200 + step, k) if costs else 0.065
            record = StepRecord(batch, k, tuple(200 + step for _ in ks), tuple(outcomes), 0.2 * total, 0.8 * total, total)
            observe_started = time.perf_counter()
            policy.observe(record)
            elapsed += (chose - started) + (time.perf_counter() - observe_started)
        results[str(batch)] = round(1e6 * elapsed / (args.steps * batch), 2)
        line = f"batch {batch:>4}: {results[str(batch)]:>8.2f} us per request per step"
        if costs:
            shares[str(batch)] = round(100 * elapsed / args.steps / reference.step_seconds(batch, 200, 0), 4)
            line += f" = {shares[str(batch)]:.3f}% of a one-token step"
        print(line)
    summary = {"policy": args.policy, "cost_model": args.cost_model, "steps": args.steps,
               "us_per_request_per_step": results}
    if profile:
        summary.update(profile=profile.get("name"), percent_of_one_token_step=shares)
    print_json_line(summary)
    return 0


def _draft_with(stop_rule, ks: list[int], rng: random.Random) -> tuple[list[int], float]:
    """Ask the stop rule at each position as the engine's draft loop does: (kept k per row, seconds
    spent inside the rule)."""
    seconds = 0.0

    def timed(position, shown):
        nonlocal seconds
        started = time.perf_counter()
        try:
            return stop_rule(position, shown)
        finally:
            seconds += time.perf_counter() - started

    kept, _ = run_stop_rule(timed, ks, lambda row, position: rng.uniform(0.3, 1.0))
    return kept, seconds
