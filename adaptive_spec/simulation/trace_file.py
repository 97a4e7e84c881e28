"""Acceptance trace files: one CSV table per trace, self-describing through a JSON header line.

Layout (schema version 1)::

    # adaptive-spec-trace {"format": "adaptive-spec-trace", "schema_version": 1, ...metadata...}
    request,prompt_id,prompt_length,position,token,accept_prob,draft_confidence
    0,HumanEval/0,142,0,750,1.0,0.93
    ...

One row per generated position of every request (position 0 is the token prefill emitted):

``request``           request index within the trace (0, 1, ...)
``prompt_id``         the prompt's id from its source (HumanEval task id, ShareGPT id, JSONL id)
``prompt_length``     prompt tokens (the request's context before it generates)
``position``          index of the generated token, 0 .. n-1 (contiguous per request)
``token``             the emitted token id
``accept_prob``       min(target(x), draft(x)) / target(x) for the processed target and draft distributions
                      at this position: the probability that x was emitted as an accepted draft
                      (greedy: 1.0 when the draft's processed argmax is x, else 0.0)
``draft_confidence``  the draft model's top probability (softmax of its raw logits) here; the
                      quantity `confidence:P` stops drafting on

Metadata (the header line's JSON): ``format``, ``schema_version``, ``created_utc``, ``target``,
``draft``, ``drafter`` ("model" or "ngram"), ``dtype``, ``sampling`` (temperature, top_k, top_p,
min_p, repetition_penalty, max_new_tokens, seed), ``workload``, ``prompt_ids``, and free notes.

pandas reads the table directly: ``pandas.read_csv(path, skiprows=1)``. `load_trace` also checks
everything and raises `TraceError` naming the file and the problem.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

FORMAT = "adaptive-spec-trace"
SCHEMA_VERSION = 1
HEADER_PREFIX = f"# {FORMAT} "
COLUMNS = ("request", "prompt_id", "prompt_length", "position", "token", "accept_prob", "draft_confidence")
REQUIRED_META = ("format", "schema_version", "target", "draft", "sampling")

__all__ = ["FORMAT", "SCHEMA_VERSION", "COLUMNS", "TraceError", "Trace", "RequestTrace", "load_trace",
           "load_traces", "save_trace", "make_trace"]


class TraceError(ValueError):
    """A trace file is missing, unreadable or malformed; the message names the file."""


@dataclass(frozen=True)
class RequestTrace:
    """One request of a trace, as arrays over its generated positions."""

    prompt_id: str
    prompt_length: int
    accept_prob: np.ndarray  # float64 [n]
    draft_confidence: np.ndarray  # float64 [n]
    tokens: np.ndarray  # int64 [n]
    label: str = ""  # where it came from (trace name), for reports

    @property
    def length(self) -> int:
        return len(self.accept_prob)


@dataclass
class Trace:
    meta: dict
    frame: pd.DataFrame
    source: str = "<trace>"

    def requests(self) -> list[RequestTrace]:
        out = []
        label = str(self.meta.get("name") or Path(self.source).stem)
        for _, group in self.frame.groupby("request", sort=True):
            group = group.sort_values("position")
            out.append(RequestTrace(str(group["prompt_id"].iloc[0]), int(group["prompt_length"].iloc[0]),
                                    group["accept_prob"].to_numpy(np.float64),
                                    group["draft_confidence"].to_numpy(np.float64),
                                    group["token"].to_numpy(np.int64), label))
        return out

    def summary(self) -> dict:
        """Acceptance statistics over positions 1.. (position 0 comes from prefill)."""
        f = self.frame[self.frame["position"] > 0]
        return {"requests": int(self.frame["request"].nunique()), "positions": int(len(self.frame)),
                "mean_accept_prob": float(f["accept_prob"].mean()) if len(f) else None,
                "mean_draft_confidence": float(f["draft_confidence"].mean()) if len(f) else None}


def make_trace(requests: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]) -> Trace:
    """A Trace from per-request dicts (prompt_id, prompt_length, tokens, accept_prob,
    draft_confidence) and metadata; fills format, schema_version, created_utc and prompt_ids."""
    rows = []
    for index, r in enumerate(requests):
        n = len(r["accept_prob"])
        tokens = r.get("tokens")
        tokens = list(tokens) if tokens is not None else [0] * n
        conf = r.get("draft_confidence")
        conf = list(conf) if conf is not None else [1.0] * n
        if not (len(tokens) == len(conf) == n):
            raise TraceError(f"request {index}: tokens, accept_prob and draft_confidence differ in length")
        pid = str(r.get("prompt_id", f"request-{index}")).replace("\n", " ")
        for position in range(n):
            rows.append((index, pid, int(r.get("prompt_length", 0)), position, int(tokens[position]),
                         float(r["accept_prob"][position]), float(conf[position])))
    frame = pd.DataFrame(rows, columns=list(COLUMNS))
    full = {"format": FORMAT, "schema_version": SCHEMA_VERSION,
            "created_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "target": "synthetic", "draft": "synthetic", "drafter": "model", "sampling": {}}
    full.update(dict(meta))
    full.setdefault("prompt_ids", list(dict.fromkeys(frame["prompt_id"].tolist())))
    trace = Trace(full, frame)
    _validate(trace, "<new trace>")
    return trace


def save_trace(trace: Trace, path: str | os.PathLike) -> Path:
    path = Path(path)
    _validate(trace, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = json.dumps(trace.meta, sort_keys=True, separators=(",", ":"))
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write(HEADER_PREFIX + meta + "\n")
        trace.frame.to_csv(f, index=False, float_format="%.6g", lineterminator="\n")
    os.replace(tmp, path)
    return path


def load_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a trace file; every problem raises `TraceError` naming the file."""
    path = Path(path)
    name = str(path)
    if not path.is_file():
        raise TraceError(f"trace file {name!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            header = f.readline()
    except (OSError, UnicodeDecodeError) as error:
        raise TraceError(f"trace file {name!r} cannot be read: {error}") from None
    if not header.startswith(HEADER_PREFIX):
        raise TraceError(f"trace file {name!r} is not an {FORMAT} file: its first line must start with "
                         f"{HEADER_PREFIX.strip()!r} followed by the JSON metadata")
    try:
        meta = json.loads(header[len(HEADER_PREFIX):])
    except json.JSONDecodeError as error:
        raise TraceError(f"trace file {name!r}: the metadata header is not valid JSON: {error}") from None
    try:
        frame = pd.read_csv(path, skiprows=1, dtype={"prompt_id": str})
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError) as error:
        raise TraceError(f"trace file {name!r}: the table cannot be parsed: {error}") from None
    trace = Trace(meta, frame, name)
    _validate(trace, name)
    return trace


