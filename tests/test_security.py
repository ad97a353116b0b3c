"""Security: checkpoints never unpickle code, shared memory is owner-only and goes with its owner."""

import builtins
import json
import os
import stat

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
    from rayzero.replay import shared

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
