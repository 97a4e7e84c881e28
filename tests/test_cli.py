"""The command line end to end on tiny local models (in process; no network)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from adaptive_spec.cli import main
from adaptive_spec.engine import SpecEngine

PROMPT = "w1 w2 w3 w1 w2 w3 w1 w2"


def last_json(capsys) -> dict:
    captured = capsys.readouterr()
    out = captured.out.strip().splitlines()
    assert out, captured.err[-2000:]
    return json.loads(out[-1])


def test_generate_streams_and_writes_json(tiny_model_dirs, tmp_path, capsys):
    target, draft, _ = tiny_model_dirs
    out_file = tmp_path / "out.json"
    code = main(["generate", "--target", target, "--draft", draft, "--prompt", PROMPT, "--policy", "static:3",
                 "--max-new-tokens", "12", "--ignore-eos", "--output-json", str(out_file)])
    summary = last_json(capsys)
    assert code == 0
    assert summary["generated_tokens"] == 12 and summary["drafted"] > 0
    assert summary["mean_acceptance_length"] >= 1
    record = json.loads(out_file.read_text())["results"][0]
    assert len(record["token_ids"]) == 12 and record["text"] and record["stats"]["steps"] > 0


def test_generate_many_prompts_with_ngram_drafter(tiny_model_dirs, tmp_path, capsys):
    target, _, _ = tiny_model_dirs
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w1 w2 w1 w2"}\n{"messages": [{"role": "user", "content": "w5 w6 w5"}]}\n')
    code = main(["generate", "--target", target, "--draft", "ngram", "--prompts", str(prompts),
                 "--temperature", "0.8", "--top-p", "0.9", "--max-new-tokens", "6", "--ignore-eos"])
    summary = last_json(capsys)
    assert code == 0 and summary["requests"] == 2 and summary["generated_tokens"] == 12


def test_malformed_prompt_file_names_the_line(tiny_model_dirs, tmp_path, capsys):
    target, _, _ = tiny_model_dirs
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt": "w1"}\n{"prompt": \n')
    assert main(["generate", "--target", target, "--draft", "none", "--prompts", str(prompts)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err


def test_impossible_sampling_parameter_is_a_clear_error(tiny_model_dirs, capsys):
    target, _, _ = tiny_model_dirs
    assert main(["generate", "--target", target, "--draft", "none", "--prompt", PROMPT, "--top-p", "1.5"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_pair_with_different_tokenizers_is_refused(tiny_model_dirs, capsys):
    target, _, foreign = tiny_model_dirs
    assert main(["generate", "--target", target, "--draft", foreign, "--prompt", PROMPT]) == 2
    assert "tokenizer" in capsys.readouterr().err.lower()


def test_bench_lanes_that_never_draft_run_without_the_draft(tiny_model_dirs, capsys, monkeypatch):
    """`off` is plain decoding: its engine gets no drafter, so no request pays the draft's prefill;
    `static:2` (the control) gets one."""
    from adaptive_spec.cli import bench

    target, draft, _ = tiny_model_dirs
    built = []
    real = bench.SpecEngine

    def recording(target_model, drafter, **options):
        built.append((options["policy"].name, drafter is not None))
        return real(target_model, drafter, **options)

    monkeypatch.setattr(bench, "SpecEngine", recording)
    assert main(["bench", "--target", target, "--draft", draft, "--prompt", PROMPT, "--policies", "off,static:2",
                 "--temperatures", "0", "--max-new-tokens", "4", "--no-chat", "--no-hf"]) == 0
    capsys.readouterr()
    assert set(built) == {("off", False), ("static:2", True)}


def test_unknown_model_name_lists_known_ones(capsys):
    assert main(["generate", "--pair", "no-such-pair", "--prompt", "x"]) == 2
    assert "qwen-coder" in capsys.readouterr().err


def test_bench_compares_configs_side_by_side(tiny_model_dirs, capsys):
    target, draft, _ = tiny_model_dirs
    code = main(["bench", "--target", target, "--draft", draft, "--prompt", PROMPT, "--prompt", "w9 w8 w7",
                 "--policies", "off,static:2", "--temperatures", "0", "--max-new-tokens", "6", "--no-chat"])
    document = last_json(capsys)
    assert code == 0
    assert set(document["tokens_per_s"]) == {"hf-plain", "hf-assisted", "hf-heuristic", "off", "static:2"}
    assert all(v > 0 for v in document["tokens_per_s"].values())
    plain = next(r for r in document["runs"] if r["config"] == "hf-plain")
    assert plain["ratio_to_hf_plain"] == 1.0


def test_goodput_with_a_foreign_profile_warns_and_runs(tiny_model_dirs, capsys):
    import warnings

    from adaptive_spec.cli.common import PROFILES_DIR

    target, draft, _ = tiny_model_dirs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(["generate", "--target", target, "--draft", draft, "--prompt", PROMPT, "--policy", "goodput",
                     "--profile", str(PROFILES_DIR / "tiny-test.json"), "--max-new-tokens", "8", "--ignore-eos"])
    assert code == 0 and last_json(capsys)["generated_tokens"] == 8
    assert any("profile" in str(w.message).lower() for w in caught)  # made for other models: a clear warning


def test_missing_profile_is_a_clear_error(tiny_model_dirs, capsys):
    target, draft, _ = tiny_model_dirs
    code = main(["generate", "--target", target, "--draft", draft, "--prompt", PROMPT, "--policy", "goodput",
                 "--profile", "no-such-profile.json"])
    assert code == 2 and "no-such-profile.json" in capsys.readouterr().err


def _fake_prompt_sets(monkeypatch):
    """HumanEval and ShareGPT stand-ins the tiny tokenizer reads: HumanEval i is w1 w(2+i) w3,
    ShareGPT i is w20 w(21+i) w40 w41 (another length, so a batch is ragged)."""
    import adaptive_spec.cli.common as common
    from adaptive_spec.assets import Prompt

    monkeypatch.setattr(common, "load_humaneval", lambda limit, **_: [
        Prompt(f"HumanEval/{i}", None, f"w1 w{2 + i} w3", "humaneval") for i in range(limit)])
    monkeypatch.setattr(common, "load_sharegpt", lambda count, **_: [
        Prompt(f"sg-{i}", None, f"w20 w{21 + i} w40 w41", "sharegpt") for i in range(count)])


def _label(prompt: tuple[int, ...]) -> str:
    """The workload and index a fake prompt's ids encode (the id of word wN is N + 5)."""
    if 25 in prompt:
        return f"sharegpt{prompt[prompt.index(25) + 1] - 26}"
    return f"humaneval{prompt[prompt.index(6) + 1] - 7}"


