"""One client's whole searches through its shared-memory channel, one after another, on the CPU: where the round
trip goes. A real InferenceServer (Ray actor, a tiny MLP, 2 simulations, so the search itself is short) answers
N searches after 50 warm-up ones; it prints the p50 round trip, the actor's `server_ms` (submitted to answered),
its queued and device parts, and three differences: the way there and back (round trip less server), the
actor's time beyond queued + device, and all but the device's
(round trip less device). One env's decision pays these on every step (issue 11's latency bar).

    python3 scripts/channel_roundtrip.py [N]

To compare two versions of the code: PYTHONPATH=OTHER_CHECKOUT/src python3 scripts/channel_roundtrip.py 1000.
"""
from __future__ import annotations

import sys
import time

import numpy as np
import ray

from rayzero.config import InferenceConfig, ModelConfig
from rayzero.inference import InferenceServer
from rayzero.inference.channel import InferenceClient
from rayzero.tree import SearchConfig

MODEL = ModelConfig(kind="mlp", latent_dim=8, hidden=16, support_size=5)
WARMUP = 50


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = InferenceConfig(device="cpu", max_batch=64, min_bucket=4, max_wait_us=300)
    server = ray.remote(InferenceServer).options(max_concurrency=100).remote(
        MODEL, cfg, (4,), 3, 0, search_cfg=SearchConfig(num_simulations=2, dirichlet_fraction=0.0), discount=0.99)
    client = InferenceClient(server, "one", max_rows=1, obs_rows=1)
    obs = np.random.default_rng(0).normal(size=(1, 4)).astype(np.float32)
    rows = []
    for i in range(n + WARMUP):
        t0 = time.perf_counter()
        client.submit_search(obs, 1.0)
        answer = client.wait_search()
        if i >= WARMUP:
            rows.append((1e3 * (time.perf_counter() - t0), answer["server_ms"], answer["queue_ms"], answer["device_ms"]))
    r = np.array(rows)
    p50 = np.percentile(r, 50, axis=0)
    print(f"transport {client.transport}: round trip {p50[0]:.3f}  server {p50[1]:.3f}  queued {p50[2]:.3f}  "
          f"device {p50[3]:.3f} ms (p50 of {len(r)}); there and back {np.percentile(r[:, 0] - r[:, 1], 50):.3f}, "
          f"server beyond queued+device {np.percentile(r[:, 1] - r[:, 2] - r[:, 3], 50):.3f}, "
          f"round trip less device {np.percentile(r[:, 0] - r[:, 3], 50):.3f} "
          f"(p90 {np.percentile(r[:, 0] - r[:, 3], 90):.3f}); lone searches {ray.get(server.stats.remote())['lone_searches']}")
    ray.shutdown()


if __name__ == "__main__":
    main()
