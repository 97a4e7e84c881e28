#!/usr/bin/env bash
# Set up, fetch the real models the real-model tests use, and run the whole test suite.
# Extra arguments go to pytest, e.g. -m "not slow" for the quick unit tests alone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/adaptive-spec models fetch qwen-coder --quiet
.venv/bin/adaptive-spec models fetch smollm2-135m-instruct --quiet
.venv/bin/python -m pytest -q --durations=15 "$@"
