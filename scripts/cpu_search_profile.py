"""Where a CPU-search simulation wave's time goes (issue 15): the real path, one stage at a time.

A real `InferenceServer` Ray actor (on the CPU, a tiny MLP, so the network costs little and the overhead shows) and
a real self-play actor (`cluster.build._RemoteSelfPlay` with `search.device=cpu`: two halves that walk their
compiled trees in two threads and send one recurrent request per simulation wave through a shared-memory channel).
Both are subclassed here only to time what the real methods do (wrappers around them, no other code path):

  actor side, per wave and half: the compiled tree call (`tree/cpu.py` `_wave`: the previous wave's backup and this
  wave's walk), packing (RemoteNetwork.recurrent_fn up to the channel's request), the channel round trip (request
  written -> answer seen), unpacking (answer seen -> recurrent_fn returns), and the search's glue (the rest of the
  search loop: checks, softmax, addresses);
  server side, per request: request written -> the poller sees it, -> queued (on the event loop; with the wave
  queue, by the poller thread itself), -> its batch launches on the GPU thread, the batch's launch (on the CPU: the
  network), -> its answer written, -> the client sees it. Clocks: time.perf_counter (CLOCK_MONOTONIC, one clock
  for every process of the machine).

Prints one table per row (roots per half) and writes JSON (machine, versions, date).

    python scripts/cpu_search_profile.py --roots 16,32 --simulations 50 --steps 8 --json runs/cpu_profile.json
"""

from __future__ import annotations

import argparse
import collections
import os
import threading
import time
from typing import Any

import numpy as np

from rayzero.cluster.build import _RemoteSelfPlay
from rayzero.inference.server import InferenceServer

_now = time.perf_counter


