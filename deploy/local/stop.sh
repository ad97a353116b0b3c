#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Stop the local cluster started by deploy/local/start.sh.
#
# Usage: deploy/local/stop.sh          stop only this cluster (the Ray processes of RAYZERO_RAY_TEMP_DIR)
#        deploy/local/stop.sh --all    `ray stop --force`: kills EVERY Ray process on this machine,
#                                      including other clusters and ray.init() sessions of other programs
#
# `ray stop` cannot be scoped to one cluster, so the default mode finds this cluster's processes
# itself: start.sh runs each `ray start` in a fresh session (setsid), and every daemon of a node
# keeps that session id. We stop all processes of the sessions whose daemons mention our temp dir,
# plus their descendants (job drivers run in sessions of their own under the job supervisor).
set -euo pipefail

# shellcheck source=_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

if [[ "${1:-}" == "--all" ]]; then
  rz_need_ray
  exec ray stop --force
fi
[[ $# -eq 0 ]] || rz_die "usage: $0 [--all]"

# Alive = exists and is not a zombie waiting to be reaped by its parent.
rz_alive() {
  local state
  state="$(ps -o stat= -p "$1" 2>/dev/null)" || return 1
  [[ -n "${state}" && "${state}" != Z* ]]
}

# Selection, in one pass over the process table:
#  1. roots: processes whose command line names the temp dir (GCS, raylets, dashboard, monitors);
#  2. their descendants (agents, workers, job supervisors and drivers);
#  3. every member of a session that holds roots, when that session is one `ray start` created
#     (its leader has exited) and holds nothing but this cluster's processes and its Ray Client server
#     (the one daemon whose command line does not name the temp dir).
# This script and its own children (ps and awk name the temp dir too) are never selected.
mapfile -t pids < <(
  ps -eo pid=,ppid=,sid=,stat=,args= | awk -v td="${RAYZERO_RAY_TEMP_DIR}/" -v self=$$ '
    {
      pid = $1; ppid[pid] = $2; sid[pid] = $3; stat[pid] = $4
      if (index($0, td)) root[pid] = 1
      if ($0 ~ /ray\.util\.client\.server/) client[pid] = 1
    }
    function close_over(set,   p, changed) {
      do {
        changed = 0
        for (p in ppid) if (!(p in set) && !(p in mine) && (ppid[p] in set)) { set[p] = 1; changed = 1 }
      } while (changed)
    }
    END {
      mine[self] = 1
      do {
        changed = 0
        for (p in ppid) if (!(p in mine) && (ppid[p] in mine)) { mine[p] = 1; changed = 1 }
      } while (changed)
      for (p in root) if (!(p in mine)) sel[p] = 1
      close_over(sel)
      for (p in sel) cand[sid[p]] = 1
      for (s in cand) {
        if (s + 0 <= 1 || ((s in stat) && stat[s] !~ /^Z/)) continue   # leader alive: a shell, not ours
        ok = 1
        for (p in sid) if (sid[p] == s && !(p in sel) && !(p in client) && !(p in mine)) ok = 0
        if (ok) for (p in sid) if (sid[p] == s && !(p in mine)) sel[p] = 1
      }
      close_over(sel)
      for (p in sel) print p
    }'
)

if (( ${#pids[@]} == 0 )); then
  echo "No Ray processes of ${RAYZERO_RAY_TEMP_DIR} are running."
  exit 0
fi

echo "Stopping ${#pids[@]} processes of the cluster in ${RAYZERO_RAY_TEMP_DIR}"
kill -TERM "${pids[@]}" 2>/dev/null || true
alive=()
for _ in $(seq 1 20); do
  alive=()
  for pid in "${pids[@]}"; do
    if rz_alive "${pid}"; then alive+=("${pid}"); fi
  done
  (( ${#alive[@]} == 0 )) && break
  sleep 0.5
done
if (( ${#alive[@]} > 0 )); then
  echo "Force-killing ${#alive[@]} processes still running after SIGTERM:" \
    "$(ps -o comm= -p "$(IFS=,; echo "${alive[*]}")" | tr '\n' ' ')"
  kill -KILL "${alive[@]}" 2>/dev/null || true
  # SIGKILL is not instantaneous either: wait (up to 10 s) until the processes are gone, so that a caller that
  # checks right after this script sees none of them.
  for _ in $(seq 1 20); do
    still=()
    for pid in "${alive[@]}"; do
      if rz_alive "${pid}"; then still+=("${pid}"); fi
    done
    (( ${#still[@]} == 0 )) && break
    sleep 0.5
  done
fi
echo "Stopped."
