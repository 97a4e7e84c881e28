"""adaptive-spec inside vLLM: a scheduler plug-in that chooses each request's speculation length.

    vllm serve MODEL --speculative-config '{"method": "ngram", "num_speculative_tokens": 6}' \\
        --scheduler-cls adaptive_spec.integrations.vllm.AdaptiveScheduler

Policy and profile come from the environment: ADAPTIVE_SPEC_VLLM_POLICY (default goodput) and
ADAPTIVE_SPEC_VLLM_PROFILE (a profile JSON file; unset = learn step costs online).

`controller` holds the vLLM-free bookkeeping; `scheduler` is the one module touching vLLM internals
(version-fenced). Importing this package does not import vLLM: `AdaptiveScheduler` loads on first use.
"""

from .controller import POLICY_ENV, PROFILE_ENV, ControllerSettings, SpecController

__all__ = ["AdaptiveScheduler", "ControllerSettings", "SpecController", "POLICY_ENV", "PROFILE_ENV"]


def __getattr__(name: str):
    if name == "AdaptiveScheduler":
        from .scheduler import AdaptiveScheduler

        return AdaptiveScheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
