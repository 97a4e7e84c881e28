"""Layer 2: estimation and control. Plain Python and numpy, no torch."""

from .acceptance import AcceptanceEstimator, AcceptancePrior, expected_emitted
from .baselines import BatchTablePolicy, ConfidencePolicy, EmaTiersPolicy, HFHeuristicPolicy
from .cost_model import CostModel
from .goodput import GoodputConfig, GoodputPolicy
from .policy import (AcceptanceHistory, Policy, PolicyBase, PolicyError, RequestOutcome, RequestView, StaticPolicy,
                     StepRecord, choose_ks, draft_confidence_floor, mean_acceptance_length)
from .registry import known_policies, load_preset, make_policy

__all__ = [
    "AcceptanceEstimator", "AcceptanceHistory", "AcceptancePrior", "BatchTablePolicy", "ConfidencePolicy",
    "CostModel", "EmaTiersPolicy", "GoodputConfig", "GoodputPolicy", "HFHeuristicPolicy", "Policy",
    "RequestOutcome", "RequestView", "StaticPolicy", "StepRecord", "expected_emitted", "known_policies",
    "load_preset", "make_policy", "PolicyBase", "PolicyError", "choose_ks", "draft_confidence_floor",
    "mean_acceptance_length",
]