def _spy_engines(monkeypatch) -> dict:
    """Record, in order, every request added and every step's outputs, per engine, and which
    request keys each goodput policy object observed."""
    from adaptive_spec.control.goodput import GoodputPolicy
    from adaptive_spec.engine import SpecEngine

    seen = {"events": [], "observed": {}}
    add_request, step, observe = SpecEngine.add_request, SpecEngine.step, GoodputPolicy.observe

    def spy_add(self, prompt, *args, **kwargs):
        seen["events"].append(("add", self, _label(tuple(prompt))))
        return add_request(self, prompt, *args, **kwargs)

    def spy_step(self):
        outputs = step(self)
        seen["events"].append(("step", self, outputs))
        return outputs

    def spy_observe(self, record):
        seen["observed"].setdefault(id(self), set()).update(o.request_id for o in record.outcomes)
        return observe(self, record)

    monkeypatch.setattr(SpecEngine, "add_request", spy_add)
    monkeypatch.setattr(SpecEngine, "step", spy_step)
    monkeypatch.setattr(GoodputPolicy, "observe", spy_observe)
    return seen


def test_bench_mix_interleaves_workloads_through_persistent_policies(tiny_model_dirs, monkeypatch, capsys):
    target, draft, _ = tiny_model_dirs
    _fake_prompt_sets(monkeypatch)
    seen = _spy_engines(monkeypatch)
    code = main(["bench", "--target", target, "--draft", draft, "--mix", "humaneval:3,sharegpt:2", "--no-hf",
                 "--policies", "off,static:2,goodput", "--profile", "none", "--temperatures", "0",
                 "--max-new-tokens", "6", "--no-chat"])
    document = last_json(capsys)
    assert code == 0
    order = ["humaneval0", "sharegpt0", "humaneval1", "sharegpt1", "humaneval2"]
    assert document["settings"]["prompts"] == ["HumanEval/0", "sg-0", "HumanEval/1", "sg-1", "HumanEval/2"]
    # What the engines were fed: after one warm-up each, prompt by prompt, every configuration in turn,
    # the order rotated by one each prompt (so each configuration goes first as often as the others).
    adds = [(engine, label) for kind, engine, label in seen["events"] if kind == "add"][3:]
    engines = [engine for engine, _ in adds[:3]]
    assert len(set(map(id, engines))) == 3
    rotations = [engines[p % 3:] + engines[:p % 3] for p in range(5)]
    assert [engine for engine, _ in adds] == [e for order in rotations for e in order]  # the same engines all along
    assert [label for _, label in adds] == [label for label in order for _ in engines]
    # The goodput policy serving the stream observed every prompt of it, not one prompt's worth.
    assert sorted(map(len, seen["observed"].values())) == [1, 5]  # the warm-up's throwaway policy, the stream's
    for row in document["runs"]:
        workloads = row["workloads"]
        assert {w: f["requests"] for w, f in workloads.items()} == {"humaneval": 3, "sharegpt": 2}
        assert sum(f["tokens"] for f in workloads.values()) == row["tokens"] > 0
        assert abs(sum(f["seconds"] for f in workloads.values()) - row["seconds"]) < 0.01
        assert all(f["ratio_to_best_static"] > 0 for f in [row, *workloads.values()])
    best = document["best_static"]["0.0"]
    assert set(best) == {"overall", "humaneval", "sharegpt"} and set(best.values()) <= {"off", "static:2"}
    for scope in best:
        figures = [r if scope == "overall" else r["workloads"][scope] for r in document["runs"]]
        assert max(f["ratio_to_best_static"] for f, r in zip(figures, document["runs"]) if r["config"] != "goodput") == 1.0


