"""The wave queue (channel recurrent requests, poller thread -> GPU thread, no event loop), in one process: the
server's event loop runs on a thread of the test, clients write into their channels as InferenceClient does.

Known answers: waves are answered while the event loop is blocked; answers equal the network evaluated directly
on the same latents and actions; concurrent clients each get their own rows; a bad request in a shared batch fails
alone; at most WAVE_BATCHES wave jobs are unfinished at once and the queue holds at most max_queue rows."""

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from rayzero.config import InferenceConfig, ModelConfig
from rayzero.inference import InferenceError, InferenceOverloaded, InferenceServer
from rayzero.inference import channel as channels
from rayzero.inference.channel import InferenceClient
from rayzero.inference.server import WAVE_BATCHES
from rayzero.models import build_model

pytestmark = pytest.mark.skipif(not channels.ORDERED_STORES, reason="channels need ordered stores (x86-64)")

MODEL = ModelConfig(kind="mlp", latent_dim=8, hidden=16, support_size=5)
OBS, A, POOL = (4,), 3, 4096


@pytest.fixture(scope="module")
def local():
    """The network the servers serve (random weights: a fresh one's output layers are zero, so every row would
    look the same and a misplaced one go unseen)."""
    torch.manual_seed(321)
    net = build_model(MODEL, OBS, A).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(0.5 * torch.randn_like(p))
    return net


