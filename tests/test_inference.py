"""The inference actor (CPU): batched answers equal direct calls; bad requests fail alone; weight swaps."""

import asyncio
import collections
import copy
import dataclasses
import threading
import time
import types

import numpy as np
import pytest
import torch

from rayzero.config import InferenceConfig, ModelConfig
from rayzero.inference import InferenceError, InferenceOverloaded, InferenceServer, bucket_ladder
from rayzero.models import build_model

MODEL = ModelConfig(kind="mlp", latent_dim=8, hidden=16, support_size=5)


def server(**overrides):
    cfg = InferenceConfig(**{"device": "cpu", "max_batch": 64, "min_bucket": 4, "max_wait_us": 2000, **overrides})
    return InferenceServer(MODEL, cfg, (4,), 3, seed=0)


def test_bucket_ladder():
    assert bucket_ladder(8, 100) == [8, 16, 32, 64, 100]
    assert bucket_ladder(4, 4) == [4]
    # inference.ladder_steps: midpoints of each doubling, whole rows only, max_batch always last
    assert bucket_ladder(8, 100, 2) == [8, 12, 16, 24, 32, 48, 64, 96, 100]
    assert bucket_ladder(1, 8, 2) == [1, 2, 3, 4, 6, 8]
    assert bucket_ladder(256, 1024, 4) == [256, 320, 384, 448, 512, 640, 768, 896, 1024]
    with pytest.raises(ValueError, match="steps=0"):
        bucket_ladder(8, 64, 0)


def test_a_finer_ladder_serves_a_batch_in_its_midpoint_bucket():
    srv = server(ladder_steps=2)
    assert srv.ladder == [4, 6, 8, 12, 16, 24, 32, 48, 64]
    obs = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    out = asyncio.run(srv.initial("c", obs))
    with torch.no_grad():
        np.testing.assert_allclose(out["value"], srv.model.initial(torch.from_numpy(obs)).value.numpy(),
                                   rtol=1e-5, atol=1e-6)
    assert list(srv.stats()["buckets"]) == ["initial/6"]  # 5 rows: the 6 bucket, not 8


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


def test_value_prefix_model_served_through_latent_handles():
    """A value-prefix model's packed latents live in the pool like any latent: two served steps give the
    rewards (prefix differences) and values of direct calls."""
    prefix_model = dataclasses.replace(MODEL, value_prefix=True, lstm_hidden=6, value_prefix_horizon=5)
    srv = InferenceServer(prefix_model, InferenceConfig(device="cpu", max_batch=16, min_bucket=4), (4,), 3, seed=0)
    state = {k: v + 0.1 * torch.randn_like(v) if v.is_floating_point() else v
             for k, v in srv.model.state_dict().items()}  # non-zero heads, so rewards are not all 0
    asyncio.run(srv.set_weights(1, state))
    obs = np.random.default_rng(1).normal(size=(5, 4)).astype(np.float32)
    actions = [np.array([0, 1, 2, 1, 0]), np.array([2, 2, 1, 0, 1])]

    async def go():
        root = await srv.initial("p", obs)
        first = await srv.recurrent("p", root["handles"], actions[0])
        second = await srv.recurrent("p", first["handles"], actions[1])
        return first, second

    served = asyncio.run(go())
    with torch.no_grad():
        out = srv.model.initial(torch.from_numpy(obs))
        for step, a in zip(served, actions):
            out = srv.model.recurrent(out.latent, torch.from_numpy(a))
            np.testing.assert_allclose(step["reward"], out.reward.numpy(), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(step["value"], out.value.numpy(), rtol=1e-5, atol=1e-5)
    assert np.abs(served[1]["reward"]).max() > 0


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


def test_more_bad_requests_fail_alone_and_the_server_serves_on():
    """Each gives an InferenceError naming the problem, good requests batched with them are answered, and the
    server serves afterwards: inf, dtypes that are no numbers, a ragged obs, actions out of range, handles out
    of the pool, a client name that is not a str (it used to fail the whole batch it was in)."""
    srv = server(latent_pool_size=32)
    good = np.zeros((2, 4), dtype=np.float32)

    async def go():
        root = await srv.initial("c", good)
        results = await asyncio.gather(
            srv.initial("ok", good),
            srv.initial("inf", np.full((2, 4), -np.inf)),
            srv.initial("str", np.full((2, 4), "a")),
            srv.initial("complex", np.zeros((2, 4), np.complex64)),
            srv.initial("ragged", [[1.0, 2.0, 3.0, 4.0], [1.0]]),
            srv.initial(["not", "a", "name"], good),
            srv.recurrent("c", root["handles"], np.array([0, 3])),
            srv.recurrent("c", root["handles"], np.array([-1, 0])),
            srv.recurrent("c", np.array([-1, 0]), np.array([0, 0])),
            srv.recurrent("c", np.array([10**12, 0]), np.array([0, 0])),
            srv.search("s", good, np.zeros((2, 3), np.int64)),
            return_exceptions=True,
        )
        after = await srv.recurrent("c", root["handles"], np.array([2, 1]))
        return results, after

    results, after = asyncio.run(go())
    assert isinstance(results[0], dict) and results[0]["handles"].shape == (2,)
    needles = ["NaN or inf", "dtype <U1", "dtype complex64", "not an array", "client must be a str",
               r"actions must be in [0, 3)", r"actions must be in [0, 3)", "out of range", "out of range",
               "invalid_actions must be bool"]
    for error, needle in zip(results[1:], needles):
        assert isinstance(error, InferenceError) and needle in str(error), (needle, error)
    assert after["handles"].shape == (2,) and np.isfinite(after["value"]).all()
    assert srv.stats()["errors"] == len(needles)


def test_requests_beyond_max_queue_are_refused_as_overloaded():
    """Backpressure: with max_queue rows waiting, a request that would pass it fails at once (not counted as a
    bad request) and nothing else changes; one that finds the queues empty is taken whatever its size."""
    srv = server(max_queue=8, max_wait_us=100_000)
    obs = np.zeros((3, 4), dtype=np.float32)

    async def go():
        first = await asyncio.gather(srv.initial("a", obs), srv.initial("b", obs), srv.initial("c", obs),
                                     return_exceptions=True)
        big = await srv.initial("d", np.zeros((20, 4), np.float32))  # > max_queue, but alone
        return first, big

    (a, b, c), big = asyncio.run(go())
    assert a["handles"].shape == b["handles"].shape == (3,)
    assert isinstance(c, InferenceOverloaded) and "max_queue=8" in str(c) and isinstance(c, InferenceError)
    assert big["handles"].shape == (20,)
    stats = srv.stats()
    assert stats["overloaded"] == 1 and stats["errors"] == 0 and stats["peak_queued_rows"] == 20
    assert stats["queued_rows"] == 0
    assert server().stats()["max_queue"] == 4 * 64  # the default bound: 4 x max_batch


def test_many_concurrent_clients_no_deadlock_and_a_bounded_queue():
    """64 clients x 20 short searches (initial, then recurrent steps) against one server: every request is
    answered; the queues never hold more than max_queue rows; refused requests are retried by the client."""
    srv = server(max_queue=48, max_wait_us=500)
    refused = [0]

    async def call(method, *args):
        while True:
            try:
                return await method(*args)
            except InferenceOverloaded:
                refused[0] += 1
                await asyncio.sleep(0.001)

    async def client(i: int) -> int:
        rng = np.random.default_rng(i)
        answered = 0
        for _ in range(20):
            rows = int(rng.integers(1, 5))
            out = await call(srv.initial, f"c{i}", rng.normal(size=(rows, 4)).astype(np.float32))
            for _ in range(2):
                out = await call(srv.recurrent, f"c{i}", out["handles"], rng.integers(0, 3, size=rows))
            answered += 3
            await srv.release(f"c{i}")
        return answered

    async def go():
        return await asyncio.wait_for(asyncio.gather(*[client(i) for i in range(64)]), 60)

    answered = asyncio.run(go())
    stats = srv.stats()
    assert sum(answered) == 64 * 20 * 3 and stats["errors"] == 0
    assert stats["peak_queued_rows"] <= 48 and stats["overloaded"] == refused[0] > 0
    assert stats["free_slots"] == 65536


def test_release_and_pool_exhaustion():
    srv = server(latent_pool_size=6)

    async def go():
        first = await srv.initial("a", np.zeros((4, 4), dtype=np.float32))
        with pytest.raises(InferenceError, match="latent pool exhausted"):
            await srv.initial("a", np.zeros((3, 4), dtype=np.float32))
        # Another client reclaims the least recently used client's slots.
        await srv.initial("b", np.zeros((5, 4), dtype=np.float32))
        with pytest.raises(InferenceError, match=r"unknown latent handles for client 'a' \(reclaimed: the pool of "
                           r"inference.latent_pool_size=6 ran short"):
            await srv.recurrent("a", first["handles"], np.zeros(4, dtype=np.int64))
        assert await srv.release("b") == 5
        # A new search of 'a' clears the mark: handles it never had are just unknown.
        await srv.initial("a", np.zeros((1, 4), dtype=np.float32))
        with pytest.raises(InferenceError, match=r"\(released or never allocated\)"):
            await srv.recurrent("a", first["handles"][1:], np.zeros(3, dtype=np.int64))

    asyncio.run(go())


def test_weight_swap_changes_outputs_and_version():
    srv = server()
    obs = np.ones((3, 4), dtype=np.float32)
    before = asyncio.run(srv.initial("c", obs))
    state = {k: v + 0.1 for k, v in srv.model.state_dict().items()}
    assert asyncio.run(srv.set_weights(7, state)) == 7 and srv.get_version() == 7
    after = asyncio.run(srv.initial("c", obs))
    assert not np.allclose(before["policy_logits"], after["policy_logits"])
    with torch.no_grad():
        expected = srv.model.initial(torch.from_numpy(obs)).policy_logits.numpy()
    np.testing.assert_allclose(after["policy_logits"], expected, rtol=1e-5)


def test_a_compiled_recurrent_step_answers_as_the_eager_one_at_any_batch_and_after_a_weight_swap():
    """inference.compile_recurrent: recurrent requests of several batch sizes (one dynamic compile) and whole
    searches give what the eager network gives, also with weights swapped in after the compile."""
    from torch._dynamo.utils import counters

    compiled, eager = server(compile_recurrent=True), server()
    rng = np.random.default_rng(1)
    graphs = counters["stats"]["unique_graphs"]

    def answers(srv):
        out = []
        for n in (3, 7, 5):
            obs = rng.normal(size=(n, 4)).astype(np.float32)
            root = asyncio.run(srv.initial("c", obs))
            step = asyncio.run(srv.recurrent("c", root["handles"], rng.integers(0, 3, size=n)))
            search = asyncio.run(srv.search("c", obs, num_simulations=8, dirichlet_fraction=0.0))
            out.append((step["reward"], step["value"], step["policy_logits"], search["root_value"]))
        return out

    for version in (1, 2):
        state = {k: v * (1.0 + 0.3 * version) for k, v in eager.model.state_dict().items()}
        for srv in (compiled, eager):
            asyncio.run(srv.set_weights(version, state))
        seed = int(rng.integers(1 << 30))
        rng = np.random.default_rng(seed)
        got = answers(compiled)
        rng = np.random.default_rng(seed)
        want = answers(eager)
        for g, w in zip(got, want):
            for a, b in zip(g, w):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)  # fp32 sums in another order
    assert counters["stats"]["unique_graphs"] > graphs  # the compiled step answered


