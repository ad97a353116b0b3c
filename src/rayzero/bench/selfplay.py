"""Benchmark of one self-play worker on the CPU: env steps/s with a local network copy, and the bare envs.

Rows, per preset and number of envs: the worker's env steps/s through `SelfPlayWorker.collect` (search with
the preset's simulations and network, env stepping, segment building; no Ray, no sink), the share of the time
the search (root inference included) takes, and the bare vector env's steps/s with random actions. This is the
CPU self-play path: one such worker per core is what `cluster.num_selfplay_actors` scales out; the GPU path
(whole searches on the inference actor) is `rayzero bench inference`.

    rayzero bench selfplay [--quick] [--json PATH]      # --quick: fewer steps and env counts, < 1 minute
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from rayzero import config as config_lib
from rayzero.actors.selfplay import SelfPlayWorker
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


def main(quick: bool = False, json_path: str | None = None) -> dict[str, Any]:
    sizes = QUICK if quick else FULL
    rows = [measure(preset, n, steps) for preset, (counts, steps) in sizes.items() for n in counts]
    return write_json(json_path, "selfplay", {"quick": quick, "torch_threads": 1, "rows": rows})


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    main(args.quick, args.json)
