"""Grammars (llguidance) as constraints: masks that depend only on the path of tokens, whatever order
drafts are explored and rejected in; structured output through the speculative engine with drafts
really running; errors for bad grammars. Needs the small real model's tokenizer and weights
(smollm2-135m-instruct, fetched by the set-up script)."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from adaptive_spec import NgramDrafter, SamplingParams, SpecEngine
from adaptive_spec.assets import encode_prompt, is_fetched
from adaptive_spec.modeling.loading import load_model
from adaptive_spec.sampling import grammar as grammar_module
from adaptive_spec.sampling.grammar import Grammar, GrammarError

from conftest import tiny_lm  # at import, while `conftest` is this folder's (tests/vllm has one too)

pytest.importorskip("llguidance")
pytestmark = pytest.mark.real_models

MODEL = "smollm2-135m-instruct"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smollm2():
    if not is_fetched(MODEL):
        pytest.skip(f"run `adaptive-spec models fetch {MODEL}`")
    return load_model(MODEL, "float32", progress=False)


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[1]


def _fresh_mask(constraint, path):
    """The mask after `path` from a brand-new request: no history but the path itself."""
    state = constraint.initial_state()
    for token in path:
        state = constraint.advance(state, token)
    return constraint.allowed_tokens(state)


def _explore(constraint, seed: int, steps: int = 40):
    """A draft tree walked as the engine walks it: from the committed state, draft a few allowed tokens
    (asking each position's mask), accept a random prefix, commit it, repeat; masks are asked for in an
    order that keeps jumping between the committed state and abandoned branches; a request whose
    grammar is complete is followed by a new one. Returns every (path, mask) pair seen."""
    rng = random.Random(seed)
    committed, committed_path, seen = constraint.initial_state(), [], []
    abandoned = []
    for _ in range(steps):
        state, path = committed, list(committed_path)
        branch = []
        for _ in range(rng.randint(1, 5)):
            mask = constraint.allowed_tokens(state)
            seen.append((tuple(path), mask.clone()))
            allowed = mask.nonzero().flatten().tolist()
            if not allowed:
                break
            token = rng.choice(allowed)
            branch.append((state, path, token))
            state, path = constraint.advance(state, token), path + [token]
        if abandoned and rng.random() < 0.5:  # look back at a rejected branch, as a stale cache would
            old_state, old_path = rng.choice(abandoned)
            seen.append((tuple(old_path), constraint.allowed_tokens(old_state).clone()))
        keep = rng.randint(0, len(branch))
        abandoned += [(s, p) for s, p, _ in branch[keep:]]
        for state_before, path_before, token in branch[:keep]:
            committed, committed_path = constraint.advance(state_before, token), path_before + [token]
        if constraint.allowed_tokens(committed).sum() == 0:  # the grammar is complete: a new request
            committed, committed_path = constraint.initial_state(), []
    return seen


def _mismatches(constraint, seen) -> int:
    """Masks that differ from a fresh request's on the same path (a path the grammar forbids counts)."""
    def differs(path, mask) -> bool:
        try:
            return not torch.equal(mask, _fresh_mask(constraint, path))
        except GrammarError:
            return True

    return sum(differs(path, mask) for path, mask in seen)


@pytest.mark.parametrize("grammar", [Grammar.json_schema(SCHEMA), Grammar.regex(r"(ab|a[0-9]{2,4})+z"),
                                     Grammar.json()], ids=["schema", "regex", "json"])
def test_masks_depend_on_the_path_only_not_on_the_order_drafts_were_explored(tokenizer, grammar):
    constraint = grammar.constraint(tokenizer)
    seen = _explore(constraint, seed=0)
    assert len(seen) > 60 and len({path for path, _ in seen}) > 30  # a real tree, revisited
    assert _mismatches(constraint, seen) == 0


def test_negative_control_a_matcher_that_never_rolls_back_is_caught(tokenizer, monkeypatch):
    """If the matcher only ever moved forward (the bug class 'draft masked with the wrong state'),
    the same walk either meets masks that differ from a fresh request's or drives the matcher into a
    state no path has (llguidance then reports an error): either way the bug is caught."""
    constraint = Grammar.json_schema(SCHEMA).constraint(tokenizer)

    def forward_only(cursor, node):  # consume the new tokens, never roll back
        path, walk = [], node
        while walk is not None and walk.depth > cursor.at.depth:
            path.append(walk.token)
            walk = walk.parent
        cursor.matcher.consume_tokens(path[::-1])
        cursor.at = node

    monkeypatch.setattr(grammar_module._Cursor, "goto", forward_only)
    try:
        seen, failed = _explore(constraint, seed=0), False
    except GrammarError:
        seen, failed = [], True
    monkeypatch.undo()
    assert failed or _mismatches(constraint, seen) > 0


def test_padding_ids_past_the_tokenizer_are_never_allowed(tokenizer):
    constraint = Grammar.json().constraint(tokenizer, vocab_size=len(tokenizer) + 64)
    mask = constraint.allowed_tokens(constraint.initial_state())
    assert mask.shape == (len(tokenizer) + 64,) and mask.any() and not mask[len(tokenizer):].any()


def test_advancing_through_a_forbidden_token_is_an_error(tokenizer):
    constraint = Grammar.regex("[0-9]+").constraint(tokenizer)
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    with pytest.raises(GrammarError, match="not allowed"):
        constraint.advance(constraint.initial_state(), letter)


@pytest.mark.parametrize("make, message", [
    (lambda: Grammar.json_schema("{not json"), "not valid JSON"),
    (lambda: Grammar.choice([]), "non-empty strings"),
])
def test_malformed_grammars_are_refused_at_construction(make, message):
    with pytest.raises(GrammarError, match=message):
        make()


def test_a_grammar_that_does_not_compile_is_refused_before_decoding(tokenizer):
    with pytest.raises(GrammarError, match="does not compile"):
        Grammar.regex("(unclosed").constraint(tokenizer)


def test_compiled_grammars_are_cached_per_grammar_and_tokenizer(tokenizer):
    first = Grammar.json_schema(SCHEMA).constraint(tokenizer)
    again = Grammar.json_schema(dict(SCHEMA)).constraint(tokenizer)
    assert first.compiled is again.compiled
    assert Grammar.regex("a+").constraint(tokenizer).compiled is not first.compiled


# --- through the engine -------------------------------------------------------------------------

def _generate(smollm2, prompts, params_list, policy):
    model, tokenizer = smollm2
    engine = SpecEngine(model, NgramDrafter(), policy=policy, seed=0)
    ids = [encode_prompt(tokenizer, p) for p in prompts]
    for i, (prompt, params) in enumerate(zip(ids, params_list)):
        engine.add_request(prompt, params, request_id=str(i))
    results = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.result
    return [results[str(i)] for i in range(len(prompts))]


def _params(tokenizer, grammar=None, **options):
    constraint = grammar.constraint(tokenizer, None) if grammar is not None else None
    return SamplingParams(**{"temperature": 0.0, "max_new_tokens": 40, "stop_token_ids": (tokenizer.eos_token_id,),
                             "constraint": constraint, **options})


# The answer is in the prompt, written as the grammar writes JSON (no spaces), so the n-gram drafter
# finds runs of it to draft.
PROMPT = ('Give the JSON for a person named Ada aged 36, like {"name":"Bob","age":41}. '
          'Answer with the JSON only: {"name":"Ada","age":36}')


def test_greedy_json_schema_output_is_valid_and_identical_with_and_without_speculation(smollm2):
    _, tokenizer = smollm2
    grammar = Grammar.json_schema(SCHEMA)
    plain_prompt = "Tell me a very short story about a cat."
    runs = {policy: _generate(smollm2, [PROMPT, plain_prompt],
                              [_params(tokenizer, grammar), _params(tokenizer, max_new_tokens=16)], policy)
            for policy in ("off", "static:4")}
    (off_json, off_plain), (spec_json, spec_plain) = runs["off"], runs["static:4"]
    assert spec_json.error is None and spec_json.token_ids == off_json.token_ids
    assert spec_plain.token_ids == off_plain.token_ids  # the unconstrained row beside it is untouched
    assert max(spec_json.stats.k_per_step) == 4 and spec_json.stats.accepted > 0  # drafts really ran and counted
    value = json.loads(tokenizer.decode(spec_json.token_ids, skip_special_tokens=True))
    assert set(value) == {"name", "age"} and isinstance(value["age"], int) and 0 <= value["age"] <= 150
    assert spec_json.finish_reason == "stop"  # the grammar ended it, not the token budget


def test_sampled_regex_and_choice_outputs_match_their_grammars(smollm2):
    _, tokenizer = smollm2
    pattern = r"[0-9]{3}-[0-9]{4}"
    options = ["red", "green", "blue"]
    # the number is in the prompt, so the n-gram drafter finds its digits to draft
    prompts = ["My number is 555-1234, and hers is 555-1234 too. Repeat my number.",
               "Pick a colour: red, green or blue?"] * 3
    grammars = [Grammar.regex(pattern), Grammar.choice(options)] * 3
    params = [_params(tokenizer, g, temperature=1.0, seed=i) for i, g in enumerate(grammars)]
    results = _generate(smollm2, prompts, params, "static:3")
    texts = [tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in results]
    assert all(r.error is None for r in results), [r.error for r in results]
    assert all(re.fullmatch(pattern, t) for t in texts[0::2]), texts
    assert all(t in options for t in texts[1::2]), texts
    assert sum(r.stats.drafted for r in results[0::2]) > 0  # speculation really ran under the regex


# --- the law under a grammar, over a real tokenizer's vocabulary --------------------------------

CHOICES = ["yes", "no", "maybe", "yesterday", "noon"]
LAW_SAMPLES = 2000
LAW_ALPHA = 1e-4


def _grammar_law(target, prompt: list[int], constraint, eos: int, settings) -> dict[tuple[int, ...], float]:
    """Every output the grammar allows (any tokenisation of each choice, then end of sequence) with
    its exact probability under the masked, processed target distributions, by walking the tree."""
    from adaptive_spec.sampling.transforms import process_logits

    law, frontier = {}, [((), constraint.initial_state(), 1.0)]
    while frontier:
        path, state, mass = frontier.pop()
        mask = constraint.allowed_tokens(state)
        with torch.no_grad():
            logits = target(torch.tensor([prompt + list(path)])).logits[:, -1]
        probs = process_logits(logits, settings, None, mask[None])[0][0].double()
        for token in mask.nonzero().flatten().tolist():
            if probs[token] <= 0:
                continue
            if token == eos:
                law[path + (token,)] = mass * float(probs[token])
            else:
                frontier.append((path + (token,), constraint.advance(state, token), mass * float(probs[token])))
    return law


def _chi_square(counts, law, total) -> float:
    from scipy import stats

    expected = {seq: p * total for seq, p in law.items()}
    if any(seq not in law for seq in counts):
        return 0.0  # an output the grammar or the target cannot produce
    big = [seq for seq in law if expected[seq] >= 5]
    observed = [counts.get(seq, 0) for seq in big] + [sum(counts.get(s, 0) for s in law if s not in big)]
    wanted = [expected[seq] for seq in big] + [sum(expected[s] for s in law if s not in big)]
    if wanted[-1] == 0:
        observed, wanted = observed[:-1], wanted[:-1]
    return float(stats.chisquare(observed, [w * sum(observed) / sum(wanted) for w in wanted]).pvalue)


def _sample_choices(tokenizer, policy, seed, samples=LAW_SAMPLES):
    from collections import Counter

    from adaptive_spec.sampling.transforms import RowSettings

    vocab = len(tokenizer)
    target, draft = tiny_lm(21, vocab=vocab, arch="llama"), tiny_lm(22, vocab=vocab, arch="llama")
    constraint = Grammar.choice(CHOICES).constraint(tokenizer, vocab)
    eos = tokenizer.eos_token_id
    params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=(eos,), constraint=constraint)
    prompt = tokenizer.encode("Answer:", add_special_tokens=False)
    engine = SpecEngine(target, draft, policy=policy, max_batch_size=200, seed=seed)
    results = engine.generate([prompt] * samples, params)
    settings = RowSettings(*(torch.tensor([v]) for v in (1.0, 0, 1.0, 0.0, 1.0)))
    law = _grammar_law(target, prompt, constraint, eos, settings)
    return results, Counter(tuple(r.token_ids) for r in results if r.error is None), law


