"""Evaluation through the inference actor (how a GPU host evaluates) against the same weights searched locally."""

import numpy as np
import pytest
import torch

from rayzero.actors.evaluate import EvalWorker
from rayzero.config import EnvConfig, InferenceConfig, ModelConfig
from rayzero.envs import env_spec
from rayzero.inference.server import InferenceServer
from rayzero.models import build_model
from rayzero.tree import SearchConfig


def test_evaluation_through_the_inference_actor_plays_the_local_evaluations_episodes():
    import ray

    env_cfg = EnvConfig(id="CartPole-v1")
    model_cfg = ModelConfig(kind="mlp", latent_dim=16, hidden=32, support_size=5)
    search_cfg = SearchConfig(num_simulations=8)
    spec = env_spec(env_cfg)
    model = build_model(model_cfg, spec.observation_shape, spec.num_actions)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # random heads, so that the greedy actions depend on the observations
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    weights = (7, {k: v.clone() for k, v in model.state_dict().items()})

    local = EvalWorker(env_cfg, model_cfg, search_cfg, 0.99).evaluate(weights, 3, 60, seed=11)
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        cfg = InferenceConfig(device="cpu", max_batch=16, min_bucket=4)
        server = ray.remote(InferenceServer).options(max_concurrency=100).remote(
            model_cfg, cfg, spec.observation_shape, spec.num_actions, 0, search_cfg=search_cfg, discount=0.99)
        ray.get(server.set_weights.remote(*weights))
        remote = EvalWorker(env_cfg, model_cfg, search_cfg, 0.99, server=server).evaluate(weights, 3, 60, seed=11)
    finally:
        ray.shutdown()
    assert remote["returns"] == local["returns"]
    assert remote["version"] == remote["last_version"] == 7  # the weights the inference actor searched with
    assert 0 < remote["steps"] <= 60
    assert not np.isnan(remote["mean"])
    # Where its time went: each step's search round trip, of which the inference actor's queue and device time
    # are parts, and the env steps; a local evaluation has no inference actor to ask.
    assert remote["search_seconds"] + remote["env_seconds"] <= remote["seconds"]
    assert 0 < remote["queue_seconds"] + remote["device_seconds"] < remote["search_seconds"]
    assert local["search_seconds"] > 0 and local["queue_seconds"] == local["device_seconds"] == 0
    assert local["steps"] == remote["steps"]  # the same games, played step for step
    # CartPole pays 1 a step, the last included: each game's length is its return, and the longest one's is
    # the batched steps played.
    assert remote["lengths"] == [int(r) for r in remote["returns"]] and max(remote["lengths"]) == remote["steps"]


def test_a_pinned_evaluation_plays_its_own_weights_while_the_served_ones_change():
    """inference.pinned_eval: an evaluation through the inference actor plays the weights it was given (the local
    evaluation's games, step for step) although the actor serves other weights, before and while it plays;
    without it, the same evaluation plays the served weights. A client not named by set_eval_weights keeps
    the served weights, and the evaluation network refuses more roots than its graphs' bucket."""
    import ray

    from rayzero.inference.errors import InferenceError

    env_cfg = EnvConfig(id="CartPole-v1")
    model_cfg = ModelConfig(kind="mlp", latent_dim=16, hidden=32, support_size=5)
    search_cfg = SearchConfig(num_simulations=8)
    spec = env_spec(env_cfg)

    def random_weights(seed: int) -> dict:
        model = build_model(model_cfg, spec.observation_shape, spec.num_actions)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
        return {k: v.clone() for k, v in model.state_dict().items()}

    evaluated, served = (7, random_weights(7)), (9, random_weights(5))
    local = {v: EvalWorker(env_cfg, model_cfg, search_cfg, 0.99).evaluate((v, w), 3, 60, seed=11)["returns"]
             for v, w in (evaluated, served)}
    assert local[7] != local[9]  # the two agents play differently
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        results = {}
        for pinned in (True, False):
            cfg = InferenceConfig(device="cpu", max_batch=16, min_bucket=4, pinned_eval=pinned)
            server = ray.remote(InferenceServer).options(max_concurrency=100).remote(
                model_cfg, cfg, spec.observation_shape, spec.num_actions, 0, search_cfg=search_cfg, discount=0.99,
                eval_rows=3)
            ray.get(server.set_weights.remote(*served))
            worker = ray.remote(EvalWorker).options(max_concurrency=2).remote(
                env_cfg, model_cfg, search_cfg, 0.99, server=server)
            ref = worker.evaluate.remote(evaluated, 3, 60, 11)
            ray.get(server.set_weights.remote(*served))  # new served weights while it plays change nothing
            results[pinned] = ray.get(ref)
            if pinned:
                obs = np.zeros((2, *spec.observation_shape), np.float32)
                other = ray.get(server.search.remote("selfplay-0", obs, temperature=0.0, dirichlet_fraction=0.0,
                                                     gumbel_scale=0.0))
                assert other["version"] == 9  # not an evaluation's client: the served weights
                eval_client = ray.get(worker.__ray_call__.remote(lambda w: w.network.client_id))
                assert ray.get(server.stats.remote())["eval_version"] == 7
                with pytest.raises(InferenceError, match="at most 4"):
                    ray.get(server.search.remote(eval_client, np.zeros((5, *spec.observation_shape), np.float32),
                                                 temperature=0.0, dirichlet_fraction=0.0, gumbel_scale=0.0))
    finally:
        ray.shutdown()
    assert results[True]["pinned"] and results[True]["returns"] == local[7]
    assert results[True]["version"] == results[True]["last_version"] == 7
    assert not results[False]["pinned"] and results[False]["returns"] == local[9]
    assert results[False]["version"] == 9


