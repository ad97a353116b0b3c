"""Shared-memory channels to the inference actor (real Ray actor, CPU): answers equal Ray calls; bad requests fail
alone with the actor's error; oversized requests, other nodes and closed channels fall back or reopen."""

import os
import time
import types

import numpy as np
import pytest
import ray

from rayzero.config import InferenceConfig, ModelConfig
from rayzero.inference import InferenceError, InferenceServer
from rayzero.inference.channel import SEARCH, TEMPERATURE_SCALE, InferenceClient

MODEL = ModelConfig(kind="mlp", latent_dim=8, hidden=16, support_size=5)


@pytest.fixture(scope="module")
def actor():
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    cfg = InferenceConfig(device="cpu", max_batch=64, min_bucket=4, max_wait_us=300)
    server = ray.remote(InferenceServer).options(max_concurrency=100).remote(MODEL, cfg, (4,), 3, 0)
    # Random weights: a fresh network's output layers start at zero, so every answer would be the same and a
    # swapped or misplaced row would go unseen.
    import torch

    from rayzero.models import build_model

    generator = torch.Generator().manual_seed(0)
    state = {k: (v + 0.5 * torch.randn(v.shape, generator=generator) if v.is_floating_point() else v).numpy()
             for k, v in build_model(MODEL, (4,), 3).state_dict().items()}
    ray.get(server.set_weights.remote(0, state))
    yield server
    ray.shutdown()


def test_channel_answers_equal_ray_calls(actor):
    client = InferenceClient(actor, "chan", max_rows=16, obs_rows=8)
    assert client.transport == "channel"
    obs = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    root = client.initial(obs)
    direct = ray.get(actor.initial.remote("direct", obs))
    for key in ("value", "reward", "policy_logits"):
        np.testing.assert_allclose(root[key], direct[key], rtol=1e-5, atol=1e-6)
    assert np.ptp(root["value"]) > 1e-3 and np.ptp(root["policy_logits"][:, 0]) > 1e-3  # rows differ
    actions = np.array([0, 1, 2, 0, 1, 2])
    step = client.recurrent(root["handles"], actions)
    direct_step = ray.get(actor.recurrent.remote("direct", direct["handles"], actions))
    for key in ("value", "reward", "policy_logits"):
        np.testing.assert_allclose(step[key], direct_step[key], rtol=1e-5, atol=1e-6)
    assert step["version"] == direct_step["version"] == 0
    # Two steps deep through the channel, from the handles it returned.
    deeper = client.recurrent(step["handles"], actions[::-1].copy())
    assert deeper["policy_logits"].shape == (6, 3) and np.isfinite(deeper["value"]).all()
    assert ray.get(actor.release.remote("chan")) == 18  # three requests of 6 rows
    ray.get(actor.release.remote("direct"))
    client.close()


def test_bad_channel_requests_fail_alone_and_the_channel_keeps_serving(actor):
    client = InferenceClient(actor, "bad", max_rows=8, obs_rows=4)
    root = client.initial(np.zeros((2, 4), np.float32))
    with pytest.raises(InferenceError, match=r"actions must be in \[0, 3\)"):
        client.recurrent(root["handles"], np.array([0, 7]))
    with pytest.raises(InferenceError, match="unknown latent handles"):
        client.recurrent(np.array([60000, 60001]), np.array([0, 1]))
    with pytest.raises(InferenceError, match="NaN"):
        client.initial(np.full((1, 4), np.nan, np.float32))
    with pytest.raises(InferenceError, match="obs shape"):  # wrong shape: sent as a Ray call, validated there
        client.initial(np.zeros((1, 5), np.float32))
    ok = client.recurrent(root["handles"], np.array([1, 2]))
    assert np.isfinite(ok["value"]).all()
    ray.get(actor.release.remote("bad"))
    client.close()


def test_oversized_requests_fall_back_and_a_closed_channel_reopens(actor):
    client = InferenceClient(actor, "big", max_rows=2, obs_rows=2)
    root = client.initial(np.ones((5, 4), np.float32))  # more rows than the channel holds: a Ray call
    step = client.recurrent(root["handles"], np.zeros(5, np.int64))
    assert step["value"].shape == (5,)
    assert ray.get(actor.close_channel.remote("big"))
    again = client.recurrent(root["handles"][:2], np.ones(2, np.int64))  # the client opens a new channel
    assert client.transport == "channel" and again["value"].shape == (2,)
    ray.get(actor.release.remote("big"))
    client.close()


