"""`python -m adaptive_spec.results.steps`: a --save-steps file sorted into step kinds and summarised."""

from __future__ import annotations

import json

import pytest

from adaptive_spec.results import steps


def entry(config, verified, drafting, seconds, predicted, **extra):
    return {"config": config, "temperature": 0.0, "step": 0, "batch": len(verified), "context": 100,
            "verified": verified, "accepted": [0] * len(verified), "drafting": drafting,
            "draft_positions": max(drafting or [0]), "catch_up_tokens": 0, "prefill_tokens": 0,
            "seconds": seconds, "learned": seconds, "predicted": predicted, "between": 0.01, **extra}


@pytest.mark.parametrize("extra, verified, drafting, kind", [
    ({"prefill_tokens": 40}, [0], [3], "prefill"),
    ({"catch_up_tokens": 80}, [0], [3], "catch-up"),
    ({"draft_positions": 4}, [3], [3], "stopped"),
    ({}, [1], [3], "mixed"),
    ({}, [3, 1], [3, 1], "ragged"),
    ({}, [3, 3], [3, 3], "uniform"),
    ({}, [3], None, "uniform"),  # vLLM's own schedule: drafting unknown, taken as verified
])
def test_each_step_gets_the_first_kind_that_applies(extra, verified, drafting, kind):
    record = entry("a", verified, drafting, 0.2, None)
    record.update(extra)
    assert steps.step_kind(record) == kind


def test_the_summary_gives_each_kinds_share_error_and_draft_length(tmp_path, capsys):
    path = tmp_path / "steps.jsonl"
    rows = [entry("a", [3], [3], 0.2, 0.22, prompt=0), entry("a", [3], [3], 0.2, 0.18, prompt=1),
            entry("a", [1], [3], 0.4, 0.2, prompt=1),
            entry("a", [0], [3], 1.2, None, prefill_tokens=50, between=9.0, prompt=0)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    frame = steps.load_steps(str(path))
    table = steps.summarise(frame)
    uniform, mixed = table.loc[("a", "uniform")], table.loc[("a", "mixed")]
    assert uniform["steps"] == 2 and uniform["error_median"] == pytest.approx(0.0)
    assert uniform["share"] == pytest.approx(0.4 / 2.0)
    assert mixed["error_mean"] == pytest.approx(-0.5) and mixed["drafting"] == 3
    assert table.loc[("a", "prefill")]["measured_ms"] == pytest.approx(1200)
    between = steps.between_summary(frame).loc["a"]
    assert between["steps"] == 3 and between["between_mean_ms"] == pytest.approx(10.0)  # the prefill's 9 s left out
    assert steps.main([str(path), "--by", "prompt-quarter"]) == 0 and steps.main([str(path), "--by", "batch"]) == 0
    assert "quarter" in capsys.readouterr().out


def test_an_empty_steps_file_is_a_clear_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(ValueError, match="no steps"):
        steps.load_steps(str(path))
