"""The profiler on tiny random models, profile files, fingerprints and the `profile` command."""

from __future__ import annotations

import argparse
import json
import math
import warnings

import numpy as np
import pytest
import torch

from adaptive_spec.control.cost_model import CostModel
from adaptive_spec.profiling import (
    NAMED_ARCHITECTURES,
    ProfileError,
    ProfileMismatchError,
    ProfileMismatchWarning,
    ProfileSettings,
    check_fingerprint,
    load_cost_model,
    load_profile,
    machine_fingerprint,
    model_fingerprint,
    profile_frame,
    profile_models,
    random_model,
    resolve_config,
    save_profile,
)
from adaptive_spec.profiling.cli import add_profile_commands, main, parse_int_list
from adaptive_spec.profiling.profiler import _filled_kv, _time_forward

TINY = ProfileSettings(batch_sizes=(1, 2), contexts=(8, 32), query_tokens=(1, 2, 3), draft_query_tokens=(1, 2),
                       overhead_ks=(0, 2), warmup=1, repeats=2, overhead_steps=2)  # fmt: skip


@pytest.fixture(scope="module")
def one_thread():
    """Tiny forwards on a busy 2-core machine stall on thread hand-offs; one thread keeps them fast."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_models():
    config = resolve_config("tiny-qwen2")
    return random_model(config, seed=0), random_model(config, seed=1)


@pytest.fixture(scope="module")
def tiny_profile(tiny_models, one_thread):
    target, draft = tiny_models
    return profile_models(target, draft, TINY, name="tiny", target_name="tiny-qwen2", draft_name="tiny-qwen2",
                          random_weights=True, progress=False, log=lambda message: None)  # fmt: skip


def test_profile_run_on_a_tiny_model_produces_a_valid_file(tiny_profile, tmp_path):
    path = save_profile(tiny_profile, tmp_path / "sub" / "tiny.json")
    loaded = load_profile(path)
    assert loaded == json.loads(json.dumps(tiny_profile))
    assert loaded["schema_version"] == 1 and loaded["format"] == "adaptive-spec-profile"
    assert len(loaded["target"]) == 2 * 2 * 3 and len(loaded["draft"]) == 2 * 2 * 2
    for row in loaded["target"] + loaded["draft"]:
        assert len(row["samples"]) == TINY.repeats and row["median"] > 0 and row["iqr"] >= 0
    assert {(r["batch"], r["k"]) for r in loaded["overhead"]} == {(1, 0), (1, 2), (2, 0), (2, 2)}
    for row in loaded["overhead"]:
        assert row["rest"] >= 0 and row["verify_extra"] >= 0 and len(row["rest_samples"]) == TINY.overhead_steps
        assert (row["draft_extra"] > 0) == (row["k"] > 0)
    fp = loaded["fingerprint"]
    for key in ("device", "device_name", "torch_version", "threads", "dtype"):
        assert fp[key] not in (None, "")
    for role in ("target", "draft"):
        model = fp["models"][role]
        assert model["architecture"] == "Qwen2ForCausalLM" and model["parameters"] > 0 and model["random_weights"]
    assert loaded["grid"]["query_tokens"] == [1, 2, 3]
    frame = profile_frame(loaded, "target")
    assert len(frame) == 12 * TINY.repeats and set(frame.columns) >= {"batch", "context", "query_tokens", "seconds"}
    report = CostModel.from_profile(loaded).loo_errors()
    assert len(report.points) == 12 + 8 and report.median_rel_error >= 0


def test_synthetic_cache_has_the_right_shape_and_timing_restores_it(tiny_models, one_thread):
    target, _ = tiny_models
    generator = torch.Generator().manual_seed(0)
    for mode in ("random", "prefill"):
        kv = _filled_kv(target, 2, 16, mode, generator)
        assert kv.num_slots == 16 and kv.lengths.tolist() == [16, 16]
        tokens = torch.randint(0, 512, (2, 3), generator=generator)
        _time_forward(kv, tokens, 0)
        assert kv.num_slots == 16 and all(layer.keys.shape[2] == 16 for layer in kv.cache.layers)
    # After the cut the cache is what it was: the same block gives the same logits again.
    first = kv.forward(tokens, logits_to_keep=0).clone()
    kv.valid = kv.valid[:, :16]
    for layer in kv.cache.layers:
        layer.keys, layer.values = layer.keys[..., :16, :], layer.values[..., :16, :]
    torch.testing.assert_close(kv.forward(tokens, logits_to_keep=0), first)


def test_fingerprint_mismatch_warns_and_strict_raises(tiny_profile, tiny_models):
    target, draft = tiny_models
    current = machine_fingerprint("cpu")
    current["models"] = {"target": model_fingerprint(target), "draft": model_fingerprint(draft)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_fingerprint(tiny_profile, current) == []
    current["threads"] = 999
    with pytest.warns(ProfileMismatchWarning, match="threads"):
        differences = check_fingerprint(tiny_profile, current)
    assert differences == [f"threads: profile {tiny_profile['fingerprint']['threads']!r}, here 999"]
    with pytest.raises(ProfileMismatchError, match="threads"):
        check_fingerprint(tiny_profile, current, strict=True)
    bigger = random_model(resolve_config({**NAMED_ARCHITECTURES["tiny-qwen2"], "num_hidden_layers": 3}))
    current = machine_fingerprint("cpu")
    current["models"] = {"target": model_fingerprint(bigger)}
    with pytest.warns(ProfileMismatchWarning) as caught:
        differences = check_fingerprint(tiny_profile, current)
    assert any(d.startswith("target.parameters") for d in differences)
    assert any(d.startswith("target.config_hash") for d in differences)
    assert "target.parameters" in str(caught[0].message)


def test_load_cost_model_checks_the_running_models(tiny_profile, tiny_models, tmp_path):
    path = save_profile(tiny_profile, tmp_path / "tiny.json")
    target, draft = tiny_models
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = load_cost_model(path, target, draft)
    assert isinstance(model, CostModel) and model.step_seconds(1, 16, 2) > 0
    other = random_model(resolve_config({**NAMED_ARCHITECTURES["tiny-qwen2"], "hidden_size": 128}))
    with pytest.warns(ProfileMismatchWarning, match="tiny.json"):
        load_cost_model(path, other, draft)
    with pytest.raises(ProfileMismatchError, match="target"):
        load_cost_model(path, other, draft, strict=True)


def test_corrupt_or_missing_files_raise_errors_naming_them(tiny_profile, tmp_path):
    missing = tmp_path / "nowhere.json"
    with pytest.raises(ProfileError, match="nowhere.json.*does not exist"):
        load_profile(missing)
    text = json.dumps(tiny_profile)
    truncated = tmp_path / "truncated.json"
    truncated.write_text(text[: len(text) // 2])
    with pytest.raises(ProfileError, match="truncated.json.*not valid JSON"):
        load_profile(truncated)
    cases = {
        "format.json": {**tiny_profile, "format": "something-else"},
        "version.json": {**tiny_profile, "schema_version": 99},
        "empty.json": {**tiny_profile, "target": []},
        "negative.json": {**tiny_profile, "target": [{**tiny_profile["target"][0], "median": -1.0}]},
        "list.json": [1, 2, 3],
    }
    for name, data in cases.items():
        path = tmp_path / name
        path.write_text(json.dumps(data))
        with pytest.raises(ProfileError, match=name):
            load_profile(path)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ProfileError, match="binary.json"):
        load_profile(binary)


def test_cli_run_then_show(tmp_path, capsys, one_thread):
    out = tmp_path / "cli.json"
    code = main(["profile", "--target-config", "tiny-qwen2", "--draft-config", "tiny-qwen2", "--batch-sizes", "1",
                 "--contexts", "8,16", "--query-tokens", "1-3", "--repeats", "2", "--warmup", "0",
                 "--overhead-ks", "0,1", "--overhead-steps", "2", "--quiet", "--out", str(out)])  # fmt: skip
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["ok"] and result["out"] == str(out) and result["target_cells"] == 6
    models = load_profile(out)["fingerprint"]["models"]
    assert models["target"]["random_weights"]
    # no --draft-dtype: the draft as `generate` runs it by default on a CPU under a float32 target
    assert models["draft"]["dtype"] == "int8" and models["target"]["dtype"] == "float32"
    assert main(["profile", "show", str(out)]) == 0
    shown = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert isinstance(shown["loo_median_rel_error"], float) and shown["loo_points"] == 6 + 4
    assert shown["machine_matches"] is True


def test_cli_linear_times_both_kernels_side_by_side(capsys, one_thread):
    code = main(["profile", "linear", "--target-config", "tiny-qwen2", "--query-tokens", "1,3", "--contexts", "16",
                 "--repeats", "2"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [row["query_tokens"] for row in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert row["torch_ms"] > 0 and row["onednn_ms"] > 0
        assert row["torch_over_onednn"] == pytest.approx(row["torch_ms"] / row["onednn_ms"], rel=0.25)  # ms are rounded


def test_cli_show_reports_a_corrupt_file(tmp_path, capsys):
    bad = tmp_path / "broken.json"
    bad.write_text('{"format": "adaptive-spec-profile", "schema_')
    assert main(["profile", "show", str(bad)]) == 2
    captured = capsys.readouterr()
    assert "broken.json" in captured.err and json.loads(captured.out.strip().splitlines()[-1])["ok"] is False
    assert main(["profile", "show", str(tmp_path / "absent.json")]) == 2
    assert "absent.json" in capsys.readouterr().err


def test_cli_parses_the_documented_forms():
    parser = argparse.ArgumentParser(prog="adaptive-spec")
    add_profile_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["profile", "--pair", "qwen-coder", "--batch-sizes", "1,2,4,8", "--contexts",
                              "128,512,2048", "--query-tokens", "1-9", "--out", "profiles/x.json"])  # fmt: skip
    assert args.command == "profile" and args.profile_action == "run" and args.pair == "qwen-coder"
    assert args.batch_sizes == (1, 2, 4, 8) and args.query_tokens == tuple(range(1, 10))
    args = parser.parse_args(["profile", "--pair", "qwen-coder", "--quick", "--out", "profiles/x.json"])
    assert args.quick and args.profile_action == "run"
    args = parser.parse_args(["profile", "run", "--target-config", "Qwen2.5-7B", "--device", "cuda", "--dtype", "bfloat16"])
    assert args.target_config == "Qwen2.5-7B" and args.dtype == "bfloat16"
    args = parser.parse_args(["profile", "show", "profiles/x.json"])
    assert args.profile_action == "show" and args.profile_path == "profiles/x.json"


def test_parse_int_list():
    assert parse_int_list("1-4,6,9") == (1, 2, 3, 4, 6, 9)
    assert parse_int_list("8,2,2") == (2, 8)
    for bad in ("", "a", "5-2", "1,,x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_int_list(bad)


@pytest.mark.parametrize("name,billions", [("qwen2.5-0.5b", 0.494), ("Qwen2.5-1.5B-Instruct", 1.544), ("qwen2.5-3b", 3.086),
                                           ("Qwen/Qwen2.5-7B", 7.616), ("qwen2.5-14b", 14.77), ("qwen2.5-32b", 32.76),
                                           ("Qwen2.5-72B", 72.71)])  # fmt: skip
def test_named_architectures_have_the_published_parameter_counts(name, billions):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # no memory: only shapes
        model = AutoModelForCausalLM.from_config(resolve_config(name))
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, rel=0.005)


def test_unknown_architecture_and_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="unknown architecture"):
        resolve_config("qwen9-1t")
    with pytest.raises(ValueError, match="batch_sizes"):
        ProfileSettings(batch_sizes=())
    with pytest.raises(ValueError, match="cache_fill"):
        ProfileSettings(cache_fill="zeros")


def test_engine_steps_feed_the_online_correction(tiny_models, one_thread):
    """With no profile, a cost model fed the engine's own StepRecords learns this machine's costs."""
    from adaptive_spec.engine.engine import SpecEngine
    from adaptive_spec.sampling.params import SamplingParams

    class Learning:
        name = "learning"

        def __init__(self):
            self.model, self.records = CostModel.default(), []

        def choose(self, requests):
            return [2] * len(requests)

        def observe(self, record):
            self.records.append(record)
            self.model.observe(record)

    policy = Learning()
    target, draft = tiny_models
    engine = SpecEngine(target, draft, policy, max_k=2, seed=0)
    engine.generate([[1, 2, 3, 4], [5, 6, 7, 8]], SamplingParams(max_new_tokens=40, seed=1))
    assert policy.model.observations == len(policy.records) >= 8
    steady = [r for r in policy.records if r.batch_size == 2 and r.batch_k == 2][-5:]
    measured = float(np.median([r.total_seconds for r in steady]))
    context = max(steady[-1].context_lengths)
    predicted = policy.model.step_seconds(2, context, 2)
    # The correction moved the prediction toward what the engine measured, from the uncorrected
    # default (which guesses a far bigger model). How close it gets is a benchmark
    # (scripts/bench_timings.py): a band in seconds fails on a busy machine.
    default = CostModel.default().step_seconds(2, context, 2)
    assert abs(math.log(predicted / measured)) < abs(math.log(default / measured))
