#!/usr/bin/env bash
# A run dir from what scripts/device_pong.sh brings back in weights/ (config.yaml, latest, and the newest
# checkpoint's model.safetensors, state.json, checksums.json), for `rayzero eval --checkpoint DIR`.
#
#   bash scripts/weights_to_run.sh /work/.device/N/weights /tmp/breakout_run
set -eu
src=$1 dir=$2
step=$(cat "$src/latest")
mkdir -p "$dir/checkpoints/$step"
cp "$src/config.yaml" "$dir/"
cp "$src/latest" "$dir/checkpoints/"
for f in model.safetensors state.json checksums.json; do cp "$src/$f" "$dir/checkpoints/$step/"; done
echo "$dir: checkpoint $step"
