#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Start a multi-node Ray cluster on this machine: one head node plus N worker nodes, with
# Ray token authentication on. Mimics the cloud layout: by default the head advertises 0 CPUs,
# so the job driver runs there but actors land on the worker nodes.
#
# Usage: deploy/local/start.sh [NUM_WORKERS]          (default 2)
#
# Environment (besides the ones in _common.sh):
#   RAYZERO_HEAD_CPUS          CPUs advertised by the head                (default 0)
#   RAYZERO_WORKER_CPUS        CPUs advertised by each worker node        (default nproc / NUM_WORKERS, at least 1)
#   RAYZERO_WORKER_GPUS        GPUs advertised by each worker node        (default: Ray autodetects)
#   RAYZERO_OBJECT_STORE_BYTES object store size of every node            (default: Ray's default)
#
# Then: deploy/local/submit.sh -- --config cartpole --out /tmp/rayzero-runs/cartpole
#       deploy/local/logs.sh
#       deploy/local/stop.sh
set -euo pipefail

# shellcheck source=_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

num_workers="${1:-2}"
[[ "${num_workers}" =~ ^[0-9]+$ ]] || rz_die "NUM_WORKERS must be a non-negative integer, got '${num_workers}'"

rz_need_ray
rz_ensure_token

head_cpus="${RAYZERO_HEAD_CPUS:-0}"
if [[ -n "${RAYZERO_WORKER_CPUS:-}" ]]; then
  worker_cpus="${RAYZERO_WORKER_CPUS}"
elif (( num_workers > 0 )); then
  worker_cpus=$(( $(nproc) / num_workers ))
  (( worker_cpus >= 1 )) || worker_cpus=1
else
  worker_cpus=0
fi

common_args=(--temp-dir="${RAYZERO_RAY_TEMP_DIR}" --disable-usage-stats
  # Several nodes share this machine: let each dashboard agent pick a free port.
  --dashboard-agent-listen-port=0)
if [[ -n "${RAYZERO_OBJECT_STORE_BYTES:-}" ]]; then
  common_args+=(--object-store-memory="${RAYZERO_OBJECT_STORE_BYTES}")
fi
worker_gpu_args=()
if [[ -n "${RAYZERO_WORKER_GPUS:-}" ]]; then
  worker_gpu_args=(--num-gpus="${RAYZERO_WORKER_GPUS}")
fi

mkdir -p "${RAYZERO_RAY_TEMP_DIR}"
start_s=${SECONDS}

# Each `ray start` runs in its own session (setsid), so stop.sh can stop exactly this cluster's
# processes instead of every Ray process on the machine.
echo "Starting head: GCS port ${RAYZERO_RAY_PORT}, dashboard ${RAYZERO_DASHBOARD_ADDRESS}, ${head_cpus} CPUs"
setsid -w ray start --head \
  --port="${RAYZERO_RAY_PORT}" \
  --dashboard-host=127.0.0.1 \
  --dashboard-port="${RAYZERO_DASHBOARD_PORT}" \
  --ray-client-server-port="${RAYZERO_CLIENT_PORT}" \
  --num-cpus="${head_cpus}" \
  "${common_args[@]}" >"${RAYZERO_RAY_TEMP_DIR}/start-head.log" 2>&1 ||
  { cat "${RAYZERO_RAY_TEMP_DIR}/start-head.log" >&2; rz_die "ray start --head failed"; }

for (( i = 1; i <= num_workers; i++ )); do
  echo "Starting worker node ${i}/${num_workers}: ${worker_cpus} CPUs"
  setsid -w ray start --address="127.0.0.1:${RAYZERO_RAY_PORT}" \
    --num-cpus="${worker_cpus}" \
    "${worker_gpu_args[@]}" \
    "${common_args[@]}" >"${RAYZERO_RAY_TEMP_DIR}/start-worker-${i}.log" 2>&1 ||
    { cat "${RAYZERO_RAY_TEMP_DIR}/start-worker-${i}.log" >&2; rz_die "ray start for worker ${i} failed"; }
done

# Wait until every node shows up as alive in the cluster state (up to 60 s).
expected=$(( num_workers + 1 ))
alive=0
for _ in $(seq 1 60); do
  alive="$(ray list nodes --address "${RAYZERO_DASHBOARD_ADDRESS}" --filter "state=ALIVE" --format json \
    2>/dev/null | grep -o '"node_id"' | wc -l || true)"
  (( alive >= expected )) && break
  sleep 1
done
(( alive >= expected )) || echo "warning: ${alive} of ${expected} nodes are alive so far" >&2

echo "Cluster up in $(( SECONDS - start_s ))s: ${alive} nodes alive (head + ${num_workers} worker nodes)."
cat <<EOF

Status:         RAY_AUTH_MODE=token ray status --address=127.0.0.1:${RAYZERO_RAY_PORT}
Submit a run:   deploy/local/submit.sh -- --config cartpole --out /tmp/rayzero-runs/cartpole
Dashboard:      ${RAYZERO_DASHBOARD_ADDRESS}
CLI auth:       export RAY_AUTH_MODE=token   (token in ~/.ray/auth_token unless RAY_AUTH_TOKEN[_PATH] is set)
Stop:           deploy/local/stop.sh
EOF
