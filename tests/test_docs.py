"""The docs, checked against the code: every `adaptive-spec ...` command shown parses with the real
argument parser, every repository path named exists, stated defaults equal the parser's, and the
generated CLI reference (docs/cli.md) is current.

Scope: README.md and docs/**/*.md. docs/history/ is left out of the command and default checks on
purpose: its files are dated records of what was run then, quoted verbatim, and stay as they were
when flags change; their links are still checked.

Commands are read from fenced code blocks: `\\` continuations are joined, `#` comments dropped,
leading `VAR=value` assignments and a path before `adaptive-spec` (`.venv/bin/`, `.venv-vllm/bin/`)
skipped; `|`, `&&` and `;` end a command. `bash scripts/X.sh` lines have their script checked.

Paths: a token or inline-code span whose first part is a top-level folder of the repository
(profiles/, traces/, scripts/, ...) or a subpackage of adaptive_spec/ (control/, integrations/, ...)
must exist (a glob must match something). Not checked, by rule: the values of options that name an
output (OUTPUT_OPTIONS: the command writes them), paths under results/ (written by `bench --save`
at run time), paths an earlier command on the same page writes (a profile made, then used), and
the short list in NOT_YET_PRESENT, each with its reason.

Defaults: docs/cli.md is generated from the parser (scripts/cli_reference.py) and must equal what
the parser gives now. In prose, a backticked `--flag` followed in the same clause by "default X" or
"(default: X)", X a number or in backticks, must state a default the flag has in some command.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import io
import re
import shlex
from pathlib import Path

import pytest

from adaptive_spec.cli import EXAMPLES, build_parser

ROOT = Path(__file__).resolve().parents[1]
HISTORY = ROOT / "docs" / "history"
OUTPUT_OPTIONS = {"--out", "--output-json", "--save-acceptance", "--save", "--save-learned"}
RUNTIME_PREFIXES = ("results/",)  # written by runs (`bench --save`), not committed
NOT_YET_PRESENT: dict[str, str] = {}  # path -> why a doc may name it before it exists
TOP_LEVEL = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")} - {"__pycache__"}
SUBPACKAGES = {p.name for p in (ROOT / "adaptive_spec").iterdir() if p.is_dir() and not p.name.startswith("__")}


def doc_files(history: bool = True) -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [f for f in files if history or HISTORY not in f.parents]


# ----------------------------------------------------------------------------- extraction

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def code_blocks(text: str) -> list[str]:
    return FENCE.findall(text)


def commands_in(block: str) -> list[list[str]]:
    """Each shell command of a code block as its words, continuations joined."""
    joined = re.sub(r"\\\n\s*", " ", block)
    commands = []
    for line in joined.splitlines():
        try:
            lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            words = list(lexer)
        except ValueError:  # not shell (JSON, Python, a server's output): nothing to check
            continue
        current: list[str] = []
        for word in words + [";"]:
            if word and set(word) <= set("|&;"):
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(word)
    return commands


def adaptive_spec_argv(words: list[str]) -> list[str] | None:
    """The arguments after `adaptive-spec` (any directory prefix), env assignments skipped; None when
    the command is another program."""
    while words and ASSIGNMENT.match(words[0]):
        words = words[1:]
    if words and Path(words[0]).name == "adaptive-spec":
        return words[1:]
    return None


def doc_commands(text: str) -> list[list[str]]:
    return [argv for block in code_blocks(text) for words in commands_in(block)
            if (argv := adaptive_spec_argv(words)) is not None]


# ----------------------------------------------------------------------------- checks

def parse_error(argv: list[str]) -> str | None:
    """argparse's message for `argv`, or None when it parses."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as exit_:
        if exit_.code:
            return stderr.getvalue().strip().splitlines()[-1] if stderr.getvalue().strip() else f"exit {exit_.code}"
    return None


