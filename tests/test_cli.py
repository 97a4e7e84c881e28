"""The command line end to end on tiny local models (in process; no network)."""

from __future__ import annotations

import json

from adaptive_spec.cli import main

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
