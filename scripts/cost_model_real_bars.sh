#!/usr/bin/env bash
# The online cost model's real bars in our engine (issue 41): goodput with the shared cost model
# started from a profile measured at the start of this run, from that profile perturbed (draft
# x1.3, verify cost per extra token x0.8) and from no profile, side by side in one bench run per
# batch size, on the mixed HumanEval + ShareGPT stream, greedy. Every lane gets the same acceptance
# warm start (the committed one, through --profile), so the starts differ in their costs alone.
#
#   bash scripts/cost_model_real_bars.sh [RESULTS_DIR] [PROMPTS_PER_WORKLOAD] [CALIBRATE_SECONDS] [BATCHES]
#
# CALIBRATE_SECONDS (default 0): each lane's start-up sweep of draft lengths (--calibrate), paid in
# its own figures; BATCHES (default "1 4"): the batch sizes, one bench each.
#
# Writes RESULTS_DIR/cost-bars/STAMP/{here,perturbed}.json (STAMP: the run's UTC start, so an earlier
# run's result files keep the profiles they name) and one result file per batch size. Takes
# about 45 minutes on the 2-core CPU; run nothing else meanwhile (the figures are wall-clock).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results}
prompts=${2:-16}
calibrate=${3:-0}
batches=${4:-1 4}
cli=.venv/bin/adaptive-spec
work="$out/cost-bars/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$work"

"$cli" profile --pair qwen-coder --quick --quiet --name cost-bars-here --out "$work/here.json"
.venv/bin/python - "$work/here.json" "$work/perturbed.json" <<'EOF'
import sys

from adaptive_spec.profiling.profile_file import load_profile, save_profile
from adaptive_spec.simulation.price_error import scaled_profile

perturbed = scaled_profile(load_profile(sys.argv[1]), draft=1.3, verify_per_token=0.8)
perturbed["name"] = "cost-bars-perturbed (draft x1.3, verify per token x0.8)"
save_profile(perturbed, sys.argv[2])
EOF

for batch in $batches; do
  "$cli" bench --pair qwen-coder --mix "humaneval:$prompts,sharegpt:$prompts" --batch-size "$batch" --no-hf \
    --temperatures 0 --max-new-tokens 64 --cost-model shared --calibrate "$calibrate" \
    --profile profiles/cpu-2core-qwen-coder-fp32-int8draft.json \
    --policies "goodput@$work/here.json,goodput@$work/perturbed.json,goodput@none" --save "$out"
done
