"""Profile files: JSON documents holding a machine's measured step costs, and their fingerprints.

A profile is data, not code. Its top level (schema version 1):

``format``          "adaptive-spec-profile"
``schema_version``  1
``name``, ``created_utc``, ``elapsed_seconds``
``fingerprint``     the machine and models it was measured with (see `machine_fingerprint`,
                    `model_fingerprint`): device, CPU/GPU model, torch version, threads, dtype,
                    and per model (``target``, ``draft``) its architecture, parameter count and a
                    hash of the latency-relevant config fields.
``settings``        how it was measured (warm-up, repeats, cache fill, spread threshold, ...)
``grid``            the requested axes: batch_sizes, contexts, query_tokens, draft_query_tokens,
                    overhead_ks
``target``          one row per (batch, context, query_tokens) cell of target forwards:
                    ``samples`` (seconds), ``median``, ``iqr``, ``rel_spread`` (iqr / median)
``draft``           the same for draft forwards (query_tokens 1 and 2: decode and catch-up)
``overhead``        one row per (batch, k): the engine step's time outside model forwards, split
                    like a `StepRecord`: ``draft_extra``, ``verify_extra``, ``rest`` (medians) and
                    their ``*_samples``
``warnings``        cells whose spread was high, and anything else worth knowing
``learned``         only in a learned state (`learned_profile`, written by ``--save-learned``): the
                    shared online cost model's state after a run (``state``), the shape it corrects
                    (``shape``: "profile", the tables of this document, copied from the profile it
                    started from; or "generic", no tables), ``whole_step``, ``from``, ``created_utc``;
                    ``fingerprint`` is then the machine it learned on

`profile_frame(profile, "target")` gives any table as a pandas DataFrame (one row per sample).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
import warnings
from pathlib import Path
from typing import Any, Mapping

__all__ = [
    "FORMAT",
    "SCHEMA_VERSION",
    "ProfileError",
    "ProfileMismatchError",
    "ProfileMismatchWarning",
    "load_profile",
    "save_profile",
    "validate_profile",
    "profile_frame",
    "machine_fingerprint",
    "model_fingerprint",
    "fingerprint_value",
    "config_hash",
    "check_fingerprint",
    "fingerprint_differences",
    "load_cost_model",
    "learned_profile",
    "is_learned",
    "best_profile",
]

FORMAT = "adaptive-spec-profile"
SCHEMA_VERSION = 1

# The config fields that decide a forward's latency (names, token ids and versions do not).
ARCHITECTURE_KEYS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "hidden_act",
    "use_sliding_window", "sliding_window", "attention_bias", "mlp_bias", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "num_local_experts",
)  # fmt: skip

# Fingerprint fields compared against the running machine (others are informational).
MACHINE_KEYS = ("device", "device_name", "torch_version", "threads")
MODEL_KEYS = ("architecture", "parameters", "config_hash", "dtype", "linear_kernel")


class ProfileError(RuntimeError):
    """A profile file is missing, unreadable, corrupt, or does not fit where it is used."""


class ProfileMismatchError(ProfileError):
    """Under a strict check: the profile was measured on another machine or with other models."""


class ProfileMismatchWarning(UserWarning):
    """The profile was measured on another machine or with other models; its costs may be off."""


# ----------------------------------------------------------------------------- files


def load_profile(path: str | os.PathLike) -> dict:
    """Read and validate a profile; a missing, unreadable or corrupt file raises `ProfileError`
    naming the file and what is wrong."""
    path = Path(path)
    if not path.exists():
        raise ProfileError(f"profile file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ProfileError(f"profile file {str(path)!r} cannot be read: {error}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ProfileError(f"profile file {str(path)!r} is not valid JSON (corrupt or truncated?): {error}") from None
    validate_profile(data, source=str(path))
    return data


def save_profile(profile: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Write a profile atomically (a temporary sibling, then one rename)."""
    validate_profile(profile, source=str(path))
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    text = _dumps(profile)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a profile is ordinary data
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _dumps(profile: Mapping[str, Any]) -> str:
    """JSON with one table row per line: readable diffs, compact files."""
    lines = ["{"]
    items = list(profile.items())
    for n, (key, value) in enumerate(items):
        comma = "," if n < len(items) - 1 else ""
        if isinstance(value, list) and value and isinstance(value[0], dict):
            rows = [f"  {json.dumps(row, separators=(',', ':'))}" for row in value]
            lines.append(f"{json.dumps(key)}: [\n" + ",\n".join(rows) + f"\n]{comma}")
        else:
            lines.append(f"{json.dumps(key)}: {_pretty(value, 1)}{comma}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _pretty(value: Any, depth: int) -> str:
    """Indented JSON whose lists of plain values stay on one line."""
    pad = " " * depth
    if isinstance(value, Mapping) and value:
        items = [f"{pad}{json.dumps(str(k))}: {_pretty(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * (depth - 1) + "}"
    if isinstance(value, list) and any(isinstance(v, (Mapping, list)) or (isinstance(v, str) and len(v) > 40) for v in value):
        items = [f"{pad}{_pretty(v, depth + 1)}" for v in value]
        return "[\n" + ",\n".join(items) + "\n" + " " * (depth - 1) + "]"
    return json.dumps(value, separators=(", ", ": "))


def _row_problem(row: Any, keys: tuple[str, ...]) -> str | None:
    if not isinstance(row, Mapping):
        return "a row is not an object"
    for key in keys:
        if key not in row:
            return f"a row lacks {key!r}"
    median = row.get("median")
    if median is not None and not (isinstance(median, (int, float)) and math.isfinite(median) and median > 0):
        return f"a row has median {median!r} (need a positive number)"
    return None


def validate_profile(data: Any, source: str = "<profile>") -> None:
    """Raise `ProfileError` naming `source` unless `data` is a well-formed profile document."""
    def fail(message: str):
        raise ProfileError(f"profile {source!r} is not a valid profile: {message}")

    if not isinstance(data, Mapping):
        fail(f"the top level is {type(data).__name__}, not an object")
    if data.get("format") != FORMAT:
        fail(f"'format' is {data.get('format')!r}, expected {FORMAT!r}")
    version = data.get("schema_version")
    if not isinstance(version, int):
        fail("'schema_version' is missing")
    if version > SCHEMA_VERSION:
        fail(f"schema_version {version} is newer than this code understands ({SCHEMA_VERSION}); upgrade adaptive-spec")
    if not isinstance(data.get("fingerprint"), Mapping):
        fail("'fingerprint' is missing")
    learned = data.get("learned")
    if learned is not None and not (isinstance(learned, Mapping) and isinstance(learned.get("state"), Mapping)):
        fail("'learned' must be an object with a 'state'")
    target = data.get("target")
    generic = learned is not None and learned.get("shape") == "generic"  # a learned state of the generic shape
    if not isinstance(target, list) or not (target or generic):
        fail("'target' has no measurements")
    for name, keys in (("target", ("batch", "context", "query_tokens", "median")),
                       ("draft", ("batch", "context", "query_tokens", "median")),
                       ("overhead", ("batch", "k", "draft_extra", "verify_extra", "rest"))):  # fmt: skip
        rows = data.get(name) or []
        if not isinstance(rows, list):
            fail(f"{name!r} is not a list")
        for row in rows:
            problem = _row_problem(row, keys)
            if problem:
                fail(f"{name}: {problem}")


def profile_frame(profile: Mapping[str, Any], component: str = "target", samples: bool = True):
    """A pandas DataFrame of one table ("target", "draft" or "overhead"): one row per sample
    (column ``seconds``) when `samples`, else one row per cell with its median and spread."""
    import pandas as pd

    rows = profile.get(component) or []
    if component == "overhead":
        return pd.DataFrame([{k: v for k, v in row.items() if not k.endswith("_samples")} for row in rows])
    if not samples:
        return pd.DataFrame([{k: v for k, v in row.items() if k != "samples"} for row in rows])
    out = []
    for row in rows:
        for n, seconds in enumerate(row.get("samples") or [row["median"]]):
            out.append({"batch": row["batch"], "context": row["context"], "query_tokens": row["query_tokens"],
                        "sample": n, "seconds": seconds, "median": row["median"]})  # fmt: skip
    return pd.DataFrame(out)


# ----------------------------------------------------------------------------- fingerprints


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def machine_fingerprint(device: str = "cpu") -> dict:
    """The running machine as a profile records it."""
    import torch
    import transformers

    device = str(device)
    kind = device.split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        name, extra = "no GPU available", {}
    elif kind == "cuda":
        index = torch.device(device).index or 0
        name = torch.cuda.get_device_name(index)
        extra = {"cuda_version": torch.version.cuda, "gpu_count": torch.cuda.device_count()}
    else:
        name, extra = _cpu_model(), {}
    return {
        "device": kind,
        "device_name": name,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch_version": torch.__version__.split("+")[0],
        "transformers_version": transformers.__version__,
        "platform": platform.platform(terse=True),
        "python": platform.python_version(),
        **extra,
    }


def config_hash(config: Any) -> str:
    """A short hash of the config fields that decide latency (`ARCHITECTURE_KEYS`)."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    picked = {key: data.get(key) for key in ARCHITECTURE_KEYS if data.get(key) is not None}
    if "head_dim" not in picked and data.get("hidden_size") and data.get("num_attention_heads"):
        picked["head_dim"] = data["hidden_size"] // data["num_attention_heads"]
    text = json.dumps(picked, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_fingerprint(model: Any, name: str | None = None, random_weights: bool = False) -> dict:
    """A model as a profile records it: architecture, parameter count, dtype, what runs its Linear
    layers (`modeling.cpu_linear.linear_kernel`), config hash."""
    import torch

    from ..modeling.cpu_linear import linear_kernel

    config = model.config
    parameters, dtype = _weights(model)
    architectures = getattr(config, "architectures", None) or [type(model).__name__]
    name = name or getattr(config, "_name_or_path", None) or type(model).__name__
    if os.path.isdir(str(name)):  # a local directory: keep its last component, not the machine's path
        name = os.path.basename(os.path.normpath(str(name)))
    return {
        "name": str(name),
        "architecture": architectures[0],
        "model_type": getattr(config, "model_type", None),
        "parameters": int(parameters),
        "dtype": dtype,
        "linear_kernel": linear_kernel(model) if isinstance(model, torch.nn.Module) else "torch",
        "config_hash": config_hash(config),
        "num_hidden_layers": getattr(config, "num_hidden_layers", None),
        "hidden_size": getattr(config, "hidden_size", None),
        "vocab_size": getattr(config, "vocab_size", None),
        "random_weights": bool(random_weights),
    }


def _weights(model: Any) -> tuple[int, str]:
    """(parameter count, precision). Dynamically int8-quantised Linear layers keep their weights
    outside `parameters()`; they are counted, and such a model's precision reads "int8"."""
    import torch

    parameters = sum(p.numel() for p in model.parameters())
    quantized = [m for m in model.modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)]
    if quantized:
        return parameters + sum(m.weight().numel() + (m.bias().numel() if m.bias() is not None else 0)
                                for m in quantized), "int8"
    return parameters, str(next(model.parameters()).dtype).replace("torch.", "")


