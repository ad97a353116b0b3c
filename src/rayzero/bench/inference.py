"""Benchmark of the inference actor (rayzero.inference): eager vs CUDA-graph buckets, served through Ray.

Sections (each one's failure is recorded in `errors` and the others still run):
* precision: error vs fp32 of the bf16 trunk with fp32 heads and of all-bf16 (value, reward, policy);
* conv: the EfficientZero-sized ResNet (the atari preset's model: 64 channels, 1 block, 601-bin supports),
  12x96x96 uint8 input, 18 actions, bf16 + fp32 heads: per bucket, initial and recurrent, eager vs graph
  latency (back-to-back calls on the actor's compute stream, so eager is its launch-bound time) and
  evaluations/s (conv weights channels-last, the default); plus NCHW weights at three buckets;
* transformer: the same for the Transformer model (6 layers, 256 patch tokens + 8 latent tokens, width 256);
* search: whole 50-simulation searches per bucket, CapturedSearch replay vs eager `search`;
* served: the actor in Ray (ray.init on this host), N CPU-only client actors each sending recurrent
  requests of R rows (store=False) back to back, through shared-memory channels (16 x 1024, 16 x 2048) and as
  Ray calls (16 x 2048): evaluations/s in the steady state vs the in-process graph
  replay at the same bucket, p50/p99 request latency, GPU utilisation (NVML, or nvidia-smi sampling) and
  energy per evaluation (NVML energy counter, or integrated power samples); optional Chrome trace.
--quick: small nets on the CPU (eager only), 4 clients for a few seconds; < 60 s on 2 cores.

Run: `python -m rayzero.bench.inference [--quick] [--json PATH] [--trace FILE]` (or `rayzero bench inference`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import traceback
from typing import Any

import numpy as np

from rayzero.bench.common import write_json
from rayzero.gpu_monitor import GpuMonitor

ATARI_OBS = (12, 96, 96)
ATARI_ACTIONS = 18


# ------------------------------------------------------------------------------------------ helpers


def _atari_model_cfg():
    from rayzero.config import load

    return load("atari").model


def _transformer_cfg(quick: bool):
    from rayzero.config import ModelConfig

    if quick:
        return ModelConfig(kind="transformer", support_size=20, transformer_dim=32, transformer_heads=4,
                           transformer_layers=2, transformer_latent_tokens=4)
    return ModelConfig(kind="transformer", support_size=300)


def _randomize(model, seed: int = 0) -> None:
    """Random weights in the zero-initialised last layers of the heads (realistic outputs, no exact ties)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if not param.abs().sum():
                param.copy_((torch.randn(param.shape, generator=g) * 0.05).to(param.device))


def _timed(fn, budget_s: float = 0.15, max_iters: int = 200) -> tuple[float, int]:
    """(seconds per call, calls) of fn(iters) -> seconds per call, sized to take about budget_s."""
    probe = fn(2)
    iters = int(min(max_iters, max(3, budget_s / max(probe, 1e-6))))
    return fn(iters), iters


def _profile_rows(srv, kinds: list[str], buckets: list[int], budget_s: float) -> list[dict[str, Any]]:
    rows = []
    for kind in kinds:
        for bucket in buckets:
            row: dict[str, Any] = {"kind": kind, "bucket": bucket}
            for mode in ("eager", "graph"):
                seconds, iters = _timed(
                    lambda n, k=kind, b=bucket, m=mode: asyncio.run(srv.profile(k, b, n, graph=m == "graph")),
                    budget_s)
                row[f"{mode}_ms"] = round(seconds * 1e3, 4)
                row[f"{mode}_evals_per_s"] = round(bucket / seconds, 1)
                row[f"{mode}_iters"] = iters
            row["speedup"] = round(row["eager_ms"] / row["graph_ms"], 2)
            rows.append(row)
            print(f"  {kind:9s} b={bucket:5d}  eager {row['eager_ms']:8.3f} ms  graph {row['graph_ms']:8.3f} ms  "
                  f"x{row['speedup']:5.2f}  {row['graph_evals_per_s'] / 1e6:7.3f} M evals/s", flush=True)
    return rows


