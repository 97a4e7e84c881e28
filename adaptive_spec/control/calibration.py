"""Calibrated acceptance from the draft's own confidence: P(draft at position j accepted | confidence).

Layer 2: plain Python and math (numpy for the table of predictions), microseconds per call.

Model (one per drafter, shared by its requests; a per-request offset on top):

    P(accept | confidence c, position j, request r) = sigmoid(w * logit(c) + b_j + o_r)

c is the draft model's top probability at that position (softmax of its raw logits), j the draft
position within the step (0-based; positions past the last share its bias), o_r a request's own
offset. The start, w = 1 and b = o = 0, reads the draft's confidence as the acceptance probability,
which is what a draft that agrees with its target would give; data then bends it.

Fit: online Newton steps with a diagonal curvature, one per outcome. Each parameter keeps an
information total (its prior precision plus the decayed sum of p(1 - p) x^2); a step moves it by
gradient / information, so it moves fast while evidence is thin and settles as evidence grows,
and the decay keeps it able to follow a drifting workload. The request offset has its own, faster
decay and a prior pulling it to 0: a request that is persistently easier or harder than its
drafter's average moves it within a few steps.

Quality: every outcome is first predicted, then learned (prequential), so `brier` and `reliability`
describe predictions made before the outcome was seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

_LOGIT_CLIP = 9.0  # |logit(c)| <= 9: confidences within 1.2e-4 of 0 or 1 read as that bound
_STEP_CLIP = 2.0  # one outcome moves a parameter by at most this much


def _logit(p: float) -> float:
    # Comparisons, not min/max: this runs for every draft shown and every outcome learned. A NaN
    # confidence reads as the upper bound.
    p = 1e-12 if p < 1e-12 else (p if p < 1 - 1e-12 else 1 - 1e-12)
    z = math.log(p / (1 - p))
    return -_LOGIT_CLIP if z < -_LOGIT_CLIP else (z if z < _LOGIT_CLIP else _LOGIT_CLIP)


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


@dataclass
class RequestOffset:
    """A request's own logit offset with its information total."""

    value: float = 0.0
    information: float = 4.0


