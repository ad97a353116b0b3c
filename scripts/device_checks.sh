#!/usr/bin/env bash
# One device call of checks that need CUDA and answer open questions (docs/benchmarks.md, "Next"), each under its
# own time limit so one that hangs does not take the others' time:
#   1. the GPU tests not yet run on CUDA (fused SGD; the min_q_range row of the tree GPU tests);
#   2. scripts/consistency_probe.py eager and compiled at batch 256: does the consistency cosine train on the GPU,
#      and where do the first steps' large gradients sit (Pong runs 2 and 10: norm 80-90, cosine ~0);
#   3. `rayzero bench selfplay --rows cpu`: CPU-search mode on the GPU host (never finished inside a call).
#
#   source .device/install.sh && bash scripts/device_checks.sh      # about 9 minutes; logs under $OUT
set -u
out=${OUT:-/tmp/device_checks}
mkdir -p "$out"
timeout 120 python3 -m pytest -q tests/test_learner_gpu.py tests/test_tree_gpu.py -k "fused_sgd or minq" \
    > "$out/pytest_gpu.txt" 2>&1
tail -3 "$out/pytest_gpu.txt"
timeout 60 python3 scripts/consistency_probe.py --device cuda --batch 256 --steps 100 --every 10 \
    > "$out/consistency_eager.txt" 2>&1
grep -v "A.L.E\|Stella" "$out/consistency_eager.txt" | tail -16
timeout 180 python3 scripts/consistency_probe.py --device cuda --compile --batch 256 --steps 150 --every 10 \
    > "$out/consistency_compiled.txt" 2>&1
grep -v "A.L.E\|Stella\|arn\|softmax\|Inductor\|PyTorch\|^ *$" "$out/consistency_compiled.txt" | tail -20
timeout 170 python3 -m rayzero bench selfplay --rows cpu --seconds 10 --json "$out/bench_selfplay_cpu.json" \
    > "$out/bench_selfplay_cpu.txt" 2>&1
grep "^served" "$out/bench_selfplay_cpu.txt" || tail -5 "$out/bench_selfplay_cpu.txt"