def test_bench_compares_cost_model_starts_in_one_run(tiny_model_dirs, tmp_path, monkeypatch, capsys):
    """`goodput@START` lanes: each cost model starts where it is told (a learned-state file, the
    generic shape), learns from its own steps, and says so; --save-learned keeps the busiest one."""
    from adaptive_spec.cli import common

    target, draft, _ = tiny_model_dirs
    _fake_prompt_sets(monkeypatch)
    started = tmp_path / "started.json"
    assert main(["generate", "--target", target, "--draft", draft, "--prompt", PROMPT, "--policy", "goodput",
                 "--profile", "none", "--max-new-tokens", "8", "--ignore-eos", "--save-learned", str(started)]) == 0
    capsys.readouterr()
    built = []
    factory = common.policy_factory
    monkeypatch.setattr("adaptive_spec.cli.bench.policy_factory",
                        lambda args, loaded: built.append(factory(args, loaded)) or built[-1])
    learned = tmp_path / "learned.json"
    code = main(["bench", "--target", target, "--draft", draft, "--mix", "humaneval:2,sharegpt:2", "--no-hf",
                 "--policies", f"static:2,goodput@none,goodput@{started}", "--profile", "none",
                 "--cost-model", "shared", "--temperatures", "0", "--max-new-tokens", "6", "--no-chat",
                 "--save-learned", str(learned)])
    captured = capsys.readouterr()
    document = json.loads(captured.out.strip().splitlines()[-1])
    assert code == 0
    rows = {row["config"]: row for row in document["runs"]}
    assert set(rows) == {"static:2", "goodput@none", f"goodput@{started}"} and "cost_model" not in rows["static:2"]
    for name in ("goodput@none", f"goodput@{started}"):
        assert rows[name]["cost_model"]["kind"] == "shared" and rows[name]["cost_model"]["observations"] > 0
        assert f"[{name} at t=0.0: cost model shared learned from" in captured.out
    # the lane that resumed counts the steps it resumed from on top of this run's
    resumed = [m for m, _ in built[0].built if m.resumed_steps][-1]  # the stream's lane (after the warm-up's)
    steps_before = json.loads(started.read_text())["learned"]["state"]["observations"]
    assert resumed.resumed_steps == steps_before and resumed.observations > steps_before
    assert f"[learned cost state: {started}" in captured.err and json.loads(learned.read_text())["learned"]


