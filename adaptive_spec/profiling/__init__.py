"""Layer 4: measure this machine's step costs into profile files, and load them.

`adaptive-spec profile ...` (see `cli`) runs `profile_models` and writes a profile; the engine
side loads one with `load_cost_model(path, target, draft)`, which checks its fingerprint against
the running machine and models and returns an `adaptive_spec.control.cost_model.CostModel`.
"""

from .profile_file import (
    FORMAT,
    SCHEMA_VERSION,
    ProfileError,
    ProfileMismatchError,
    ProfileMismatchWarning,
    check_fingerprint,
    load_cost_model,
    load_profile,
    machine_fingerprint,
    model_fingerprint,
    profile_frame,
    save_profile,
    validate_profile,
)
from .profiler import NAMED_ARCHITECTURES, QUICK_SETTINGS, ProfileSettings, profile_models, random_model, resolve_config

__all__ = [
    "FORMAT", "SCHEMA_VERSION", "NAMED_ARCHITECTURES", "QUICK_SETTINGS", "ProfileError", "ProfileMismatchError",
    "ProfileMismatchWarning", "ProfileSettings", "check_fingerprint", "load_cost_model", "load_profile",
    "machine_fingerprint", "model_fingerprint", "profile_frame", "profile_models", "random_model", "resolve_config",
    "save_profile", "validate_profile",
]
