"""adaptive-spec inside vLLM: a scheduler plug-in that chooses each request's speculation length.

    vllm serve MODEL --speculative-config '{"method": "ngram", "num_speculative_tokens": 6}' \\
        --scheduler-cls adaptive_spec.integrations.vllm.AdaptiveScheduler

Policy and profile come from the environment: ADAPTIVE_SPEC_VLLM_POLICY (default goodput) and
ADAPTIVE_SPEC_VLLM_PROFILE (a profile JSON file; unset = learn step costs online).

`controller` and `draft_cache` hold the vLLM-free bookkeeping; `scheduler` (the engine core's side) and
`lazy_draft` (the model runner's side: a step at k = 0 skips the draft model, which catches up later)
touch vLLM internals and are version-fenced (`fence`). Importing this package does not import vLLM:
`AdaptiveScheduler` loads on first use.
"""

from .controller import POLICY_ENV, PROFILE_ENV, ControllerSettings, SpecController

__all__ = ["AdaptiveScheduler", "ControllerSettings", "SpecController", "POLICY_ENV", "PROFILE_ENV"]


def __getattr__(name: str):
    if name == "AdaptiveScheduler":
        from .scheduler import AdaptiveScheduler

        return AdaptiveScheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
