"""Learner: the loss learns a fixed batch, checkpoints restore exactly, corrupt files fail clearly."""

import dataclasses
import shutil
import time

import numpy as np
import pytest
import torch

from rayzero.config import ConfigError, LearnerConfig, ModelConfig, ReplayConfig
from rayzero.learner import CheckpointError, Learner
from rayzero.learner import checkpoint as ckpt
from rayzero.learner.learner import EAGER_BEFORE_GRAPH
from rayzero.learner.step_graph import StepGraph
from rayzero.models.support import support_to_scalar
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


def test_value_prefix_model_learns_and_search_reads_prefix_differences():
    """The value-prefix loss learns a fixed batch; in search a step's reward is its prefix minus the parent's,
    and the prefix restarts at the horizon."""
    from rayzero.learner.loss import value_prefix_targets
    from rayzero.models import build_model

    rewards = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])
    torch.testing.assert_close(value_prefix_targets(rewards, 2), torch.tensor([[0.0, 1.0, 3.0, 3.0, 7.0]]))

    cfg = ModelConfig(kind="mlp", latent_dim=16, hidden=32, support_size=10, value_prefix=True, lstm_hidden=8,
                      value_prefix_horizon=2)
    learner = Learner(cfg, LEARNER, (4,), 2, seed=0)
    batch = filled_replay().sample(32)
    first, _ = learner.step(batch)
    for _ in range(150):
        metrics, _ = learner.step(batch)
    assert metrics["loss"] < 0.6 * first["loss"] and metrics["reward_loss"] < 0.6 * first["reward_loss"]

    model = build_model(cfg, (4,), 2)
    model.load_state_dict(learner.model.state_dict())
    obs, actions = torch.randn(3, 4), torch.tensor([[0, 1, 1], [1, 1, 0], [0, 0, 1]])
    with torch.no_grad():
        out = model.initial(obs)
        assert out.latent.shape == (3, 16 + 2 * 8 + 2)
        rewards = []
        for k in range(3):
            out = model.recurrent(out.latent, actions[:, k])
            rewards.append(out.reward)
        # The same unroll through the training path: prefixes p1, p2, then (restart) p3.
        latent, state, prefixes = model.represent(obs), model.prefix_state(3, obs.device), []
        for k in range(3):
            latent = model.transition(latent, actions[:, k])
            logits, state = model.prefix_step(latent, state)
            prefixes.append(support_to_scalar(logits, cfg.support_size))
            if (k + 1) % 2 == 0:
                state = model.prefix_state(3, obs.device)
    torch.testing.assert_close(rewards[0], prefixes[0])
    torch.testing.assert_close(rewards[1], prefixes[1] - prefixes[0])
    torch.testing.assert_close(rewards[2], prefixes[2])
    assert not torch.allclose(prefixes[0], torch.zeros(3))  # the test is not vacuous


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


def test_a_checkpoint_copied_without_its_replay_and_optimizer_still_gives_its_weights(tmp_path):
    """`rayzero eval` needs the weights alone (ckpt.latest(..., files=(MODEL,))): a run's checkpoint copied off a
    machine without its replay snapshot (GBs) or optimizer plays; a corrupt copy of the weights still fails."""
    paths = _three_checkpoints(tmp_path)
    for name in ("replay.npz", "optimizer.pt"):
        (paths[-1] / name).unlink()
    assert ckpt.latest(tmp_path, files=(ckpt.MODEL,)) == paths[-1]
    assert ckpt.latest(tmp_path) == paths[-2]  # a resume needs everything: the newest complete one
    (paths[-1] / ckpt.MODEL).write_bytes(b"garbage")
    assert ckpt.latest(tmp_path, files=(ckpt.MODEL,)) == paths[-2]


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


def _three_checkpoints(tmp_path):
    learner = Learner(MODEL, LEARNER, (4,), 2)
    paths = []
    for step in range(3):
        staging = ckpt.staging_dir(tmp_path, step)
        learner.save(str(staging))
        (staging / "replay.npz").write_bytes(b"replay" * 100)
        paths.append(ckpt.commit(tmp_path, staging, step, {"learner_steps": step, "env_steps": 10 * step}))
    return paths


def test_a_truncated_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    from rayzero.train import check_resumable

    paths = _three_checkpoints(tmp_path)
    assert (paths[-1] / ckpt.CHECKSUMS).exists() and ckpt.latest(tmp_path) == paths[-1]
    optimizer = paths[-1] / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:100])  # half-written
    assert ckpt.latest(tmp_path) == paths[-2]
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "optimizer.pt" in lines[0] and str(paths[-2]) in lines[0], lines
    checkpoint, state = check_resumable(tmp_path)
    assert checkpoint == paths[-2] and state["env_steps"] == 10
    Learner(MODEL, LEARNER, (4,), 2).load(str(checkpoint))
    # A missing file counts too; a checkpoint dir named directly is checked without a fallback.
    (paths[-2] / "replay.npz").unlink()
    assert ckpt.latest(tmp_path) == paths[0]
    with pytest.raises(CheckpointError, match="optimizer.pt is corrupt"):
        ckpt.latest(paths[-1])


def test_all_checkpoints_corrupt_is_a_clear_error(tmp_path):
    paths = _three_checkpoints(tmp_path)
    for path in paths:
        (path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="no valid checkpoint") as error:
        ckpt.latest(tmp_path)
    assert str(error.value).count("model.safetensors is corrupt") == 3


