"""The channel fast path for recurrent waves (real Ray actor, CPU): answers equal the network evaluated directly on
the same latents and actions; many clients at once each get their own rows; a bad request (handle out of range,
another client's handle, an action outside [0, A), too many rows) fails alone with an error naming the value, in
the same batch as good requests, and the actor keeps serving; backpressure refuses, the client retries."""

import threading
import time

import numpy as np
import pytest
import ray
import torch

from rayzero.config import InferenceConfig, ModelConfig
from rayzero.inference import InferenceError, InferenceServer
from rayzero.inference.channel import InferenceClient, InferenceOverloaded
from rayzero.models import build_model

MODEL = ModelConfig(kind="mlp", latent_dim=8, hidden=16, support_size=5)
OBS, A, POOL = (4,), 3, 4096


@pytest.fixture(scope="module")
def served():
    """The actor serving weights of a local twin (version 7), and that twin to check its answers against."""
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    torch.manual_seed(123)
    local = build_model(MODEL, OBS, A).eval()
    with torch.no_grad():  # the output layers start at zero (constant answers): random weights everywhere
        for p in local.parameters():
            p.copy_(0.5 * torch.randn_like(p))
    cfg = InferenceConfig(device="cpu", max_batch=256, min_bucket=4, max_wait_us=300, latent_pool_size=POOL)
    server = ray.remote(InferenceServer).options(max_concurrency=100).remote(MODEL, cfg, OBS, A, 0)
    assert ray.get(server.set_weights.remote(7, {k: v.clone() for k, v in local.state_dict().items()})) == 7
    yield server, local
    ray.shutdown()


