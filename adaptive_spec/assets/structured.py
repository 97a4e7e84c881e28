"""The structured-output workload: real texts, each with a request to describe it as JSON that
matches a schema.

Code prompts are HumanEval problems (a signature and docstring); chat prompts are ShareGPT opening
turns. Each is asked to be described, not answered, as JSON under one of eight schemas (four for
code, four for chat) that between them hold nested objects, arrays, enums, numbers, booleans and
string patterns. The schema travels twice: in the prompt, so the model knows the keys, and as the
prompt's `json_schema`, so the engine holds the answer to it. Strings are bounded (`maxLength`,
`maxItems`) so an answer can finish inside a small token budget.

    load_structured(16)  # code, chat, code, ... : HumanEval 0..7 and 8 ShareGPT prompts
"""

from __future__ import annotations

import json
from dataclasses import replace

from .prompts import Prompt, load_humaneval, load_sharegpt

_NAME = {"type": "string", "pattern": "^[a-z_][a-z0-9_]*$", "maxLength": 40}
_SHORT = {"type": "string", "maxLength": 60}

CODE_SCHEMAS: dict[str, dict] = {
    "signature": {
        "type": "object",
        "properties": {
            "function": _NAME,
            "parameters": {"type": "array", "maxItems": 4, "items": {
                "type": "object", "properties": {"name": _NAME, "type": {"type": "string", "maxLength": 30}},
                "required": ["name", "type"], "additionalProperties": False}},
            "returns": {"type": "string", "maxLength": 30},
        },
        "required": ["function", "parameters", "returns"], "additionalProperties": False,
    },
    "examples": {
        "type": "object",
        "properties": {
            "function": _NAME,
            "examples": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
                "type": "object", "properties": {"call": _SHORT, "result": {"type": "string", "maxLength": 30}},
                "required": ["call", "result"], "additionalProperties": False}},
        },
        "required": ["function", "examples"], "additionalProperties": False,
    },
    "difficulty": {
        "type": "object",
        "properties": {
            "difficulty": {"enum": ["easy", "medium", "hard"]},
            "topics": {"type": "array", "minItems": 1, "maxItems": 3,
                       "items": {"enum": ["strings", "lists", "math", "sorting", "parsing", "search", "other"]}},
            "lines_of_code": {"type": "integer", "minimum": 1, "maximum": 60},
        },
        "required": ["difficulty", "topics", "lines_of_code"], "additionalProperties": False,
    },
    "review": {
        "type": "object",
        "properties": {
            "function": _NAME,
            "input": {"type": "object", "properties": {
                "kind": {"enum": ["number", "string", "list", "mixed"]},
                "may_be_empty": {"type": "boolean"}}, "required": ["kind", "may_be_empty"],
                "additionalProperties": False},
            "edge_cases": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 40}},
        },
        "required": ["function", "input", "edge_cases"], "additionalProperties": False,
    },
}

CHAT_SCHEMAS: dict[str, dict] = {
    "intent": {
        "type": "object",
        "properties": {
            "intent": {"enum": ["question", "task", "creative", "code", "advice", "other"]},
            "language": {"type": "string", "pattern": "^[a-z]{2}$"},
            "needs_code": {"type": "boolean"},
        },
        "required": ["intent", "language", "needs_code"], "additionalProperties": False,
    },
    "summary": {
        "type": "object",
        "properties": {
            "title": _SHORT,
            "keywords": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "string", "maxLength": 20}},
        },
        "required": ["title", "keywords"], "additionalProperties": False,
    },
    "triage": {
        "type": "object",
        "properties": {
            "request": {"type": "object", "properties": {
                "topic": {"type": "string", "maxLength": 40},
                "domain": {"enum": ["software", "business", "science", "writing", "education", "personal", "other"]}},
                "required": ["topic", "domain"], "additionalProperties": False},
            "effort": {"type": "object", "properties": {
                "minutes": {"type": "integer", "minimum": 1, "maximum": 600},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
                "required": ["minutes", "confidence"], "additionalProperties": False},
        },
        "required": ["request", "effort"], "additionalProperties": False,
    },
    "entities": {
        "type": "object",
        "properties": {
            "entities": {"type": "array", "maxItems": 3, "items": {
                "type": "object", "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "kind": {"enum": ["person", "place", "organization", "product", "technology", "other"]}},
                "required": ["name", "kind"], "additionalProperties": False}},
            "tone": {"enum": ["positive", "neutral", "negative"]},
        },
        "required": ["entities", "tone"], "additionalProperties": False,
    },
}

SCHEMAS = {**{f"code-{k}": v for k, v in CODE_SCHEMAS.items()}, **{f"chat-{k}": v for k, v in CHAT_SCHEMAS.items()}}

_CODE_ASK = "Do not write the code. Describe this function as JSON matching this schema, and answer with the JSON only:"
_CHAT_ASK = "Do not answer this request. Describe it as JSON matching this schema, and answer with the JSON only:"
_CHAT_CHARS = 1200  # ShareGPT openings up to this long, so prefill stays a small share on a CPU


def load_structured(count: int, *, humaneval_from: int = 0, seed: int = 0) -> list[Prompt]:
    """`count` prompts, code and chat alternating (code first), schemas in rotation within each.
    Ids are `<source id>/<schema>`; sources `json-code` and `json-chat`."""
    if count < 0:
        raise ValueError(f"the structured workload needs a count >= 0, got {count}")
    code_count, chat_count = (count + 1) // 2, count // 2
    code = load_humaneval(limit=humaneval_from + code_count)[humaneval_from:]
    chat = load_sharegpt(chat_count, seed=seed, max_prompt_chars=_CHAT_CHARS) if chat_count else []
    code = [_ask(p, "code", name, _CODE_ASK) for p, name in zip(code, _cycle(CODE_SCHEMAS, len(code)))]
    chat = [_ask(p, "chat", name, _CHAT_ASK) for p, name in zip(chat, _cycle(CHAT_SCHEMAS, len(chat)))]
    return [prompt for pair in zip(code, chat) for prompt in pair] + code[len(chat):]


def _cycle(schemas: dict, count: int) -> list[str]:
    names = list(schemas)
    return [names[i % len(names)] for i in range(count)]


def _ask(prompt: Prompt, kind: str, schema_name: str, ask: str) -> Prompt:
    schema = SCHEMAS[f"{kind}-{schema_name}"]
    text = f"{prompt.text.rstrip()}\n\n{ask}\n{json.dumps(schema, separators=(',', ':'))}"
    return replace(prompt, id=f"{prompt.id}/{schema_name}", text=text, source=f"json-{kind}", json_schema=schema)