def profile_engine(profile: Mapping[str, Any]) -> str:
    """The engine whose steps a profile timed: "hf" (this project's engine, the default) or "vllm"."""
    fingerprint = profile.get("fingerprint") if isinstance(profile, Mapping) else None
    return str((fingerprint or {}).get("engine", "hf")) if isinstance(fingerprint, Mapping) else "hf"


def fingerprint_value(model: Mapping[str, Any], key: str) -> Any:
    """A model fingerprint's `key`, or for a profile written before that key existed, what it was
    measured with: profiles without a linear_kernel ran torch's own kernels (dynamic int8 for an
    int8 model)."""
    if key in model:
        return model[key]
    if key == "linear_kernel":
        return "int8-dynamic" if model.get("dtype") == "int8" else "torch"
    return None


def check_fingerprint(profile: Mapping[str, Any], current: Mapping[str, Any], strict: bool = False,
                      source: str | None = None) -> list[str]:  # fmt: skip
    """Compare a profile's fingerprint with `current` (a fingerprint of the running machine and,
    under ``models``, of the running models; roles absent from `current` are not compared).

    Returns the differences, one string each ("threads: profile 2, here 16"). Any difference
    warns with `ProfileMismatchWarning`, or raises `ProfileMismatchError` when `strict`.
    """
    name = source or profile.get("name") or "profile"
    differences = fingerprint_differences(profile, current)
    if differences:
        message = (f"profile {name!r} was measured on a different machine or with different models "
                   f"({'; '.join(differences)}); its costs may be off until the online correction catches up")  # fmt: skip
        if strict:
            raise ProfileMismatchError(message)
        warnings.warn(message, ProfileMismatchWarning, stacklevel=2)
    return differences


