#!/usr/bin/env bash
# One device call: the compiled consistency step's gradient blow-up, variants side by side in parallel processes.
# Pong run 17 (batch 512, cache path) lost its consistency cosine (-0.87 to ~0) when the compiled step took over
# from the eager one; runs 14 and 16 (batch 256) kept it; the GPU test (batch 128, noise frames, direct path)
# fails. Each variant is scripts/consistency_probe.py, compiled, under one time limit for all. Ninth session: the
# compiled norms were ~800 (batch 512) and jumped between 4 and 190 (batch 128), eager ~4; the learner now turns
# inductor's mix-order reduction off (learner.avoid_miscompiles). This call checks that fix, and runs the GPU test.
# The probes print the compiled step's own norms (learner.compile_check_steps=0), except cache512_checked, whose
# log says whether the compile check found the compiled step off eager's, and graph512, the eager step replayed as
# one CUDA graph (learner.step_graph), whose norms must be eager512's.
#
#   source .device/install.sh && bash scripts/device_bisect3.sh      # ~3 minutes; logs under $OUT
set -u
out=${OUT:-/tmp/device_bisect3}
mkdir -p "$out"
limit=${LIMIT:-330}
run() {
    local name=$1
    shift
    timeout "$limit" python3 scripts/consistency_probe.py --device cuda --steps 12 --every 1 "$@" \
        learner.background_compile=false "learner.compile_check_steps=${CHECK:-0}" > "$out/probe_$name.txt" 2>&1 &
}
run cache512 --compile --batch 512 --path cache
run cache256 --compile --batch 256 --path cache
run noise128 --compile --batch 128 --path direct --frames noise
run eager512 --batch 512 --path cache learner.step_graph=false
run graph512 --batch 512 --path cache  # the eager step replayed as one CUDA graph (learner.step_graph)
CHECK=8 run cache512_checked --compile --batch 512 --path cache
timeout "$limit" python3 -m pytest -q tests/test_learner_gpu.py tests/test_tree_gpu.py -k "consistency or per_row or step_graph" \
    > "$out/pytest_gpu.txt" 2>&1 &
wait
grep -E "^(FAILED|ERROR)" "$out/pytest_gpu.txt" | cut -c1-300; tail -1 "$out/pytest_gpu.txt"
for f in "$out"/probe_*.txt; do
    echo "== $(basename "$f" .txt)"
    grep "step " "$f" | grep -v "compiled step" | sed 's/^.*: step/step/' \
        | awk '{printf "%s:%s/%s ", $2, $4, $6} END {print ""}'
    grep -m1 "Error" "$f"
    grep -h "compiled step" "$f" | sed 's/^.*rayzero/rayzero/'
done
