#!/usr/bin/env bash
# One device call (~9 minutes): the compiled step's gradients with the mix-order fix (scripts/device_bisect3.sh,
# ~3 minutes), then a 300 s Pong run with the learner inside the inference actor's process
# (cluster.colocate_learner=true), whose updates/s answer whether one process beats two on one GPU (Pong run 16,
# two processes: 40.6 updates/s outside evaluations, 33.7 during them, at the same settings).
#
#   source .device/install.sh && bash scripts/device_fix_and_colocate.sh      # logs under $OUT
set -u
out=${OUT:-/tmp/device_fix_and_colocate}
mkdir -p "$out/bisect" "$out/colocated"
OUT="$out/bisect" LIMIT="${BISECT_LIMIT:-200}" bash scripts/device_bisect3.sh
OUT="$out/colocated" TRAIN_TIMEOUT="${TRAIN_TIMEOUT:-345}" PROBE=0 \
    bash scripts/device_pong.sh colocated "${RUN_LIMIT:-300}" --env ALE/Pong-v5 cluster.colocate_learner=true