@pytest.mark.slow
def test_sampled_outputs_under_a_grammar_follow_the_target_law_over_smollm2s_vocabulary(tokenizer):
    """A random target and draft over SmolLM2's 49,152-token vocabulary, a choice grammar whose every
    tokenisation is enumerated, k = 4 drafts: the outputs' law equals the masked target's, by a
    chi-square test at p < 1e-4 (its false-failure probability), 2,000 samples, fixed seeds."""
    results, counts, law = _sample_choices(tokenizer, "static:4", seed=3)
    assert all(r.error is None for r in results), {r.error for r in results}
    assert len(law) > len(CHOICES)  # several tokenisations of the choices are possible
    assert max(k for r in results for k in r.stats.k_per_step) >= 3  # deep drafts really ran
    assert sum(r.stats.accepted for r in results) > 0 and sum(r.stats.drafted for r in results) > sum(
        r.stats.accepted for r in results)  # drafts were both accepted and rejected
    texts = {tokenizer.decode(seq[:-1]) for seq in counts}
    assert texts <= set(CHOICES)
    assert _chi_square(counts, law, LAW_SAMPLES) >= LAW_ALPHA


@pytest.mark.slow
def test_negative_control_target_masked_with_the_committed_state_is_caught(tokenizer, monkeypatch):
    """The same test fails when every verified position is masked with the committed state's mask."""
    from adaptive_spec.engine import processing

    correct = processing.StepSampler._allowed_at
    monkeypatch.setattr(processing.StepSampler, "_allowed_at",
                        lambda self, row, position, drafts: correct(self, row, 0, drafts))
    results, counts, law = _sample_choices(tokenizer, "static:4", seed=3, samples=500)
    monkeypatch.undo()
    failed = sum(r.error is not None for r in results)
    assert failed > 0 or _chi_square(counts, law, len(results)) < LAW_ALPHA


