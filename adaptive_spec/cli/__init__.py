"""Layer 5: the `adaptive-spec` command line. One subcommand per job; each ends with one JSON line."""

from __future__ import annotations

import argparse
import os
import sys

from ..assets.cli import add_models_commands, run_models
from .bench import add_bench_command, run_bench
from .generate import add_generate_command, run_generate
from .policy_cost import add_policy_cost_command, run_policy_cost
from .serve import add_serve_command, run_serve_command
from .trace_simulate import add_trace_commands, run_simulate, run_trace

from ..assets import FetchError
from ..profiling.cli import add_profile_commands, run_profile
from ..profiling.profile_file import ProfileError

# Bad input only: a KeyError or any other exception from a bug keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, PermissionError, FetchError, ProfileError)


# One example per command, shown at the end of `adaptive-spec COMMAND --help` (tests/test_docs.py
# parses each with this parser, so an example cannot go stale).
EXAMPLES = {
    "generate": ["adaptive-spec generate --pair qwen-coder --prompt 'Write a quicksort in Python'",
                 "adaptive-spec generate --pair qwen-coder --prompts prompts.jsonl --policy static:3 --temperature 0.7"],
    "bench": ["adaptive-spec bench --pair qwen-coder --humaneval 3 --sharegpt 3",
              "adaptive-spec bench --pair qwen-coder --mix humaneval:8,sharegpt:8 --policies off,static:3,goodput --no-hf"],
    "models": ["adaptive-spec models list", "adaptive-spec models fetch qwen-coder"],
    "policy-cost": ["adaptive-spec policy-cost --policy goodput --profile profiles/cpu-2core-qwen-coder-fp32-int8draft.json"],
    "profile": ["adaptive-spec profile --pair qwen-coder --quick --out profiles/my-machine.json",
                "adaptive-spec profile show profiles/cpu-2core-qwen-coder-fp32-int8draft.json"],
    "trace": ["adaptive-spec trace --pair qwen-coder --humaneval 6 --max-new-tokens 64 --workload code --out my-trace.csv"],
    "simulate": ["adaptive-spec simulate --trace traces/int8-draft/qwen-coder-code-t0.csv "
                 "--profile profiles/cpu-2core-qwen-coder-fp32-int8draft.json --policies off,static:3,goodput,oracle"],
    "serve": ["adaptive-spec serve --pair qwen-coder --port 8000",
              "adaptive-spec serve --pair qwen-coder --dry-run"],
}


def _add_examples(parser: argparse.ArgumentParser, examples: list[str]) -> None:
    """Print `examples` after the command's help, line by line: appended to the formatted help, so
    each subparser keeps its own formatter (some re-wrap an epilog's lines) and its own epilog."""
    help_of = parser.format_help
    text = "examples:\n" + "".join(f"  {example}\n" for example in examples)
    parser.format_help = lambda: help_of().rstrip("\n") + "\n\n" + text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adaptive-spec", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_generate_command(subparsers)
    add_bench_command(subparsers)
    add_models_commands(subparsers)
    add_policy_cost_command(subparsers)
    add_profile_commands(subparsers)
    add_trace_commands(subparsers)
    add_serve_command(subparsers)
    for name, command in subparsers.choices.items():
        if name in EXAMPLES:
            _add_examples(command, EXAMPLES[name])
    return parser


COMMANDS = {"generate": run_generate, "bench": run_bench, "models": run_models, "policy-cost": run_policy_cost,
            "profile": run_profile, "trace": run_trace, "simulate": run_simulate, "serve": run_serve_command}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except USER_ERRORS as error:  # bad input: one clear line, no traceback
        print(f"adaptive-spec {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader left early (`... | head`): stop quietly, as a shell tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # or the exit's flush fails again
        return 141


if __name__ == "__main__":
    sys.exit(main())
