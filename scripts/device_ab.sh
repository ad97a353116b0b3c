#!/usr/bin/env bash
# One device call, several variants at once: each a `rayzero train --config atari` of its own (its own local Ray
# instance, through scripts/device_pong.sh), all sharing the host's GPU and cores, so each runs at roughly 1/N of
# the speed alone. For a per-update A/B of learning settings (compare the evaluations against updates, not
# wall-clock): one call gives N runs of ~1/N the updates, where one bar run gives one.
#
#   source .device/install.sh && bash scripts/device_ab.sh NAME TIME_LIMIT "--env ALE/Breakout-v5" \
#       "--env ALE/Breakout-v5 learner.lr_decay_steps=25000" [...]
#
# Each variant's arguments are one word of this script (quoted); they go to `rayzero train` as they are.
# In $OUT: NAME_<i>/ for variant i (what device_pong.sh leaves, and variant.txt), then each one's notebook row.
# TRAIN_TIMEOUT (default TIME_LIMIT + 50) ends them all. CONFIG=cartpole tries it on a CPU (with an nvidia-smi
# stand-in on the PATH).
set -u
name=$1 limit=$2
shift 2
out=${OUT:-/tmp/$name.out}
i=0
pids=""
for variant in "$@"; do
    i=$((i + 1))
    mkdir -p "$out/${name}_$i"
    echo "$variant" > "$out/${name}_$i/variant.txt"
    # shellcheck disable=SC2086  # a variant's words are separate arguments
    OUT="$out/${name}_$i" PROBE=0 TRAIN_TIMEOUT="${TRAIN_TIMEOUT:-$((limit + 50))}" \
        bash "$(dirname "$0")/device_pong.sh" "${name}_$i" "$limit" $variant > "$out/${name}_$i/row.txt" 2>&1 &
    pids="$pids $!"
    sleep "${STAGGER:-3}"  # the Ray instances start one after another
done
# shellcheck disable=SC2086  # the pids are separate words
wait $pids
i=0
for variant in "$@"; do
    i=$((i + 1))
    echo "== ${name}_$i: $variant"
    cat "$out/${name}_$i/row.txt"
done
