"""adaptive-spec: exact speculative decoding with an adaptive, cost-model-driven choice of k.

Layers (imports point down only): `sampling` (pure math) -> `control` (policies, no torch) ->
`modeling` (drafters, KV caches) -> `engine` (step loop) -> `cli`.
"""

from .control import Policy, RequestView, StaticPolicy, StepRecord
from .engine import GenerationResult, RequestStats, SpecEngine, StepOutput
from .modeling import Drafter, ModelDrafter, NgramDrafter
from .sampling import Constraint, PrefixConstraint, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "Constraint", "Drafter", "GenerationResult", "ModelDrafter", "NgramDrafter", "Policy", "PrefixConstraint", "RequestStats",
    "RequestView", "SamplingParams", "SpecEngine", "StaticPolicy", "StepOutput", "StepRecord",
]