def fingerprint_differences(profile: Mapping[str, Any], current: Mapping[str, Any], *,
                            machine_only: bool = False) -> list[str]:  # fmt: skip
    """`check_fingerprint`'s differences, without warning; `machine_only`: the machine's alone."""
    recorded = profile.get("fingerprint") or {}
    differences = []
    for key in MACHINE_KEYS:
        if key in current and recorded.get(key) != current.get(key):
            differences.append(f"{key}: profile {recorded.get(key)!r}, here {current.get(key)!r}")
    if machine_only:
        return differences
    recorded_models = recorded.get("models") or {}
    for role, model in (current.get("models") or {}).items():
        if model is None:
            continue
        theirs = recorded_models.get(role)
        if theirs is None:
            differences.append(f"{role}: the profile has no {role} model, here {model.get('architecture')!r}")
            continue
        for key in MODEL_KEYS:
            recorded_value = fingerprint_value(theirs, key)
            if key in model and recorded_value != model.get(key):
                differences.append(f"{role}.{key}: profile {recorded_value!r}, here {model.get(key)!r}")
    return differences


def load_cost_model(path: str | os.PathLike, target: Any = None, draft: Any = None, device: str | None = None,
                    strict: bool = False, kind: str = "cells", **options: Any):  # fmt: skip
    """Load a profile (or a learned state), check it against this machine (and the given models),
    and build its cost model of `kind` (`control.online_cost.cost_model_for`; a learned state
    always gives the shared model it saved). A mismatch warns (raises under `strict`); a bad file
    raises `ProfileError`."""
    from ..control.online_cost import cost_model_for

    profile = load_profile(path)
    check_fingerprint(profile, running_fingerprint(profile, target, draft, device), strict=strict, source=str(path))
    try:
        return cost_model_for(profile, kind, **options)
    except ValueError as error:
        raise ProfileError(f"profile {str(path)!r} cannot give a cost model: {error}") from None


