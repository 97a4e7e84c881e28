"""How well a cost model would have priced the steps of a real run: a replay of `--save-steps` logs.

    python -m adaptive_spec.results.price_replay FILE... --profile PROFILE [--drafting-side default,W,...]

Each configuration of each file is replayed in its own order through a fresh shared cost model
(`control.online_cost`, prior: PROFILE): every decode step is priced before the model learns it, as
the plug-in would price it, and then learned, with its wall time and its rows' lengths. Prefill steps
and steps that caught a lazy draft up are left out (the plug-in does not learn them as steps). The
price error is predicted / measured - 1, summarised per step kind (`results.steps`) and overall, for
each weight of a lag-mixed step's drafting side (`default`: the model's own by batch size,
`CostModel.drafting_weight`; a number: that weight at every batch size), over the second half of
each configuration's steps, once the model has learned from the first.

A log keeps each step's longest context only; every row is given it (the context term is small
next to a step's length terms on the profiles here). Pure numpy and pandas; no model is loaded.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

import pandas as pd

from ..control.online_cost import cost_model_for
from ..control.policy import RequestOutcome
from ..control.step_timing import mixed_step_seconds, whole_step_record
from .steps import step_kind

__all__ = ["replay", "main"]


def _learnable(entry: dict) -> bool:
    return (entry.get("drafting") is not None and not entry.get("prefill_tokens")
            and not entry.get("catch_up_tokens") and entry.get("seconds", 0) > 0)


def replay(entries: Sequence[dict], profile: dict, drafting_side: float | None = None) -> pd.DataFrame:
    """The steps of one configuration, in order: kind, measured and predicted seconds, and whether the
    step falls in the second half (the steps the summary judges)."""
    model = cost_model_for(profile, "shared", whole_step=True)
    if drafting_side is not None:  # that weight at every batch size
        model.drafting_side, model.drafting_side_by_batch = drafting_side, {}
    steps = [e for e in entries if _learnable(e)]
    rows = []
    for index, entry in enumerate(steps):
        batch, context = entry["batch"], entry["context"]
        verified, drafting = list(entry["verified"]), list(entry["drafting"])
        predicted = mixed_step_seconds(model, batch, context, verified, drafting)
        rows.append({"kind": step_kind(entry), "seconds": entry["seconds"], "predicted": predicted,
                     "held_out": index >= len(steps) // 2})
        outcomes = tuple(RequestOutcome(f"r{i}", k, a, a + 1) for i, (k, a) in enumerate(zip(verified, entry["accepted"])))
        model.observe(whole_step_record(model, batch_size=batch, batch_k=max(verified), context_lengths=(context,) * batch,
                                        outcomes=outcomes, total_seconds=entry["seconds"], lag=1, drafting=drafting,
                                        draft_positions=entry.get("draft_positions", 0)))
    return pd.DataFrame(rows, columns=["kind", "seconds", "predicted", "held_out"])


def summarise(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (weight, kind) and overall: held-out steps, median |error| and mean error."""
    held = frame[frame["held_out"]].copy()
    held["error"] = held["predicted"] / held["seconds"] - 1
    held["abs_error"] = held["error"].abs()
    every = held.assign(kind="all")
    table = pd.concat([held, every]).groupby(["drafting_side", "kind"]).agg(
        steps=("error", "size"), abs_error_median=("abs_error", "median"), error_mean=("error", "mean"))
    return table.round(4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adaptive_spec.results.price_replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="step logs written by bench --engine vllm --save-steps")
    parser.add_argument("--profile", required=True, help="the vLLM profile the shared model starts from")
    parser.add_argument("--drafting-side", default="default",
                        help="comma-separated weights of a lag-mixed step's drafting side: default (the model's) or numbers")
    args = parser.parse_args(argv)
    try:
        from ..profiling.profile_file import load_profile

        profile = load_profile(args.profile)
        weights = [None if w.strip() == "default" else float(w) for w in args.drafting_side.split(",")]
        if any(w is not None and not 0 <= w <= 1 for w in weights):
            raise ValueError(f"--drafting-side weights must be in [0, 1], got {args.drafting_side!r}")
        frames = []
        for path in args.files:
            with open(path) as handle:
                entries = [json.loads(line) for line in handle if line.strip()]
            lanes: dict[str, list[dict]] = {}
            for entry in entries:
                lanes.setdefault(f"{path}:{entry.get('config')}:{entry.get('temperature')}:{entry.get('repeat', 0)}", []).append(entry)
            for weight in weights:
                label = "default" if weight is None else f"{weight:g}"
                frames += [replay(lane, profile, weight).assign(drafting_side=label) for lane in lanes.values()]
        frame = pd.concat(frames)
        if frame.empty:
            raise ValueError("no decode steps chosen by this project's policies in these files")
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    with pd.option_context("display.width", 160):
        print(summarise(frame).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
