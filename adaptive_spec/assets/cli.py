"""The ``models`` command group: list the registered models and fetch them into the cache.

The main command line registers it with ``add_models_commands(subparsers)`` and calls
``run_models(args)`` when ``args.command == "models"``.  Every command's last stdout line is
one JSON document; progress and errors go to stderr.  ``python -m adaptive_spec.assets.cli``
runs the group on its own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .fetch import FetchError, default_cache_dir, fetch_model, is_fetched, model_cache_path
from .registry import MODELS, PAIRS, UnknownModelError, get_model_spec, get_pair

__all__ = ["add_models_commands", "run_models", "main"]


def add_models_commands(subparsers) -> argparse.ArgumentParser:
    """Register ``models list`` and ``models fetch NAME`` on an argparse subparsers object."""
    models = subparsers.add_parser(
        "models", help="list or fetch the registered pretrained models",
        description="List or fetch the pretrained models this project knows.",
    )  # fmt: skip
    sub = models.add_subparsers(dest="models_command", metavar="{list,fetch}")
    sub.required = True
    lst = sub.add_parser("list", help="show each model, its role, size and whether it is cached")
    lst.add_argument("--cache-dir", default=None,
                     help="cache directory (default: $ADAPTIVE_SPEC_CACHE or ~/.cache/adaptive-spec)")
    fetch = sub.add_parser("fetch", help="download, verify and convert a model (or a pair)")
    fetch.add_argument("name", help="a model name or a pair name (fetches target and draft)")
    fetch.add_argument("--cache-dir", default=None, help="cache directory")
    fetch.add_argument("--quiet", action="store_true", help="no progress output")
    return models


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _list(args) -> int:
    cache = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()
    rows = []
    for spec in MODELS.values():
        cached = is_fetched(spec.name, cache)
        path = model_cache_path(spec.name, cache)
        rows.append({
            "name": spec.name, "role": spec.role, "description": spec.description,
            "gguf_bytes": spec.size, "wheels": spec.num_parts, "cached": cached,
            "path": str(path) if cached else None,
            "cached_bytes": _dir_bytes(path) if cached else 0,
        })  # fmt: skip
        print(f"{spec.name:<30} {spec.role:<7} {spec.size / 1e6:8.1f} MB GGUF  "
              f"{'cached' if cached else 'not cached'}")  # fmt: skip
    pairs = [{"name": p.name, "target": p.target, "draft": p.draft} for p in PAIRS.values()]
    for p in pairs:
        print(f"pair {p['name']}: target {p['target']}, draft {p['draft']}")
    print(json.dumps({"cache_dir": str(cache), "models": rows, "pairs": pairs}))
    return 0


def _fetch(args) -> int:
    try:
        if args.name in PAIRS:
            pair = get_pair(args.name)
            names = [pair.target, pair.draft]
        else:
            names = [get_model_spec(args.name).name]
    except UnknownModelError as e:
        print(f"error: {e}; known pairs: {', '.join(PAIRS)}", file=sys.stderr)
        return 2
    fetched = []
    for name in names:
        t0 = time.perf_counter()
        try:
            path = fetch_model(name, cache_dir=args.cache_dir, progress=not args.quiet)
        except FetchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        fetched.append({"name": name, "path": str(path),
                        "seconds": round(time.perf_counter() - t0, 2)})  # fmt: skip
        print(f"{name}: {path}")
    print(json.dumps({"fetched": fetched}))
    return 0


def run_models(args) -> int:
    """Run the ``models`` subcommand chosen in ``args``; returns the process exit status."""
    if args.models_command == "list":
        return _list(args)
    if args.models_command == "fetch":
        return _fetch(args)
    raise ValueError(f"unknown models command {args.models_command!r}")


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: ``python -m adaptive_spec.assets.cli models list``."""
    parser = argparse.ArgumentParser(prog="adaptive-spec")
    sub = parser.add_subparsers(dest="command")
    sub.required = True
    add_models_commands(sub)
    args = parser.parse_args(argv)
    return run_models(args)


if __name__ == "__main__":
    sys.exit(main())
