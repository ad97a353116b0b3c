#!/usr/bin/env bash
# One device call (~9 minutes), the checks before the next Pong runs:
# 1. scripts/device_bisect3.sh (up to 5 minutes): the compiled step's gradients with the mix-order fix, the eager
#    step replayed as one CUDA graph (learner.step_graph) against plain eager, and the GPU tests of the
#    consistency step, the step graph and the per-row search graph;
# 2. scripts/learner_cost.py: the preset's update alone on the GPU, compiled with inductor's CUDA graphs (the
#    preset), compiled without them under the step graph, eager with and without the step graph, and batch 512.
#
#   source .device/install.sh && bash scripts/device_checks.sh      # logs under $OUT
set -u
out=${OUT:-/tmp/device_checks}
mkdir -p "$out/bisect"
OUT="$out/bisect" LIMIT="${BISECT_LIMIT:-300}" bash scripts/device_bisect3.sh
timeout "${COST_LIMIT:-240}" python3 scripts/learner_cost.py --variants "${VARIANTS:-preset,default_graph,eager,eager_graph,batch_512}" \
    --json "$out/learner_cost.json" > "$out/learner_cost.txt" 2>&1
tail -9 "$out/learner_cost.txt"
