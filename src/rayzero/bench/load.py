"""Load on the inference actor (CPU): many concurrent clients, each running short searches (an initial request,
then recurrent steps on its handles), against one server with a bounded queue.

Reports, per transport: requests answered, requests refused by backpressure (`inference.max_queue`; clients
retry after 1 ms), the peak rows queued, throughput, and the p50 / p99 / max latency of a request (from its
first attempt to its answer, retries included). Transports: 'asyncio' (the server in-process, coroutines as
clients: the batcher alone) and 'ray' (the server as a Ray async actor, one driver thread per client). The test
suite checks the behaviour on a small size (tests/test_inference.py); this script gives the figures.

    rayzero bench load [--quick] [--json out.json]
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np

from rayzero.bench.common import write_json
from rayzero.config import InferenceConfig, ModelConfig
from rayzero.inference import InferenceOverloaded, InferenceServer

MODEL = ModelConfig(kind="mlp", latent_dim=16, hidden=32, support_size=10)
OBS, ACTIONS = (4,), 2
CLIENTS = 64
STEPS = 3  # recurrent steps per search: a search is 1 + STEPS requests


def _config(max_queue: int) -> InferenceConfig:
    return InferenceConfig(device="cpu", max_batch=256, min_bucket=8, max_wait_us=500, max_queue=max_queue,
                           channels=False)


def _summary(transport: str, latencies: list[float], refused: int, seconds: float, stats: dict) -> dict[str, Any]:
    ms = np.asarray(latencies) * 1e3
    row = {"transport": transport, "clients": CLIENTS, "requests": len(ms), "refused": refused,
           "peak_queued_rows": stats["peak_queued_rows"], "max_queue": stats["max_queue"],
           "errors": stats["errors"], "seconds": round(seconds, 2),
           "requests_per_s": round(len(ms) / seconds, 1),
           "p50_ms": round(float(np.percentile(ms, 50)), 3), "p99_ms": round(float(np.percentile(ms, 99)), 3),
           "max_ms": round(float(ms.max()), 3)}
    print(f"  {transport:7s} {row['requests']:7d} requests  {row['requests_per_s']:8.1f}/s  p50 {row['p50_ms']:7.3f} ms"
          f"  p99 {row['p99_ms']:8.3f} ms  max {row['max_ms']:8.3f} ms  refused {refused}  peak queue "
          f"{row['peak_queued_rows']}/{row['max_queue']}", flush=True)
    return row


def run_asyncio(searches: int, max_queue: int) -> dict[str, Any]:
    srv = InferenceServer(MODEL, _config(max_queue), OBS, ACTIONS)
    latencies: list[float] = []
    refused = [0]

    async def call(method, *args):
        start = time.perf_counter()
        while True:
            try:
                out = await method(*args)
                latencies.append(time.perf_counter() - start)
                return out
            except InferenceOverloaded:
                refused[0] += 1
                await asyncio.sleep(0.001)

    async def client(i: int) -> None:
        rng = np.random.default_rng(i)
        for _ in range(searches):
            rows = int(rng.integers(1, 9))
            out = await call(srv.initial, f"c{i}", rng.normal(size=(rows, *OBS)).astype(np.float32))
            for _ in range(STEPS):
                out = await call(srv.recurrent, f"c{i}", out["handles"], rng.integers(0, ACTIONS, size=rows))
            await srv.release(f"c{i}")

    async def go() -> float:
        start = time.perf_counter()
        await asyncio.gather(*[client(i) for i in range(CLIENTS)])
        return time.perf_counter() - start

    seconds = asyncio.run(go())
    return _summary("asyncio", latencies, refused[0], seconds, srv.stats())


def run_ray(searches: int, max_queue: int) -> dict[str, Any]:
    import ray

    from rayzero.cluster import connect
    from rayzero.config import ClusterConfig

    connect(ClusterConfig())
    actor = ray.remote(InferenceServer).options(max_concurrency=1000, num_cpus=0).remote(
        MODEL, _config(max_queue), OBS, ACTIONS)
    ray.get(actor.get_version.remote())
    latencies: list[list[float]] = [[] for _ in range(CLIENTS)]
    refused = [0] * CLIENTS

    def call(i: int, method, *args):
        start = time.perf_counter()
        while True:
            try:
                out = ray.get(method.remote(*args))
                latencies[i].append(time.perf_counter() - start)
                return out
            except InferenceOverloaded:
                refused[i] += 1
                time.sleep(0.001)

    def client(i: int) -> None:
        rng = np.random.default_rng(i)
        for _ in range(searches):
            rows = int(rng.integers(1, 9))
            out = call(i, actor.initial, f"c{i}", rng.normal(size=(rows, *OBS)).astype(np.float32))
            for _ in range(STEPS):
                out = call(i, actor.recurrent, f"c{i}", out["handles"], rng.integers(0, ACTIONS, size=rows))
            ray.get(actor.release.remote(f"c{i}"))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    stats = ray.get(actor.stats.remote())
    ray.kill(actor)
    return _summary("ray", [x for part in latencies for x in part], sum(refused), seconds, stats)


def main(quick: bool = False, json_path: str | None = None) -> dict[str, Any]:
    # 10,000 requests per client in the full run (the bar): 2,500 searches of 1 + 3 requests.
    searches = 25 if quick else 2500
    max_queue = 64  # rows: below what 64 clients of up to 8 rows can send at once, so backpressure acts
    print(f"inference load: {CLIENTS} clients x {searches * (1 + STEPS)} requests, max_queue={max_queue} rows",
          flush=True)
    rows = [run_asyncio(searches, max_queue), run_ray(searches, max_queue)]
    return write_json(json_path, "load", {"quick": quick, "clients": CLIENTS, "searches_per_client": searches,
                                          "requests_per_client": searches * (1 + STEPS), "rows": rows})


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    main(quick=args.quick, json_path=args.json)
