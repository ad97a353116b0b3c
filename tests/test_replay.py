"""Replay: n-step targets against hand-computed values, eviction, priorities, snapshots."""

import dataclasses

import numpy as np
import pytest

from rayzero.config import ReplayConfig
from rayzero.replay import ReplayBuffer, Segment


def segment(length, num_actions=2, terminal=True, bootstrap=0.0, sampleable=None, start_value=0.0, obs_dim=3):
    t = np.arange(length, dtype=np.float32)
    return Segment(
        obs=np.stack([t + start_value] * obs_dim, axis=1),
        actions=(np.arange(length) % num_actions).astype(np.int64),
        rewards=np.ones(length, dtype=np.float32),
        policies=np.full((length, num_actions), 1.0 / num_actions, dtype=np.float32),
        root_values=(10.0 + t).astype(np.float32),
        num_sampleable=sampleable or length,
        terminal=terminal,
        bootstrap_value=bootstrap,
    )


def targets_at(buffer, flat_index):
    return buffer._targets(np.array([flat_index]), np.ones(1, dtype=np.float32))


def test_n_step_value_target_inside_episode():
    cfg = ReplayConfig(capacity=100, unroll_steps=2, td_steps=3, discount=0.5, min_size=0)
    buffer = ReplayBuffer(cfg)
    buffer.add(segment(10))
    batch = targets_at(buffer, 2)
    # z_2 = 1 + .5 + .25 + .125 * v_5, v_5 = 15
    assert batch.target_values[0, 0] == pytest.approx(1 + 0.5 + 0.25 + 0.125 * 15)
    assert batch.target_values[0, 1] == pytest.approx(1 + 0.5 + 0.25 + 0.125 * 16)
    np.testing.assert_array_equal(batch.target_rewards[0], [0, 1, 1])
    np.testing.assert_array_equal(batch.obs[0], [2, 2, 2])
    np.testing.assert_array_equal(batch.actions[0], [0, 1])
    assert batch.value_mask.all() and batch.policy_mask.all()


def test_terminal_end_is_absorbing():
    cfg = ReplayConfig(capacity=100, unroll_steps=3, td_steps=5, discount=1.0, min_size=0)
    buffer = ReplayBuffer(cfg)
    buffer.add(segment(4, terminal=True))
    batch = targets_at(buffer, 2)  # states 2, 3 inside; 4, 5 after the terminal
    np.testing.assert_allclose(batch.target_values[0], [2, 1, 0, 0])
    np.testing.assert_allclose(batch.target_rewards[0], [0, 1, 1, 0])
    np.testing.assert_array_equal(batch.value_mask[0], [1, 1, 1, 1])
    np.testing.assert_array_equal(batch.reward_mask[0], [0, 1, 1, 1])
    np.testing.assert_array_equal(batch.policy_mask[0], [1, 1, 0, 0])


def test_truncated_end_bootstraps_and_masks_beyond():
    cfg = ReplayConfig(capacity=100, unroll_steps=3, td_steps=5, discount=0.5, min_size=0)
    buffer = ReplayBuffer(cfg)
    buffer.add(segment(4, terminal=False, bootstrap=8.0))
    batch = targets_at(buffer, 2)
    # z_2 = 1 + .5 + .25 * 8 ; z_3 = 1 + .5 * 8 ; state 4 = the cut: its value is the bootstrap
    np.testing.assert_allclose(batch.target_values[0, :3], [1 + 0.5 + 0.25 * 8, 1 + 0.5 * 8, 8.0])
    np.testing.assert_array_equal(batch.value_mask[0], [1, 1, 1, 0])
    np.testing.assert_array_equal(batch.reward_mask[0], [0, 1, 1, 0])


def test_mid_episode_tail_is_not_sampled():
    cfg = ReplayConfig(capacity=100, unroll_steps=2, td_steps=2, discount=1.0, min_size=0)
    buffer = ReplayBuffer(cfg, seed=1)
    buffer.add(segment(9, terminal=False, sampleable=5))
    batch = buffer.sample(2000)
    assert set(np.unique(batch.indices)) == {0, 1, 2, 3, 4}
    assert batch.value_mask.all() and batch.policy_mask.all()


