"""Known-answer tests of the data path that learning depends on: self-play -> replay -> targets -> loss.

`Countdown` is an episode of T steps whose rewards do not depend on the actions: r_t = t + 1 (t = 0..T-1),
then a terminal state. Its observation is the one-hot step index, so the true value of step t under any policy
is v_t = sum_{i >= t} gamma^(i - t) (i + 1), and a network can learn it exactly.
"""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest
import torch

from rayzero.actors.selfplay import SelfPlayWorker
from rayzero.config import EnvConfig, LearnerConfig, ModelConfig, ReplayConfig
from rayzero.learner import Learner
from rayzero.replay import ReplayBuffer
from rayzero.tree import SearchConfig

T = 12
GAMMA = 0.9
ENV_ID = "RayzeroCountdown-v0"


class Countdown(gymnasium.Env):
    observation_space = gymnasium.spaces.Box(0.0, 1.0, (T,), np.float32)
    action_space = gymnasium.spaces.Discrete(3)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def _obs(self):
        obs = np.zeros(T, np.float32)
        obs[min(self.t, T - 1)] = 1.0
        return obs

    def step(self, action):
        reward = float(self.t + 1)
        self.t += 1
        return self._obs(), reward, self.t == T, False, {}


if ENV_ID not in gymnasium.envs.registry:
    gymnasium.register(ENV_ID, entry_point=Countdown)


def true_values() -> np.ndarray:
    """[T + 1] v_t for t = 0..T (v_T = 0: terminal)."""
    values = np.zeros(T + 1)
    for t in range(T - 1, -1, -1):
        values[t] = (t + 1) + GAMMA * values[t + 1]
    return values


def play(replay_cfg: ReplayConfig, steps: int, num_envs: int = 3):
    """Self-play `steps` batched steps with a fresh network; returns (segments, worker)."""
    segments = []
    worker = SelfPlayWorker(EnvConfig(id=ENV_ID, num_envs=num_envs), MODEL, SearchConfig(num_simulations=6),
                            replay_cfg, seed=0, sink=segments.append)
    worker.collect(steps)
    return segments, worker


MODEL = ModelConfig(kind="mlp", latent_dim=16, hidden=32, support_size=20)


def test_self_play_stores_the_episodes_rewards_policies_and_search_values():
    cfg = ReplayConfig(capacity=1000, unroll_steps=2, td_steps=3, discount=GAMMA, segment_length=5, min_size=0)
    segments, _ = play(cfg, 2 * T)
    assert segments, "no segment left self-play"
    for s in segments:
        step = s.obs.argmax(1)  # the one-hot observation names the step
        np.testing.assert_array_equal(s.rewards, step + 1.0)  # the reward after the action at step t
        np.testing.assert_allclose(s.policies.sum(1), 1.0, rtol=1e-5)
        assert np.all(s.policies * 6 == np.round(s.policies * 6))  # visit fractions of 6 simulations
        assert np.all(np.isfinite(s.root_values))
        if s.terminal:
            assert step[-1] == T - 1 and s.num_sampleable == len(s.actions)
        else:  # a cut mid-episode: the first positions (segment_length of them, fewer in an env's first
            # segment) start unrolls, the tail completes them
            assert len(s.actions) == s.num_sampleable + 2 + 3 and 1 <= s.num_sampleable <= 5
            np.testing.assert_array_equal(np.diff(step), 1)
    # Every step of the two whole episodes each env played starts exactly one sampleable position.
    starts = np.concatenate([s.obs.argmax(1)[:s.num_sampleable] for s in segments])
    assert np.bincount(starts, minlength=T).tolist() == [2 * 3] * T


class Signs(gymnasium.Env):
    """Episodes of len(REWARDS) steps paying REWARDS in turn, whatever the actions."""

    REWARDS = (1.0, -1.0, 0.0, 2.0, -3.0, 0.0)
    observation_space = gymnasium.spaces.Box(0.0, 1.0, (len(REWARDS),), np.float32)
    action_space = gymnasium.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.eye(len(self.REWARDS), dtype=np.float32)[0], {}

    def step(self, action):
        reward = self.REWARDS[self.t]
        self.t += 1
        done = self.t == len(self.REWARDS)
        return np.eye(len(self.REWARDS), dtype=np.float32)[self.t % len(self.REWARDS)], reward, done, False, {}


SIGNS_ID = "RayzeroSigns-v0"
if SIGNS_ID not in gymnasium.envs.registry:
    gymnasium.register(SIGNS_ID, entry_point=Signs)