def _mountain_car_worker():
    env_cfg = EnvConfig(id="MountainCar-v0")  # 200 steps an episode under a policy that has not learned
    model_cfg = ModelConfig(kind="mlp", latent_dim=16, hidden=32, support_size=5)
    search_cfg = SearchConfig(num_simulations=8)
    spec = env_spec(env_cfg)
    model = build_model(model_cfg, spec.observation_shape, spec.num_actions)
    return (env_cfg, model_cfg, search_cfg), (1, model.state_dict())


def test_a_cancelled_evaluation_plays_no_further_and_says_so():
    """A token cancelled before its evaluation starts: no step is played; another token plays whole episodes."""
    args, weights = _mountain_car_worker()
    worker = EvalWorker(*args, 0.99)
    worker.cancel(5)
    cancelled = worker.evaluate(weights, 2, 1000, seed=0, token=5)
    assert cancelled["cancelled"] and cancelled["steps"] == 0 and cancelled["returns"] == [0.0, 0.0]
    played = worker.evaluate(weights, 2, 1000, seed=0, token=6)
    assert not played["cancelled"] and played["returns"] == [-200.0, -200.0]
    assert worker.evaluate(weights, 2, 1000, seed=0, token=5)["returns"] == [-200.0, -200.0]  # used up


def test_an_evaluation_with_a_time_budget_ends_its_episodes_where_they_are_and_counts_them():
    """run.final_eval_seconds: MountainCar's 200-step episodes against a budget far shorter than they take end
    early, each with its return so far (-1 a step) and counted as unfinished; without a budget they finish."""
    args, weights = _mountain_car_worker()
    worker = EvalWorker(*args, 0.99)
    whole = worker.evaluate(weights, 2, 1000, seed=0)
    assert whole["returns"] == [-200.0, -200.0] and whole["unfinished"] == 0 and whole["lengths"] == [200, 200]
    cut = worker.evaluate(weights, 2, 1000, seed=0, seconds=0.05)
    assert not cut["cancelled"] and cut["unfinished"] == 2
    assert 0 < cut["steps"] < 200 and cut["returns"] == [-float(cut["steps"])] * 2
    assert cut["lengths"] == [cut["steps"]] * 2
    capped = worker.evaluate(weights, 2, 50, seed=0)  # the step cap counts the same way
    assert capped["returns"] == [-50.0, -50.0] and capped["unfinished"] == 2 and capped["lengths"] == [50, 50]


def test_the_evaluation_actor_keeps_its_envs_and_plays_the_games_of_new_ones():
    """Evaluations of as many games reuse the worker's envs (making Atari envs costs more than a short
    evaluation's steps); each resets them with its seed, so it plays what a new worker plays, also after an
    evaluation cut mid-game. Another count of games makes new envs."""
    env_cfg = EnvConfig(id="CartPole-v1")
    model_cfg = ModelConfig(kind="mlp", latent_dim=16, hidden=32, support_size=5)
    args = (env_cfg, model_cfg, SearchConfig(num_simulations=4), 0.99)
    spec = env_spec(env_cfg)
    model = build_model(model_cfg, spec.observation_shape, spec.num_actions)
    generator = torch.Generator().manual_seed(4)  # heads that balance for 41-92 steps, by the seed's games
    with torch.no_grad():  # random heads: the greedy actions, so the games' lengths, depend on the observations
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    weights = (1, {k: v.clone() for k, v in model.state_dict().items()})
    worker = EvalWorker(*args)
    first = worker.evaluate(weights, 3, 500, seed=3)
    kept = worker._envs
    cut = worker.evaluate(weights, 3, 4, seed=4)  # leaves the envs mid-game
    again = worker.evaluate(weights, 3, 500, seed=3)
    assert worker._envs is kept and cut["unfinished"] == 3
    assert again["lengths"] == first["lengths"] == EvalWorker(*args).evaluate(weights, 3, 500, seed=3)["lengths"]
    assert again["returns"] == first["returns"]
    assert first["lengths"] != worker.evaluate(weights, 3, 500, seed=4)["lengths"]  # the seed decides the games
    three = worker.evaluate(weights, 2, 5, seed=3)
    assert worker._envs is not kept and worker._envs.num_envs == 2 and three["lengths"] == [5, 5]


def test_the_evaluation_actor_takes_a_cancel_while_it_plays():
    """As the plan makes it (two threads), the actor ends an evaluation in play when cancelled: the run's end
    does not wait for an evaluation whose result it would not use."""
    import ray

    from rayzero.cluster.plan import plan
    from rayzero.config import load

    args, weights = _mountain_car_worker()
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        options = plan(load("cartpole"), {"CPU": 2.0}).evaluation.actor_options()
        actor = ray.remote(EvalWorker).options(**options).remote(*args, 0.99)
        ref = actor.evaluate.remote(weights, 2, 1000, 0, 1)
        ray.get(actor.cancel.remote(1))
        result = ray.get(ref, timeout=60)
    finally:
        ray.shutdown()
    assert result["cancelled"] and result["steps"] < 200