def _cpu_rows(model, obs_shape, num_actions, kinds, buckets, obs_dtype) -> list[dict[str, Any]]:
    """--quick on the CPU: eager calls of the model (no graphs exist there)."""
    import torch

    rows = []
    with torch.no_grad():
        for kind in kinds:
            for bucket in buckets:
                if obs_dtype == np.uint8:
                    obs = torch.randint(0, 256, (bucket, *obs_shape), dtype=torch.uint8)
                else:
                    obs = torch.randn(bucket, *obs_shape)
                latent = model.initial(obs).latent
                actions = torch.randint(0, num_actions, (bucket,))

                def run(n, kind=kind, obs=obs, latent=latent, actions=actions):
                    start = time.perf_counter()
                    for _ in range(n):
                        model.initial(obs) if kind == "initial" else model.recurrent(latent, actions)
                    return (time.perf_counter() - start) / n

                seconds, iters = _timed(run, 0.1, 50)
                rows.append({"kind": kind, "bucket": bucket, "eager_ms": round(seconds * 1e3, 4),
                             "eager_evals_per_s": round(bucket / seconds, 1), "eager_iters": iters})
                print(f"  {kind:9s} b={bucket:5d}  eager {seconds * 1e3:8.3f} ms (CPU)", flush=True)
    return rows


def _energy_per_eval(monitor: GpuMonitor, srv, kind: str, bucket: int, seconds: float = 2.0) -> dict[str, Any]:
    """Joules per evaluation of back-to-back graph replays at one bucket (NVML energy counter)."""
    per_call = asyncio.run(srv.profile(kind, bucket, 5, graph=True))
    iters = max(5, int(seconds / per_call))
    e0, t0 = monitor.energy_j(), time.monotonic()
    per_call = asyncio.run(srv.profile(kind, bucket, iters, graph=True))
    e1, t1 = monitor.energy_j(), time.monotonic()
    out = {"kind": kind, "bucket": bucket, "evals": iters * bucket, "seconds": round(t1 - t0, 3),
           "evals_per_s": round(bucket / per_call, 1)}
    if e0 is not None and e1 is not None:
        out["joules"] = round(e1 - e0, 3)
        out["uj_per_eval"] = round((e1 - e0) / (iters * bucket) * 1e6, 4)
    return out


# ------------------------------------------------------------------------------------------ served


class _Client:
    """A CPU-only client actor: one initial request, then recurrent requests back to back (store=False), as
    Ray calls (transport 'ray') or through a shared-memory channel (transport 'channel', inference/channel.py)."""

    def __init__(self, server, name: str, obs_box: list, rows: int, num_actions: int, seed: int,
                 transport: str = "ray"):
        from rayzero.inference.channel import InferenceClient

        self.server, self.name, self.obs_box, self.rows = server, name, obs_box, rows
        rng = np.random.default_rng(seed)
        self.actions = [rng.integers(0, num_actions, size=rows).astype(np.int64) for _ in range(8)]
        self.handles = None
        self.client = InferenceClient(server, name, rows, 0, channel=transport == "channel")

    def setup(self) -> str:
        import ray

        out = ray.get(self.server.initial.remote(self.name, self.obs_box[0]))
        self.handles = out["handles"]
        return self.client.transport

    def run(self, until: float) -> list[tuple[float, float, int]]:
        """(sent, received, rows) of each request until time.monotonic() >= until."""
        log, i = [], 0
        while time.monotonic() < until:
            sent = time.monotonic()
            self.client.recurrent(self.handles, self.actions[i % 8], False)
            log.append((sent, time.monotonic(), self.rows))
            i += 1
        return log

    def close(self) -> None:
        self.client.close()