def test_bench_batch_4_closed_loop_keeps_4_requests_in_flight(tiny_model_dirs, monkeypatch, capsys):
    target, draft, _ = tiny_model_dirs
    _fake_prompt_sets(monkeypatch)
    seen = _spy_engines(monkeypatch)
    code = main(["bench", "--target", target, "--draft", draft, "--mix", "humaneval:4,sharegpt:3",
                 "--batch-size", "4", "--policies", "static:2", "--temperatures", "0", "--max-new-tokens", "6",
                 "--no-chat"])
    captured = capsys.readouterr()
    document = json.loads(captured.out.strip().splitlines()[-1])
    assert code == 0 and "skipping hf-plain" in captured.err
    (row,) = document["runs"]
    assert row["config"] == "static:2" and row["requests"] == 7 and row["peak_batch"] == 4
    assert sum(f["tokens"] for f in row["workloads"].values()) == row["tokens"]
    stream_engine = seen["events"][-1][1]
    events = [(kind, item) for kind, engine, item in seen["events"] if engine is stream_engine]
    served = [{o.request_id for o in outputs} for kind, outputs in events if kind == "step"]
    assert max(map(len, served)) == 4  # four requests in one step, from the engine's own outputs
    adds = [i for i, (kind, _) in enumerate(events) if kind == "add"]
    first_finish = next(i for i, (kind, item) in enumerate(events) if kind == "step" and any(o.finished for o in item))
    assert len(adds) == 7 and adds[3] < first_finish < adds[4]  # the fifth joins only when one has finished


@pytest.mark.parametrize("options, problem", [
    (["--mix", "foo:3"], "unknown workload 'foo'"), (["--mix", "humaneval:0"], "positive integer"),
    (["--mix", "humaneval:x"], "positive integer"), (["--mix", "humaneval"], "positive integer"),
    (["--mix", "humaneval:2,humaneval:3"], "twice"), (["--mix", "humaneval:2", "--humaneval", "3"], "replaces"),
    (["--mix", "prompts:2"], "--prompts FILE.jsonl"), (["--batch-size", "0"], "--batch-size")])
def test_bench_bad_mix_or_batch_size_is_a_clear_error(tiny_model_dirs, capsys, options, problem):
    target, draft, _ = tiny_model_dirs
    assert main(["bench", "--target", target, "--draft", draft, *options]) == 2
    assert problem in capsys.readouterr().err