def test_served_through_ray_to_a_selfplay_search():
    """The central mode end to end: a remote evaluator drives a batched search; latents stay in the actor."""
    import ray

    from rayzero.actors.network import RemoteNetwork
    from rayzero.tree import SearchConfig, search

    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        cfg = InferenceConfig(device="cpu", max_batch=64, min_bucket=4, max_wait_us=500)
        actor = ray.remote(InferenceServer).options(max_concurrency=100).remote(MODEL, cfg, (4,), 3, 0)
        evaluator = RemoteNetwork(actor, 0.99, "client-0")
        root = evaluator.root(np.zeros((5, 4), dtype=np.float32))
        out = search(root, evaluator.recurrent_fn, 8, SearchConfig(dirichlet_fraction=0.0))
        assert evaluator.client.transport == "channel"  # the driver is on the actor's node
        evaluator.release()
        assert out.visit_counts.sum(1).tolist() == [8] * 5
        assert ray.get(actor.stats.remote())["free_slots"] == 65536
    finally:
        ray.shutdown()


# -- the inference issue: swaps under load, mixed precision, cache, timeouts, whole searches, transformer -----

def _randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Give the zero-initialised last layers of the heads random weights, so that outputs depend on inputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if not param.abs().sum():
                param.copy_(torch.randn(param.shape, generator=g) * 0.05)


def _tiny_transformer(**extra) -> ModelConfig:
    """A transformer ModelConfig small enough for the CPU."""
    sizes = {"transformer_dim": 32, "transformer_heads": 4, "transformer_layers": 2, "transformer_latent_tokens": 4}
    return ModelConfig(kind="transformer", support_size=5, head_hidden=16, **{**sizes, **extra})


def test_weight_swap_while_serving_no_request_fails_and_versions_match():
    srv = server(max_wait_us=200)
    _randomize(srv.model)
    old = {k: v.clone() for k, v in srv.model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()
           for k, v in old.items()}
    obs = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)

    async def client(name: str, stop: asyncio.Event, seen: list) -> None:
        while not stop.is_set():
            out = await srv.initial(name, obs)
            step = await srv.recurrent(name, out["handles"], np.array([0, 1, 2]))
            seen.append((out["version"], out["policy_logits"], step["version"]))
            await srv.release(name)

    async def go() -> list:
        stop, seen = asyncio.Event(), []
        tasks = [asyncio.create_task(client(f"c{i}", stop, seen)) for i in range(6)]
        while len(seen) < 20:
            await asyncio.sleep(0.001)
        await srv.set_weights(3, new)
        count = len(seen)
        while len(seen) < count + 20:
            await asyncio.sleep(0.001)
        stop.set()
        await asyncio.gather(*tasks)  # any failed request raises here
        return seen

    seen = asyncio.run(go())
    assert srv.get_version() == 3 and srv.stats()["errors"] == 0
    expected = {}
    for version, state in ((0, old), (3, new)):
        model = build_model(MODEL, (4,), 3).eval()
        model.load_state_dict(state)
        with torch.no_grad():
            expected[version] = model.initial(torch.from_numpy(obs)).policy_logits.numpy()
    assert not np.allclose(expected[0], expected[3])
    versions = [v for v, _, _ in seen]
    assert versions[0] == 0 and versions[-1] == 3 and set(versions) == {0, 3}
    assert versions == sorted(versions)  # once the new version is served, the old one never comes back
    for version, logits, _ in seen:
        np.testing.assert_allclose(logits, expected[version], rtol=1e-5, atol=1e-6)


def test_set_weights_rejects_a_wrong_state_dict_and_keeps_serving():
    srv = server()
    bad = {k: torch.zeros(1) for k in srv.model.state_dict()}
    with pytest.raises(InferenceError, match="shape"):
        asyncio.run(srv.set_weights(1, bad))
    with pytest.raises(InferenceError, match="lacks"):
        asyncio.run(srv.set_weights(1, {}))
    assert srv.get_version() == 0
    assert asyncio.run(srv.initial("c", np.zeros((1, 4), np.float32)))["version"] == 0


