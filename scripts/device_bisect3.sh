#!/usr/bin/env bash
# One device call: the compiled consistency step's gradient blow-up, variants side by side in parallel processes.
# Pong run 17 (batch 512, cache path) lost its consistency cosine (-0.87 to ~0) when the compiled step took over
# from the eager one; runs 14 and 16 (batch 256) kept it; the GPU test (batch 128, noise frames, direct path)
# fails. Each variant is scripts/consistency_probe.py, compiled, under one time limit for all.
#
#   source .device/install.sh && bash scripts/device_bisect3.sh      # ~6 minutes; logs under $OUT
set -u
out=${OUT:-/tmp/device_bisect3}
mkdir -p "$out"
limit=${LIMIT:-330}
run() {
    local name=$1
    shift
    timeout "$limit" python3 scripts/consistency_probe.py --device cuda --steps 12 --every 1 --compile "$@" learner.background_compile=false \
        > "$out/probe_$name.txt" 2>&1 &
}
run cache512 --batch 512 --path cache
run cache256 --batch 256 --path cache
run cache512_default --batch 512 --path cache learner.compile_mode=default
run noise128 --batch 128 --path direct --frames noise
run noise128_fp32 --batch 128 --path direct --frames noise learner.bf16=false
run noise128_default --batch 128 --path direct --frames noise learner.compile_mode=default
run noise128_side_eager --batch 128 --path direct --frames noise learner.compile_side_steps=false
wait
for f in "$out"/probe_*.txt; do
    echo "== $(basename "$f" .txt)"
    grep "step " "$f" | sed 's/^.*: step/step/' | awk '{printf "%s:%s/%s ", $2, $4, $6} END {print ""}'
    grep -m1 "Error" "$f"
done