def running_fingerprint(profile: Mapping[str, Any] | None, target: Any = None, draft: Any = None,
                        device: str | None = None) -> dict:  # fmt: skip
    """This machine's fingerprint with the given models under ``models``, as `check_fingerprint`
    compares it; the device is the target's, else the profile's, else the CPU."""
    if device is None:
        recorded = (profile or {}).get("fingerprint") or {}
        device = str(next(target.parameters()).device) if target is not None else (recorded.get("device") or "cpu")
    current = machine_fingerprint(device)
    models = {}
    if target is not None:
        models["target"] = model_fingerprint(target)
    if draft is not None and hasattr(draft, "parameters"):
        models["draft"] = model_fingerprint(draft)
    current["models"] = models
    return current


def best_profile(directory: str | os.PathLike, engine: str, target: str, draft: str | None,
                 here: Mapping[str, Any], wanted: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None
                 ) -> Path | None:  # fmt: skip
    """`--profile auto`, the same rule for every command and host: among the profiles (and learned
    states) in `directory` that timed `engine`'s steps with these target and draft model names,
    the one of this machine (`here`'s device, its name, torch version, threads) first, then the one
    whose models match `wanted` (per role, the fingerprint values that change a step's cost:
    precision, Linear kernels) in most keys, then a learned state over a measured profile (it holds
    that profile and what runs taught since). None when no profile names these models."""
    matches = []
    for path in sorted(Path(directory).glob("*.json")):
        if path.name.endswith(".acceptance.json"):
            continue
        try:
            profile = json.loads(path.read_text())
            models = profile.get("fingerprint", {}).get("models") or {}
        except (OSError, ValueError, AttributeError):
            continue
        if profile_engine(profile) != engine:
            continue
        found = (models.get("target") or {}, models.get("draft") or {})
        if found[0].get("name") != target or found[1].get("name") != draft:
            continue
        other_machine = bool(fingerprint_differences(profile, here, machine_only=True))
        misses = sum(fingerprint_value(model, key) != value
                     for model, want in zip(found, wanted or ({}, {})) for key, value in want.items())
        matches.append((other_machine, misses, not is_learned(profile), path))
    if not matches:
        return None
    found = min(matches)[-1]
    try:  # as the user would name it (profiles/NAME.json from the checkout), not where it lies
        return found.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return found