def _phase(ray, server, monitor: GpuMonitor | None, trace_path: str | None, name: str, clients: int, rows: int,
           obs: np.ndarray, num_actions: int, duration_s: float, warmup_s: float,
           transport: str = "ray") -> dict[str, Any]:
    """One served measurement: `clients` actors x `rows` rows per request, steady-state window figures."""
    obs_box = [ray.put(obs[:rows])]
    actors = [ray.remote(num_cpus=0)(_Client).remote(server, f"{name}-{i}", obs_box, rows, num_actions, i, transport)
              for i in range(clients)]
    transports = ray.get([a.setup.remote() for a in actors])
    start = time.monotonic() + 0.5
    until = start + warmup_s + duration_s
    lo, hi = start + warmup_s, until
    before = ray.get(server.stats.remote())["buckets"]
    if monitor is not None:
        monitor.start(0.1)
    refs = [a.run.remote(until) for a in actors]
    time.sleep(max(0.0, lo - time.monotonic()))
    e0 = monitor.energy_j() if monitor is not None else None
    if trace_path:  # the last second of the window only (tracing costs a little)
        time.sleep(max(0.0, until - 1.0 - time.monotonic()))
        ray.get(server.start_trace.remote())
    logs = ray.get(refs)
    e1 = monitor.energy_j() if monitor is not None else None
    trace = ray.get(server.stop_trace.remote()) if trace_path else None
    after = ray.get(server.stats.remote())["buckets"]
    samples = monitor.stop() if monitor is not None else []
    ray.get([server.release.remote(f"{name}-{i}") for i in range(clients)])
    ray.get([a.close.remote() for a in actors])
    for actor in actors:
        ray.kill(actor)
    in_window = [(s, r, n) for log in logs for (s, r, n) in log if lo <= r <= hi]
    evals = sum(n for _, _, n in in_window)
    latencies = np.array([r - s for s, r, _ in in_window]) * 1e3
    buckets = {}
    for key, m in after.items():
        old = before.get(key, {})
        delta = {f: m[f] - old.get(f, 0) for f in ("count", "requests", "rows", "padded", "wait_s", "gpu_s", "host_s")}
        if delta["count"]:
            delta["mean_gpu_ms"] = round(1e3 * delta["gpu_s"] / delta["count"], 4)
            delta["mean_host_ms"] = round(1e3 * delta["host_s"] / delta["count"], 4)
            delta["mean_wait_ms"] = round(1e3 * delta["wait_s"] / max(1, delta["requests"]), 4)
            buckets[key] = {f: (round(v, 4) if isinstance(v, float) else v) for f, v in delta.items()}
    out: dict[str, Any] = {
        "clients": clients, "rows_per_request": rows, "transport": sorted(set(transports)),
        "window_s": round(hi - lo, 2), "requests": len(in_window),
        "evals": evals, "evals_per_s": round(evals / (hi - lo), 1),
        "latency_ms_p50": round(float(np.percentile(latencies, 50)), 3) if len(latencies) else None,
        "latency_ms_p99": round(float(np.percentile(latencies, 99)), 3) if len(latencies) else None,
        "server_buckets": buckets,
    }
    if monitor is not None:
        out["gpu"] = {"backend": monitor.backend, **GpuMonitor.summarize(samples, lo, hi)}
        if e0 is not None and e1 is not None and evals:
            out["gpu"]["energy_j"] = round(e1 - e0, 3)
            out["gpu"]["uj_per_eval"] = round((e1 - e0) / evals * 1e6, 4)
    if trace is not None:
        import json

        with open(trace_path, "w") as f:
            json.dump(trace, f)
        out["trace"] = {"path": trace_path, "events": len(trace["traceEvents"]), "window": "last 1 s"}
    gpu = out.get("gpu", {})
    print(f"  served {clients} clients x {rows} rows ({'/'.join(out['transport'])}): "
          f"{out['evals_per_s'] / 1e6:.3f} M evals/s, "
          f"p50 {out['latency_ms_p50']} ms, p99 {out['latency_ms_p99']} ms, GPU util {gpu.get('util_mean')} % "
          f"(p10 {gpu.get('util_p10')}), {gpu.get('uj_per_eval')} uJ/eval", flush=True)
    return out


