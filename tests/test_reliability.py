"""Regression tests from the reliability review: each failed before its fix.

Every test drives the public engine on tiny random models and checks the outcome against plain
greedy decoding of the target, token for token, and that what the test meant to happen (a fault in
a given phase, a rejected draft, a detached draft row) really happened.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import warnings

import pytest
import torch

from adaptive_spec import SamplingParams, SpecEngine
from adaptive_spec.control import HFHeuristicPolicy, PolicyBase, RequestOutcome, RequestView, StepRecord
from adaptive_spec.control.policy import AcceptanceHistory
from adaptive_spec.modeling import Draft, DrafterBase, ModelDrafter
from adaptive_spec.sampling.transforms import RowSettings, process_logits

from conftest import tiny_lm

VOCAB = 64
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [12], [30, 31, 30, 31, 30]]
LENGTH = 12


@pytest.fixture(scope="module")
def pair():
    return tiny_lm(10, vocab=VOCAB), tiny_lm(11, vocab=VOCAB)


def plain_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def greedy(n=LENGTH, **extra):
    return SamplingParams(temperature=0, max_new_tokens=n, **extra)


def run_streaming(engine, requests):
    """Serve (prompt, params) pairs through add_request/step; returns {id: (streamed tokens, result)}."""
    streamed, results = {}, {}
    for index, (prompt, params) in enumerate(requests):
        streamed[engine.add_request(prompt, params, f"r{index}")] = []
    while engine.has_unfinished:
        for out in engine.step():
            streamed[out.request_id] += out.new_token_ids
            if out.finished:
                results[out.request_id] = out.result
    return {rid: (streamed[rid], results[rid]) for rid in streamed}


# --- 2. sliding-window targets and drafts with rejected drafts ---------------------------------------

def sliding_lm(seed: int, window: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                         sliding_window=window, max_window_layers=0,
                         layer_types=["sliding_attention", "sliding_attention"])
    model = Qwen2ForCausalLM(config).eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.mark.parametrize("window", [24, 64])
def test_sliding_window_pair_with_rejections_equals_plain_greedy(window):
    """A different sliding-window draft makes rejections, so the cache compacts mid-step."""
    target, draft = sliding_lm(3, window), sliding_lm(4, window)
    prompt = [1, 2, 3]
    new_tokens = window - len(prompt) - 4 - 1  # the longest request the engine accepts at max_k 4
    result = SpecEngine(target, draft, policy="static:4", max_k=4).generate([prompt], greedy(new_tokens))[0]
    assert result.error is None
    assert result.token_ids == plain_greedy(target, prompt, new_tokens)
    assert result.stats.drafted > result.stats.accepted  # drafts were rejected: holes were made
    assert 4 in result.stats.k_per_step


# --- 3. a step is a transaction ----------------------------------------------------------------

def engine_phase() -> str:
    """Which engine phase the calling user code runs in, read from the call stack."""
    names = {frame.function for frame in inspect.stack()}
    for phase, function in (("emit", "_emit"), ("draft", "_draft"), ("verify", "_verify_and_emit"),
                            ("admit", "_prefill"), ("jump", "_forced_runs")):
        if function in names:
            return phase
    return "other"


class FaultyConstraint:
    """Allows every token, but `method` raises in engine phase `phase` once the state holds
    `at_length` tokens. Records the phases it raised in."""

    def __init__(self, phase: str, method: str, at_length: int):
        self.phase, self.method, self.at_length = phase, method, at_length
        self.fired: set[str] = set()

    def _maybe_raise(self, method, state):
        if method == self.method and len(state) >= self.at_length and engine_phase() == self.phase:
            self.fired.add(self.phase)
            raise RuntimeError(f"injected fault in {method}")

    def initial_state(self):
        return ()

    def allowed_tokens(self, state):
        self._maybe_raise("allowed_tokens", state)
        return range(VOCAB)

    def advance(self, state, token):
        self._maybe_raise("advance", state + (token,))
        return state + (token,)


@pytest.mark.parametrize("phase, method, at_length", [
    ("admit", "allowed_tokens", 0), ("draft", "allowed_tokens", 3), ("verify", "allowed_tokens", 3),
    ("emit", "advance", 3),
])
def test_a_constraint_fault_fails_only_its_request_in_every_phase(pair, phase, method, at_length):
    target, draft = pair
    constraint = FaultyConstraint(phase, method, at_length)
    faulty_prompt = [1, 2, 4]  # the same length as PROMPTS[0]: one prefill group
    requests = [(p, greedy()) for p in PROMPTS] + [(faulty_prompt, greedy(constraint=constraint))]
    # With jump-forward the committed position's mask is made before drafting: without it, the draft
    # asks for that mask first, so a fault there is the draft's.
    engine = SpecEngine(target, draft, policy="static:3", jump_forward=phase != "draft")
    outcome = run_streaming(engine, requests)
    assert constraint.fired == {phase}
    for index, prompt in enumerate(PROMPTS):
        streamed, result = outcome[f"r{index}"]
        assert result.error is None and result.token_ids == plain_greedy(target, prompt, LENGTH)
        assert streamed == result.token_ids  # nothing lost, nothing duplicated
    streamed, result = outcome[f"r{len(PROMPTS)}"]
    assert result.finish_reason == "error" and "injected fault" in result.error
    assert streamed == result.token_ids
    expected = plain_greedy(target, faulty_prompt, LENGTH)
    assert result.token_ids == expected[: len(result.token_ids)]
    if phase != "admit":
        assert len(result.token_ids) >= at_length - 1  # the tokens before the fault were kept


def test_a_constraint_fault_in_jump_forward_costs_only_the_jump(pair):
    """Jump-forward asks for the committed position's mask before drafting and treats a fault there as
    no forced run: the step asks again, here without the fault, and the request goes on exactly."""
    target, draft = pair
    constraint = FaultyConstraint("jump", "allowed_tokens", 3)
    result = SpecEngine(target, draft, policy="static:3").generate([[1, 2, 4]], greedy(constraint=constraint))[0]
    assert constraint.fired == {"jump"}
    assert result.error is None and result.token_ids == plain_greedy(target, [1, 2, 4], LENGTH)


def test_a_constraint_whose_initial_state_raises_is_refused_alone(pair):
    target, draft = pair

    class NoStart(FaultyConstraint):
        def initial_state(self):
            raise RuntimeError("no start state")

    engine = SpecEngine(target, draft, policy="static:3")
    results = engine.generate([PROMPTS[0], PROMPTS[1]],
                              [greedy(constraint=NoStart("x", "x", 0)), greedy()])
    assert results[0].finish_reason == "error" and "no start state" in results[0].error
    assert results[1].token_ids == plain_greedy(target, PROMPTS[1], LENGTH)
    assert not engine.has_unfinished


class FlakyDrafter(ModelDrafter):
    """A model drafter whose `method` raises on its `on_call`-th call."""

    def __init__(self, model, method: str, on_call: int):
        super().__init__(model)
        self.method, self.on_call, self.calls = method, on_call, 0

    def _tick(self, method):
        if method == self.method:
            self.calls += 1
            if self.calls == self.on_call:
                raise RuntimeError(f"injected drafter fault in {method}")

    def propose(self, contexts, num_tokens, sample):
        self._tick("propose")
        return super().propose(contexts, num_tokens, sample)

    def accept(self, num_accepted):
        self._tick("accept")
        super().accept(num_accepted)


@pytest.mark.parametrize("method", ["propose", "accept"])
def test_a_drafter_fault_mid_run_switches_speculation_off_and_keeps_every_request_exact(pair, method):
    target, draft = pair
    drafter = FlakyDrafter(draft, method, on_call=3)
    engine = SpecEngine(target, drafter, policy="static:3")
    with pytest.warns(RuntimeWarning, match="injected drafter fault"):
        outcome = run_streaming(engine, [(p, greedy()) for p in PROMPTS])
    assert drafter.calls == 3 and "injected drafter fault" in engine.drafter_error
    for index, prompt in enumerate(PROMPTS):
        streamed, result = outcome[f"r{index}"]
        assert result.error is None and result.token_ids == plain_greedy(target, prompt, LENGTH)
        assert streamed == result.token_ids
        assert result.stats.drafted > 0  # it did speculate before the fault


@pytest.mark.parametrize("where", ["choose", "keep_drafting", "observe"])
def test_a_policy_fault_switches_speculation_off_and_keeps_outputs_exact(pair, where):
    target, draft = pair

    class Faulty(PolicyBase):
        name = "faulty"

        def __init__(self):
            self.steps = 0

        def choose(self, requests):
            if where == "choose" and self.steps == 2:
                raise RuntimeError("injected policy fault")
            return [3] * len(requests)

        def keep_drafting(self, position, confidences):
            if where == "keep_drafting" and self.steps == 2 and position == 1:
                raise RuntimeError("injected policy fault")
            return [c is not None for c in confidences]

        def observe(self, record):
            self.steps += 1
            if where == "observe" and self.steps == 2:
                raise RuntimeError("injected policy fault")

    engine = SpecEngine(target, draft, policy=Faulty())
    with pytest.warns(RuntimeWarning, match="injected policy fault"):
        results = engine.generate(PROMPTS, greedy())
    assert "injected policy fault" in engine.policy_error and engine.policy.name == "off"
    assert [r.token_ids for r in results] == [plain_greedy(target, p, LENGTH) for p in PROMPTS]
    assert all(0 < r.stats.drafted for r in results)


def test_a_prefill_group_survives_a_request_that_breaks_its_forward(pair):
    """Prompts of one length prefill together; a failing forward is retried request by request."""
    target, _ = pair

    class Fussy(torch.nn.Module):  # raises on any batch holding token 63
        def __init__(self, model):
            super().__init__()
            self.model, self.config = model, model.config

        def get_output_embeddings(self):
            return self.model.get_output_embeddings()

        def forward(self, input_ids, **kwargs):
            if (input_ids == 63).any():
                raise RuntimeError("token 63 is cursed")
            return self.model(input_ids=input_ids, **kwargs)

    engine = SpecEngine(Fussy(target), None)
    results = engine.generate([[1, 2, 3], [1, 63, 3], [5, 6, 7]], greedy(4))
    assert "cursed" in results[1].error
    assert results[0].token_ids == plain_greedy(target, [1, 2, 3], 4)
    assert results[2].token_ids == plain_greedy(target, [5, 6, 7], 4)


# --- 4. drafter output is validated ----------------------------------------------------------

class ScriptedDrafter(DrafterBase):
    """Proposes what `make(contexts, num_tokens)` returns; counts its calls."""

    def __init__(self, make, vocab_size=None):
        self.make, self.vocab_size, self.calls = make, vocab_size, 0

    def propose(self, contexts, num_tokens, sample):
        self.calls += 1
        return self.make(contexts, num_tokens)


def _no_drafts(contexts, num_tokens):
    return Draft(torch.zeros(len(contexts), max(num_tokens), dtype=torch.long), None,
                 torch.zeros(len(contexts), dtype=torch.long))


def test_out_of_vocabulary_drafts_are_dropped_with_one_warning(pair):
    target, _ = pair

    def out_of_vocab(contexts, num_tokens):
        return Draft(torch.full((len(contexts), max(num_tokens)), 999), None, torch.as_tensor(num_tokens))

    drafter = ScriptedDrafter(out_of_vocab)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = SpecEngine(target, drafter, policy="static:3").generate(PROMPTS, greedy())
    unusable = [w for w in caught if "unusable draft" in str(w.message)]
    assert len(unusable) == 1
    assert drafter.calls == LENGTH - 2  # asked at every step but the last (budget 1 left: k capped to 0)
    assert [r.token_ids for r in results] == [plain_greedy(target, p, LENGTH) for p in PROMPTS]
    assert all(r.stats.drafted == 0 for r in results)


@pytest.mark.parametrize("defect", ["count-beyond-columns", "zero-draft-probability", "negative-count"])
def test_a_malformed_draft_row_is_verified_as_no_draft(pair, defect):
    """At temperature 1 a malformed row that were used would change the sampled stream; treated
    as no draft, the run equals one whose drafter proposes nothing (same uniforms per step)."""
    target, draft_model = pair
    torch.manual_seed(0)

    def malformed(contexts, num_tokens):
        rows, columns = len(contexts), max(num_tokens)
        with torch.no_grad():  # the target's own argmax: a draft the accept test would like
            best = [int(target(torch.tensor([c])).logits[0, -1].argmax()) for c in contexts]
        tokens = torch.tensor(best)[:, None].repeat(1, columns)
        if defect == "count-beyond-columns":
            return Draft(tokens, None, torch.full((rows,), columns + 1))
        if defect == "negative-count":
            return Draft(tokens, None, torch.full((rows,), -2))
        probs = torch.zeros(rows, columns, VOCAB).scatter_(-1, (tokens[..., None] + 1) % VOCAB, 1.0)
        return Draft(tokens, probs, torch.as_tensor(num_tokens))  # all mass beside the drafted token

    params = [SamplingParams(temperature=1.0, max_new_tokens=LENGTH, seed=s) for s in range(len(PROMPTS))]
    with pytest.warns(RuntimeWarning, match="unusable draft"):
        checked = SpecEngine(target, ScriptedDrafter(malformed, VOCAB), policy="static:3").generate(PROMPTS, params)
    reference = SpecEngine(target, ScriptedDrafter(_no_drafts, VOCAB), policy="static:3").generate(PROMPTS, params)
    assert [r.token_ids for r in checked] == [r.token_ids for r in reference]
    assert all(r.stats.drafted == 0 for r in checked)


# --- 5. extreme parameters -------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("temperature", 1e-39), ("temperature", 1e39),
                                          ("repetition_penalty", 1e-39), ("repetition_penalty", 1e39)])
def test_parameters_that_cannot_be_computed_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_a_huge_top_k_keeps_everything_and_spares_its_prefill_group(pair):
    target, draft = pair
    prompts = [[1, 2, 3], [4, 5, 6]]  # one prefill group
    huge = SpecEngine(target, draft, policy="static:2").generate(
        prompts, [SamplingParams(top_k=2**63, max_new_tokens=8, seed=1), SamplingParams(max_new_tokens=8, seed=2)])
    plain = SpecEngine(target, draft, policy="static:2").generate(
        prompts, [SamplingParams(top_k=0, max_new_tokens=8, seed=1), SamplingParams(max_new_tokens=8, seed=2)])
    assert all(r.error is None for r in huge)
    assert [r.token_ids for r in huge] == [r.token_ids for r in plain]


@pytest.mark.parametrize("temperature", [1e-30, 1e30])
def test_the_extreme_accepted_temperatures_stay_inside_the_allowed_set(pair, temperature):
    """The bounds of the accepted range are really computable (beyond them: refused, above)."""
    target, draft = pair
    allowed = frozenset({3, 9, 17, 40})
    params = SamplingParams(temperature=temperature, allowed_token_ids=allowed, max_new_tokens=10, seed=4)
    results = SpecEngine(target, draft, policy="static:3").generate(PROMPTS, params)
    assert all(r.error is None and set(r.token_ids) <= allowed for r in results)
    assert sum(r.stats.drafted for r in results) > 0


def test_a_row_whose_distribution_overflows_fails_alone(pair):
    target, draft = pair

    class Loud(torch.nn.Module):  # token 5's logit near the float32 limit
        def __init__(self, model):
            super().__init__()
            self.model, self.config = model, model.config

        def get_output_embeddings(self):
            return self.model.get_output_embeddings()

        def forward(self, **kwargs):
            out = self.model(**kwargs)
            out.logits[..., 5] = 1e37
            return out

    engine = SpecEngine(Loud(target), draft, policy="static:2")
    results = engine.generate([[5, 1, 2], [1, 2, 3]], [SamplingParams(repetition_penalty=1e-20, max_new_tokens=4),
                                                       SamplingParams(max_new_tokens=4, seed=3)])
    assert results[0].finish_reason == "error" and "non-finite distribution" in results[0].error
    assert results[1].error is None and len(results[1].token_ids) == 4


# --- 6. top-k ties -------------------------------------------------------------------------

def test_top_k_keeps_ties_like_hugging_face():
    from transformers.generation.logits_process import TopKLogitsWarper

    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0]])
    settings = RowSettings(*(torch.tensor([v]) for v in (1.0, 2, 1.0, 0.0, 1.0)))
    probs, _ = process_logits(logits, settings)
    hf = torch.softmax(TopKLogitsWarper(top_k=2)(None, logits.clone()), dim=-1)
    assert (probs > 0).tolist() == [[True, True, True, False, False]]
    assert torch.allclose(probs, hf, atol=1e-6)


# --- 7. a draft model with a position limit ---------------------------------------------------

def test_a_prompt_too_long_for_the_draft_only_turns_its_own_drafting_off(pair):
    from transformers import GPT2Config, GPT2LMHeadModel

    target, _ = pair
    torch.manual_seed(0)
    short_draft = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                             bos_token_id=None, eos_token_id=None)).eval()
    long_prompt, short_prompt = list(range(1, 21)), [1, 2, 3]
    engine = SpecEngine(target, short_draft, policy="static:3")
    results = engine.generate([long_prompt, short_prompt], greedy(16))
    assert engine.drafter_error is None
    assert results[0].token_ids == plain_greedy(target, long_prompt, 16) and results[0].stats.drafted == 0
    assert results[1].token_ids == plain_greedy(target, short_prompt, 16) and results[1].stats.drafted > 0
    # the short request outgrew the draft's 16 positions mid-run (3 + 16 tokens) and stopped drafting
    assert results[1].stats.k_per_step[-1] == 0
    later = engine.generate([short_prompt], greedy(8))[0]  # speculation still on for new requests
    assert later.stats.drafted > 0


# --- 8. per-request policy state ---------------------------------------------------------------

def test_a_reused_request_id_starts_with_fresh_policy_state(pair):
    target, draft = pair
    seen = []

    class Recorder(PolicyBase):
        name = "recorder"

        def choose(self, requests):
            seen.extend(r.request_id for r in requests)
            return [2] * len(requests)

    engine = SpecEngine(target, draft, policy=Recorder())
    keys = []
    for _ in range(2):
        engine.add_request(PROMPTS[0], greedy(4), request_id="same")
        before = len(seen)
        while engine.has_unfinished:
            engine.step()
        keys.append(set(seen[before:]))
    assert len(keys[0]) == len(keys[1]) == 1 and keys[0] != keys[1]


def test_heuristic_with_floor_zero_probes_its_way_back():
    policy = HFHeuristicPolicy(start=1, floor=0, probe_interval=4)
    view = RequestView("r", 10, 100, 8, AcceptanceHistory())

    def step(accepted_all: bool) -> int:
        k = policy.choose([view])[0]
        policy.observe(StepRecord(1, k, (10,), (RequestOutcome("r", k, k if accepted_all else 0, 1),), 0, 0, 0))
        return k

    assert step(False) == 1  # rejected: down to 0
    assert [step(False) for _ in range(4)] == [0, 0, 0, 0]
    assert step(True) == 1  # the probe, fully accepted
    assert step(True) == 2  # climbing back by +2


# --- 10. shipped data outside a checkout ------------------------------------------------------

@pytest.mark.slow
def test_a_non_editable_install_finds_presets_and_profiles(tmp_path):
    """Build and install the package (not editable) into a folder and import it from elsewhere."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(root)], check=True, cwd=tmp_path)
    probe = ("import adaptive_spec, json; from adaptive_spec.control.registry import known_policies, make_policy; "
             "from adaptive_spec.cli.common import PROFILES_DIR; "
             "print(json.dumps([adaptive_spec.__file__, known_policies(), make_policy('static-3').name, "
             "sorted(p.name for p in PROFILES_DIR.glob('*.json'))]))")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}).stdout
    import json

    location, policies, preset_name, profiles = json.loads(out.strip().splitlines()[-1])
    assert location.startswith(str(target))  # really the installed copy, not the checkout
    assert {"goodput", "static-3"} <= set(policies) and preset_name == "static:3"
    assert "cpu-2core-qwen-coder-fp32.json" in profiles
