"""Layer 2: estimation and control. Plain Python and numpy, no torch."""

from .acceptance import AcceptanceEstimator, AcceptancePrior, expected_emitted
from .calibration import ConfidenceCalibration
from .baselines import BatchTablePolicy, ConfidencePolicy, EmaTiersPolicy, HFHeuristicPolicy
from .cost_model import CostModel
from .goodput import GoodputConfig, GoodputPolicy
from .policy import (KEEP_LAST, AcceptanceHistory, Policy, PolicyBase, PolicyError, RequestOutcome, RequestView, StaticPolicy,
                     StepRecord, adopt_stop_rule, ask_stop_rule, choose_ks, draft_stop_rule, mean_acceptance_length,
                     run_stop_rule)
from .registry import known_policies, load_preset, make_policy, with_tpot_target
from .step_cost import StepCost, StepCostBase

__all__ = [
    "KEEP_LAST",
    "AcceptanceEstimator", "AcceptanceHistory", "AcceptancePrior", "BatchTablePolicy", "ConfidencePolicy",
    "ConfidenceCalibration", "CostModel", "EmaTiersPolicy", "GoodputConfig", "GoodputPolicy", "HFHeuristicPolicy", "Policy",
    "RequestOutcome", "RequestView", "StaticPolicy", "StepRecord", "expected_emitted", "known_policies",
    "load_preset", "make_policy", "with_tpot_target", "PolicyBase", "PolicyError", "choose_ks", "draft_stop_rule", "ask_stop_rule", "adopt_stop_rule", "run_stop_rule",
    "mean_acceptance_length", "StepCost", "StepCostBase",
]