def test_requests_are_served_while_a_slow_weight_swap_is_in_progress():
    """set_weights waits off the event loop: requests sent during a slow swap are answered (old version)
    before it ends, and later ones get the new version."""
    srv = server()
    obs = np.ones((2, 4), dtype=np.float32)
    staging, release = threading.Event(), threading.Event()
    stage = srv.runner.stage_weights

    def slow_stage(state_dict):
        staging.set()
        release.wait(10)
        return stage(state_dict)

    srv.runner.stage_weights = slow_stage

    async def go():
        swap = asyncio.create_task(srv.set_weights(1, {k: v + 0.1 for k, v in srv.model.state_dict().items()}))
        await asyncio.get_running_loop().run_in_executor(None, staging.wait, 10)
        during = [await asyncio.wait_for(srv.initial("c", obs), 5) for _ in range(5)]
        stats = srv.stats()
        assert not swap.done()
        release.set()
        assert await swap == 1
        return during, stats, await srv.initial("c", obs)

    during, stats, after = asyncio.run(go())
    assert [d["version"] for d in during] == [0] * 5 and stats["version"] == 0
    assert after["version"] == 1


def test_weight_swaps_sent_together_land_in_call_order():
    srv = server()
    stage = srv.runner.stage_weights

    def slow_stage(state_dict):
        time.sleep(0.01)
        return stage(state_dict)

    srv.runner.stage_weights = slow_stage
    states = {v: {k: t + v for k, t in srv.model.state_dict().items()} for v in range(1, 9)}

    async def go():
        await asyncio.gather(*[srv.set_weights(v, states[v]) for v in states])
        return await srv.initial("c", np.ones((1, 4), np.float32))

    assert asyncio.run(go())["version"] == 8 and srv.get_version() == 8
    for name, tensor in srv.model.state_dict().items():
        torch.testing.assert_close(tensor, states[8][name])


def test_stats_while_the_gpu_thread_adds_buckets():
    """stats() (event loop) reads the metrics while the GPU thread records batches of new buckets."""
    srv = server()

    def record() -> None:
        for bucket in range(1, 20001):
            flight = types.SimpleNamespace(bucket=bucket, rows=1, graph=False, gpu_s=0.0)
            srv._record(types.SimpleNamespace(kind="initial", flight=flight, launched=0.0, host_s=0.0,
                                              requests=[types.SimpleNamespace(submitted=0.0)]))
        done.set()

    done = threading.Event()
    writer = threading.Thread(target=record)
    writer.start()
    try:
        while not done.is_set():
            srv.stats()
    finally:
        writer.join()
    buckets = srv.stats()["buckets"]
    assert len(buckets) == 20000 and all(b["count"] == 1 for b in buckets.values())


def _precision_errors(model, obs, actions) -> dict[bool, dict[str, float]]:
    """Errors vs fp32 under bf16 autocast, for heads_fp32 True and False: mean abs error of the values
    (initial and one recurrent step) and of the reward, max abs error of the policy probabilities."""
    with torch.no_grad():
        ref0 = model.initial(obs)
        ref1 = model.recurrent(ref0.latent, actions)
        errors = {}
        for heads_fp32 in (True, False):
            model.heads_fp32 = heads_fp32
            with torch.autocast(obs.device.type, dtype=torch.bfloat16, cache_enabled=False):
                out0 = model.initial(obs)
                out1 = model.recurrent(out0.latent, actions)
            value = torch.cat([out0.value - ref0.value, out1.value - ref1.value]).abs().mean()
            policy = out1.policy_logits.float().softmax(-1) - ref1.policy_logits.softmax(-1)
            errors[heads_fp32] = {"value": float(value), "reward": float((out1.reward - ref1.reward).abs().mean()),
                                  "policy": float(policy.abs().max())}
        model.heads_fp32 = False
    return errors


def test_bf16_trunk_with_fp32_heads_meets_its_tolerance_and_beats_all_bf16():
    """bf16 autocast on the CPU: the fp32-head variant's mean error vs fp32 stays within 3e-3 (value, reward;
    measured 1.4e-3 and 0.6e-3 here) and 1e-3 max (policy probabilities), below the all-bf16 variant's."""
    torch.manual_seed(0)
    cfg = ModelConfig(kind="resnet", channels=16, reduced_channels=4, head_hidden=16, support_size=20)
    model = build_model(cfg, (12, 32, 32), 6).eval()
    _randomize(model)
    obs = torch.randint(0, 256, (64, 12, 32, 32), dtype=torch.uint8)
    actions = torch.randint(0, 6, (64,))
    errors = _precision_errors(model, obs, actions)
    fp32_heads, all_bf16 = errors[True], errors[False]
    assert fp32_heads["value"] <= 3e-3 and fp32_heads["reward"] <= 3e-3 and fp32_heads["policy"] <= 1e-3, errors
    assert fp32_heads["value"] < all_bf16["value"] and fp32_heads["reward"] < all_bf16["reward"], errors


