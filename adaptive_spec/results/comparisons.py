"""Ratios between configurations of one run, with paired intervals (`intervals`), from the per-prompt
figures a result file holds. Pure: the bench tables, the saved documents and the report all call it.

A per-prompt record is a dict with at least `index` (the prompt's place in one pass of the stream,
or the request's place in the arrival trace under load), `tokens` and `seconds`; `repeat` tells
passes of `--repeats` apart. Repeats of a prompt are summed before resampling, so the bootstrap
draws prompts, the unit the claim is about, not (prompt, repeat) pairs that share a prompt's length.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np

from .intervals import DEFAULT_RESAMPLES, paired_ratio_interval, paired_spread, prompts_for_half_width, ratio_of_totals

OFF_CONFIGS = ("off", "vllm-off")
INTERVAL_SEED = 0  # fixed: the same figures always give the same intervals (the report is checked in)


def is_static(config: str) -> bool:
    """The configurations a "best static" is chosen from: no speculation or one fixed k."""
    return config in OFF_CONFIGS or config.startswith(("static:", "vllm-static:"))


def rotated(items: Sequence, turn: int) -> list:
    """`items` started at position turn mod len: prompt i runs the configurations in this order, so each
    configuration is first (and last) equally often and drift over a prompt hits all alike."""
    if not items:
        return []
    start = turn % len(items)
    return list(items[start:]) + list(items[:start])


def prompt_totals(prompts: Iterable[Mapping]) -> dict[int, tuple[float, float]]:
    """index -> (tokens, seconds) summed over repeats."""
    totals: dict[int, tuple[float, float]] = {}
    for record in prompts:
        tokens, seconds = totals.get(record["index"], (0.0, 0.0))
        totals[record["index"]] = (tokens + record["tokens"], seconds + record["seconds"])
    return totals


def compare(runs: Mapping[str, Sequence[Mapping]], *, seed: int = INTERVAL_SEED,
            resamples: int = DEFAULT_RESAMPLES, half_width: float = 0.05) -> dict[str, dict]:
    """config -> its ratios to the best static configuration and to off (in a run with neither: to
    the first configuration, `to_first`), each with a paired 95% interval over the prompts every
    configuration served, the per-prompt spread of that paired ratio
    and the prompts a +-`half_width` interval would need at that spread. `runs`: config -> per-prompt
    records, in the order the table shows them."""
    totals = {config: prompt_totals(prompts) for config, prompts in runs.items()}
    shared = sorted(set.intersection(*(set(t) for t in totals.values()))) if totals else []
    shared = [i for i in shared if all(t[i][1] > 0 for t in totals.values())]
    if not shared:
        return {}
    columns = {config: (np.array([t[i][0] for i in shared]), np.array([t[i][1] for i in shared]))
               for config, t in totals.items()}
    speeds = {config: float(tokens.sum() / seconds.sum()) for config, (tokens, seconds) in columns.items()}
    statics = [config for config in columns if is_static(config)]
    best = max(statics, key=speeds.get, default=None)
    off = next((config for config in OFF_CONFIGS if config in columns), None)
    # a run of one policy's lanes alone (`goodput@START`, ...): each is compared with the first lane
    first = next(iter(columns)) if best is None and off is None else None
    out = {}
    for config in columns:
        entry = {"prompts": len(shared), "tokens_per_s": round(speeds[config], 4)}
        for label, reference in (("to_best_static", best), ("to_off", off), ("to_first", first)):
            if reference is None or reference == config:
                continue
            pair = (*columns[config], *columns[reference])
            interval = paired_ratio_interval(*pair, rng=np.random.default_rng(seed), resamples=resamples)
            spread = paired_spread(*pair)
            entry[label] = {"reference": reference, **interval.as_dict(), "spread": _rounded(spread),
                            f"prompts_for_{round(half_width * 100)}pct": prompts_for_half_width(spread, half_width)}
        out[config] = entry
    return out


def first_or_best(entry: Mapping) -> tuple[Mapping | None, str]:
    """A comparison's ratio to the best static configuration, or where the run has none, to its first
    lane: (the ratio, its reference as a table cell shows it)."""
    best = entry.get("to_best_static") or entry.get("to_first")
    return best, (f" ({_vs(entry)}{best['reference']})" if best else "")


def ratio_cell(comparison: Mapping | None, digits: int = 2) -> str:
    """`1.03 [0.98, 1.08]`, with `*` where the interval excludes 1.0; `-` where there is no ratio."""
    if not comparison:
        return "-"
    mark = "*" if comparison["excludes_1"] else ""
    return (f"{comparison['ratio']:.{digits}f} [{comparison['low']:.{digits}f}, "
            f"{comparison['high']:.{digits}f}]{mark}")


TOTAL_RATE = "total tokens / total seconds"


def format_intervals(intervals: Mapping[str, Mapping[str, Mapping]], measure: str = TOTAL_RATE,
                     unit: str = "prompts") -> str:
    """The table under a bench's: per temperature and configuration, the ratios to the best static
    configuration and to off with their paired 95% intervals; `*`: the interval excludes 1.0."""
    header = f"{'temp':>5} {'config':<16} {'x best static':<32} {'x off':<24} {unit:>8}"
    lines = ["", f"ratios of {measure}, paired 95% bootstrap intervals over {unit} (* = excludes 1.0)",
             header, "-" * len(header)]
    for temperature, table in intervals.items():
        for config, entry in table.items():
            best, reference = first_or_best(entry)
            best_cell = ratio_cell(best) + reference
            lines.append(f"{temperature:>5} {config:<16} {best_cell:<32} {ratio_cell(entry.get('to_off')):<24} "
                         f"{entry['prompts']:>8}")
    return "\n".join(lines)


def _vs(entry: Mapping) -> str:
    """'vs ' where a ratio is to the first lane rather than to the best static configuration."""
    return "vs " if "to_first" in entry else ""


def _rounded(value: float) -> float | None:
    return None if value != value else round(value, 4)  # NaN (one prompt) -> None


__all__ = ["TOTAL_RATE", "compare", "first_or_best", "format_intervals", "is_static", "prompt_totals", "ratio_cell", "ratio_of_totals", "rotated", "OFF_CONFIGS"]
