"""Structured output: JSON schemas, any JSON, regular expressions, choice lists and Lark grammars as
`Constraint`s, backed by llguidance (the grammar engine vLLM and SGLang also ship).

    grammar = Grammar.json_schema({"type": "object", "properties": {"name": {"type": "string"}}})
    params = SamplingParams(temperature=0.7, constraint=grammar.constraint(tokenizer, vocab_size))

Why llguidance: it has no dependencies of its own (xgrammar pulls triton and a TVM runtime), builds its
token trie from a Hugging Face fast tokenizer directly, rolls back any number of tokens, and writes
a packed bitmask (one bit per token).

How speculation stays exact: the engine threads immutable *states* through a constraint and asks for
the mask at every drafted position, for the draft and the target alike (`engine/processing.py`). A
state here is a node of a token tree: its parent, its token, its depth. Each request's tree (each
`initial_state()` call) owns one llguidance matcher, which is moved to whichever node is asked for
by rolling back to the common ancestor and consuming the tokens down to it. So a mask depends only on
the tokens of the node's path, never on the order in which drafts were explored or rejected; the
committed state advances only on emitted tokens, and a rejected branch is simply never asked for
again. Masks are cached per node (a small LRU per request), so a draft position that is accepted and
becomes committed is not computed twice.

Width: a model's logits are often wider than its tokenizer (padding rows in the embedding); those ids
are always masked out.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

MASK_CACHE = 64  # masks kept per request: a step's draft positions and the committed one


class GrammarError(ValueError):
    """A grammar that does not compile, or a grammar engine that is missing."""


@dataclass(frozen=True)
class Grammar:
    """What the output must match; tokenizer-free, so it can be built before any model loads.
    `kind` is one of json_schema, regex, choice, lark; `source` the text llguidance compiles."""

    kind: str
    source: str

    @classmethod
    def json_schema(cls, schema: dict | str) -> "Grammar":
        text = schema if isinstance(schema, str) else json.dumps(schema)  # key order kept: it orders the output
        try:
            json.loads(text)
        except json.JSONDecodeError as error:
            raise GrammarError(f"the JSON schema is not valid JSON: {error}") from None
        return cls("json_schema", text)

    @classmethod
    def json(cls) -> "Grammar":
        """Any JSON value."""
        return cls("json_schema", "{}")

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> "Grammar":
        options = list(options)
        if not options or not all(isinstance(o, str) and o for o in options):
            raise GrammarError(f"a choice needs one or more non-empty strings, got {options!r}")
        return cls("choice", json.dumps(options))

    @classmethod
    def lark(cls, text: str) -> "Grammar":
        """A grammar in llguidance's Lark syntax (GBNF is converted too)."""
        return cls("lark", text)

    def checked(self) -> "Grammar":
        """This grammar, once the grammar engine has parsed it without a tokenizer: a malformed
        schema, regex or grammar raises GrammarError here, before any model loads."""
        llguidance = _llguidance()
        problem = llguidance.LLMatcher.validate_grammar(_grammar_text(llguidance, self))
        if problem:
            raise GrammarError(f"the {self.kind} grammar does not compile: {problem}")
        return self

    def constraint(self, tokenizer, vocab_size: int | None = None) -> "GrammarConstraint":
        """This grammar for `tokenizer` (a Hugging Face fast tokenizer) and logits `vocab_size` wide
        (default: the tokenizer's size). Compiled grammars are cached per (grammar, tokenizer)."""
        return GrammarConstraint(_compiled(self, tokenizer), vocab_size or len(tokenizer), len(tokenizer))


class _Node:
    """One state: the path root -> this node is the tokens generated so far (plus drafts)."""

    __slots__ = ("parent", "token", "depth", "cursor", "finished", "__weakref__")

    def __init__(self, parent: "_Node | None", token: int | None, cursor: "_Cursor", finished: bool = False):
        self.parent, self.token, self.cursor, self.finished = parent, token, cursor, finished
        self.depth = 0 if parent is None else parent.depth + 1


