"""Where a run's step time went: a summary of `bench --engine vllm --save-steps FILE`.

    python -m adaptive_spec.results.steps FILE [--by kind|prompt-quarter|batch]

Each line of FILE is one engine step of one configuration (`SpecController._step_entry`). Steps are
sorted into kinds by what they did:
  prefill   the step computed prompt tokens (its time is not a decode step's cost; untimed)
  catch-up  the lazy draft ran over context it had missed (untimed beyond the catch-up price)
  stopped   the in-step rule ended the draft loop past the longest length kept (a dropped draft)
  mixed     rows verified other lengths than they draft (vLLM's one-step lag)
  ragged    rows of one step verify (and draft) different lengths
  uniform   every row verifies and drafts one length K
For each configuration and kind: steps, mean measured and predicted milliseconds, the median and the
mean of predicted / measured - 1 (the cost model's price error before it learned the step), and the
draft length rows chose. `between` is the engine loop's time outside the timed step (output
processing, the next schedule's setup), which no step price holds; prefill steps are left out of
it, since a prompt's first step follows the idle time while other configurations ran.

Pure pandas over the file; no model or engine is loaded.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Iterable

import pandas as pd

KINDS = ("prefill", "catch-up", "stopped", "mixed", "ragged", "uniform")


def load_steps(path: str) -> pd.DataFrame:
    """The steps of a --save-steps file as a frame, one row per step, with its `kind`."""
    with open(path) as handle:
        entries = [json.loads(line) for line in handle if line.strip()]
    if not entries:
        raise ValueError(f"{path} holds no steps")
    frame = pd.DataFrame(entries)
    frame["kind"] = [step_kind(e) for e in entries]
    frame["drafting_mean"] = [sum(e["drafting"]) / len(e["drafting"]) if e["drafting"] else float("nan")
                              for e in entries]  # NaN where vLLM's own schedule chose
    frame["error"] = [e["predicted"] / e["seconds"] - 1 if e.get("predicted") and e["seconds"] > 0 else float("nan")
                      for e in entries]
    return frame


def step_kind(entry: dict) -> str:
    """Which of `KINDS` a logged step is (the first that applies, in that order)."""
    if entry.get("prefill_tokens"):
        return "prefill"
    if entry.get("catch_up_tokens"):
        return "catch-up"
    verified = list(entry["verified"])
    drafting = verified if entry["drafting"] is None else list(entry["drafting"])  # None: vLLM's schedule
    if entry.get("draft_positions", 0) > max(drafting, default=0):
        return "stopped"
    if verified != drafting:
        return "mixed"
    if len(set(verified)) > 1:
        return "ragged"
    return "uniform"


def summarise(frame: pd.DataFrame, by: Iterable[str] = ("config", "kind")) -> pd.DataFrame:
    """Per group: steps, share of the configuration's step time, mean measured / predicted ms, the
    price error's median and mean, and the mean draft length chosen."""
    by = list(by)
    total = frame.groupby("config")["seconds"].transform("sum")
    frame = frame.assign(share=frame["seconds"] / total)
    table = frame.groupby(by, sort=False).agg(
        steps=("seconds", "size"), share=("share", "sum"), measured_ms=("seconds", "mean"),
        predicted_ms=("predicted", "mean"), error_median=("error", "median"), error_mean=("error", "mean"),
        drafting=("drafting_mean", "mean"))
    table["measured_ms"] *= 1000
    table["predicted_ms"] *= 1000
    return table.round(3)


def between_summary(frame: pd.DataFrame) -> pd.DataFrame:
    """Per configuration: the engine loop's median and mean time between steps (ms), prefill steps
    left out, and its share of the configuration's wall time."""
    kept = frame[frame["kind"].ne("prefill") & frame["between"].notna()]
    table = kept.groupby("config", sort=False)["between"].agg(["median", "mean", "size"]) * [1000, 1000, 1]
    table.columns = ["between_median_ms", "between_mean_ms", "steps"]
    steps_ms = kept.groupby("config", sort=False)["seconds"].mean() * 1000
    table["share_of_wall"] = table["between_mean_ms"] / (table["between_mean_ms"] + steps_ms)
    return table.round(3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adaptive_spec.results.steps", description=__doc__.split("\n")[0])
    parser.add_argument("file", help="a bench --save-steps file")
    parser.add_argument("--by", choices=("kind", "prompt-quarter", "batch"), default="kind",
                        help="group each configuration's steps by kind (default), by quarter of its prompts "
                             "(batch 1) or by the number of rows in the step (under load)")
    args = parser.parse_args(argv)
    frame = load_steps(args.file)
    if args.by == "prompt-quarter":
        if "prompt" not in frame:
            raise SystemExit(f"{args.file}: steps carry no prompt index (a run under load); use --by kind")
        quarter = (frame["prompt"] * 4 // (frame["prompt"].max() + 1)).astype(int) + 1
        table = summarise(frame.assign(quarter=quarter), ("config", "quarter"))
    elif args.by == "batch":
        table = summarise(frame, ("config", "batch"))
    else:
        table = summarise(frame)
    with pd.option_context("display.width", 160, "display.max_rows", 200):
        print(table.to_string())
        print()
        print(between_summary(frame).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
