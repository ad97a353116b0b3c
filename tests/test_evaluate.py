"""Evaluation through the inference actor (how a GPU host evaluates) against the same weights searched locally."""

import numpy as np
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
