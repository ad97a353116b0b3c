#!/usr/bin/env bash
# One device call (~8 minutes), issue 11's bar for the preset as it is: `rayzero train --config atari
# --time-limit 300` with no overrides, then the reference it is read against, the preset's learner alone on the
# whole GPU (`python -m rayzero.bench.learner --preset atari`, compiled before it is timed).
# Read: the learner's updates/s over the run's last 200 s (scripts/lab_row.py) against the bench's real-loop
# steps/s (bar: >= 80 %); GPU utilisation (>= 80 % mean); the run's end within 60 s of the limit with summary.json
# and a final evaluation of >= 8 episodes (printed below).
#
#   source .device/install.sh && bash scripts/device_host_bar.sh      # logs under $OUT
#
# A second call on the same warm machine (NAME=bar300b BENCH=0) runs it again with the compile caches that the
# first run left (inductor's, Triton's), as a user's second run on a host would, without the learner bench.
set -u
name=${NAME:-bar300}
out=${OUT:-/tmp/device_host_bar}
mkdir -p "$out"
nvidia-smi dmon -s u -d 5 > "$out/dmon.txt" 2>&1 < /dev/null &
dmon=$!
trap 'kill $dmon 2>/dev/null' EXIT
start=$(date +%s)
timeout -k 10 "${TRAIN_TIMEOUT:-400}" python3 -m rayzero train --config atari --out "/tmp/$name" --time-limit 300 \
    > "$out/train.out" 2> "$out/train.log"
rc=$?
echo "train: exit $rc after $(( $(date +%s) - start )) s (limit 300 s; the bar: ended by 360 s)"
kill "$dmon" 2>/dev/null
for f in metrics.jsonl summary.json learning_curve.png plan.json; do cp "/tmp/$name/$f" "$out/" 2>/dev/null; done
python3 scripts/lab_row.py "/tmp/$name" --dmon "$out/dmon.txt" --at 60,120,180,300
python3 -c "import json; s = json.load(open('/tmp/$name/summary.json')); print('summary: wall', round(s['wall_seconds']), 's, final eval', s['eval_return_mean'], 'over', s['eval_episodes'], 'episodes')" \
    2>&1 | tail -1
[ "${BENCH:-1}" = 1 ] && timeout "${BENCH_TIMEOUT:-200}" python3 -m rayzero.bench.learner --preset atari learner.background_compile=false \
    --json "$out/bench_learner.json" > "$out/bench_learner.txt" 2>&1
[ "${BENCH:-1}" = 1 ] && grep -v "A.L.E\|Stella\|pid=" "$out/bench_learner.txt" | tail -6
# Where the start went (the GPU idles until the first update): the inference actor's captures, the learner's compile.
grep -h "done (\|inference actor up\|inference actor.s start\|every role is up\|evaluation step alone\|followed eager\|where eager\|replays as one\|training stops" \
    "$out/train.log" | sed 's/^.*rayzero/rayzero/' | cut -c1-420