def test_eviction_keeps_whole_segments_and_counts():
    cfg = ReplayConfig(capacity=25, unroll_steps=1, td_steps=1, min_size=0)
    buffer = ReplayBuffer(cfg)
    for i in range(5):
        buffer.add(segment(10, start_value=100 * i))
    # 25 slots hold two segments of 10; the third wrapped to 0 and evicted the oldest.
    assert len(buffer) == 20
    batch = buffer.sample(500)
    starts = set((batch.obs[:, 0] // 100).astype(int).tolist())
    assert starts == {3, 4}
    assert buffer.stats()["total_added"] == 50


def test_priorities_steer_sampling_and_ignore_stale_updates():
    cfg = ReplayConfig(capacity=20, unroll_steps=1, td_steps=1, min_size=0)
    buffer = ReplayBuffer(cfg, seed=0)
    buffer.add(segment(10))
    batch = buffer.sample(10)
    priorities = np.full(10, 1e-6)
    priorities[batch.indices == batch.indices[0]] = 100.0
    buffer.update_priorities(batch.indices, batch.generations, priorities)
    counts = np.bincount(buffer.sample(1000).indices, minlength=20)
    assert counts[batch.indices[0]] > 900
    # Overwrite the segment, then an update with old generations must not change anything.
    buffer.add(segment(10))
    buffer.add(segment(10))
    before = buffer._arrays["priority"].copy()
    buffer.update_priorities(batch.indices, batch.generations, np.full(10, 5.0))
    np.testing.assert_array_equal(before, buffer._arrays["priority"])


def test_snapshot_roundtrip(tmp_path):
    cfg = ReplayConfig(capacity=50, unroll_steps=2, td_steps=2, min_size=0)
    buffer = ReplayBuffer(cfg, seed=3)
    for i in range(3):
        buffer.add(segment(7, start_value=i))
    buffer.snapshot(tmp_path / "replay.npz")
    restored = ReplayBuffer(cfg, seed=3)
    restored.restore(tmp_path / "replay.npz")
    assert restored.stats() == buffer.stats()
    for name, array in buffer._arrays.items():
        np.testing.assert_array_equal(array, restored._arrays[name])
    assert not (tmp_path / "replay.npz.tmp").exists()


def test_bad_segments_are_rejected():
    buffer = ReplayBuffer(ReplayConfig(capacity=10, min_size=0))
    with pytest.raises(ValueError, match="exceeds replay.capacity=10"):
        buffer.add(segment(11))
    bad = segment(5)._replace(rewards=np.ones(4, dtype=np.float32))
    with pytest.raises(ValueError, match="rewards has 4 steps"):
        buffer.add(bad)
    with pytest.raises(ValueError, match="empty"):
        buffer.sample(4)


def test_actions_out_of_range_and_non_finite_targets_are_rejected_with_their_steps():
    buffer = ReplayBuffer(ReplayConfig(capacity=50, min_size=0))
    good = segment(5)
    num_actions = good.policies.shape[1]
    actions = good.actions.copy()
    actions[3] = num_actions
    with pytest.raises(ValueError, match=rf"holds \[{num_actions}\] at steps \[3\]; valid actions are 0..{num_actions - 1}"):
        buffer.add(good._replace(actions=actions))
    values = good.root_values.astype(np.float32).copy()
    values[2] = np.nan
    with pytest.raises(ValueError, match=r"root_values holds non-finite values at steps \[2\]"):
        buffer.add(good._replace(root_values=values))
    buffer.add(good)  # the good segment still goes in: nothing of the bad ones was stored
    assert buffer.stats()["size"] == 5


def test_reanalysed_targets_replace_stored_ones_and_skip_overwritten_positions():
    cfg = ReplayConfig(capacity=20, unroll_steps=2, td_steps=3, discount=0.5, min_size=0)
    buffer = ReplayBuffer(cfg, seed=0)
    assert buffer.sample_positions(4) is None  # nothing stored yet
    buffer.add(segment(10))
    job = buffer.sample_positions(8)
    assert job["indices"].shape == (8,) and job["obs"].shape == (8, 3)
    np.testing.assert_array_equal(job["obs"][:, 0], job["indices"])  # obs of segment(10) at t is t
    policies = np.tile([0.9, 0.1], (8, 1)).astype(np.float32)
    values = np.full(8, 100.0, dtype=np.float32)
    assert buffer.update_targets(job["indices"], job["generations"], policies, values) == 8
    first = int(job["indices"][0])
    batch = targets_at(buffer, first)
    np.testing.assert_allclose(batch.target_policies[0, 0], [0.9, 0.1])
    assert buffer.stats()["reanalysed"] == 8
    # A reanalysed search value is the n-step bootstrap of the positions n steps before it.
    every = np.arange(10)
    generations = buffer._arrays["generation"][every]
    buffer.update_targets(every, generations, np.tile([0.5, 0.5], (10, 1)), np.full(10, 100.0))
    assert targets_at(buffer, 2).target_values[0, 0] == pytest.approx(1 + 0.5 + 0.25 + 0.125 * 100)
    # Overwrite the positions: an answer for the old generations changes nothing.
    buffer.add(segment(10))
    buffer.add(segment(10))
    before = buffer._arrays["policy"].copy()
    assert buffer.update_targets(job["indices"], job["generations"], policies, values) == 0
    np.testing.assert_array_equal(before, buffer._arrays["policy"])
    with pytest.raises(ValueError, match="do not match"):
        buffer.update_targets(job["indices"], job["generations"], policies[:, :1], values)
    with pytest.raises(ValueError, match="count=0"):
        buffer.sample_positions(0)


def stacked_segments(rng, episodes=3, episode_len=37, seg_len=10, tail=4, stack=4, channels=3, size=5):
    """Segments as self-play sends them (mid-episode cuts carry `tail` extra steps) of stacked image
    observations [stack * channels, size, size], zero-padded at each episode's start, newest frame last."""
    for _ in range(episodes):
        frames = rng.integers(1, 256, size=(episode_len, channels, size, size), dtype=np.uint8)
        padded = np.concatenate([np.zeros((stack - 1, channels, size, size), np.uint8), frames])
        obs = np.stack([padded[t:t + stack].reshape(stack * channels, size, size) for t in range(episode_len)])
        start = 0
        while start < episode_len:
            stop = min(start + seg_len + tail, episode_len)
            last = stop == episode_len
            n = stop - start
            yield Segment(
                obs=obs[start:stop],
                actions=rng.integers(0, 3, size=n),
                rewards=rng.normal(size=n).astype(np.float32),
                policies=rng.dirichlet(np.ones(3), size=n).astype(np.float32),
                root_values=rng.normal(size=n).astype(np.float32),
                num_sampleable=n if last else min(seg_len, n), terminal=last, bootstrap_value=0.0,
            )
            if last:
                break
            start += seg_len


def test_frame_storage_restacks_exactly_through_eviction_and_snapshots(tmp_path):
    cfg = ReplayConfig(capacity=60, unroll_steps=2, td_steps=2, discount=0.9, min_size=0, frame_stack=4,
                       next_obs=True, bootstrap_obs=True)
    plain_cfg = ReplayConfig(capacity=500, unroll_steps=2, td_steps=2, discount=0.9, min_size=0, next_obs=True,
                             bootstrap_obs=True)
    frames, plain = ReplayBuffer(cfg, seed=0), ReplayBuffer(plain_cfg, seed=0)
    sent_as_frames = ReplayBuffer(cfg, seed=0)  # the same segments in frame form, as self-play sends them
    truth = {}  # frame-buffer position -> (plain-buffer position), for positions written last
    rng = np.random.default_rng(0)
    for s in stacked_segments(rng):
        frames.add(s)
        plain.add(s)
        small = s._replace(obs=s.obs[:, -3:], history=s.obs[0, :-3].reshape(3, 3, 5, 5))
        np.testing.assert_array_equal(small.stacked_obs(), s.obs)
        sent_as_frames.add(small)
        n = len(s.actions)
        for o in range(n):
            truth[frames.cursor - n + o] = plain.cursor - n + o
    assert frames.total_added > 60  # the ring wrapped: blocks (history frames included) were evicted
    assert frames._arrays["obs"].shape == (60, 3, 5, 5)  # single frames: 4x less than [60, 12, 5, 5]

    def check(buffer):
        alive = np.flatnonzero(buffer._arrays["alive"])
        assert len(alive) == len(buffer) > 0
        for p in alive:
            mine, theirs = targets_at(buffer, p), targets_at(plain, truth[p])
            for name in ("obs", "next_obs", "bootstrap_obs", "target_values", "target_rewards",
                         "target_policies", "value_mask", "reward_mask", "policy_mask", "next_mask",
                         "bootstrap_scale"):
                np.testing.assert_array_equal(getattr(mine, name), getattr(theirs, name), err_msg=f"{name} at {p}")

    check(frames)
    for name, array in frames._arrays.items():
        if name != "added_time":  # wall-clock times of two buffers filled one after the other
            np.testing.assert_array_equal(sent_as_frames._arrays[name], array, err_msg=name)
    frames.snapshot(tmp_path / "frames.npz")
    restored = ReplayBuffer(cfg, seed=0)
    restored.restore(tmp_path / "frames.npz")
    check(restored)
    job = restored.sample_positions(8)
    np.testing.assert_array_equal(job["obs"], np.stack([plain.obs_at(np.array(truth[p])) for p in job["indices"]]))
    with pytest.raises(ValueError, match="frame_stack"):
        ReplayBuffer(dataclasses.replace(plain_cfg, capacity=60), 0).restore(tmp_path / "frames.npz")
    with pytest.raises(ValueError, match="image observations"):
        ReplayBuffer(cfg, 0).add(segment(10, obs_dim=3))


def test_sampling_diagnostics_have_their_known_values():
    """Uniform sampling: importance weights all 1 (effective size = the batch); every stored reward is 1 and the
    absorbing steps past a terminal end have reward 0; a sample's age in transitions is what was added after it."""
    from rayzero.replay.buffer import diagnostic_means

    buffer = ReplayBuffer(ReplayConfig(capacity=100, unroll_steps=2, td_steps=2, priority_alpha=0.0, min_size=0), seed=0)
    buffer.add(segment(10))
    buffer.add(segment(10))
    first = buffer.stats()
    batch = buffer.sample(64)
    means = diagnostic_means(buffer.stats(), first)
    assert means["sample_is_weight_mean"] == 1.0 and means["sample_is_weight_ess"] == pytest.approx(1.0)
    offset = batch.indices % 10  # two terminal segments of 10 steps; unroll steps k = 1, 2 follow step offset+k-1
    inside = (offset[:, None] + np.arange(2)[None, :]) < 10
    assert means["sample_reward_nonzero"] == pytest.approx(inside.mean())
    expected_age = np.mean(np.where(batch.indices < 10, 10, 0))  # the first segment's positions saw 10 more
    assert means["sample_age_transitions"] == pytest.approx(expected_age)
    assert 0 <= means["sample_age_seconds"] < 60
    assert diagnostic_means(buffer.stats(), buffer.stats()) == {}  # no batch in between


def test_a_dominant_importance_weight_shows_as_a_small_effective_batch():
    """alpha = beta = 1 with one position fit far better than the rest: that position's weight dominates."""
    from rayzero.replay.buffer import diagnostic_means

    buffer = ReplayBuffer(ReplayConfig(capacity=100, unroll_steps=2, td_steps=2, min_size=0), seed=0)
    buffer.add(segment(40))
    buffer.update_priorities(np.arange(40), buffer._arrays["generation"][:40], np.r_[1e-4, np.ones(39)])
    while True:  # a batch that holds the well-fit position
        before = buffer.stats()
        batch = buffer.sample(32)
        if 0 in batch.indices:
            break
    assert diagnostic_means(buffer.stats(), before)["sample_is_weight_ess"] < 0.1