def load_traces(paths: Sequence[str | os.PathLike]) -> list[RequestTrace]:
    """The requests of several trace files, in file order."""
    out: list[RequestTrace] = []
    for path in paths:
        out += load_trace(path).requests()
    return out


def _validate(trace: Trace, name: str) -> None:
    meta, frame = trace.meta, trace.frame

    def fail(message: str) -> None:
        raise TraceError(f"trace file {name!r}: {message}")

    if not isinstance(meta, dict):
        fail("the metadata header must be a JSON object")
    if meta.get("format") != FORMAT:
        fail(f"metadata 'format' must be {FORMAT!r}, got {meta.get('format')!r}")
    if meta.get("schema_version") != SCHEMA_VERSION:
        fail(f"unsupported schema_version {meta.get('schema_version')!r} (this reader knows {SCHEMA_VERSION})")
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        fail(f"metadata lacks {missing}")
    if not isinstance(meta["sampling"], dict):
        fail("metadata 'sampling' must be an object")
    absent = [c for c in COLUMNS if c not in frame.columns]
    if absent:
        fail(f"missing columns {absent}; expected {list(COLUMNS)}")
    if frame.empty:
        fail("the table has no rows")
    for column in ("request", "prompt_length", "position", "token"):
        values = pd.to_numeric(frame[column], errors="coerce")
        if values.isna().any() or (values != values.round()).any():
            fail(f"column {column!r} must hold integers (row {int(values.isna().idxmax()) + 2} or another is not)")
        if (values < 0).any():
            fail(f"column {column!r} holds negative values")
        frame[column] = values.astype(np.int64)
    for column in ("accept_prob", "draft_confidence"):
        values = pd.to_numeric(frame[column], errors="coerce")
        bad = values.isna() | (values < 0) | (values > 1)
        if bad.any():
            fail(f"column {column!r} must hold numbers in [0, 1]; data row {int(bad.idxmax()) + 1} holds "
                 f"{frame[column].iloc[int(bad.idxmax())]!r}")
        frame[column] = values.astype(np.float64)
    for request, group in frame.groupby("request"):
        positions = np.sort(group["position"].to_numpy())
        if not np.array_equal(positions, np.arange(len(positions))):
            fail(f"request {request}: positions must run 0..{len(positions) - 1} without gaps or repeats")
        if group["prompt_length"].nunique() != 1 or group["prompt_id"].nunique() != 1:
            fail(f"request {request}: prompt_id and prompt_length must be the same on all its rows")
