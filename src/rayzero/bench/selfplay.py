"""Benchmark of self-play: the whole self-play path as a run uses it, and one worker on the CPU.

served (the default): self-play actors, the inference actor and replay as `rayzero train` builds them from the
preset and the host (cluster.plan; no learner), with randomly initialised weights. Per simulation count it
reports env steps/s and frames/s in the steady state, the env-only ceiling measured in the same run (as many
actors stepping the same envs with random actions), their ratio, the decision latency per step (p50, p99;
every env of an actor waits one batched step for its next action), one env alone (p50, p99), GPU utilisation
and energy per env step (NVML), how full the inference actor's batches were, and the host's CPU busy share
(/proc/stat) while the actors ran and while the ceiling did (are the cores the bound?), with the cores each role
kept busy (/proc/PID/stat: which processes took them). On a GPU host the
default rows are the `atari` preset at 50 simulations with the plan's envs per actor and with 16, at 200
simulations, and with `search.device=cpu` (trees walked by the self-play actors, leaves evaluated by the
inference actor), each with as many self-play actors as the host plan gives; `--rows preset,envs16,envs128,sims200,cpu,cpu128,cpu256,
cut,lanes2,lanes3,lanes2_128,lanes3_128,vl2,vl4,vl8,groups3,poll100,threads3,threads4,spin` picks some of them (a device
call may not have time for all four); the rows beyond the four defaults run only when asked for.

worker: one `SelfPlayWorker` with a local network copy, no Ray (the CPU path a laptop runs), against the
bare vector env.

    rayzero bench selfplay [--quick] [--seconds S] [--rows R,..] [--json PATH] [section.field=value ...]
    # --quick: cartpole, CPU, a few seconds per phase; overrides apply to every served row
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import numpy as np
import torch

from rayzero import config as config_lib
from rayzero.actors.selfplay import PHASES, SEARCH_PARTS, SelfPlayWorker
from rayzero.bench.common import write_json
from rayzero.envs import make_vector_env

FULL = {"cartpole": ((16, 32, 64), 30), "atari": ((8, 32), 6)}  # preset: (env counts, timed steps)
QUICK = {"cartpole": ((32,), 10), "atari": ((8,), 2)}


def _bare_env(env_cfg: Any, num_envs: int, steps: int) -> float:
    """Env steps/s of the vector env alone, random actions."""
    env = make_vector_env(env_cfg, num_envs, seed=0, training=True)
    rng = np.random.default_rng(0)
    try:
        env.reset(seed=0)
        start = time.perf_counter()
        for _ in range(steps):
            env.step(rng.integers(0, env.spec.num_actions, size=num_envs))
        return steps * num_envs / (time.perf_counter() - start)
    finally:
        env.close()


def measure(preset: str, num_envs: int, steps: int) -> dict[str, Any]:
    cfg = config_lib.load(preset, [f"env.num_envs={num_envs}"])
    torch.set_num_threads(1)
    worker = SelfPlayWorker(cfg.env, cfg.model, cfg.search, cfg.replay, seed=0)
    search_seconds = 0.0
    evaluator = worker.evaluator
    root, recurrent = evaluator.root, evaluator.recurrent_fn

    def timed(fn):  # time spent in network calls made by the search
        def wrapper(*args, **kwargs):
            nonlocal search_seconds
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                search_seconds += time.perf_counter() - start
        return wrapper

    evaluator.root, evaluator.recurrent_fn = timed(root), timed(recurrent)
    try:
        worker.collect(2)  # warm-up
        search_seconds = 0.0
        result = worker.collect(steps)
    finally:
        worker.env.close()
    seconds = result["seconds"]
    row = {
        "preset": preset, "env_id": cfg.env.id, "num_envs": num_envs, "simulations": cfg.search.num_simulations,
        "model": cfg.model.kind, "steps": steps, "env_steps_per_second": result["env_steps"] / seconds,
        "ms_per_batched_step": 1e3 * seconds / steps, "network_share": search_seconds / seconds,
        "bare_env_steps_per_second": _bare_env(cfg.env, num_envs, max(20, steps)),
    }
    print(f"{preset:8s} {cfg.env.id:14s} envs {num_envs:3d}  sims {row['simulations']:3d}  "
          f"{row['env_steps_per_second']:8,.0f} env steps/s  {row['ms_per_batched_step']:7.1f} ms/step  "
          f"network {row['network_share']:4.0%}  bare env {row['bare_env_steps_per_second']:9,.0f} steps/s",
          flush=True)
    return row


# -------------------------------------------------------------------------------- the served path (Ray)


def _percentiles(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {}
    ms = 1e3 * np.asarray(seconds)
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "steps": len(ms)}


def _run_actors(actors: list[Any], seconds: float, steps_per_call: int) -> dict[str, Any]:
    """Keep every actor collecting for `seconds`; env steps, per-step latencies, where the actors' collects spent
    their time (PHASES, summed over actors) and the wall time they took."""
    import ray

    start = time.perf_counter()
    pending = {a.collect.remote(steps_per_call, 1.0, None): a for a in actors}
    env_steps, step_seconds, half_steps, phases = 0, [], 0, dict.fromkeys(PHASES + SEARCH_PARTS, 0.0)
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        actor = pending.pop(ready[0])
        result = ray.get(ready[0])
        env_steps += result["env_steps"]
        step_seconds += result["step_seconds"]
        half_steps += result["half_steps"]
        for name, value in result["phase_seconds"].items():
            phases[name] += value
        if time.perf_counter() - start < seconds:
            pending[actor.collect.remote(steps_per_call, 1.0, None)] = actor
    return {"env_steps": env_steps, "seconds": time.perf_counter() - start, "step_seconds": step_seconds,
            "phase_seconds": phases, "half_steps": half_steps}


def _phase_shares(result: dict[str, Any]) -> dict[str, float]:
    """Of collects' `result`: each phase's share of the actors' time, and the ms per half-step of each (a half's
    turnaround from its answer to its next request is env + record + submit; the search's queued and device parts
    as well)."""
    phases, half_steps = result["phase_seconds"], result["half_steps"]
    total = sum(phases[name] for name in PHASES)
    out = {f"{name}_share": phases[name] / total if total else 0.0 for name in PHASES}
    out.update({f"{name}_ms_per_half_step": 1e3 * value / half_steps if half_steps else 0.0
                for name, value in phases.items()})
    return out


def _cpu_times(stat: str | None = None) -> tuple[int, int] | None:
    """(busy, total) jiffies of all the host's CPUs from /proc/stat's first line (or `stat`'s); None where there
    is no /proc/stat. Idle and iowait count as not busy; guest time is inside user time already."""
    if stat is None:
        try:
            with open("/proc/stat") as f:
                stat = f.readline()
        except OSError:
            return None
    fields = stat.split()
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def _percent(share: float | None) -> str:
    return "n/a" if share is None else f"{share:.0%}"


def _cpu_busy(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Share of the host's CPU time that was busy between two `_cpu_times` readings."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def _process_cpu(proc: str = "/proc") -> dict[int, tuple[str, float]] | None:
    """Every process's (role, CPU seconds so far: its threads' user and system time) from `proc`. The role is a
    Ray worker's actor class or task from its title ("ray::_RemoteSelfPlay.collect" -> "_RemoteSelfPlay"), else
    the process's name (raylet, gcs_server, python3). None where there is no `proc`."""
    try:
        pids = [name for name in os.listdir(proc) if name.isdigit()]
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for pid in pids:
        try:
            with open(os.path.join(proc, pid, "stat")) as f:
                stat = f.read()
            with open(os.path.join(proc, pid, "cmdline"), "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if title.startswith("ray::"):
            name = title[5:].split()[0].split(".")[0] if title[5:].strip() else name
        out[int(pid)] = name, (int(rest[11]) + int(rest[12])) / tick  # utime, stime: fields 14 and 15
    return out


def _cpu_by_role(before: dict[int, tuple[str, float]] | None, after: dict[int, tuple[str, float]] | None,
                 seconds: float, names: dict[int, str] | None = None) -> dict[str, dict[str, float]] | None:
    """Cores each role kept busy between two `_process_cpu` readings (CPU seconds over `seconds`), and how many
    of its processes ran, busiest role first; a process that started meanwhile counts from zero. `names`: roles
    of given processes (a Ray task's worker is titled "ray::IDLE" again once its task is done)."""
    if before is None or after is None or seconds <= 0:
        return None
    roles: dict[str, dict[str, float]] = {}
    for pid, (name, cpu) in after.items():
        used = cpu - (before[pid][1] if pid in before else 0.0)
        if used <= 0:
            continue
        name = (names or {}).get(pid, name)
        role = roles.setdefault(name, {"cores": 0.0, "processes": 0})
        role["cores"] += used / seconds
        role["processes"] += 1
    return dict(sorted(roles.items(), key=lambda item: -item[1]["cores"]))


def _roles_line(roles: dict[str, dict[str, float]] | None, top: int = 6) -> str:
    if not roles:
        return "n/a"
    parts = [f"{name} {r['cores']:.1f}" + (f" ({int(r['processes'])} processes)" if r["processes"] > 1 else "")
             for name, r in list(roles.items())[:top]]
    rest = sum(r["cores"] for _, r in list(roles.items())[top:])
    return ", ".join(parts) + (f", the rest {rest:.1f}" if rest >= 0.05 else "")


def _env_ceiling(env_cfg: Any, num_actors: int, cpus: float, seconds: float) -> tuple[float, list[int]]:
    """Env steps/s of `num_actors` Ray tasks, each stepping env_cfg.num_envs envs with random actions, as one
    vector env with env_cfg's threads (with env.num_threads=0 one per CPU: envs alone step fastest so, faster than
    on the plan's fewer threads per actor, so the ceiling is not lowered by the actors' setting). Every task
    builds its envs and then waits for the others, so that none is timed while another's worker process still
    starts and imports (Ray starts them for a run's first tasks). Returns the env steps/s and the tasks'
    processes."""
    import asyncio

    import ray

    @ray.remote(num_cpus=0)
    class Barrier:
        def __init__(self, parties: int) -> None:
            self.parties, self.arrived, self.all_here = parties, 0, asyncio.Event()

        async def wait(self) -> None:
            self.arrived += 1
            if self.arrived >= self.parties:
                self.all_here.set()
            await self.all_here.wait()

    @ray.remote
    def step_randomly(seed: int, barrier: Any) -> tuple[int, float, int]:
        env = make_vector_env(env_cfg, env_cfg.num_envs, seed, training=True)
        rng = np.random.default_rng(seed)
        env.reset(seed=seed)
        ray.get(barrier.wait.remote())
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            env.step(rng.integers(0, env.spec.num_actions, size=env_cfg.num_envs))
            steps += env_cfg.num_envs
        env.close()
        return steps, time.perf_counter() - start, os.getpid()

    barrier = Barrier.remote(num_actors)
    try:
        results = ray.get([step_randomly.options(num_cpus=cpus).remote(i, barrier) for i in range(num_actors)])
    finally:
        ray.kill(barrier)
    rate = sum(steps for steps, _, _ in results) / max(seconds for _, seconds, _ in results)
    return rate, [pid for _, _, pid in results]


def _batch_fill(stats: dict[str, Any], before: dict[str, Any]) -> dict[str, float]:
    """Rows per whole-search (or recurrent) batch and the share of bucket rows that were padding, since `before`."""
    rows = padded = count = 0
    for name, m in stats["buckets"].items():
        if not name.startswith(("search", "recurrent")):
            continue
        old = before["buckets"].get(name, {"rows": 0, "padded": 0, "count": 0})
        rows, padded, count = rows + m["rows"] - old["rows"], padded + m["padded"] - old["padded"], \
            count + m["count"] - old["count"]
    return {"rows_per_batch": rows / count if count else 0.0,
            "padding_fraction": padded / (rows + padded) if rows + padded else 0.0}


def served(preset: str, overrides: list[str], seconds: float, warmup_steps: int = 3) -> dict[str, Any]:
    """One row of the served path (see the module docstring)."""
    import ray

    from rayzero import cluster
    from rayzero.gpu_monitor import GpuMonitor
    from rayzero.envs import env_spec
    from rayzero.models import build_model

    cfg = config_lib.load(preset, overrides)
    spec = env_spec(cfg.env)
    p = cluster.plan(cfg, ray.cluster_resources())
    cfg = cluster.sized(cfg, p)
    replay = cluster.make_replay(cfg, p)
    inference = cluster.make_inference(cfg, spec, p)
    if inference is not None:
        model = build_model(cfg.model, spec.observation_shape, spec.num_actions)
        ray.get(inference.set_weights.remote(0, {k: v.numpy() for k, v in model.state_dict().items()}))
    actors = [cluster.make_selfplay(cfg, p, replay, inference, i) for i in range(p.selfplay.count)]
    steps_per_call = cfg.run.selfplay_steps_per_call
    try:
        ray.get([a.collect.remote(warmup_steps, 1.0, None) for a in actors])  # graphs captured, channels open
        before = ray.get(inference.stats.remote()) if inference is not None else None
        gpu = GpuMonitor()
        energy0 = gpu.energy_j()
        gpu.start()
        t0, cpu0, procs0 = time.monotonic(), _cpu_times(), _process_cpu()
        run = _run_actors(actors, seconds, steps_per_call)
        t1, cpu1, procs1 = time.monotonic(), _cpu_times(), _process_cpu()
        energy = gpu.energy_j()
        samples = gpu.stop()
        after = ray.get(inference.stats.remote()) if inference is not None else None
    finally:
        for actor in actors:
            ray.kill(actor)
    alone_cfg = config_lib.load(preset, [*overrides, "env.num_envs=1", "cluster.num_selfplay_actors=1"])
    alone = cluster.make_selfplay(alone_cfg, cluster.plan(alone_cfg, ray.cluster_resources()), replay, inference,
                                  10_000)
    try:
        ray.get(alone.collect.remote(warmup_steps, 1.0, None))
        single = ray.get(alone.collect.remote(max(20, int(10 * seconds)), 1.0, None))
    finally:
        ray.kill(alone)
    ceiling_cpu0, ceiling_procs0, ceiling_t0 = _cpu_times(), _process_cpu(), time.monotonic()
    # The ceiling's envs step on the vector env's own threads (env.num_threads=0: one per CPU, the fastest for
    # envs alone), whatever a row sets for self-play's: a row's fewer threads must not lower its own ceiling.
    ceiling, ceiling_pids = _env_ceiling(dataclasses.replace(cfg.env, num_threads=0), p.selfplay.count,
                                         p.selfplay.cpus, seconds)
    ceiling_cpu = _cpu_busy(ceiling_cpu0, _cpu_times())
    ceiling_roles = _cpu_by_role(ceiling_procs0, _process_cpu(), time.monotonic() - ceiling_t0,
                                 {pid: "step_randomly" for pid in ceiling_pids})
    rate = run["env_steps"] / run["seconds"]
    row = {
        "preset": preset, "overrides": overrides, "env_id": cfg.env.id, "simulations": cfg.search.num_simulations,
        "actors": p.selfplay.count, "envs_per_actor": cfg.env.num_envs, "whole_search": p.whole_search,
        "inference_device": p.inference.device if p.inference is not None else "local",
        "env_steps_per_second": rate, "frames_per_second": rate * (cfg.env.frame_skip if cfg.env.is_atari else 1),
        "ceiling_env_steps_per_second": ceiling, "ratio_to_ceiling": rate / ceiling if ceiling else None,
        "step_latency": _percentiles(run["step_seconds"]), "one_env_latency": _percentiles(single["step_seconds"]),
        "actor_time": _phase_shares(run), "one_env_time": _phase_shares(single),
        "gpu": GpuMonitor.summarize(samples, t0, t1),
        # whether the host's cores are the bound: all CPUs' busy share while the actors ran, and while the ceiling did
        "host_cpu_busy": _cpu_busy(cpu0, cpu1), "ceiling_host_cpu_busy": ceiling_cpu,
        # where those cores went: cores busy per role (Ray actor class or task, or process name), from /proc
        "cpu_by_role": _cpu_by_role(procs0, procs1, t1 - t0), "ceiling_cpu_by_role": ceiling_roles,
        "energy_j_per_env_step": (energy - energy0) / run["env_steps"] if energy is not None and energy0 is not None
        else None,
        "seconds": run["seconds"],
    }
    if after is not None:
        row["batches"] = _batch_fill(after, before)
        row["lane_batches"] = [n - m for n, m in zip(after.get("lane_batches", []), before.get("lane_batches", []))]
        # the GPU thread's CUDA batch waits over the timed steps: slept on a blocking event, or spun
        row["batch_waits"] = {k: n - before.get("batch_waits", {}).get(k, 0)
                              for k, n in after.get("batch_waits", {}).items()}
    lat, one = row["step_latency"], row["one_env_latency"]
    print(f"served {preset:8s} sims {row['simulations']:3d}  {row['actors']:2d} x {row['envs_per_actor']:3d} envs  "
          f"{rate:8,.0f} env steps/s  ceiling {ceiling:8,.0f} ({row['ratio_to_ceiling']:.0%})  "
          f"step p50 {lat.get('p50_ms', 0):6.1f} p99 {lat.get('p99_ms', 0):6.1f} ms  "
          f"one env p50 {one.get('p50_ms', 0):5.1f} ms  GPU {row['gpu'].get('util_mean', float('nan')):5.1f} %  "
          f"host CPU {_percent(row['host_cpu_busy'])} (ceiling's {_percent(ceiling_cpu)})", flush=True)
    if len(row.get("lane_batches", [])) > 1:
        print(f"  whole-search batches per lane {row['lane_batches']}  rows per batch "
              f"{row['batches']['rows_per_batch']:.0f} (padding {row['batches']['padding_fraction']:.0%})", flush=True)
    print(f"  cores busy  {_roles_line(row['cpu_by_role'])}  (ceiling: {_roles_line(ceiling_roles, 3)})", flush=True)
    for name in ("actor_time", "one_env_time"):
        t = row[name]
        print(f"  {name:12s} " + "  ".join(f"{phase} {t.get(phase + '_share', 0):4.0%} "
                                           f"({t.get(phase + '_ms_per_half_step', 0):.2f} ms)" for phase in PHASES)
              + "  (search: " + "  ".join(f"{part} {t.get(part + '_ms_per_half_step', 0):.2f}"
                                          for part in SEARCH_PARTS) + " ms)", flush=True)
    return row


_HOST = ["cluster.num_selfplay_actors=0", "env.num_envs=0"]
GPU_ROWS = {"preset": _HOST, "envs16": [*_HOST, "env.num_envs=16"], "envs128": [*_HOST, "env.num_envs=128"],
            "sims200": [*_HOST, "search.num_simulations=200"], "cpu": [*_HOST, "search.device=cpu", "env.num_envs=64"],
            "cpu128": [*_HOST, "search.device=cpu", "env.num_envs=128"],
            "cpu256": [*_HOST, "search.device=cpu", "env.num_envs=256"],
            "cut": [*_HOST, "inference.bucket_cut=true"],
            "lanes2": [*_HOST, "inference.search_lanes=2"], "lanes3": [*_HOST, "inference.search_lanes=3"],
            "lanes2_128": [*_HOST, "inference.search_lanes=2", "env.num_envs=128"],
            "lanes3_128": [*_HOST, "inference.search_lanes=3", "env.num_envs=128"],
            "vl2": [*_HOST, "search.virtual_loss=2"], "vl4": [*_HOST, "search.virtual_loss=4"],
            "vl8": [*_HOST, "search.virtual_loss=8"], "groups3": [*_HOST, "env.search_groups=3"],
            "poll100": [*_HOST, "inference.poll_interval_us=100"], "spin": [*_HOST, "inference.sleep_waits=false"],
            "threads3": [*_HOST, "env.num_threads=3"], "threads4": [*_HOST, "env.num_threads=4"]}
"""The rows on a GPU host: the plan's envs per actor (cluster/plan.py, `selfplay_envs`: 128 where whole searches
run on the GPU), then 16 (searches of a quarter the roots) or 128, 200 simulations, and the trees walked on the
CPU with 64 envs per actor (the preset's) and with 128 (a CPU search's simulation waves wait on the round trip to
the inference actor, so twice the rows per wave may come near twice the env steps; the default rows leave it
out) or 256 (the same again, where 128 left the GPU mostly idle in the fifteenth session), whole searches cut at
a smaller bucket where that moves more rows per device second (inference.bucket_cut=true), 2 or 3 search lanes
(whole searches in flight at once on their own streams), virtual loss 2, 4 or 8 (K walks per tree per network
call: a K times shorter chain of calls), the envs in three groups rather than two halves (each search has
two groups' steps to come back in), and 3 or 4 native threads per vector env instead of the plan's (the
cluster's CPUs over its actors: 2 for 12 actors on 16 cores), where the actors' time goes to the env step, and
the inference actor's GPU thread spinning on every batch (`spin`: inference.sleep_waits=false) rather than sleeping
on a blocking event. Every row sizes self-play from the host (as many actors, and as many envs
per actor, as the plan gives): the preset pins one actor of 64 envs, which is what its learner needs at its
replay ratio, while this bench measures what self-play on the host can do."""


DEFAULT_ROWS = ("preset", "envs16", "sims200", "cpu")


def check_rows(only: list[str] | None) -> list[str] | None:
    """`only` (rows of GPU_ROWS, None = all) as given, or a ValueError naming what is valid."""
    if only is not None and (not only or any(r not in GPU_ROWS for r in only)):
        raise ValueError(f"bench selfplay rows {only!r}: valid rows are {', '.join(GPU_ROWS)}")
    return only


def main(quick: bool = False, json_path: str | None = None, seconds: float | None = None,
         only: list[str] | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    import ray

    import torch as _torch

    from rayzero import cluster
    from rayzero.config import ClusterConfig

    gpu = _torch.cuda.is_available()
    check_rows(only)
    if only is not None and (quick or not gpu):
        raise ValueError("bench selfplay --rows picks rows of the GPU host's table; this run has "
                         + ("--quick" if quick else "no GPU"))
    if quick:
        variants = [("cartpole", ["inference.mode=central", "cluster.num_selfplay_actors=1", "env.num_envs=8"])]
    elif gpu:
        variants = [("atari", GPU_ROWS[r]) for r in (only or DEFAULT_ROWS)]
    else:
        variants = [("cartpole", ["inference.mode=central"])]
    variants = [(preset, [*row, *(overrides or [])]) for preset, row in variants]
    for preset, row in variants:
        config_lib.load(preset, row)  # a bad override fails here, before Ray starts
    if seconds is None:
        seconds = 3.0 if quick else 30.0
    cluster.connect(ClusterConfig())
    rows: list[dict[str, Any]] = []
    try:
        for preset, overrides in variants:
            rows.append(served(preset, overrides, seconds))
            if json_path:  # rows so far, in case a later one does not finish (a device call's time limit)
                write_json(json_path, "selfplay", {"quick": quick, "served": rows, "worker": [], "partial": True})
    finally:
        ray.shutdown()
    worker_rows = [] if gpu and not quick else [
        measure(preset, n, steps) for preset, (counts, steps) in (QUICK if quick else FULL).items() for n in counts]
    return write_json(json_path, "selfplay", {"quick": quick, "served": rows, "worker": worker_rows})


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--seconds", type=float, default=None)
    args = parser.parse_args()
    main(args.quick, args.json, args.seconds)
