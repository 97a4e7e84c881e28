"""Bad input at the vLLM boundary: an untested vLLM version, a missing profile, an unknown policy.

The failures that happen while vLLM starts run in a child process, so a half-started engine cannot
leak into the other tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from vllm_cases import SMALL_MODEL, TEST_THREADS, require_vllm

require_vllm()

from adaptive_spec.integrations.vllm.scheduler import (TESTED_VERSIONS, UnsupportedVLLMVersion,  # noqa: E402
                                                        check_vllm_version)
from packaging.version import Version  # noqa: E402

pytestmark = pytest.mark.vllm


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "not-a-version"])
def test_versions_outside_the_tested_range_are_refused(version):
    with pytest.raises(UnsupportedVLLMVersion, match=rf"supports vLLM >= 0.32.0, < 0.33.*found vLLM {version}"):
        check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.32.2+cpu"])
def test_tested_versions_are_accepted(version):
    low, high = TESTED_VERSIONS
    assert low <= Version(Version(version).base_version) < high  # the case is inside the range it tests
    assert check_vllm_version(version) is None  # no UnsupportedVLLMVersion


def test_importing_the_plug_in_under_an_untested_vllm_fails_with_a_clear_message():
    result = run_python("""
        import vllm
        vllm.__version__ = "0.34.0"
        import adaptive_spec.integrations.vllm.scheduler
    """)
    assert result.returncode != 0
    assert "UnsupportedVLLMVersion" in result.stderr and "found vLLM 0.34.0" in result.stderr


@pytest.mark.real_models
@pytest.mark.parametrize("settings,expected", [
    ("ControllerSettings('goodput', 'no-such-profile.json')", "profile file 'no-such-profile.json' does not exist"),
    ("ControllerSettings('fastest')", "unknown policy 'fastest'"),
])
def test_a_bad_setting_stops_vllm_at_start_up_with_a_clear_error(settings, expected):
    result = run_python(f"""
        from adaptive_spec.integrations.vllm.controller import ControllerSettings
        from adaptive_spec.integrations.vllm.engine import EngineSpec, make_llm
        if __name__ == "__main__":
            make_llm(EngineSpec({SMALL_MODEL!r}, drafter="ngram", threads={TEST_THREADS}, settings={settings}))
            print("STARTED")
    """, NUMBA_NUM_THREADS="1")
    assert "STARTED" not in result.stdout
    assert result.returncode != 0 and expected in result.stderr, result.stderr[-2000:]
