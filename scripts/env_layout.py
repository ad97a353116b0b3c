"""How fast a host's Atari envs step in the layouts a self-play actor can give them, with nothing else running.

`rayzero bench selfplay` compares self-play with an env-only ceiling (one vector env of all of an actor's envs
on all cores' threads per process). Self-play's actors step two halves in turn, each a vector env on a few
native threads. This script steps random actions in each layout, in the same number of processes, and prints
env steps/s and env steps per core-second, so the gap between self-play and its ceiling can be split into what
the layout costs and what the rest of the served system (inference actor, replay, Ray) costs.

    python scripts/env_layout.py [--processes 12] [--seconds 10] [--layouts ceiling,halves_t2,...] [--json F]

No Ray, no GPU: plain processes (multiprocessing, spawn) and ale-py's vector env with the atari preset's
settings (Pong, 64x64 grayscale, 4 frames, frame skip 4, sticky actions 0.25).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import time

LAYOUTS = {
    # name: (vector envs per process, envs in each, native threads of each: 0 = one per core)
    "ceiling": (1, 128, 0),
    "one_t2": (1, 128, 2),
    "halves_t1": (2, 64, 1),
    "halves_t2": (2, 64, 2),
    "halves_t3": (2, 64, 3),
    "halves_t4": (2, 64, 4),
    "halves_t8": (2, 64, 8),
    # rayzero's own wrapper (envs.make_vector_env: fire reset, episode returns, lives) around the same env
    "ceiling_rz": (1, 128, 0),
    "halves_t2_rz": (2, 64, 2),
}


def _make(envs: int, threads: int, seed: int, wrapped: bool):
    if wrapped:
        from rayzero import config as config_lib
        from rayzero.envs import make_vector_env

        cfg = config_lib.load("atari", [f"env.num_threads={threads}"])
        return make_vector_env(cfg.env, envs, seed, training=True)
    from ale_py.vector_env import AtariVectorEnv

    return AtariVectorEnv("pong", envs, num_threads=threads or os.cpu_count(), img_height=64, img_width=64,
                          grayscale=True, stack_num=4, frameskip=4, repeat_action_probability=0.25,
                          noop_max=30, autoreset_mode="SameStep", reward_clipping=False, use_fire_reset=False)


def _worker(index: int, name: str, seconds: float, barrier, results) -> None:
    import numpy as np

    groups, envs, threads = LAYOUTS[name]
    vector = [_make(envs, threads, 1000 * index + g, name.endswith("_rz")) for g in range(groups)]
    for g, env in enumerate(vector):
        env.reset(seed=1000 * index + 100 * g)
    rng = np.random.default_rng(index)
    barrier.wait()
    t0, c0 = time.perf_counter(), os.times()
    steps = 0
    while time.perf_counter() - t0 < seconds:
        for env in vector:  # the halves in turn, as a self-play actor steps them
            env.step(rng.integers(0, 6, size=envs))
            steps += envs
    wall, c1 = time.perf_counter() - t0, os.times()
    for env in vector:
        env.close()
    results.put((steps, wall, (c1.user - c0.user) + (c1.system - c0.system)))


def run(name: str, processes: int, seconds: float) -> dict:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(i, name, seconds, barrier, results)) for i in range(processes)]
    for p in procs:
        p.start()
    got = [results.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join()
    steps = sum(s for s, _, _ in got)
    wall = max(w for _, w, _ in got)
    cpu = sum(c for _, _, c in got)
    groups, envs, threads = LAYOUTS[name]
    return {"layout": name, "groups": groups, "envs_each": envs, "threads": threads or os.cpu_count(),
            "processes": processes, "env_steps_per_s": steps / wall, "cores_busy": cpu / wall,
            "steps_per_core_s": steps / cpu if cpu else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--json")
    args = parser.parse_args()
    names = args.layouts.split(",")
    bad = [n for n in names if n not in LAYOUTS]
    if bad:
        parser.error(f"--layouts {','.join(bad)}: valid layouts are {', '.join(LAYOUTS)}")
    rows = []
    print(f"{'layout':<11} {'groups x envs':>13} {'threads':>7} {'env steps/s':>12} {'cores busy':>10} "
          f"{'steps per core-s':>16}")
    for name in names:
        row = run(name, args.processes, args.seconds)
        rows.append(row)
        print(f"{name:<11} {row['groups']:>4} x {row['envs_each']:<6} {row['threads']:>7} "
              f"{row['env_steps_per_s']:>12,.0f} {row['cores_busy']:>10.1f} {row['steps_per_core_s']:>16,.0f}",
              flush=True)
    if args.json:
        import ale_py

        with open(args.json, "w") as f:
            json.dump({"rows": rows, "machine": {"cpus": os.cpu_count(), "processor": platform.processor(),
                                                 "node": platform.node()},
                       "versions": {"python": platform.python_version(), "ale_py": ale_py.__version__},
                       "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}, f, indent=1)


if __name__ == "__main__":
    main()