def test_policy_cost_times_choose_the_in_step_rule_and_observe(monkeypatch, capsys):
    """The report covers each batch size, and for goodput the in-step rule really ran: the rule is
    called at least once per step that drafts (a cost that skips it would understate the decision)."""
    from adaptive_spec.control import GoodputPolicy

    calls = []
    original = GoodputPolicy.keep_drafting
    monkeypatch.setattr(GoodputPolicy, "keep_drafting",
                        lambda self, position, shown: calls.append(position) or original(self, position, shown))
    assert main(["policy-cost", "--policy", "goodput", "--batch-sizes", "1,4", "--steps", "40"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["us_per_request_per_step"]) == {"1", "4"}
    assert all(us > 0 for us in report["us_per_request_per_step"].values())
    assert calls.count(0) >= 40  # at 70% acceptance goodput drafts in (nearly) every step


PROFILES = Path(__file__).resolve().parents[1] / "profiles"


def test_policy_cost_with_a_profile_reports_shares_of_its_step(capsys):
    """With --profile the share is the decision's seconds over the profile's one-token step, so a
    fast machine's share is larger for the same work (the synthetic accelerator vs the 2-core CPU)."""
    shares = {}
    for name in ("cpu-2core-qwen-coder-fp32-int8draft", "gpu-h200-qwen2.5-7b-0.5b-bf16-random"):
        assert main(["policy-cost", "--batch-sizes", "8", "--steps", "30", "--profile", str(PROFILES / f"{name}.json")]) == 0
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert report["profile"] == name
        us = report["us_per_request_per_step"]["8"]
        shares[name] = report["percent_of_one_token_step"]["8"]
        assert shares[name] > 0 and us > 0
    assert shares["gpu-h200-qwen2.5-7b-0.5b-bf16-random"] > shares["cpu-2core-qwen-coder-fp32-int8draft"]
    assert main(["policy-cost", "--profile", "no-such-profile.json"]) == 2
    assert "no-such-profile.json" in capsys.readouterr().err


def test_profile_auto_never_picks_a_vllm_profile_for_this_engine(tmp_path, monkeypatch):
    """Whole vLLM steps are not our engine's step costs, even for the same models. A vLLM profile
    that sorts first and matches as well is passed over; with no other profile, auto finds none."""
    from types import SimpleNamespace

    from adaptive_spec.cli import common

    shipped = common.PROFILES_DIR
    (tmp_path / "a-vllm.json").write_text((shipped / "cpu-2core-vllm-qwen-coder-fp32.json").read_text())
    (tmp_path / "b-hf.json").write_text((shipped / "cpu-2core-qwen-coder-fp32.json").read_text())
    monkeypatch.setattr(common, "PROFILES_DIR", tmp_path)
    loaded = SimpleNamespace(target=None, draft_model=None, target_name="qwen2.5-coder-1.5b-instruct",
                             draft_name="qwen2.5-coder-0.5b-instruct")
    assert common.find_profile(loaded).name == "b-hf.json"
    (tmp_path / "b-hf.json").unlink()
    assert common.find_profile(loaded) is None


def test_profile_auto_prefers_this_machine_then_a_learned_state(tmp_path, monkeypatch):
    """Of profiles for the same models, one of another machine that sorts first loses to one of this
    machine; a learned state of this machine beats the measured profile it holds."""
    from types import SimpleNamespace

    from adaptive_spec.cli import common
    from adaptive_spec.profiling.profile_file import MACHINE_KEYS, machine_fingerprint

    profile = json.loads((common.PROFILES_DIR / "cpu-2core-qwen-coder-fp32.json").read_text())
    here = machine_fingerprint("cpu")
    mine = {**profile, "fingerprint": {**profile["fingerprint"], **{k: here[k] for k in MACHINE_KEYS}}}
    other = {**profile, "fingerprint": {**mine["fingerprint"], "device_name": "another CPU"}}
    (tmp_path / "a-other.json").write_text(json.dumps(other))
    (tmp_path / "b-mine.json").write_text(json.dumps(mine))
    monkeypatch.setattr(common, "PROFILES_DIR", tmp_path)
    loaded = SimpleNamespace(target=None, draft_model=None, target_name="qwen2.5-coder-1.5b-instruct",
                             draft_name="qwen2.5-coder-0.5b-instruct")
    assert common.find_profile(loaded).name == "b-mine.json"
    (tmp_path / "c-learned.json").write_text(json.dumps({**mine, "learned": {"shape": "profile", "state": {}}}))
    assert common.find_profile(loaded).name == "c-learned.json"
    (tmp_path / "b-mine.json").unlink()
    (tmp_path / "c-learned.json").unlink()
    assert common.find_profile(loaded).name == "a-other.json"  # another machine's is still better than none


def test_profile_auto_through_vllm_follows_the_same_rule(tmp_path):
    """`serve` and `bench --engine vllm` with `--profile auto`: a vLLM profile of this machine for these
    models beats another machine's that sorts first, a learned state of this machine beats both, our
    engine's profiles are never taken, and with none for these models auto finds none."""
    from adaptive_spec.cli.common import PROFILES_DIR
    from adaptive_spec.integrations.vllm.engine import EngineSpec
    from adaptive_spec.integrations.vllm.profile import find_vllm_profile, start_line
    from adaptive_spec.profiling.profile_file import MACHINE_KEYS, machine_fingerprint

    profile = json.loads((PROFILES_DIR / "cpu-2core-vllm-qwen-coder-fp32.json").read_text())
    here = machine_fingerprint("cpu")
    mine = {**profile, "fingerprint": {**profile["fingerprint"], **{k: here[k] for k in MACHINE_KEYS}}}
    other = {**profile, "fingerprint": {**mine["fingerprint"], "device_name": "another CPU"}}
    (tmp_path / "0-hf.json").write_text((PROFILES_DIR / "cpu-2core-qwen-coder-fp32.json").read_text())
    (tmp_path / "a-other.json").write_text(json.dumps(other))
    spec = EngineSpec.for_pair("qwen-coder")
    assert find_vllm_profile(spec, tmp_path).name == "a-other.json"  # another machine's beats none
    (tmp_path / "b-mine.json").write_text(json.dumps(mine))
    assert find_vllm_profile(spec, tmp_path).name == "b-mine.json"
    (tmp_path / "c-learned.json").write_text(json.dumps({**mine, "learned": {"shape": "profile", "state": {}}}))
    assert find_vllm_profile(spec, tmp_path).name == "c-learned.json"
    assert find_vllm_profile(EngineSpec("smollm2-135m-instruct", "ngram"), tmp_path) is None
    assert start_line("auto", None).startswith("[no vLLM profile for these models")
    assert start_line("auto", str(tmp_path / "b-mine.json")) == f"[latency profile: {tmp_path / 'b-mine.json'}]"


def test_generate_saves_what_goodput_learned_and_the_next_run_resumes_it(tiny_model_dirs, tmp_path, capsys):
    target, draft, _ = tiny_model_dirs
    learned = tmp_path / "learned.json"
    run = ["generate", "--target", target, "--draft", draft, "--prompt", PROMPT, "--policy", "goodput",
           "--max-new-tokens", "12", "--ignore-eos", "--save-learned", str(learned)]
    assert main([*run, "--profile", "none"]) == 0
    err = capsys.readouterr().err
    document = json.loads(learned.read_text())
    steps = document["learned"]["state"]["observations"]
    assert steps > 0 and document["learned"]["shape"] == "generic" and f"{steps} steps this run" in err
    assert document["fingerprint"]["models"]["target"]["num_hidden_layers"] is not None  # the models it learned with
    assert main([*run, "--profile", str(learned)]) == 0
    err = capsys.readouterr().err
    assert f"[learned cost state: {learned}, {steps} steps]" in err  # it says where it started from
    assert json.loads(learned.read_text())["learned"]["state"]["observations"] > steps


def test_save_learned_with_nothing_to_save_or_a_contradiction_says_so(tiny_model_dirs, tmp_path, capsys):
    target, draft, _ = tiny_model_dirs
    learned = tmp_path / "learned.json"
    base = ["generate", "--target", target, "--draft", draft, "--prompt", PROMPT, "--max-new-tokens", "6",
            "--save-learned", str(learned)]
    assert main([*base, "--policy", "goodput", "--cost-model", "cells"]) == 2
    assert "--save-learned needs --cost-model shared" in capsys.readouterr().err
    assert main([*base, "--policy", "static:2"]) == 0  # no policy read costs: nothing learned, and it says so
    assert "not written" in capsys.readouterr().err and not learned.exists()


def test_a_reader_that_leaves_early_ends_the_command_quietly():
    """`adaptive-spec simulate ... | head -1`: once the reader has gone, writing fails; the command
    stops with the shell's status for it (141) and no traceback. The reader here leaves before the
    first line, so the write must fail: 141 shows the failure happened and was handled."""
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-c", "import sys; from adaptive_spec.cli import main; sys.exit(main())",
               "simulate", "--trace", str(root / "traces/qwen-coder-code-t0.csv"),
               "--profile", str(root / "profiles/cpu-2core-qwen-coder-fp32-int8draft.json"), "--policy", "static:2"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=root)
    process.stdout.close()
    errors = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141, errors
    assert "Traceback" not in errors


