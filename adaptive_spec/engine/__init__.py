"""Layer 4: the engine step and the serving-loop API."""

from .engine import SpecEngine
from .request import GenerationResult, RequestStats, StepOutput

__all__ = ["SpecEngine", "GenerationResult", "RequestStats", "StepOutput"]
