"""The engine through its public API on tiny random models: greedy equality, batching, the serving
loop, cache hygiene and bad input."""

from __future__ import annotations

import warnings

import pytest
import torch

from adaptive_spec import PrefixConstraint, SamplingParams, SpecEngine, StaticPolicy
from adaptive_spec.control import AcceptanceHistory
from adaptive_spec.modeling import DrafterBase

from conftest import tiny_lm

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11], [12], [30, 31, 30, 31, 30]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=24)


def plain_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("k", [0, 1, 2, 4, 8])
def test_greedy_equals_plain_target_decoding(greedy_pair, k):
    target, draft = greedy_pair
    expected = [plain_greedy(target, p, 24) for p in PROMPTS]
    results = SpecEngine(target, draft, policy=f"static:{k}").generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" and r.error is None for r in results)
    if k:
        assert all(r.stats.drafted > 0 for r in results)


def test_a_perfect_draft_is_always_accepted(greedy_pair):
    target, _ = greedy_pair
    result = SpecEngine(target, target, policy="static:4").generate([PROMPTS[1]], GREEDY)[0]
    assert result.stats.acceptance_rate == 1.0
    assert result.stats.mean_acceptance_length > 4  # 5 per full step; the last step is cut by the budget


def test_ragged_batch_equals_each_request_alone(greedy_pair):
    target, draft = greedy_pair
    params = [SamplingParams(temperature=0, max_new_tokens=n) for n in (5, 24, 13, 17)]
    together = SpecEngine(target, draft, policy="static:3").generate(PROMPTS, params)
    alone = [SpecEngine(target, draft, policy="static:3").generate([p], q)[0] for p, q in zip(PROMPTS, params)]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [len(r.token_ids) for r in together] == [5, 24, 13, 17]


def test_sampling_is_reproducible_and_batch_independent(small_pair):
    target, draft = small_pair
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=12, seed=s) for s in (1, 2, 3)]
    prompts = [[1, 2], [3, 4, 5, 6], [7]]
    first = SpecEngine(target, draft, policy="static:3").generate(prompts, params)
    again = SpecEngine(target, draft, policy="static:3").generate(prompts, params)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    # Each request draws from its own generator, so its output does not depend on its neighbours.
    alone = SpecEngine(target, draft, policy="static:3").generate([prompts[1]], [params[1]])[0]
    assert alone.token_ids == first[1].token_ids
    other_seed = SpecEngine(target, draft, policy="static:3").generate(
        prompts, [SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=12, seed=s) for s in (11, 12, 13)])
    assert [r.token_ids for r in other_seed] != [r.token_ids for r in first]


class Alternating:
    """k = 0 on even steps and 3 on odd ones: exercises the draft cache catching up after k = 0."""

    name = "alternating"

    def __init__(self):
        self.steps = 0

    def choose(self, requests):
        self.steps += 1
        return [3 if self.steps % 2 else 0 for _ in requests]

    def observe(self, record):
        pass


def test_draft_cache_catches_up_after_speculation_was_off(greedy_pair):
    target, _ = greedy_pair
    # With the target as its own draft, any stale or misplaced draft KV shows up as a rejection.
    result = SpecEngine(target, target, policy=Alternating()).generate([PROMPTS[0]], GREEDY)[0]
    assert result.token_ids == plain_greedy(target, PROMPTS[0], 24)
    assert result.stats.drafted > 0 and result.stats.acceptance_rate == 1.0
    assert 0 in result.stats.k_per_step


def test_serving_loop_join_abort_and_finish(greedy_pair):
    target, draft = greedy_pair
    engine = SpecEngine(target, draft, policy="static:2", max_batch_size=2)
    a = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=10))
    b = engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_new_tokens=30))
    c = engine.add_request(PROMPTS[2], SamplingParams(temperature=0, max_new_tokens=6))  # waits for room
    streamed = {a: [], b: [], c: []}
    finished = {}
    steps = 0
    while engine.has_unfinished:
        steps += 1
        for out in engine.step():
            streamed[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out.finish_reason
        if steps == 3:
            aborted = engine.abort(b)
            assert aborted.finish_reason == "aborted" and aborted.token_ids == streamed[b]
    assert finished == {a: "length", c: "length"}
    assert streamed[a] == plain_greedy(target, PROMPTS[0], 10)
    assert streamed[c] == plain_greedy(target, PROMPTS[2], 6)
    assert engine.abort("no-such-request") is None


def test_stop_tokens_end_a_request_and_are_kept(greedy_pair):
    target, draft = greedy_pair
    reference = plain_greedy(target, PROMPTS[1], 24)
    stop = reference[5]
    cut = reference.index(stop) + 1
    result = SpecEngine(target, draft, policy="static:4").generate(
        [PROMPTS[1]], SamplingParams(temperature=0, max_new_tokens=24, stop_token_ids=[stop]))[0]
    assert result.finish_reason == "stop" and result.token_ids == reference[:cut]


def test_cache_memory_follows_live_tokens_not_drafts(greedy_pair):
    target, draft = greedy_pair
    engine = SpecEngine(target, draft, policy="static:8")
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=150))
    widest = 0
    while engine.has_unfinished:
        engine.step()
        if engine._running:
            lengths = engine._kv.lengths
            widest = max(widest, engine._kv.num_slots)
            # Slots are bounded by the live length (compaction), although 9 are fed per step.
            assert engine._kv.num_slots <= 1.5 * int(lengths.max()) + 32 + 9
            assert engine.drafter.kv.num_slots <= 1.5 * int(engine.drafter.kv.lengths.max()) + 32 + 9
    assert widest > 0


