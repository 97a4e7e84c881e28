"""The structured workload and per-prompt schemas: what the prompts carry, how each command resolves
them into grammars before any model loads, and the engine's count of constraint-mask work."""

from __future__ import annotations

import argparse
import json

import jsonschema
import pytest

from adaptive_spec import PrefixConstraint, SamplingParams, SpecEngine
from adaptive_spec.assets import Prompt, PromptFileError, load_jsonl
from adaptive_spec.assets import structured
from adaptive_spec.cli.common import add_structured_options, prompt_grammars
from adaptive_spec.sampling.grammar import Grammar, GrammarError

pytest.importorskip("llguidance")


def _fake_sources(monkeypatch):
    """HumanEval and ShareGPT stand-ins, so the workload's shape is tested without the data wheels."""
    monkeypatch.setattr(structured, "load_humaneval", lambda limit: [
        Prompt(f"HumanEval/{i}", None, f"def f{i}(x):\n    \"\"\"Problem {i}.\"\"\"\n", "humaneval") for i in range(limit)])
    monkeypatch.setattr(structured, "load_sharegpt", lambda count, seed, max_prompt_chars: [
        Prompt(f"chat{i}", None, f"Request number {i}, please help.", "sharegpt") for i in range(count)])


def test_the_workload_alternates_code_and_chat_under_eight_valid_schemas(monkeypatch):
    _fake_sources(monkeypatch)
    prompts = structured.load_structured(17, humaneval_from=3)
    assert [p.source for p in prompts[:4]] == ["json-code", "json-chat", "json-code", "json-chat"]
    assert prompts[0].id == "HumanEval/3/signature" and prompts[-1].id == "HumanEval/11/signature"
    assert len(prompts) == 17 and sum(p.source == "json-code" for p in prompts) == 9
    schemas = {json.dumps(p.json_schema, sort_keys=True) for p in prompts}
    assert len(schemas) == 8 == len(structured.SCHEMAS)
    for prompt in prompts:  # the schema the answer is held to is the one the prompt shows
        assert prompt.text.endswith(json.dumps(prompt.json_schema, separators=(",", ":")))
    for schema in structured.SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)
        Grammar.json_schema(schema).checked()  # the grammar engine compiles every one


def test_a_negative_count_is_refused():
    with pytest.raises(ValueError, match="count >= 0"):
        structured.load_structured(-1)


def test_jsonl_records_may_carry_a_json_schema(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a", "json_schema": {"type": "object"}}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "b"}]}) + "\n")
    first, second = load_jsonl(path)
    assert first.json_schema == {"type": "object"} and second.json_schema is None
    path.write_text(json.dumps({"prompt": "a", "json_schema": "{}"}) + "\n")
    with pytest.raises(PromptFileError, match=r"p.jsonl:1: \"json_schema\" must be a JSON object"):
        load_jsonl(path)


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_structured_options(parser)
    return parser.parse_args(list(argv))


def test_prompts_keep_their_own_schemas_and_free_text_drops_them():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    prompts = [Prompt("x", None, "t", "s", json_schema=schema), Prompt("y", None, "t", "s")]
    own, free = prompt_grammars(_args(), prompts), prompt_grammars(_args("--free-text"), prompts)
    assert own == [Grammar.json_schema(schema), None] and free == [None, None]
    assert prompt_grammars(_args("--regex", "[0-9]+"), prompts[1:]) == [Grammar.regex("[0-9]+")]


def test_an_option_beside_prompts_with_their_own_schemas_is_refused():
    prompts = [Prompt("x", None, "t", "s", json_schema={"type": "object"})]
    with pytest.raises(ValueError, match="carry their own json_schema"):
        prompt_grammars(_args("--json"), prompts)


def test_a_malformed_schema_or_regex_fails_before_any_model_loads():
    bad = [Prompt("bad-one", None, "t", "s", json_schema={"type": "nonsense"})]
    with pytest.raises(ValueError, match="prompt 'bad-one'.*nonsense"):
        prompt_grammars(_args(), bad)
    with pytest.raises(GrammarError, match="regex"):
        prompt_grammars(_args("--regex", "[0-9"), [Prompt("y", None, "t", "s")])


def test_the_engine_counts_one_mask_per_position_shared_by_draft_and_target(small_pair):
    """A constrained request's masks: one at prefill, then one per drafted position and one at the
    bonus position of every step; drafting and verifying share them (the count would be about
    twice as high otherwise). A free row beside it computes none, and each step reports its share."""
    target, draft = small_pair
    records = []
    engine = SpecEngine(target, draft, policy="static:3", seed=0)
    observe = engine.policy.observe
    engine.policy.observe = lambda record: (records.append(record), observe(record))
    constrained = SamplingParams(temperature=1.0, max_new_tokens=20, seed=1,
                                 constraint=PrefixConstraint(lambda state: range(2, 12)))
    free = SamplingParams(temperature=1.0, max_new_tokens=20, seed=2)
    held, loose = engine.generate([[1, 2, 3], [4, 5]], [constrained, free])
    assert max(held.stats.k_per_step) == 3  # k = 3 was drafted
    assert held.stats.masks == 1 + sum(k + 1 for k in held.stats.k_per_step)
    assert held.stats.mask_seconds > 0 and loose.stats.masks == 0 and loose.stats.mask_seconds == 0
    assert records[0].mask_seconds > 0 and all(r.mask_seconds < r.total_seconds for r in records)
    assert sum(r.mask_seconds for r in records) <= held.stats.mask_seconds