class ProfiledServer(InferenceServer):
    """The inference actor, with each channel wave request's times recorded: seen by the poller, queued (event
    loop or wave queue, whichever the served rayzero has), its batch's launch start and end, answered. Keyed by
    (client, seq)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._prof: dict[tuple[str, int], list[float]] = {}
        self._prof_batches: list[tuple[int, int, float, float]] = []  # (requests, rows, launch s, finish s)
        self._prof_lock = threading.Lock()

    def _on_channel_requests(self, new):
        now = _now()
        with self._prof_lock:
            for channel, seq in new:
                self._prof[(channel.client, seq)] = [now, 0.0, 0.0, 0.0, 0.0]
        return super()._on_channel_requests(new)

    def _queued(self, requests):
        now = _now()
        for r in requests:
            e = self._prof.get((r.client, r.seq))
            if e is not None:
                e[1] = now

    def _enqueue_channel(self, requests, others):  # rayzero before the wave queue: the event loop queues waves
        self._queued(requests)
        return super()._enqueue_channel(requests, others)

    def _queue_waves(self, requests):  # with the wave queue: the poller thread queues them (no event loop)
        self._queued(requests)
        return super()._queue_waves(requests)

    def _launch(self, key, requests):
        start = _now()
        batch = super()._launch(key, requests)
        end = _now()
        for r in requests:
            e = self._prof.get((r.client, r.seq)) if r.channel is not None else None
            if e is not None:
                e[2], e[3] = start, end
        batch._prof_launch = end - start
        return batch

    def _finish(self, batch):
        start = _now()
        results = super()._finish(batch)
        end = _now()
        for r in batch.requests:
            e = self._prof.get((r.client, r.seq)) if r.channel is not None else None
            if e is not None:
                e[4] = end
        if batch.kind == "recurrent":
            self._prof_batches.append((len(batch.requests), sum(r.rows for r in batch.requests),
                                       getattr(batch, "_prof_launch", 0.0), end - start))
        return results

    def prof_fake_network(self, us: float) -> None:
        """After the weights are in (see _fake_network)."""
        _fake_network(self.runner, us / 1e6)
        self._prof_fake = True

    def _step(self, key, requests, inflight):
        """With the fake network, recurrent batches stay in flight while the next gathers (the GPU's `_step`)."""
        if not getattr(self, "_prof_fake", False):
            return super()._step(key, requests, inflight)
        launched = self._launch(key, requests)
        done = [(inflight, self._finish(inflight))] if inflight is not None else []
        if key != "recurrent":
            done.append((launched, self._finish(launched)))
            launched = None
        return launched, done

    def prof_take(self) -> dict[str, Any]:
        with self._prof_lock:
            events, self._prof = self._prof, {}
        batches, self._prof_batches = self._prof_batches, []
        return {"events": {f"{c}|{s}": v for (c, s), v in events.items()}, "batches": batches}

    def prof_net_seconds(self, rows: int, iters: int = 200) -> float:
        """Seconds of the bare network step for `rows` leaves (runner.launch_recurrent + wait), back to back."""
        import numpy as np

        handles = self.pool.allocate("__prof__", rows)
        src, act = handles.copy(), np.zeros(rows, np.int64)
        fut = self.gpu.submit(lambda: [self.runner.wait(self.runner.launch_recurrent(src, act, handles))
                                       for _ in range(10)])
        fut.result()

        def run():
            t = _now()
            for _ in range(iters):
                self.runner.wait(self.runner.launch_recurrent(src, act, handles))
            return (_now() - t) / iters
        seconds = self.gpu.submit(run).result()
        self.pool.release("__prof__")
        return seconds


def _fake_network(runner: Any, seconds: float) -> None:
    """What-if (--fake-network-us): recurrent batches cost the host what a CUDA-graph launch does (next to nothing)
    and finish `seconds` after their launch, as a GPU's would, the GPU thread waiting with the GIL released; the
    answers are zeros (a search still runs: every leaf looks the same). The latent pool is not written."""
    from rayzero.inference.runner import Flight

    wait = runner.wait

    def fake_launch(src, action, dst):
        n = len(src)
        flight = Flight("recurrent", n, runner.bucket(n) or n, False, {"out": np.zeros((n, 2 + runner.A), np.float32)})
        flight.cpu_s = seconds
        flight._done_at = _now() + seconds
        return flight

    def fake_wait(flight):
        done_at = getattr(flight, "_done_at", None)
        if done_at is None:
            return wait(flight)
        left = done_at - _now()
        if left > 0:
            time.sleep(left)
        flight.gpu_s = flight.cpu_s
        return flight.outputs

    runner.launch_recurrent, runner.wait = fake_launch, fake_wait


class ProfiledSelfPlay(_RemoteSelfPlay):
    """The self-play actor, with the time of each stage of each search wave summed per thread (half)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        _install_client_timers(type(self))

    def prof_take(self) -> dict[str, Any]:
        st = _state()
        out = {name: dict(v) for name, v in st.stats.items()}
        sends = list(st.sends)
        st.stats.clear()
        st.sends.clear()
        return {"threads": out, "sends": sends}


def _state() -> Any:
    """This process's timers (a module in sys.modules: the functions here travel to the actors by value)."""
    import sys
    import types

    state = sys.modules.get("_cpu_search_profile_state")
    if state is None:
        state = types.ModuleType("_cpu_search_profile_state")
        state.stats = collections.defaultdict(collections.Counter)  # per thread name
        state.sends = []  # (client, seq, written, answer seen) of each wave request
        state.local = threading.local()
        sys.modules[state.__name__] = state
    return state


def _install_client_timers(worker_class: type) -> None:
    """Wrap (in this process) the functions a CPU search's wave goes through, to time them."""
    from rayzero.actors import network, selfplay
    from rayzero.inference import channel
    from rayzero.tree import cpu

    if getattr(cpu, "_profiled", False):
        return
    cpu._profiled = True
    st = _state()
    _LOCAL, _SENDS = st.local, st.sends

    def stats() -> collections.Counter:
        return st.stats[threading.current_thread().name]

    wave = cpu._wave

    def timed_wave(*args):
        t = _now()
        try:
            return wave(*args)
        finally:
            s = stats()
            s["walk_s"] += _now() - t
            s["wave_calls"] += 1

    cpu._wave = timed_wave

    send, wait = channel.InferenceClient._send, channel.InferenceClient._wait

    def timed_send(self, kind, rows, store):
        _LOCAL.sent = _now()
        seq = send(self, kind, rows, store)
        _LOCAL.seq = seq
        return seq

    def timed_wait(self, seq):
        ok = wait(self, seq)
        _LOCAL.done = _now()
        if getattr(_LOCAL, "in_wave", False):
            _SENDS.append((self.client_id, seq, _LOCAL.sent, _LOCAL.done))
        return ok

    channel.InferenceClient._send, channel.InferenceClient._wait = timed_send, timed_wait

    recurrent_fn = network.RemoteNetwork.recurrent_fn

    def timed_recurrent_fn(self, action, embedding):
        t0 = _now()
        _LOCAL.in_wave = True
        try:
            return recurrent_fn(self, action, embedding)
        finally:
            _LOCAL.in_wave = False
            t1 = _now()
            s = stats()
            s["pack_s"] += _LOCAL.sent - t0
            s["round_trip_s"] += _LOCAL.done - _LOCAL.sent
            s["unpack_s"] += t1 - _LOCAL.done
            s["waves"] += 1

    network.RemoteNetwork.recurrent_fn = timed_recurrent_fn

    for name, key in (("root", "root_s"), ("release", "release_s")):
        original = getattr(network.RemoteNetwork, name)

        def timed(self, *args, _original=original, _key=key):
            t = _now()
            try:
                return _original(self, *args)
            finally:
                stats()[_key] += _now() - t

        setattr(network.RemoteNetwork, name, timed)

    search_observations = selfplay.search_observations

    def timed_search(*args, **kwargs):
        t = _now()
        try:
            return search_observations(*args, **kwargs)
        finally:
            s = stats()
            s["search_s"] += _now() - t
            s["searches"] += 1

    selfplay.search_observations = timed_search

    advance = worker_class._advance  # Ray's actor class holds its own copies of the methods

    def timed_advance(self, *args):
        t = _now()
        try:
            return advance(self, *args)
        finally:
            stats()["advance_s"] += _now() - t

    worker_class._advance = timed_advance


class _Sink:
    """Replay stand-in: takes segments, keeps nothing."""

    def add(self, segment: Any, name: str) -> int:
        return segment.num_sampleable


def profile_row(ray: Any, roots: int, simulations: int, steps: int, overrides: list[str], fake_network_us: float = 0.0,
                py_spy: str | None = None) -> dict[str, Any]:
    from rayzero import config as config_lib
    from rayzero.envs import env_spec
    from rayzero.models import build_model

    cfg = config_lib.load("cartpole", [
        f"env.num_envs={2 * roots}", f"search.num_simulations={simulations}", "search.device=cpu",
        "model.latent_dim=8", "model.hidden=16", "model.support_size=5", "inference.device=cpu",
        "inference.mode=central", *overrides])
    spec = env_spec(cfg.env)
    server = ray.remote(ProfiledServer).options(num_cpus=0, max_concurrency=1000).remote(
        cfg.model, cfg.inference, spec.observation_shape, spec.num_actions, 0, cfg.cluster.torch_threads,
        obs_dtype=spec.observation_dtype, search_cfg=cfg.search, discount=cfg.replay.discount)
    model = build_model(cfg.model, spec.observation_shape, spec.num_actions)
    ray.get(server.set_weights.remote(0, {k: v.numpy() for k, v in model.state_dict().items()}))
    net_s = net_half_s = 0.0
    if fake_network_us > 0:
        net_s = net_half_s = fake_network_us / 1e6
        ray.get(server.prof_fake_network.remote(fake_network_us))
    sink = ray.remote(_Sink).options(num_cpus=0).remote()
    actor = ray.remote(ProfiledSelfPlay).options(num_cpus=0).remote(
        cfg.env, cfg.model, cfg.search, cfg.replay, 1, cfg.cluster.torch_threads, [sink], server, "selfplay-0", 0,
        whole_search=False)
    where = ray.get(server.__ray_call__.remote(lambda self: __import__("rayzero").__file__))
    try:
        ray.get(actor.collect.remote(2, 1.0, None))  # compiles, opens the channels
        ray.get([actor.prof_take.remote(), server.prof_take.remote()])
        load0 = os.getloadavg()[0]
        result = ray.get(actor.collect.remote(steps, 1.0, None))
        client, srv = ray.get([actor.prof_take.remote(), server.prof_take.remote()])
        if py_spy:  # a longer collect, both actors sampled by py-spy meanwhile (its figures are not the table's)
            import subprocess

            ref = actor.collect.remote(max(steps, int(4.0 / (result["seconds"] / steps))), 1.0, None)
            time.sleep(0.5)
            pids = ray.get([server.__ray_call__.remote(lambda self: os.getpid()),
                            actor.__ray_call__.remote(lambda self: os.getpid())])
            procs = [subprocess.Popen(["py-spy", "record", "-p", str(pid), "-d", "3", "-r", "1000", "-f", "raw",
                                       "-o", f"{py_spy}.{who}.{roots}.txt", "--threads", "--nonblocking"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for pid, who in zip(pids, ("server", "selfplay"))]
            for proc in procs:
                proc.wait()
            ray.get(ref)
        if not fake_network_us:
            net_s = ray.get(server.prof_net_seconds.remote(2 * roots))
            net_half_s = ray.get(server.prof_net_seconds.remote(roots))
    finally:
        ray.kill(actor)
        ray.kill(server)
        ray.kill(sink)
    row = summarize(roots, simulations, result, client, srv, net_s, net_half_s, load0)
    row["fake_network_us"] = fake_network_us
    row["server_rayzero"] = where
    return row


def summarize(roots, simulations, result, client, srv, net_s, net_half_s, load0) -> dict[str, Any]:
    threads = {name: s for name, s in client["threads"].items() if s.get("waves")}
    waves = sum(s["waves"] for s in threads.values())
    total = collections.Counter()
    for s in threads.values():
        total.update(s)
    # Per wave of one half (both halves' waves together): actor-side stages.
    walk = total["walk_s"] / waves
    pack, rtt, unpack = total["pack_s"] / waves, total["round_trip_s"] / waves, total["unpack_s"] / waves
    per_search_fixed = (total["root_s"] + total["release_s"]) / waves
    wave_wall = (total["search_s"] - total["root_s"] - total["release_s"]) / waves
    glue = wave_wall - walk - pack - rtt - unpack
    # Server-side split of the round trip (requests both sides saw).
    parts = collections.defaultdict(list)
    for c, seq, sent, done in client["sends"]:
        e = srv["events"].get(f"{c}|{seq}")
        if e is None or not all(e):
            continue
        seen, queued, launch0, launch1, answered = e
        parts["poll"].append(seen - sent)
        parts["to_loop"].append(queued - seen)
        parts["to_launch"].append(launch0 - queued)
        parts["launch"].append(launch1 - launch0)
        parts["finish"].append(answered - launch1)
        parts["notice"].append(done - answered)
    server = {k: float(np.mean(v)) for k, v in parts.items()}
    batches = srv["batches"]
    step_s = np.asarray(result["step_seconds"])
    row = {
        "roots_per_half": roots, "simulations": simulations, "steps": len(step_s),
        "env_steps_per_second": result["env_steps"] / result["seconds"],
        "step_ms_p50": float(1e3 * np.median(step_s)),
        "wave_ms": 1e3 * float(np.median(step_s)) / simulations,
        "per_wave_us": {"walk": 1e6 * walk, "pack": 1e6 * pack, "round_trip": 1e6 * rtt, "unpack": 1e6 * unpack,
                        "glue": 1e6 * glue, "wave_wall": 1e6 * wave_wall, "root+release": 1e6 * per_search_fixed},
        "round_trip_us": {k: 1e6 * v for k, v in server.items()},
        "matched_requests": len(parts["poll"]),
        "requests_per_batch": float(np.mean([b[0] for b in batches])) if batches else None,
        "rows_per_batch": float(np.mean([b[1] for b in batches])) if batches else None,
        "batch_launch_us": 1e6 * float(np.mean([b[2] for b in batches])) if batches else None,
        "batch_finish_us": 1e6 * float(np.mean([b[3] for b in batches])) if batches else None,
        "net_us_both_halves": 1e6 * net_s, "net_us_one_half": 1e6 * net_half_s,
        "advance_ms_per_step": 1e3 * total["advance_s"] / max(1, len(step_s)),
        "loadavg": load0,
    }
    return row


def print_row(row: dict[str, Any]) -> None:
    w, r = row["per_wave_us"], row["round_trip_us"]
    print(f"\nroots/half {row['roots_per_half']}, {row['simulations']} simulations: "
          f"{row['env_steps_per_second']:,.0f} env steps/s, step p50 {row['step_ms_p50']:.1f} ms "
          f"= {1e3 * row['wave_ms']:.0f} us per wave; load {row['loadavg']:.2f}; {row['server_rayzero']}")
    print("  actor side, per wave of one half (us): " + "  ".join(f"{k} {v:.0f}" for k, v in w.items()))
    print("  round trip split (us):                  " + "  ".join(f"{k} {v:.0f}" for k, v in r.items()))
    print(f"  batches: {row['requests_per_batch'] or 0:.2f} requests, {row['rows_per_batch'] or 0:.1f} rows; "
          f"launch {row['batch_launch_us'] or 0:.0f} us, finish {row['batch_finish_us'] or 0:.0f} us; bare network "
          f"{row['net_us_one_half']:.0f} us (one half's rows), {row['net_us_both_halves']:.0f} us (both); "
          f"env step + record {row['advance_ms_per_step']:.2f} ms per step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--roots", default="16,32", help="roots per half (the actor steps twice as many envs)")
    parser.add_argument("--simulations", type=int, default=50)
    parser.add_argument("--steps", type=int, default=8, help="timed env steps")
    parser.add_argument("--repeat", type=int, default=1, help="rows of each roots count")
    parser.add_argument("--json", default=None)
    parser.add_argument("--fake-network-us", type=float, default=0.0,
                        help="what-if: recurrent batches take this long off the CPU (a GPU's), answers zeros")
    parser.add_argument("--py-spy", default=None, help="path prefix: py-spy raw profiles of both actors")
    parser.add_argument("overrides", nargs="*", help="config overrides (section.field=value)")
    args = parser.parse_args()

    import ray

    from rayzero.bench.common import write_json

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for _ in range(args.repeat):
            for roots in (int(r) for r in args.roots.split(",")):
                row = profile_row(ray, roots, args.simulations, args.steps, args.overrides, args.fake_network_us,
                                  args.py_spy)
                print_row(row)
                rows.append(row)
    finally:
        ray.shutdown()
    write_json(args.json, "cpu_search_profile", {"config": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
