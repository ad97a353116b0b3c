# shellcheck shell=bash
# Sourced by the device scripts, which set $out: `probe NAME TIMEOUT ARGS...` runs scripts/consistency_probe.py
# on CUDA under its own time limit, logs to $out/probe_NAME.txt and prints its per-step line (gradient norm,
# cosine) and any error.
# shellcheck disable=SC2154  # $out: the sourcing script's log directory
probe() {
    local name=$1 limit=$2
    shift 2
    timeout "$limit" python3 scripts/consistency_probe.py --device cuda --steps 12 --every 1 "$@" \
        > "$out/probe_$name.txt" 2>&1
    echo "== $name"
    grep "step " "$out/probe_$name.txt" | sed 's/^.*: step/step/' | tr '\n' ' ' | cut -c1-600; echo
    grep -m1 "Error" "$out/probe_$name.txt"
}
