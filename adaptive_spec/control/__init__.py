"""Layer 2: estimation and control. Plain Python, no torch."""

from .policy import AcceptanceHistory, Policy, RequestOutcome, RequestView, StaticPolicy, StepRecord, parse_policy

__all__ = ["AcceptanceHistory", "Policy", "RequestOutcome", "RequestView", "StaticPolicy", "StepRecord", "parse_policy"]
