#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Submit `rayzero train` to a running Ray cluster as a Ray job (ray job submit).
#
# Usage: deploy/local/submit.sh [--no-wait] [--submission-id ID] [--address URL] -- TRAIN_ARGS...
#        deploy/local/submit.sh TRAIN_ARGS...            (no options: every argument goes to `rayzero train`)
#
# Examples:
#   deploy/local/submit.sh -- --config cartpole --out /tmp/rayzero-runs/cartpole --time-limit 600
#   deploy/local/submit.sh --no-wait -- --config atari --env ALE/Pong-v5 --out s3://bucket/runs/pong
#
# The repository is shipped as the job's working_dir (code and configs; .venv, runs/, .git, ... are
# excluded). rayzero itself and its dependencies must already be installed in the cluster's Python
# environment (true for the local cluster and for the deploy/Dockerfile image), so the runtime_env
# carries no pip packages. Set RAYZERO_SHIP_CODE=1 to also ship src/rayzero as a py_module, so the
# cluster runs this checkout's Python code instead of the installed copy.
#
# The job's current directory is a temporary copy of the repo: a relative --out is turned into an
# absolute path here (meaningful for a cluster on this machine; use a URI or a shared filesystem path
# for remote clusters).
#
# Environment: RAYZERO_DASHBOARD_ADDRESS (Jobs API, default http://127.0.0.1:8265),
#              RAYZERO_DRY_RUN=1 prints the `ray job submit` command instead of running it.
set -euo pipefail

# shellcheck source=_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

wait_flag=()
submission_id=""
address="${RAYZERO_DASHBOARD_ADDRESS}"
train_args=()

if [[ " $* " == *" -- "* ]]; then
  while (( $# > 0 )); do
    case "$1" in
      --no-wait) wait_flag=(--no-wait); shift ;;
      --submission-id) submission_id="${2:?--submission-id needs a value}"; shift 2 ;;
      --address) address="${2:?--address needs a value}"; shift 2 ;;
      --) shift; break ;;
      *) rz_die "unknown option '$1' (options go before --, training arguments after it)" ;;
    esac
  done
fi
train_args=("$@")
(( ${#train_args[@]} > 0 )) || rz_die "no training arguments; e.g. $0 -- --config cartpole --out /tmp/rayzero-runs/cp"

# Make a relative --out absolute (the job runs in a temporary copy of the repo).
for (( i = 0; i < ${#train_args[@]}; i++ )); do
  if [[ "${train_args[i]}" == "--out" && $(( i + 1 )) -lt ${#train_args[@]} ]]; then
    out="${train_args[i + 1]}"
    if [[ "${out}" != /* && "${out}" != *://* ]]; then
      train_args[i + 1]="${PWD}/${out}"
      echo "note: --out ${out} -> ${train_args[i + 1]}" >&2
    fi
  fi
done

if [[ -z "${submission_id}" ]]; then
  submission_id="rayzero-$(date +%Y%m%d-%H%M%S)-${RANDOM}"
fi

excludes='".git/", ".venv/", "venv/", "runs/", ".device/", "**/__pycache__/", "*.egg-info/", ".pytest_cache/", ".ruff_cache/", "build/", "dist/", ".whl/", "*.pyc"'
if [[ "${RAYZERO_SHIP_CODE:-0}" == "1" ]]; then
  runtime_env="{\"excludes\": [${excludes}], \"py_modules\": [\"${RAYZERO_REPO_ROOT}/src/rayzero\"]}"
else
  runtime_env="{\"excludes\": [${excludes}]}"
fi

cmd=(ray job submit
  --address "${address}"
  --submission-id "${submission_id}"
  --working-dir "${RAYZERO_REPO_ROOT}"
  --runtime-env-json "${runtime_env}"
  "${wait_flag[@]}"
  -- rayzero train "${train_args[@]}")

if [[ "${RAYZERO_DRY_RUN:-0}" == "1" ]]; then
  printf '%s\n' "${cmd[@]}"
  exit 0
fi

rz_need_ray
mkdir -p "${RAYZERO_STATE_DIR}"
echo "${submission_id}" >"${RAYZERO_STATE_DIR}/last_submission_id"
echo "Submitting ${submission_id} to ${address}" >&2
exec "${cmd[@]}"
