"""`python -m rayzero.bench.learner --preset`: the learner-alone reference of a training run's learner."""
import dataclasses

import numpy as np

import ray

from rayzero.bench.learner import QUICK, preset_row

SMALL = ["learner.batch_size=8", "model.channels=16", "learner.steps_per_call=3"]


def test_the_preset_reference_runs_the_learner_where_training_runs_it():
    """With the learner colocated (as the atari preset runs it on one GPU), the bench trains it inside the
    inference actor's process, through the same handle as training, in the thread's compile mode; otherwise as
    an actor of its own. Both time real train calls: the steps they report are the steps the learner made."""
    sizes = dataclasses.replace(QUICK, capacity=2_000, timed_calls=2, bare_steps=2)
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        rows = {colocated: preset_row("atari", SMALL, sizes, gpu=False, colocated=colocated)
                for colocated in (True, False)}
    finally:
        ray.shutdown()
    for colocated, row in rows.items():
        assert row["colocated"] is colocated
        assert row["obs_shape"] == [4, 64, 64] and row["target_network"]
        assert row["loop_steps_per_second"] > 0 and row["bare_steps_per_second"] > 0
        assert len(row["call_ms"]) == sizes.timed_calls
    # A thread other than the main one compiles without inductor's CUDA graphs (cluster/colocated.py).
    assert rows[True]["variant"].startswith("default") and rows[False]["variant"].startswith("reduce-overhead")


def test_the_reference_trains_on_the_preset_games_frames():
    """The bench's replay holds the preset's game as a run sees it: the frames of the env played with the
    recorded actions, segment by segment (here 2 envs, 2 segments of 30 steps)."""
    from rayzero import config as config_lib
    from rayzero.bench.learner import SyntheticReplay
    from rayzero.envs import env_spec, make_vector_env

    cfg = config_lib.load("atari", ["replay.frame_stack=0", "replay.capacity=60", "replay.min_size=0",
                                    "replay.shared_obs=false"])
    replay = SyntheticReplay(cfg.replay, 0)
    filled = replay.fill_from_env(cfg.env, env_spec(cfg.env).num_actions, length=30, seed=3, num_envs=2)
    assert filled["frames"] == "env" and filled["total_added"] == 2 * 20  # 30 - 10 sampleable positions a segment
    env = make_vector_env(cfg.env, 2, 3, training=True)
    obs = env.reset()
    first, second = np.arange(30), np.arange(30, 60)  # env 0's segment, then env 1's
    actions = replay._arrays["action"]
    assert obs.std() > 0  # a game's screen, not a blank one
    for t in range(30):
        assert np.array_equal(replay.obs_at(first[t:t + 1])[0], obs[0])
        assert np.array_equal(replay.obs_at(second[t:t + 1])[0], obs[1])
        obs = env.step(np.array([actions[first[t]], actions[second[t]]])).obs
    env.close()
