#!/usr/bin/env bash
# One device call of checks that need CUDA and answer open questions (docs/benchmarks.md, "Next"), each under its
# own time limit so one that hangs does not take the others' time:
#   1. the GPU tests not yet run on CUDA (fused SGD; the min_q_range row of the tree GPU tests);
#   2. scripts/consistency_probe.py on the GPU at batch 256: does the consistency cosine train, and where do the
#      first steps' large gradients sit (Pong runs 2 and 10: norm 80-90, cosine ~0)? Eager with observations
#      attached, eager through a run's path (frames in shared memory, the learner's device cache), eager SGD, and
#      compiled (CUDA graphs) through a run's path;
#   3. `rayzero bench selfplay --rows cpu`: CPU-search mode on the GPU host (never finished inside a call).
#
#   source .device/install.sh && bash scripts/device_checks.sh      # about 8 minutes; logs under $OUT
set -u
out=${OUT:-/tmp/device_checks}
mkdir -p "$out"
timeout 90 python3 -m pytest -q tests/test_learner_gpu.py tests/test_tree_gpu.py -k "fused_sgd or minq" \
    > "$out/pytest_gpu.txt" 2>&1
tail -3 "$out/pytest_gpu.txt"
probe() {  # NAME TIMEOUT ARGS...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" python3 scripts/consistency_probe.py --device cuda --batch 256 "$@" > "$out/probe_$name.txt" 2>&1
    grep -v "A.L.E\|Stella\|arn\|softmax\|Inductor\|PyTorch\|^ *$" "$out/probe_$name.txt" | tail -14
}
probe eager_direct 50 --steps 40 --every 10
probe eager_cache 50 --path cache --steps 40 --every 10
probe eager_cache_sgd 50 --path cache --steps 40 --every 10 learner.optimizer=sgd learner.lr=0.2 learner.lr_warmup_steps=20
probe compiled_cache 200 --path cache --compile --steps 60 --every 10
timeout 140 python3 -m rayzero bench selfplay --rows cpu --seconds 10 --json "$out/bench_selfplay_cpu.json" \
    > "$out/bench_selfplay_cpu.txt" 2>&1
grep "^served\|env-only\|cpu" "$out/bench_selfplay_cpu.txt" | tail -6 || tail -5 "$out/bench_selfplay_cpu.txt"
