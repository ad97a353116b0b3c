"""The poller idle measurement of docs/benchmarks.md ("The poller backs off when idle").

    python docs/results/poller_idle_2026-12-01.py
"""
import os
import time

import numpy as np
import ray

from rayzero.config import InferenceConfig, ModelConfig
from rayzero.inference import InferenceServer
from rayzero.inference.channel import InferenceClient

ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
MODEL = ModelConfig(kind="mlp", latent_dim=8, hidden=16, support_size=5)
srv = ray.remote(InferenceServer).options(max_concurrency=100).remote(MODEL, InferenceConfig(device="cpu"), (4,), 3, 0)
pid = ray.get(srv.__ray_call__.remote(lambda self: os.getpid()))
client = InferenceClient(srv, "c", max_rows=16, obs_rows=8)
obs = np.zeros((4, 4), np.float32)
client.initial(obs)


def cpu() -> float:
    fields = open(f"/proc/{pid}/stat").read().split(")")[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


time.sleep(1)
a = cpu()
time.sleep(4)
b = cpu()
latencies = []
for _ in range(20):
    time.sleep(0.05)  # idle 50 ms, then one request
    t = time.perf_counter()
    client.initial(obs)
    latencies.append(time.perf_counter() - t)
print(f"idle actor CPU {100 * (b - a) / 4:.0f} % of a core; first request after 50 ms idle p50 "
      f"{1e3 * np.median(latencies):.2f} ms")
