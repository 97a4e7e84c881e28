#!/usr/bin/env bash
# Set up, fetch the real models the real-model tests use, and run the whole test suite: first in
# .venv, then the vLLM integration's tests in .venv-vllm (vLLM's CPU build; see setup.sh --vllm).
# Extra arguments go to pytest, e.g. -m "not slow" for the quick unit tests alone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --vllm
.venv/bin/adaptive-spec models fetch qwen-coder --quiet
.venv/bin/adaptive-spec models fetch smollm2-135m-instruct --quiet
.venv/bin/python -m pytest -q --durations=15 "$@"
# One process per module: vLLM 0.32 cannot start a third engine in a process once its n-gram
# drafter has loaded, and each module starts at most two.
for module in tests/vllm/test_*.py; do
    .venv-vllm/bin/python -m pytest -q --durations=5 "$module" "$@"
done
