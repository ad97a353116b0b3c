#!/usr/bin/env bash
# One device call of the Atari lab notebook (docs/benchmarks.md): a run as a user starts it, then what answers
# its questions: the notebook row (scripts/lab_row.py) and the search probe on its final checkpoint.
#
#   source .device/install.sh && bash scripts/device_pong.sh NAME TIME_LIMIT [--env ALE/Breakout-v5] [section.field=value ...]
#
# Everything lands in $OUT: train.out/.log, metrics.jsonl, summary.json, learning_curve.png, dmon.txt,
# run.tgz (the newest checkpoint's weights, config and plan: at most 8 files come back), probe.json (PROBE_DEVICE=cpu for a try on a CPU), agent.gif (GIF=1). A run of TIME_LIMIT s takes about TIME_LIMIT + 60 s, the probe up to 90 s more.
# A bar run (TIME_LIMIT 540) fits a 600 s call: its final evaluation ends by the limit, then ~2-10 s of checkpoint
# (~15 s of install before). TRAIN_TIMEOUT=584 PROBE=0 still ends it in time if it overran (SIGTERM starts rayzero's clean end, final evaluation included; -k 10 kills what is left
# 10 s later), and metrics.jsonl and train.log are copied into $OUT every 10 s, so what it logged comes back.
set -u
name=$1 limit=$2
shift 2
out=${OUT:-/tmp/$name.out}
mkdir -p "$out"
rm -rf "/tmp/$name"  # this script's run dir: a NAME used before on a warm machine starts afresh
# The two watchers let go of this script's stdout and stderr (a caller's `| tail` would otherwise wait for them
# past the end: run 19's call ran into the call's limit so) and stop when the script does.
nvidia-smi dmon -s u -d 5 > "$out/dmon.txt" 2>&1 < /dev/null &
watchers=$!
(while sleep 10; do cp "/tmp/$name/metrics.jsonl" "$out/" 2>/dev/null; done) > /dev/null 2>&1 < /dev/null &
watchers="$watchers $!"
trap 'kill $watchers 2>/dev/null' EXIT
timeout -k 10 "${TRAIN_TIMEOUT:-$((limit + 90))}" python3 -m rayzero train --config "${CONFIG:-atari}" --out "/tmp/$name" --time-limit "$limit" "$@" \
    > "$out/train.out" 2> "$out/train.log"
for f in metrics.jsonl summary.json learning_curve.png; do cp "/tmp/$name/$f" "$out/" 2>/dev/null; done
# The newest checkpoint's weights (not its GBs of replay) and the plan, as one file (the device tool brings back
# at most 8): `mkdir DIR && tar xzf run.tgz -C DIR` makes a run dir that `rayzero eval --checkpoint DIR --gif
# agent.gif` plays on any machine.
if [ -e "/tmp/$name/checkpoints/latest" ]; then
    step=$(cat "/tmp/$name/checkpoints/latest")
    tar czf "$out/run.tgz" -C "/tmp/$name" config.yaml plan.json checkpoints/latest \
        "checkpoints/$step/model.safetensors" "checkpoints/$step/state.json" "checkpoints/$step/checksums.json"
fi
python3 scripts/lab_row.py "/tmp/$name" --dmon "$out/dmon.txt" --at "60,120,180,300,$limit"
[ "${PROBE:-1}" = 1 ] && timeout 90 python3 scripts/search_probe.py --checkpoint "/tmp/$name" --device "${PROBE_DEVICE:-cuda}" --envs 16 --steps 200 --every 20 \
    --json "$out/probe.json" 2>&1 | grep -v "A.L.E\|Stella"
# GIF=1: one greedy game of the final checkpoint as $out/agent.gif (a run that ended cleanly has one).
if [ "${GIF:-0}" = 1 ] && [ -e "/tmp/$name/checkpoints/latest" ]; then
    timeout "${GIF_TIMEOUT:-150}" python3 -m rayzero eval --checkpoint "/tmp/$name" --episodes 1 --device cuda \
        --gif "$out/agent.gif" 2>&1 | grep -v "A.L.E\|Stella" | tail -3
fi
# What the log says about the final evaluation's reserve (the step timed alone, when training stopped), the
# compiled step (the compile check, learner.compile_check_steps), the helper and the eager step's graph
# (learner.step_graph).
grep -h "inference actor up\|inference actor.s start\|colocated learner built\|every role is up\|evaluation step alone\|training stops\|compiled step\|helpers compiled\|helpers were done\|helpers started\|helper process failed\|background compile (\|helpers' cache\|torch.compile\|CUDA graph" "$out/train.log" | sed 's/^.*rayzero/rayzero/' | cut -c1-400 | head -24
tail -2 "$out/train.log"
