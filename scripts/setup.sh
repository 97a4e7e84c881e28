#!/usr/bin/env bash
# Set up everything on a fresh machine: a virtual environment in .venv with the package, its
# dependencies and the test tools. Idempotent; safe to rerun.
# Torch: an existing torch in .venv is kept (bring your own GPU build); otherwise the CPU build is
# installed explicitly, because a bare `torch` requirement can pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install --quiet "torch==2.13.0"
fi
.venv/bin/python -m pip install --quiet -e ".[test]"
.venv/bin/python -c "import adaptive_spec, torch; print('adaptive-spec', adaptive_spec.__version__, '| torch', torch.__version__)"
