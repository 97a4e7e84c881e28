#!/usr/bin/env bash
# The online cost model's real bar through vLLM (issue 41): goodput with the shared cost model
# started from a vLLM profile measured at the start of this run, from the committed vLLM profile
# (another day's machine state) and from no profile, side by side in one bench run at batch 1 on
# the mixed HumanEval + ShareGPT stream, greedy. Run in the vLLM environment (.venv-vllm).
#
#   bash scripts/cost_model_real_bars_vllm.sh [RESULTS_DIR] [PROMPTS_PER_WORKLOAD] [CALIBRATE_SECONDS]
#
# CALIBRATE_SECONDS (default 0): each lane's start-up sweep of draft lengths (--calibrate), paid in
# its own figures. Writes RESULTS_DIR/cost-bars/STAMP-vllm/here.json and steps.jsonl (every step of
# every lane: python -m adaptive_spec.results.steps FILE) and one result file. Takes about 35 minutes on
# the 2-core CPU; run nothing else meanwhile (the figures are wall-clock).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results}
prompts=${2:-16}
calibrate=${3:-0}
cli=.venv-vllm/bin/adaptive-spec
work="$out/cost-bars/$(date -u +%Y%m%dT%H%M%SZ)-vllm"
committed=profiles/cpu-2core-vllm-qwen-coder-fp32.json
mkdir -p "$work"
export VLLM_ENABLE_V1_MULTIPROCESSING=0

# batch 1 cells only (the bar's batch), with the lazy draft's catch-up as the committed profile has it
"$cli" profile --engine vllm --pair qwen-coder --batch-sizes 1 --contexts 128,512 --query-tokens 1,2,4,6 \
  --warmup 2 --repeats 5 --name cost-bars-vllm-here --out "$work/here.json"
.venv-vllm/bin/python -m adaptive_spec.integrations.vllm.profile --add-catch-up "$work/here.json"

"$cli" bench --engine vllm --pair qwen-coder --mix "humaneval:$prompts,sharegpt:$prompts" --max-new-tokens 64 \
  --temperatures 0 --cost-model shared --calibrate "$calibrate" --save-steps "$work/steps.jsonl" \
  --policies "goodput@$work/here.json,goodput@$committed,goodput@none" --save "$out"
