"""Learner: the loss learns a fixed batch, checkpoints restore exactly, corrupt files fail clearly."""

import numpy as np
import pytest
import torch

from rayzero.config import LearnerConfig, ModelConfig, ReplayConfig
from rayzero.learner import CheckpointError, Learner
from rayzero.learner import checkpoint as ckpt
from rayzero.replay import ReplayBuffer, Segment

MODEL = ModelConfig(kind="mlp", latent_dim=16, hidden=32, support_size=10)
LEARNER = LearnerConfig(batch_size=32, lr=3e-3, lr_warmup_steps=0, device="cpu")


def filled_replay(seed=0):
    rng = np.random.default_rng(seed)
    buffer = ReplayBuffer(ReplayConfig(capacity=1000, unroll_steps=3, td_steps=3, discount=0.9, min_size=0), seed)
    for _ in range(10):
        length = 30
        policies = rng.dirichlet(np.ones(2), size=length).astype(np.float32)
        buffer.add(Segment(
            obs=rng.normal(size=(length, 4)).astype(np.float32),
            actions=rng.integers(0, 2, size=length),
            rewards=rng.normal(size=length).astype(np.float32),
            policies=policies,
            root_values=rng.normal(size=length).astype(np.float32),
            num_sampleable=length, terminal=True, bootstrap_value=0.0,
        ))
    return buffer


def test_loss_falls_on_a_fixed_batch():
    learner = Learner(MODEL, LEARNER, (4,), 2, seed=0)
    batch = filled_replay().sample(32)
    first, _ = learner.step(batch)
    for _ in range(150):
        metrics, priorities = learner.step(batch)
    assert metrics["loss"] < 0.6 * first["loss"]
    assert priorities.shape == (32,) and np.all(priorities > 0)
    assert learner.steps == 151 and learner.samples == 151 * 32


def test_checkpoint_restores_counters_optimizer_and_continuation(tmp_path):
    replay = filled_replay()
    batches = [replay.sample(32) for _ in range(6)]
    learner = Learner(MODEL, LEARNER, (4,), 2, seed=0)
    for batch in batches[:3]:
        learner.step(batch)
    learner.version = 3
    staging = ckpt.staging_dir(tmp_path, learner.steps)
    learner.save(str(staging))
    path = ckpt.commit(tmp_path, staging, learner.steps, {"learner_steps": learner.steps, "env_steps": 0})
    assert ckpt.latest(tmp_path) == path

    resumed = Learner(MODEL, LEARNER, (4,), 2, seed=123)
    resumed.load(str(ckpt.latest(tmp_path)))
    assert resumed.counters() == learner.counters()
    for a, b in zip(learner.optimizer.state_dict()["state"].values(), resumed.optimizer.state_dict()["state"].values()):
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"], rtol=0, atol=0)
    # Training on from the checkpoint matches training straight through.
    for batch in batches[3:]:
        m1, _ = learner.step(batch)
        m2, _ = resumed.step(batch)
        assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-6)
    for p1, p2 in zip(learner.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p1, p2)


def test_missing_and_corrupt_checkpoints_fail_clearly(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        ckpt.latest(tmp_path)
    learner = Learner(MODEL, LEARNER, (4,), 2)
    staging = ckpt.staging_dir(tmp_path, 0)
    learner.save(str(staging))
    path = ckpt.commit(tmp_path, staging, 0, {"learner_steps": 0, "env_steps": 0})
    (path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="corrupt"):
        Learner(MODEL, LEARNER, (4,), 2).load(str(path))


def test_commit_is_atomic_and_prunes(tmp_path):
    learner = Learner(MODEL, LEARNER, (4,), 2)
    for step in range(5):
        staging = ckpt.staging_dir(tmp_path, step)
        learner.save(str(staging))
        ckpt.commit(tmp_path, staging, step, {"learner_steps": step, "env_steps": 0}, keep=3)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_00000002", "step_00000003", "step_00000004"]
    # A staging dir left by a crash is ignored by `latest`.
    ckpt.staging_dir(tmp_path, 99)
    assert ckpt.latest(tmp_path).name == "step_00000004"
