# shellcheck shell=bash
# Shared settings for the deploy/local scripts (sourced, not executed).
#
# Every value can be overridden from the environment:
#   RAYZERO_RAY_PORT        GCS port of the head node                    (default 6379)
#   RAYZERO_DASHBOARD_PORT  dashboard / Jobs API port of the head node   (default 8265)
#   RAYZERO_CLIENT_PORT     Ray Client server port of the head node      (default 10001)
#   RAYZERO_RAY_TEMP_DIR    Ray --temp-dir for every node of the cluster (default /tmp/rayzero-local)
#                           Keep it short: Ray puts unix sockets under it (path limit ~107 chars).
#   RAYZERO_DASHBOARD_ADDRESS  Jobs API address used by submit/logs (default http://127.0.0.1:$RAYZERO_DASHBOARD_PORT)
#   RAYZERO_STATE_DIR       where submit.sh remembers the last submission id (default ~/.cache/rayzero)
#
# Token authentication stays on: every Ray CLI call below runs with RAY_AUTH_MODE=token and reads
# the token from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token (in that order).

export RAY_AUTH_MODE=token
export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}"

RAYZERO_RAY_PORT="${RAYZERO_RAY_PORT:-6379}"
RAYZERO_DASHBOARD_PORT="${RAYZERO_DASHBOARD_PORT:-8265}"
RAYZERO_CLIENT_PORT="${RAYZERO_CLIENT_PORT:-10001}"
RAYZERO_RAY_TEMP_DIR="${RAYZERO_RAY_TEMP_DIR:-/tmp/rayzero-local}"
RAYZERO_DASHBOARD_ADDRESS="${RAYZERO_DASHBOARD_ADDRESS:-http://127.0.0.1:${RAYZERO_DASHBOARD_PORT}}"
RAYZERO_STATE_DIR="${RAYZERO_STATE_DIR:-${HOME}/.cache/rayzero}"

# Repository root (deploy/local/../..).
RAYZERO_REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

# Prefer the project's virtualenv when the caller has not activated one.
if ! command -v ray >/dev/null 2>&1 && [[ -x "${RAYZERO_REPO_ROOT}/.venv/bin/ray" ]]; then
  export PATH="${RAYZERO_REPO_ROOT}/.venv/bin:${PATH}"
fi

rz_die() {
  echo "error: $*" >&2
  exit 1
}

rz_need_ray() {
  command -v ray >/dev/null 2>&1 || rz_die "the 'ray' CLI is not on PATH (activate the project's virtualenv)"
}

# Make sure a token exists for the CLI and the cluster processes.
rz_ensure_token() {
  if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then
    return 0
  fi
  if [[ -n "${RAY_AUTH_TOKEN_PATH:-}" ]]; then
    [[ -s "${RAY_AUTH_TOKEN_PATH}" ]] || rz_die "RAY_AUTH_TOKEN_PATH=${RAY_AUTH_TOKEN_PATH} is missing or empty"
    return 0
  fi
  if [[ ! -s "${HOME}/.ray/auth_token" ]]; then
    echo "Generating a Ray auth token in ~/.ray/auth_token" >&2
    ray get-auth-token --generate >/dev/null
  fi
}
