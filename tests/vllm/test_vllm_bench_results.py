"""`bench --engine vllm --save --repeats`: a result file with per-request figures and paired intervals
(a tiny real model through vLLM's CPU build; the timings mean nothing, only the bookkeeping)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_cases import SMALL_MODEL, require_vllm


@pytest.mark.vllm
@pytest.mark.real_models
def test_bench_vllm_saves_per_prompt_figures_for_each_pass(tmp_path):
    require_vllm()
    from adaptive_spec.results import load_result

    command = [sys.executable, "-m", "adaptive_spec", "bench", "--engine", "vllm", "--target", SMALL_MODEL,
               "--draft", "ngram", "--prompt", "Count from one to twenty: one, two, three,",
               "--prompt", "Tell me about the sea.", "--max-new-tokens", "8", "--temperatures", "0",
               "--policies", "vllm-off,vllm-static:2,goodput", "--threads", "1", "--repeats", "2",
               "--save", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "NUMBA_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    printed = json.loads(result.stdout.strip().splitlines()[-1])
    assert "paired 95% bootstrap intervals over prompts" in result.stdout
    (path,) = tmp_path.glob("*-bench-vllm-batch1.json")
    saved = load_result(path)
    assert saved["kind"] == "bench" and saved["engine"] == "vllm" and saved["packages"]["vllm"]
    assert saved["intervals"] == printed["intervals"] and "prompts" not in printed["runs"][0]
    for run in saved["runs"]:
        assert sorted((p["repeat"], p["index"]) for p in run["prompts"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert sum(p["tokens"] for p in run["prompts"]) == run["tokens"]
        assert all("ttft_ms" in p for p in run["prompts"])
    goodput = saved["intervals"]["0.0"]["goodput"]
    assert goodput["to_off"]["reference"] == "vllm-off" and goodput["to_best_static"]["prompts"] == 2
