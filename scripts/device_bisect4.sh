#!/usr/bin/env bash
# One device call (~5 minutes): which compiler setting makes the compiled step's gradients right?
# The eleventh session found the compiled step wrong at batch 128 (noise frames, direct path) and 512 (the run's
# cache path), in both modes, with inductor's mix-order reduction off (learner.avoid_miscompiles): gradient norms
# of 80-960 where eager gives ~4; batch 256, the preset's, was right. Each probe is scripts/consistency_probe.py
# compiled at batch 128, in its own process, with one compiler setting changed, against the eager control. The
# setting whose norms follow eager's names the faulty pass; it then goes into learner.avoid_miscompiles.
#
#   source .device/install.sh && bash scripts/device_bisect4.sh      # logs under $OUT
set -u
out=${OUT:-/tmp/device_bisect4}
mkdir -p "$out"
limit=${LIMIT:-300}
probe() {
    local name=$1
    shift
    timeout "$limit" python3 scripts/consistency_probe.py --device cuda --steps 8 --every 1 --batch 128 --path direct \
        --frames noise "$@" learner.background_compile=false learner.compile_check_steps=0 \
        > "$out/probe_$name.txt" 2>&1 &
}
probe eager learner.step_graph=false
probe compiled --compile
probe no_donated_buffer --compile --torch-config functorch.donated_buffer=False
probe no_split_reductions --compile --torch-config inductor.split_reductions=False
probe no_persistent_reductions --compile --torch-config inductor.triton.persistent_reductions=False
probe no_loop_reordering --compile --torch-config inductor.loop_ordering_after_fusion=False
probe no_online_softmax --compile --torch-config inductor.online_softmax=False
probe no_epilogue_fusion --compile --torch-config inductor.epilogue_fusion=False
probe fusion_1 --compile --torch-config inductor.max_fusion_size=1
probe no_pattern_matcher --compile --torch-config inductor.pattern_matcher=False
wait
for f in "$out"/probe_*.txt; do
    printf '%-26s ' "$(basename "$f" .txt | sed 's/^probe_//')"
    grep "step " "$f" | grep -v "compiled step" | sed 's/^.*: step/step/' | awk '{printf "%s ", $4} END {print ""}'
    grep -m1 "Error" "$f"
done
