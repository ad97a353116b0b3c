#!/usr/bin/env bash
# One device call of checks before the notebook's runs: the GPU tests of the inference actor and the learner
# (the pinned evaluation network's among them), then the preset's learner alone (`rayzero bench learner
# --preset atari`: the rate a training run's colocated learner is held against, issue 11).
#
#   source .device/install.sh && bash scripts/device_checks.sh
#
# Lands in $OUT: gpu_tests.txt, bench_learner_preset.json and .txt. About 6-8 minutes.
set -u
out=${OUT:-/tmp/device_checks}
mkdir -p "$out"
timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider tests/test_inference_gpu.py \
    tests/test_learner_gpu.py > "$out/gpu_tests.txt" 2>&1
echo "GPU tests (rc $?):"; grep -E "passed|failed|error" "$out/gpu_tests.txt" | tail -5
grep -E "^(FAILED|ERROR)" "$out/gpu_tests.txt" | head -20
timeout "${BENCH_TIMEOUT:-240}" python3 -m rayzero bench learner --preset atari --short \
    --json "$out/bench_learner_preset.json" > "$out/bench_learner_preset.txt" 2>&1
echo "bench learner --preset atari (rc $?):"; grep -v "A.L.E\|Stella" "$out/bench_learner_preset.txt" | tail -12
