"""What the subcommands share: model and prompt options, sampling options, summaries."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from pathlib import Path

from ..assets import Prompt, encode_prompt, load_humaneval, load_jsonl, load_sharegpt
from ..assets.structured import load_structured
from ..control.policy import mean_acceptance_length
from ..resources import data_dir
from ..engine.request import GenerationResult
from ..modeling.cpu_linear import KERNELS
from ..modeling.loading import PRECISIONS, LoadedPair, load_pair
from ..sampling.grammar import Grammar
from ..sampling.params import SamplingParams

DEFAULT_PAIR = "qwen-coder"


def add_model_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("models")
    group.add_argument("--pair", default=None, help=f"a named target/draft pair (default {DEFAULT_PAIR} "
                                                    "unless --target is given)")
    group.add_argument("--target", default=None, help="target model: a registry name or a local directory")
    group.add_argument("--draft", default=None,
                       help="draft model name or directory, 'ngram' (prompt lookup) or 'none'")
    group.add_argument("--dtype", choices=PRECISIONS, default="float32", help="target precision")
    group.add_argument("--draft-dtype", choices=PRECISIONS, default=None,
                       help="draft precision (int8 = dynamic quantisation; default: int8 under a float32 "
                            "target, the fastest exact choice on CPU, else the target's)")
    group.add_argument("--cpu-linear", choices=KERNELS, default="onednn",
                       help="what runs float32 Linear layers on CPU: oneDNN (default; 1.1-2.4x faster than torch's "
                            "default on the AMD CPUs measured, most on multi-token verifies) or torch's own "
                            "kernel; `adaptive-spec profile linear` compares them on this CPU")


def add_prompt_options(parser: argparse.ArgumentParser, default_prompt: str | None = None) -> None:
    group = parser.add_argument_group("prompts")
    group.add_argument("--prompt", action="append", default=None, help="a prompt text (repeatable)")
    group.add_argument("--prompts", default=None, help="a JSONL file of {\"prompt\": ...} or {\"messages\": [...]}")
    group.add_argument("--humaneval", type=int, default=0, metavar="N", help="the first N HumanEval prompts")
    group.add_argument("--humaneval-from", type=int, default=0, metavar="I",
                       help="start --humaneval (and --mix humaneval:N) at problem I, e.g. to keep traces that "
                            "warm-start a policy apart from the prompts it is benchmarked on")
    group.add_argument("--sharegpt", type=int, default=0, metavar="N", help="N ShareGPT prompts, sampled by length")
    group.add_argument("--structured", type=int, default=0, metavar="N",
                       help="N prompts of the structured workload: HumanEval and ShareGPT texts, each to be "
                            "described as JSON under its own schema (the answer is held to it)")
    group.add_argument("--no-chat", action="store_true", help="encode prompts as plain text, no chat template")
    parser.set_defaults(default_prompt=default_prompt)


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--max-new-tokens", type=int, default=128)
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")


def add_structured_options(parser: argparse.ArgumentParser) -> None:
    structured = parser.add_argument_group("structured output (one of)").add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="FILE", default=None, help="output JSON matching this schema")
    structured.add_argument("--json", action="store_true", help="output any JSON value")
    structured.add_argument("--regex", default=None, help="output matching this regular expression")
    structured.add_argument("--choice", default=None, metavar="A,B,...", help="output exactly one of these strings")
    structured.add_argument("--grammar", metavar="FILE", default=None,
                            help="output matching this grammar (llguidance's Lark syntax, or GBNF)")
    structured.add_argument("--free-text", action="store_true",
                            help="ignore the JSON schemas prompts carry (--structured, json_schema in --prompts): "
                                 "the same texts, unconstrained")


def prompt_grammars(args, prompts: Sequence[Prompt]) -> list[Grammar | None]:
    """Each prompt's grammar: the structured-output option for all, else the prompt's own
    `json_schema`, else none (and none with --free-text). A malformed one fails here, before any
    model loads; an option beside prompts with their own schemas is ambiguous, so it is refused."""
    grammar = grammar_from_args(args)
    own = [p for p in prompts if p.json_schema is not None]
    if grammar is not None and own:
        raise ValueError(f"{len(own)} prompt(s) carry their own json_schema (e.g. {own[0].id!r}) and a structured-"
                         "output option asks for one grammar for all: drop the option, or give --free-text "
                         "without it to run them unconstrained")
    if grammar is not None or getattr(args, "free_text", False):
        return [grammar] * len(prompts)
    grammars = []
    for prompt in prompts:
        if prompt.json_schema is None:
            grammars.append(None)
            continue
        try:
            grammars.append(Grammar.json_schema(prompt.json_schema).checked())
        except ValueError as error:
            raise ValueError(f"prompt {prompt.id!r}: {error}") from None
    return grammars


def grammar_from_args(args) -> Grammar | None:
    """The structured-output option given, if any, parsed by the grammar engine; a missing file or a
    malformed schema, regex or grammar is a clear error before any model loads."""
    grammar = _grammar_option(args)
    return grammar.checked() if grammar is not None else None


def _grammar_option(args) -> Grammar | None:
    if args.json_schema:
        return Grammar.json_schema(_read(args.json_schema, "--json-schema"))
    if args.json:
        return Grammar.json()
    if args.regex is not None:
        return Grammar.regex(args.regex)
    if args.choice is not None:
        return Grammar.choice([option.strip() for option in args.choice.split(",")])
    if args.grammar:
        return Grammar.lark(_read(args.grammar, "--grammar"))
    return None


def _read(path: str, option: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError as error:
        raise FileNotFoundError(f"{option}: cannot read {path}: {error.strerror}") from None


PROFILES_DIR = data_dir("profiles")


def add_policy_options(parser: argparse.ArgumentParser, default: str) -> None:
    group = parser.add_argument_group("policy")
    group.add_argument("--policy", default=default,
                       help="off | static:K | goodput | heuristic | confidence:P | ema-tiers | batch-table | a preset "
                            "name from policies/ | a preset .toml path")
    group.add_argument("--profile", default="auto",
                       help="latency profile for the goodput policy: a JSON file (a profile, or a learned state "
                            "from --save-learned), 'auto' (the best match in profiles/ for these models: one of this "
                            "machine first) or 'none' (learn costs online from a generic start)")
    add_learning_options(group)


def add_learning_options(parser) -> None:
    """--cost-model and --save-learned, for the commands that run our engine."""
    from ..control.online_cost import COST_MODELS

    parser.add_argument("--cost-model", choices=COST_MODELS, default=None,
                        help="goodput's online cost correction: cells (per (batch, K) cell) or shared (parameters "
                             "shared by every cell, control/online_cost.py); default cells, shared with "
                             "--save-learned or a learned --profile")
    parser.add_argument("--save-learned", metavar="FILE", default=None,
                        help="after the run, write the shared cost model's learned state here (profile format; "
                             "pass it as --profile to start the next run where this one ended)")
    add_calibrate_option(parser)
    add_latency_option(parser)


def add_latency_option(parser) -> None:
    parser.add_argument("--slo-tpot", type=float, default=0.0, metavar="MS",
                        help="goodput's latency guard: in steps of more than one request, keep every request's expected "
                             "time per output token within MS milliseconds (the decode step as the cost model prices "
                             "it; prefills beside it are not bounded); 0 = no target")


def add_calibrate_option(parser) -> None:
    parser.add_argument("--calibrate", type=float, default=0.0, metavar="SECONDS",
                        help="spend the first SECONDS of traffic (whole sweeps, at least one) drafting every length "
                             "0..max k in turn, so the cost model times each at the live context before the policy "
                             "prices them (control/price_sweep.py); for policies that read step costs; 0 = off")


def cost_model_kind(args) -> str:
    """--cost-model, or its default: shared when a learned state is saved, else cells."""
    from ..control.online_cost import resolve_kind

    return resolve_kind(args.cost_model, bool(getattr(args, "save_learned", None)))


def policy_factory(args, loaded: LoadedPair):
    """A cost-model factory for `make_policy`: loads the profile only if a policy needs it. Called
    with no argument it starts from --profile; ``factory(profile=P)`` from P instead ('none', 'auto'
    or a file: `bench`'s ``goodput@P``), the acceptance warm start still --profile's, so starts that
    differ in costs alone can be compared. Each model it builds is kept in ``factory.built`` as
    (model, the profile document or None), so `save_learned` can write what the run learned."""
    from ..profiling.profile_file import acceptance_path, is_learned, load_acceptance, load_cost_model, load_profile

    kind = cost_model_kind(args)

    def resolve(profile: str) -> Path | str | None:
        return find_profile(loaded) if profile == "auto" else None if profile == "none" else profile

    def cost_model(profile: str | None = None):
        from ..control.online_cost import cost_model_for

        path = resolve(profile or args.profile)
        if path is None:
            print("[no latency profile for these models: goodput learns step costs online]", file=sys.stderr)
            model, document = cost_model_for(None, kind), None
        else:
            model = load_cost_model(path, loaded.target, loaded.draft_model, kind=kind)
            document = load_profile(path)
            if is_learned(document):
                print(f"[learned cost state: {path}, {model.resumed_steps} steps]", file=sys.stderr)
            else:
                print(f"[latency profile: {path}]", file=sys.stderr)
        warm_from = resolve(args.profile) if profile else path
        model.warm_start = load_acceptance(acceptance_path(warm_from)) if warm_from is not None else None
        if model.warm_start:
            print(f"[acceptance warm start: {acceptance_path(warm_from)}]", file=sys.stderr)
        cost_model.built.append((model, document))
        return model

    cost_model.built = []
    return cost_model


def save_learned(args, factory, loaded: LoadedPair) -> Path | None:
    """Write --save-learned: the state of the model that learned the most steps this run."""
    from ..profiling.profile_file import learned_profile, running_fingerprint, save_profile

    if not getattr(args, "save_learned", None):
        return None
    learned = [(model.observations - getattr(model, "resumed_steps", 0), model, document)
               for model, document in factory.built if hasattr(model, "learned_state")]
    learned = [entry for entry in learned if entry[0] > 0]
    if not learned:
        print(f"[--save-learned: no policy learned step costs in this run (does one read costs, such as "
              f"goodput?); {args.save_learned} not written]", file=sys.stderr)
        return None
    steps, model, document = max(learned, key=lambda entry: entry[0])
    fingerprint = running_fingerprint(document, loaded.target, loaded.draft_model)
    for role, name in (("target", loaded.target_name), ("draft", loaded.draft_name)):
        if role in fingerprint["models"] and name and not Path(name).is_dir():  # registry names: what `auto` matches
            fingerprint["models"][role]["name"] = str(name)
    path = save_profile(learned_profile(model, document, fingerprint), args.save_learned)
    print(f"[learned cost state: {steps} steps this run, {model.observations} in all, "
          f"{model.outliers} outliers, {model.shifts} shifts -> {path}]", file=sys.stderr)
    return path


def find_profile(loaded: LoadedPair) -> Path | None:
    """`--profile auto` for our engine (`profile_file.best_profile`): a profile of this machine for
    these models first, then one measured with the same precisions and Linear kernels (an int8
    draft costs about half an fp32 one; oneDNN's float32 matmul about half of torch's default on a
    multi-token verify), then a learned state over a measured profile."""
    from ..profiling.profile_file import best_profile, fingerprint_value, model_fingerprint, running_fingerprint

    def how(model) -> dict:
        if model is None:
            return {}
        fingerprint = model_fingerprint(model)
        return {key: fingerprint_value(fingerprint, key) for key in ("dtype", "linear_kernel")}

    return best_profile(PROFILES_DIR, "hf", loaded.target_name, loaded.draft_name,
                        running_fingerprint(None, loaded.target), (how(loaded.target), how(loaded.draft_model)))


def load_models(args) -> LoadedPair:
    pair = args.pair if args.pair or args.target else DEFAULT_PAIR
    return load_pair(pair, args.target, args.draft, args.dtype, draft_precision(args),
                     cpu_linear=getattr(args, "cpu_linear", "onednn"))


def draft_precision(args) -> str:
    """The draft's precision: as asked, else int8 under a float32 target. The draft's numerics never
    touch exactness (the accept test corrects for whatever the draft proposes), and on the 2-core
    CPU an int8 draft of the default pair is the fastest exact configuration measured (see README)."""
    if args.draft_dtype:
        return args.draft_dtype
    return "int8" if args.dtype == "float32" else args.dtype


def gather_prompts(args) -> list[Prompt]:
    """Read every prompt source before any model loads, so a bad file fails fast."""
    prompts: list[Prompt] = []
    for index, text in enumerate(args.prompt or []):
        prompts.append(Prompt(id=f"prompt-{index}", messages=None, text=text, source="cli"))
    load = _source_loaders(args)
    if args.prompts:
        prompts += load_jsonl(args.prompts)
    if args.humaneval:
        prompts += load["humaneval"](args.humaneval)
    if args.sharegpt:
        prompts += load["sharegpt"](args.sharegpt)
    if getattr(args, "structured", 0):
        prompts += load["structured"](args.structured)
    if not prompts and args.default_prompt:
        prompts.append(Prompt(id="default", messages=None, text=args.default_prompt, source="default"))
    if not prompts:
        raise ValueError("no prompts: give --prompt, --prompts FILE.jsonl, --humaneval N, --sharegpt N or --structured N")
    return prompts


MIX_SOURCES = ("humaneval", "sharegpt", "structured", "prompts")


def parse_mix(text: str) -> list[tuple[str, int]]:
    """`humaneval:8,sharegpt:8` -> [("humaneval", 8), ("sharegpt", 8)]; an error names the part at fault."""
    mix: list[tuple[str, int]] = []
    for part in (piece.strip() for piece in text.split(",")):
        name, _, count = part.partition(":")
        name, count = name.strip().lower(), count.strip()
        if name not in MIX_SOURCES:
            raise ValueError(f"--mix {part!r}: unknown workload {name!r}; known: {', '.join(MIX_SOURCES)}")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"--mix {part!r}: the count must be a positive integer, as in {name}:8")
        if name in dict(mix):
            raise ValueError(f"--mix names {name!r} twice")
        mix.append((name, int(count)))
    return mix


def gather_mix(args, mix: list[tuple[str, int]]) -> list[tuple[str, list[Prompt]]]:
    """Each workload's prompts for `--mix`, read before any model loads. The mix replaces the other
    prompt options, so no prompt joins the stream unnamed; `--prompts FILE` joins only as `prompts:N`."""
    if args.prompt or args.humaneval or args.sharegpt or getattr(args, "structured", 0):
        raise ValueError("--mix replaces --prompt, --humaneval, --sharegpt and --structured: give one or the other")
    counts = dict(mix)
    if "prompts" in counts and not args.prompts:
        raise ValueError("--mix prompts:N takes its prompts from --prompts FILE.jsonl, which is missing")
    if args.prompts and "prompts" not in counts:
        raise ValueError("--prompts FILE joins a --mix only as prompts:N")
    load = _source_loaders(args)
    workloads = []
    for name, count in mix:
        prompts = load[name](count)
        if len(prompts) < count:
            raise ValueError(f"--mix {name}:{count}: only {len(prompts)} {name} prompts are available")
        workloads.append((name, prompts))
    return workloads


def _source_loaders(args) -> dict:
    """Prompt sets a count is drawn from, by the names `--mix` uses."""
    start = getattr(args, "humaneval_from", 0)
    if start < 0:
        raise ValueError(f"--humaneval-from must be >= 0, got {start}")
    return {"humaneval": lambda count: load_humaneval(limit=start + count)[start:],
            "sharegpt": lambda count: load_sharegpt(count, seed=args.seed, max_prompt_chars=2000),
            "structured": lambda count: load_structured(count, humaneval_from=start, seed=args.seed),
            "prompts": lambda count: load_jsonl(args.prompts)[:count]}


def encode_all(prompts: Sequence[Prompt], tokenizer, chat: bool) -> list[list[int]]:
    return [encode_prompt(tokenizer, prompt, chat=chat) for prompt in prompts]


def stop_ids(tokenizer, model) -> tuple[int, ...]:
    """End-of-sequence ids from the tokenizer and the model's generation config."""
    ids = set()
    for value in (getattr(tokenizer, "eos_token_id", None),
                  getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


def sampling_params(args, stops: tuple[int, ...], seed: int | None = None) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, max_new_tokens=args.max_new_tokens,
        seed=seed, stop_token_ids=() if args.ignore_eos else stops,
    )


def summarize(results: Sequence[GenerationResult], seconds: float) -> dict:
    """Totals over results. mean_acceptance_length counts the bonus/recovered token."""
    generated = sum(len(r.token_ids) for r in results)
    drafted = sum(r.stats.drafted for r in results)
    accepted = sum(r.stats.accepted for r in results)
    steps = sum(r.stats.steps for r in results)
    return {
        "requests": len(results),
        "errors": sum(r.error is not None for r in results),
        "generated_tokens": generated,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(generated / seconds, 3) if seconds > 0 else None,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "mean_acceptance_length": None if not steps else round(mean_acceptance_length(accepted, steps), 4),
    }


def print_json_line(document: dict) -> None:
    sys.stdout.write(json.dumps(document, sort_keys=True) + "\n")
    sys.stdout.flush()
