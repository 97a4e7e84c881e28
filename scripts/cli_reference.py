"""Write docs/cli.md, the command-line reference, from the real argument parser.

    python scripts/cli_reference.py          # rewrite docs/cli.md
    python scripts/cli_reference.py --check  # exit 1 if docs/cli.md is not what the parser gives

tests/test_docs.py runs the check, so a flag or default changed in code fails CI until this is rerun.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "cli.md"

HEADER = """# Command-line reference

Generated from the argument parser by `python scripts/cli_reference.py`; do not edit by hand
(`tests/test_docs.py` fails when it is out of date). `adaptive-spec COMMAND --help` prints the same
with each option's full help. Every command's last stdout line is one JSON document.
"""


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off" if action.default is False else "on"
    if not action.option_strings and action.nargs in ("?", "*", argparse.REMAINDER) and action.default is None:
        return "-"
    if action.required:
        return "required"
    if action.default is None or action.default == argparse.SUPPRESS:
        return "-"
    value = action.default
    if isinstance(value, (tuple, list)):
        value = ",".join(str(v) for v in value)
    return f"`{value}`"


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    text = argparse.HelpFormatter(parser.prog)._expand_help(action)  # the help as written, without a formatter's additions
    return " ".join(text.split()).replace("|", "\\|")


def _name(action: argparse.Action) -> str:
    if action.option_strings:
        flags = ", ".join(action.option_strings)
        if action.nargs == 0:
            return f"`{flags}`"
        metavar = action.metavar or (("{" + ",".join(map(str, action.choices)) + "}") if action.choices
                                      else action.dest.upper())
        return f"`{flags} {metavar}`".replace("|", "\\|")
    return f"`{action.metavar or action.dest}`"


def _command(lines: list[str], prog: str, parser: argparse.ArgumentParser, summary: str, examples) -> None:
    lines += ["", f"## {prog}", ""]
    if summary:
        lines += [summary, ""]
    rows = [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.help != argparse.SUPPRESS]
    if rows:
        lines += ["| argument | default | meaning |", "|---|---|---|"]
        lines += [f"| {_name(a)} | {_default(a)} | {_help(parser, a)} |" for a in rows]
    if examples:
        lines += ["", "```bash", *examples, "```"]
    sub = _subparsers(parser)
    if sub is not None:
        helps = {choice.dest: choice.help or "" for choice in sub._choices_actions}
        for name, child in sub.choices.items():
            _command(lines, f"{prog} {name}", child, helps.get(name, ""), None)


def render() -> str:
    sys.path.insert(0, str(ROOT))
    from adaptive_spec.cli import EXAMPLES, build_parser

    parser = build_parser()
    sub = _subparsers(parser)
    helps = {choice.dest: choice.help or "" for choice in sub._choices_actions}
    lines = HEADER.rstrip("\n").split("\n")
    lines += ["", "Commands: " + ", ".join(f"[`{name}`](#adaptive-spec-{name})" for name in sub.choices) + "."]
    for name, command in sub.choices.items():
        _command(lines, f"adaptive-spec {name}", command, helps.get(name, ""), EXAMPLES.get(name))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT.relative_to(ROOT)} is out of date: run python scripts/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
