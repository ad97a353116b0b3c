#!/usr/bin/env bash
# One device call of checks that need CUDA and answer open questions (docs/benchmarks.md, "Next"), each under its
# own time limit so one that hangs does not take the others' time:
#   1. the GPU tests not yet run on CUDA: the compiled consistency step against eager at the atari size
#      (learner.consistency_targets), and the inference GPU tests (the channel fast path shares their batcher);
#   2. `rayzero bench selfplay --rows cpu`: CPU-search mode on the GPU host after the channel fast path
#      (463 env steps/s before it);
#   3. scripts/channel_bench.py on the host's 16 cores (the CPU actor's per-request host work, 2-core figures in
#      docs/benchmarks.md).
#
#   source .device/install.sh && bash scripts/device_checks.sh      # about 7 minutes; logs under $OUT
set -u
out=${OUT:-/tmp/device_checks}
mkdir -p "$out"
timeout 200 python3 -m pytest -q tests/test_learner_gpu.py tests/test_inference_gpu.py \
    -k "compiled_consistency or inference" > "$out/pytest_gpu.txt" 2>&1
tail -3 "$out/pytest_gpu.txt"
timeout 170 python3 -m rayzero bench selfplay --rows cpu --seconds 10 --json "$out/bench_selfplay_cpu.json" \
    > "$out/bench_selfplay_cpu.txt" 2>&1
grep "^served" "$out/bench_selfplay_cpu.txt" || tail -5 "$out/bench_selfplay_cpu.txt"
timeout 60 python3 scripts/channel_bench.py --clients 2,8,24 --seconds 4 --json "$out/channel_bench.json" \
    > "$out/channel_bench.txt" 2>&1
tail -6 "$out/channel_bench.txt"
