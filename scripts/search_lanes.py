"""Do whole searches on concurrent CUDA streams move more roots per second than one after another?

Issue 11's self-play is bound by the GPU's whole searches, whose time grows far slower than their roots
(docs/benchmarks.md), so most of a search is a chain of small kernels, each leaving most of the GPU idle. If searches on L streams overlap,
the inference actor could keep L searches in flight ("lanes") instead of one. This measures the hypothesis before
anything is built: L inference runners (runner.py), each with its own copy of the preset's network, stream,
static buffers, memory pool and whole-search graph of one bucket, run `--rounds` rounds; in each round every lane
launches its initial step and whole search on its own stream, and the round's wall time is taken after all are
done. Lanes = 1 is the sequential baseline (the actor today). It prints a table (ms a round, roots/s, speed-up)
and writes JSON with machine, versions and date. CUDA only.

The server's search lanes built on this (inference.search_lanes) hung on an H100 while every runner's graphs
were captured on torch's one default capture stream and so shared its cuBLAS workspace; since runners capture on
their own streams, two and three lanes finish (the thirty-second and thirty-third sessions in docs/benchmarks.md).
Run it under `timeout` all the same: a hang here is a hang in the inference actor.

    python3 scripts/search_lanes.py [--preset atari] [--buckets 128,256,512] [--lanes 1,2,3,4] [--rounds 30] \
        [--json PATH] [section.field=value ...]
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from rayzero import config as config_lib
from rayzero.bench.common import write_json
from rayzero.envs import env_spec
from rayzero.inference.runner import Runner
from rayzero.models import build_model


def lane_runners(config: config_lib.Config, bucket: int, lanes: int) -> list[Runner]:
    """`lanes` runners of one whole-search bucket, their networks copies of one (the same weights)."""
    spec = env_spec(config.env)
    cfg = dataclasses.replace(config.inference, device="cuda", max_batch=bucket, min_bucket=bucket,
                              search_max_batch=bucket, latent_pool_size=bucket, cache_size=0, merge_searches=False)
    models = [build_model(config.model, spec.observation_shape, spec.num_actions).cuda().eval() for _ in range(lanes)]
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    return [Runner(model, cfg, spec.observation_shape, spec.observation_dtype, spec.num_actions, [bucket],
                   config.search, config.replay.discount, seed=lane) for lane, model in enumerate(models)]


@torch.no_grad()
def time_rounds(runners: list[Runner], bucket: int, rounds: int) -> float:
    """Seconds a round: every lane's initial step and whole search launched on its own stream, then all waited."""
    steps = []
    for runner in runners:
        with torch.cuda.stream(runner.stream):
            steps.append(runner._profile_step("search", bucket, graph=True))
    def one_round() -> None:
        for runner, step in zip(runners, steps):
            with torch.cuda.stream(runner.stream):
                step()
    for _ in range(3):  # warm-up
        one_round()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(rounds):
        one_round()
        for runner in runners:  # a round ends when every lane's search has
            runner.stream.synchronize()
    return (time.perf_counter() - start) / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="atari")
    parser.add_argument("--buckets", default="128,256,512")
    parser.add_argument("--lanes", default="1,2,3,4")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json")
    parser.add_argument("overrides", nargs="*", help="section.field=value over the preset")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("search_lanes.py needs CUDA: it times whole-search CUDA graphs on concurrent streams")
    config = config_lib.load(args.preset, args.overrides)
    rows = []
    for bucket in (int(b) for b in args.buckets.split(",")):
        base = None
        for lanes in (int(n) for n in args.lanes.split(",")):
            runners = lane_runners(config, bucket, lanes)
            seconds = time_rounds(runners, bucket, args.rounds)
            roots = lanes * bucket / seconds
            base = base or roots
            rows.append({"bucket": bucket, "lanes": lanes, "ms_per_round": 1e3 * seconds, "roots_per_s": roots,
                         "speedup": roots / base})
            print(f"bucket {bucket:5d}  lanes {lanes}  {1e3 * seconds:7.2f} ms a round  {roots:9,.0f} roots/s  "
                  f"x{roots / base:.2f}", flush=True)
            del runners
            torch.cuda.empty_cache()
    write_json(args.json, "search_lanes", {"preset": args.preset, "overrides": args.overrides,
                                           "simulations": config.search.num_simulations, "rows": rows})


if __name__ == "__main__":
    main()
