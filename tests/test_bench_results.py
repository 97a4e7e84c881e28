"""`bench --save` and `--repeats` on tiny local models: the result file, its per-prompt figures and
the paired intervals (in process; timings of tiny models mean nothing, only the bookkeeping)."""

from __future__ import annotations

import json

from adaptive_spec.cli import main
from adaptive_spec.results import load_result

PROMPTS = ["w1 w2 w3 w1 w2 w3 w1 w2", "w9 w8 w7", "w4 w5 w6 w4 w5"]


def test_bench_save_writes_per_prompt_figures_and_intervals(tiny_model_dirs, tmp_path, capsys):
    target, draft, _ = tiny_model_dirs
    prompts = [option for text in PROMPTS for option in ("--prompt", text)]
    code = main(["bench", "--target", target, "--draft", draft, *prompts, "--no-hf", "--repeats", "2",
                 "--policies", "off,static:2,heuristic", "--temperatures", "0,0.7", "--max-new-tokens", "6",
                 "--no-chat", "--save", str(tmp_path)])
    captured = capsys.readouterr()
    printed = json.loads(captured.out.strip().splitlines()[-1])
    assert code == 0 and "paired 95% bootstrap intervals over prompts" in captured.out
    (path,) = tmp_path.glob("*.json")
    assert path.name.endswith("-bench-hf-batch1.json")
    result = load_result(path)
    assert result["kind"] == "bench" and result["engine"] == "hf" and result["schema_version"] == 1
    assert {"cpu_model", "cores", "memory_bytes", "platform", "threads"} <= set(result["machine"])
    assert result["packages"]["torch"] and result["options"]["repeats"] == 2
    assert result["intervals"] == printed["intervals"]  # the printed document, built on
    for run in result["runs"]:
        assert [(p["repeat"], p["index"]) for p in sorted(run["prompts"], key=lambda p: (p["repeat"], p["index"]))] \
            == [(r, i) for r in range(2) for i in range(3)]
        assert sum(p["tokens"] for p in run["prompts"]) == run["tokens"]
        assert abs(sum(p["seconds"] for p in run["prompts"]) - run["seconds"]) < 0.01
        engine_prompt = run["prompts"][0]
        assert len(engine_prompt["k_per_step"]) == len(engine_prompt["accepted_per_step"])
        assert run["step_times"] and all(len(step) == 5 for step in run["step_times"])  # [b, K, context, measured, predicted]
    for temperature in ("0.0", "0.7"):
        table = result["intervals"][temperature]
        assert table["heuristic"]["prompts"] == 3 and table["heuristic"]["to_off"]["reference"] == "off"
        best = table["heuristic"]["to_best_static"]
        assert best["reference"] in ("off", "static:2") and best["low"] <= best["ratio"] <= best["high"]
    assert "prompts" not in printed["runs"][0]  # per-prompt figures only in the result file


def test_bench_save_to_a_named_file_and_closed_loop_shares(tiny_model_dirs, tmp_path, capsys):
    target, draft, _ = tiny_model_dirs
    prompts = [option for text in PROMPTS for option in ("--prompt", text)]
    out = tmp_path / "deep" / "run.json"
    assert main(["bench", "--target", target, "--draft", draft, *prompts, "--batch-size", "2",
                 "--policies", "off,static:2", "--temperatures", "0", "--max-new-tokens", "6", "--no-chat",
                 "--save", str(out)]) == 0
    capsys.readouterr()
    (run, _) = load_result(out)["runs"]
    assert len(run["prompts"]) == 3 and abs(sum(p["seconds"] for p in run["prompts"]) - run["seconds"]) < 0.01


def test_bench_refuses_zero_repeats(tiny_model_dirs, capsys):
    target, draft, _ = tiny_model_dirs
    assert main(["bench", "--target", target, "--draft", draft, "--prompt", "w1", "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err


def test_simulate_save_writes_per_request_figures(tmp_path, capsys):
    code = main(["simulate", "--trace", "traces/int8-draft/qwen-coder-code-t0.csv",
                 "--profile", "profiles/cpu-2core-qwen-coder-fp32-int8draft.json",
                 "--policies", "off,static:2,goodput", "--num-requests", "6", "--save", str(tmp_path)])
    captured = capsys.readouterr()
    printed = json.loads(captured.out.strip().splitlines()[-1])
    assert code == 0 and "over requests" in captured.out
    (path,) = tmp_path.glob("*-simulate-qwen-coder-code-t0-hf-batch1.json")
    saved = load_result(path)
    assert saved["kind"] == "simulate" and saved["temperatures"] == [0.0]
    assert saved["intervals"] == printed["intervals"] and "requests" not in printed["runs"][0]
    for run in saved["runs"]:
        assert run["config"] == run["policy"] and run["temperature"] == 0.0
        assert [p["index"] for p in run["prompts"]] == list(range(6))
        assert sum(p["tokens"] for p in run["prompts"]) == run["generated_tokens"]
        assert abs(sum(p["seconds"] for p in run["prompts"]) - run["simulated_seconds"]) < 1e-3
    goodput = saved["intervals"]["all"]["goodput"]
    assert goodput["to_best_static"]["reference"] in ("off", "static:2") and goodput["prompts"] == 6


def test_closed_loop_tpot_counts_a_requests_own_steps_after_its_first(tiny_model_dirs, tmp_path, capsys, monkeypatch):
    """TPOT in the closed loop: per request, the whole time of its configuration's steps after its
    first, over the tokens they emitted. With a clock that makes every step take 1 s and no
    speculation (one token a step after the step that prefills), it is exactly 1000 ms. Control:
    the target drafting for itself 2 a step (every draft accepted at t = 0) emits up to 3 tokens a
    step, so its TPOT falls below 1000 ms."""
    import types

    import adaptive_spec.cli.bench as bench

    ticks = iter(range(10**6))
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    target, _, _ = tiny_model_dirs
    prompts = [option for text in PROMPTS for option in ("--prompt", text)]
    out = tmp_path / "run.json"
    assert main(["bench", "--target", target, "--draft", target, *prompts, "--batch-size", "2", "--policies",
                 "off,static:2", "--temperatures", "0", "--max-new-tokens", "6", "--no-chat",
                 "--save", str(out)]) == 0
    assert "TPOT99" in capsys.readouterr().out
    off, static = load_result(out)["runs"]
    several = [p for p in off["prompts"] if p["tokens"] > 2]  # one done in its first step has no TPOT
    assert several and all(p["tpot_ms"] == 1000.0 for p in several) and off["tpot_p99_ms"] == 1000.0
    assert sum(p["accepted"] for p in static["prompts"]) > 0
    assert static["tpot_p99_ms"] < 1000.0