class Tree:
    """A client's search as the local twin sees it: the latent behind each of its handles."""

    def __init__(self, local):
        self.local, self.latents = local, {}

    @torch.no_grad()
    def initial(self, obs, answer):
        o = self.local.initial(torch.from_numpy(obs))
        np.testing.assert_allclose(answer["value"], o.value.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(answer["policy_logits"], o.policy_logits.numpy(), rtol=1e-5, atol=1e-5)
        self.latents.update(zip(answer["handles"].tolist(), o.latent))

    @torch.no_grad()
    def recurrent(self, handles, actions, answer):
        latent = torch.stack([self.latents[h] for h in handles.tolist()])
        o = self.local.recurrent(latent, torch.from_numpy(np.asarray(actions, np.int64)))
        np.testing.assert_allclose(answer["value"], o.value.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(answer["reward"], o.reward.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(answer["policy_logits"], o.policy_logits.numpy(), rtol=1e-5, atol=1e-5)
        assert answer["version"] == 7
        self.latents.update(zip(answer["handles"].tolist(), o.latent))


def _search(server, local, name, seed, rows=8, waves=20, errors=None):
    """One client's search: an initial, then waves of `rows` leaves picked among all its handles so far."""
    try:
        rng = np.random.default_rng(seed)
        client = InferenceClient(server, name, max_rows=rows, obs_rows=rows)
        assert client.transport == "channel"
        tree = Tree(local)
        obs = rng.normal(size=(rows, *OBS)).astype(np.float32)
        tree.initial(obs, client.initial(obs))
        for _ in range(waves):
            handles = rng.choice(np.array(list(tree.latents)), size=rows)
            actions = rng.integers(0, A, size=rows)
            answer = client.recurrent(handles, actions)
            assert answer["handles"].shape == (rows,) and (answer["handles"] >= 0).all()
            tree.recurrent(handles, actions, answer)
        ray.get(server.release.remote(name))
        client.close()
    except BaseException as error:  # noqa: BLE001 - handed to the test's thread
        if errors is None:
            raise
        errors.append(error)


def test_wave_answers_equal_the_network_evaluated_directly(served):
    server, local = served
    _search(server, local, "direct", seed=0)


def test_many_clients_at_once_each_get_their_own_rows(served):
    server, local = served
    before = ray.get(server.stats.remote())["buckets"]
    errors: list[BaseException] = []
    threads = [threading.Thread(target=_search, args=(server, local, f"many-{i}", 100 + i, 8, 25, errors))
               for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    after = ray.get(server.stats.remote())["buckets"]
    requests = sum(m["requests"] - before.get(k, {}).get("requests", 0) for k, m in after.items()
                   if k.startswith("recurrent"))
    batches = sum(m["count"] - before.get(k, {}).get("count", 0) for k, m in after.items()
                  if k.startswith("recurrent"))
    assert requests == 12 * 25 and batches < requests  # waves of several clients shared batches


def _send(client, handles, actions, rows=None):
    """Write a recurrent request into the client's channel without waiting; returns its sequence number."""
    a = client.arrays
    a["handles"][:len(handles)] = handles
    a["actions"][:len(actions)] = actions
    return client._send(2, len(handles) if rows is None else rows, 1)


def _answer(client, seq, rows):
    client._wait(seq)
    out = client.arrays["out"]
    return {"handles": client.arrays["out_handles"][:rows].copy(), "value": out[:rows, 0].copy(),
            "reward": out[:rows, 1].copy(), "policy_logits": out[:rows, 2:].copy(),
            "version": int(client.arrays["header"][6])}


def test_bad_wave_requests_fail_alone_in_a_shared_batch_and_the_actor_keeps_serving(served):
    server, local = served
    names = ["good", "range", "foreign", "action", "negative", "rows"]
    clients = {n: InferenceClient(server, f"bad-{n}", max_rows=4, obs_rows=4) for n in names}
    trees = {n: Tree(local) for n in names}
    roots = {}
    for n in names:
        obs = np.random.default_rng(len(n)).normal(size=(4, *OBS)).astype(np.float32)
        roots[n] = clients[n].initial(obs)
        trees[n].initial(obs, roots[n])
    errors_before = ray.get(server.stats.remote())["errors"]
    good_actions = np.array([0, 1, 2, 1])
    requests = {
        "good": (roots["good"]["handles"], good_actions),
        "range": (np.array([roots["range"]["handles"][0], POOL + 5, 0, 1]), good_actions),
        "foreign": (roots["good"]["handles"], good_actions),  # another client's slots
        "action": (roots["action"]["handles"], np.array([0, 1, 7, 1])),
        "negative": (roots["negative"]["handles"], np.array([-2, 1, 0, 1])),
        "rows": (roots["rows"]["handles"], good_actions),
    }
    seqs = {n: _send(clients[n], *requests[n], rows=9 if n == "rows" else None) for n in names}  # one sweep
    answer = _answer(clients["good"], seqs["good"], 4)
    trees["good"].recurrent(*requests["good"], answer)
    expected = {"range": rf"latent handle out of range \[0, {POOL}\): 0\.\.{POOL + 5}",
                "foreign": "unknown latent handles for client 'bad-foreign'",
                "action": r"actions must be in \[0, 3\), got 7 at row 2",
                "negative": r"actions must be in \[0, 3\), got -2 at row 0",
                "rows": r"channel rows=9 must be in \[0, 4\]"}
    for n, pattern in expected.items():
        with pytest.raises(InferenceError, match=pattern):
            _answer(clients[n], seqs[n], 4)
    assert ray.get(server.stats.remote())["errors"] == errors_before + len(expected)
    for n in names:  # every channel keeps serving, the bad ones included
        handles = roots[n]["handles"]
        trees[n].recurrent(handles, good_actions, clients[n].recurrent(handles, good_actions))
        ray.get(server.release.remote(f"bad-{n}"))
        clients[n].close()


def test_backpressure_refuses_wave_requests_and_the_client_retries(served):
    cfg = InferenceConfig(device="cpu", max_batch=8, min_bucket=4, max_wait_us=300, max_queue=8)
    server = ray.remote(InferenceServer).options(max_concurrency=100).remote(MODEL, cfg, OBS, A, 0)
    ray.get(server.set_weights.remote(1, {k: v.clone() for k, v in served[1].state_dict().items()}))
    clients = [InferenceClient(server, f"bp-{i}", max_rows=8, obs_rows=8) for i in range(4)]
    roots = [c.initial(np.random.default_rng(i).normal(size=(8, *OBS)).astype(np.float32))
             for i, c in enumerate(clients)]
    actions = np.arange(8) % A
    # Hold the GPU thread so that the queue fills: the first request is taken, the second queued, the rest refused.
    ray.get(server.__ray_call__.remote(lambda self: self.gpu.submit(time.sleep, 1.0) and None))
    seqs = [_send(c, r["handles"], actions) for c, r in zip(clients, roots)]
    refused = 0
    for c, seq in zip(clients, seqs):
        try:
            assert np.isfinite(_answer(c, seq, 8)["value"]).all()
        except InferenceOverloaded as error:
            assert "inference.max_queue=8" in str(error)
            refused += 1
    stats = ray.get(server.stats.remote())
    assert refused >= 1 and stats["overloaded"] == refused and stats["errors"] == 0
    overloaded = ray.get(server.stats.remote())["overloaded"]
    ray.get(server.__ray_call__.remote(lambda self: self.gpu.submit(time.sleep, 0.5) and None))
    answers: list = [None] * len(clients)

    def wave(i):
        answers[i] = clients[i].recurrent(roots[i]["handles"], actions)  # refused ones are sent again

    threads = [threading.Thread(target=wave, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ray.get(server.stats.remote())["overloaded"] > overloaded
    for i, answer in enumerate(answers):
        reference = ray.get(server.recurrent.remote(f"bp-{i}", roots[i]["handles"], actions, False))
        np.testing.assert_allclose(answer["value"], reference["value"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(answer["policy_logits"], reference["policy_logits"], rtol=1e-5, atol=1e-6)
    ray.kill(server)


def test_the_batcher_waits_for_more_rows_only_while_another_channel_could_send_them(served):
    # A long max_wait (1 s) against loose bounds, so that a loaded 2-core machine's round trips (0.2 s and more
    # under other tests' load) cannot pass for the wait or hide it.
    cfg = InferenceConfig(device="cpu", max_batch=64, min_bucket=4, max_wait_us=1_000_000)
    server = ray.remote(InferenceServer).options(max_concurrency=100).remote(MODEL, cfg, OBS, A, 0)
    alone = InferenceClient(server, "alone", max_rows=4, obs_rows=4)
    root = alone.initial(np.zeros((4, *OBS), np.float32))  # waits max_wait: no batching rule for the first
    actions = np.array([0, 1, 2, 0])

    def round_trip(client):
        start = time.perf_counter()
        client.recurrent(root["handles"], actions, False)
        return time.perf_counter() - start

    # The only open channel is waiting for its answer: no other channel can add rows, so no 1 s wait.
    assert np.median([round_trip(alone) for _ in range(5)]) < 0.5
    idle = InferenceClient(server, "idle", max_rows=4, obs_rows=4)  # open, sending nothing
    assert idle.transport == "channel"
    assert round_trip(alone) >= 0.95  # another channel could still send: the batcher waits max_wait_us
    idle.close()
    assert np.median([round_trip(alone) for _ in range(5)]) < 0.5
    ray.kill(server)
