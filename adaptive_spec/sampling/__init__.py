"""Layer 1: pure sampling math. No models, no requests, randomness passed in."""

from .params import Constraint, PrefixConstraint, SamplingParams
from .rejection import Verdict, sample_inverse_cdf, verify
from .transforms import RowSettings, one_hot_argmax, process_logits

__all__ = [
    "Constraint", "PrefixConstraint", "SamplingParams", "Verdict", "sample_inverse_cdf", "verify",
    "RowSettings", "one_hot_argmax", "process_logits",
]