def test_bench_constrains_every_request_and_skips_the_hf_baselines(smollm2, capsys):
    """`bench --choice`: every request of every configuration is held to the grammar (a one-word
    answer, then the end), where the same prompts unconstrained run on (the negative control)."""
    from adaptive_spec.cli import main

    base = ["bench", "--target", MODEL, "--draft", "ngram", "--prompt", "Is the sky blue? Answer yes or no.",
            "--prompt", "Is water dry? Answer yes or no.", "--policies", "off,static:3", "--temperatures", "0,0.7",
            "--max-new-tokens", "24"]
    documents = {}
    for structured in ([], ["--choice", "yes,no"]):
        assert main(base + structured) == 0
        captured = capsys.readouterr()
        documents[bool(structured)] = json.loads(captured.out.strip().splitlines()[-1])
        assert ("skipping hf-plain" in captured.err) == bool(structured)
    constrained = documents[True]
    assert constrained["settings"]["structured"] == "--choice yes,no" and documents[False]["settings"]["structured"] is None
    assert {(r["config"], r["temperature"]) for r in constrained["runs"]} == {
        (c, t) for c in ("off", "static:3") for t in (0.0, 0.7)}
    for row in constrained["runs"]:  # "yes" or "no" and the end of sequence: a few tokens per request
        assert row["tokens"] <= 3 * row["requests"], row
    free = [row for row in documents[False]["runs"] if row["config"] != "hf-plain"]
    assert min(row["tokens"] for row in free) > 3 * 2  # unconstrained, the model says more