class _Cursor:
    """A request's matcher, where it stands in the tree, and the masks it has computed."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.at: _Node | None = None  # set to the root once the root exists
        self.masks: OrderedDict[_Node, torch.Tensor] = OrderedDict()
        self.lock = threading.Lock()  # requests of one engine run in one thread; a server may not

    def goto(self, node: _Node) -> None:
        """Move the matcher to `node`: roll back to the common ancestor, consume down to `node`."""
        here, there, back, down = self.at, node, 0, []
        while here.depth > there.depth:
            here, back = here.parent, back + 1
        while there.depth > here.depth:
            down.append(there.token)
            there = there.parent
        while here is not there:
            here, back = here.parent, back + 1
            down.append(there.token)
            there = there.parent
        if back and not self.matcher.rollback(back):
            raise GrammarError(f"the grammar engine could not roll back {back} tokens: {self.matcher.get_error()}")
        if down and not self.matcher.consume_tokens(down[::-1]):
            raise GrammarError(f"the grammar rejects this output: {self.matcher.get_error()}")
        self.at = node


class GrammarConstraint:
    """The `Constraint` protocol over a compiled grammar: `allowed_tokens` returns a boolean mask."""

    def __init__(self, compiled: "_Compiled", vocab_size: int, tokenizer_size: int):
        if vocab_size < tokenizer_size:
            raise GrammarError(f"logits of width {vocab_size} cannot hold the tokenizer's {tokenizer_size} tokens")
        self.compiled, self.vocab_size, self.tokenizer_size = compiled, vocab_size, tokenizer_size

    def initial_state(self) -> _Node:
        cursor = _Cursor(self.compiled.matcher.deep_copy())
        root = _Node(None, None, cursor)
        cursor.at = root
        return root

    def advance(self, state: _Node, token_id: int) -> _Node:
        if not bool(self.allowed_tokens(state)[token_id]):
            raise GrammarError(f"token {token_id} is not allowed by the grammar here")
        return _Node(state, int(token_id), state.cursor, finished=token_id in self.compiled.end_tokens)

    def allowed_tokens(self, state: _Node) -> torch.Tensor:
        """The mask after the node's path. Past the end-of-sequence token that closed the grammar nothing
        is allowed (a drafted position there is never emitted: the request stops at that token)."""
        if state.finished:
            return torch.zeros(self.vocab_size, dtype=torch.bool)
        cursor = state.cursor
        with cursor.lock:
            mask = cursor.masks.get(state)
            if mask is not None:
                cursor.masks.move_to_end(state)
                return mask
            cursor.goto(state)
            mask = self._mask(cursor.matcher)
            cursor.masks[state] = mask
            if len(cursor.masks) > MASK_CACHE:
                cursor.masks.popitem(last=False)
            return mask

    def is_accepting(self, state: _Node) -> bool:
        """Whether the output so far is a complete match (ending here would satisfy the grammar)."""
        with state.cursor.lock:
            state.cursor.goto(state)
            return bool(state.cursor.matcher.is_accepting())

    def _mask(self, matcher) -> torch.Tensor:
        if matcher.is_error():
            raise GrammarError(f"the grammar engine failed: {matcher.get_error()}")
        packed = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(packed, bitorder="little")[: self.tokenizer_size]
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[: len(bits)] = torch.from_numpy(bits.astype(bool))
        return mask


@dataclass(frozen=True)
class _Compiled:
    grammar: Grammar
    matcher: Any  # a fresh llguidance matcher: each request deep-copies it
    end_tokens: frozenset[int]  # the tokenizer's end of sequence, which the grammar allows once it is complete


# tokenizer -> (its llguidance twin, {grammar: compiled}); weak, so a freed tokenizer frees its grammars
_COMPILED: "weakref.WeakKeyDictionary[Any, tuple[Any, dict[Grammar, _Compiled]]]" = weakref.WeakKeyDictionary()


def _compiled(grammar: Grammar, tokenizer) -> _Compiled:
    llguidance = _llguidance()
    if tokenizer not in _COMPILED:
        import llguidance.hf

        try:
            _COMPILED[tokenizer] = (llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer)), {})
        except ValueError as error:
            raise GrammarError(f"grammars need a fast Hugging Face tokenizer: {error}") from None
    twin, grammars = _COMPILED[tokenizer]
    if grammar not in grammars:
        matcher = llguidance.LLMatcher(twin, _grammar_text(llguidance, grammar), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {grammar.kind} grammar does not compile: {matcher.get_error()}")
        end = tokenizer.eos_token_id
        grammars[grammar] = _Compiled(grammar, matcher, frozenset(() if end is None else (end,)))
    return grammars[grammar]


# JSON without free whitespace between tokens: a small model given the choice pads with spaces and
# newlines until its token budget ends (vLLM's default for this engine too).
JSON_OPTIONS = {"whitespace_flexible": False}


def _grammar_text(llguidance, grammar: Grammar) -> str:
    try:
        if grammar.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(grammar.source, defaults=JSON_OPTIONS)
        return llguidance.grammar_from(grammar.kind, grammar.source)
    except ValueError as error:
        raise GrammarError(f"the {grammar.kind} grammar does not compile: {error}") from None


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GrammarError("structured output needs llguidance (pip install 'llguidance>=1.7,<1.8')") from None
    return llguidance