def test_open_channel_checks_its_arguments_and_other_nodes_get_none(actor):
    with pytest.raises(InferenceError, match="max_rows=0"):
        ray.get(actor.open_channel.remote("x", 0))
    assert ray.get(actor.open_channel.remote("x", 4, 0, "another-node")) is None
    with pytest.raises(InferenceError, match="pid=-3"):
        ray.get(actor.open_channel.remote("x", 4, 0, None, -3))
    errors_before = ray.get(actor.stats.remote())["errors"]
    assert errors_before >= 2


def test_a_dead_actor_raises_instead_of_leaving_the_client_waiting(actor):
    cfg = InferenceConfig(device="cpu", max_batch=16, min_bucket=4)
    doomed = ray.remote(InferenceServer).options(max_concurrency=10, max_restarts=0).remote(MODEL, cfg, (4,), 3, 0)
    client = InferenceClient(doomed, "orphan", max_rows=4, obs_rows=2)
    root = client.initial(np.zeros((2, 4), np.float32))
    assert client.transport == "channel"
    pid = ray.get(doomed.__ray_call__.remote(lambda self: os.getpid()))
    ray.kill(doomed)
    deadline = time.monotonic() + 30  # Ray reports the actor dead before its process has exited
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.05)
    with pytest.raises(ray.exceptions.RayActorError):
        client.recurrent(root["handles"], np.array([0, 1]))


@ray.remote(num_cpus=0)
class _ChannelUser:
    def __init__(self, server, name):
        self.client = InferenceClient(server, name, max_rows=8, obs_rows=8)

    def run(self, obs, actions):
        out = [self.client.initial(obs)]
        for step_actions in actions:
            out.append(self.client.recurrent(out[-1]["handles"], step_actions))
        return self.client.transport, out


