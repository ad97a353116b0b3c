#!/usr/bin/env bash
# One device call (seventh session): where the learner's first-update delay goes, and the failing GPU test.
#   1. scripts/compile_cost.py: the atari preset's learner to its first fast update, cold, with a warm compile
#      cache, with the side steps eager (learner.compile_side_steps=false), and eager (~4 minutes);
#   2. three probes of scripts/device_bisect2.sh: the failing test's path (noise frames, batch 128, observations
#      attached), the runs' path (Pong frames, batch 256, device cache), and the test's path in fp32.
#
#   source .device/install.sh && bash scripts/device_compile.sh      # under 10 minutes; logs under $OUT
set -u
out=${OUT:-/tmp/device_compile}
mkdir -p "$out"
timeout 300 python3 scripts/compile_cost.py --variants cold,warm_other_weights,side_eager,eager --log-dir "$out" \
    --json "$out/compile_cost.json" > "$out/compile_cost.txt" 2>&1
grep -A8 "^variant" "$out/compile_cost.txt" || tail -5 "$out/compile_cost.txt"
source scripts/consistency_probe.sh  # probe()
probe test_noise128 100 --compile --batch 128 --path direct --frames noise
probe run_cache256 90 --compile --batch 256 --path cache
probe fp32_noise128 80 --compile --batch 128 --path direct --frames noise learner.bf16=false
