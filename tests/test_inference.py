"""The inference actor (CPU): batched answers equal direct calls; bad requests fail alone; weight swaps."""

import asyncio

import numpy as np
import pytest
import torch

from rayzero.config import InferenceConfig, ModelConfig
from rayzero.inference import InferenceError, InferenceServer, bucket_ladder

MODEL = ModelConfig(kind="mlp", latent_dim=8, hidden=16, support_size=5)


def server(**overrides):
    cfg = InferenceConfig(**{"device": "cpu", "max_batch": 64, "min_bucket": 4, "max_wait_us": 2000, **overrides})
    return InferenceServer(MODEL, cfg, (4,), 3, seed=0)


def test_bucket_ladder():
    assert bucket_ladder(8, 100) == [8, 16, 32, 64, 100]
    assert bucket_ladder(4, 4) == [4]


def test_concurrent_requests_are_batched_and_match_direct_calls():
    srv = server()
    rng = np.random.default_rng(0)
    obs = [rng.normal(size=(n, 4)).astype(np.float32) for n in (1, 3, 5, 2)]

    async def go():
        roots = await asyncio.gather(*[srv.initial(f"c{i}", o) for i, o in enumerate(obs)])
        actions = [rng.integers(0, 3, size=len(o)) for o in obs]
        steps = await asyncio.gather(*[srv.recurrent(f"c{i}", r["handles"], a)
                                       for i, (r, a) in enumerate(zip(roots, actions))])
        return roots, actions, steps

    roots, actions, steps = asyncio.run(go())
    model = srv.model
    with torch.no_grad():
        for o, r, a, s in zip(obs, roots, actions, steps):
            direct = model.initial(torch.from_numpy(o))
            np.testing.assert_allclose(r["value"], direct.value.numpy(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(r["policy_logits"], direct.policy_logits.numpy(), rtol=1e-5, atol=1e-6)
            nxt = model.recurrent(direct.latent, torch.from_numpy(a))
            np.testing.assert_allclose(s["reward"], nxt.reward.numpy(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(s["value"], nxt.value.numpy(), rtol=1e-5, atol=1e-6)
    stats = srv.stats()["buckets"]
    assert sum(b["count"] for b in stats.values()) < 8  # 8 requests, fewer batches
    assert sum(b["rows"] for b in stats.values()) == 22


def test_bad_requests_fail_alone():
    srv = server()
    good_obs = np.zeros((2, 4), dtype=np.float32)

    async def go():
        results = await asyncio.gather(
            srv.initial("ok", good_obs),
            srv.initial("shape", np.zeros((2, 5), dtype=np.float32)),
            srv.initial("nan", np.full((2, 4), np.nan, dtype=np.float32)),
            srv.recurrent("nobody", np.array([0, 1]), np.array([0, 1])),
            srv.recurrent("dtype", np.array([0, 1]), np.array([0.5, 1.0])),
            return_exceptions=True,
        )
        after = await srv.initial("ok", good_obs)
        return results, after

    results, after = asyncio.run(go())
    assert isinstance(results[0], dict)
    for error, needle in zip(results[1:], ["obs shape", "NaN", "unknown latent handles", "integer"]):
        assert isinstance(error, InferenceError) and needle in str(error), error
    assert after["handles"].shape == (2,)
    assert srv.stats()["errors"] == 4


def test_release_and_pool_exhaustion():
    srv = server(latent_pool_size=6)

    async def go():
        first = await srv.initial("a", np.zeros((4, 4), dtype=np.float32))
        with pytest.raises(InferenceError, match="latent pool exhausted"):
            await srv.initial("a", np.zeros((3, 4), dtype=np.float32))
        # Another client reclaims the least recently used client's slots.
        await srv.initial("b", np.zeros((5, 4), dtype=np.float32))
        with pytest.raises(InferenceError, match="unknown latent handles"):
            await srv.recurrent("a", first["handles"], np.zeros(4, dtype=np.int64))
        assert await srv.release("b") == 5

    asyncio.run(go())


def test_weight_swap_changes_outputs_and_version():
    srv = server()
    obs = np.ones((3, 4), dtype=np.float32)
    before = asyncio.run(srv.initial("c", obs))
    state = {k: v + 0.1 for k, v in srv.model.state_dict().items()}
    assert srv.set_weights(7, state) == 7 and srv.get_version() == 7
    after = asyncio.run(srv.initial("c", obs))
    assert not np.allclose(before["policy_logits"], after["policy_logits"])
    with torch.no_grad():
        expected = srv.model.initial(torch.from_numpy(obs)).policy_logits.numpy()
    np.testing.assert_allclose(after["policy_logits"], expected, rtol=1e-5)


def test_served_through_ray_to_a_selfplay_search():
    """The central mode end to end: a remote evaluator drives a batched search; latents stay in the actor."""
    import ray

    from rayzero.actors.evaluator import RemoteEvaluator
    from rayzero.tree import SearchConfig, search

    ray.init(num_cpus=1, include_dashboard=False)
    try:
        cfg = InferenceConfig(device="cpu", max_batch=64, min_bucket=4, max_wait_us=500)
        actor = ray.remote(InferenceServer).options(max_concurrency=100).remote(MODEL, cfg, (4,), 3, 0)
        evaluator = RemoteEvaluator(actor, 0.99, "client-0")
        root = evaluator.root(np.zeros((5, 4), dtype=np.float32))
        out = search(root, evaluator.recurrent_fn, 8, SearchConfig(dirichlet_fraction=0.0))
        evaluator.release()
        assert out.visit_counts.sum(1).tolist() == [8] * 5
        assert ray.get(actor.stats.remote())["free_slots"] == 65536
    finally:
        ray.shutdown()