def test_constraint_advances_on_emitted_tokens_only(small_pair):
    target, draft = small_pair
    calls = []

    def allowed(generated):
        calls.append(generated)
        return [t for t in range(12) if t % 3 != (generated[-1] % 3 if generated else 0)]

    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=5, constraint=PrefixConstraint(allowed))
    out = SpecEngine(target, draft, policy="static:4").generate([[1, 2, 3]], params)[0]
    assert out.error is None and len(out.token_ids) == 20
    assert all(b % 3 != a % 3 for a, b in zip(out.token_ids, out.token_ids[1:]))
    assert out.token_ids[0] % 3 != 0


def test_bad_requests_fail_alone(small_pair):
    target, draft = small_pair
    engine = SpecEngine(target, draft, policy="static:2")
    nothing = PrefixConstraint(lambda generated: [] if len(generated) >= 2 else list(range(12)))
    good = SamplingParams(max_new_tokens=5, seed=0)
    cases = [
        ([], good, "empty"),
        ([1, 99], good, "outside the vocabulary"),
        ([1, 2], SamplingParams(max_new_tokens=300), "exceeds the model's context"),
        ([1, 2], SamplingParams(max_new_tokens=5, stop_token_ids=[40]), "outside the vocabulary"),
        ([1, 2], SamplingParams(max_new_tokens=5, constraint=nothing), "no token"),
        ([1, 2], SamplingParams(max_new_tokens=5, allowed_token_ids=[3]), None),
    ]
    results = engine.generate([c[0] for c in cases] + [[1, 2, 3]], [c[1] for c in cases] + [good])
    for (prompt, _, message), result in zip(cases, results):
        if message is None:
            assert result.error is None and set(result.token_ids) == {3}
        else:
            assert result.finish_reason == "error" and message in result.error, (message, result.error)
    assert results[-1].error is None and len(results[-1].token_ids) == 5
    # The constrained request kept what it emitted before the constraint closed.
    assert len(results[4].token_ids) == 2
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], good)


def test_vocabulary_mismatch_is_refused():
    with pytest.raises(ValueError, match="vocabularies differ"):
        SpecEngine(tiny_lm(0, vocab=12), tiny_lm(1, vocab=16))


class NaNModel(torch.nn.Module):
    """Wraps a model and poisons the logits of every row whose last input token is `poison`."""

    def __init__(self, model, poison):
        super().__init__()
        self.model, self.config, self.poison = model, model.config, poison

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()

    def forward(self, input_ids, logits_to_keep=0, **kwargs):
        out = self.model(input_ids=input_ids, logits_to_keep=logits_to_keep, **kwargs)
        bad = input_ids[:, -1] == self.poison
        out.logits[bad] = float("nan")
        return out


def test_non_finite_target_logits_fail_that_request_only(small_pair):
    target, draft = small_pair
    engine = SpecEngine(NaNModel(target, poison=11), draft, policy="static:2")
    results = engine.generate([[1, 11], [1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=4))
    assert results[0].finish_reason == "error" and "non-finite" in results[0].error
    assert results[1].error is None and results[1].token_ids == plain_greedy(target, [1, 2, 3], 4)


def test_non_finite_draft_logits_only_shorten_the_draft(small_pair):
    target, draft = small_pair
    poisoned = SpecEngine(target, NaNModel(draft, poison=5), policy="static:3")
    result = poisoned.generate([[5, 5, 1]], SamplingParams(temperature=0, max_new_tokens=12))[0]
    assert result.error is None and result.token_ids == plain_greedy(target, [5, 5, 1], 12)


class BrokenDrafter(DrafterBase):
    def propose(self, contexts, num_tokens, sample):
        raise RuntimeError("draft server went away")


def test_a_failing_drafter_falls_back_to_plain_decoding(small_pair):
    target, _ = small_pair
    engine = SpecEngine(target, BrokenDrafter(), policy="static:3")
    with pytest.warns(RuntimeWarning, match="draft server went away"):
        result = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=6))[0]
    assert result.error is None and result.token_ids == plain_greedy(target, [1, 2, 3], 6)