def is_learned(profile: Mapping[str, Any]) -> bool:
    """Whether a profile document is a learned state (`learned_profile`)."""
    return isinstance(profile, Mapping) and profile.get("learned") is not None


def learned_profile(model: Any, prior: Mapping[str, Any] | None, fingerprint: Mapping[str, Any], *,
                    whole_step: bool = False) -> dict:  # fmt: skip
    """A shared cost model's state after a run, in the profile format: the tables of `prior` (the
    profile it started from, the shape it corrects; none for the generic shape), `fingerprint` (the
    machine and models it learned on) and a ``learned`` section. `--profile` takes the file, and the
    next start resumes where this run ended."""
    import datetime

    if not hasattr(model, "learned_state"):
        raise ValueError("only the shared cost model (--cost-model shared) has a learned state to save")
    state = model.learned_state()
    document = {key: value for key, value in (prior or {}).items() if key != "learned"}
    document.setdefault("format", FORMAT)
    document.setdefault("schema_version", SCHEMA_VERSION)
    document.setdefault("target", [])
    if is_learned(prior):  # resumed from a learned state: the same shape, named after the same start
        earlier = prior["learned"]
        shape, started, whole_step = earlier.get("shape"), earlier.get("from"), bool(earlier.get("whole_step"))
    else:
        shape = "generic" if prior is None else "profile"
        started = (prior or {}).get("name") or ("the generic shape" if prior is None else "a profile")
    document["name"] = f"{started}, learned online over {state['observations']} steps"
    document["fingerprint"] = {**((prior or {}).get("fingerprint") or {}), **fingerprint}
    document["learned"] = {
        "shape": shape,
        "whole_step": bool(whole_step),
        "from": str(started),
        "created_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "state": state,
    }
    return document


# --- acceptance learned with a profile's models (the goodput policy's warm start) ---------------
ACCEPTANCE_FORMAT = "adaptive-spec-acceptance"


def acceptance_path(profile_path: str | os.PathLike) -> Path:
    """Where a profile's acceptance state lives: beside it, `<name>.acceptance.json`."""
    path = Path(profile_path)
    return path.with_name(path.stem + ".acceptance.json")


def save_acceptance(path: str | os.PathLike, state: Mapping[str, Any], source: Mapping[str, Any]) -> Path:
    document = {"format": ACCEPTANCE_FORMAT, "schema_version": 1, "source": dict(source), "goodput": dict(state)}
    path = Path(path)
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path


def load_acceptance(path: str | os.PathLike) -> dict | None:
    """The saved goodput state, None when there is no file; a malformed one warns and is ignored
    (a warm start is an optimisation: the policy then learns from its usual prior)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        document = json.loads(path.read_text())
        if document.get("format") != ACCEPTANCE_FORMAT or not isinstance(document.get("goodput"), dict):
            raise ValueError(f"not an {ACCEPTANCE_FORMAT} document")
        return document["goodput"]
    except (OSError, ValueError, AttributeError) as error:
        warnings.warn(f"ignoring acceptance state {str(path)!r}: {error}", stacklevel=2)
        return None
