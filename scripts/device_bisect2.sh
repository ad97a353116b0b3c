#!/usr/bin/env bash
# One device call: why test_compiled_consistency_step_follows_the_eager_one_at_the_atari_size fails on CUDA
# (compiled gradient norm 3.8 then ~100-140 against eager's ~4, with consistency_targets=separate), while last
# session's probe followed eager and Pong runs 12-13 train the cosine to -0.9. The test differs from the probe in
# four ways: SGD (the preset's optimizer since run 13; the probe had AdamW), batch 128 (256), observations
# attached to the batch (the probe and the runs: the learner's device cache), and uniform noise frames (the probe:
# random Pong play). Inductor on the CPU (fp32, no CUDA graphs) follows eager on the test's path (docs). Each is
# scripts/consistency_probe.py, compiled, under its own time limit, in the order of what it decides.
#
#   source .device/install.sh && bash scripts/device_bisect2.sh      # under 10 minutes; logs under $OUT
set -u
out=${OUT:-/tmp/device_bisect2}
mkdir -p "$out"
source scripts/consistency_probe.sh  # probe()
probe eager_noise128 40 --batch 128 --path direct --frames noise
probe test_noise128 110 --compile --batch 128 --path direct --frames noise
probe pong_direct128 110 --compile --batch 128 --path direct
probe run_cache256 100 --compile --batch 256 --path cache
probe adamw_noise128 100 --compile --batch 128 --path direct --frames noise learner.optimizer=adamw learner.lr=0.001
probe fp32_noise128 90 --compile --batch 128 --path direct --frames noise learner.bf16=false