def test_concurrent_channel_clients_each_get_their_own_answers(actor):
    rng = np.random.default_rng(1)
    users = [_ChannelUser.remote(actor, f"user-{i}") for i in range(4)]
    obs = [rng.normal(size=(5, 4)).astype(np.float32) for _ in users]
    actions = [[rng.integers(0, 3, size=5) for _ in range(6)] for _ in users]
    results = ray.get([u.run.remote(o, a) for u, o, a in zip(users, obs, actions)])
    for i, (transport, out) in enumerate(results):
        assert transport == "channel"
        expected = ray.get(actor.initial.remote(f"ref-{i}", obs[i]))
        np.testing.assert_allclose(out[0]["value"], expected["value"], rtol=1e-5, atol=1e-6)
        for step, step_actions in zip(out[1:], actions[i]):
            expected = ray.get(actor.recurrent.remote(f"ref-{i}", expected["handles"], step_actions))
            np.testing.assert_allclose(step["policy_logits"], expected["policy_logits"], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(step["reward"], expected["reward"], rtol=1e-5, atol=1e-6)
    for i in range(4):
        ray.get([actor.release.remote(f"user-{i}"), actor.release.remote(f"ref-{i}")])
    for user in users:
        ray.kill(user)


def test_a_dead_clients_channel_closes_and_its_latent_slots_are_freed(actor):
    before = ray.get(actor.stats.remote())
    user = _ChannelUser.remote(actor, "short-lived")
    rng = np.random.default_rng(2)
    transport, _ = ray.get(user.run.remote(rng.normal(size=(6, 4)).astype(np.float32),
                                           [rng.integers(0, 3, size=6) for _ in range(3)]))
    assert transport == "channel"
    during = ray.get(actor.stats.remote())
    assert during["free_slots"] == before["free_slots"] - 4 * 6 and "short-lived" in during["channel_clients"]
    ray.kill(user)  # no release, no close: the process just ends
    deadline = time.monotonic() + 30
    after = during
    while time.monotonic() < deadline and "short-lived" in after["channel_clients"]:
        time.sleep(0.2)
        after = ray.get(actor.stats.remote())
    assert "short-lived" not in after["channel_clients"]
    assert after["free_slots"] == before["free_slots"] and after["gone_clients"] > during["gone_clients"]
    # The server goes on serving channel clients.
    assert ray.get(_ChannelUser.remote(actor, "next").run.remote(np.zeros((2, 4), np.float32), []))[0] == "channel"


def test_an_overloaded_answer_keeps_its_type_through_a_channel():
    from rayzero.inference import InferenceOverloaded, channel

    made = channel.create("client", 4, 0, (4,), np.dtype(np.float32), 3)
    assert made is not None
    server_side, paths = made
    server_side.fail(1, InferenceOverloaded("inference actor overloaded: retry later"))
    assert server_side.header[channel.STATUS] == channel.OVERLOADED and server_side.header[channel.DONE] == 1
    server_side.fail(2, InferenceError("bad"))
    assert server_side.header[channel.STATUS] == 1


def test_a_client_waits_out_an_overloaded_actor(monkeypatch):
    """InferenceClient sends a request the actor refused as overloaded again after a pause (clients block, not
    fail); past its timeout the error comes through."""
    from rayzero.inference import InferenceOverloaded

    answer = {"handles": np.zeros(1, np.int64)}
    refusals = [3]

    def initial(client, obs):
        if refusals[0]:
            refusals[0] -= 1
            raise InferenceOverloaded("inference actor overloaded: retry later")
        return answer

    server = types.SimpleNamespace(initial=types.SimpleNamespace(remote=initial))
    monkeypatch.setattr(ray, "get", lambda value, **kwargs: value)
    client = InferenceClient(server, "c", max_rows=4, channel=False)
    assert client.initial(np.zeros((1, 4), np.float32)) is answer and refusals[0] == 0
    refusals[0] = 10**6
    client.timeout_s = 0.05
    with pytest.raises(InferenceOverloaded):
        client.initial(np.zeros((1, 4), np.float32))


def test_overloaded_crosses_ray_as_its_type(actor):
    """Through Ray calls a refused request raises InferenceOverloaded (what clients catch to retry)."""
    from rayzero.inference import InferenceOverloaded

    cfg = InferenceConfig(device="cpu", max_batch=64, min_bucket=4, max_wait_us=200_000, max_queue=4)
    small = ray.remote(InferenceServer).options(max_concurrency=100).remote(MODEL, cfg, (4,), 3, 0)
    refs = [small.initial.remote(f"c{i}", np.zeros((2, 4), np.float32)) for i in range(6)]
    outcomes = []
    for ref in refs:
        try:
            outcomes.append(ray.get(ref)["handles"].shape)
        except InferenceOverloaded as error:
            outcomes.append("overloaded" if "max_queue=4" in str(error) else error)
    assert outcomes.count((2,)) >= 2 and outcomes.count("overloaded") >= 1, outcomes
    assert set(outcomes) <= {(2,), "overloaded"}, outcomes
    ray.kill(small)


def test_whole_searches_through_the_channel_equal_ray_calls_and_two_can_be_in_flight(actor):
    from rayzero.tree import SearchConfig

    cfg = InferenceConfig(device="cpu", max_batch=64, min_bucket=4, max_wait_us=300)
    search_cfg = SearchConfig(num_simulations=8, dirichlet_fraction=0.0)  # no noise: answers are comparable
    server = ray.remote(InferenceServer).options(max_concurrency=100).remote(
        MODEL, cfg, (4,), 3, 0, search_cfg=search_cfg, discount=0.99)
    obs = np.random.default_rng(1).normal(size=(5, 4)).astype(np.float32)
    direct = ray.get(server.search.remote("direct", obs, temperature=0.0))
    first, second = (InferenceClient(server, name, max_rows=5, obs_rows=5) for name in ("s0", "s1"))
    assert first.transport == second.transport == "channel"
    first.submit_search(obs, 0.0)
    second.submit_search(obs[::-1].copy(), 0.0)  # both in flight at once, each on its own channel
    with pytest.raises(InferenceError, match="already in flight"):
        first.submit_search(obs, 0.0)
    answer, reversed_answer = first.wait_search(), second.wait_search()
    np.testing.assert_array_equal(answer["action"], direct["action"])
    np.testing.assert_allclose(answer["action_weights"], direct["action_weights"], rtol=1e-6)
    np.testing.assert_allclose(answer["root_value"], direct["root_value"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(reversed_answer["action"], direct["action"][::-1])
    assert answer["action"].dtype == np.int64 and answer["version"] == direct["version"]
    # The temperature travels with the request: at 1 the actions are drawn, at 0 they are the most visited.
    np.testing.assert_array_equal(answer["action"], answer["action_weights"].argmax(1))
    with pytest.raises(InferenceError, match="no search in flight"):
        first.wait_search()
    # The GPU thread wrote these answers into their channels: none went back through the event loop.
    assert ray.get(server.stats.remote())["channel_answers"] == {"event_loop": 0, "gpu_thread": 2}
    _bad_search_fails_alone(first, obs, direct["action"])
    assert ray.get(server.stats.remote())["channel_answers"] == {"event_loop": 1, "gpu_thread": 3}
    ray.kill(server)


def _bad_search_fails_alone(client: InferenceClient, obs: np.ndarray, actions: np.ndarray) -> None:
    """A search past InferenceClient's own checks (a negative temperature written into the channel's header)
    fails alone, with what was wrong, and the channel answers the next one (its actions: `actions`)."""
    client.arrays["obs"][:len(obs)] = obs
    client._inflight = (client._send(SEARCH, len(obs), -TEMPERATURE_SCALE), obs, -1.0, False)
    with pytest.raises(InferenceError, match="bad search config override.*temperature"):
        client.wait_search()
    client.submit_search(obs, 0.0)
    np.testing.assert_array_equal(client.wait_search()["action"], actions)


def test_a_lone_clients_searches_skip_the_event_loop_and_a_bad_one_fails_alone(actor):
    """One env's (or an evaluation's) searches: with the batcher holding nothing and no other channel able to add
    rows, the poller hands each straight to the GPU thread, which answers into the channel; the answers are a Ray call's."""
    from rayzero.tree import SearchConfig

    cfg = InferenceConfig(device="cpu", max_batch=64, min_bucket=4, max_wait_us=300)
    search_cfg = SearchConfig(num_simulations=8, dirichlet_fraction=0.0)
    server = ray.remote(InferenceServer).options(max_concurrency=100).remote(
        MODEL, cfg, (4,), 3, 0, search_cfg=search_cfg, discount=0.99)
    obs = np.random.default_rng(4).normal(size=(3, 4)).astype(np.float32)
    client = InferenceClient(server, "one", max_rows=3, obs_rows=3)
    direct = ray.get(server.search.remote("direct", obs, temperature=0.0))  # a Ray call: through the batcher
    for _ in range(3):
        client.submit_search(obs, 0.0)
        answer = client.wait_search()
        np.testing.assert_array_equal(answer["action"], direct["action"])
        np.testing.assert_allclose(answer["action_weights"], direct["action_weights"], rtol=1e-6)
        np.testing.assert_allclose(answer["root_value"], direct["root_value"], rtol=1e-5, atol=1e-6)
        assert answer["server_ms"] >= answer["queue_ms"] + answer["device_ms"] > 0
    stats = ray.get(server.stats.remote())
    assert stats["lone_searches"] == 3 and stats["channel_answers"] == {"event_loop": 0, "gpu_thread": 3}
    _bad_search_fails_alone(client, obs, direct["action"])  # counted as an error
    stats = ray.get(server.stats.remote())
    assert stats["errors"] == 1 and stats["lone_searches"] == 4
    ray.kill(server)


def test_an_evaluations_greedy_search_goes_through_the_channel_and_searches_without_noise(actor):
    """The evaluation's per-step search (temperature 0, no root noise) travels through the shared-memory channel,
    not a Ray call carrying the observations, and gives what the same search through a Ray call gives, on a
    server whose own config has root noise (a noisy search would differ)."""
    from rayzero.actors.network import RemoteNetwork
    from rayzero.tree import SearchConfig

    cfg = InferenceConfig(device="cpu", max_batch=64, min_bucket=4, max_wait_us=300)
    search_cfg = SearchConfig(num_simulations=16, dirichlet_fraction=0.5, cpu_backend="torch")
    server = ray.remote(InferenceServer).options(max_concurrency=100).remote(
        MODEL, cfg, (4,), 3, 0, search_cfg=search_cfg, discount=0.99)
    ray.get(server.set_weights.remote(1, _random_state()))
    obs = np.random.default_rng(2).normal(size=(6, 4)).astype(np.float32)
    greedy = {"dirichlet_fraction": 0.0, "gumbel_scale": 0.0}
    direct = ray.get(server.search.remote("direct", obs, temperature=0.0, **greedy))
    network = RemoteNetwork(server, 0.99, "eval", whole_search=True, channel=True)
    answers = [network.search(obs, 0.0, **greedy) for _ in range(2)]
    assert network.search_clients[0].transport == "channel"
    for answer in answers:
        np.testing.assert_array_equal(answer["action"], direct["action"])
        np.testing.assert_allclose(answer["action_weights"], direct["action_weights"], rtol=1e-6)
        np.testing.assert_array_equal(answer["action"], answer["action_weights"].argmax(1))
        assert answer["version"] == 1 and answer["queue_ms"] >= 0 and answer["device_ms"] > 0
        assert answer["server_ms"] >= answer["queue_ms"] + answer["device_ms"]  # submitted to answered
    noisy = [network.search(obs, 0.0)["action_weights"] for _ in range(3)]  # the server's noise: rows change
    assert any(not np.allclose(w, direct["action_weights"]) for w in noisy)
    # A channel the actor dropped is opened anew by the next search, not left to Ray calls for the rest of the run.
    assert ray.get(server.close_channel.remote("eval-search0"))
    np.testing.assert_array_equal(network.search(obs, 0.0, **greedy)["action"], direct["action"])
    from rayzero.inference.channel import CLOSED

    assert network.search_clients[0].arrays["header"][CLOSED] == 0  # a new channel, not the dropped one
    ray.kill(server)


def _random_state() -> dict:
    import torch

    from rayzero.models import build_model

    generator = torch.Generator().manual_seed(3)
    return {k: (v + 0.5 * torch.randn(v.shape, generator=generator) if v.is_floating_point() else v).numpy()
            for k, v in build_model(MODEL, (4,), 3).state_dict().items()}


@pytest.mark.parametrize("failures", [2, 3])
def test_a_failed_whole_search_is_sent_again_and_one_that_keeps_failing_raises(actor, failures):
    """Self-play does not end on one failed batch of the inference actor (RemoteNetwork.wait_search)."""
    from rayzero.actors.network import SEARCH_RETRIES, RemoteNetwork
    from rayzero.tree import SearchConfig

    class FailingSearches(InferenceServer):  # defined here: Ray's workers cannot import test modules
        """An inference actor whose first `failures` whole searches fail, as a batch does when the device errs."""

        def __init__(self, *args, failures=0, **kwargs):
            super().__init__(*args, **kwargs)
            self.failures = failures

        def _launch_search(self, batch):
            if self.failures > 0:
                self.failures -= 1
                raise RuntimeError("CUDA error: operation failed during capture")
            return super()._launch_search(batch)

    cfg = InferenceConfig(device="cpu", max_batch=64, min_bucket=4, max_wait_us=300)
    server = ray.remote(FailingSearches).options(max_concurrency=100).remote(
        MODEL, cfg, (4,), 3, 0, search_cfg=SearchConfig(num_simulations=4), discount=0.99, failures=failures)
    network = RemoteNetwork(server, 0.99, "retry", whole_search=True, channel=True)
    obs = np.random.default_rng(2).normal(size=(3, 4)).astype(np.float32)
    try:
        if failures <= SEARCH_RETRIES:
            answer = network.search(obs, 1.0)
            assert answer["action"].shape == (3,) and np.allclose(answer["action_weights"].sum(1), 1.0)
            assert network.search_clients[0].transport == "channel"
        else:
            with pytest.raises(InferenceError, match="operation failed during capture"):
                network.search(obs, 1.0)
            assert len(network.search(obs, 1.0)["action"]) == 3  # the actor serves again afterwards
    finally:
        ray.kill(server)


def test_set_published_takes_the_learners_weights_ref_once_it_is_made(actor):
    """The driver hands the inference actor the ref of a learner's weights() result without waiting for it
    (train.py's _publish): the actor serves the new weights once they exist, with their version."""
    cfg = InferenceConfig(device="cpu", max_batch=16, min_bucket=4)
    server = ray.remote(InferenceServer).options(max_concurrency=10).remote(MODEL, cfg, (4,), 3, 0)
    obs = np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)
    before = ray.get(server.initial.remote("c", obs))

    @ray.remote
    def slow_weights():  # a learner's weights(): (version, state_dict), ready after a while
        import torch

        from rayzero.models import build_model

        time.sleep(1.0)
        generator = torch.Generator().manual_seed(3)
        return 5, {k: (v + torch.randn(v.shape, generator=generator) if v.is_floating_point() else v).numpy()
                   for k, v in build_model(MODEL, (4,), 3).state_dict().items()}

    ref = slow_weights.remote()
    done = server.set_published.remote(ref)
    assert ray.get(server.get_version.remote()) == 0  # the actor serves on while the weights are being made
    assert ray.get(done) == 5
    after = ray.get(server.initial.remote("c", obs))
    assert after["version"] == 5 and not np.allclose(after["value"], before["value"])
    ray.kill(server)


@pytest.mark.skipif(not os.path.exists("/proc/self/timerslack_ns"), reason="Linux timer slack")
def test_the_poller_thread_sleeps_with_a_fine_timer_slack_and_other_threads_keep_theirs():
    """Linux ends a sleep up to the thread's timer slack late (50 us by default): the poller's 20 us sweeps set
    their thread's slack to 1 us. Known answers: the poller's thread reads back 1000 ns (prctl); the thread that
    made the poller keeps the slack it had; so does a thread that sets it (`set_timer_slack` returns 1000)."""
    import ctypes

    from rayzero.inference import channel

    libc = ctypes.CDLL(None)
    mine = libc.prctl(30, 0, 0, 0, 0)  # PR_GET_TIMERSLACK
    poller = channel.Poller(lambda new: None)
    deadline = time.monotonic() + 5
    while poller.timer_slack_ns is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert poller.timer_slack_ns == channel.POLL_TIMER_SLACK_NS == 1000
    assert libc.prctl(30, 0, 0, 0, 0) == mine

    out = []
    thread = __import__("threading").Thread(
        target=lambda: out.append((channel.set_timer_slack(1000), libc.prctl(30, 0, 0, 0, 0))))
    thread.start()
    thread.join()
    assert out == [(1000, 1000)] and libc.prctl(30, 0, 0, 0, 0) == mine


def test_the_poller_sweeps_fast_while_a_request_is_in_flight_and_backs_off_once_answered():
    """A search can outlast the poller's idle_after_s; its client's next request comes right after the answer, so
    the poller must not be in its long idle sleeps then. Known answer: with idle sweeps 50 ms apart, 200 ms with a
    request in flight see hundreds of sweeps (20 us apart); 200 ms after its answer see at most a handful."""
    from rayzero.inference import channel

    sweeps = []
    poller = channel.Poller(lambda new: None, idle_after_s=0.001, idle_sleep_s=0.05,
                            on_idle=lambda: sweeps.append(time.monotonic()) and False)
    header = np.zeros(channel.HEADER, dtype=np.int64)
    poller.add(channel.ServerChannel("c", {"header": header}))
    header[channel.REQ] = 1  # sent, not answered
    time.sleep(0.05)
    start = len(sweeps)
    time.sleep(0.2)
    in_flight = len(sweeps) - start
    header[channel.DONE] = 1  # answered
    time.sleep(0.1)
    start = len(sweeps)
    time.sleep(0.2)
    answered = len(sweeps) - start
    assert in_flight > 100, in_flight
    assert answered <= 6, answered


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="the doorbell is a pipe opened through /proc")
def test_with_two_requests_in_flight_the_poller_sleeps_on_its_doorbell_and_a_ring_wakes_it():
    """Many clients' requests in flight (a GPU host's self-play) leave the poller asleep on its doorbell rather
    than sweeping every 20 us. Known answers: 200 ms with two requests in flight see at most a handful of sweeps
    (50 ms doorbell waits), against hundreds with one in flight (the test above); a third client's request,
    written and rung as `InferenceClient` does, is handed on well before the next 50 ms wait would end; one
    written without a ring is still handed on, when a wait runs out."""
    from rayzero.inference import channel

    seen = []
    poller = channel.Poller(lambda new: seen.extend((c.client, seq, time.monotonic()) for c, seq in new))
    assert poller.doorbell_path is not None
    headers = {name: np.zeros(channel.HEADER, dtype=np.int64) for name in "abc"}
    for name, header in headers.items():
        poller.add(channel.ServerChannel(name, {"header": header}))
    headers["a"][channel.REQ] = headers["b"][channel.REQ] = 1  # two requests in flight, never answered here
    time.sleep(0.1)
    start = poller.sweeps
    time.sleep(0.2)
    asleep = poller.sweeps - start
    bell = os.open(poller.doorbell_path, os.O_WRONLY | os.O_NONBLOCK)
    try:
        rung_at = time.monotonic()
        headers["c"][channel.REQ] = 1
        os.write(bell, b"\1")
        deadline = rung_at + 5
        while not any(c == "c" for c, _, _ in seen) and time.monotonic() < deadline:
            time.sleep(0.001)
        rung = [t for c, _, t in seen if c == "c"][0] - rung_at
    finally:
        os.close(bell)
    time.sleep(0.06)  # past the wait that the ring ended
    silent_at = time.monotonic()
    headers["c"][channel.REQ] = 2  # no ring: seen only when the doorbell wait runs out
    deadline = silent_at + 5
    while not any(c == "c" and seq == 2 for c, seq, _ in seen) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert asleep <= 10, asleep
    assert rung < 0.025, rung
    assert {(c, seq) for c, seq, _ in seen} == {("a", 1), ("b", 1), ("c", 1), ("c", 2)}
