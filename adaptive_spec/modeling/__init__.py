"""Layer 3: model I/O. Drafters, the ragged KV cache over Hugging Face models."""

from .drafters import Draft, Drafter, DraftSampler, ModelDrafter, NgramDrafter, logits_width
from .kv import RaggedKV

__all__ = ["Draft", "Drafter", "DraftSampler", "ModelDrafter", "NgramDrafter", "logits_width", "RaggedKV"]