def test_heads_fp32_flag_changes_nothing_in_fp32():
    model = build_model(ModelConfig(kind="resnet", channels=8, reduced_channels=2, head_hidden=8, support_size=5),
                        (3, 16, 16), 4).eval()
    _randomize(model)
    obs = torch.randint(0, 256, (5, 3, 16, 16), dtype=torch.uint8)
    with torch.no_grad():
        a = model.initial(obs)
        model.heads_fp32 = True
        b = model.initial(obs)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_transformer_model_and_served_outputs_match_direct_calls():
    cfg = _tiny_transformer()
    srv = InferenceServer(cfg, InferenceConfig(device="cpu", max_batch=16, min_bucket=4), (3, 8, 8), 5)
    model = srv.model
    assert model.tokens == 64 and len(model.repr_blocks) == 2
    _randomize(model)
    obs = np.random.default_rng(0).integers(0, 256, size=(6, 3, 8, 8), dtype=np.uint8)

    async def go():
        root = await srv.initial("t", obs)
        step = await srv.recurrent("t", root["handles"], np.arange(6) % 5)
        return root, step

    root, step = asyncio.run(go())
    with torch.no_grad():
        direct = model.initial(torch.from_numpy(obs))
        nxt = model.recurrent(direct.latent, torch.from_numpy(np.arange(6) % 5))
    assert direct.latent.shape == (6, 4, 32)
    np.testing.assert_allclose(root["policy_logits"], direct.policy_logits.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(step["reward"], nxt.reward.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(step["value"], nxt.value.numpy(), rtol=1e-5, atol=1e-6)
    # Frame tokens [T, F] and feature tokens [F]; more than 512 tokens is refused.
    assert build_model(cfg, (10, 7), 3).tokens == 10 and build_model(cfg, (4,), 3).tokens == 4
    with pytest.raises(ValueError, match="tokens"):
        build_model(cfg, (600, 3), 3)


def test_evaluation_cache_hits_give_the_same_answers_and_valid_handles():
    srv = server(cache_size=4)
    _randomize(srv.model)
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(3, 4)).astype(np.float32)
    other = rng.normal(size=(2, 4)).astype(np.float32)

    async def go():
        first = await srv.initial("a", obs)
        second = await srv.initial("b", np.concatenate([obs[1:], other]))  # 2 hits, 2 misses
        steps = [await srv.recurrent(c, r["handles"], np.zeros(len(r["handles"]), np.int64))
                 for c, r in (("a", first), ("b", second))]
        return first, second, steps

    first, second, steps = asyncio.run(go())
    np.testing.assert_allclose(second["policy_logits"][:2], first["policy_logits"][1:], rtol=1e-6)
    np.testing.assert_allclose(steps[1]["value"][:2], steps[0]["value"][1:], rtol=1e-5, atol=1e-6)
    cache = srv.stats()["cache"]
    assert cache["lookups"] == 7 and cache["hits"] == 2 and cache["hit_rate"] == pytest.approx(2 / 7)
    assert cache["entries"] == 4  # bounded: 5 distinct rows, 4 entries
    asyncio.run(srv.set_weights(1, srv.model.state_dict()))
    assert srv.stats()["cache"]["entries"] == 0  # a weight update clears it


def test_latent_slots_of_an_idle_client_time_out():
    srv = server(latent_pool_size=100, latent_timeout_s=0.05)

    async def go():
        first = await srv.initial("idle", np.zeros((4, 4), np.float32))
        await asyncio.sleep(0.1)
        await srv.initial("busy", np.zeros((2, 4), np.float32))  # not short of slots: the timeout reclaims
        with pytest.raises(InferenceError, match="unknown latent handles"):
            await srv.recurrent("idle", first["handles"], np.zeros(4, np.int64))

    asyncio.run(go())
    assert srv.stats()["reclaimed_clients"] == 1 and srv.stats()["free_slots"] == 98


def test_recurrent_without_storing_keeps_no_slots():
    srv = server(latent_pool_size=10)

    async def go():
        root = await srv.initial("c", np.zeros((4, 4), np.float32))
        outs = [await srv.recurrent("c", root["handles"], np.arange(4) % 3, store=False) for _ in range(5)]
        return outs

    outs = asyncio.run(go())
    assert all((o["handles"] == -1).all() for o in outs)
    assert srv.stats()["free_slots"] == 6


def test_whole_search_requests_match_a_direct_search():
    from rayzero.actors.network import LocalNetwork
    from rayzero.tree import SearchConfig, search

    search_cfg = SearchConfig(num_simulations=8, dirichlet_fraction=0.0, temperature=0.0)
    srv = InferenceServer(MODEL, InferenceConfig(device="cpu", max_batch=64, min_bucket=4), (4,), 3,
                          search_cfg=search_cfg, discount=0.99)
    _randomize(srv.model)
    rng = np.random.default_rng(0)
    obs = [rng.normal(size=(n, 4)).astype(np.float32) for n in (3, 2)]
    invalid = np.zeros((2, 3), bool)
    invalid[0, 1] = True

    async def go():
        return await asyncio.gather(srv.search("a", obs[0]), srv.search("b", obs[1], invalid),
                                    srv.search("c", obs[0], num_simulations=4),
                                    srv.search("d", obs[0], num_simulations=0), return_exceptions=True)

    a, b, c, bad = asyncio.run(go())
    evaluator = LocalNetwork(srv.model, 0.99)
    for out, o, mask in ((a, obs[0], None), (b, obs[1], invalid)):
        ref = search(evaluator.root(o), evaluator.recurrent_fn, 8, search_cfg,
                     torch.from_numpy(mask) if mask is not None else None)
        np.testing.assert_array_equal(out["visit_counts"], ref.visit_counts.numpy())
        np.testing.assert_array_equal(out["action"], ref.action.numpy())
        np.testing.assert_allclose(out["root_value"], ref.root_value.numpy(), rtol=1e-5, atol=1e-6)
        assert out["version"] == 0
    assert b["visit_counts"][0, 1] == 0
    assert (c["visit_counts"].sum(1) == 4).all()
    assert isinstance(bad, InferenceError) and "num_simulations" in str(bad)
    with pytest.raises(InferenceError, match="every action invalid"):
        asyncio.run(srv.search("e", obs[1], np.ones((2, 3), bool)))
    # The actor remembers the configs of overrides it has seen: a bad one fails again, and one that equals a
    # remembered one in value but not in type (4.0 for 4) is checked on its own.
    with pytest.raises(InferenceError, match="num_simulations"):
        asyncio.run(srv.search("d", obs[0], num_simulations=0))
    with pytest.raises(InferenceError, match="num_simulations"):
        asyncio.run(srv.search("d", obs[0], num_simulations=4.0))
    again = asyncio.run(srv.search("c", obs[0], num_simulations=4))
    assert (again["visit_counts"].sum(1) == 4).all()


@pytest.mark.parametrize("merge, graphs", [(True, False), (False, False), (True, True)])
def test_greedy_searches_join_self_plays_batch_and_still_search_greedily(merge, graphs, request):
    """inference.merge_searches: an evaluation's greedy search (no root noise, argmax of visits) and self-play's
    noisy one share one batch; the greedy rows get what a greedy search of their own gives. Also through the
    whole-search graphs of the (emulated) CUDA path, whose per-row settings go up from a staging slot's pinned
    buffer."""
    from rayzero.actors.network import LocalNetwork
    from rayzero.tree import SearchConfig, search

    if graphs:
        request.getfixturevalue("emulated_cuda")
    search_cfg = SearchConfig(num_simulations=12, dirichlet_fraction=0.25, temperature=1.0, cpu_backend="torch")
    srv = InferenceServer(MODEL, InferenceConfig(device="cpu", max_batch=64, min_bucket=4, merge_searches=merge,
                                                 search_max_batch=16 if graphs else 0, bf16=False),
                          (4,), 3, search_cfg=search_cfg, discount=0.99)
    assert srv.runner.cuda == graphs
    _randomize(srv.model)
    rng = np.random.default_rng(0)
    obs = [rng.normal(size=(n, 4)).astype(np.float32) for n in (5, 3)]

    async def go():
        return await asyncio.gather(srv.search("selfplay", obs[0], temperature=1.0),
                                    srv.search("eval", obs[1], temperature=0.0, dirichlet_fraction=0.0,
                                               gumbel_scale=0.0))

    played, greedy = asyncio.run(go())
    batches = sum(m["count"] for name, m in srv.metrics.items() if name.startswith("search"))
    assert batches == (1 if merge else 2)
    evaluator = LocalNetwork(srv.model, 0.99)
    greedy_cfg = dataclasses.replace(search_cfg, temperature=0.0, dirichlet_fraction=0.0)
    ref = search(evaluator.root(obs[1]), evaluator.recurrent_fn, 12, greedy_cfg)
    np.testing.assert_array_equal(greedy["visit_counts"], ref.visit_counts.numpy())
    np.testing.assert_array_equal(greedy["action"], ref.visit_counts.numpy().argmax(-1))
    np.testing.assert_allclose(greedy["root_value"], ref.root_value.numpy(), rtol=1e-5, atol=1e-6)
    assert (played["visit_counts"].sum(1) == 12).all() and played["action"].shape == (5,)
    if graphs:
        assert srv.stats()["buckets"]["search/8"]["graph"] == 1


@pytest.mark.parametrize("virtual_loss, eval_virtual_loss", [(1, 0), (4, 1), (4, 0)])
def test_the_evaluation_network_searches_with_the_evaluations_simulations(virtual_loss, eval_virtual_loss):
    """run.eval_simulations and run.eval_virtual_loss with inference.pinned_eval: an evaluation's greedy searches
    (a request that names neither, as the channel's) run the evaluation network with the evaluation's simulations
    and K (0: self-play's), and give what a local greedy search of those gives; another client's greedy search
    keeps the run's."""
    from rayzero.actors.network import LocalNetwork
    from rayzero.tree import SearchConfig, search

    search_cfg = SearchConfig(num_simulations=12, cpu_backend="torch", virtual_loss=virtual_loss)
    srv = InferenceServer(MODEL, InferenceConfig(device="cpu", max_batch=16, min_bucket=4, pinned_eval=True),
                          (4,), 3, search_cfg=search_cfg, discount=0.99, eval_rows=4,
                          eval_search=dataclasses.replace(search_cfg, num_simulations=5,
                                                          virtual_loss=eval_virtual_loss or virtual_loss))
    _randomize(srv.model)
    state = {k: v.clone() for k, v in srv.model.state_dict().items()}
    obs = np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32)
    greedy = {"temperature": 0.0, "dirichlet_fraction": 0.0, "gumbel_scale": 0.0}

    async def go():
        assert await srv.set_eval_weights(3, state, "eval")
        return await asyncio.gather(srv.search("eval-1", obs, **greedy), srv.search("selfplay", obs, **greedy))

    evaluated, other = asyncio.run(go())
    assert (evaluated["visit_counts"].sum(1) == 5).all() and (other["visit_counts"].sum(1) == 12).all()
    evaluator = LocalNetwork(srv.model, 0.99)
    eval_cfg = dataclasses.replace(search_cfg, num_simulations=5, virtual_loss=eval_virtual_loss or virtual_loss)
    ref = search(evaluator.root(obs), evaluator.recurrent_fn, 5, dataclasses.replace(eval_cfg, **greedy))
    np.testing.assert_array_equal(evaluated["visit_counts"], ref.visit_counts.numpy())
    if virtual_loss != (eval_virtual_loss or virtual_loss):  # the K tells: the other's searches differ here
        other_k = search(evaluator.root(obs), evaluator.recurrent_fn, 5,
                         dataclasses.replace(search_cfg, num_simulations=5, **greedy))
        assert not np.array_equal(evaluated["visit_counts"], other_k.visit_counts.numpy())
    with pytest.raises(InferenceError, match="only searches greedily"):
        asyncio.run(srv.search("eval-1", obs, temperature=1.0))


