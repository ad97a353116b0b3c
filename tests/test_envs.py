"""Tests of rayzero.envs: specs, same-step autoreset, episode statistics, Atari preprocessing, errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rayzero import envs
from rayzero.config import EnvConfig


def _random_actions(rng: np.random.Generator, env: envs.BatchedEnv) -> np.ndarray:
    return rng.integers(0, env.spec.num_actions, size=env.num_envs)


# ----------------------------------------------------------------------------------------------------
# Gymnasium (non-ALE) envs


def test_cartpole_shapes_and_dtypes() -> None:
    cfg = EnvConfig(id="CartPole-v1")
    spec = envs.env_spec(cfg)
    assert spec == envs.EnvSpec((4,), np.dtype(np.float32), 2, None)
    with envs.make_vector_env(cfg, 3, seed=0, training=True) as env:
        assert env.num_envs == 3 and env.spec == spec
        obs = env.reset()
        assert obs.shape == (3, 4) and obs.dtype == np.float32
        res = env.step(np.zeros(3, dtype=np.int64))
        assert res.obs.shape == (3, 4) and res.obs.dtype == np.float32
        assert res.reward.shape == (3,) and res.reward.dtype == np.float32
        assert res.terminated.dtype == np.bool_ and res.truncated.dtype == np.bool_
        assert res.final_obs is None and res.episode_returns == [] and res.episode_lengths == []
        with pytest.raises(ValueError, match="shape"):
            env.step(np.zeros(2, dtype=np.int64))


def test_cartpole_same_step_autoreset_and_returns() -> None:
    cfg = EnvConfig(id="CartPole-v1")
    with envs.make_vector_env(cfg, 4, seed=1, training=True) as env:
        env.reset()
        steps = np.zeros(4, dtype=int)
        ends = 0
        # Always pushing left topples the pole within a few dozen steps, again and again.
        for _ in range(300):
            res = env.step(np.zeros(4, dtype=np.int64))
            steps += 1
            assert not res.truncated.any()
            if not res.terminated.any():
                assert res.final_obs is None and res.episode_returns == []
                continue
            assert res.final_obs is not None and res.final_obs.shape == (4, 4)
            ended = np.flatnonzero(res.terminated)
            for i in ended:
                x, _, angle, _ = res.final_obs[i]
                assert abs(x) > 2.4 or abs(angle) > 0.2094  # the terminal state
                assert np.all(np.abs(res.obs[i]) <= 0.05)  # already the next episode's first observation
            # CartPole pays 1 per step: the return and the length of each finished episode are its steps.
            assert res.episode_returns == [float(steps[i]) for i in ended]
            assert res.episode_lengths == [int(steps[i]) for i in ended]
            steps[ended] = 0
            ends += len(ended)
        assert ends >= 8


def test_cartpole_truncation() -> None:
    cfg = EnvConfig(id="CartPole-v1", max_episode_steps=5)
    with envs.make_vector_env(cfg, 2, seed=0, training=False) as env:
        prev = env.reset()
        for t in range(5):
            res = env.step(np.full(2, t % 2, dtype=np.int64))  # alternate: the pole stays up
            if t < 4:
                assert not (res.terminated | res.truncated).any()
                prev = res.obs
        assert res.truncated.all() and not res.terminated.any()
        assert res.episode_returns == [5.0, 5.0] and res.episode_lengths == [5, 5]
        assert res.final_obs is not None and not np.array_equal(res.final_obs, res.obs)
        assert not np.array_equal(res.final_obs, prev)


def test_cartpole_seeding_is_reproducible() -> None:
    cfg = EnvConfig(id="CartPole-v1")

    def rollout(seed: int) -> np.ndarray:
        with envs.make_vector_env(cfg, 4, seed=seed, training=True) as env:
            rng = np.random.default_rng(0)
            frames = [env.reset()]
            for _ in range(60):
                frames.append(env.step(_random_actions(rng, env)).obs)
            frames.append(env.reset(seed=seed))  # an explicit seed reseeds like the construction seed
            return np.stack(frames)

    a, b, c = rollout(7), rollout(7), rollout(8)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a[0], a[-1])
    assert not np.array_equal(a[0], c[0])
    # Distinct envs of one batch are seeded differently.
    assert len({tuple(row) for row in a[0]}) == 4


def test_discrete_observations_become_one_hot() -> None:
    cfg = EnvConfig(id="FrozenLake-v1")
    spec = envs.env_spec(cfg)
    assert spec.observation_shape == (16,) and spec.observation_dtype == np.float32 and spec.num_actions == 4
    with envs.make_vector_env(cfg, 2, seed=0, training=True) as env:
        obs = env.reset()
        np.testing.assert_array_equal(obs, np.eye(16, dtype=np.float32)[[0, 0]])


def test_non_discrete_action_space_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"Pendulum-v1.*Box"):
        envs.make_vector_env(EnvConfig(id="Pendulum-v1"), 2, seed=0, training=True)


@pytest.mark.parametrize(
    ("env_id", "suggestion"),
    [("CartPol-v1", "CartPole-v1"), ("ALE/Pongg-v5", "ALE/Pong-v5"), ("ALE/pong-v5", "ALE/Pong-v5"),
     ("ALE/NoSuchGame-v5", "ALE/Breakout-v5"), ("PongNoFrameskip-v4", "ALE/Pong-v5")],
)
def test_unknown_ids_fail_with_one_line(env_id: str, suggestion: str) -> None:
    cfg = EnvConfig(id=env_id)
    for make in (envs.env_spec, lambda c: envs.make_vector_env(c, 1, seed=0, training=True),
                 lambda c: envs.make_render_env(c, seed=0)):
        with pytest.raises(ValueError) as info:
            make(cfg)
        message = str(info.value)
        assert env_id in message and suggestion in message and "\n" not in message


def test_cartpole_render_env_matches_spec() -> None:
    cfg = EnvConfig(id="CartPole-v1")
    env = envs.make_render_env(cfg, seed=0)
    obs, _ = env.reset()
    spec = envs.env_spec(cfg)
    assert obs.shape == spec.observation_shape and obs.dtype == spec.observation_dtype
    assert env.observation_space.shape == spec.observation_shape
    obs, *_ = env.step(0)
    assert obs.shape == spec.observation_shape and obs.dtype == spec.observation_dtype
    pytest.importorskip("pygame")  # CartPole draws with pygame, which is optional
    frame = env.render()
    assert frame.ndim == 3 and frame.shape[-1] == 3 and frame.dtype == np.uint8
    env.close()


# ----------------------------------------------------------------------------------------------------
# Atari (ALE native vector env)


@pytest.mark.parametrize(
    ("grayscale", "size", "full", "shape", "actions"),
    [
        (False, 96, False, (12, 96, 96), 6),
        (True, 84, False, (4, 84, 84), 6),
        (True, 84, True, (4, 84, 84), 18),
        (True, 64, False, (4, 64, 64), 6),
    ],
)
def test_pong_spec_and_random_steps(grayscale: bool, size: int, full: bool, shape: tuple[int, ...],
                                    actions: int) -> None:
    cfg = EnvConfig(id="ALE/Pong-v5", grayscale=grayscale, image_size=size, full_action_space=full)
    spec = envs.env_spec(cfg)
    assert spec.observation_shape == shape and spec.observation_dtype == np.uint8
    assert spec.num_actions == actions and spec.action_meanings is not None
    assert len(spec.action_meanings) == actions and spec.action_meanings[0] == "NOOP"
    with envs.make_vector_env(cfg, 4, seed=0, training=True) as env:
        obs = env.reset()
        assert obs.shape == (4, *shape) and obs.dtype == np.uint8
        # The stack is zero-padded after a reset: only the newest frame is drawn.
        channels = 1 if grayscale else 3
        assert not obs[:, :-channels].any() and obs[:, -channels:].any(axis=(1, 2, 3)).all()
        rng = np.random.default_rng(0)
        for _ in range(300):
            res = env.step(_random_actions(rng, env))
            assert res.obs.shape == (4, *shape) and res.obs.dtype == np.uint8
            assert res.reward.dtype == np.float32 and set(np.unique(res.reward)) <= {-1.0, 0.0, 1.0}
        assert res.obs[:, :-channels].any()  # the stack has filled up


def test_atari_env_threads_do_not_change_what_is_played() -> None:
    """env.num_threads only changes how many native threads step the envs: with one thread and with four, the
    same seed and actions give the same observations and rewards; a negative count names what is valid."""
    rng = np.random.default_rng(3)
    actions = rng.integers(0, 6, size=(120, 4))
    played = []
    for threads in (1, 4):
        with envs.make_vector_env(EnvConfig(id="ALE/Pong-v5", sticky_action_prob=0.0, num_threads=threads), 4,
                                  seed=5, training=True) as env:
            frames, rewards = [env.reset()], []
            for a in actions:
                res = env.step(a)
                frames.append(res.obs)
                rewards.append(res.reward)
        played.append((np.stack(frames), np.stack(rewards)))
    assert played[0][0][-1].any()
    np.testing.assert_array_equal(played[0][0], played[1][0])
    np.testing.assert_array_equal(played[0][1], played[1][1])
    with pytest.raises(ValueError, match=r"num_threads.*>= 0"):
        EnvConfig(id="ALE/Pong-v5", num_threads=-1)


def test_atari_render_env_matches_vector_env_exactly() -> None:
    # Without no-ops and sticky actions both pipelines see the same frames; this pins the shape, dtype,
    # channel order (frames oldest first, R G B within a frame) and every preprocessing step.
    cfg = EnvConfig(id="ALE/Pong-v5", noop_max=0, sticky_action_prob=0.0)
    spec = envs.env_spec(cfg)
    single = envs.make_render_env(cfg, seed=0)
    with envs.make_vector_env(cfg, 1, seed=0, training=False) as env:
        batched = env.reset()
        obs, _ = single.reset()
        assert obs.shape == spec.observation_shape and obs.dtype == spec.observation_dtype
        assert single.observation_space.shape == spec.observation_shape
        assert single.action_space.n == spec.num_actions
        np.testing.assert_array_equal(obs, batched[0])
        rng = np.random.default_rng(0)
        for _ in range(120):
            action = int(rng.integers(spec.num_actions))
            res = env.step(np.array([action]))
            obs, reward, terminated, _, _ = single.step(action)
            assert abs(obs.astype(int) - res.obs[0].astype(int)).max() <= 1
            assert reward == res.reward[0] and terminated == res.terminated[0]
    frame = single.render()
    assert frame.shape == (210, 160, 3) and frame.dtype == np.uint8 and frame.any()
    # The newest frame of the observation is the screen, resized.
    newest = obs[-3:].transpose(1, 2, 0).astype(float)
    assert abs(newest.mean(axis=(0, 1)) - frame.astype(float).mean(axis=(0, 1))).max() < 8
    single.close()


def test_atari_render_env_grayscale_shape() -> None:
    cfg = EnvConfig(id="ALE/Breakout-v5", grayscale=True, image_size=84)
    env = envs.make_render_env(cfg, seed=3)
    obs, _ = env.reset()
    assert obs.shape == (4, 84, 84) and obs.dtype == np.uint8
    obs, *_ = env.step(1)
    assert obs.shape == (4, 84, 84) and env.render().shape == (210, 160, 3)
    env.close()


def test_breakout_episodic_life_in_training_reports_whole_games() -> None:
    cfg = EnvConfig(id="ALE/Breakout-v5", grayscale=True, image_size=84, episodic_life=True)
    rng = np.random.default_rng(0)
    game_return = np.zeros(2)
    game_length = np.zeros(2, dtype=int)
    life_losses = np.zeros(2, dtype=int)
    finished: list[tuple[int, float, int, int]] = []  # (env, return, length, life losses before game over)
    with envs.make_vector_env(cfg, 2, seed=0, training=True) as env:
        env.reset()
        for _ in range(5000):
            res = env.step(_random_actions(rng, env))
            game_return += res.reward  # unclipped: clip_rewards is off
            game_length += 1
            done = res.terminated | res.truncated
            if res.final_obs is not None:
                assert done.any()
            returns = iter(zip(res.episode_returns, res.episode_lengths))
            for i in np.flatnonzero(done):
                # A lost life keeps the game going: the last observation of the episode is the current one.
                if np.array_equal(res.final_obs[i], res.obs[i]):
                    life_losses[i] += 1
                    continue
                ret, length = next(returns)
                finished.append((int(i), ret, length, int(life_losses[i])))
                assert ret == game_return[i] and length == game_length[i]
                game_return[i], game_length[i], life_losses[i] = 0.0, 0, 0
            assert next(returns, None) is None
            if len(finished) >= 2:
                break
    assert len(finished) >= 2
    for _, _, length, losses in finished:
        # Breakout has 5 lives: 4 lost lives end episodes for training, the 5th is the game over.
        assert losses == 4 and length > 50


def test_breakout_evaluation_never_uses_episodic_life_or_clipping() -> None:
    cfg = EnvConfig(id="ALE/Breakout-v5", grayscale=True, image_size=84, episodic_life=True,
                    clip_rewards=True)
    rng = np.random.default_rng(1)
    with envs.make_vector_env(cfg, 2, seed=0, training=False) as env:
        env.reset()
        games = 0
        for _ in range(5000):
            res = env.step(_random_actions(rng, env))
            # Every termination is a game over, reported with its return.
            assert len(res.episode_returns) == int((res.terminated | res.truncated).sum())
            games += len(res.episode_returns)
            if games >= 1:
                break
        assert games >= 1


def test_atari_reward_clipping_truncation_and_raw_returns() -> None:
    # MsPacman pays 10 per pellet: clipped rewards are 1 while the reported returns stay raw.
    base = EnvConfig(id="ALE/MsPacman-v5", grayscale=True, image_size=84, max_episode_steps=150,
                     episodic_life=False)
    for training, clip in ((True, True), (False, True), (True, False)):
        cfg = dataclasses.replace(base, clip_rewards=clip)
        rng = np.random.default_rng(0)
        with envs.make_vector_env(cfg, 2, seed=0, training=training) as env:
            prev = env.reset()
            total = np.zeros(2)
            for t in range(150):
                res = env.step(_random_actions(rng, env))
                total += res.reward
                if t < 149:
                    assert not (res.terminated | res.truncated).any()
                    prev = res.obs
        assert res.truncated.all() and not res.terminated.any()
        assert res.episode_lengths == [150, 150]
        assert res.final_obs is not None
        # The final observation continues the previous stack; obs is the next game's first (zero-padded).
        np.testing.assert_array_equal(res.final_obs[:, :-1], prev[:, 1:])
        assert not res.obs[:, :-1].any()
        if training and clip:
            assert set(np.unique(res.reward)) <= {0.0, 1.0} and total.max() > 0
            # Every MsPacman reward is at least 10: the raw return is at least 10 per rewarded step.
            for raw, clipped in zip(res.episode_returns, total):
                assert raw >= 10 * clipped
        else:
            assert max(res.episode_returns) > 0 and res.episode_returns == total.tolist()


def test_atari_render_env_matches_vector_env_in_grayscale_64() -> None:
    # The `atari` preset's observations: the evaluation pipeline must give what the network was trained on.
    cfg = EnvConfig(id="ALE/Pong-v5", noop_max=0, sticky_action_prob=0.0, grayscale=True, image_size=64)
    single = envs.make_render_env(cfg, seed=0)
    with envs.make_vector_env(cfg, 1, seed=0, training=False) as env:
        np.testing.assert_array_equal(single.reset()[0], env.reset()[0])
        rng = np.random.default_rng(0)
        for _ in range(200):
            action = int(rng.integers(env.spec.num_actions))
            res = env.step(np.array([action]))
            obs = single.step(action)[0]
            assert obs.shape == (4, 64, 64) and abs(obs.astype(int) - res.obs[0].astype(int)).max() <= 1
    single.close()


def test_atari_seeding_is_reproducible() -> None:
    cfg = EnvConfig(id="ALE/Breakout-v5", grayscale=True, image_size=84)  # sticky actions and no-ops on

    def rollout(seed: int) -> tuple[np.ndarray, np.ndarray]:
        with envs.make_vector_env(cfg, 2, seed=seed, training=True) as env:
            rng = np.random.default_rng(0)
            frames, rewards = [env.reset()], []
            for _ in range(100):
                res = env.step(_random_actions(rng, env))
                frames.append(res.obs)
                rewards.append(res.reward)
            return np.stack(frames), np.stack(rewards)

    (fa, ra), (fb, rb), (fc, _) = rollout(5), rollout(5), rollout(6)
    np.testing.assert_array_equal(fa, fb)
    np.testing.assert_array_equal(ra, rb)
    assert not np.array_equal(fa, fc)


@pytest.mark.parametrize("env_id", ["ALE/Breakout-v5", "CartPole-v1"])
def test_a_kept_vector_env_reset_with_a_seed_plays_the_games_of_a_new_one(env_id: str) -> None:
    """What the evaluation actor relies on when it keeps its envs from one evaluation to the next: reset(seed)
    after other games (left mid-game) gives the frames and rewards of new envs reset with that seed, sticky
    actions and no-op starts included."""
    cfg = EnvConfig(id=env_id, grayscale=True, image_size=84) if env_id.startswith("ALE/") else EnvConfig(id=env_id)

    def play(env: envs.BatchedEnv, seed: int, steps: int = 60) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(0)
        frames, rewards = [env.reset(seed=seed)], []
        for _ in range(steps):
            res = env.step(_random_actions(rng, env))
            frames.append(res.obs)
            rewards.append(res.reward)
        return np.stack(frames), np.stack(rewards)

    with envs.make_vector_env(cfg, 3, seed=5, training=False) as new:
        expected = play(new, 5)
    with envs.make_vector_env(cfg, 3, seed=9, training=False) as kept:
        other = play(kept, 9, steps=37)
        again = play(kept, 5)
    np.testing.assert_array_equal(again[0], expected[0])
    np.testing.assert_array_equal(again[1], expected[1])
    assert not np.array_equal(other[0], expected[0][:38])  # the other games were other games


def test_env_spec_is_cached_and_matches_vector_env() -> None:
    for cfg in (EnvConfig(id="CartPole-v1"), EnvConfig(id="ALE/Breakout-v5", full_action_space=True)):
        spec = envs.env_spec(cfg)
        assert envs.env_spec(dataclasses.replace(cfg)) is spec
        with envs.make_vector_env(cfg, 2, seed=0, training=False) as env:
            obs = env.reset()
            assert env.spec == spec
            assert obs.shape[1:] == spec.observation_shape and obs.dtype == spec.observation_dtype


def test_selfplay_sends_atari_segments_as_frames_that_restack_exactly() -> None:
    """With replay.frame_stack, self-play sends each step's newest frame plus the first observation's older
    frames; restacked they are exactly the observations a stacked-form worker with the same seed sends."""
    from rayzero.actors.selfplay import SelfPlayWorker
    from rayzero.config import ModelConfig, ReplayConfig
    from rayzero.tree import SearchConfig

    env_cfg = EnvConfig(id="ALE/Pong-v5", num_envs=2, image_size=84, grayscale=True)
    model = ModelConfig(kind="resnet", channels=8, blocks=1, support_size=5, reduced_channels=2, head_hidden=8)
    search = SearchConfig(num_simulations=2)
    sent: dict[int, list] = {0: [], 4: []}
    for k in sent:
        replay = ReplayConfig(segment_length=6, unroll_steps=1, td_steps=1, frame_stack=k)
        worker = SelfPlayWorker(env_cfg, model, search, replay, seed=3, sink=sent[k].append)
        worker.collect(20)
        worker.env.close()
    assert len(sent[4]) == len(sent[0]) >= 4
    for framed, stacked in zip(sent[4], sent[0]):
        assert stacked.history is None and framed.history.shape == (3, 1, 84, 84)
        assert framed.obs.shape == (len(stacked.actions), 1, 84, 84)
        np.testing.assert_array_equal(framed.stacked_obs(), stacked.obs)
        np.testing.assert_array_equal(framed.actions, stacked.actions)
    assert any(f.history.any() for f in sent[4])  # mid-episode segments carry real older frames


def test_self_play_envs_can_play_without_sticky_actions_while_evaluation_keeps_them() -> None:
    """env.train_sticky_action_prob applies to the training envs only: with it at 0 they play what envs without
    sticky actions play, while evaluation envs of the same config still repeat actions (and so play otherwise)."""
    rng = np.random.default_rng(4)
    actions = rng.integers(0, 6, size=(150, 2))

    def play(cfg: EnvConfig, training: bool) -> np.ndarray:
        with envs.make_vector_env(cfg, 2, seed=7, training=training) as env:
            frames = [env.reset()]
            frames += [env.step(a).obs for a in actions]
        return np.stack(frames)

    base = dict(id="ALE/Pong-v5", noop_max=0, num_threads=1)
    split = EnvConfig(**base, sticky_action_prob=0.9, train_sticky_action_prob=0.0)
    np.testing.assert_array_equal(play(split, True), play(EnvConfig(**base, sticky_action_prob=0.0), True))
    evaluated = play(split, False)
    assert not np.array_equal(evaluated, play(EnvConfig(**base, sticky_action_prob=0.0), False))
    np.testing.assert_array_equal(evaluated, play(EnvConfig(**base, sticky_action_prob=0.9), False))
    with pytest.raises(ValueError, match=r"train_sticky_action_prob=1.0.*\[0, 1\)"):
        EnvConfig(id="ALE/Pong-v5", train_sticky_action_prob=1.0)


def _noop_until_game_over(cfg: EnvConfig, training: bool, steps: int) -> tuple[list[np.ndarray], list[float]]:
    """Always NOOP in one Breakout env for `steps` steps: the actions played, and the games that ended."""
    played, games = [], []
    with envs.make_vector_env(cfg, 1, seed=3, training=training) as env:
        env.reset()
        for _ in range(steps):
            res = env.step(np.zeros(1, dtype=np.int64))
            played.append(res.actions.copy())
            games += res.episode_returns
            if games:
                break
    return played, games


@pytest.mark.parametrize("training", [False, True])
def test_fire_reset_serves_every_life_of_an_agent_that_never_fires(training: bool) -> None:
    """Breakout serves only on FIRE. An agent that always plays NOOP waits forever without `fire_reset`; with it
    the env presses FIRE for the first two steps of each of the 5 lives, the misses end the game, and the actions
    played say so (the self-play actor stores them, not the agent's)."""
    base = dict(id="ALE/Breakout-v5", grayscale=True, image_size=64, num_threads=1)
    fire = envs.env_spec(EnvConfig(**base)).action_meanings.index("FIRE")
    played, games = _noop_until_game_over(EnvConfig(**base), training, 1500)
    assert not games and not np.concatenate(played).any()  # 1,500 steps, no serve, no lost life
    played, games = _noop_until_game_over(EnvConfig(**base, fire_reset=True), training, 5000)
    assert len(games) == 1 and games[0] >= 0
    fired = np.flatnonzero(np.concatenate(played) == fire)
    # Two presses at the game's start, then two after each of the 4 lives lost before the game over.
    assert len(fired) == 2 * 5 and fired[0] == 0 and fired[1] == 1
    assert np.all(fired[1::2] == fired[0::2] + 1) and np.all(np.diff(fired[0::2]) > 20)
    assert set(np.unique(np.concatenate(played))) == {0, fire}


def test_fire_reset_in_the_render_env_and_games_without_fire() -> None:
    """The GIF's env presses FIRE as the vector env does (info['action']); a game without FIRE is unchanged."""
    cfg = EnvConfig(id="ALE/Breakout-v5", grayscale=True, image_size=64, fire_reset=True)
    env = envs.make_render_env(cfg, seed=3)
    env.reset()
    actions, lives, ended = [], [], False
    for _ in range(5000):
        _, _, terminated, truncated, info = env.step(0)
        actions.append(info["action"])
        lives.append(info["lives"])
        if terminated or truncated:
            ended = True
            break
    env.close()
    assert ended and lives[-1] == 0
    fired = np.flatnonzero(np.array(actions) == 1)
    assert len(fired) == 10 and list(fired[:2]) == [0, 1]
    # A game whose action set has no FIRE (MsPacman's minimal set): the agent's actions stand.
    cfg = EnvConfig(id="ALE/MsPacman-v5", grayscale=True, image_size=64, fire_reset=True, num_threads=1)
    assert "FIRE" not in envs.env_spec(cfg).action_meanings
    with envs.make_vector_env(cfg, 2, seed=0, training=False) as vec:
        vec.reset()
        assert vec.step(np.array([3, 4])).actions.tolist() == [3, 4]
    with pytest.raises(ValueError, match=r"fire_reset=True.*ALE namespace"):
        EnvConfig(id="CartPole-v1", fire_reset=True)


def test_selfplay_stores_the_fire_that_fire_reset_played() -> None:
    """Self-play's segments hold the actions the env played: FIRE at each game's first two steps with
    `fire_reset`, whatever the search chose, so the dynamics learn from what happened."""
    from rayzero.actors.selfplay import SelfPlayWorker
    from rayzero.config import ModelConfig, ReplayConfig
    from rayzero.tree import SearchConfig

    model = ModelConfig(kind="resnet", channels=8, blocks=1, support_size=5, reduced_channels=2, head_hidden=8)
    replay = ReplayConfig(segment_length=6, unroll_steps=1, td_steps=1)
    firsts = {}
    for fire_reset in (False, True):
        env_cfg = EnvConfig(id="ALE/Breakout-v5", num_envs=4, image_size=64, grayscale=True, fire_reset=fire_reset)
        sent: list = []
        worker = SelfPlayWorker(env_cfg, model, SearchConfig(num_simulations=2), replay, seed=5, sink=sent.append)
        worker.collect(8)
        worker.env.close()
        assert len(sent) == 4  # each env's first 6 steps, from its game's start
        firsts[fire_reset] = np.stack([s.actions[:2] for s in sent])
    assert (firsts[True] == 1).all()
    assert not (firsts[False] == 1).all()  # an untrained search with temperature 1 picks all four actions
