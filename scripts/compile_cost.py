"""How long the `atari` preset's learner takes to its first compiled update, cold and with a warm compile cache,
and with its side steps (target network, consistency targets) left eager.

The Pong bar runs lose 109-149 s of their 540 s before the first update, nearly all of it the learner's first
call, which compiles (docs/benchmarks.md, runs 12-13). This script answers which part of that a run could save.
Each variant runs in a fresh process, one after another (compiling is CPU work; parallel compiles would inflate
each other), on the replay of random Atari-sized segments that scripts/learner_cost.py uses. A variant names its
inductor cache directory: 'warm' reuses the one 'cold' filled, as a second run on the same machine would. Per
variant: seconds to build the learner, seconds of the first three updates (compile and CUDA-graph recording),
steady ms per update, and torch._dynamo's table of compile phases (in the log). Those ms are of a bare loop that
does not replay the step as one CUDA graph (learner.step_graph works in the learner's call loop), so on a GPU
they are launch-bound, not a run's: `python -m rayzero.bench.learner --preset atari` times the step as a run has
it, and the two can rank variants differently (docs/benchmarks.md, twenty-fourth session).

    python3 scripts/compile_cost.py [--variants cold,warm,side_eager,eager] [--json PATH] [--log-dir DIR] [overrides]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from learner_cost import preset_replay  # noqa: E402  (the same replay and sizes as learner_cost.py)

# name: (overrides, cache group[, learner seed]); 'warm_other_weights' asks whether the cache still hits for other
# weights (a learner that trained eagerly while another process filled the cache)
VARIANTS = {
    "cold": ([], "preset"),
    "warm": ([], "preset"),
    "warm_other_weights": ([], "preset", 1),
    "side_eager": (["learner.compile_side_steps=false"], "side_eager"),
    "side_eager_warm": (["learner.compile_side_steps=false"], "side_eager"),
    "eager": (["learner.compile=false"], "eager"),
    "batch_512": (["learner.batch_size=512"], "batch_512"),
    # learner.compile_regions: the root and one unrolled step compiled on their own (the step traced once for all K)
    "regions": (["learner.compile_regions=true"], "regions"),
    "regions_warm": (["learner.compile_regions=true"], "regions"),
    # the loss as one graph (the preset before the twenty-first session): its steady step against the regions'
    "whole": (["learner.compile_regions=false"], "whole"),
    "whole_warm": (["learner.compile_regions=false"], "whole"),
    # batch 512 as regions: the whole loss's compiled step at 512 computes wrong gradients on torch 2.11 (ninth and
    # eleventh sessions), which the compile check catches; the row's 'compile' says whether the regions' pass it
    "regions_512": (["learner.compile_regions=true", "learner.batch_size=512"], "regions_512"),
    # the regions without the target network's bootstraps (the stored search values instead): what they cost
    "regions_no_target": (["learner.compile_regions=true", "learner.target_update_interval=0",
                           "replay.bootstrap_obs=false"], "regions_no_target"),
    "nhwc": (["learner.channels_last=true"], "nhwc"),  # the net and its batches NHWC (learner.channels_last)
    # learner.early_compile as the driver runs it: helpers compile on a made batch (background.synthetic_batch),
    # then a learner compiles on a real one from their cache; the row says how many graphs it found there
    "early": ([], "early"),
    "early_regions": (["learner.compile_regions=true"], "early_regions"),
    # the early compile's parts (background.parts) with the regions, each helper alone and cold, one after
    # another: what each part costs without the others beside it (on a host with a core for each helper, the
    # early compile takes about the longest of them)
    "parts_alone": (["learner.compile_regions=true"], "parts_alone"),
}


def _one(name: str, overrides: list[str], cache_dir: str, steps: int, quick: bool, log_path: str, queue,
         seed: int = 0) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # before torch is imported
    try:
        import torch
        import torch._inductor.config as inductor_config

        from rayzero.learner.learner import Learner

        cfg, obs_shape, actions, replay = preset_replay(overrides, quick)
        batch = replay.sample(cfg.learner.batch_size)
        if name.startswith("early"):
            queue.put(_early(name, overrides, cfg, obs_shape, actions, batch, steps))
            return
        if name == "parts_alone":
            queue.put(_parts_alone(name, overrides, cfg, obs_shape, actions, cache_dir))
            return
        t0 = time.perf_counter()
        learner = Learner(cfg.model, cfg.learner, obs_shape, actions, seed=seed)
        build_s = time.perf_counter() - t0
        firsts = []
        for _ in range(3):  # compile, then CUDA-graph warm-up and recording
            t = time.perf_counter()
            learner.bench_steps(batch, 1, warmup=0)
            firsts.append(time.perf_counter() - t)
        timed = learner.bench_steps(batch, steps, warmup=5)
        with open(log_path, "a") as log:
            log.write(f"== {name} {overrides} cache {cache_dir}\n")
            try:
                log.write(str(torch._dynamo.utils.compile_times(repr="str")) + "\n")
            except Exception as error:  # noqa: BLE001 - the table is a diagnostic
                log.write(f"(no compile_times: {error})\n")
        queue.put({"variant": name, "overrides": overrides, "cache": os.path.basename(cache_dir),
                   "batch": cfg.learner.batch_size, "build_s": round(build_s, 1),
                   "first_steps_s": [round(x, 1) for x in firsts], "to_first_fast_s": round(build_s + sum(firsts), 1),
                   "ms_per_step": round(timed["ms_per_step"], 2), "compile": timed["compile"],
                   "compile_threads": inductor_config.compile_threads})
    except Exception as error:  # noqa: BLE001 - a row that failed says why; the others still run
        queue.put({"variant": name, "overrides": overrides, "error": f"{type(error).__name__}: {error}"[:300]})


def _early(name: str, overrides: list[str], cfg, obs_shape, actions: int, batch, steps: int) -> dict:
    """learner.early_compile: the driver's helpers on a made batch (timed to their end), then a learner of another
    seed told of them, whose updates run on a real batch until its compiled step has run."""
    import dataclasses
    import shutil
    from pathlib import Path

    import numpy as np
    import torch

    from rayzero.learner import background
    from rayzero.learner.learner import Learner

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    learner_cfg = dataclasses.replace(cfg.learner, background_compile=True, device=device.type)
    made = background.synthetic_batch(cfg.replay, obs_shape, np.dtype(np.uint8), actions, learner_cfg.batch_size)
    directory = Path(tempfile.mkdtemp(prefix="compile_cost_prewarm."))
    t0 = time.perf_counter()
    helpers = background.prewarm(cfg.model, learner_cfg, obs_shape, actions, device, made, directory)
    watch = background.PrewarmWatch(str(directory))
    while watch.codes() is None:
        time.sleep(0.5)
    helpers_s, codes = time.perf_counter() - t0, watch.codes()
    for helper in helpers:
        helper.wait()
        background.clean_up(helper)
    learner = Learner(cfg.model, dataclasses.replace(learner_cfg, prewarm_dir=str(directory)), obs_shape, actions,
                      seed=1)
    t1 = time.perf_counter()
    updates = 0
    while learner.compile_cache_use is None and updates < 10:
        learner.bench_steps(batch, 1, warmup=0)
        updates += 1
    compiled_s = time.perf_counter() - t1
    timed = learner.bench_steps(batch, steps, warmup=5)
    shutil.rmtree(directory, ignore_errors=True)
    return {"variant": name, "overrides": overrides, "batch": learner_cfg.batch_size, "helpers_s": round(helpers_s, 1),
            "helper_codes": codes, "updates_to_compiled": updates, "learner_compile_s": round(compiled_s, 1),
            "cache_use": learner.compile_cache_use, "build_s": 0.0, "first_steps_s": [round(compiled_s, 1)],
            "to_first_fast_s": round(helpers_s + compiled_s, 1), "ms_per_step": round(timed["ms_per_step"], 2),
            "compile": timed["compile"]}


def _parts_alone(name: str, overrides: list[str], cfg, obs_shape, actions: int, cache_dir: str) -> dict:
    """Each part of the early compile in a helper of its own, alone and with a cold cache of its own: seconds
    from its start (Python, torch and its learner coming up included) to its end."""
    import dataclasses
    import shutil

    import numpy as np
    import torch

    from rayzero.learner import background

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    learner_cfg = dataclasses.replace(cfg.learner, background_compile=True, device=device.type)
    made = background.synthetic_batch(cfg.replay, obs_shape, np.dtype(np.uint8), actions, learner_cfg.batch_size)
    seconds, codes = {}, {}
    for part in background.parts(learner_cfg, cfg.model):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, part)  # inherited by the helper: cold
        t0 = time.perf_counter()
        helper = background.spawn(cfg.model, learner_cfg, obs_shape, actions, device, part)
        background.hand_over(helper, made, 0)
        codes[part] = helper.wait()
        seconds[part] = round(time.perf_counter() - t0, 1)
        background.clean_up(helper)
    shutil.rmtree(cache_dir, ignore_errors=True)
    longest = max(seconds.values())
    return {"variant": name, "overrides": overrides, "batch": learner_cfg.batch_size, "part_seconds": seconds,
            "helper_codes": codes, "sum_s": round(sum(seconds.values()), 1), "longest_s": longest, "build_s": 0.0,
            "first_steps_s": [longest], "to_first_fast_s": longest, "ms_per_step": float("nan"), "compile": "-"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="cold,warm,side_eager,eager")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--json", default=None)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--quick", action="store_true", help="smoke size for a CPU")
    parser.add_argument("overrides", nargs="*", help="config overrides for every variant (learner.compile=true "
                        "compiles on a CPU too)")
    args = parser.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant {unknown[0]!r}; valid: {', '.join(VARIANTS)}")
    root = tempfile.mkdtemp(prefix="compile_cost.")
    log_dir = args.log_dir or root
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, "compile_times.txt")
    ctx = mp.get_context("spawn")
    rows = []
    for name in names:
        overrides, group, *seed = VARIANTS[name]
        queue = ctx.Queue()
        proc = ctx.Process(target=_one, args=(name, [*args.overrides, *overrides], os.path.join(root, group),
                                              args.steps, args.quick, log_path, queue, *seed))
        proc.start()
        rows.append(queue.get())
        proc.join()
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'variant':<16} {'batch':>5} {'build s':>7} {'first 3 steps s':>18} {'to fast s':>9} {'ms/step':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<16} error: {r['error']}")
            continue
        firsts = "/".join(str(x) for x in r["first_steps_s"])
        print(f"{r['variant']:<16} {r['batch']:>5} {r['build_s']:>7} {firsts:>18} {r['to_first_fast_s']:>9} "
              f"{r['ms_per_step']:>8}")
    if args.json:
        import torch

        from rayzero.bench.common import write_json
        write_json(args.json, "compile_cost", {"rows": rows, "steps": args.steps, "cuda": torch.cuda.is_available()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
