"""Whole-search latency through the inference actor at the small batches that wait on it: one env alone, the
greedy evaluation's 10 games, a self-play half of 32 envs. Each variant (inference overrides, e.g.
`compile_recurrent=true`) builds its own inference actor with the preset's network and search, alone on the
device, and times `search` requests one after another (p50 and p99 of the round trip, and the device's share).
With `--kernels N` (CUDA) it also traces N searches of each variant at each bucket of `--kernel-rows`
(torch.profiler): the kernels a search runs, their summed time against the search's wall time on the device (the
rest is gaps between kernels), and the kernels that take the most. It prints tables and writes JSON with machine,
versions and date.

    python3 scripts/search_latency.py [--preset atari] [--rows 1,10,32] [--requests 200] [--json PATH] \
        [--variants "plain;compile_recurrent=true;simulations=16;virtual_loss=4"] [--kernels 20 --kernel-rows 1,256]
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time

import numpy as np
import torch

from rayzero import config as config_lib
from rayzero.bench.common import write_json
from rayzero.config import InferenceConfig
from rayzero.envs import env_spec
from rayzero.inference import InferenceServer


def variant_config(base: InferenceConfig, spec: str) -> tuple[InferenceConfig, int, int]:
    """`plain`, or `field=value[,field=value]` over the preset's inference section; `simulations=N` sets the
    searches' simulations (0 in the result: the preset's), as run.eval_simulations does for an evaluation;
    `virtual_loss=K` the search's paths per wave (0: the preset's)."""
    if spec == "plain":
        return base, 0, 0
    fields = {f.name: f for f in dataclasses.fields(InferenceConfig)}
    changes, simulations, virtual_loss = {}, 0, 0
    for item in spec.split(","):
        name, _, value = item.partition("=")
        if name == "simulations":
            simulations = int(value)
            continue
        if name == "virtual_loss":
            virtual_loss = int(value)
            continue
        if name not in fields:
            raise SystemExit(f"variant {spec!r}: inference has no field {name!r}; valid: {', '.join(fields)}")
        kind = type(getattr(base, name))
        changes[name] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
    return dataclasses.replace(base, **changes), simulations, virtual_loss


def kernel_table(runner, searches: int, rows: int = 1, top: int = 15) -> dict:
    """Trace `searches` whole searches of `rows` roots (initial step and captured search at that bucket, back to
    back on the runner's stream): kernels per search, their summed device time, the wall time, and the `top`
    kernels by time."""
    from torch.profiler import ProfilerActivity, profile

    bucket = runner.search_bucket(rows)
    runner.profile("search", bucket, 3, graph=True)  # captured and warm before the trace
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall_s = runner.profile("search", bucket, searches, graph=True)
    calls = searches + 2  # Runner.profile runs two untimed steps first
    kernels = []
    for event in prof.key_averages():
        if "cuda" not in str(getattr(event, "device_type", "")).lower():
            continue
        total = getattr(event, "self_device_time_total", None)
        if total is None:
            total = event.self_cuda_time_total
        if total <= 0:
            continue
        kernels.append({"name": event.key, "per_search": event.count / calls, "us_per_search": total / calls})
    kernels.sort(key=lambda k: -k["us_per_search"])
    return {"searches": searches, "bucket": bucket, "wall_ms": 1e3 * wall_s,
            "kernels_per_search": sum(k["per_search"] for k in kernels),
            "kernel_ms": sum(k["us_per_search"] for k in kernels) / 1e3, "top": kernels[:top]}


def time_variant(config: config_lib.Config, inference: InferenceConfig, rows: list[int], requests: int,
                 simulations: int = 0, virtual_loss: int = 0, kernels: int = 0,
                 kernel_rows: tuple[int, ...] = (1,)) -> dict:
    spec = env_spec(config.env)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    search_cfg = dataclasses.replace(config.search, dirichlet_fraction=0.0, temperature=0.0,  # greedy: evaluation
                                     num_simulations=simulations or config.search.num_simulations,
                                     virtual_loss=virtual_loss or config.search.virtual_loss)
    started = time.perf_counter()
    srv = InferenceServer(config.model, dataclasses.replace(inference, device=device, max_batch=max(64, 2 * max(rows))),
                          spec.observation_shape, spec.num_actions, seed=0, search_cfg=search_cfg,
                          discount=config.replay.discount)
    ready = time.perf_counter() - started
    rng = np.random.default_rng(0)
    out = {"ready_s": ready, "rows": {}}
    for n in rows:
        obs = rng.integers(0, 256, size=(n, *spec.observation_shape), dtype=np.uint8)
        times, device_ms = [], []
        for i in range(requests + 5):
            start = time.perf_counter()
            answer = asyncio.run(srv.search("bench", obs))
            if i >= 5:  # the first requests warm up
                times.append(1e3 * (time.perf_counter() - start))
                device_ms.append(float(answer.get("device_ms", 0.0)))
        out["rows"][n] = {"p50_ms": float(np.percentile(times, 50)), "p99_ms": float(np.percentile(times, 99)),
                          "device_ms": float(np.median(device_ms)), "requests": requests}
    if kernels and device == "cuda":
        out["kernels"] = [srv.gpu.submit(kernel_table, srv.runner, kernels, n).result() for n in kernel_rows]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="atari")
    parser.add_argument("--rows", default="1,10,32")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--variants", default="plain;compile_recurrent=true")
    parser.add_argument("--kernels", type=int, default=0, help="trace this many searches per bucket (CUDA)")
    parser.add_argument("--kernel-rows", default="1", help="the searches' roots (their buckets) to trace")
    parser.add_argument("--json")
    args = parser.parse_args()
    config = config_lib.load(args.preset)
    rows = [int(r) for r in args.rows.split(",")]
    results = {}
    for spec in args.variants.split(";"):
        inference, simulations, virtual_loss = variant_config(config.inference, spec)
        results[spec] = time_variant(config, inference, rows, args.requests, simulations, virtual_loss,
                                     args.kernels, tuple(int(r) for r in args.kernel_rows.split(",")))
        print(f"{spec}: ready in {results[spec]['ready_s']:.1f} s; " + "; ".join(
            f"{n} rows p50 {row['p50_ms']:.2f} ms (device {row['device_ms']:.2f})"
            for n, row in results[spec]["rows"].items()), flush=True)
        if args.json:  # the variants so far, in case a later one does not finish (a device call's limit)
            write_json(args.json, "search_latency", {"preset": args.preset, "variants": results, "partial": True})
    print(f"{'variant':32s} {'rows':>5s} {'p50 ms':>8s} {'p99 ms':>8s} {'device ms':>10s}")
    for spec, result in results.items():
        for n, row in result["rows"].items():
            print(f"{spec:32s} {n:5d} {row['p50_ms']:8.2f} {row['p99_ms']:8.2f} {row['device_ms']:10.2f}")
    for spec, result in results.items():
        for k in result.get("kernels", []):
            print(f"\n{spec}: search of bucket {k['bucket']}: {k['wall_ms']:.2f} ms on the device, "
                  f"{k['kernels_per_search']:.0f} kernels summing {k['kernel_ms']:.2f} ms")
            for row in k["top"]:
                print(f"  {row['us_per_search']:8.1f} us  {row['per_search']:6.1f} x  {row['name'][:90]}")
    write_json(args.json, "search_latency", {"preset": args.preset, "variants": results})


if __name__ == "__main__":
    main()