@dataclass
class ConfidenceCalibration:
    positions: int = 8
    decay: float = 0.999  # per outcome, on the shared parameters' information
    prior_information: float = 4.0  # how many outcomes' worth the starting parameters count
    offset_decay: float = 0.95  # per outcome, on a request's offset information
    offset_prior_information: float = 4.0
    weight: float = 1.0
    biases: list[float] = field(default_factory=list)
    weight_information: float = 0.0
    bias_information: list[float] = field(default_factory=list)
    # Prequential quality: squared errors and outcomes per predicted-probability decile.
    outcomes: int = 0
    squared_error: float = 0.0
    raw_squared_error: float = 0.0  # the same, reading the confidence itself as the probability
    bins_predicted: list[float] = field(default_factory=lambda: [0.0] * 10)
    bins_accepted: list[float] = field(default_factory=lambda: [0.0] * 10)
    bins_count: list[int] = field(default_factory=lambda: [0] * 10)

    def __post_init__(self) -> None:
        if self.positions < 1 or not 0 < self.decay <= 1 or not 0 < self.offset_decay <= 1:
            raise ValueError("calibration needs positions >= 1 and decays in (0, 1]")
        if self.prior_information <= 0 or self.offset_prior_information <= 0:
            raise ValueError("calibration needs positive prior information")
        self.biases = (list(self.biases) + [0.0] * self.positions)[: self.positions]
        self.bias_information = (list(self.bias_information) + [self.prior_information] * self.positions)[: self.positions]
        self.weight_information = self.weight_information or self.prior_information

    def new_offset(self) -> RequestOffset:
        return RequestOffset(0.0, self.offset_prior_information)

    def predict(self, confidence: float, position: int, offset: RequestOffset | None = None) -> float:
        return _sigmoid(self._z(_logit(confidence), position, offset))

    def _z(self, x: float, position: int, offset: RequestOffset | None) -> float:
        j = position if position < self.positions else self.positions - 1
        return self.weight * x + self.biases[j] + (offset.value if offset else 0.0)

    def predict_table(self, confidences: list[float], positions: int, offset: RequestOffset | None = None) -> np.ndarray:
        """predict() for every confidence at positions 0..positions-1: a (positions, n) array."""
        logits = np.array([_logit(c) for c in confidences])
        biases = np.array([self.biases[min(j, self.positions - 1)] for j in range(positions)])
        z = self.weight * logits[None, :] + biases[:, None] + (offset.value if offset else 0.0)
        return 1.0 / (1.0 + np.exp(-z))

    def update(self, confidence: float, position: int, accepted: bool, offset: RequestOffset | None = None) -> None:
        """Learn one outcome: the draft at `position` with this confidence was accepted or not."""
        x = _logit(confidence)
        predicted = _sigmoid(self._z(x, position, offset))
        self._score(predicted, accepted, confidence)
        j = position if position < self.positions else self.positions - 1
        residual = (1.0 if accepted else 0.0) - predicted
        curvature = max(predicted * (1 - predicted), 1e-3)
        self.weight_information = self.weight_information * self.decay + curvature * x * x
        self.bias_information[j] = self.bias_information[j] * self.decay + curvature
        self.weight += _clip(residual * x / self.weight_information)
        self.biases[j] += _clip(residual / self.bias_information[j])
        if offset is not None:
            # Pull toward 0 as the information decays, then step: a ridge-regularised running fit.
            offset.information = offset.information * self.offset_decay + curvature
            shrunk = offset.value * (1 - (1 - self.offset_decay) * self.offset_prior_information / offset.information)
            offset.value = shrunk + _clip(residual / offset.information)

    # --- quality -------------------------------------------------------------------------------
    def _score(self, predicted: float, accepted: bool, confidence: float) -> None:
        y = 1.0 if accepted else 0.0
        self.outcomes += 1
        self.squared_error += (predicted - y) ** 2
        self.raw_squared_error += (confidence - y) ** 2
        b = min(int(predicted * 10), 9)
        self.bins_predicted[b] += predicted
        self.bins_accepted[b] += y
        self.bins_count[b] += 1

    @property
    def brier(self) -> float | None:
        """Mean squared error of the predictions made before each outcome (0 = perfect; a
        constant 0.5 scores 0.25)."""
        return self.squared_error / self.outcomes if self.outcomes else None

    def report(self) -> dict:
        """Prequential quality for reports: the fit's Brier score, the raw confidence's, and the
        reliability table."""
        raw = self.raw_squared_error / self.outcomes if self.outcomes else None
        return {"outcomes": self.outcomes, "brier": _round(self.brier), "brier_raw_confidence": _round(raw),
                "reliability": self.reliability()}

    def reliability(self) -> list[dict]:
        """Per predicted-probability decile: outcomes, mean prediction, observed acceptance."""
        return [{"bin": f"{b / 10:.1f}-{(b + 1) / 10:.1f}", "outcomes": n,
                 "predicted": round(self.bins_predicted[b] / n, 4), "accepted": round(self.bins_accepted[b] / n, 4)}
                for b, n in enumerate(self.bins_count) if n]

    # --- persistence (warm start) --------------------------------------------------------------
    def state(self) -> dict:
        return {"weight": self.weight, "biases": list(self.biases), "weight_information": self.weight_information,
                "bias_information": list(self.bias_information)}

    def load_state(self, state: dict) -> None:
        """Start from a saved fit; its information is capped so new data can still move it."""
        try:
            weight = float(state["weight"])
            biases = [float(b) for b in state["biases"]]
            w_info = float(state["weight_information"])
            b_info = [float(b) for b in state["bias_information"]]
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"calibration state lacks or mangles a field: {error}") from None
        values = [weight, w_info, *biases, *b_info]
        if not biases or len(biases) != len(b_info) or not all(math.isfinite(v) for v in values) or min(w_info, *b_info) <= 0:
            raise ValueError("calibration state must hold finite values, positive information, one per bias")
        cap = 50 * self.prior_information
        self.weight, self.weight_information = weight, min(w_info, cap)
        self.biases = (biases + [biases[-1]] * self.positions)[: self.positions]
        infos = [min(b, cap) for b in b_info]
        self.bias_information = (infos + [infos[-1]] * self.positions)[: self.positions]


def _clip(step: float) -> float:
    return -_STEP_CLIP if step < -_STEP_CLIP else (step if step < _STEP_CLIP else _STEP_CLIP)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
