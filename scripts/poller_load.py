"""Many clients' whole searches in flight at once through their shared-memory channels, on the CPU: what the
inference actor's channel poller thread costs while they are. A real InferenceServer (Ray actor, a tiny MLP,
2 simulations) serves K client threads; each sends a search, sleeps as if its other envs stepped (`--env-ms`),
and collects the answer, for `--seconds`. Prints searches/s, the p50 wait beyond the sleep, the cores the
actor's process and its poller thread kept busy (/proc), and the poller's sweeps per second.

    python3 scripts/poller_load.py [--clients 8] [--seconds 10] [--env-ms 5]

To compare two versions of the code: PYTHONPATH=OTHER_CHECKOUT/src python3 scripts/poller_load.py.
"""
from __future__ import annotations

import argparse
import os
import threading
import time

import numpy as np
import ray

from rayzero.config import InferenceConfig, ModelConfig
from rayzero.inference import InferenceServer
from rayzero.inference.channel import InferenceClient
from rayzero.tree import SearchConfig

MODEL = ModelConfig(kind="mlp", latent_dim=8, hidden=16, support_size=5)
TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(path: str) -> float:
    """CPU seconds (user + system) of the process or thread whose /proc stat file is `path`."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--env-ms", type=float, default=5.0)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = InferenceConfig(device="cpu", max_batch=64, min_bucket=4, max_wait_us=300)
    server = ray.remote(InferenceServer).options(max_concurrency=100).remote(
        MODEL, cfg, (4,), 3, 0, search_cfg=SearchConfig(num_simulations=2, dirichlet_fraction=0.0), discount=0.99)
    pid = ray.get(server.__ray_call__.remote(lambda self: os.getpid()))
    clients = [InferenceClient(server, f"c{i}", max_rows=8, obs_rows=8) for i in range(args.clients)]
    obs = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    for client in clients:  # warm-up
        client.submit_search(obs, 1.0)
        client.wait_search()
    stop = time.monotonic() + args.seconds
    waits: list[list[float]] = [[] for _ in clients]

    def play(i: int) -> None:
        client = clients[i]
        while time.monotonic() < stop:
            client.submit_search(obs, 1.0)
            time.sleep(args.env_ms / 1e3)
            t0 = time.perf_counter()
            client.wait_search()
            waits[i].append(1e3 * (time.perf_counter() - t0))

    poller_tid = ray.get(server.__ray_call__.remote(lambda self: self._poller._thread.native_id))
    process, thread = f"/proc/{pid}/stat", f"/proc/{pid}/task/{poller_tid}/stat"
    before = ray.get(server.stats.remote())
    cpu0, poller0 = _cpu_s(process), _cpu_s(thread)
    t0 = time.monotonic()
    workers = [threading.Thread(target=play, args=(i,)) for i in range(len(clients))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.monotonic() - t0
    cpu1, poller = _cpu_s(process), _cpu_s(thread) - poller0
    after = ray.get(server.stats.remote())
    done = sum(len(w) for w in waits)
    sweeps = after.get("poller_sweeps", 0) - before.get("poller_sweeps", 0)
    print(f"{args.clients} clients, {args.env_ms:g} ms between send and collect: {done / wall:,.0f} searches/s, "
          f"wait beyond it p50 {np.percentile(np.concatenate(waits), 50):.3f} ms; inference actor "
          f"{(cpu1 - cpu0) / wall:.2f} cores, its poller {poller / wall:.2f}; "
          f"{sweeps / wall:,.0f} sweeps/s")
    ray.shutdown()


if __name__ == "__main__":
    main()