def test_image_server_checks_dtype_and_traces_its_timeline():
    cfg = ModelConfig(kind="resnet", channels=8, reduced_channels=2, head_hidden=8, support_size=5)
    srv = InferenceServer(cfg, InferenceConfig(device="cpu", max_batch=8, min_bucket=2), (3, 16, 16), 4)
    srv.start_trace()

    async def go():
        return await asyncio.gather(
            srv.initial("ok", np.zeros((2, 3, 16, 16), np.uint8)),
            srv.initial("float", np.zeros((2, 3, 16, 16), np.float32)),
            srv.initial("range", np.full((1, 3, 16, 16), 300, np.uint16)),
            return_exceptions=True)

    ok, as_float, out_of_range = asyncio.run(go())
    assert ok["handles"].shape == (2,)
    assert isinstance(as_float, InferenceError) and "dtype" in str(as_float)
    assert isinstance(out_of_range, InferenceError) and "range" in str(out_of_range)
    trace = srv.stop_trace()["traceEvents"]
    assert {e["name"] for e in trace} >= {"queue", "launch initial", "wait"}
    stats = srv.stats()["buckets"]["initial/2"]
    assert stats["count"] == 1 and stats["rows"] == 2 and stats["padding_fraction"] == 0.0


# -- the CUDA path's plumbing, emulated on the CPU (the `emulated_cuda` fixture: conftest.py) ---------------------


