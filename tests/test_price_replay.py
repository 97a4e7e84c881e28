"""The replay of real step logs through the shared cost model (`results.price_replay`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from adaptive_spec.profiling.profile_file import load_profile
from adaptive_spec.results.price_replay import main, replay, summarise

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "profiles" / "cpu-2core-xeon-vllm-qwen-coder-fp32.json"


def _log(steps: int = 300, seed: int = 0) -> list[dict]:
    """A batch-1 vLLM-like run: each step verifies what the last drafted and drafts 0-4; a step costs
    0.3 s + 0.1 s per drafted position + 0.005 s per verified draft (the draft loop is the cost, as
    measured through vLLM on the 2-core CPU), with 1% noise. A prefill and a catch-up step are mixed in."""
    rng = np.random.default_rng(seed)
    entries, verified = [], 0
    for step in range(steps):
        drafting = int(rng.integers(0, 5)) if rng.random() < 0.5 else verified  # half the steps switch length
        seconds = (0.3 + 0.1 * drafting + 0.005 * verified) * (1 + 0.01 * rng.standard_normal())
        entries.append({"config": "goodput", "temperature": 0.0, "batch": 1, "context": 200 + step, "verified": [verified],
                        "accepted": [verified], "drafting": [drafting], "draft_positions": drafting,
                        "catch_up_tokens": 0, "prefill_tokens": 0, "seconds": seconds})
        verified = drafting
    if steps > 20:
        entries[10] = {**entries[10], "prefill_tokens": 150, "seconds": 9.0}  # not a decode step
        entries[20] = {**entries[20], "catch_up_tokens": 150, "seconds": 9.0}  # a catch-up: not a step cost
    return entries


def test_a_drafting_side_weight_that_fits_the_machine_prices_mixed_steps_closer():
    """On a log whose mixed steps cost nearly their drafting side (w ~ 0.95), the replay with 0.95
    prices the held-out mixed steps within 3% (median) and the mean of the sides (0.5) misses by more
    than twice that. Uniform steps are priced alike by both. Deterministic (seed 0; 1% noise)."""
    profile = load_profile(PROFILE)
    entries = _log()
    frames = {w: replay(entries, profile, w).assign(drafting_side=f"{w:g}") for w in (0.5, 0.95)}
    assert all(len(frame) == len(entries) - 2 for frame in frames.values())  # the prefill and the catch-up left out
    table = summarise(pd.concat(frames.values()))
    near, mean = table.loc[("0.95", "mixed"), "abs_error_median"], table.loc[("0.5", "mixed"), "abs_error_median"]
    assert near < 0.03 and mean > 2 * near
    assert table.loc[("0.95", "mixed"), "steps"] > 50  # the mixed steps were really judged


def test_the_replay_command_reads_logs_and_refuses_bad_input(tmp_path, capsys):
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in _log(60)))
    assert main([str(log), "--profile", str(PROFILE), "--drafting-side", "default,0.5"]) == 0
    out = capsys.readouterr().out
    assert "default" in out and "mixed" in out
    assert main([str(log), "--profile", str(PROFILE), "--drafting-side", "1.5"]) == 2
    assert "must be in [0, 1]" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.jsonl"), "--profile", str(PROFILE)]) == 2
    vllm_only = tmp_path / "vllm.jsonl"  # a lane vLLM's own schedule chose: nothing of ours to replay
    vllm_only.write_text(json.dumps({**_log(1)[0], "config": "vllm-static:1", "drafting": None}) + "\n")
    assert main([str(vllm_only), "--profile", str(PROFILE)]) == 2
    assert "no decode steps" in capsys.readouterr().err
