"""What one learner update of the `atari` preset costs, alone on the GPU, and which of its parts cost it.

The Atari lab notebook (docs/benchmarks.md) found the learner to be the bound of every Pong run: the replay
ratio makes self-play wait for it. This script answers where its step time goes. Each variant is the preset's
learner (`rayzero.config.load("atari", overrides)`) on a replay of random Atari-sized segments, timed with
`Learner.bench_steps` (one batch kept on the device: no sampling, no Ray), so the rows differ only in the
step. The variants compile in parallel processes (compilation is CPU work) and are timed one at a time, so no
two share the GPU while timed. It reports the compile time (the first step) as well: it delays every run's
first update.

    python3 scripts/learner_cost.py [--variants preset,no_target,...] [--steps 200] [--json PATH]

Run on a GPU host (scripts/device_pong.sh's machine); on a CPU it runs a smoke size (--quick).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import multiprocessing as mp
import os
import sys
import time

VARIANTS = {
    "preset": [],
    "no_target": ["learner.target_update_interval=0", "replay.bootstrap_obs=false"],
    "batch_512": ["learner.batch_size=512"],
    "batch_1024": ["learner.batch_size=1024"],
    "gray64": ["env.grayscale=true", "env.image_size=64"],
    "gray64_d8": ["env.grayscale=true", "env.image_size=64", "model.downsample=8"],  # LightZero's 8x8 latent
    "consistency": ["learner.consistency_weight=2", "replay.next_obs=true"],
    "consistency_step": ["learner.consistency_weight=2", "replay.next_obs=true", "learner.consistency_targets=step"],
    "consistency_separate": ["learner.consistency_weight=2", "replay.next_obs=true",
                             "learner.consistency_targets=separate"],
    "no_cudagraphs": ["learner.compile_mode=default", "learner.step_graph=false"],
    "default_graph": ["learner.compile_mode=default"],  # inductor's kernels, the whole update as one CUDA graph
    "eager": ["learner.compile=false", "learner.step_graph=false"],
    "eager_graph": ["learner.compile=false"],  # the eager step replayed as one CUDA graph
}
QUICK = ["model.channels=8", "model.support_size=10", "learner.batch_size=8", "env.image_size=64"]


def _obs_shape(env) -> tuple[int, int, int]:
    return ((1 if env.grayscale else 3) * env.frame_stack, env.image_size, env.image_size)


def preset_replay(overrides: list[str], quick: bool):
    """The atari preset's config with `overrides`, and a replay of random Atari-sized segments to sample from:
    (config, obs_shape, num_actions, replay)."""
    import numpy as np

    from rayzero import config as config_mod
    from rayzero.replay.buffer import ReplayBuffer, Segment

    # The step as it runs once compiled: the background compile's eager start is not what is timed here.
    cfg = config_mod.load("atari", ["learner.background_compile=false", *overrides, *(QUICK if quick else []),
                                    "replay.frame_stack=0",
                                    "replay.shared_obs=false", "replay.capacity=4000", "replay.min_size=100"])
    obs_shape, actions = _obs_shape(cfg.env), 6
    replay = ReplayBuffer(cfg.replay, seed=0)
    rng = np.random.default_rng(0)
    for _ in range(cfg.replay.capacity // 200):
        replay.add(Segment(
            obs=rng.integers(0, 256, size=(200, *obs_shape), dtype=np.uint8),
            actions=rng.integers(0, actions, size=200),
            rewards=rng.choice([-1.0, 0.0, 0.0, 0.0, 1.0], size=200).astype(np.float32),
            policies=rng.dirichlet(np.ones(actions), size=200).astype(np.float32),
            root_values=rng.normal(size=200).astype(np.float32),
            num_sampleable=190, terminal=False, bootstrap_value=0.0,
        ))
    return cfg, obs_shape, actions, replay


def _one(name: str, overrides: list[str], steps: int, lock_path: str, queue, quick: bool) -> None:
    from rayzero.learner.learner import Learner

    try:
        cfg, obs_shape, actions, replay = preset_replay(overrides, quick)
        learner = Learner(cfg.model, cfg.learner, obs_shape, actions, seed=0)
        batch = replay.sample(cfg.learner.batch_size)
        t0 = time.perf_counter()
        learner.bench_steps(batch, 1, warmup=2)  # compiles (and captures) here
        compile_s = time.perf_counter() - t0
        with open(lock_path, "w") as lock:  # one variant at a time on the GPU
            fcntl.flock(lock, fcntl.LOCK_EX)
            learner.bench_steps(batch, 20, warmup=5)
            timed = learner.bench_steps(batch, steps, warmup=0)
            fcntl.flock(lock, fcntl.LOCK_UN)
        queue.put({"variant": name, "overrides": overrides, "batch": cfg.learner.batch_size,
                   "obs_shape": list(obs_shape), "compile_s": round(compile_s, 1),
                   "ms_per_step": round(timed["ms_per_step"], 3),
                   "steps_per_second": round(timed["steps_per_second"], 1),
                   "samples_per_second": round(timed["samples_per_second"]), "compile": timed["compile"],
                   "graph_updates": learner.graph_updates})
    except Exception as error:  # noqa: BLE001 - a row that failed says why; the others still run
        queue.put({"variant": name, "overrides": overrides, "error": f"{type(error).__name__}: {error}"[:300]})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="smoke size for a CPU")
    parser.add_argument("--parallel", type=int, default=4, help="variants compiling at once")
    args = parser.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant {unknown[0]!r}; valid: {', '.join(VARIANTS)}")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    lock_path = f"/tmp/learner_cost.{os.getpid()}.lock"
    start = time.perf_counter()
    rows, procs, pending = [], [], list(names)
    while len(rows) < len(names):
        while pending and len(procs) - len(rows) < args.parallel:  # a variant is done when its row arrives
            name = pending.pop(0)
            procs.append(ctx.Process(target=_one, args=(name, VARIANTS[name], args.steps, lock_path, queue,
                                                        args.quick)))
            procs[-1].start()
        rows.append(queue.get())
        print(json.dumps(rows[-1]), flush=True)
    for proc in procs:
        proc.join()
    import torch

    from rayzero.bench.common import write_json
    print(f"\n{'variant':<14} {'batch':>5} {'obs':>10} {'compile s':>9} {'ms/step':>8} {'steps/s':>8} {'samples/s':>10}")
    for r in sorted(rows, key=lambda r: names.index(r["variant"])):
        if "error" in r:
            print(f"{r['variant']:<14} error: {r['error']}")
            continue
        obs = "x".join(map(str, r["obs_shape"]))
        print(f"{r['variant']:<14} {r['batch']:>5} {obs:>10} {r['compile_s']:>9} {r['ms_per_step']:>8} "
              f"{r['steps_per_second']:>8} {r['samples_per_second']:>10}")
    print(f"({time.perf_counter() - start:.0f} s in all)")
    if args.json:
        write_json(args.json, "learner_cost", {"rows": rows, "steps": args.steps, "cuda": torch.cuda.is_available()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