def _served(quick: bool, monitor: GpuMonitor | None, trace_path: str | None, clients: int,
            phases: list[tuple[int, float, float, str]]) -> dict[str, Any]:
    """The actor in Ray with `clients` client actors; phases of (rows per request, window s, warm-up s,
    transport)."""
    import ray

    from rayzero.config import InferenceConfig, ModelConfig
    from rayzero.inference import InferenceServer

    max_rows = max(rows for rows, _, _, _ in phases)
    if quick:
        model_cfg = ModelConfig(kind="resnet", channels=16, reduced_channels=4, head_hidden=16, support_size=20)
        obs_shape, num_actions = (12, 32, 32), 6
        cfg = InferenceConfig(device="cpu", max_batch=max_rows * clients, min_bucket=max_rows, max_wait_us=2000,
                              search_max_batch=0)
    else:
        model_cfg, obs_shape, num_actions = _atari_model_cfg(), ATARI_OBS, ATARI_ACTIONS
        cfg = InferenceConfig(device="cuda", max_batch=4096, min_bucket=512, max_wait_us=2000, search_max_batch=0,
                              latent_pool_size=65536)
    started = time.monotonic()
    ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)
    try:
        server = ray.remote(InferenceServer).options(
            num_gpus=0 if quick else 1, num_cpus=1, max_concurrency=1000).remote(model_cfg, cfg, obs_shape,
                                                                               num_actions, 0)
        ray.get(server.get_version.remote())
        out: dict[str, Any] = {"server_start_s": round(time.monotonic() - started, 2), "config": {
            "max_batch": cfg.max_batch, "min_bucket": cfg.min_bucket, "max_wait_us": cfg.max_wait_us,
            "bf16": cfg.bf16, "channels_last": cfg.channels_last, "switch_interval_us": cfg.switch_interval_us},
            "phases": []}
        obs = np.random.default_rng(0).integers(0, 256, size=(max_rows, *obs_shape), dtype=np.uint8)
        for i, (rows, duration_s, warmup_s, transport) in enumerate(phases):
            out["phases"].append(_phase(ray, server, monitor, trace_path if i == 0 else None, f"p{i}", clients,
                                        rows, obs, num_actions, duration_s, warmup_s, transport))
        out["server_errors"] = ray.get(server.stats.remote())["errors"]
    finally:
        ray.shutdown()
    return out


# ------------------------------------------------------------------------------------------ main


