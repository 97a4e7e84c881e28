"""Policies by name: `off`, `static:K`, `goodput`, `heuristic`, `confidence:P`, `ema-tiers`,
`batch-table`, a preset name from the `policies/` folder, or a path to a preset TOML file.

A preset is a small TOML file:

    policy = "goodput"          # which kind
    name = "my-goodput"         # optional: what reports call it
    [params]                    # that kind's config fields; unknown fields are errors
    max_k = 8

The goodput policy needs a cost model (pass one, or a zero-argument factory called only when a
policy needs it); without one it starts from `CostModel.default()` and learns this machine's costs
online.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable

from ..resources import data_dir
from .baselines import BatchTablePolicy, ConfidencePolicy, EmaTiersPolicy, HFHeuristicPolicy
from .cost_model import CostModel
from .goodput import GoodputConfig, GoodputPolicy, StepCost
from .policy import Policy, StaticPolicy

PRESET_DIRS_ENV = "ADAPTIVE_SPEC_POLICIES"
SHIPPED_PRESETS = data_dir("policies")


def _goodput(params: dict, cost_model: StepCost | Callable[[], StepCost | None] | None) -> GoodputPolicy:
    if callable(cost_model) and not hasattr(cost_model, "step_seconds_table"):
        cost_model = cost_model()  # a factory: only a policy that needs costs pays for loading them
    policy = GoodputPolicy(cost_model or CostModel.default(), _build(GoodputConfig, params, "goodput"))
    warm_start = getattr(cost_model, "warm_start", None)
    if warm_start:
        try:
            policy.load_state(warm_start)
        except ValueError as error:  # an optimisation only: start from the usual prior instead
            warnings.warn(f"goodput: ignoring the saved acceptance state ({error})", stacklevel=2)
    return policy


KINDS: dict[str, Callable[[dict, StepCost | None], Policy]] = {
    "off": lambda params, _: _build(StaticPolicy, {"k": 0, **params}, "off"),
    "static": lambda params, _: _build(StaticPolicy, params, "static"),
    "goodput": _goodput,
    "heuristic": lambda params, _: _build(HFHeuristicPolicy, params, "heuristic"),
    "confidence": lambda params, _: _build(ConfidencePolicy, params, "confidence"),
    "ema-tiers": lambda params, _: _build(EmaTiersPolicy, params, "ema-tiers"),
    "batch-table": lambda params, _: _build(BatchTablePolicy, params, "batch-table"),
}


def make_policy(spec: str | Policy, cost_model: StepCost | None = None) -> Policy:
    """A policy from a name, `kind:value`, preset name or preset path; objects pass through."""
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"policy must be a non-empty string or a Policy object, got {spec!r}")
    text = spec.strip()
    path = _preset_path(text)  # a preset of the same name wins over a kind's built-in defaults
    if path is not None:
        return load_preset(path, cost_model)
    kind, _, value = text.partition(":")
    kind = kind.lower()
    if kind in KINDS and (value or kind not in ("static", "confidence")):
        return KINDS[kind](_shorthand(kind, value, spec), cost_model)
    raise ValueError(f"unknown policy {spec!r}; known: {', '.join(known_policies())}, static:K, confidence:P, "
                     "or a path to a preset .toml file")


def with_tpot_target(policy: Policy, milliseconds: float | None, *, only_goodput: bool = False) -> Policy:
    """`policy` with goodput's latency guard at `milliseconds` per output token (`--slo-tpot`; None or 0:
    unchanged). A policy that is not goodput is a ValueError, or, with `only_goodput` (a bench lane
    beside others), left as it is."""
    if not milliseconds:
        return policy
    if not milliseconds > 0:
        raise ValueError(f"--slo-tpot needs milliseconds > 0, got {milliseconds}")
    if not isinstance(policy, GoodputPolicy):
        if only_goodput:
            return policy
        raise ValueError(f"--slo-tpot bounds goodput's choices; policy {getattr(policy, 'name', policy)!r} has no latency guard")
    policy.config = dataclasses.replace(policy.config, tpot_target=milliseconds / 1000)
    return policy


def load_preset(path: str | os.PathLike, cost_model: StepCost | None = None) -> Policy:
    path = Path(path)
    try:
        document = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"policy preset {path} does not exist") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"policy preset {path} is not valid TOML: {error}") from None
    kind = document.get("policy")
    if kind not in KINDS:
        raise ValueError(f"policy preset {path}: 'policy' must be one of {', '.join(KINDS)}, got {kind!r}")
    extra = set(document) - {"policy", "params", "description", "name"}
    if extra:
        raise ValueError(f"policy preset {path}: unknown keys {sorted(extra)}")
    params = document.get("params", {})
    if not isinstance(params, dict):
        raise ValueError(f"policy preset {path}: [params] must be a table")
    name = document.get("name")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ValueError(f"policy preset {path}: 'name' must be a non-empty string, got {name!r}")
    try:
        policy = KINDS[kind](dict(params), cost_model)
    except (TypeError, ValueError) as error:
        raise ValueError(f"policy preset {path}: {error}") from None
    if name is not None:  # what reports call it (default: its kind's name)
        policy.name = name.strip()
    return policy


def known_policies() -> list[str]:
    presets = sorted({p.stem for d in _preset_dirs() for p in d.glob("*.toml")})
    builtin = [k for k in KINDS if k not in ("static", "confidence")]
    return builtin + [p for p in presets if p not in builtin]


def _shorthand(kind: str, value: str, spec: str) -> dict[str, Any]:
    if kind in ("off", "goodput", "heuristic", "ema-tiers", "batch-table"):
        if value:
            raise ValueError(f"policy {spec!r}: {kind} takes no ':value' (use a preset file for settings)")
        return {}
    try:
        return {"k": int(value)} if kind == "static" else {"min_draft_confidence": float(value)}
    except ValueError:
        raise ValueError(f"policy {spec!r}: expected {'static:K with an integer K' if kind == 'static' else 'confidence:P with a number P'}") from None


def _build(cls, params: dict, kind: str):
    names = {f.name for f in fields(cls) if f.init}
    unknown = set(params) - names
    if unknown:
        raise ValueError(f"{kind}: unknown settings {sorted(unknown)}; known: {sorted(names - {'name'})}")
    if isinstance(params.get("table"), dict):  # TOML keys are strings
        params = {**params, "table": {int(b): k for b, k in params["table"].items()}}
    if isinstance(params.get("tiers"), list):
        params = {**params, "tiers": tuple(params["tiers"])}
    return cls(**params)


def _preset_dirs() -> list[Path]:
    dirs = [Path(d) for d in os.environ.get(PRESET_DIRS_ENV, "").split(os.pathsep) if d]
    return [d for d in dirs + [SHIPPED_PRESETS] if d.is_dir()]


def _preset_path(text: str) -> Path | None:
    if text.endswith(".toml"):
        return Path(text)
    if ":" in text or "/" in text:
        return None
    for directory in _preset_dirs():
        candidate = directory / f"{text}.toml"
        if candidate.is_file():
            return candidate
    return None