def looks_like_repo_path(text: str) -> bool:
    first = text.split("/", 1)[0]
    return "/" in text and (first in TOP_LEVEL or first in SUBPACKAGES) and " " not in text


def missing_path(text: str) -> bool:
    """Whether a repository path a doc names is absent (globs must match something)."""
    text = text.rstrip(".,:;)").split("::", 1)[0]  # a pytest node id names its file
    if text.startswith(RUNTIME_PREFIXES) or text in NOT_YET_PRESENT:
        return False
    first = text.split("/", 1)[0]
    base = ROOT if first in TOP_LEVEL else ROOT / "adaptive_spec"
    if any(c in text for c in "*?["):
        return not glob.glob(str(base / text))
    return not (base / text).exists()


def _option_values(argv: list[str]):
    for previous, word in zip([""] + argv, argv):
        if word.startswith("--") and "=" in word:
            yield word.split("=", 1)[0], word.split("=", 1)[1]
        else:
            yield previous, word


def command_outputs(argv: list[str]) -> set[str]:
    """What a command writes: the values of its output options."""
    return {value for option, value in _option_values(argv) if option in OUTPUT_OPTIONS}


def command_path_errors(argv: list[str], produced: set[str] = frozenset()) -> list[str]:
    """Repository paths the command reads that do not exist. `produced`: paths written by the
    commands shown before it on the same page (a profile made, then used)."""
    errors = []
    for option, value in _option_values(argv):
        if option in OUTPUT_OPTIONS or value in produced:
            continue
        if looks_like_repo_path(value) and missing_path(value):
            errors.append(value)
    return errors


INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def prose_path_errors(text: str, doc: Path) -> list[str]:
    """Repository paths in inline code that do not exist, and relative links that lead nowhere."""
    errors = []
    outside = FENCE.sub("", text)
    for span in INLINE.findall(outside):
        if looks_like_repo_path(span) and missing_path(span):
            errors.append(span)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        relative = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        if not path.exists() and relative not in NOT_YET_PRESENT:
            errors.append(target)
    return errors


STATED_DEFAULT = re.compile(r"`(--[a-z0-9-]+)[^`]*`(?:[^`.;]|`[^`-][^`]*`)*?\(?default:? (`[^`]+`|-?\d[\d.]*)")


def parser_defaults() -> dict[str, set[str]]:
    """Every flag's defaults over all commands, as text."""
    found: dict[str, set[str]] = {}

    def walk(parser):
        for action in parser._actions:
            if hasattr(action, "choices") and isinstance(action.choices, dict):
                for child in action.choices.values():
                    walk(child)
            for flag in action.option_strings:
                found.setdefault(flag, set()).add(str(action.default))
    walk(build_parser())
    return found


def default_errors(text: str) -> list[str]:
    defaults = parser_defaults()
    errors = []
    for flag, stated in STATED_DEFAULT.findall(FENCE.sub("", text)):
        value = stated.strip("`")
        known = defaults.get(flag)
        if known is None:
            errors.append(f"{flag}: no such option")
        elif value not in known and not any(_same_number(value, k) for k in known):
            errors.append(f"{flag}: doc says default {value}, the parser has {sorted(known)}")
    return errors


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def cli_reference():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "scripts" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- tests

CHECKED = doc_files(history=False)


