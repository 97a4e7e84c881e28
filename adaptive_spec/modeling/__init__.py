"""Layer 3: model I/O. Drafters, the ragged KV cache over Hugging Face models."""

from .drafters import Draft, Drafter, DrafterBase, DraftSampler, ModelDrafter, NgramDrafter, logits_width
from .kv import RaggedKV

__all__ = ["Draft", "Drafter", "DrafterBase", "DraftSampler", "ModelDrafter", "NgramDrafter", "logits_width", "RaggedKV"]
