"""`python -m adaptive_spec.report`: docs/results.md is what the committed result files give, and the
report reads both kinds of result (measured bench runs, simulations) into tables and figures."""

from __future__ import annotations

import json

import numpy as np
import pytest

from adaptive_spec import report
from adaptive_spec.results.result_file import RESULT_SCHEMA_VERSION

pytest.importorskip("matplotlib")


def test_docs_results_md_is_generated_from_the_committed_result_files():
    results = report.load_all(report.RESULTS)
    assert results, "no committed result files in results/"
    assert report.PAGE.read_text() == report.render(results), "run: python -m adaptive_spec.report"
    for stem, result in results:  # every figure the page links to is committed
        assert all((report.FIGURES / name).is_file() for _, name in report.figure_names(stem, result))


def test_the_page_depends_only_on_the_files():
    results = report.load_all(report.RESULTS)
    assert report.render(results) == report.render(report.load_all(report.RESULTS))


def _prompts(rng, speed, with_steps=True):
    """Twelve prompts of one configuration: each prompt's own length and difficulty (shared by every
    configuration: seeded alike), a little timing noise of this configuration's own."""
    shared = np.random.default_rng(99)
    records = []
    for index in range(12):
        tokens, difficulty = int(shared.integers(20, 64)), shared.lognormal(0, 0.3)
        seconds = tokens / speed * difficulty * rng.lognormal(0, 0.03)
        record = {"index": index, "repeat": 0, "tokens": tokens, "seconds": seconds}
        if with_steps:
            record.update(k_per_step=[3, 2, 4, 0, 1], accepted_per_step=[3, 1, 2, 0, 1])
        records.append(record)
    return records


def _bench_result(engine: str, rate: float = 0.0) -> dict:
    rng = np.random.default_rng(0)
    names = ["off", "static:3", "goodput"] if engine == "hf" else ["vllm-off", "vllm-static:3", "goodput"]
    runs = []
    for name, speed in zip(names, (10.0, 12.0, 14.0)):
        prompts = _prompts(rng, speed, with_steps=engine == "hf")
        run = {"config": name, "temperature": 0.0, "tokens": sum(p["tokens"] for p in prompts),
               "tokens_per_s": speed, "prompts": prompts}
        if engine == "hf" and name != "off":
            run["step_times"] = [[1, 3, 100 + i, 0.05 + 0.001 * i, 0.05] for i in range(10)]
        runs.append(run)
    return {"schema_version": RESULT_SCHEMA_VERSION, "kind": "bench", "engine": engine,
            "created_utc": "2026-01-01T00:00:00+00:00", "machine": {"cpu_model": "Test CPU", "cores": 2},
            "git": {"commit": "0" * 40, "dirty": False}, "packages": {"torch": "2.0"},
            "command": f"adaptive-spec bench --engine {engine} --save results", "argv": None, "options": {},
            "settings": {"rate": rate, "prompts": [f"p{i}" for i in range(12)]}, "runs": runs}


def test_the_report_reads_measured_and_simulated_results(tmp_path, capsys):
    directory = tmp_path / "results"
    directory.mkdir()
    for name, result in [("a-bench-hf", _bench_result("hf")), ("b-bench-vllm", _bench_result("vllm", rate=2.0))]:
        (directory / f"{name}.json").write_text(json.dumps(result))
    (simulated,) = report.load_all(report.RESULTS)[:1]
    (directory / "c-simulate.json").write_text(json.dumps(simulated[1]))
    out = tmp_path / "docs" / "results.md"
    options = ["--results", str(directory), "--out", str(out), "--figures", str(tmp_path / "docs" / "figures")]
    assert report.main(options) == 0
    page = out.read_text()
    assert page.count("\n## ") == 3 and "measured: bench, engine hf" in page and "simulated from a profile" in page
    goodput = next(line for line in page.splitlines() if line.startswith("| `goodput`"))  # the hf section's
    assert goodput.count("]*") == 2 and "(static:3)" in goodput  # 14 / 12 and 14 / 10 tok/s: both exclude 1
    assert "per request of the same arrival trace" in page  # under load, what is paired is said
    figures = sorted(p.name for p in (tmp_path / "docs" / "figures").iterdir())
    assert "a-bench-hf-step-time.png" in figures and "a-bench-hf-k-over-request.png" in figures
    assert "b-bench-vllm-tokens-per-s.png" in figures and "b-bench-vllm-k-over-request.png" not in figures
    assert all(f"figures/{name}" in page for name in figures)
    assert report.main([*options, "--check"]) == 0
    out.write_text(page + "edited\n")
    assert report.main([*options, "--check"]) == 1


def test_acceptance_by_position_conditions_on_being_drafted():
    prompts = [{"k_per_step": [2, 1, 0], "accepted_per_step": [2, 0, 0]}]
    assert report.acceptance_by_position(prompts) == [0.5, 1.0]  # position 1: 1 of 2; position 2: 1 of 1


def test_a_newer_schema_is_refused(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"schema_version": RESULT_SCHEMA_VERSION + 1}))
    with pytest.raises(ValueError, match="schema_version"):
        report.load_all(tmp_path)


def test_the_cost_model_bars_render_as_one_table():
    rows = [{"batch": 4, "kind": "shared", "start": "none", "ratio": 0.9712, "steps": 2000, "requests": 150,
             "price_error_after_300": {"mean": 0.0441, "p90": 0.0747, "max": 0.4624},
             "events": {"outliers": 3, "shifts": 1}},
            {"batch": 4, "kind": "shared", "start": "draft x1.3 at step 1000", "ratio": 1.0, "steps_to_3pct": None,
             "price_error_after_300": {"mean": 0.18, "max": 0.2}, "events": {"outliers": 0, "shifts": 0}}]
    result = {"schema_version": RESULT_SCHEMA_VERSION, "kind": report.BARS, "created_utc": "2026-12-07T03:00:00+00:00",
              "host": "vllm", "profile": "profiles/a.json", "other_profile": "profiles/b.json", "rows": rows,
              "options": {"min_steps": 2000, "change_at": 1000, "set": []}, "command": "python scripts/cost_model_bars.py"}
    page = report.render([("20261207T030000Z-cost-model-bars-vllm", result)])
    assert "| 4 | shared | none | 0.971 | 0.044 / 0.075 / 0.462 |  | 3 | 1 |" in page
    assert "| 4 | shared | draft x1.3 at step 1000 | 1.000 | 0.180 / 0.200 | never | 0 | 0 |" in page
    assert "min_steps 2000" in page and "not exposed to contention" in page


def test_lanes_of_one_policy_are_compared_with_the_first_lane():
    """No static or off configuration in the run (cost-model starts side by side): each lane's ratio
    is to the first lane, marked `vs`; with a static one present (negative control) there is none."""
    from adaptive_spec.results.comparisons import compare, first_or_best

    rng = np.random.default_rng(0)
    lanes = {name: _prompts(rng, speed) for name, speed in (("goodput@here", 5.0), ("goodput@none", 4.5))}
    table = compare(lanes)
    best, reference = first_or_best(table["goodput@none"])
    assert reference == " (vs goodput@here)" and best["ratio"] < 1 and "to_first" not in table["goodput@here"]
    with_static = compare({**lanes, "static:3": _prompts(rng, 4.0)})
    assert all("to_first" not in entry for entry in with_static.values())