@pytest.mark.parametrize("doc", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_shown_parses_and_names_existing_paths(doc):
    text = doc.read_text()
    errors = []
    produced: set[str] = set()
    for argv in doc_commands(text):
        if (error := parse_error(argv)) is not None:
            errors.append(f"adaptive-spec {shlex.join(argv)}: {error}")
        errors += [f"adaptive-spec {shlex.join(argv)}: no such path {p}" for p in command_path_errors(argv, produced)]
        produced |= command_outputs(argv)
    for block in code_blocks(text):
        for words in commands_in(block):
            if words[:1] == ["bash"] and len(words) > 1 and not (ROOT / words[1]).exists():
                errors.append(f"bash {words[1]}: no such script")
    assert not errors, "\n".join(errors)


def test_the_docs_show_commands_at_all():
    """A guard on the extraction itself: the README alone shows every command."""
    shown = {argv[0] for doc in CHECKED for argv in doc_commands(doc.read_text()) if argv}
    assert shown >= {"generate", "bench", "profile", "simulate", "serve", "models", "trace", "policy-cost"}


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_and_links_in_prose_exist(doc):
    assert not prose_path_errors(doc.read_text(), doc)


@pytest.mark.parametrize("doc", [d for d in CHECKED if d.name != "cli.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_stated_defaults_equal_the_parsers(doc):  # docs/cli.md is generated: its defaults are the parser's
    assert not default_errors(doc.read_text())


def test_the_cli_reference_is_generated_from_the_current_parser():
    assert (ROOT / "docs" / "cli.md").read_text() == cli_reference().render(), \
        "docs/cli.md is out of date: run python scripts/cli_reference.py"


@pytest.mark.parametrize("command", sorted(EXAMPLES))
def test_each_command_help_carries_examples_that_parse(command):
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(getattr(a, "choices", None), dict))
    help_text = sub.choices[command].format_help()
    assert "examples:" in help_text
    for example in EXAMPLES[command]:
        assert example in help_text
        argv = shlex.split(example)[1:]
        assert argv[0] == command and parse_error(argv) is None, example
        assert not command_path_errors(argv), example
    assert set(EXAMPLES) == set(sub.choices), "every command has examples"


# ----------------------------------------------------------------------------- negative controls

BAD_DOC = """
Run it:

```bash
VLLM_X=1 .venv-vllm/bin/adaptive-spec bench --engine vllm \\
    --no-such-flag --profile profiles/cpu-2core-qwen-coder-fp32-int8draft.json
adaptive-spec simulate --trace traces/no-such-trace.csv --profile profiles/cpu-2core-vllm-qwen-coder-fp32.json --save-acceptance profiles/new.json
adaptive-spec generate --pair qwen-coder | head -3  # a comment with adaptive-spec --bogus
```

The profile `profiles/gone.json` and [a page](no-such-page.md). `--max-k` caps k (default 99).
"""


def test_the_checks_catch_a_wrong_doc():
    commands = doc_commands(BAD_DOC)
    assert [argv[0] for argv in commands] == ["bench", "simulate", "generate"]  # env, prefix, \\, | and # handled
    assert "--no-such-flag" in parse_error(commands[0])
    assert parse_error(commands[1]) is None and parse_error(commands[2]) is None
    assert command_path_errors(commands[1]) == ["traces/no-such-trace.csv"]  # an --out target is not checked
    assert command_outputs(commands[1]) == {"profiles/new.json"}
    assert command_path_errors(["simulate", "--profile", "profiles/new.json"]) == ["profiles/new.json"]
    assert command_path_errors(["simulate", "--profile", "profiles/new.json"], {"profiles/new.json"}) == []
    assert command_path_errors(commands[0]) == []
    assert prose_path_errors(BAD_DOC, ROOT / "docs" / "x.md") == ["profiles/gone.json", "no-such-page.md"]
    assert default_errors(BAD_DOC) == ["--max-k: doc says default 99, the parser has ['0', '16', '6']"]
    assert default_errors("`--max-k` caps every k (vLLM's `num_speculative_tokens`, default 6)") == []


def test_a_stale_cli_reference_is_caught(tmp_path, monkeypatch):
    module = cli_reference()
    stale = tmp_path / "cli.md"
    stale.write_text(module.render().replace("`goodput`", "`static:3`", 1))
    monkeypatch.setattr(module, "OUT", stale)
    monkeypatch.setattr(module, "ROOT", tmp_path)
    assert module.main(["--check"]) == 1
    stale.write_text(module.render())
    assert module.main(["--check"]) == 0


def test_the_readme_stays_a_short_guide():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
