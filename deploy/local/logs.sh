#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Follow the logs of a Ray job until it finishes.
#
# Usage: deploy/local/logs.sh [SUBMISSION_ID]    (default: the last job sent by submit.sh)
# Environment: RAYZERO_DASHBOARD_ADDRESS (Jobs API, default http://127.0.0.1:8265)
set -euo pipefail

# shellcheck source=_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

rz_need_ray
job_id="${1:-}"
if [[ -z "${job_id}" ]]; then
  [[ -s "${RAYZERO_STATE_DIR}/last_submission_id" ]] ||
    rz_die "no SUBMISSION_ID given and no job submitted by submit.sh yet"
  job_id="$(<"${RAYZERO_STATE_DIR}/last_submission_id")"
fi

ray job status --address "${RAYZERO_DASHBOARD_ADDRESS}" "${job_id}" || true
exec ray job logs --address "${RAYZERO_DASHBOARD_ADDRESS}" --follow "${job_id}"