def test_a_full_disk_during_a_commit_keeps_the_previous_checkpoint(tmp_path):
    """A file-size limit (as a full disk) fails the commit of step 1 with a CheckpointError that says why; its
    partial files are gone and step 0 stays the valid latest checkpoint."""
    import subprocess
    import sys

    code = f"""
import resource, signal
from rayzero.config import LearnerConfig, ModelConfig
from rayzero.learner import Learner, checkpoint as ckpt
learner = Learner(ModelConfig(kind="mlp", latent_dim=16, hidden=32, support_size=10),
                  LearnerConfig(batch_size=32, device="cpu"), (4,), 2)
for step in (0, 1):
    staging = ckpt.staging_dir({str(tmp_path)!r}, step)
    learner.save(str(staging))
    if step == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit then fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (16, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        ckpt.commit({str(tmp_path)!r}, staging, step, {{"learner_steps": step, "env_steps": 0}})
    except ckpt.CheckpointError as error:
        print(error)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "could not write checkpoint" in out.stdout and "File too large" in out.stdout, out.stdout
    assert "the previous checkpoint stays valid" in out.stdout
    assert ckpt.latest(tmp_path).name == "step_00000000"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_00000000"]
    Learner(MODEL, LEARNER, (4,), 2).load(str(ckpt.latest(tmp_path)))


# -- targets, options and the data path ------------------------------------------------------------------

def image_segments(seed=0, count=6, length=20, shape=(3, 16, 16), num_actions=3):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        yield Segment(
            obs=rng.integers(0, 256, size=(length, *shape), dtype=np.uint8),
            actions=rng.integers(0, num_actions, size=length),
            rewards=rng.normal(size=length).astype(np.float32),
            policies=rng.dirichlet(np.ones(num_actions), size=length).astype(np.float32),
            root_values=rng.normal(size=length).astype(np.float32),
            num_sampleable=length - 4, terminal=False, bootstrap_value=0.3,
        )


def test_bootstrap_obs_targets_add_up_to_the_stored_value_targets():
    cfg = ReplayConfig(capacity=500, unroll_steps=3, td_steps=4, discount=0.9, min_size=0)
    plain, split = ReplayBuffer(cfg), ReplayBuffer(ReplayConfig(**{**cfg.__dict__, "bootstrap_obs": True,
                                                                   "next_obs": True}))
    for s in image_segments():
        plain.add(s)
        split.add(s)
    index = np.arange(0, 120, 7)
    a = plain._targets(index, np.ones(len(index), np.float32))
    b = split._targets(index, np.ones(len(index), np.float32))
    stored = split._arrays["root_value"][b.bootstrap_index]
    np.testing.assert_allclose(b.target_values + b.bootstrap_scale * stored, a.target_values, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(b.bootstrap_obs, split._arrays["obs"][b.bootstrap_index])
    inside = b.next_mask[:, 0] == 1
    assert inside.sum() >= len(index) - 3
    np.testing.assert_array_equal(b.next_obs[inside, 0], split._arrays["obs"][index[inside] + 1])
    assert b.next_mask.shape == (len(index), 3) and set(np.unique(b.bootstrap_scale)) <= {0.0, np.float32(0.9**4)}


def test_sum_tree_sampling_follows_priorities_and_survives_restore(tmp_path):
    cfg = ReplayConfig(capacity=200, unroll_steps=1, td_steps=1, min_size=0, priority_alpha=0.5)
    buffer = ReplayBuffer(cfg, seed=0)
    for s in image_segments(count=5):
        buffer.add(s)
    batch = buffer.sample(64)
    buffer.update_priorities(batch.indices, batch.generations, np.linspace(0.1, 9.0, 64))
    weights = np.where(buffer._arrays["sampleable"], buffer._arrays["priority"] ** 0.5, 0.0)
    np.testing.assert_allclose(buffer.tree.total, weights.sum())
    counts = np.bincount(buffer.sample(200_000).indices, minlength=200) / 200_000
    np.testing.assert_allclose(counts, weights / weights.sum(), atol=4e-3)
    buffer.snapshot(tmp_path / "replay.npz")
    restored = ReplayBuffer(cfg, seed=0)
    restored.restore(tmp_path / "replay.npz")
    np.testing.assert_allclose(restored.tree.nodes, buffer.tree.nodes)


def test_shared_obs_are_gathered_by_the_learner_and_rewrites_are_dropped():
    from rayzero.learner.prefetch import ObsStore, Staging

    cfg = ReplayConfig(capacity=100, unroll_steps=2, td_steps=2, min_size=0, shared_obs=True, next_obs=True)
    buffer = ReplayBuffer(cfg, seed=0)
    for s in image_segments(count=5):
        buffer.add(s)
    store = ObsStore.open(buffer.obs_store(), threads=2)
    assert store is not None
    staging = Staging(torch.device("cpu"), store)
    batch = buffer.sample(40, with_obs=False)
    assert batch.obs is None and batch.next_obs is None
    item = staging.upload(batch)
    np.testing.assert_array_equal(item.tensors["obs"].numpy(), buffer._arrays["obs"][batch.indices])
    np.testing.assert_array_equal(item.tensors["next_obs"].numpy(), buffer._arrays["obs"][batch.next_index])
    assert item.stale == 0
    # A new segment overwrites the oldest one (ring wraps): samples from it come out with weight 0.
    buffer.add(next(image_segments(seed=9, count=1)))
    item = staging.upload(batch)
    rewritten = buffer._arrays["generation"][batch.indices] != batch.generations
    assert item.stale == rewritten.sum() > 0
    assert np.all(item.tensors["weights"].numpy()[rewritten] == 0)
    assert np.all(item.tensors["weights"].numpy()[~rewritten] == batch.weights[~rewritten])


def test_device_obs_cache_serves_sampled_positions_and_refreshes_rewritten_ones():
    from rayzero.learner.prefetch import ObsStore, Staging

    cfg = ReplayConfig(capacity=100, unroll_steps=2, td_steps=2, min_size=0, shared_obs=True, next_obs=True,
                       bootstrap_obs=True)
    buffer = ReplayBuffer(cfg, seed=0)
    for s in image_segments(count=5):
        buffer.add(s)
    store = ObsStore.open(buffer.obs_store(), threads=2)
    staging = Staging(torch.device("cpu"), store, obs_cache=True)  # the CUDA logic, on a CPU "device"
    obs = buffer._arrays["obs"]

    def check(batch, item):
        for name, index in (("obs", batch.indices), ("next_obs", batch.next_index),
                            ("bootstrap_obs", batch.bootstrap_index)):
            np.testing.assert_array_equal(item.tensors[name].numpy(), obs[index], err_msg=name)

    batch = buffer.sample(40, with_obs=False)
    item = staging.upload(batch)
    check(batch, item)
    first = staging.cache.uploaded
    assert item.stale == 0 and first > 0
    item = staging.upload(batch)  # the same positions again: all served from the cache
    check(batch, item)
    assert staging.cache.uploaded == first
    # New data overwrites the oldest segment: the old batch's samples there are stale (weight 0), and a fresh
    # batch gets the new observations, not the cached old ones.
    buffer.add(next(image_segments(seed=9, count=1)))
    item = staging.upload(batch)
    rewritten = buffer._arrays["generation"][batch.indices] != batch.generations
    assert item.stale == rewritten.sum() > 0
    assert np.all(item.tensors["weights"].numpy()[rewritten] == 0)
    for _ in range(5):
        fresh = buffer.sample(64, with_obs=False)
        check(fresh, staging.upload(fresh))


def test_frame_storage_through_the_shared_store_and_the_device_cache():
    """replay.frame_stack: the learner's gather from /dev/shm and the device cache restack the frames into the
    same observations the replay gives with observations attached."""
    from test_replay import stacked_segments

    from rayzero.learner.prefetch import ObsStore, Staging

    cfg = ReplayConfig(capacity=80, unroll_steps=2, td_steps=2, min_size=0, shared_obs=True, next_obs=True,
                       bootstrap_obs=True, frame_stack=4)
    buffer = ReplayBuffer(cfg, seed=0)
    for s in stacked_segments(np.random.default_rng(1)):
        buffer.add(s)
    for obs_cache in (False, True):
        store = ObsStore.open(buffer.obs_store(), threads=2)
        assert store.obs.shape[1:] == (3, 5, 5) and store.obs_shape == (12, 5, 5)
        staging = Staging(torch.device("cpu"), store, obs_cache=obs_cache)
        for _ in range(3):
            batch = buffer.sample(32, with_obs=False)
            item = staging.upload(batch)
            for name, index in (("obs", batch.indices), ("next_obs", batch.next_index),
                                ("bootstrap_obs", batch.bootstrap_index)):
                np.testing.assert_array_equal(item.tensors[name].numpy(), buffer.obs_at(index),
                                              err_msg=f"{name} cache={obs_cache}")


def blob_segments(seed=0, count=8, length=40, size=24, num_actions=4):
    """Segments of a bright square that each action moves (up, down, left, right; wrapping): the next frame is
    predictable from the frame and the action, which is what the consistency loss learns. The policy targets
    peak (0.85) on the action numbered by the square's quadrant, so a prior that reads the frame fits them."""
    rng = np.random.default_rng(seed)
    moves = np.array([(-3, 0), (3, 0), (0, -3), (0, 3)])[:num_actions]
    for _ in range(count):
        pos = rng.integers(0, size, size=2)
        actions = rng.integers(0, num_actions, size=length)
        obs = np.zeros((length, 3, size, size), dtype=np.uint8)
        policies = np.full((length, num_actions), 0.15 / (num_actions - 1), np.float32)
        for t in range(length):
            rows, cols = (pos[0] + np.arange(5)) % size, (pos[1] + np.arange(5)) % size
            obs[t][:, rows[:, None], cols[None, :]] = 255
            policies[t, (2 * (pos[0] >= size // 2) + (pos[1] >= size // 2)) % num_actions] = 0.85
            pos = (pos + moves[actions[t]]) % size
        yield Segment(obs=obs, actions=actions, rewards=np.zeros(length, np.float32), policies=policies,
                      root_values=np.zeros(length, np.float32), num_sampleable=length, terminal=True,
                      bootstrap_value=0.0)


BLOB_MODEL = ModelConfig(kind="resnet", channels=16, blocks=1, support_size=5, reduced_channels=4, head_hidden=16)


def consistency_after(learner_cfg, steps=150, seed=0):
    """(first policy loss, mean policy loss and consistency loss of the last 10 of `steps` updates) on blob
    batches."""
    replay = ReplayBuffer(ReplayConfig(capacity=2000, unroll_steps=3, td_steps=3, min_size=0, next_obs=True), seed)
    for s in blob_segments(seed):
        replay.add(s)
    learner = Learner(BLOB_MODEL, learner_cfg, (3, 24, 24), 4, seed=seed)
    metrics = [learner.step(replay.sample(learner_cfg.batch_size))[0] for _ in range(steps)]
    return (metrics[0]["policy_loss"], float(np.mean([m["policy_loss"] for m in metrics[-10:]])),
            float(np.mean([m["consistency_loss"] for m in metrics[-10:]])))


def test_consistency_loss_learns_to_predict_the_next_latent():
    """Known answer: the next frame follows from the frame and the action, so the predicted projection of the
    unrolled latent lines up with the projection of the real next observation (cosine towards 1)."""
    cfg = LearnerConfig(batch_size=32, lr=3e-3, lr_warmup_steps=0, device="cpu", compile=False,
                        consistency_weight=2.0, consistency_dim=32)
    first_policy, policy, consistency = consistency_after(cfg)
    assert consistency < -0.35  # about -0.5 after 150 steps, -0.8 after 300; untrained: about 0
    # ... while the prior still learns to read the frame (Pong runs 2 and 5 on a GPU: it stayed uniform).
    assert policy < first_policy - 0.5, (first_policy, policy)



def stacked_blob_segments(seed=0, stack=4):
    """blob_segments with frame-stacked observations as self-play sends them (zeros before the first frame)."""
    for s in blob_segments(seed):
        frames = np.concatenate([np.zeros((stack - 1, *s.obs.shape[1:]), np.uint8), s.obs])
        yield s._replace(obs=np.stack([frames[t:t + stack].reshape(-1, *s.obs.shape[2:]) for t in range(len(s.obs))]))


def consistency_through_a_replay_actor(learner_cfg, num_gpus=0, calls=5, steps=30):
    """Learner.train results on blob data held by a replay actor as Atari runs hold it (single frames in shared
    memory, restacked by the learner)."""
    import ray

    ray.init(address="local", num_cpus=2, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False)
    try:
        cfg = ReplayConfig(capacity=4000, unroll_steps=3, td_steps=3, min_size=0, next_obs=True, shared_obs=True,
                           frame_stack=4)
        replay = ray.remote(ReplayBuffer).remote(cfg, 0)
        ray.get([replay.add.remote(s) for s in stacked_blob_segments()])
        learner = Learner(BLOB_MODEL, learner_cfg, (12, 24, 24), 4, seed=0)
        return [learner.train(replay, steps) for _ in range(calls)]
    finally:
        ray.shutdown()


def test_consistency_loss_trains_through_a_replay_actor_and_the_observation_cache():
    cfg = LearnerConfig(batch_size=32, lr=3e-3, lr_warmup_steps=0, device="cpu", compile=False, obs_cache=True,
                        consistency_weight=2.0, consistency_dim=32)
    results = consistency_through_a_replay_actor(cfg)
    assert results[-1]["obs_path"] == "device_cache"
    assert results[-1]["consistency_loss"] < -0.35, [r["consistency_loss"] for r in results]

def test_random_shift_is_a_replicate_pad_and_a_random_crop():
    """Each image moves by its own offset in [-pad, pad]^2, uncovered pixels copy the edge, dtype stays: the same
    bits as torch's replicate padding followed by a crop at those offsets."""
    from torch.nn import functional as F

    from rayzero.learner.loss import random_shift

    images = torch.randint(0, 256, (16, 3, 10, 12), dtype=torch.uint8)
    shifted = random_shift(images, 2, torch.Generator().manual_seed(3))
    offsets = torch.randint(0, 5, (2, 16), generator=torch.Generator().manual_seed(3)) - 2
    assert shifted.dtype == torch.uint8 and shifted.shape == images.shape
    padded = F.pad(images.float(), (2, 2, 2, 2), mode="replicate")
    for i in range(16):
        dy, dx = 2 + int(offsets[0, i]), 2 + int(offsets[1, i])
        assert torch.equal(shifted[i].float(), padded[i, :, dy:dy + 10, dx:dx + 12]), i
    assert len({(int(a), int(b)) for a, b in offsets.T}) > 5  # offsets differ between images
    assert torch.equal(random_shift(images, 0), images)


def test_a_learner_with_random_shifts_trains_the_consistency_loss():
    """learner.shift_pixels on image batches: the step runs through the shifted root and next observations, and the
    consistency cosine still trains (the blob known-answer data of consistency_after)."""
    cfg = LearnerConfig(batch_size=32, lr=3e-3, lr_warmup_steps=0, device="cpu", consistency_weight=2.0,
                        consistency_dim=32, shift_pixels=2)
    first_policy, policy, consistency = consistency_after(cfg)
    assert consistency < -0.35 and policy < first_policy - 0.5, (first_policy, policy, consistency)
    images = torch.randint(0, 256, (8, 3, 24, 24), dtype=torch.uint8)
    seen = Learner(BLOB_MODEL, cfg, (3, 24, 24), 4, seed=0).loss_module._images(images)
    assert seen.shape == images.shape and not torch.equal(seen, images)  # the representation sees shifted images


def assert_same_steps(learner, resumed, batches):
    """Both learners take the same steps on `batches`: equal metrics and priorities, bit for bit."""
    for batch in batches:
        m1, p1 = learner.step(batch)
        m2, p2 = resumed.step(batch)
        assert m1 == m2
        np.testing.assert_array_equal(p1, p2)


def test_options_resume_exactly(tmp_path):
    """Target network, consistency heads, value prefix and NHWC: resuming from a checkpoint continues bit for
    bit."""
    model = ModelConfig(kind="resnet", channels=8, blocks=1, support_size=5, reduced_channels=2, head_hidden=8,
                        value_prefix=True, lstm_hidden=8)
    learner_cfg = LearnerConfig(batch_size=8, lr=1e-3, lr_warmup_steps=2, device="cpu", target_update_interval=2,
                                consistency_weight=1.0, consistency_dim=16, channels_last=True)
    replay = ReplayBuffer(ReplayConfig(capacity=500, unroll_steps=2, td_steps=2, min_size=0, bootstrap_obs=True,
                                       next_obs=True), seed=0)
    for s in image_segments():
        replay.add(s)
    batches = [replay.sample(8) for _ in range(6)]
    learner = Learner(model, learner_cfg, (3, 16, 16), 3, seed=0)
    for batch in batches[:3]:
        metrics, _ = learner.step(batch)
    assert metrics["consistency_loss"] < 0  # negative cosine similarity
    learner.save(str(tmp_path))
    resumed = Learner(model, learner_cfg, (3, 16, 16), 3, seed=5)
    resumed.load(str(tmp_path))
    assert_same_steps(learner, resumed, batches[3:])
    for t1, t2 in zip(learner.target.state_dict().values(), resumed.target.state_dict().values()):
        torch.testing.assert_close(t1, t2, rtol=0, atol=0)


def test_a_target_network_that_fails_to_compile_bootstraps_eagerly_with_the_same_values(monkeypatch):
    """The target network's bootstrap forward is compiled on its own; when the compiler fails on it, the step
    carries on eagerly and trains exactly as a learner that never compiled it."""
    def fake_compile(fn, mode="default", **kwargs):
        def run(*args):
            if fn is loss_lib.bootstrap_values:
                raise torch._dynamo.exc.BackendCompilerFailed(run, RuntimeError("no target graph here"), None)
            return fn(*args)
        return run

    from rayzero.learner import loss as loss_lib

    model = ModelConfig(kind="resnet", channels=8, blocks=1, support_size=5, reduced_channels=2, head_hidden=8)
    cfg = LearnerConfig(batch_size=8, lr=1e-3, lr_warmup_steps=2, device="cpu", target_update_interval=2)
    replay = ReplayBuffer(ReplayConfig(capacity=500, unroll_steps=2, td_steps=2, min_size=0, bootstrap_obs=True),
                          seed=0)
    for s in image_segments():
        replay.add(s)
    batches = [replay.sample(8) for _ in range(4)]
    reference = Learner(model, cfg, (3, 16, 16), 3, seed=0)
    expected = [reference.step(b)[0]["loss"] for b in batches]
    monkeypatch.setattr(torch, "compile", fake_compile)
    learner = Learner(model, LearnerConfig(**{**cfg.__dict__, "compile": True, "compile_mode": "default"}),
                      (3, 16, 16), 3, seed=0)
    assert learner._bootstrap.compiled is not None
    got = [learner.step(b)[0]["loss"] for b in batches]
    assert learner._bootstrap.compiled is None  # given up after the failure
    assert got == expected


def _consistency_learners():
    """(model, base learner settings, replay of image segments with bootstrap and next observations): a learner
    with a target network and the consistency loss, both side steps in use."""
    model = ModelConfig(kind="resnet", channels=8, blocks=1, support_size=5, reduced_channels=2, head_hidden=8)
    base = dict(batch_size=8, lr=1e-3, lr_warmup_steps=2, device="cpu", target_update_interval=2,
                consistency_weight=1.0, consistency_dim=16)
    replay = ReplayBuffer(ReplayConfig(capacity=500, unroll_steps=2, td_steps=2, min_size=0, bootstrap_obs=True,
                                       next_obs=True), seed=0)
    for s in image_segments():
        replay.add(s)
    return model, base, replay


@pytest.mark.parametrize("targets", ["separate", "step"])
def test_the_loss_compiled_as_regions_traces_one_unrolled_step_for_all_of_them_and_trains_as_eager(
        monkeypatch, targets):
    """learner.compile_regions: the root, one unrolled step and the consistency targets are compiled each on its
    own, so dynamo traces the step once for all K = 5 calls of every update, into a graph far smaller than the
    whole unrolled loss's; the updates are eager's. The backend here runs the traced graphs as they are."""
    graphs = []
    real_compile = torch.compile

    def tracing_compile(fn, **kwargs):  # torch.compile with a backend that records each graph it is given
        name = getattr(fn, "__name__", type(fn).__name__)

        def backend(gm, example_inputs):
            graphs.append((name, len(gm.graph.nodes)))
            return gm.forward
        return real_compile(fn, backend=backend, dynamic=False)

    model = ModelConfig(kind="resnet", channels=8, blocks=1, support_size=5, reduced_channels=2, head_hidden=8)
    replay = ReplayBuffer(ReplayConfig(capacity=500, unroll_steps=5, td_steps=2, min_size=0, next_obs=True), seed=0)
    for segment in image_segments(length=30):
        replay.add(segment)
    batches = [replay.sample(8) for _ in range(4)]
    base = dict(batch_size=8, lr=1e-3, lr_warmup_steps=0, device="cpu", consistency_weight=1.0, consistency_dim=16,
                consistency_targets=targets, compile_check_steps=0, compile_side_steps=False)
    reference = Learner(model, LearnerConfig(**base), (3, 16, 16), 3, seed=0)
    expected = [reference.step(b)[0] for b in batches]
    monkeypatch.setattr(torch, "compile", tracing_compile)
    whole = Learner(model, LearnerConfig(**base, compile=True), (3, 16, 16), 3, seed=0)
    whole.step(batches[0])
    (_, whole_nodes), = graphs
    graphs.clear()
    regions = Learner(model, LearnerConfig(**base, compile=True, compile_regions=True), (3, 16, 16), 3, seed=0)
    for batch, want in zip(batches, expected):
        got, _ = regions.step(batch)
        for name in ("loss", "policy_loss", "value_loss", "reward_loss", "consistency_loss", "grad_norm"):
            assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6), name
    assert regions.compile_state == "on:reduce-overhead"
    traced = [name for name, _ in graphs]
    assert traced.count("step_terms") == 1 and traced.count("root_terms") == 1, graphs
    assert traced.count("consistency_targets") == (1 if targets == "step" else 0), graphs
    # Five unrolled steps in the whole loss's graph against one in the regions'.
    assert sum(nodes for _, nodes in graphs) < 0.6 * whole_nodes, (graphs, whole_nodes)
    for a, b in zip(regions.model.state_dict().values(), reference.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_side_steps_stay_eager_when_asked_while_the_step_compiles(monkeypatch):
    compiled = []

    def recording_compile(fn, **kwargs):  # records what the learner compiles; runs it as it is
        compiled.append(getattr(fn, "__name__", type(fn).__name__))
        return fn

    model, base, replay = _consistency_learners()
    batches = [replay.sample(8) for _ in range(3)]
    reference = Learner(model, LearnerConfig(**base), (3, 16, 16), 3, seed=0)
    expected = [reference.step(b)[0]["loss"] for b in batches]
    monkeypatch.setattr(torch, "compile", recording_compile)
    learner = Learner(model, LearnerConfig(**base, compile=True, compile_side_steps=False), (3, 16, 16), 3, seed=0)
    assert compiled == ["MuZeroLoss"]  # the step only: the bootstraps and the consistency targets stay eager
    assert learner._bootstrap.compiled is None and learner._consistency_targets.compiled is None
    assert [learner.step(b)[0]["loss"] for b in batches] == expected
    compiled.clear()
    Learner(model, LearnerConfig(**base, compile=True), (3, 16, 16), 3, seed=0)
    assert sorted(compiled) == sorted(["MuZeroLoss", "bootstrap_values", "consistency_targets"])


def _background_learner():
    model, base, replay = _consistency_learners()
    reference = Learner(model, LearnerConfig(**base), (3, 16, 16), 3, seed=0)
    # aot_eager traces the step (graphs and autograd, as inductor gets them) without generating kernels: it
    # compiles in seconds and computes what eager does, so the updates must equal eager's exactly.
    cfg = LearnerConfig(**base, compile=True, compile_backend="aot_eager", background_compile=True)
    return reference, Learner(model, cfg, (3, 16, 16), 3, seed=0), replay


def _train_until_compiled(reference, learner, replay, timeout_s=240.0):
    states, deadline = [], time.monotonic() + timeout_s
    while not (learner.compile_state.startswith("on") and len(states) >= 2) and time.monotonic() < deadline:
        batch = replay.sample(8)
        assert learner.step(batch)[0]["loss"] == reference.step(batch)[0]["loss"]
        states.append(learner.compile_state)
        if learner.compile_state == "background":
            time.sleep(0.2)  # the helper compiles meanwhile
    return states


def test_background_compile_trains_eagerly_then_switches_to_the_compiled_step_with_the_same_updates():
    reference, learner, replay = _background_learner()
    assert learner.compile_state == "background" and learner._switch.compiled is None
    states = _train_until_compiled(reference, learner, replay)
    assert states[0] == "background" and states[-1] == "on:reduce-overhead", states
    assert learner.background_compile_s is not None
    # One helper compiled the step, one each side step (target network, consistency targets), all at once.
    assert [helper.returncode for helper in learner._background_helpers] == [0, 0, 0]
    assert learner._bootstrap.compiled is not None and learner._consistency_targets.compiled is not None
    # The weights the two learners reached are the same.
    for a, b in zip(learner.model.state_dict().values(), reference.model.state_dict().values()):
        assert torch.equal(a, b)


def _train_regions_first(reference, learner, replay, done, timeout_s=240.0):
    """Step a learner.regions_first learner beside an eager `reference` (every update must equal its) until
    `done(kind)` holds once the step it is on is compiled and checked; returns the kinds of step it trained on in
    turn ('eager', 'regions', 'whole')."""
    from rayzero.learner.loss import CompiledRegions

    kinds, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = replay.sample(8)
        assert learner.step(batch)[0]["loss"] == reference.step(batch)[0]["loss"]
        compiled = learner._switch.compiled
        kind = "eager" if compiled is None else "regions" if isinstance(compiled, CompiledRegions) else "whole"
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
        if done(kind) and learner.compile_state.startswith("on") and not learner._check_steps:
            break
        if learner._background or learner._whole_waiting:
            time.sleep(0.1)  # the helpers compile meanwhile
    return kinds


@pytest.fixture(scope="module")
def prewarmed():
    """(model, the regions_first compile settings, replay, a directory of learner.early_compile's helpers all done
    with exit code 0): the helpers run once for the tests that read their reports; each test works on a copy."""
    import tempfile
    from pathlib import Path

    from rayzero.learner import background

    model, base, replay = _consistency_learners()
    cfg = LearnerConfig(**base, compile=True, compile_backend="aot_eager", background_compile=True,
                        regions_first=True)
    assert background.parts(cfg, model) == ["root", "unroll", "step", "bootstrap", "consistency"]
    tensors = background.synthetic_batch(replay.cfg, (3, 16, 16), np.dtype(np.uint8), 3, 8)
    directory = Path(tempfile.mkdtemp(prefix="rayzero_prewarm_test."))
    helpers = background.prewarm(model, cfg, (3, 16, 16), 3, torch.device("cpu"), tensors, directory)
    assert sorted(p.stem for p in directory.glob("*.pid")) == ["bootstrap", "consistency", "root", "step", "unroll"]
    for helper in helpers:
        assert helper.wait(timeout=240) == 0
    assert sorted(p.read_text() for p in directory.glob("*.rc")) == ["0"] * 5
    yield model, base, cfg, replay, directory
    shutil.rmtree(directory, ignore_errors=True)


def _prewarmed_learner(prewarmed, tmp_path, step_rc):
    """A regions_first learner watching a copy of `prewarmed`'s reports, the whole loss's ("step") helper's set to
    `step_rc` (None: still running), and an eager reference learner."""
    import os

    model, base, cfg, replay, directory = prewarmed
    reports = tmp_path / "prewarm"
    shutil.copytree(directory, reports)
    (reports / "step.rc").unlink()
    if step_rc is None:
        (reports / "step.pid").write_text(str(os.getpid()))  # a live process, which has not reported
    else:
        (reports / "step.rc").write_text(str(step_rc))
    reference = Learner(model, LearnerConfig(**base), (3, 16, 16), 3, seed=0)
    learner = Learner(model, dataclasses.replace(cfg, prewarm_dir=str(reports)), (3, 16, 16), 3, seed=0)
    return reference, learner, replay, reports


def test_regions_first_trains_on_the_regions_step_then_moves_to_the_whole_loss_with_the_same_updates(
        caplog, prewarmed, tmp_path):
    """learner.regions_first, the whole loss's helper still compiling when the others are done (a cold cache): the
    learner trains on the regions' compiled step, checked, and moves to the whole loss's once that helper reports;
    every update equals eager's."""
    reference, learner, replay, reports = _prewarmed_learner(prewarmed, tmp_path, None)
    caplog.set_level("INFO", logger="rayzero.learner.learner")
    kinds = _train_regions_first(reference, learner, replay, lambda kind: kind == "regions", timeout_s=60)
    assert kinds == ["regions"] and learner._whole_waiting, kinds
    assert "compiling it here from the warm cache" in caplog.text
    for _ in range(3):  # it stays on the regions' step while the whole loss's helper runs
        batch = replay.sample(8)
        assert learner.step(batch)[0]["loss"] == reference.step(batch)[0]["loss"]
    assert learner._whole_waiting
    (reports / "step.rc").write_text("0")
    kinds += _train_regions_first(reference, learner, replay, lambda kind: kind == "whole", timeout_s=60)
    assert kinds == ["regions", "whole"], kinds
    assert "the whole loss's helper is done (update" in caplog.text
    for a, b in zip(learner.model.state_dict().values(), reference.model.state_dict().values()):
        assert torch.equal(a, b)


def _make_the_whole_loss_wrong(monkeypatch):
    """Learners compile the whole loss with three times eager's loss (their regions as compiled); returns the list
    that gets the learner's update count at each whole-loss compile."""
    from rayzero.learner.loss import MuZeroLoss

    real = Learner._compiler
    compiled_whole = []

    def compiler(self, mode):
        compile = real(self, mode)

        def compile_one(fn, **kwargs):
            compiled = compile(fn, **kwargs)
            if not isinstance(fn, MuZeroLoss):  # a region: as compiled
                return compiled
            compiled_whole.append(self.steps)

            def wrong(tensors):
                loss, stats, priorities = compiled(tensors)
                return 3 * loss, stats, priorities
            return wrong
        return compile_one

    monkeypatch.setattr(Learner, "_compiler", compiler)
    return compiled_whole


def _said_in_order(log: str, *texts: str) -> None:
    """Each of `texts` is in a line of `log`, the first line of each in the order given."""
    lines = log.splitlines()
    said = [next((i for i, line in enumerate(lines) if text in line), None) for text in texts]
    assert None not in said and said == sorted(said), log


def _goes_on_with_the_regions_step(reference, learner, replay):
    """The learner trains on, on the regions' compiled step, every update eager's, and its weights are eager's."""
    from rayzero.learner.loss import CompiledRegions

    for _ in range(3):
        batch = replay.sample(8)
        assert learner.step(batch)[0]["loss"] == reference.step(batch)[0]["loss"]
    assert isinstance(learner._switch.compiled, CompiledRegions) and learner.compile_state.startswith("on")
    for a, b in zip(learner.model.state_dict().values(), reference.model.state_dict().values()):
        assert torch.equal(a, b)


def test_regions_first_compiles_the_whole_loss_at_once_when_its_helper_is_done_by_then(
        caplog, prewarmed, tmp_path, monkeypatch):
    """learner.regions_first with every helper done by the first update (a warm cache): the learner compiles the
    whole loss at once, not the regions' step and its checked updates first, and keeps the regions' step to fall
    back on. Shown with a whole loss whose loss is three times eager's: the check catches it at its first update,
    and the learner goes on with the regions' compiled step, every update still eager's."""
    compiled_whole = _make_the_whole_loss_wrong(monkeypatch)
    reference, learner, replay, _ = _prewarmed_learner(prewarmed, tmp_path, 0)
    caplog.set_level("INFO", logger="rayzero.learner.learner")
    kinds = _train_regions_first(reference, learner, replay,
                                 lambda kind: "training on its regions' step" in caplog.text, timeout_s=60)
    assert compiled_whole == [0], compiled_whole  # the whole loss, compiled before the first update
    assert kinds == ["regions"], kinds  # its first update was caught, so none ended on it
    _said_in_order(caplog.text, "the whole loss's helper is done too", "computed a gradient norm",
                   "going back to the regions' step", "training on its regions' step")
    _goes_on_with_the_regions_step(reference, learner, replay)


def test_regions_first_goes_back_to_the_regions_step_when_the_whole_loss_is_off_eager(caplog, monkeypatch):
    """learner.regions_first, where the whole loss's compiled step computes wrong gradients (Pong run 26a seed 1's
    did, on an H100: a gradient norm of 4.3 where eager's was 0.88, and without regions_first it trained eagerly
    at half the rate): the compile check catches it, and the learner goes on with the regions' compiled step, not
    eager, every update still eager's. The fault is injected as a whole-loss compile whose loss is three times
    eager's."""
    _make_the_whole_loss_wrong(monkeypatch)
    model, base, replay = _consistency_learners()
    reference = Learner(model, LearnerConfig(**base), (3, 16, 16), 3, seed=0)
    cfg = LearnerConfig(**base, compile=True, compile_backend="aot_eager", background_compile=True,
                        regions_first=True, compile_check_steps=2)
    learner = Learner(model, cfg, (3, 16, 16), 3, seed=0)
    caplog.set_level("INFO", logger="rayzero.learner.learner")
    kinds = _train_regions_first(reference, learner, replay,
                                 lambda kind: "training on its regions' step" in caplog.text)
    # The whole loss's step is caught at its first update, so no update ends on it.
    assert kinds in (["eager", "regions"], ["regions"]), kinds
    _said_in_order(caplog.text, "the whole loss's helper is done", "computed a gradient norm",
                   "going back to the regions' step", "training on its regions' step")
    _goes_on_with_the_regions_step(reference, learner, replay)


def test_regions_first_keeps_the_regions_step_when_the_whole_loss_helper_failed(caplog, prewarmed, tmp_path):
    """learner.regions_first with helpers started with the run (learner.early_compile): when the whole loss's
    helper reports a failure, the learner says so and goes on with the regions' step, its updates eager's."""
    from rayzero.learner.loss import CompiledRegions

    # What the whole loss's helper reports when its compile failed.
    reference, learner, replay, _ = _prewarmed_learner(prewarmed, tmp_path, 1)
    caplog.set_level("INFO", logger="rayzero.learner.learner")
    for _ in range(30):
        batch = replay.sample(8)
        assert learner.step(batch)[0]["loss"] == reference.step(batch)[0]["loss"]
        if not learner._whole_waiting:
            break
    assert "the whole loss's helper failed (exit code 1)" in caplog.text
    assert isinstance(learner._switch.compiled, CompiledRegions) and learner.compile_state.startswith("on")
    for _ in range(3):  # and it goes on there
        batch = replay.sample(8)
        assert learner.step(batch)[0]["loss"] == reference.step(batch)[0]["loss"]
    assert isinstance(learner._switch.compiled, CompiledRegions)


def test_the_early_compiles_batch_has_the_fields_shapes_dtypes_and_layout_of_the_runs_batches():
    """learner.early_compile's helpers compile on a batch the driver makes from random segments: for the compile
    cache to serve the learner, each field must match what the learner gets from the `atari` preset's replay
    (frames stored once and restacked, bootstrap and next observations) through its staging."""
    from rayzero import config as config_mod
    from rayzero.envs import env_spec
    from rayzero.learner import background
    from rayzero.learner.prefetch import Staging

    cfg = config_mod.load("atari", ["replay.shared_obs=false", "replay.capacity=2000", "replay.min_size=0"])
    spec = env_spec(cfg.env)
    channels = spec.observation_shape[0] // cfg.env.frame_stack
    replay = ReplayBuffer(cfg.replay, seed=0)
    rng = np.random.default_rng(0)
    for _ in range(3):
        frames = rng.integers(0, 256, size=(203, channels, *spec.observation_shape[1:]), dtype=np.uint8)
        stacked = np.stack([frames[t:t + cfg.env.frame_stack].reshape(spec.observation_shape) for t in range(200)])
        replay.add(Segment(obs=stacked, actions=rng.integers(0, spec.num_actions, 200),
                           rewards=np.zeros(200, np.float32),
                           policies=np.full((200, spec.num_actions), 1 / spec.num_actions, np.float32),
                           root_values=np.zeros(200, np.float32), num_sampleable=190, terminal=False,
                           bootstrap_value=0.0))
    real = Staging(torch.device("cpu")).upload(replay.sample(32)).tensors
    made = background.synthetic_batch(cfg.replay, spec.observation_shape, spec.observation_dtype, spec.num_actions,
                                      32)
    assert {"obs", "bootstrap_obs", "next_obs", "bootstrap_scale"} <= set(real)
    assert sorted(made) == sorted(real)
    for name, tensor in real.items():
        got = made[name]
        assert (got.shape, got.dtype, got.stride(), got.is_contiguous()) == (
            tensor.shape, tensor.dtype, tensor.stride(), tensor.is_contiguous()), name


def test_a_learner_waits_on_the_helpers_started_with_the_run_and_compiles_at_once_when_they_are_done(caplog):
    """learner.early_compile: helpers started elsewhere (the driver) on a made-up batch report into a directory;
    a learner told of it starts no helpers of its own, and when they are done by its first update it compiles
    from there, with no eager updates; its updates are eager's. Helpers that died without a report leave it
    compiling in its own process."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from rayzero.learner import background

    model, base, replay = _consistency_learners()
    cfg = LearnerConfig(**base, compile=True, compile_backend="aot_eager", background_compile=True)
    tensors = background.synthetic_batch(replay.cfg, (3, 16, 16), np.dtype(np.uint8), 3, 8)
    directory = Path(tempfile.mkdtemp(prefix="rayzero_prewarm_test."))
    helpers = background.prewarm(model, cfg, (3, 16, 16), 3, torch.device("cpu"), tensors, directory)
    # The step, and each side step (target network, consistency targets), each in a helper of its own.
    assert sorted(p.stem for p in directory.glob("*.pid")) == ["bootstrap", "consistency", "step"]
    for helper in helpers:
        assert helper.wait(timeout=240) == 0
    reference = Learner(model, LearnerConfig(**base), (3, 16, 16), 3, seed=0)
    learner = Learner(model, dataclasses.replace(cfg, prewarm_dir=str(directory)), (3, 16, 16), 3, seed=0)
    assert learner._background_helpers == []  # none of its own
    caplog.set_level("INFO", logger="rayzero.learner.learner")
    batch = replay.sample(8)
    assert learner.step(batch)[0]["loss"] == reference.step(batch)[0]["loss"]
    assert learner.compile_state.startswith(("pending", "on")), learner.compile_state
    assert "were done by the first update" in caplog.text
    # A helper that ended without reporting (killed): the learner compiles the step itself.
    dead = Path(tempfile.mkdtemp(prefix="rayzero_prewarm_test."))
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    (dead / "step.pid").write_text(str(ended.pid))
    caplog.clear()
    orphan = Learner(model, dataclasses.replace(cfg, prewarm_dir=str(dead)), (3, 16, 16), 3, seed=0)
    orphan.step(replay.sample(8))
    assert orphan.compile_state.startswith(("pending", "on")) and "exit code -1" in caplog.text


def test_a_failed_background_compile_leaves_the_learner_compiling_in_its_own_process(monkeypatch, caplog):
    import subprocess
    import sys

    from rayzero.learner import background

    monkeypatch.setattr(background, "spawn", lambda *a, **k: subprocess.Popen([sys.executable, "-c", "exit(7)"]))
    reference, learner, replay = _background_learner()
    with caplog.at_level("WARNING"):
        states = _train_until_compiled(reference, learner, replay)
    assert states[-1] == "on:reduce-overhead", states
    assert "failed to compile the step (exit code 7)" in caplog.text


def test_closing_the_learner_stops_its_background_compile_and_removes_the_batch_copy():
    _, learner, replay = _background_learner()
    helpers = learner._background_helpers  # started with the learner, waiting for the first batch
    assert len(helpers) == 3 and all(helper.poll() is None for helper in helpers)
    learner.step(replay.sample(8))  # the first batch reaches them
    assert all(helper.poll() is None for helper in helpers)  # compiling (each removes its batch copy once read;
    learner.close()                                         # a killed one cannot)
    assert all(helper.poll() is not None and not helper.work_dir.exists() for helper in helpers)


def test_a_learner_that_never_trains_stops_its_waiting_helpers_when_closed():
    _, learner, _ = _background_learner()
    helpers = learner._background_helpers
    learner.close()
    assert all(helper.poll() is not None and not helper.work_dir.exists() for helper in helpers)


def test_the_background_helper_gets_a_valid_device_from_an_indexed_one():
    """A Ray GPU actor's learner sits on torch.device('cuda', 0); the helper's config must still validate."""
    import pickle

    from rayzero.learner import background

    for part, side_steps in (("step", False), ("root", False), ("unroll", False), ("bootstrap", True),
                             ("consistency", True)):
        helper = background.spawn(ModelConfig(), LearnerConfig(), (3, 16, 16), 3, torch.device("cuda", 0), part)
        try:
            with open(helper.work_dir / "args.pkl", "rb") as f:
                args = pickle.load(f)
            assert args["cfg"].device == "cuda" and args["cfg"].compile and not args["cfg"].background_compile
            # The step's helper leaves the side steps eager (the other helper compiles them).
            assert args["part"] == part and args["cfg"].compile_side_steps == side_steps
        finally:
            helper.kill()
            helper.wait()
            background.clean_up(helper)
    with pytest.raises(ValueError, match="'both'.*expected one of"):
        background.spawn(ModelConfig(), LearnerConfig(), (3, 16, 16), 3, torch.device("cpu"), "both")


def test_the_background_compile_splits_the_step_into_parts_that_compile_at_once():
    """A helper per part: the loss whole or, with compile_regions, its root and its unrolled step apart (not for a
    value-prefix model, whose loss is compiled whole), and each side step that is compiled."""
    from rayzero.learner import background

    model, base, _ = _consistency_learners()
    cfg = LearnerConfig(**base)
    assert background.parts(cfg, model) == ["step", "bootstrap", "consistency"]
    regions = dataclasses.replace(cfg, compile_regions=True)
    assert background.parts(regions, model) == ["root", "unroll", "bootstrap", "consistency"]
    assert background.parts(regions, dataclasses.replace(model, value_prefix=True))[0] == "step"
    assert background.parts(dataclasses.replace(regions, consistency_targets="step"), model) == [
        "root", "unroll", "bootstrap"]
    assert background.parts(dataclasses.replace(regions, compile_side_steps=False), model) == ["root", "unroll"]
    assert background.parts(dataclasses.replace(cfg, target_update_interval=0, consistency_weight=0.0), model) == [
        "step"]


@pytest.mark.parametrize("targets", ["separate", "step"])
def test_each_background_compile_helper_compiles_only_its_part_and_runs_the_rest_eagerly(monkeypatch, targets):
    """What a helper of each part sends through torch.compile on its batch: together the parts compile everything
    the learner's own compile does, and no part compiles what another does (it would only cost time)."""
    from rayzero.learner import background
    from rayzero.learner.learner import narrow_to_part, run_part

    called: list[str] = []

    def recording_compile(fn, **kwargs):  # runs fn as it is, recording each call through the compiled form
        name = getattr(fn, "__name__", type(fn).__name__)

        def compiled(*args):
            called.append(name)
            return fn(*args)
        return compiled

    model, base, replay = _consistency_learners()
    cfg = LearnerConfig(**base, compile_regions=True, consistency_targets=targets)
    tensors = background.synthetic_batch(replay.cfg, (3, 16, 16), np.dtype(np.uint8), 3, 8)
    monkeypatch.setattr(torch, "compile", recording_compile)
    seen = {}
    for part in background.parts(cfg, model):
        learner = Learner(model, background.helper_config(cfg, torch.device("cpu"), part), (3, 16, 16), 3, seed=0)
        called.clear()
        run_part(learner, narrow_to_part(learner, part), dict(tensors), 0)
        seen[part] = set(called)
    root = {"root_terms"} | ({"consistency_targets"} if targets == "step" else set())
    expected = {"root": root, "unroll": {"step_terms"}, "bootstrap": {"bootstrap_values"}}
    if targets == "separate":
        expected["consistency"] = {"consistency_targets"}
    assert seen == expected
    # The learner's own compile (from the cache they filled) goes through all of them.
    learner = Learner(model, dataclasses.replace(cfg, compile=True), (3, 16, 16), 3, seed=0)
    called.clear()
    learner.step(replay.sample(8))
    assert set(called) == set().union(*expected.values())
    monkeypatch.undo()
    # Each part compiles and runs its updates, forward and backward (aot_eager: autograd traced as inductor gets
    # it; an eager root's backward before compiled steps that update the same batch-norm statistics would fail).
    traced = dataclasses.replace(cfg, compile_backend="aot_eager")
    for part in expected:
        learner = Learner(model, background.helper_config(traced, torch.device("cpu"), part), (3, 16, 16), 3, seed=0)
        sides = narrow_to_part(learner, part)
        run_part(learner, sides, dict(tensors), 0)
        assert all(side.compiled is not None for side in sides)
        assert sides or learner.compile_state.startswith(("pending", "on"))
    # The unrolled step's helper runs the root outside autograd: the latent its compiled steps get must look as the
    # learner's does (what the compile's guards and cache key read), or the learner would miss the cache.
    from rayzero.learner.learner import _root_without_autograd

    loss = Learner(model, cfg, (3, 16, 16), 3, seed=0).loss_module
    batch = dict(tensors)
    args = (batch["obs"], batch["target_policies"][:, 0], batch["target_values"][:, 0], batch["policy_mask"][:, 0],
            batch["value_mask"][:, 0])
    with_grad, without = loss.root_terms(*args)[0], _root_without_autograd(loss.root_terms)(*args)[0]
    assert [(t.shape, t.stride(), t.dtype, t.requires_grad) for t in (with_grad, without)] == [
        (with_grad.shape, with_grad.stride(), with_grad.dtype, True)] * 2
    torch.testing.assert_close(without, with_grad.detach())


def test_regions_first_with_the_loss_compiled_as_regions_is_refused():
    with pytest.raises(ConfigError, match=r"regions_first=True.*compile_regions"):
        LearnerConfig(regions_first=True, compile_regions=True)
    # Without a background compile there is nothing to move between: the loss compiles whole, as without it.
    from rayzero.learner.loss import CompiledRegions

    learner = Learner(ModelConfig(), LearnerConfig(regions_first=True, compile=True, compile_backend="aot_eager",
                                                   device="cpu"), (3, 16, 16), 3, seed=0)
    assert learner._switch.compiled is not None and not isinstance(learner._switch.compiled, CompiledRegions)


def test_unknown_compile_backend_is_refused_with_the_valid_ones():
    with pytest.raises(ConfigError, match=r"compile_backend.*'tvm'.*inductor.*aot_eager"):
        LearnerConfig(compile_backend="tvm")


def test_compile_failures_fall_back_to_the_plain_mode_then_eager(monkeypatch):
    working = {"default"}

    def fake_compile(module, mode="default", **kwargs):
        def run(*args):
            if mode not in working:
                raise torch._dynamo.exc.BackendCompilerFailed(run, RuntimeError(f"no {mode} here"), None)
            return module(*args)
        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    batch = filled_replay().sample(32)
    reference = Learner(MODEL, LEARNER, (4,), 2, seed=0)
    expected = [reference.step(batch)[0]["loss"] for _ in range(4)]
    cfg = LearnerConfig(**{**LEARNER.__dict__, "compile": True, "compile_mode": "reduce-overhead"})
    learner = Learner(MODEL, cfg, (4,), 2, seed=0)
    losses = [learner.step(batch)[0]["loss"] for _ in range(4)]
    assert learner.compile_state == "on:default" and losses == expected
    working.clear()
    learner = Learner(MODEL, cfg, (4,), 2, seed=0)
    assert learner.step(batch)[0]["loss"] == expected[0]
    assert learner.compile_state == "failed"


@pytest.mark.parametrize("error", [ValueError("a bug in the loss"), torch.OutOfMemoryError("CUDA out of memory")])
def test_errors_of_the_loss_in_the_first_compiled_steps_propagate(monkeypatch, error):
    """Only compiler errors move to the next compile mode: an error raised by the loss code, or an OOM, in a
    watched first step propagates at once, and the compile state stays as it was."""
    calls = []

    def fake_compile(module, mode="default", **kwargs):
        def run(*args):
            calls.append(mode)
            raise error
        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    cfg = LearnerConfig(**{**LEARNER.__dict__, "compile": True, "compile_mode": "reduce-overhead"})
    learner = Learner(MODEL, cfg, (4,), 2, seed=0)
    with pytest.raises(type(error), match=str(error)):
        learner.step(filled_replay().sample(32))
    assert calls == ["reduce-overhead"] and learner.compile_state == "pending:reduce-overhead"


def test_published_weights_follow_updates_and_cross_ray_as_writable_tensors():
    import pickle

    from rayzero.models.state import StateDict, snapshot

    learner = Learner(ModelConfig(kind="resnet", channels=8, blocks=1, support_size=5, reduced_channels=2,
                                  head_hidden=8), LEARNER, (3, 16, 16), 4, seed=0)
    live = learner.model.state_dict()
    version, published = learner.weights()
    assert isinstance(published, StateDict) and list(published) == list(live)
    assert {str(v.dtype) for v in published.values()} >= {"torch.float32", "torch.int64"}  # BatchNorm counters
    assert all(torch.equal(published[k], live[k]) for k in live)
    assert learner.weights()[1] is published  # one copy per version
    # Each tensor owns its memory: even as a plain dict (pickled by torch) the weights pickle to about their size.
    size = sum(v.numel() * v.element_size() for v in published.values())
    assert len(pickle.dumps(dict(published))) < 1.5 * size + 100_000
    # An update (even without a new version) and a rollback each give a fresh copy.
    batch = ReplayBuffer(ReplayConfig(capacity=100, unroll_steps=2, td_steps=2, min_size=0), 0)
    rng = np.random.default_rng(0)
    batch.add(Segment(obs=rng.integers(0, 255, size=(20, 3, 16, 16), dtype=np.uint8), actions=rng.integers(0, 4, 20),
                      rewards=np.ones(20, np.float32), policies=np.full((20, 4), 0.25, np.float32),
                      root_values=np.zeros(20, np.float32), num_sampleable=20, terminal=True, bootstrap_value=0.0))
    learner.step(batch.sample(8))
    after = learner.weights()[1]
    assert after is not published
    assert any(not torch.equal(after[k], published[k]) for k in live if live[k].is_floating_point())
    assert all(torch.equal(after[k], live[k]) for k in live)
    learner.set_weights(7, published)
    assert learner.weights()[0] == 7 and all(torch.equal(learner.weights()[1][k], published[k]) for k in live)
    # Pickled, in band and as Ray does it (protocol 5, numpy buffers out of band, read-only on the way in): same
    # names, order, dtypes and values; tensors that can be written.
    mixed = snapshot({"w": torch.randn(3, 4), "b": torch.randn(5).bfloat16(), "n": torch.tensor(3)})
    buffers: list = []
    data = pickle.dumps(mixed, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 2  # w and n as numpy buffers; bfloat16, which numpy lacks, pickled by torch
    out_of_band = pickle.loads(data, buffers=[b.raw().toreadonly() for b in buffers])
    for copy in (pickle.loads(pickle.dumps(mixed, protocol=5)), out_of_band):
        assert isinstance(copy, StateDict) and list(copy) == ["w", "b", "n"]
        for k in mixed:
            assert copy[k].dtype == mixed[k].dtype and torch.equal(copy[k], mixed[k])
        copy["w"].add_(1.0)
        assert not torch.equal(copy["w"], mixed["w"])


def test_flat_gradient_sync_keeps_each_gradient_in_its_parameters_layout():
    """learner.grad_sync='flat' hands back gradients with their parameters' strides (channels_last convolutions
    included): CUDA's fused AdamW refuses a gradient whose strides differ from its parameter's."""
    import socket

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        cfg = LearnerConfig(batch_size=8, device="cpu", channels_last=True, compile=False, grad_sync="flat")
        learner = Learner(ModelConfig(kind="resnet", channels=8, blocks=1, support_size=5, reduced_channels=2,
                                      head_hidden=8), cfg, (3, 16, 16), 4, seed=0, distributed=True)
        params = [p for group in learner.optimizer.param_groups for p in group["params"]]
        assert any(not p.is_contiguous() for p in params)  # channels_last convolution weights
        loss = sum((p.float() ** 2).sum() for p in params)
        loss.backward()
        before = [p.grad.clone() for p in params]
        learner._all_reduce_flat(params)
        for param, grad in zip(params, before):
            assert param.grad.stride() == param.stride(), (param.shape, param.grad.stride(), param.stride())
            assert torch.equal(param.grad, grad)
    finally:
        dist.destroy_process_group()


def test_loss_diagnostics_have_their_known_values():
    """Zero-initialised heads: a uniform prior, values and rewards decoding to 0. Against a uniform target the
    KL is 0 and the target entropy ln A; value and reward errors are the mean absolute targets."""
    from rayzero.learner.loss import STAT_NAMES, MuZeroLoss
    from rayzero.models import build_model

    model = build_model(MODEL, (4,), 2)
    batch = filled_replay().sample(16)
    tensors = {name: torch.as_tensor(getattr(batch, name)) for name in (
        "obs", "actions", "target_values", "target_rewards", "target_policies", "value_mask", "reward_mask",
        "policy_mask", "weights")}
    tensors["target_policies"] = torch.full_like(tensors["target_policies"], 0.5)
    _, stats, _ = MuZeroLoss(model, 0.25)(tensors)
    got = dict(zip(STAT_NAMES, stats.tolist()))
    assert got["target_entropy"] == pytest.approx(np.log(2), rel=1e-5)
    assert got["policy_kl"] == pytest.approx(0.0, abs=1e-5)
    value_mask = batch.value_mask[:, 0]
    assert got["value_error"] == pytest.approx(np.mean(np.abs(batch.target_values[:, 0]) * value_mask), rel=1e-4)
    K = batch.actions.shape[1]
    reward_error = (np.abs(batch.target_rewards[:, 1:]) * batch.reward_mask[:, 1:]).sum(1) / K
    assert got["reward_error"] == pytest.approx(reward_error.mean(), rel=1e-4)


def _unroll_only_batch():
    """A batch whose root terms are masked out, so the loss is the unrolled steps' alone."""
    batch = filled_replay().sample(16)
    tensors = {name: torch.as_tensor(getattr(batch, name)) for name in (
        "obs", "actions", "target_values", "target_rewards", "target_policies", "value_mask", "reward_mask",
        "policy_mask", "weights")}
    for mask in ("value_mask", "policy_mask"):
        tensors[mask] = tensors[mask].clone()
        tensors[mask][:, 0] = 0
    return tensors


def test_the_dynamics_gradient_scale_scales_only_what_reaches_the_representation():
    """With the root terms masked and one unrolled step, the representation's gradient is the scale times its
    unscaled gradient, while the dynamics and prediction gradients do not change."""
    from rayzero.learner.loss import MuZeroLoss
    from rayzero.models import build_model

    torch.manual_seed(0)
    model = build_model(MODEL, (4,), 2)
    with torch.no_grad():  # the heads start at zero, which would pass no gradient back to the latent
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    steps = {"target_values", "target_rewards", "target_policies", "value_mask", "reward_mask", "policy_mask"}
    tensors = {k: v[:, :2] if k in steps else v for k, v in _unroll_only_batch().items()}
    tensors["actions"] = tensors["actions"][:, :1]  # K = 1
    grads = {}
    for scale in (1.0, 0.5, 0.25):
        model.zero_grad()
        MuZeroLoss(model, 0.25, dynamics_grad_scale=scale)(tensors)[0].backward()
        grads[scale] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    represent = [n for n in grads[1.0] if n.startswith("representation")]
    others = [n for n in grads[1.0] if not n.startswith("representation")]
    assert represent and others
    assert any(grads[1.0][n].abs().max() > 0 for n in represent)
    for scale in (0.5, 0.25):
        for n in represent:
            torch.testing.assert_close(grads[scale][n], scale * grads[1.0][n], rtol=1e-5, atol=1e-7)
        for n in others:
            torch.testing.assert_close(grads[scale][n], grads[1.0][n], rtol=1e-5, atol=1e-7)


def test_the_unroll_step_weight_weighs_each_unrolled_step_against_the_root():
    """Root terms masked: a weight of 1 per unrolled step gives K times the default 1/K loss; with the root
    unmasked, the default equals an explicit 1/K."""
    from rayzero.learner.loss import MuZeroLoss
    from rayzero.models import build_model

    model = build_model(MODEL, (4,), 2)
    tensors = _unroll_only_batch()
    K = tensors["actions"].shape[1]
    default = MuZeroLoss(model, 0.25)(tensors)[0]
    torch.testing.assert_close(MuZeroLoss(model, 0.25, unroll_step_weight=1.0)(tensors)[0], K * default)
    full = filled_replay().sample(16)
    full = {name: torch.as_tensor(getattr(full, name)) for name in tensors}
    assert MuZeroLoss(model, 0.25)(full)[0] == MuZeroLoss(model, 0.25, unroll_step_weight=1.0 / K)(full)[0]


@pytest.mark.parametrize("field,value", [("dynamics_grad_scale", 0.0), ("dynamics_grad_scale", 1.5),
                                         ("unroll_step_weight", 0.0)])
def test_bad_unroll_loss_settings_are_refused_with_the_valid_range(field, value):
    with pytest.raises(ConfigError, match=rf"learner.{field}={value}.*(\(0, 1\]|> 0, or None)"):
        LearnerConfig(**{field: value})


@pytest.mark.parametrize("kind,obs_shape", [("mlp", (4,)), ("resnet", (12, 96, 96))])
def test_latent_norm_minmax_scales_what_none_leaves_as_the_blocks_make_it(kind, obs_shape):
    """The same weights: 'minmax' latents are the 'none' latents scaled per sample to [0, 1], after the
    representation and after a dynamics step from the same latent."""
    from rayzero.models import build_model
    from rayzero.models.layers import scale_latent

    cfg = dict(kind=kind, latent_dim=16, hidden=32, channels=8, support_size=5)
    torch.manual_seed(0)
    scaled = build_model(ModelConfig(**cfg), obs_shape, 3).eval()
    raw = build_model(ModelConfig(**cfg, latent_norm="none"), obs_shape, 3).eval()
    raw.load_state_dict(scaled.state_dict())
    obs = torch.randint(0, 256, (4, *obs_shape)).float() if kind == "resnet" else torch.randn(4, *obs_shape) * 3
    actions = torch.tensor([0, 1, 2, 1])
    with torch.no_grad():
        latent = scaled.represent(obs)
        pairs = [(latent, raw.represent(obs)), (scaled.transition(latent, actions), raw.transition(latent, actions))]
    for minmax, unscaled in pairs:
        flat = minmax.flatten(1)
        torch.testing.assert_close(flat.min(1).values, torch.zeros(4))
        torch.testing.assert_close(flat.max(1).values, torch.ones(4))
        assert not torch.allclose(unscaled.flatten(1).max(1).values, torch.ones(4))
        torch.testing.assert_close(minmax, scale_latent(unscaled))


def test_bad_latent_norm_is_refused_with_the_valid_ones():
    with pytest.raises(ConfigError, match=r"latent_norm='l2'.*'minmax' or 'none'"):
        ModelConfig(latent_norm="l2")
    with pytest.raises(ConfigError, match=r"latent_norm='none'.*transformer"):
        ModelConfig(kind="transformer", latent_norm="none")


def test_resnet_dynamics_tells_actions_apart_whose_codes_are_neighbours():
    """The reward depends on the action non-monotonically (1 for actions 2 and 4 of 6, 0 for the rest), as
    Pong's RIGHT/LEFT/RIGHTFIRE codes do. After 40 Adam steps the dynamics' reward head must be within 0.5 of
    every action's reward: one-hot action planes get there (0.33); EfficientZero's one plane of a / A does not
    (0.75, seeded, on the CPU)."""
    from rayzero.config import ModelConfig
    from rayzero.models.networks import ResNet
    from rayzero.models.support import scalar_to_support, support_to_scalar

    torch.manual_seed(0)
    model = ResNet((3, 32, 32), 6, ModelConfig(channels=16, blocks=1, reduced_channels=4, head_hidden=32,
                                               support_size=5))
    obs = torch.randint(0, 256, (60, 3, 32, 32), dtype=torch.uint8)
    actions = torch.arange(6).repeat(10)
    target = ((actions == 2) | (actions == 4)).float()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(40):
        _, logits = model.dynamics(model.represent(obs), actions)
        loss = -(scalar_to_support(target, 5) * torch.log_softmax(logits, -1)).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        _, logits = model.dynamics(model.represent(obs), actions)
    predicted = support_to_scalar(logits, 5)
    for action in range(6):
        rows = actions == action
        assert (predicted[rows] - target[rows]).abs().max() < 0.5, (action, predicted[rows])


def test_sgd_steps_are_heavy_ball_momentum_with_l2_weight_decay():
    """learner.optimizer=sgd: p <- p - lr * b, b <- momentum * b + (g + wd * p), checked against the gradients
    of two steps on a fixed batch (no clipping, no warm-up: the step uses lr as given)."""
    lr, momentum, wd = 0.2, 0.9, 1e-2
    cfg = dataclasses.replace(LEARNER, optimizer="sgd", lr=lr, momentum=momentum, weight_decay=wd, grad_clip=0.0)
    learner = Learner(MODEL, cfg, (4,), 2, seed=0)
    batch = filled_replay().sample(32)
    params = [p for _, p in learner.loss_module.named_parameters()]
    before = [p.detach().clone() for p in params]
    learner.step(batch)
    grads = [p.grad.detach().clone() for p in params]
    buffers = [g + wd * p0 for g, p0 in zip(grads, before)]
    for p, p0, b in zip(params, before, buffers):
        torch.testing.assert_close(p.detach(), p0 - lr * b)
    middle = [p.detach().clone() for p in params]
    learner.step(batch)
    for p, p1, b, g in zip(params, middle, buffers, (p.grad.detach().clone() for p in params)):
        torch.testing.assert_close(p.detach(), p1 - lr * (momentum * b + g + wd * p1))
    assert isinstance(learner.optimizer, torch.optim.SGD)


def test_an_unknown_optimizer_is_a_clear_config_error():
    with pytest.raises(ValueError, match="optimizer.*'adamw' or 'sgd'"):
        LearnerConfig(optimizer="lamb")


def test_sgd_momentum_buffers_resume_exactly(tmp_path):
    """A checkpoint of an SGD learner holds its momentum buffers: the resumed learner continues bit for bit
    (without them its next steps would differ)."""
    cfg = dataclasses.replace(LEARNER, optimizer="sgd", lr=0.05)
    replay = filled_replay()
    batches = [replay.sample(32) for _ in range(5)]
    learner = Learner(MODEL, cfg, (4,), 2, seed=0)
    for batch in batches[:2]:
        learner.step(batch)
    learner.save(str(tmp_path))
    resumed = Learner(MODEL, cfg, (4,), 2, seed=3)
    resumed.load(str(tmp_path))
    assert_same_steps(learner, resumed, batches[2:])


def test_consistency_targets_computed_beforehand_give_the_same_updates():
    """learner.consistency_targets='separate' (the targets outside the compiled step) changes where they are
    computed, not what the learner does: the same losses and weights as 'step' over a few updates."""
    replay = ReplayBuffer(ReplayConfig(capacity=2000, unroll_steps=3, td_steps=3, min_size=0, next_obs=True), 0)
    for s in blob_segments(0):
        replay.add(s)
    batches = [replay.sample(16) for _ in range(3)]
    runs = {}
    for where in ("step", "separate"):
        cfg = LearnerConfig(batch_size=16, lr=3e-3, lr_warmup_steps=0, device="cpu", compile=False,
                            consistency_weight=2.0, consistency_dim=32, consistency_targets=where)
        learner = Learner(BLOB_MODEL, cfg, (3, 24, 24), 4, seed=0)
        metrics = [learner.step(b)[0] for b in batches]
        runs[where] = (metrics, {k: v.clone() for k, v in learner.model.state_dict().items()
                                 if "running" not in k and "num_batches" not in k})
    (m1, w1), (m2, w2) = runs["step"], runs["separate"]
    assert m1[-1]["consistency_loss"] != 0
    for a, b in zip(m1, m2):
        for name in ("loss", "policy_loss", "value_loss", "consistency_loss", "grad_norm"):
            assert a[name] == pytest.approx(b[name], rel=1e-5, abs=1e-7), name
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ConfigError, match="consistency_targets"):
        LearnerConfig(consistency_targets="elsewhere")


def _compiled_as(monkeypatch, wrap):
    """torch.compile replaced by `wrap(fn)` for the step (the side steps run as they are)."""
    def fake_compile(fn, **kwargs):
        return wrap(fn) if isinstance(fn, torch.nn.Module) else fn
    monkeypatch.setattr(torch, "compile", fake_compile)


def test_a_compiled_step_with_wrong_gradients_is_dropped_and_its_updates_are_eager_ones(monkeypatch, caplog):
    """A miscompile that gets the forward's scale of the gradients wrong (as inductor's mix-order reduction did
    on the H200) is caught on the first compiled update, in each mode, and the learner goes on eagerly; every
    update it made equals an eager learner's."""
    def ten_times(module):
        def step(batch):
            loss, stats, priorities = module(batch)
            return loss * 10.0, stats, priorities
        return step

    model, base, replay = _consistency_learners()
    batches = [replay.sample(8) for _ in range(4)]
    reference = Learner(model, LearnerConfig(**base), (3, 16, 16), 3, seed=0)
    expected = [reference.step(b)[0]["loss"] for b in batches]
    _compiled_as(monkeypatch, ten_times)
    learner = Learner(model, LearnerConfig(**base, compile=True, compile_check_steps=3), (3, 16, 16), 3, seed=0)
    with caplog.at_level("WARNING"):
        losses = [learner.step(b)[0]["loss"] for b in batches]
    assert losses == expected
    warnings = [r.getMessage() for r in caplog.records if "computed a gradient norm" in r.getMessage()]
    assert len(warnings) == 2, warnings  # reduce-overhead, then default
    assert "trying mode default" in warnings[0] and "training eagerly" in warnings[1]
    # The forward's terms of both sides: the loss 10x eager's, the loss terms (its parts) equal.
    forward = warnings[0].split("The forward (compiled / eager): ")[1].split(". Largest")[0]
    terms = {name: (float(c), float(e)) for name, c, _, e in (part.split(" ") for part in forward.split(", "))}
    assert set(terms) == {"loss", "policy_loss", "value_loss", "reward_loss", "consistency_loss"}
    assert terms["loss"][0] == pytest.approx(10 * terms["loss"][1], rel=1e-3)
    assert terms["policy_loss"][0] == terms["policy_loss"][1] and terms["value_loss"][0] == terms["value_loss"][1]
    assert learner.compile_state == "failed" and learner._switch.compiled is None
    for a, b in zip(learner.model.state_dict().values(), reference.model.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("wrong_calls", [1, 100])
def test_a_failed_compile_check_runs_the_compiled_step_again_on_the_same_batch(monkeypatch, caplog, wrong_calls):
    """Pong runs s36a and s37a's whole-loss steps computed 20-200x eager's gradients at their first checked update:
    the warning also gives the gradient norm of the compiled step run once more on the same batch from the same
    state, which tells a miscompile wrong for these inputs (the same norm again) from one that differs between
    calls (eager's norm the second time). The update itself stays eager's."""
    calls = []

    def wrong_for_a_while(module):
        def step(batch):
            calls.append(1)
            loss, stats, priorities = module(batch)
            return (loss * 10.0 if len(calls) <= wrong_calls else loss), stats, priorities
        return step

    model, base, replay = _consistency_learners()
    batch = replay.sample(8)
    reference = Learner(model, LearnerConfig(**base), (3, 16, 16), 3, seed=0)
    expected = reference.step(batch)[0]["loss"]
    _compiled_as(monkeypatch, wrong_for_a_while)
    learner = Learner(model, LearnerConfig(**base, compile=True, compile_check_steps=3), (3, 16, 16), 3, seed=0)
    with caplog.at_level("WARNING"):
        assert learner.step(batch)[0]["loss"] == expected
    warning = next(r.getMessage() for r in caplog.records if "computed a gradient norm" in r.getMessage())
    first, eager = (float(x) for x in warning.split("computed a gradient norm of ")[1].split(" on the same")[0]
                    .split(" where eager computes "))
    again = float(warning.split("), and ")[1].split(" when run again")[0])
    assert first == pytest.approx(10 * eager, rel=1e-3)
    assert again == pytest.approx(first if wrong_calls > 1 else eager, rel=1e-3)
    for a, b in zip(learner.model.state_dict().values(), reference.model.state_dict().values()):
        assert torch.equal(a, b)


def test_the_compile_check_names_the_parameters_whose_gradients_the_miscompile_got_wrong(monkeypatch, caplog):
    """A miscompile that writes a wrong gradient into one parameter only: the warning names that one first, with
    its compiled and eager gradient norms (where to look for the faulty kernel)."""
    wrong = {}

    def one_parameter_off(module):
        name, param = max(module.named_parameters(), key=lambda item: item[1].numel())
        wrong["name"] = name

        def step(batch):
            loss, stats, priorities = module(batch)
            return loss + 50.0 * param.square().sum(), stats, priorities
        return step

    model, base, replay = _consistency_learners()
    _compiled_as(monkeypatch, one_parameter_off)
    learner = Learner(model, LearnerConfig(**base, compile=True, compile_check_steps=3), (3, 16, 16), 3, seed=0)
    with caplog.at_level("WARNING"):
        learner.step(replay.sample(8))
    warning = next(r.getMessage() for r in caplog.records if "computed a gradient norm" in r.getMessage())
    worst = warning.split("Largest differences (compiled / eager gradient norm): ")[1]
    first, _, norms = worst.split(", ")[0].partition(" ")
    compiled_norm, eager_norm = (float(x) for x in norms.split(" / "))
    assert first == wrong["name"] and compiled_norm > 10 * eager_norm


def test_a_compiled_step_that_goes_wrong_after_a_recompile_says_how_many_frames_compiled_since(monkeypatch, caplog):
    """Pong runs 26a and 28b's whole-loss steps passed their first checked updates and then computed gradients 5x
    eager's: the warning says how many frames torch._dynamo compiled in the process since the first checked
    update (here one: the step recompiles at its third update, then goes wrong), so a recompile shows."""
    real_compile = torch.compile
    calls = []

    def wrong_after_a_recompile(module):
        def step(batch):
            calls.append(1)
            loss, stats, priorities = module(batch)
            if len(calls) < 3:
                return loss, stats, priorities
            if len(calls) == 3:
                real_compile(lambda x: x + 1, backend="eager")(torch.ones(2))  # a frame compiled: a recompile's trace
            return loss * 10.0, stats, priorities
        return step

    model, base, replay = _consistency_learners()
    _compiled_as(monkeypatch, wrong_after_a_recompile)
    learner = Learner(model, LearnerConfig(**base, compile=True, compile_mode="default", compile_check_steps=4),
                      (3, 16, 16), 3, seed=0)
    with caplog.at_level("WARNING"):
        for _ in range(3):
            learner.step(replay.sample(8))
    warning = next(r.getMessage() for r in caplog.records if "computed a gradient norm" in r.getMessage())
    assert "(update 2)" in warning, warning
    assert "Since the first checked update this process compiled 1 frames" in warning, warning


def test_a_compiled_step_that_follows_eager_stays_on_after_its_checks(monkeypatch, caplog):
    model, base, replay = _consistency_learners()
    batches = [replay.sample(8) for _ in range(5)]
    reference = Learner(model, LearnerConfig(**base), (3, 16, 16), 3, seed=0)
    expected = [reference.step(b)[0]["loss"] for b in batches]
    calls = []

    def counted(module):
        def step(batch):
            calls.append(1)
            return module(batch)
        return step

    _compiled_as(monkeypatch, counted)
    learner = Learner(model, LearnerConfig(**base, compile=True, compile_check_steps=3), (3, 16, 16), 3, seed=0)
    with caplog.at_level("INFO"):
        assert [learner.step(b)[0]["loss"] for b in batches] == expected
    assert len(calls) == 5 and learner.compile_state.startswith("on:") and learner._check_steps == 0
    assert "followed eager over 3 updates" in caplog.text
    for a, b in zip(learner.model.state_dict().values(), reference.model.state_dict().values()):
        assert torch.equal(a, b)


class _Ungraphed(StepGraph):
    """StepGraph's protocol without CUDA: the optimizer reads the rate from the graph's tensor, and each call runs
    the body the graph would capture and replay (CUDA's capture and replay run in tests/test_learner_gpu.py)."""

    def __call__(self, tensors, lr):
        self.lr.fill_(lr)
        rates = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        try:
            self.captures = 1
            return self.body(tensors)
        finally:
            for group, rate in zip(self.optimizer.param_groups, rates):
                group["lr"] = rate


@pytest.mark.parametrize("compiled", [False, True])
def test_the_step_graphs_body_is_the_update_it_replaces(compiled):
    """What learner.step_graph captures (target-network bootstraps, consistency targets, loss, backward,
    clipping, SGD at a rate read from a tensor) updates the learner exactly as the update without it does, with
    the rate changing every update (warm-up) and the target copied every second one. compiled: the step compiled
    without CUDA graphs (aot_eager here), which the graph takes over once its first steps are watched and checked
    against eager."""
    model, base, replay = _consistency_learners()
    cfg = LearnerConfig(**{**base, "optimizer": "sgd", "lr": 0.05, "lr_warmup_steps": 4, "compile": compiled,
                           "compile_backend": "aot_eager", "compile_mode": "default", "compile_check_steps": 2})
    batches = [replay.sample(8) for _ in range(9)]
    plain = Learner(model, cfg, (3, 16, 16), 3, seed=0)
    graphed = Learner(model, cfg, (3, 16, 16), 3, seed=0)
    graphed._step_graph = _Ungraphed(graphed._graph_body, graphed.optimizer, graphed.device)
    for batch in batches:
        expected, expected_priorities = plain.step(batch)
        got, priorities = graphed.step(batch)
        for name in ("loss", "grad_norm", "value_loss", "consistency_loss", "lr"):
            assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-7), name
        np.testing.assert_allclose(priorities, expected_priorities, rtol=1e-5)
    # Eager: two plain updates first. Compiled: three watched (compile failures), of which two are checked.
    assert graphed.graph_updates == len(batches) - (3 if compiled else EAGER_BEFORE_GRAPH)
    assert plain.graph_updates == 0
    assert graphed.compile_state == ("on:default" if compiled else "off")
    for name, weight in plain.model.state_dict().items():
        torch.testing.assert_close(graphed.model.state_dict()[name], weight, rtol=1e-5, atol=1e-6, msg=name)
    assert all(isinstance(group["lr"], float) for group in graphed.optimizer.param_groups)


@pytest.mark.parametrize("kind, obs_shape, extra", [
    ("mlp", (4,), {}),
    ("resnet", (4, 32, 32), {"channels": 8, "downsample": 8}),
    ("resnet", (4, 32, 32), {"channels": 8, "downsample": 8, "value_prefix": True}),
])
def test_a_recurrent_steps_scalars_decode_its_own_logits(kind, obs_shape, extra):
    """The search reads the decoded value and reward (computed together, in one pass over both heads); they are
    what its logits decode to, one head at a time, and each row's alone (rows do not mix)."""
    from rayzero.models import build_model, support_to_scalar

    torch.manual_seed(0)
    model = build_model(ModelConfig(kind=kind, support_size=20, **extra), obs_shape, 3).eval()
    for p in model.parameters():  # the heads start at zero: give them something to decode
        p.data.normal_(0, 0.3)
    with torch.no_grad():
        root = model.initial(torch.randint(0, 255, (5, *obs_shape), dtype=torch.uint8) if len(obs_shape) > 1
                             else torch.randn(5, *obs_shape))
        out = model.recurrent(root.latent, torch.tensor([0, 1, 2, 1, 0]))
        one = model.recurrent(root.latent[2:3], torch.tensor([2]))
    torch.testing.assert_close(out.value, support_to_scalar(out.value_logits, 20), rtol=1e-6, atol=1e-6)
    if not extra.get("value_prefix"):
        torch.testing.assert_close(out.reward, support_to_scalar(out.reward_logits, 20), rtol=1e-6, atol=1e-6)
    else:  # a root's prefix is 0: the first step's reward is its prefix
        torch.testing.assert_close(out.reward, support_to_scalar(out.reward_logits, 20), rtol=1e-5, atol=1e-5)
    assert out.value.abs().max() > 1e-3 and out.reward.abs().max() > 1e-3
    # A row alone against the same row in the batch: float32 kernels for batch 1 and 5 may sum in another order,
    # and the decode's inverse squash amplifies that (6.7e-5 relative on one 2-core CPU); rows that mixed would
    # differ by far more.
    torch.testing.assert_close(one.value, out.value[2:3], rtol=5e-4, atol=1e-5)
    torch.testing.assert_close(one.reward, out.reward[2:3], rtol=5e-4, atol=1e-5)


def test_a_train_result_says_how_long_the_learner_spent_between_train_calls_and_in_weights(monkeypatch):
    """Each train call after the first reports the gap since the last one ended (`between_calls_s`) and the part of
    it spent making published weights (`weights_s`): what the learner's share of time outside its calls is made of
    in a run (scripts/lab_row.py). Known answers: a 0.2 s pause with one `weights` call in it."""
    learner = Learner(MODEL, LearnerConfig(device="cpu"), (4,), 2, seed=0)
    monkeypatch.setattr(learner, "_train", lambda replay, num_steps: {"call_s": 0.01})
    first = learner.train(None, 1)
    assert "between_calls_s" not in first and "weights_s" not in first
    time.sleep(0.2)
    learner.weights()
    second = learner.train(None, 1)
    assert 0.2 <= second["between_calls_s"] < 2.0
    assert 0.0 < second["weights_s"] < second["between_calls_s"] - 0.19
    third = learner.train(None, 1)  # no weights() since the last call
    assert third["weights_s"] == 0.0 and third["between_calls_s"] < second["between_calls_s"]