def test_bench_holds_each_prompt_to_its_own_schema_and_free_text_drops_them(smollm2, capsys, tmp_path):
    """Prompts carrying a json_schema are held to it, a prompt without one runs free beside them, and
    the result counts the mask work; with --free-text the same prompts run unconstrained (the
    negative control: no masks, and the Hugging Face baseline comes back)."""
    from adaptive_spec.cli import main

    yes_no = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(record) for record in [
        {"prompt": 'Is the sky blue? Answer as JSON, like {"answer":"yes"}.', "json_schema": yes_no},
        {"prompt": 'Is water dry? Answer as JSON, like {"answer":"no"}.', "json_schema": yes_no},
        {"prompt": "Tell me about the sea."}]) + "\n")
    base = ["bench", "--target", MODEL, "--draft", "ngram", "--prompts", str(path), "--policies", "off,static:2",
            "--temperatures", "0", "--max-new-tokens", "24"]
    documents = {}
    for extra in ([], ["--free-text"]):
        assert main(base + extra) == 0
        captured = capsys.readouterr()
        documents[bool(extra)] = json.loads(captured.out.strip().splitlines()[-1])
        assert ("skipping hf-plain" in captured.err) != bool(extra)
    held, free = documents[False], documents[True]
    assert held["settings"]["structured"] == "own json_schema (2 of 3 prompts)" and free["settings"]["structured"] is None
    for row in held["runs"]:
        assert row["masks"] > 0 and 0 < row["mask_ms_per_mask"] and 0 < row["mask_share"] < 1, row
    assert all("masks" not in row for row in free["runs"]) and "hf-plain" in {r["config"] for r in free["runs"]}
    assert main(base + ["--json"]) == 2  # one grammar for all beside prompts with their own: ambiguous
    assert "carry their own json_schema" in capsys.readouterr().err


def test_bench_reports_jump_forward_and_runs_a_lane_without_it(smollm2, capsys, tmp_path):
    """Under a JSON schema, fixed text (`{"answer":"`) is forced: the default lane takes part of its
    tokens by jump-forward (`forced_share` > 0), the `+no-jump` lane none, with equal greedy outputs."""
    from adaptive_spec.cli import main

    path = tmp_path / "schema.json"
    path.write_text(json.dumps({"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
                                "required": ["answer"], "additionalProperties": False}))
    args = ["bench", "--target", MODEL, "--draft", "ngram", "--prompt",
            'Is the sky blue? Answer like {"answer":"yes"}.', "--policies", "static:2,static:2+no-jump",
            "--temperatures", "0", "--max-new-tokens", "24"]
    assert main(args + ["--json-schema", str(path)]) == 0
    document = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {row["config"]: row for row in document["runs"]}
    assert set(rows) == {"static:2", "static:2+no-jump"}
    assert rows["static:2"]["forced_share"] > 0 and rows["static:2+no-jump"]["forced_share"] == 0
    assert rows["static:2"]["tokens"] == rows["static:2+no-jump"]["tokens"]
