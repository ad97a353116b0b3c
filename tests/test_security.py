"""Security: checkpoints never unpickle code."""

import builtins
import json
import os

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
