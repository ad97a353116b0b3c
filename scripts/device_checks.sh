#!/usr/bin/env bash
# One device call of checks that need CUDA and answer open questions (docs/benchmarks.md, "Next"), each under its
# own time limit so one that hangs does not take the others' time:
#   1. the GPU tests not yet run on CUDA: the compiled consistency step against eager at the atari size
#      (learner.consistency_targets), and the inference GPU tests (the channel fast path shares their batcher);
#   2. `rayzero bench selfplay --rows cpu,preset`: CPU-search mode on the GPU host after the channel fast path
#      and the batched slot checks (463 env steps/s before them, 12 actors x 16 envs), beside GPU-search mode,
#      both at the preset's 64 envs per actor with the host's actors.
#
#   source .device/install.sh && bash scripts/device_checks.sh      # about 5.5 minutes; logs under $OUT
set -u
out=${OUT:-/tmp/device_checks}
mkdir -p "$out"
timeout 140 python3 -m pytest -q tests/test_learner_gpu.py tests/test_inference_gpu.py \
    -k "compiled_consistency or served or bad_requests or selfplay_halves" > "$out/pytest_gpu.txt" 2>&1
tail -3 "$out/pytest_gpu.txt"
timeout "${BENCH_TIMEOUT:-170}" python3 -m rayzero bench selfplay --rows cpu,preset --seconds 10 \
    --json "$out/bench_selfplay.json" > "$out/bench_selfplay.txt" 2>&1
grep "^served" "$out/bench_selfplay.txt" || tail -5 "$out/bench_selfplay.txt"