class Served:
    """An InferenceServer in this process, its event loop on a thread, serving `local`'s weights as version 7."""

    def __init__(self, local, **overrides):
        cfg = dict(device="cpu", max_batch=256, min_bucket=4, max_wait_us=300, latent_pool_size=POOL)
        cfg.update(overrides)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = InferenceServer(MODEL, InferenceConfig(**cfg), OBS, A, 0)
        assert self.call(self.server.set_weights(7, {k: v.clone() for k, v in local.state_dict().items()})) == 7

    def call(self, coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def client(self, name, rows):
        info = self.call(self.server.open_channel(name, rows, rows))
        assert info is not None
        client = InferenceClient(None, name, rows, rows, channel=False)
        client.arrays = {tag: np.load(path, mmap_mode="r+").view(np.ndarray) for tag, path in info["paths"].items()}
        return client

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Tree:
    """A client's search as the local twin sees it: the latent behind each of its handles."""

    def __init__(self, local):
        self.local, self.latents = local, {}

    @torch.no_grad()
    def initial(self, served, name, obs):
        answer = served.call(served.server.initial(name, obs))
        self.latents.update(zip(answer["handles"].tolist(), self.local.initial(torch.from_numpy(obs)).latent))
        return answer["handles"]

    @torch.no_grad()
    def check(self, handles, actions, answer, store=True):
        latent = torch.stack([self.latents[h] for h in np.asarray(handles).tolist()])
        o = self.local.recurrent(latent, torch.from_numpy(np.asarray(actions, np.int64)))
        np.testing.assert_allclose(answer["value"], o.value.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(answer["reward"], o.reward.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(answer["policy_logits"], o.policy_logits.numpy(), rtol=1e-5, atol=1e-5)
        assert answer["version"] == 7
        if store:
            assert (answer["handles"] >= 0).all()
            self.latents.update(zip(answer["handles"].tolist(), o.latent))
        else:
            assert (answer["handles"] == -1).all()


def send(client, handles, actions, rows=None):
    """Write a recurrent request into the channel without waiting for it; returns its sequence number."""
    a = client.arrays
    a["handles"][:len(handles)] = handles
    a["actions"][:len(actions)] = actions
    return client._send(channels.RECURRENT, len(handles) if rows is None else rows, 1)


def answer_of(client, seq, rows):
    client._wait(seq)
    out, a = client.arrays["out"], client.arrays
    return {"handles": a["out_handles"][:rows].copy(), "value": out[:rows, 0].copy(), "reward": out[:rows, 1].copy(),
            "policy_logits": out[:rows, 2:].copy(), "version": int(a["header"][channels.VERSION])}


def wait_for(condition, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def recurrent_buckets(server):
    return {k: m for k, m in server.stats()["buckets"].items() if k.startswith("recurrent")}


def delta(before, after, field):
    return sum(m[field] - before.get(k, {}).get(field, 0) for k, m in after.items())


def test_waves_are_answered_by_the_network_while_the_event_loop_is_blocked(local):
    served = Served(local)
    try:
        server, tree, rng = served.server, Tree(local), np.random.default_rng(0)
        client = served.client("direct", 8)
        handles = tree.initial(served, "direct", rng.normal(size=(8, *OBS)).astype(np.float32))
        for _ in range(10):  # waves over the whole tree so far
            picked = rng.choice(np.array(list(tree.latents)), size=8)
            actions = rng.integers(0, A, size=8)
            tree.check(picked, actions, client.recurrent(picked, actions))
        tree.check(handles[:3], [2, 1, 0], client.recurrent(handles[:3], np.array([2, 1, 0]), store=False), store=False)
        requests_before = server.stats()["requests"]

        gate = threading.Event()  # the event loop waits on it: only a path without the loop can answer
        served.loop.call_soon_threadsafe(gate.wait, 30)
        answers = []
        worker = threading.Thread(target=lambda: answers.append(client.recurrent(handles, np.arange(8) % A)))
        worker.start()
        worker.join(10)
        loop_was_blocked = not gate.is_set()
        gate.set()
        worker.join(10)
        assert loop_was_blocked and len(answers) == 1
        tree.check(handles, np.arange(8) % A, answers[0])
        stats = server.stats()
        assert stats["requests"] == requests_before + 1 and stats["errors"] == 0
        assert stats["queued_rows"] == 0 and 1 <= stats["wave_jobs_peak"] <= WAVE_BATCHES
        assert sum(m["requests"] for m in recurrent_buckets(server).values()) == 12
    finally:
        served.close()


def test_the_poller_sweeps_at_the_configured_interval_and_answers_as_before(local):
    """inference.poll_interval_us: the channels' poller sweeps that often while requests come (20 us by
    default); at a longer interval the answers are the same."""
    served = Served(local, poll_interval_us=300)
    try:
        tree, rng = Tree(local), np.random.default_rng(1)
        client = served.client("slow-poll", 8)
        handles = tree.initial(served, "slow-poll", rng.normal(size=(8, *OBS)).astype(np.float32))
        assert served.server._poller.sleep_s == pytest.approx(300e-6)
        for _ in range(5):
            actions = rng.integers(0, A, size=8)
            tree.check(handles, actions, client.recurrent(handles, actions, store=False), store=False)
        assert served.server.stats()["errors"] == 0
    finally:
        served.close()
    default = Served(local)
    try:
        default.client("fast-poll", 4)
        assert default.server._poller.sleep_s == pytest.approx(20e-6)
    finally:
        default.close()


def test_concurrent_clients_each_get_their_own_rows_in_shared_batches(local):
    served = Served(local, max_wait_us=2000)
    errors: list[BaseException] = []
    clients, waves = 8, 15

    def search(i):
        try:
            name, rng, tree = f"c{i}", np.random.default_rng(10 + i), Tree(local)
            client = served.client(name, 6)
            tree.initial(served, name, rng.normal(size=(6, *OBS)).astype(np.float32))
            for _ in range(waves):
                picked = rng.choice(np.array(list(tree.latents)), size=6)
                actions = rng.integers(0, A, size=6)
                tree.check(picked, actions, client.recurrent(picked, actions))
            served.call(served.server.close_channel(name))
            assert served.call(served.server.release(name)) == 6 * (waves + 1)
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            errors.append(error)

    try:
        # One client alone first, so that every first-time import and compile of the path happens in one thread:
        # CPython 3.11 can raise a spurious "AST constructor recursion depth mismatch" SystemError when threads
        # compile at once (python/cpython#106905; seen once in CI here).
        search(-1)
        before = recurrent_buckets(served.server)
        threads = [threading.Thread(target=search, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        if errors and all(isinstance(e, SystemError) and "AST constructor recursion depth mismatch" in str(e)
                          for e in errors):  # the warm-up above did not keep it away (seen twice in 30 CI runs)
            pytest.skip(f"CPython 3.11's python/cpython#106905 in a client thread: {errors[0]}")
        assert not errors, errors
        after = recurrent_buckets(served.server)
        requests, batches = delta(before, after, "requests"), delta(before, after, "count")
        assert requests == clients * waves and delta(before, after, "rows") == clients * waves * 6
        assert batches < requests  # waves of several clients shared batches
        assert served.server.stats()["errors"] == 0
    finally:
        served.close()


def test_a_bad_request_fails_alone_in_a_shared_batch(local):
    served = Served(local)
    try:
        server = served.server
        names = ["good", "good2", "range", "foreign", "released", "action", "rows"]
        clients = {n: served.client(n, 4) for n in names}
        trees = {n: Tree(local) for n in names}
        roots = {n: trees[n].initial(served, n, np.random.default_rng(i).normal(size=(4, *OBS)).astype(np.float32))
                 for i, n in enumerate(names)}
        served.call(server.release("released"))
        actions = np.array([0, 1, 2, 1])
        requests = {"good": (roots["good"], actions), "good2": (roots["good2"], actions[::-1].copy()),
                    "range": (np.array([roots["range"][0], POOL + 5, 0, 1]), actions),
                    "foreign": (roots["good"], actions), "released": (roots["released"], actions),
                    "action": (roots["action"], np.array([0, 1, 7, 1])), "rows": (roots["rows"], actions)}
        stats0, before = server.stats(), recurrent_buckets(server)
        gate = threading.Event()
        server.gpu.submit(gate.wait, 30)  # hold the GPU thread: every request lands in the wave queue first
        seqs = {n: send(clients[n], *requests[n], rows=9 if n == "rows" else None) for n in names}
        wait_for(lambda: server.stats()["requests"] == stats0["requests"] + 5, "five queued requests")
        gate.set()
        for n in ("good", "good2"):
            trees[n].check(*requests[n], answer_of(clients[n], seqs[n], 4))
        expected = {"range": rf"latent handle out of range \[0, {POOL}\): 0\.\.{POOL + 5}",
                    "foreign": "unknown latent handles for client 'foreign'",
                    "released": "unknown latent handles for client 'released'",
                    "action": r"actions must be in \[0, 3\), got 7 at row 2",
                    "rows": r"channel rows=9 must be in \[0, 4\]"}
        for n, pattern in expected.items():
            with pytest.raises(InferenceError, match=pattern):
                answer_of(clients[n], seqs[n], 4)
        after = recurrent_buckets(server)
        # One batch: both good requests and the three with bad handles (the poller refused the other two).
        assert delta(before, after, "count") == 1 and delta(before, after, "requests") == 5
        assert delta(before, after, "rows") == 8
        assert server.stats()["errors"] == stats0["errors"] + len(expected)
        for n in ("good", "range", "action", "rows"):  # the channels keep serving, the bad ones included
            trees[n].check(roots[n], actions, clients[n].recurrent(roots[n], actions))
    finally:
        served.close()


def test_at_most_wave_batches_unfinished_and_the_queue_is_bounded(local):
    served = Served(local, max_batch=8, max_wait_us=0, max_queue=16)
    try:
        server = served.server
        unfinished, peak, lock = [0], [0], threading.Lock()
        submit = server.gpu.submit

        def counted_submit(fn, *args, **kwargs):  # counts the wave jobs from outside the server's own counters
            if getattr(fn, "__name__", "") != "_wave_job":
                return submit(fn, *args, **kwargs)
            with lock:
                unfinished[0] += 1
                peak[0] = max(peak[0], unfinished[0])

            def run():
                try:
                    return fn(*args, **kwargs)
                finally:
                    with lock:
                        unfinished[0] -= 1
            return submit(run)

        server.gpu.submit = counted_submit
        gate, launched = threading.Event(), threading.Event()
        launch = server.runner.launch_recurrent

        def held_launch(*args):  # the first wave batch holds the GPU thread until the gate opens
            if not launched.is_set():
                launched.set()
                gate.wait(30)
            return launch(*args)

        server.runner.launch_recurrent = held_launch
        names = [f"q{i}" for i in range(10)]
        clients = [served.client(n, 4) for n in names]
        trees = [Tree(local) for _ in names]
        roots = [t.initial(served, n, np.random.default_rng(i).normal(size=(4, *OBS)).astype(np.float32))
                 for i, (t, n) in enumerate(zip(trees, names))]
        actions = np.array([2, 0, 1, 2])
        seqs = [send(clients[0], roots[0], actions)]
        wait_for(launched.is_set, "the first wave batch")
        for i in range(1, len(names)):  # one at a time, each in its own sweep
            seqs.append(send(clients[i], roots[i], actions))
            wait_for(lambda n=i + 1: server._wave_requests_n + server._wave_overloaded == n, f"request {i} seen")
            with lock:
                assert unfinished[0] <= WAVE_BATCHES
            assert server.gpu._work_queue.qsize() <= WAVE_BATCHES - 1
        stats = server.stats()
        assert stats["queued_rows"] == 16 and stats["peak_queued_rows"] == 16  # 4 requests of 4 rows wait
        assert stats["overloaded"] == 5 and stats["errors"] == 0
        gate.set()
        refused = []
        for i, seq in enumerate(seqs):
            try:
                trees[i].check(roots[i], actions, answer_of(clients[i], seq, 4))
            except InferenceOverloaded as error:
                assert "inference.max_queue=16" in str(error)
                refused.append(i)
        assert refused == [5, 6, 7, 8, 9]
        for i in refused:  # sent again, they are served
            trees[i].check(roots[i], actions, clients[i].recurrent(roots[i], actions))
        assert peak[0] == WAVE_BATCHES == server.stats()["wave_jobs_peak"]
        wait_for(lambda: unfinished[0] == 0, "the wave jobs to end")
        assert server.stats()["queued_rows"] == 0
    finally:
        served.close()


def test_a_wave_batch_between_the_batchers_batches_leaves_their_staging_slots_alone(local, emulated_cuda):
    """CUDA (emulated on the CPU: conftest.py): the batcher keeps one batch in flight while it launches
    the next, in the other of the runner's two staging slots. A wave job between the two must not make the next
    launch reuse the slot of the batch still in flight (its outputs would be overwritten before they are read).
    Order, made certain by holding the GPU thread: batcher launches X, a wave batch runs, batcher launches Y and
    only then finishes X; X's answer must be X's network outputs, not Y's."""
    served = Served(local, max_batch=16, max_wait_us=0, bf16=False, search_max_batch=0, switch_interval_us=0)
    try:
        server = served.server
        assert server.runner.cuda and server.runner.graphs
        rng = np.random.default_rng(5)
        wave_client, wave_tree = served.client("w", 4), Tree(local)
        wave_roots = wave_tree.initial(served, "w", rng.normal(size=(4, *OBS)).astype(np.float32))
        obs_x, obs_y = (rng.normal(size=(3, *OBS)).astype(np.float32) for _ in range(2))
        gate = threading.Event()
        server.gpu.submit(gate.wait, 30)
        x = asyncio.run_coroutine_threadsafe(server.initial("x", obs_x), served.loop)
        wait_for(lambda: server.gpu._work_queue.qsize() == 1, "the batcher's launch of X")
        seq = send(wave_client, wave_roots, np.array([1, 2, 0, 1]))
        wait_for(lambda: server.gpu._work_queue.qsize() == 2, "the wave job")
        y = asyncio.run_coroutine_threadsafe(server.initial("y", obs_y), served.loop)
        wait_for(lambda: server._loop_queued_rows() == 3, "Y queued")
        gate.set()
        wave_tree.check(wave_roots, [1, 2, 0, 1], answer_of(wave_client, seq, 4))
        with torch.no_grad():
            for future, obs in ((x, obs_x), (y, obs_y)):
                answer, direct = future.result(30), local.initial(torch.from_numpy(obs))
                np.testing.assert_allclose(answer["value"], direct.value.numpy(), rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(answer["policy_logits"], direct.policy_logits.numpy(), rtol=1e-5, atol=1e-5)
        assert server.stats()["errors"] == 0
    finally:
        served.close()