@pytest.mark.parametrize("network_graphs", ["all", "search"])
def test_emulated_cuda_path_matches_direct_calls(emulated_cuda, network_graphs):
    """Every request answers as direct calls of the network and the search, with the network's own graphs for
    every bucket or (inference.network_graphs=search, the plan's where every search is whole) only the roots'
    graphs of the whole-search buckets, the other requests eagerly."""
    from rayzero.actors.network import LocalNetwork
    from rayzero.tree import SearchConfig, search

    search_cfg = SearchConfig(num_simulations=6, dirichlet_fraction=0.0, temperature=0.0)
    cfg = InferenceConfig(device="cpu", max_batch=16, min_bucket=4, max_wait_us=2000, bf16=False, cache_size=32,
                          search_max_batch=8, network_graphs=network_graphs)
    srv = InferenceServer(MODEL, cfg, (4,), 3, search_cfg=search_cfg, discount=0.99)
    runner = srv.runner
    assert runner.cuda and set(runner.graphs) == ({(k, b) for k in ("initial", "recurrent") for b in (4, 8, 16)}
                                                  if network_graphs == "all" else {("initial", 4), ("initial", 8)})
    assert {key[0] for key in runner.searches} == {4, 8}
    _randomize(srv.model)
    model = srv.model
    rng = np.random.default_rng(0)
    obs = [rng.normal(size=(n, 4)).astype(np.float32) for n in (1, 3, 5, 2, 20)]  # 20 > max_batch: eager

    async def go():
        roots = await asyncio.gather(*[srv.initial(f"c{i}", o) for i, o in enumerate(obs)])
        again = await srv.initial("c0", obs[1])  # all cache hits
        actions = [rng.integers(0, 3, size=len(o)) for o in obs]
        steps = await asyncio.gather(*[srv.recurrent(f"c{i}", r["handles"], a, store=i != 2)
                                       for i, (r, a) in enumerate(zip(roots, actions))])
        deeper = await asyncio.gather(*[srv.recurrent(f"c{i}", s["handles"], a)
                                        for i, (s, a) in enumerate(zip(steps, actions)) if i != 2])
        searched = await asyncio.gather(srv.search("s", obs[1]), srv.search("t", obs[4][:12]))
        return roots, again, actions, steps, deeper, searched

    roots, again, actions, steps, deeper, searched = asyncio.run(go())
    with torch.no_grad():
        for i, (o, r, a, s) in enumerate(zip(obs, roots, actions, steps)):
            direct = model.initial(torch.from_numpy(o))
            np.testing.assert_allclose(r["value"], direct.value.numpy(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(r["policy_logits"], direct.policy_logits.numpy(), rtol=1e-5, atol=1e-6)
            nxt = model.recurrent(direct.latent, torch.from_numpy(a))
            np.testing.assert_allclose(s["reward"], nxt.reward.numpy(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(s["policy_logits"], nxt.policy_logits.numpy(), rtol=1e-5, atol=1e-6)
            if i == 2:
                assert (s["handles"] == -1).all()
                continue
            d = deeper[i if i < 2 else i - 1]
            nxt2 = model.recurrent(nxt.latent, torch.from_numpy(a))
            np.testing.assert_allclose(d["value"], nxt2.value.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(again["policy_logits"], roots[1]["policy_logits"], rtol=1e-6)
        evaluator = LocalNetwork(model, 0.99)
        for out, o in zip(searched, (obs[1], obs[4][:12])):  # 3 rows: a graph bucket; 12 rows: eager
            ref = search(evaluator.root(o), evaluator.recurrent_fn, 6, search_cfg)
            np.testing.assert_array_equal(out["visit_counts"], ref.visit_counts.numpy())
            np.testing.assert_allclose(out["root_value"], ref.root_value.numpy(), rtol=1e-5, atol=1e-6)
    stats = srv.stats()
    assert stats["errors"] == 0 and stats["cache"]["hits"] == 3
    buckets = stats["buckets"]
    assert buckets["initial/20"]["graph"] == 0 and buckets["search/4"]["graph"] == 1
    graphed = [m for k, m in buckets.items() if m["graph"]]
    assert sum(m["padded"] for m in graphed) > 0 and all(0 <= m["padding_fraction"] < 1 for m in graphed)
    replays = sum(g.replays for g in runner.graphs.values())
    recurrent = [m["graph"] for k, m in buckets.items() if k.startswith("recurrent/")]
    if network_graphs == "all":
        assert replays >= 4 and any(recurrent)
    else:  # the graphed search's root replayed its initial step's graph; the recurrent requests ran eagerly
        assert replays >= 1 and recurrent and not any(recurrent)
    # Weights land in place: the same parameter tensors, new values, reported version.
    before = [p.data_ptr() for p in model.parameters()]
    asyncio.run(srv.set_weights(2, {k: v * 0.5 for k, v in model.state_dict().items()}))
    assert [p.data_ptr() for p in model.parameters()] == before
    after = asyncio.run(srv.initial("c9", obs[0]))
    with torch.no_grad():
        np.testing.assert_allclose(after["policy_logits"], model.initial(torch.from_numpy(obs[0])).policy_logits.numpy(),
                                   rtol=1e-5, atol=1e-6)
    assert after["version"] == 2


def test_emulated_cuda_a_batch_launched_with_nothing_queued_is_finished_by_the_call_that_launched_it(
        emulated_cuda, monkeypatch):
    """The GPU thread's step: with nothing else queued on the event loop, the batch it launches is waited for and
    answered in the same call (the batcher would wait for it next anyway), so one client's answers skip two
    thread hops; with rows queued it stays in flight while the next batch is launched behind it. Either way every
    request gets its answer."""
    cfg = InferenceConfig(device="cpu", max_batch=16, min_bucket=4, max_wait_us=0, bf16=False)
    srv = InferenceServer(MODEL, cfg, (4,), 3, discount=0.99)
    assert srv.runner.cuda
    steps = []
    real_step = srv._step

    def step(key, requests, unfinished):
        launched, done = real_step(key, requests, unfinished)
        steps.append((launched, [batch for batch, _ in done], len(unfinished)))
        return launched, done

    monkeypatch.setattr(srv, "_step", step)
    obs = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    alone = asyncio.run(srv.initial("a", obs))
    assert len(steps) == 1 and steps[0][0] is None and len(steps[0][1]) == 1 and steps[0][2] == 0, steps
    steps.clear()
    monkeypatch.setattr(srv, "_loop_queued_rows", lambda: 1)  # as if another client's rows were queued
    behind = asyncio.run(srv.initial("a", obs))
    assert len(steps) == 1 and steps[0][0] is not None and steps[0][1] == [] and steps[0][2] == 1, steps
    np.testing.assert_allclose(behind["value"], alone["value"], rtol=1e-6)


@pytest.mark.parametrize("sleep_waits", [True, False])
def test_emulated_cuda_a_batch_wait_sleeps_on_the_blocking_event_recorded_after_the_batch(emulated_cuda, monkeypatch,
                                                                                        sleep_waits):
    """inference.sleep_waits: the GPU thread waits for each batch (searches and the network's own steps) on a
    blocking event recorded on the compute stream after the batch's end event, then on the end event (done by
    then); with the option off, only on the end event, which spins."""
    waited = []

    class Recorded(torch.cuda.Event):  # the fixture's emulated event, which remembers how it was made and used
        def __init__(self, *args, **kwargs):
            self.blocking, self.records = kwargs.get("blocking", False), 0

        def record(self, stream=None):
            self.records += 1

        def synchronize(self):
            waited.append(self)

    monkeypatch.setattr(torch.cuda, "Event", Recorded)
    from rayzero.tree import SearchConfig

    search_cfg = SearchConfig(num_simulations=4, dirichlet_fraction=0.0, temperature=0.0)
    cfg = InferenceConfig(device="cpu", max_batch=16, min_bucket=4, max_wait_us=0, bf16=False, search_max_batch=16,
                          sleep_waits=sleep_waits)
    srv = InferenceServer(MODEL, cfg, (4,), 3, search_cfg=search_cfg, discount=0.99)
    waited.clear()  # the start-up's own waits
    obs = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    for _ in range(2):
        asyncio.run(srv.search("a", obs))
    asyncio.run(srv.initial("b", obs))
    slots = srv.runner.slots
    ends = {id(slot.end) for slot in slots}
    if sleep_waits:
        assert [w.blocking for w in waited] == [True, False] * 3
        assert all(id(w) in ends for w in waited[1::2])
        assert all(slot.done.records == slot.end.records for slot in slots)
    else:
        assert [w.blocking for w in waited] == [False] * 3 and all(id(w) in ends for w in waited)
    assert srv.stats()["batch_waits"] == ({"slept": 3, "spun": 0} if sleep_waits else {"slept": 0, "spun": 3})


@pytest.mark.parametrize("merge", [True, False])
def test_emulated_cuda_whole_searches_take_their_noise_from_pools_drawn_for_many_searches(emulated_cuda, monkeypatch,
                                                                                          merge):
    """Whole searches on the graphs draw their root and action noise once per NOISE_POOL_ROWS roots of a (config,
    bucket), not once per search. Known answers with pools of 16 roots: bucket 4's first four searches share one
    draw and the fifth draws anew; each search gets noise no other did; greedy searches still answer as a
    direct greedy search does; merged or not."""
    import rayzero.inference.runner as runner_module
    from rayzero.actors.network import LocalNetwork
    from rayzero.tree import SearchConfig, search

    monkeypatch.setattr(runner_module, "NOISE_POOL_ROWS", 16)
    search_cfg = SearchConfig(num_simulations=6, dirichlet_fraction=0.25, temperature=1.0, cpu_backend="torch")
    srv = InferenceServer(MODEL, InferenceConfig(device="cpu", max_batch=16, min_bucket=4, search_max_batch=16,
                                                 bf16=False, merge_searches=merge),
                          (4,), 3, search_cfg=search_cfg, discount=0.99)
    _randomize(srv.model)
    runner = srv.runner
    seen = []
    real = runner._pooled_noise

    def pooled(config, bucket):
        noise = real(config, bucket)
        seen.append(None if noise.root is None else noise.root.clone())  # None: a greedy search's
        return noise

    monkeypatch.setattr(runner, "_pooled_noise", pooled)
    obs = np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)
    for i in range(4):
        asyncio.run(srv.search("a", obs))
        assert runner.noise_draws == 1, i
    asyncio.run(srv.search("a", obs))
    assert runner.noise_draws == 2 and len(seen) == 5
    assert all(s.shape == (4, 3) for s in seen)
    assert all(not torch.equal(seen[i], seen[j]) for i in range(5) for j in range(i))
    greedy = asyncio.run(srv.search("e", obs, temperature=0.0, dirichlet_fraction=0.0))
    evaluator = LocalNetwork(srv.model, 0.99)
    greedy_cfg = dataclasses.replace(search_cfg, temperature=0.0, dirichlet_fraction=0.0)
    ref = search(evaluator.root(obs), evaluator.recurrent_fn, 6, greedy_cfg)
    np.testing.assert_array_equal(greedy["visit_counts"], ref.visit_counts.numpy())


def test_emulated_cuda_whole_searches_stop_at_a_smaller_bucket_where_it_moves_more_rows_per_device_second(
        emulated_cuda):
    """inference.bucket_cut: with a batch on the device, 9 queued rows (4 + 4 + 1) take only the 8 that fill
    bucket 8 when bucket 8's mean device time moves more rows a second than bucket 16's (800 against 692 rows/s),
    and the last request stays queued, first for the next batch. Where bucket 16 is nearly as fast, with too few
    timings, with nothing on the device, or with the option off, all 9 go."""
    from rayzero.inference.server import _Request
    from rayzero.tree import SearchConfig

    search_cfg = SearchConfig(num_simulations=4, dirichlet_fraction=0.0, temperature=0.0)
    cfg = InferenceConfig(device="cpu", max_batch=16, min_bucket=4, max_wait_us=0, bf16=False, search_max_batch=16,
                          bucket_cut=True)
    srv = InferenceServer(MODEL, cfg, (4,), 3, search_cfg=search_cfg, discount=0.99)
    assert srv.runner.search_ladder == [4, 8, 16]
    key = ("search", search_cfg)

    def timed(bucket: int, count: int, mean_s: float) -> None:
        srv.metrics[f"search/{bucket}"] = {"count": count, "gpu_s": count * mean_s}

    def take(busy: bool) -> tuple[list[int], list[int]]:
        srv._queues[key] = collections.deque(_Request(key, f"c{i}", None, rows, None, float(i))
                                             for i, rows in enumerate((4, 4, 1)))
        srv._queued_rows[key] = 9
        taken = srv._take(key, busy=busy)
        left = [r.rows for r in srv._queues.pop(key, ())]
        assert srv._queued_rows.pop(key) == sum(left)
        return [r.rows for r in taken], left

    timed(8, 3, 0.010)
    timed(16, 3, 0.013)
    assert take(busy=True) == ([4, 4], [1])
    assert take(busy=False) == ([4, 4, 1], [])
    timed(16, 3, 0.0105)  # 857 rows/s: the whole queue is faster
    assert take(busy=True) == ([4, 4, 1], [])
    timed(16, 2, 0.013)  # too few timings of bucket 16 to trust
    assert take(busy=True) == ([4, 4, 1], [])
    timed(16, 3, 0.013)
    srv.cfg = dataclasses.replace(cfg, bucket_cut=False)
    assert take(busy=True) == ([4, 4, 1], [])


def test_emulated_cuda_the_start_up_log_says_where_the_captures_time_went(emulated_cuda, caplog):
    """The inference actor's start on a GPU host (what a run's first update waits for): its log gives the time
    before the captures, the network graphs' and each whole-search bucket's, whose first of a kind compiles."""
    from rayzero.tree import SearchConfig

    cfg = InferenceConfig(device="cpu", max_batch=16, min_bucket=4, max_wait_us=0, bf16=False, search_max_batch=8)
    with caplog.at_level("INFO", logger="rayzero.inference.server"):
        srv = InferenceServer(MODEL, cfg, (4,), 3, search_cfg=SearchConfig(num_simulations=4), discount=0.99)
    parts = srv.runner.capture_parts
    assert list(parts) == ["network graphs", "search 4", "search 8"] and all(t >= 0 for t in parts.values())
    assert sum(parts.values()) <= srv.runner.capture_s + 1e-3
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("inference actor's start"))
    assert "before the captures; network graphs " in line and ", search 4 " in line and ", search 8 " in line


def test_emulated_cuda_each_runner_captures_its_graphs_on_its_own_stream(emulated_cuda):
    """Every graph of a runner (network steps and whole searches) is captured on that runner's compute stream,
    and the served and the evaluation network's runners have different ones: a captured GEMM keeps its capture
    stream's cuBLAS workspace, so graphs of both, replayed at once on their own streams, must not share one."""
    from rayzero.tree import SearchConfig

    search_cfg = SearchConfig(num_simulations=4, dirichlet_fraction=0.0, temperature=0.0)
    cfg = InferenceConfig(device="cpu", max_batch=16, min_bucket=4, max_wait_us=0, bf16=False, search_max_batch=8,
                          pinned_eval=True)
    srv = InferenceServer(MODEL, cfg, (4,), 3, search_cfg=search_cfg, discount=0.99, eval_rows=4,
                          eval_search=dataclasses.replace(search_cfg, num_simulations=5))
    served, evaluation = srv.runner, srv.eval_runner
    assert evaluation is not None and served.stream is not evaluation.stream
    for runner in (served, evaluation):
        assert runner.searches and all(captured.stream is runner.stream for captured in runner.searches.values())
    assert served.graphs and all(graph.stream is served.stream for graph in served.graphs.values())
def test_emulated_cuda_search_lanes_answer_as_direct_searches_and_take_new_weights(emulated_cuda):
    """inference.search_lanes=2: whole searches alternate between the served runner and a second lane (its own copy
    of the network, buffers and search graphs); every answer equals a direct search with the served weights, and
    a weight swap reaches both lanes' networks."""
    from rayzero.actors.network import LocalNetwork
    from rayzero.tree import SearchConfig, search

    search_cfg = SearchConfig(num_simulations=6, dirichlet_fraction=0.0, temperature=0.0)
    cfg = InferenceConfig(device="cpu", max_batch=16, min_bucket=4, max_wait_us=0, bf16=False, search_max_batch=8,
                          search_lanes=2)
    srv = InferenceServer(MODEL, cfg, (4,), 3, search_cfg=search_cfg, discount=0.99)
    lane = srv.lanes[1]
    assert len(srv.lanes) == 2 and srv.lanes[0] is srv.runner and lane.model is not srv.model
    assert {key[0] for key in lane.searches} == {4, 8}
    # each lane's graphs captured on its own stream, so they do not share one cuBLAS workspace (the hang of s32)
    assert lane.stream is not srv.runner.stream
    assert all(captured.stream is lane.stream for captured in lane.searches.values())
    rng = np.random.default_rng(0)
    obs = [rng.normal(size=(n, 4)).astype(np.float32) for n in (3, 5, 2, 7, 1, 4)]

    def check(state: dict[str, torch.Tensor], version: int) -> None:
        asyncio.run(srv.set_weights(version, state))
        before = list(srv.lane_batches)
        answers = [asyncio.run(srv.search(f"c{i}", o)) for i, o in enumerate(obs)]  # one batch each
        assert all(now - then >= 2 for now, then in zip(srv.lane_batches, before)), srv.lane_batches
        evaluator = LocalNetwork(srv.model, 0.99)
        with torch.no_grad():
            for answer, o in zip(answers, obs):
                ref = search(evaluator.root(o), evaluator.recurrent_fn, 6, search_cfg)
                np.testing.assert_array_equal(answer["visit_counts"], ref.visit_counts.numpy())
                np.testing.assert_allclose(answer["root_value"], ref.root_value.numpy(), rtol=1e-5, atol=1e-6)
                assert answer["version"] == version

    trained = copy.deepcopy(srv.model)
    _randomize(trained)
    check(trained.state_dict(), 1)
    check({k: v * 0.5 for k, v in trained.state_dict().items()}, 2)
    assert srv.stats()["errors"] == 0 and srv.stats()["lane_batches"] == srv.lane_batches


def test_emulated_cuda_batches_beyond_the_ladder_run_on_the_compute_stream(emulated_cuda, monkeypatch):
    """Batches larger than the biggest bucket run eagerly, on the compute stream where weight copies are queued
    (non-blocking), so stream order puts them after a swap; on the default stream nothing ordered the two."""
    import contextlib

    from rayzero.tree import SearchConfig

    current = [None]

    @contextlib.contextmanager
    def stream(s):
        previous, current[0] = current[0], s
        try:
            yield
        finally:
            current[0] = previous

    monkeypatch.setattr(torch.cuda, "stream", stream)
    cfg = InferenceConfig(device="cpu", max_batch=8, min_bucket=4, bf16=False, search_max_batch=4)
    srv = InferenceServer(MODEL, cfg, (4,), 3, search_cfg=SearchConfig(num_simulations=2), discount=0.99)
    runner = srv.runner
    seen = []
    def spy(name, real):
        def run(*args):
            seen.append((name, current[0]))
            return real(*args)
        return run

    for name in ("_eager_initial", "_eager_recurrent", "_eager_search"):
        setattr(runner, name, spy(name, getattr(runner, name)))
    obs = np.random.default_rng(0).normal(size=(12, 4)).astype(np.float32)

    async def go():
        await srv.set_weights(1, {k: v * 0.5 for k, v in srv.model.state_dict().items()})
        root = await srv.initial("c", obs)
        await srv.recurrent("c", root["handles"], np.zeros(12, np.int64))
        await srv.search("c", obs[:6])
        return root

    root = asyncio.run(go())
    assert [name for name, _ in seen] == ["_eager_initial", "_eager_recurrent", "_eager_search"]
    assert all(s is runner.stream for _, s in seen), seen
    with torch.no_grad():
        np.testing.assert_allclose(root["value"], srv.model.initial(torch.from_numpy(obs)).value.numpy(),
                                   rtol=1e-5, atol=1e-6)
    assert root["version"] == 1 and srv.stats()["errors"] == 0


@pytest.mark.parametrize("whole_search, groups", [(True, 2), (True, 3), (False, 3)],
                         ids=["gpu-search", "gpu-search-3-groups", "cpu-search"])
def test_selfplay_in_halves_through_ray(whole_search, groups):
    """Central mode, here on the CPU. Whole searches (the GPU default): each group of the envs (two halves, or
    three groups of 3, 2 and 2 envs) has its search in flight while the others step. CPU search: two halves
    (whatever env.search_groups says) walk their trees in two threads, each through its own channel and latent
    slots. Either way every env's steps reach replay once, in order."""
    import ray

    from rayzero.actors.network import RemoteNetwork
    from rayzero.actors.selfplay import SelfPlayWorker
    from rayzero.config import EnvConfig, ReplayConfig
    from rayzero.replay import ReplayBuffer
    from rayzero.tree import SearchConfig

    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        search_cfg = SearchConfig(num_simulations=6)
        cfg = InferenceConfig(device="cpu", max_batch=64, min_bucket=4, max_wait_us=500)
        actor = ray.remote(InferenceServer).options(max_concurrency=100).remote(
            MODEL, cfg, (4,), 2, 0, search_cfg=search_cfg, discount=0.99)
        replay = ReplayBuffer(ReplayConfig(capacity=1000, segment_length=10, min_size=0))
        worker = SelfPlayWorker(
            EnvConfig(id="CartPole-v1", num_envs=7 if groups == 3 else 3, search_groups=groups), MODEL, search_cfg,
            ReplayConfig(capacity=1000, segment_length=10, min_size=0), seed=0, sink=replay.add,
            evaluator=RemoteNetwork(actor, 0.99, "sp-0", whole_search=whole_search),
        )
        assert worker.threaded == (not whole_search)
        expected = [3, 2, 2] if whole_search and groups == 3 else ([4, 3] if groups == 3 else [2, 1])
        assert [len(half.rows) for half in worker.halves] == expected
        assert np.concatenate([half.rows for half in worker.halves]).tolist() == list(range(worker.num_envs))
        result = worker.collect(30, temperature=1.0)
        assert result["env_steps"] == 30 * worker.num_envs and result["transitions_sent"] > 0
        assert len(result["step_seconds"]) == 30
        # Where the steps went (bench selfplay's breakdown): the search and the envs are both timed, and the
        # phases fit inside the steps (the pipelined mode's first submit of each half is before the first step).
        phases = result["phase_seconds"]
        steps = {"search", "env", "record", "submit"}
        assert set(phases) == steps | {"queued", "device", "server"} and phases["search"] > 0 and phases["env"] > 0
        assert (phases["submit"] > 0) == whole_search
        assert sum(phases[name] for name in steps) <= sum(result["step_seconds"]) * 1.01
        # A whole search's answer says how long it queued and ran, and how long the inference actor held it (a CPU
        # search's waves do not); what it held it for includes its queueing and its running.
        assert (phases["device"] > 0) == whole_search and (phases["server"] > 0) == whole_search
        assert phases["server"] >= 0.99 * (phases["queued"] + phases["device"])
        batch = replay.sample(8)
        np.testing.assert_allclose(batch.target_policies[:, 0].sum(-1), 1.0, rtol=1e-5)
        # CartPole observations follow from each other: within a stored segment, no step is lost or repeated.
        a = replay._arrays
        for start in np.unique(a["seg_start"][a["alive"]]):
            obs = a["obs"][start:start + a["seg_len"][start]]
            assert len(np.unique(obs, axis=0)) == len(obs)
        clients = ray.get(actor.stats.remote())["channel_clients"]
        if not whole_search:
            assert {"sp-0-half0", "sp-0-half1"} <= set(clients)
        assert ray.get(actor.stats.remote())["errors"] == 0
    finally:
        ray.shutdown()


def _sequential(pool, clients, handles, store):
    """What check_allocate must equal: check, then allocate (or -1s), request by request."""
    out = []
    for client, h, keep in zip(clients, handles, store):
        try:
            pool.check(client, h)
            out.append(pool.allocate(client, len(h)) if keep else np.full(len(h), -1, np.int64))
        except InferenceError as error:
            out.append(error)
    return out


@pytest.mark.parametrize("timeout_s", [0.0, 30.0])
def test_a_batchs_slot_checks_and_allocations_at_once_equal_them_one_request_at_a_time(timeout_s):
    """A batch of 6 requests: good ones of two clients, an empty one, one with store=False, one with another
    client's handle and one out of range. Known answers on a 20-slot pool (slots are handed out from 0 up): the
    pools that served the batch at once and one request at a time end in the same state and gave the same slots and
    errors, and a refused request took no slots."""
    from rayzero.inference.pool import LatentPool

    pools = [LatentPool(20, timeout_s), LatentPool(20, timeout_s)]
    for pool in pools:
        assert pool.allocate("a", 3).tolist() == [0, 1, 2] and pool.allocate("b", 2).tolist() == [3, 4]
    clients = ["a", "b", "a", "b", "a", "b"]
    handles = [np.array([0, 2]), np.array([3]), np.array([], np.int64), np.array([4, 0]), np.array([1, 25]),
               np.array([4, 3, 3])]
    store = [True, True, True, True, True, False]
    batched = pools[0].check_allocate(clients, handles, store)
    one_by_one = _sequential(pools[1], clients, handles, store)
    assert [x.tolist() for x in batched[:3]] == [[5, 6], [7], []]
    assert "unknown latent handles for client 'b'" in str(batched[3])
    assert "out of range [0, 20): 1..25" in str(batched[4])
    assert batched[5].tolist() == [-1, -1, -1]
    for x, y in zip(batched, one_by_one):
        if isinstance(y, InferenceError):
            assert type(x) is type(y) and str(x) == str(y)
        else:
            assert x.tolist() == y.tolist()
    for pool in pools:
        assert pool.free == 20 - 8
    assert pools[0].allocate("c", 2).tolist() == pools[1].allocate("c", 2).tolist() == [8, 9]
    assert pools[0].release("a") == pools[1].release("a") == 3 + 2 and pools[0].release("b") == 2 + 1


def test_a_batch_that_needs_more_slots_than_are_free_reclaims_as_one_request_at_a_time_does():
    """A 6-slot pool: 'b' holds slot 0, then 'a' slots 1-4 (1 free). A batch of 'a' (2 rows) then 'b' (1 row) wants
    3: 'a''s allocation reclaims 'b', the least recently active client, and 'b''s request then fails its check,
    as one request at a time."""
    from rayzero.inference.pool import LatentPool

    answers = []
    for batched in (True, False):
        pool = LatentPool(6)
        b = pool.allocate("b", 1)
        a = pool.allocate("a", 4)
        clients, handles, store = ["a", "b"], [a[:2], b], [True, True]
        got = pool.check_allocate(clients, handles, store) if batched else _sequential(pool, clients, handles, store)
        answers.append(([g.tolist() if isinstance(g, np.ndarray) else str(g) for g in got], pool.free,
                        pool.reclaimed_clients))
    assert answers[0] == answers[1]
    (slots_a, error_b), free, reclaimed = answers[0]
    assert sorted(slots_a) == [0, 5] and "unknown latent handles for client 'b' (reclaimed" in error_b
    assert free == 0 and reclaimed == 1


def test_a_trunk_held_in_bf16_gives_the_same_bits_under_bf16_autocast():
    """The inference actor keeps its trunk's conv weights in bf16 (no weight cast per conv per simulation in the
    captured searches); under bf16 autocast, with its cast cache off as there, every output is the same bit for bit
    as the float32 model's, and weights copied in afterwards (a weight swap) are cast on the way."""
    import copy

    from rayzero.config import ModelConfig
    from rayzero.models import build_model
    from rayzero.models.networks import hold_trunk_in_bf16

    torch.manual_seed(0)
    model = build_model(ModelConfig(kind="resnet", channels=16, support_size=10, downsample=8), (4, 32, 32), 3).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    model.heads_fp32 = True
    held = copy.deepcopy(model)
    assert hold_trunk_in_bf16(held) == 15  # 2 in the downsampling, 2 per residual block (5 of them), the dynamics' 1
    assert held.value_conv.weight.dtype == torch.float32 and held.down[1].weight.dtype == torch.float32  # head, BN
    obs = torch.randint(0, 255, (6, 4, 32, 32), dtype=torch.uint8)
    action = torch.tensor([0, 1, 2, 0, 1, 2])

    def outputs(net):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            root = net.initial(obs)
            step = net.recurrent(root.latent, action)
        return [*root, *step]

    for a, b in zip(outputs(model), outputs(held)):
        assert torch.equal(a, b)
    params = dict(model.named_parameters())
    swapped = {k: v.clone().normal_(0, 0.2) if k in params else v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(swapped)
    for name, tensor in held.state_dict().items():
        tensor.copy_(swapped[name])  # as the runner's apply_weights does
    for a, b in zip(outputs(model), outputs(held)):
        assert torch.equal(a, b)
