#!/usr/bin/env bash
# One device call, several variants at once: each a `rayzero train --config atari` of its own (its own local Ray
# instance), all sharing the host's GPU and cores, so each runs at roughly 1/N of the speed alone. For a per-update
# A/B of learning settings (compare the evaluations against updates, not wall-clock): one call gives N runs of
# ~1/N the updates, where one bar run gives one (docs/benchmarks.md, seventeenth session).
#
#   source .device/install.sh && bash scripts/device_ab.sh NAME TIME_LIMIT "--env ALE/Breakout-v5" \
#       "--env ALE/Breakout-v5 learner.lr_decay_steps=25000" [...]
#
# CONFIG=cartpole tries it on a CPU (no nvidia-smi needed). Each variant's arguments are one word of this script (quoted); they go to `rayzero train` as they are.
# In $OUT: NAME_<i>/{train.out,train.log,metrics.jsonl,summary.json,learning_curve.png,plan.json}, dmon.txt,
# and each variant's notebook row (scripts/lab_row.py). TRAIN_TIMEOUT (default TIME_LIMIT + 50) ends them all;
# metrics.jsonl is copied every 10 s, so what a run logged comes back even if it is cut.
set -u
name=$1 limit=$2
shift 2
out=${OUT:-/tmp/$name.out}
mkdir -p "$out"
nvidia-smi dmon -s u -d 5 > "$out/dmon.txt" 2>&1 < /dev/null &
watchers=$!
n=$#
(while sleep 10; do for i in $(seq 1 "$n"); do mkdir -p "$out/${name}_$i"; cp "/tmp/${name}_$i/metrics.jsonl" "$out/${name}_$i/" 2>/dev/null; done; done) > /dev/null 2>&1 < /dev/null &
watchers="$watchers $!"
trap 'kill $watchers 2>/dev/null' EXIT
i=0
pids=""
for variant in "$@"; do
    i=$((i + 1))
    mkdir -p "$out/${name}_$i"
    echo "$variant" > "$out/${name}_$i/variant.txt"
    # shellcheck disable=SC2086  # a variant's words are separate arguments
    timeout -k 10 "${TRAIN_TIMEOUT:-$((limit + 50))}" python3 -m rayzero train --config "${CONFIG:-atari}" --out "/tmp/${name}_$i" \
        --time-limit "$limit" $variant > "$out/${name}_$i/train.out" 2> "$out/${name}_$i/train.log" < /dev/null &
    pids="$pids $!"
    sleep "${STAGGER:-3}"  # the Ray instances start one after another
done
# shellcheck disable=SC2086  # the pids are separate words
wait $pids
i=0
for variant in "$@"; do
    i=$((i + 1))
    for f in metrics.jsonl summary.json learning_curve.png plan.json; do cp "/tmp/${name}_$i/$f" "$out/${name}_$i/" 2>/dev/null; done
    echo "== ${name}_$i: $variant"
    python3 scripts/lab_row.py "/tmp/${name}_$i" --at "60,120,180,300,$limit" 2>&1
done
