"""Security: checkpoints never unpickle code, shared memory is owner-only and goes with its owner, a local Ray
keeps token auth and serves no unauthenticated API."""

import builtins
import json
import os
import stat
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import pytest
import torch

from rayzero.config import LearnerConfig, ModelConfig
from rayzero.learner import CheckpointError, Learner
from rayzero.learner import checkpoint as ckpt

MODEL = ModelConfig(kind="mlp", latent_dim=8, hidden=16, support_size=5)
LEARNER = LearnerConfig(batch_size=8, device="cpu")


class _Payload:
    """Unpickling this runs code: it writes `marker`."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return builtins.exec, (f"open({self.marker!r}, 'w').write('pwned')",)


def test_a_malicious_pickle_in_a_checkpoint_is_refused(tmp_path):
    learner = Learner(MODEL, LEARNER, (4,), 2)
    staging = ckpt.staging_dir(tmp_path, 0)
    learner.save(str(staging))
    path = ckpt.commit(tmp_path, staging, 0, {"learner_steps": 0, "env_steps": 0})
    marker = tmp_path / "pwned"
    torch.save({"optimizer": _Payload(str(marker)), "counters": {}, "rng": torch.get_rng_state()},
               path / "optimizer.pt")
    with pytest.raises(CheckpointError, match="no valid checkpoint.*optimizer.pt is corrupt"):
        ckpt.latest(tmp_path)  # the checksum catches the swap
    sums_path = path / ckpt.CHECKSUMS  # an attacker who rewrites the checksums too
    sums = json.loads(sums_path.read_text())
    sums["sha256"]["optimizer.pt"] = ckpt._sha256(path / "optimizer.pt")
    sums_path.write_text(json.dumps(sums))
    assert ckpt.latest(tmp_path) == path
    with pytest.raises(CheckpointError, match="optimizer.pt refused, it is not a weights-only torch file"):
        Learner(MODEL, LEARNER, (4,), 2).load(str(path))
    assert not marker.exists()


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_shared_memory_is_owner_only_and_goes_with_its_owner():
    from rayzero.inference import channel
    from rayzero import shm as shared

    class Owner:
        pass

    before = set(os.listdir("/dev/shm"))
    old_umask = os.umask(0)  # the mode must not depend on the umask
    try:
        owner = Owner()
        arrays, paths = shared.create(owner, {"obs": ((4, 3), np.dtype(np.uint8))})
        made = channel.create("client", 4, 2, (3,), np.dtype(np.float32), 2)
    finally:
        os.umask(old_umask)
    assert made is not None
    server_channel, channel_paths = made
    for path in [*paths.values(), *channel_paths.values()]:
        assert _mode(path) == 0o600, (path, oct(_mode(path)))
    assert set(os.listdir("/dev/shm")) == before  # names are unlinked at once: nothing outlives the processes
    arrays["obs"][:] = 7
    assert shared.open_readonly(paths["obs"]).sum() == 7 * 12
    del owner
    del server_channel, made
    for path in [*paths.values(), *channel_paths.values()]:
        assert not os.path.exists(path)  # the descriptors closed with their owner


def _listeners(node) -> set[tuple[str, int]]:
    """(host, port) of every TCP socket that the processes of this Ray session listen on."""
    import psutil

    roots = [info.process.pid for infos in node.all_processes.values() for info in infos]
    procs = {p.pid: p for pid in roots for p in (psutil.Process(pid), *psutil.Process(pid).children(recursive=True))}
    out = set()
    for proc in procs.values():
        for conn in proc.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN:
                host = conn.laddr.ip if conn.laddr.ip not in ("0.0.0.0", "::") else "127.0.0.1"
                out.add((host, conn.laddr.port))
    return out


def _http_answers(listeners) -> dict[tuple[str, int], Any]:
    """What a plain GET / (no token) gets on each listener that answers HTTP (gRPC ones do not): the status, or
    'metrics' for a Prometheus exposition (read-only counters)."""
    import http.client

    answers: dict[tuple[str, int], Any] = {}
    for host, port in listeners:
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/", timeout=2) as response:
                answers[(host, port)] = "metrics" if response.read(6) in (b"# HELP", b"# TYPE") else response.status
        except urllib.error.HTTPError as error:
            answers[(host, port)] = error.code
        except (urllib.error.URLError, http.client.HTTPException, OSError):
            continue
    return answers


def test_a_local_ray_start_keeps_token_auth_and_no_api_without_it(monkeypatch):
    import ray
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    from rayzero.cluster import connect
    from rayzero.config import ClusterConfig

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    try:
        assert connect(ClusterConfig(num_cpus=1)) == "local"
        assert is_token_auth_enabled() and os.environ["RAY_AUTH_MODE"] == "token"
        node = ray._private.worker._global_node
        assert not node.address_info.get("webui_url")  # no dashboard, so no job API
        answers = _http_answers(_listeners(node))
        # What speaks HTTP asks for the token (the node agent's server: job agent, runtime envs), except the
        # read-only Prometheus metrics (Ray binds them to every interface; ray.init has no option to move them).
        assert answers and set(answers.values()) <= {401, "metrics"}, answers
    finally:
        ray.shutdown()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_shared_memory_of_a_killed_owner_is_gone():
    """SIGKILL runs no exit handler: the names were unlinked at creation, so nothing is left in /dev/shm."""
    import signal
    import subprocess
    import sys

    code = ("import sys, time, numpy as np\n"
            "from rayzero import shm as shared\n"
            "class Owner: pass\n"
            "owner = Owner()\n"
            "arrays, paths = shared.create(owner, {'obs': ((1024, 1024), np.dtype(np.uint8))})\n"
            "print(paths['obs'], flush=True)\n"
            "time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        path = child.stdout.readline().strip()
        assert path.startswith(f"/proc/{child.pid}/fd/") and _mode(path) == 0o600
        assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"rayzero-{child.pid}-")]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert not os.path.exists(path)