def main(quick: bool = False, json_path: str | None = None, trace_path: str | None = None) -> dict[str, Any]:
    import torch

    from rayzero.config import InferenceConfig, ModelConfig
    from rayzero.inference import InferenceServer

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    cuda = torch.cuda.is_available() and not quick
    results: dict[str, Any] = {"quick": quick, "device": "cuda" if cuda else "cpu", "errors": []}
    monitor = GpuMonitor() if cuda else None
    if monitor is not None:
        results["gpu_monitor"] = monitor.backend

    def section(name: str, fn) -> None:
        start = time.perf_counter()
        print(f"[{name}]", flush=True)
        try:
            results[name] = fn()
        except Exception as error:  # noqa: BLE001 - record and go on with the other sections
            traceback.print_exc()
            results["errors"].append(f"{name}: {type(error).__name__}: {error}")
        print(f"[{name}] {time.perf_counter() - start:.1f} s", flush=True)

    def precision():
        from rayzero.models import build_model

        torch.manual_seed(0)
        device = "cuda" if cuda else "cpu"
        if quick:
            cfg, shape, actions = ModelConfig(kind="resnet", channels=16, reduced_channels=4, head_hidden=16,
                                              support_size=20), (12, 32, 32), 6
        else:
            cfg, shape, actions = _atari_model_cfg(), ATARI_OBS, ATARI_ACTIONS
        out = {}
        for kind, model_cfg in (("conv", cfg), ("transformer", _transformer_cfg(quick))):
            model = build_model(model_cfg, shape, actions).to(device).eval()
            _randomize(model)
            n = 256 if cuda else 32
            obs = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, device=device)
            acts = torch.randint(0, actions, (n,), device=device)
            out[kind] = _precision_errors(model, obs, acts)
            print(f"  {kind}: {out[kind]}", flush=True)
        return out

    conv_server: list = []

    def conv():
        cfg = _atari_model_cfg()
        if not cuda:
            from rayzero.models import build_model

            small = ModelConfig(kind="resnet", channels=16, reduced_channels=4, head_hidden=16, support_size=20)
            model = build_model(small, (12, 32, 32), 6).eval()
            return {"model": "resnet 16ch 12x32x32 (quick)",
                    "rows": _cpu_rows(model, (12, 32, 32), 6, ["initial", "recurrent"], [1, 8, 64], np.uint8)}
        start = time.perf_counter()
        # Whole-search graphs are captured on first use by the search section (its buckets only).
        srv = InferenceServer(cfg, InferenceConfig(device="cuda", max_batch=4096, min_bucket=1, search_max_batch=0),
                              ATARI_OBS, ATARI_ACTIONS)
        _randomize(srv.model)
        conv_server.append(srv)
        startup = time.perf_counter() - start
        params = sum(p.numel() for p in srv.model.parameters())
        rows = _profile_rows(srv, ["recurrent", "initial"], srv.ladder, 0.12)
        return {"model": f"resnet channels={cfg.channels} blocks={cfg.blocks} support={cfg.support_size}, "
                         f"{params / 1e6:.2f} M params, input 12x96x96 uint8, 18 actions, bf16 + fp32 heads",
                "startup_s": round(startup, 2), "capture_s": round(srv.runner.capture_s, 2), "rows": rows}

    def conv_nchw():
        srv = InferenceServer(_atari_model_cfg(), InferenceConfig(device="cuda", max_batch=4096, min_bucket=64,
                                                                  search_max_batch=0, channels_last=False),
                              ATARI_OBS, ATARI_ACTIONS)
        _randomize(srv.model)
        rows = _profile_rows(srv, ["recurrent", "initial"], [64, 1024, 4096], 0.12)
        del srv
        torch.cuda.empty_cache()
        return {"model": "the conv net with NCHW conv weights (channels_last=False)", "rows": rows}

    def transformer():
        tcfg = _transformer_cfg(quick)
        if not cuda:
            from rayzero.models import build_model

            model = build_model(tcfg, (3, 16, 16), 6).eval()
            return {"model": "transformer 2 layers width 32, 256 patch tokens (quick)",
                    "rows": _cpu_rows(model, (3, 16, 16), 6, ["initial", "recurrent"], [1, 8], np.uint8)}
        start = time.perf_counter()
        srv = InferenceServer(tcfg, InferenceConfig(device="cuda", max_batch=1024, min_bucket=1, search_max_batch=0),
                              ATARI_OBS, ATARI_ACTIONS)
        _randomize(srv.model)
        startup = time.perf_counter() - start
        params = sum(p.numel() for p in srv.model.parameters())
        rows = _profile_rows(srv, ["recurrent", "initial"], [1, 8, 64, 256, 1024], 0.12)
        out = {"model": f"transformer {tcfg.transformer_layers} layers width {tcfg.transformer_dim} heads "
                        f"{tcfg.transformer_heads}, {srv.model.tokens} patch tokens + {tcfg.transformer_latent_tokens} "
                        f"latent tokens, {params / 1e6:.2f} M params, SDPA, bf16 + fp32 heads",
               "startup_s": round(startup, 2), "capture_s": round(srv.runner.capture_s, 2), "rows": rows}
        del srv
        torch.cuda.empty_cache()
        return out

    def whole_search():
        from rayzero.tree import SearchConfig

        if not cuda:
            srv = InferenceServer(ModelConfig(kind="mlp", latent_dim=16, hidden=32, support_size=10),
                                  InferenceConfig(device="cpu", max_batch=64, min_bucket=8), (4,), 2,
                                  search_cfg=SearchConfig(num_simulations=10))
            obs = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
            start = time.perf_counter()
            out = asyncio.run(srv.search("bench", obs))
            seconds = time.perf_counter() - start
            return {"rows": [{"bucket": 16, "num_simulations": 10, "eager_ms": round(seconds * 1e3, 2),
                              "visits": int(out["visit_counts"].sum())}]}
        srv = conv_server[0]
        rows = []
        for bucket in (16, 256, 1024):
            row: dict[str, Any] = {"bucket": bucket, "num_simulations": srv.search_cfg.num_simulations}
            for mode in ("eager", "graph"):
                seconds = asyncio.run(srv.profile("search", bucket, 3, graph=mode == "graph"))
                row[f"{mode}_ms"] = round(seconds * 1e3, 3)
            row["speedup"] = round(row["eager_ms"] / row["graph_ms"], 2)
            row["graph_searches_per_s"] = round(bucket / row["graph_ms"] * 1e3, 1)
            print(f"  search b={bucket:5d}: eager {row['eager_ms']:.2f} ms, graph {row['graph_ms']:.2f} ms "
                  f"(x{row['speedup']})", flush=True)
            rows.append(row)
        return {"rows": rows, "config": str(srv.search_cfg)}

    def energy():
        return _energy_per_eval(monitor, conv_server[0], "recurrent", 4096)

    def served():
        if conv_server:  # free the in-process server's GPU memory before the actor starts
            import gc

            conv_server.clear()
            gc.collect()
            torch.cuda.empty_cache()
        if quick:
            return _served(True, None, trace_path, clients=4,
                           phases=[(64, 2.0, 1.0, "channel"), (128, 2.0, 1.0, "channel"), (128, 2.0, 1.0, "ray")])
        return _served(False, monitor, trace_path, clients=16,
                       phases=[(1024, 8.0, 2.0, "channel"), (2048, 8.0, 2.0, "channel"), (2048, 6.0, 2.0, "ray")])

    section("precision", precision)
    section("conv", conv)
    if cuda:
        section("conv_nchw", conv_nchw)
    section("transformer", transformer)
    section("search", whole_search)
    if cuda and monitor is not None and monitor.energy_j() is not None:
        section("energy", energy)
    section("served", served)
    results["bars"] = _bars(results)
    print("bars:", results["bars"], flush=True)
    return write_json(json_path, "inference", results)


