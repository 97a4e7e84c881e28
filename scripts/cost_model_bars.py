"""Simulated bars of a cost model that relearns the machine's prices: goodput started from a wrong
profile against goodput given the machine's own, and the policy's relative price error of K = 1..6
against K = 0, for each online correction (cells, shared).

    python scripts/cost_model_bars.py --host hf --batch 1 4 16
    python scripts/cost_model_bars.py --host vllm --batch 1 4 16 --save results

Scenarios (true costs = profile A; the controller given):
  scaled      A with draft x1.3 and verify cost per token x0.8
  other       another machine's / configuration's profile
  none        no profile (the generic shape)
  change      A, while the machine's draft gets x1.3 slower after `--change-at` steps; compared with
              an informed controller whose cost model switches to the new costs at the same step
Simulated seconds come from profiles: this is not wall-clock timing. `--save` writes a result file
(kind cost-model-bars) that `python -m adaptive_spec.report` renders in docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from adaptive_spec.control.cost_model import CostModel
from adaptive_spec.control.online_cost import cost_model_for
from adaptive_spec.control.registry import make_policy
from adaptive_spec.results.result_file import add_save_option, result_document, save_result
from adaptive_spec.simulation import load_traces, simulate
from adaptive_spec.simulation.price_error import ClockChange, scaled_profile

ROOT = Path(__file__).resolve().parents[1]
HOSTS = {  # profile A (the machine), the other profile, the traces
    "hf": ("profiles/cpu-2core-qwen-coder-fp32-int8draft.json", "profiles/cpu-2core-qwen-coder-fp32.json"),
    "vllm": ("profiles/cpu-2core-vllm-qwen-coder-fp32.json", "profiles/cpu-2core-xeon-vllm-qwen-coder-fp32.json"),
}
TRACES = ["traces/int8-draft/qwen-coder-code-t0.csv", "traces/int8-draft/qwen-coder-chat-t0.csv"]


class _Switching:
    """The informed controller's cost model under a clock change: one model before, another after."""

    def __init__(self, before: CostModel, after: CostModel, at: int):
        self._models, self._at, self._seen = (before, after), at, 0

    def __getattr__(self, name):
        return getattr(self._models[self._seen >= self._at], name)

    def observe(self, record) -> None:
        self._seen += 1
        self._models[self._seen >= self._at].observe(record)


def _run(traces, machine, costs, batch, requests, host, change=None):
    policy = make_policy("goodput", cost_model=costs)
    return simulate(traces, machine, policy, batch_size=batch, num_requests=requests, host=host,
                    clock_profile=machine, clock_change=change, price_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", choices=sorted(HOSTS), default="hf")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--min-steps", type=int, default=2000)
    parser.add_argument("--change-at", type=int, default=1000)
    parser.add_argument("--kinds", default="cells,shared")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a shared-model option (e.g. cusum_slack=1.0), for tuning; repeatable")
    add_save_option(parser)
    args = parser.parse_args()
    options = {name: float(value) for name, _, value in (item.partition("=") for item in args.set)}
    rows = [row for batch in args.batch for row in _bars(args, batch, options)]
    if args.save:
        document = result_document("cost-model-bars", args, {"host": args.host, "profile": HOSTS[args.host][0],
                                                             "other_profile": HOSTS[args.host][1], "traces": TRACES,
                                                             "rows": rows})
        document["command"] = "python scripts/cost_model_bars.py " + shlex.join(sys.argv[1:])
        save_result(args.save, f"cost-model-bars-{args.host}", document)


def _bars(args, batch: int, options: dict) -> list[dict]:
    """One row per (cost model kind, start) at this batch size, and one per kind for the clock change."""
    traces = load_traces([str(ROOT / t) for t in TRACES])
    machine = json.loads((ROOT / HOSTS[args.host][0]).read_text())
    other = json.loads((ROOT / HOSTS[args.host][1]).read_text())
    given = {"scaled": scaled_profile(machine, draft=1.3, verify_per_token=0.8), "other": other, "none": None}
    slower = scaled_profile(machine, draft=1.3)
    # enough requests for min_steps steps: measure one informed run's steps per request
    probe = _run(traces, machine, CostModel.from_profile(machine), batch, 16 * batch, args.host)
    requests = int(16 * batch * args.min_steps / probe["steps"] * 1.1) + 1
    informed = _run(traces, machine, CostModel.from_profile(machine), batch, requests, args.host)
    change = ClockChange(args.change_at, slower)
    informed_change = _run(traces, machine, _Switching(CostModel.from_profile(machine), CostModel.from_profile(slower),
                                                       args.change_at), batch, requests, args.host, change)
    base = informed["tokens_per_s"]
    print(f"host {args.host}, batch {batch}: {requests} requests, {informed['steps']} steps; informed goodput "
          f"{base} tok/s (price error after 300: {informed['price_error'].get('after_300')})")
    rows = []
    for kind in args.kinds.split(","):
        own = options if kind == "shared" else {}
        for name, profile in given.items():
            report = _run(traces, machine, cost_model_for(profile, kind, whole_step=args.host == "vllm", **own),
                          batch, requests, args.host)
            error = report["price_error"].get("after_300", {})
            rows.append({"batch": batch, "kind": kind, "start": name, "steps": report["steps"], "requests": requests,
                         "ratio": round(report["tokens_per_s"] / base, 4), "tokens_per_s": report["tokens_per_s"],
                         "informed_tokens_per_s": base, "price_error_after_300": error,
                         "events": report.get("cost_model_events")})
            print(f"  {kind:<6} given {name:<6}: {rows[-1]['ratio']:.3f}x informed ({report['tokens_per_s']} tok/s); "
                  f"price error after 300 steps mean {error.get('mean')} p90 {error.get('p90')} max {error.get('max')}; "
                  f"events {report.get('cost_model_events')}")
        report = _run(traces, machine, cost_model_for(machine, kind, **own), batch, requests, args.host, change)
        error = report["price_error"]
        ours = error.get("tokens_per_s_from_change_300")
        theirs = informed_change["price_error"].get("tokens_per_s_from_change_300")
        rows.append({"batch": batch, "kind": kind, "start": f"draft x1.3 at step {args.change_at}", "steps": report["steps"],
                     "requests": requests, "ratio": round(ours / theirs, 4), "tokens_per_s": ours,
                     "informed_tokens_per_s": theirs, "steps_to_3pct": error.get("steps_to_3pct"),
                     "price_error_after_300": error.get("after_change_300"), "events": report.get("cost_model_events")})
        print(f"  {kind:<6} draft x1.3 at step {args.change_at}: goodput from 300 steps after it "
              f"{ours / theirs:.3f}x the informed controller's ({ours} / {theirs} tok/s); steps until the price "
              f"error stays within 3%: {error.get('steps_to_3pct')}; after 300: {error.get('after_change_300')}; "
              f"events {report.get('cost_model_events')}")
    return rows


if __name__ == "__main__":
    main()