def test_a_collect_counts_the_rewards_its_steps_paid_while_no_episode_has_ended():
    """Each collect reports its env steps' rewards (sum, > 0, < 0), which show how self-play goes in games whose
    episodes outlast a run (Pong at 64 envs): here 3 envs, two collects of 4 and then 8 steps."""
    cfg = ReplayConfig(capacity=1000, unroll_steps=1, td_steps=1, discount=GAMMA, segment_length=4, min_size=0)
    worker = SelfPlayWorker(EnvConfig(id=SIGNS_ID, num_envs=3), MODEL, SearchConfig(num_simulations=4), cfg, seed=0)
    first = worker.collect(4)  # steps 0-3 of each env's first episode: 1, -1, 0, 2
    assert first["episode_returns"] == []
    assert (first["reward_sum"], first["rewards_positive"], first["rewards_negative"]) == (3 * 2.0, 3 * 2, 3 * 1)
    second = worker.collect(8)  # steps 4-5 (-3, 0), then a whole episode (1, -1, 0, 2, -3, 0)
    assert second["episode_returns"] == [-1.0] * 6
    assert (second["reward_sum"], second["rewards_positive"], second["rewards_negative"]) == (
        3 * (-3.0 - 1.0), 3 * 2, 3 * 3)


def test_envs_that_start_together_send_their_first_segments_staggered():
    """Env i of E cuts its first segment after (i + 1) / E of segment_length sampleable positions, so the
    envs' segments do not all reach replay on the same step; every later cut holds segment_length."""
    cfg = ReplayConfig(capacity=1000, unroll_steps=1, td_steps=1, discount=GAMMA, segment_length=4, min_size=0)
    segments, _ = play(cfg, T, num_envs=4)  # one episode each: steps 0..T-1
    cuts = [s for s in segments if not s.terminal]
    first = sorted(s.num_sampleable for s in cuts if s.obs[0].argmax() == 0)
    assert first == [1, 2, 3, 4]
    assert all(s.num_sampleable == 4 for s in cuts if s.obs[0].argmax() != 0)
    # Each episode's positions still start exactly one sampleable position each.
    starts = np.concatenate([s.obs.argmax(1)[:s.num_sampleable] for s in segments])
    assert np.bincount(starts, minlength=T).tolist() == [4] * T


def test_replay_targets_equal_hand_computed_n_step_returns():
    n, K = 3, 2
    cfg = ReplayConfig(capacity=1000, unroll_steps=K, td_steps=n, discount=GAMMA, segment_length=5, min_size=0)
    segments, _ = play(cfg, 2 * T)
    buffer = ReplayBuffer(cfg)
    for s in segments:
        buffer.add(s)
    batch = buffer.sample(256)
    # The search value each position stored, by (segment start, offset): rebuild per position from the arrays.
    a = buffer._arrays
    for row, index in enumerate(batch.indices):
        start, length = a["seg_start"][index], a["seg_len"][index]
        t0 = int(a["obs"][index].argmax())
        terminal = bool(a["seg_terminal"][index])
        for k in range(K + 1):
            pos = index - start + k
            if pos >= length:
                if terminal:  # absorbing: value 0, reward 0, uniform policy
                    assert batch.target_values[row, k] == 0 and batch.value_mask[row, k] == 1
                continue
            t = t0 + k
            expected = sum(GAMMA**i * (t + i + 1) for i in range(n) if pos + i < length)
            if pos + n < length:
                expected += GAMMA**n * a["root_value"][start + pos + n]
            assert batch.target_values[row, k] == pytest.approx(expected, rel=1e-5), (row, k)
            if k > 0:
                assert batch.target_rewards[row, k] == t  # the reward of the transition into step t
            np.testing.assert_allclose(batch.target_policies[row, k], a["policy"][start + pos])


def test_training_on_self_play_data_fits_the_true_values():
    """Monte-Carlo targets (n past the episode's end) are the true values; a short training fits them."""
    cfg = ReplayConfig(capacity=2000, unroll_steps=2, td_steps=T, discount=GAMMA, segment_length=T, min_size=0,
                       priority_alpha=0.0)
    segments, _ = play(cfg, 4 * T, num_envs=4)
    buffer = ReplayBuffer(cfg)
    for s in segments:
        buffer.add(s)
    truth = true_values()
    batch = buffer.sample(64)
    steps = batch.obs.argmax(1)
    np.testing.assert_allclose(batch.target_values[:, 0], truth[steps], rtol=1e-5)

    torch.manual_seed(0)
    learner = Learner(MODEL, LearnerConfig(batch_size=64, lr=3e-3, lr_warmup_steps=0, device="cpu"), (T,), 3, seed=0)
    obs = torch.eye(T)

    def value_error() -> float:
        with torch.no_grad():
            predicted = learner.model.initial(obs).value.numpy()
        return float(np.abs(predicted - truth[:T]).mean())

    before = value_error()
    for _ in range(250):
        learner.step(buffer.sample(64))
    after = value_error()
    assert before > 20 and after < 0.1 * before, (before, after)