def _precision_errors(model, obs, actions) -> dict[str, dict[str, float]]:
    """Errors vs fp32 under bf16 autocast: mean abs of values (initial + 1 step) and reward, also relative to
    the mean |value| / |reward| of the fp32 reference, and max abs of the policy probabilities."""
    import torch

    with torch.no_grad():
        model.heads_fp32 = False
        ref0 = model.initial(obs)
        ref1 = model.recurrent(ref0.latent, actions)
        errors = {}
        for name, heads_fp32 in (("fp32_heads", True), ("all_bf16", False)):
            model.heads_fp32 = heads_fp32
            with torch.autocast(obs.device.type, dtype=torch.bfloat16, cache_enabled=False):
                out0 = model.initial(obs)
                out1 = model.recurrent(out0.latent, actions)
            value = torch.cat([out0.value - ref0.value, out1.value - ref1.value]).abs().mean()
            reward = (out1.reward - ref1.reward).abs().mean()
            value_scale = torch.cat([ref0.value, ref1.value]).abs().mean().clamp_min(1e-6)
            policy = out1.policy_logits.float().softmax(-1) - ref1.policy_logits.softmax(-1)
            errors[name] = {"value_mae": round(float(value), 6), "reward_mae": round(float(reward), 6),
                            "value_rel": round(float(value / value_scale), 6),
                            "reward_rel": round(float(reward / ref1.reward.abs().mean().clamp_min(1e-6)), 6),
                            "policy_max_abs": round(float(policy.abs().max()), 6)}
        model.heads_fp32 = False
    return errors


def _bars(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's bars, from this run's figures (absent sections give None)."""
    bars: dict[str, Any] = {}
    rows = results.get("conv", {}).get("rows", [])
    rec = {r["bucket"]: r for r in rows if r["kind"] == "recurrent" and "graph_ms" in r}
    small = [r["speedup"] for b, r in rec.items() if b <= 64]
    if small:
        bars["graph_speedup_recurrent_le64"] = {"min": min(small), "bar": 4.0, "holds": min(small) >= 4.0}
    if 4096 in rec:
        value = rec[4096]["graph_evals_per_s"]
        bars["recurrent_evals_per_s_4096"] = {"value": value, "bar": 2.5e6, "holds": value >= 2.5e6}
    for phase in results.get("served", {}).get("phases", []):
        if 4096 not in rec or not phase.get("evals_per_s"):
            continue
        ratio = phase["evals_per_s"] / rec[4096]["graph_evals_per_s"]
        util = phase.get("gpu", {}).get("util_mean")
        bars[f"served_{phase['clients']}x{phase['rows_per_request']}_{'_'.join(phase.get('transport', ['ray']))}"] = {
            "ratio_vs_replay_4096": round(ratio, 3), "ratio_bar": 0.7, "gpu_util_mean": util, "util_bar": 90,
            "holds": ratio >= 0.7 and util is not None and util >= 90}
    return bars


def _cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--trace", default=None, help="write a Chrome trace of the served run's batcher here")
    args = parser.parse_args()
    main(quick=args.quick, json_path=args.json, trace_path=args.trace)


if __name__ == "__main__":
    _cli()
