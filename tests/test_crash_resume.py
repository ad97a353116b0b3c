"""A driver killed with SIGKILL mid-run resumes from its last complete checkpoint; a corrupt newest checkpoint
is reported in one line and the previous one is used (through the CLI, on a real local Ray)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rayzero.learner import checkpoint as ckpt

pytestmark = pytest.mark.slow

SMALL = ["run.eval_episodes=1", "run.eval_max_steps=100", "run.stop_return=0", "replay.min_size=200",
         "learner.steps_per_call=10", "learner.checkpoint_interval=10", "run.log_interval=2"]


def _complete(run_dir) -> list:
    root = run_dir / ckpt.CHECKPOINTS
    return sorted(p for p in root.glob("step_*") if (p / ckpt.CHECKSUMS).exists()) if root.is_dir() else []


def test_a_sigkilled_driver_resumes_from_its_last_complete_checkpoint(tmp_path):
    log = open(tmp_path / "first.log", "w")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # Its own session, so the kill takes the local Ray the driver started along with it.
    driver = subprocess.Popen([sys.executable, "-m", "rayzero", "train", "--config", "cartpole", "--out",
                               str(tmp_path), "run.max_env_steps=10000000", *SMALL],
                              stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while len(_complete(tmp_path)) < 3 and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_complete(tmp_path)) >= 3, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
        log.close()
    assert not (tmp_path / "summary.json").exists()  # it never got to finish

    newest = ckpt.latest(tmp_path)
    previous = _complete(tmp_path)[-2] if newest == _complete(tmp_path)[-1] else None
    assert previous is not None
    model = newest / "model.safetensors"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])  # as if half-written
    state = ckpt.read_state(previous)
    result = subprocess.run([sys.executable, "-m", "rayzero", "train", "--config", "cartpole", "--out",
                             str(tmp_path), "--resume", f"run.max_env_steps={state['env_steps'] + 600}", *SMALL],
                            capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    warnings = [line for line in result.stderr.splitlines() if "model.safetensors is corrupt" in line]
    assert len(warnings) == 1 and str(previous) in warnings[0], result.stderr[-3000:]
    assert f"resumed from {previous}" in result.stderr  # the driver logs to stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["learner_steps_this_run"] > 0
    assert summary["learner_steps"] == state["learner_steps"] + summary["learner_steps_this_run"]
    assert summary["env_steps"] == state["env_steps"] + summary["env_steps_this_run"]
