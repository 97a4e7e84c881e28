#!/usr/bin/env bash
# The main job on its embedded default: set up, fetch the default pair (Qwen2.5-Coder 1.5B target +
# 0.5B draft; pinned, hash-checked, converted once), and stream a completion.
# Extra arguments go to `adaptive-spec generate`, e.g. --prompt "..." --temperature 0.7.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/adaptive-spec models fetch qwen-coder
.venv/bin/adaptive-spec generate --pair qwen-coder "$@"
