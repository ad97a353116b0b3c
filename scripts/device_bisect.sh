#!/usr/bin/env bash
# One device call bisecting why the consistency cosine does not train in the compiled GPU step (Pong runs 2 and
# 10; scripts/device_checks.sh: eager on the GPU trains it, compiled with CUDA graphs the gradient norm jumps to
# 60-90 after the first step and the cosine stays at 0). Each variant is scripts/consistency_probe.py through a
# run's observation path at batch 256, compiled, under its own time limit; the order is by what it decides:
#   1. mode 'default' (inductor without CUDA graphs): the graphs or the generated kernels?
#   2. learner.consistency_targets=separate: the stop-gradient target branch out of the graphed step (a fix?)
#   3. no target network: does the target network's compiled bootstrap before the step matter?
#   4. fp32 (no bf16 autocast)
#   5. without the consistency loss, SGD: does the compiled step fit the heads as eager does (the main runs)?
#
#   source .device/install.sh && bash scripts/device_bisect.sh      # under 10 minutes; logs under $OUT
set -u
out=${OUT:-/tmp/device_bisect}
mkdir -p "$out"
probe() {  # NAME TIMEOUT ARGS...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" python3 scripts/consistency_probe.py --device cuda --batch 256 --path cache --compile \
        --steps 30 --every 10 "$@" > "$out/probe_$name.txt" 2>&1
    echo "== $name"
    grep "step " "$out/probe_$name.txt" | sed 's/^.*: step/step/'; grep -m1 "Error" "$out/probe_$name.txt"
}
probe default 120 learner.compile_mode=default
probe separate 120 learner.consistency_targets=separate
probe no_target 115 learner.target_update_interval=0 replay.bootstrap_obs=false
probe fp32 110 learner.bf16=false
probe sgd_no_consistency 100 --consistency 0 learner.optimizer=sgd learner.lr=0.2 learner.lr_warmup_steps=20