def test_policy_sees_history_and_its_choice_is_clamped(greedy_pair):
    target, draft = greedy_pair
    seen = []

    class Greedy:
        name = "record"

        def choose(self, requests):
            seen.append([(r.remaining_tokens, r.max_k, r.history.steps) for r in requests])
            return [100 for _ in requests]

        def observe(self, record):
            assert record.batch_size == len(record.outcomes)

    result = SpecEngine(target, draft, policy=Greedy(), max_k=5).generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=9))[0]
    assert max(result.stats.k_per_step) <= 5
    assert all(max_k <= min(5, remaining - 1) for step in seen for remaining, max_k, _ in step)
    assert [s[0][2] for s in seen] == list(range(len(seen)))


def test_policy_strings():
    assert StaticPolicy(0).name == "off"
    with pytest.raises(ValueError, match="unknown policy"):
        SpecEngine(tiny_lm(0), None, policy="fastest")
    with pytest.raises(ValueError, match="static:K"):
        SpecEngine(tiny_lm(0), None, policy="static:x")
    history = AcceptanceHistory()
    history.record(3, 2)
    assert (history.drafted, history.accepted, history.steps) == (3, 2, 1)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_ngram_drafter_greedy_equals_plain_decoding(greedy_pair, k):
    from adaptive_spec import NgramDrafter

    target, _ = greedy_pair
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 1, 2, 1]]
    expected = [plain_greedy(target, p, 30) for p in prompts]
    results = SpecEngine(target, NgramDrafter(min_ngram=1), policy=f"static:{k}").generate(
        prompts, SamplingParams(temperature=0, max_new_tokens=30))
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.drafted for r in results) > 0


def test_ngram_lookup_prefers_the_longest_latest_match():
    from adaptive_spec import NgramDrafter

    drafter = NgramDrafter(max_ngram=3, min_ngram=1)
    assert drafter.lookup([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3], 2) == [4, 9]  # trigram 1,2,3 beats 2,3
    assert drafter.lookup([7, 1, 8, 1], 2) == [8, 1]  # unigram 1: latest earlier occurrence
    assert drafter.lookup([4, 5, 6], 3) == []
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=1, min_ngram=2)


def test_sliding_window_models_stay_exact_inside_the_window_and_refuse_beyond():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    config = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=24,
                         max_window_layers=0, layer_types=["sliding_attention", "sliding_attention"])
    target = Qwen2ForCausalLM(config).eval()
    target.generation_config.eos_token_id = None
    engine = SpecEngine(target, target, policy="static:4", max_k=4)
    assert engine.attention_window == 24
    result = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=16))[0]
    assert result.error is None and result.token_ids == plain_greedy(target, [1, 2, 3], 16)
    refused = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=30))[0]
    assert "sliding attention window" in refused.error


def test_confidence_policy_stops_drafts_early_and_stays_exact(greedy_pair):
    target, draft = greedy_pair
    expected = plain_greedy(target, PROMPTS[1], 24)
    eager = SpecEngine(target, draft, policy="confidence:0.0").generate([PROMPTS[1]], GREEDY)[0]
    shy = SpecEngine(target, draft, policy="confidence:0.9").generate([PROMPTS[1]], GREEDY)[0]
    assert eager.token_ids == expected and shy.token_ids == expected
    assert shy.stats.drafted < eager.stats.drafted


@pytest.mark.parametrize("policy", ["goodput", "heuristic", "ema-tiers", "batch-table"])
def test_adaptive_policies_keep_greedy_exact(greedy_pair, policy):
    target, draft = greedy_pair
    expected = [plain_greedy(target, p, 24) for p in PROMPTS]
    results = SpecEngine(target, draft, policy=policy).generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == expected


def test_keep_last_ends_a_row_without_running_another_draft_forward(small_pair):
    """A stop rule answering KEEP_LAST at position 1 keeps 2 drafts and runs no third draft
    forward (draft_positions == 2, although k = 6 was chosen); False at position 0 drafts nothing
    and the loop ends after 1 forward. Outputs stay plain greedy."""
    from adaptive_spec.control import KEEP_LAST, PolicyBase

    target, draft = small_pair

    class KeepTwo(PolicyBase):
        name = "keep-two"

        def __init__(self, answer_at_0):
            self.answer_at_0, self.records = answer_at_0, []

        def choose(self, requests):
            return [6] * len(requests)

        def keep_drafting(self, position, confidences):
            answer = self.answer_at_0 if position == 0 else KEEP_LAST
            return [answer if c is not None else False for c in confidences]

        def observe(self, record):
            self.records.append(record)

    prompt = [1, 2, 3, 4]
    for answer, kept, positions in ((True, 2, 2), (False, 0, 1)):
        policy = KeepTwo(answer)
        engine = SpecEngine(target, draft, policy=policy)
        result = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=12))[0]
        assert result.token_ids == plain_greedy(target, prompt, 12)
        speculative = [r for r in policy.records if r.draft_positions]
        # Near the budget's end the cap (remaining - 1) is below 6 and ends the draft sooner.
        assert all(r.draft_positions <= positions and r.batch_k <= kept for r in speculative)
        full = [r for r in speculative if r.draft_positions == positions]
        assert len(full) >= len(speculative) - 2 >= 1
        assert all(r.batch_k == kept and r.outcomes[0].k == kept for r in full)
