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
