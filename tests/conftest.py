"""Shared fixtures: tiny randomly initialised causal LMs (right for unit tests, never for speed claims)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

ARCHITECTURES = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}


def tiny_lm(seed: int, vocab: int = 12, arch: str = "qwen2", sharpness: float = 8.0, max_positions: int = 256):
    """A 2-layer random LM. `sharpness` scales the weights so distributions are far from uniform
    (random init alone gives near-uniform logits, which would make every test trivially pass)."""
    config_cls, model_cls = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    config = config_cls(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                        tie_word_embeddings=False)
    model = model_cls(config).eval()
    # No end-of-sequence token: reference `generate` calls must run the full length, unsuppressed.
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model


@pytest.fixture(scope="session")
def small_pair():
    """(target, draft) with a 12-token vocabulary and different seeds."""
    return tiny_lm(0), tiny_lm(1)


@pytest.fixture(scope="session", params=["qwen2", "llama"])
def greedy_pair(request):
    """(target, draft) with a 64-token vocabulary, one pair per architecture."""
    return tiny_lm(10, vocab=64, arch=request.param), tiny_lm(11, vocab=64, arch=request.param)


CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)


def save_tiny_model(directory, seed: int, words: list[str], arch: str = "llama") -> str:
    """A tiny model plus a word-level tokenizer saved the way `from_pretrained` reads them.

    Llama by default: for a qwen2 config, AutoTokenizer in transformers 5 swaps in the Qwen2
    tokenizer class, which cannot read a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    model = tiny_lm(seed, vocab=len(words), arch=arch)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


WORDS = ["[UNK]", "<s>", "</s>", "user", "assistant"] + [f"w{i}" for i in range(59)]


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """(target_dir, draft_dir, foreign_dir): two models sharing a tokenizer, one with another vocabulary."""
    root = tmp_path_factory.mktemp("models")
    return (save_tiny_model(root / "target", 20, WORDS), save_tiny_model(root / "draft", 21, WORDS),
            save_tiny_model(root / "foreign", 22, WORDS[:5] + [f"v{i}" for i in range(59)]))