def test_save_steps_outside_the_vllm_plug_in_is_a_clear_error(capsys):
    """bench --save-steps logs the vLLM scheduler plug-in's steps; asked of our engine it refuses before
    any model loads rather than write nothing."""
    assert main(["bench", "--prompt", PROMPT, "--policies", "static:1", "--save-steps", "steps.jsonl"]) == 2
    assert "--save-steps logs the steps of the vLLM scheduler plug-in" in capsys.readouterr().err


def test_calibrate_sweeps_every_length_first_and_says_so(tiny_model_dirs, tmp_path, capsys):
    """generate --calibrate: the start-up sweep of K = 0..max k ran (its steps and lengths are in the
    summary) before goodput chose; asked of a policy that reads no costs, a clear error."""
    target, draft, _ = tiny_model_dirs
    preset = tmp_path / "goodput-3.toml"
    preset.write_text('policy = "goodput"\n[params]\nmax_k = 3\n')
    base = ["generate", "--target", target, "--draft", draft, "--prompt", PROMPT, "--max-new-tokens", "60",
            "--ignore-eos", "--profile", "none"]
    assert main([*base, "--policy", str(preset), "--calibrate", "0.000001"]) == 0
    summary = last_json(capsys)
    assert summary["calibration"]["max_k"] == 3 and summary["calibration"]["steps"] == 12  # 0..3, three steps each
    assert summary["calibration"]["seconds"] is not None  # the sweep ended and goodput took over
    assert main([*base, "--policy", "static:2", "--calibrate", "5"]) == 2
    assert "reads no step costs" in capsys.readouterr().err


def test_slo_tpot_reaches_goodput_and_is_refused_for_a_policy_without_the_guard(tiny_model_dirs, capsys, monkeypatch):
    """generate --slo-tpot: the engine's goodput runs with the target (seconds); a fixed policy has no
    guard, a clear error."""
    import adaptive_spec.cli.generate as generate

    built = []
    monkeypatch.setattr(generate, "SpecEngine", lambda *a, policy, **kw: built.append(policy) or SpecEngine(*a, policy=policy, **kw))
    target, draft, _ = tiny_model_dirs
    base = ["generate", "--target", target, "--draft", draft, "--prompt", PROMPT, "--max-new-tokens", "8",
            "--profile", "none"]
    assert main([*base, "--policy", "goodput", "--slo-tpot", "500"]) == 0
    assert built[0].config.tpot_target == pytest.approx(0.5)
    capsys.readouterr()
    assert main([*base, "--policy", "static:2", "--slo-tpot", "500"]) == 2
    assert "no latency guard" in capsys.readouterr().err
