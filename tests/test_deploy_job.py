"""End to end: a real two-node Ray cluster on this machine (deploy/local/start.sh), a training run sent
with `ray job submit` (deploy/local/submit.sh), outputs checked, cluster stopped (deploy/local/stop.sh).

Isolation from other Ray instances of the test suite or the machine:
- its own free ports and its own --temp-dir under /tmp (so no /tmp/ray/ray_current_cluster entry that a
  plain `ray.init()` elsewhere could pick up);
- its own token in RAY_AUTH_TOKEN (token auth on; ~/.ray/auth_token is not touched);
- teardown with stop.sh, which stops only the processes of this cluster (`ray stop` would kill every Ray
  process on the machine, including other tests' clusters); `ray stop` is never called here.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="uses setsid and /proc")]

REPO = Path(__file__).resolve().parents[1]
LOCAL = REPO / "deploy" / "local"
BIN = Path(sys.executable).parent

# The run: the cartpole preset on the 2 CPUs of this cluster, one minute of training.
TRAIN_ARGS = ["--config", "cartpole", "--time-limit", "60", "run.eval_episodes=2"]
JOB_TIMEOUT_S = 360


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _live_processes_mentioning(text: str) -> list[tuple[int, str]]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state != "Z" and text in cmdline:
            found.append((int(entry.name), cmdline[:200]))
    return found


def _run(args: list[str], env: dict, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, check=False,
                          **kwargs)


@pytest.fixture(scope="module")
def cluster():
    if not (BIN / "ray").exists() or shutil.which("setsid") is None:
        pytest.skip("needs the ray CLI next to this Python and setsid")
    temp_dir = tempfile.mkdtemp(prefix="rzjob-", dir="/tmp")  # short: Ray's socket paths live under it
    ports = {"RAYZERO_RAY_PORT": _free_port(), "RAYZERO_DASHBOARD_PORT": _free_port(),
             "RAYZERO_CLIENT_PORT": _free_port()}
    env = {key: value for key, value in os.environ.items()
           if key not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
    env.update({key: str(value) for key, value in ports.items()})
    env.update({
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAYZERO_RAY_TEMP_DIR": temp_dir,
        "RAYZERO_STATE_DIR": os.path.join(temp_dir, "state"),
        "RAYZERO_HEAD_CPUS": "1",
        "RAYZERO_WORKER_CPUS": "1",
        "RAYZERO_OBJECT_STORE_BYTES": str(500 * 2**20),
    })
    address = f"http://127.0.0.1:{ports['RAYZERO_DASHBOARD_PORT']}"
    try:
        start = time.monotonic()
        result = _run([str(LOCAL / "start.sh"), "1"], env, timeout=240)
        startup_s = time.monotonic() - start
        assert result.returncode == 0, result.stdout + result.stderr
        print(f"\ncluster (head + 1 worker node) started in {startup_s:.1f}s")
        yield {"env": env, "address": address, "temp_dir": temp_dir, "startup_s": startup_s}
    finally:
        stop = _run([str(LOCAL / "stop.sh")], env, timeout=120)
        leftovers = _live_processes_mentioning(temp_dir + "/")
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert not leftovers, f"stop.sh left processes behind: {leftovers}"


def _ray(cluster, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return _run([str(BIN / "ray"), *args], cluster["env"], timeout=timeout)


def test_cluster_has_two_nodes_and_runs_a_job(cluster):
    """The mechanics alone, with a trivial entrypoint: auth, job submission, the driver's environment."""
    script = ("import os, ray; ray.init(); "
              "alive = [n for n in ray.nodes() if n['Alive']]; "
              "print('NODES', len(alive), 'CPU', ray.cluster_resources().get('CPU'), "
              "'RAY_ADDRESS' in os.environ)")
    result = _ray(cluster, "job", "submit", "--address", cluster["address"], "--", sys.executable, "-c", script,
                  timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "NODES 2 CPU 2.0 True" in result.stdout, result.stdout


def test_cluster_rejects_a_wrong_token(cluster):
    env = {**cluster["env"], "RAY_AUTH_TOKEN": "0" * 64}
    result = _run([str(BIN / "ray"), "job", "list", "--address", cluster["address"]], env, timeout=60)
    assert result.returncode != 0
    assert "token" in (result.stdout + result.stderr).lower()


@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_training_job_writes_summary_and_checkpoint(cluster, tmp_path):
    out = tmp_path / "run"
    submission_id = f"rzjob-test-{secrets.token_hex(4)}"
    start = time.monotonic()
    try:
        result = _run([str(LOCAL / "submit.sh"), "--submission-id", submission_id, "--", *TRAIN_ARGS,
                       "--out", str(out)], cluster["env"], timeout=JOB_TIMEOUT_S, cwd=REPO)
    except subprocess.TimeoutExpired:
        logs = _ray(cluster, "job", "logs", "--address", cluster["address"], submission_id)
        _ray(cluster, "job", "stop", "--address", cluster["address"], submission_id)
        pytest.fail(f"job did not finish in {JOB_TIMEOUT_S}s; its logs:\n{logs.stdout[-6000:]}")
    print(f"\ntraining job finished in {time.monotonic() - start:.1f}s")
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]

    status = _ray(cluster, "job", "status", "--address", cluster["address"], submission_id)
    assert f"job '{submission_id}' succeeded" in (status.stdout + status.stderr).lower()

    summary = json.loads((out / "summary.json").read_text())
    assert summary, "empty summary.json"
    assert (out / "config.yaml").exists()
    latest = out / "checkpoints" / "latest"
    assert latest.exists(), sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    checkpoint = out / "checkpoints" / latest.read_text().strip()
    assert (checkpoint / "model.safetensors").is_file()
