"""Benchmark of the learner: samples/s and steps/s in the real loop and bare, on 1, 2 (and 4) GPUs.

Real loop: a replay actor (shared-memory observations) filled with synthetic Atari-sized segments
(12x96x96 uint8 observations, 18 actions, K=5, n=5); the learner actor, or a `LearnerGroup` of N DDP ranks,
runs `train(replay, 50)` calls: every rank samples its own batches from its replay shard (one shard per rank,
as `replay.shards=0` gives in training), gathers the observations into pinned memory and copies them to its
GPU ahead of the update, sends priorities back; after each call the driver fetches the published weights
(`weights()`), as the training driver does.
Bare: `bench_steps` in the same learner process on one batch kept on the device (no sampling, no Ray calls
in the loop), so the two rows show what the data path costs. Net: the EfficientZero-sized ResNet of
ANCHORS.md (64 channels, 1 block, 601-bin supports), AdamW, bf16 autocast, torch.compile on CUDA (by default
with CUDA graphs, learner.compile_mode).

Reanalyse: positions per second that one reanalyse worker re-searches (50 simulations, batches 256 and 1024)
on one GPU, in the driver process after the learner rows.

Rows per (GPUs, batch per GPU) for batch 1024 and 256; on GPUs also the NHWC layout and an eager bare row at
1024 on one GPU. Scaling efficiency = samples/s on N GPUs / (N x samples/s on one), same per-GPU batch.
--quick: CPU sized (3x32x32 observations, a 16-channel net, batch 16 and 32, 1 and 2 gloo ranks), < 60 s.
Options for short device sessions: --batches, --compile-mode, --no-alternatives, --overlap (the 2-GPU group
compiles together with the 1-GPU learner), --short, --capacity. `--preset atari [overrides]`: only the real loop
and bare step of that preset's own learner (target network and all), the reference a training run's learner is
compared with; where the preset colocates the learner with the inference actor (one GPU), in that actor's process
as training runs it (--colocated yes/no forces either).

Run: `rayzero bench learner [--quick] [--json PATH]` or `python -m rayzero.bench.learner [options]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import numpy as np
import ray

from rayzero.bench.common import write_json
from rayzero.cluster.plan import learner_ranks
from rayzero.config import LearnerConfig, ModelConfig, ReplayConfig
from rayzero.learner.group import PER_RANK, LearnerGroup
from rayzero.learner.learner import Learner
from rayzero.replay.buffer import ReplayBuffer, Segment


SETTLE_CALLS = 2  # untimed train calls before each real-loop measurement


@dataclasses.dataclass(frozen=True)
class Sizes:
    obs_shape: tuple[int, ...]
    num_actions: int
    model: ModelConfig
    batches: tuple[int, ...]
    capacity: int
    steps_per_call: int
    timed_calls: int
    bare_steps: int
    budget_s: float  # stop starting new configurations after this long


FULL = Sizes((12, 96, 96), 18, ModelConfig(kind="resnet", channels=64, blocks=1, support_size=300), (1024, 256),
             capacity=50_000, steps_per_call=50, timed_calls=3, bare_steps=40, budget_s=320.0)
QUICK = Sizes((3, 32, 32), 4, ModelConfig(kind="resnet", channels=16, blocks=1, support_size=10,
                                          reduced_channels=4, head_hidden=16),
              (16, 32), capacity=3_000, steps_per_call=3, timed_calls=2, bare_steps=3, budget_s=45.0)


class SyntheticReplay(ReplayBuffer):
    """A replay buffer that fills itself with random segments (no transfer of gigabytes through Ray)."""

    def fill(self, obs_shape: tuple[int, ...], num_actions: int, length: int = 200, seed: int = 0) -> dict:
        rng = np.random.default_rng(seed)
        blocks = [rng.integers(0, 256, size=(length, *obs_shape), dtype=np.uint8) for _ in range(4)]
        for i in range(self.capacity // length):
            self.add(Segment(
                obs=blocks[i % len(blocks)],
                actions=rng.integers(0, num_actions, size=length),
                rewards=rng.normal(size=length).astype(np.float32),
                policies=rng.dirichlet(np.ones(num_actions), size=length).astype(np.float32),
                root_values=rng.normal(size=length).astype(np.float32),
                num_sampleable=length - 10, terminal=False, bootstrap_value=0.5,
            ))
        return {**self.stats(), "shared": self.shared_paths is not None}

    def fill_from_env(self, env_cfg: Any, num_actions: int, length: int = 200, seed: int = 0,
                      num_envs: int = 16) -> dict:
        """Segments of real frames: the env (a preset's game, its preprocessing) played with random actions, so
        the learner trains on what a run feeds it rather than noise (search targets stay synthetic)."""
        from rayzero.envs import make_vector_env

        rng = np.random.default_rng(seed)
        env = make_vector_env(env_cfg, num_envs, seed, training=True)
        try:
            obs = env.reset()
            segments = self.capacity // length
            while segments > 0:
                frames = np.empty((length, *obs.shape), dtype=obs.dtype)
                rewards = np.empty((length, num_envs), dtype=np.float32)
                actions = rng.integers(0, num_actions, size=(length, num_envs))
                for t in range(length):
                    frames[t] = obs
                    step = env.step(actions[t])
                    obs, rewards[t] = step.obs, step.reward
                for e in range(min(num_envs, segments)):
                    self.add(Segment(
                        obs=np.ascontiguousarray(frames[:, e]), actions=actions[:, e], rewards=rewards[:, e],
                        policies=rng.dirichlet(np.ones(num_actions), size=length).astype(np.float32),
                        root_values=np.zeros(length, np.float32), num_sampleable=length - 10, terminal=False,
                        bootstrap_value=0.0,
                    ))
                    segments -= 1
        finally:
            env.close()
        return {**self.stats(), "shared": self.shared_paths is not None, "frames": "env"}


def _learner_cfg(batch: int, gpu: bool, v: Variant) -> LearnerConfig:
    return LearnerConfig(batch_size=batch, lr=1e-3, lr_warmup_steps=100, device="cuda" if gpu else "cpu",
                         compile=v.compile, compile_mode=v.compile_mode, channels_last=v.channels_last,
                         steps_per_call=50, grad_sync=v.grad_sync, prefetch=v.prefetch, manual_gc=v.manual_gc)


@dataclasses.dataclass(frozen=True)
class Variant:
    batch: int
    compile: bool | None = None  # None: the default (on for CUDA)
    channels_last: bool = False
    compile_mode: str = LearnerConfig.compile_mode
    bare_only: bool = False
    grad_sync: str = LearnerConfig.grad_sync  # of groups (learner.grad_sync)
    prefetch: int = LearnerConfig.prefetch
    manual_gc: bool = LearnerConfig.manual_gc

    def label(self) -> str:
        parts = []
        if self.compile is False:
            parts.append("eager")
        else:
            parts.append(self.compile_mode)
        parts.append("nhwc" if self.channels_last else "nchw")
        return "+".join(parts)


def _start(sizes: Sizes, world: int, v: Variant, gpu: bool, gpu_share: float = 1.0) -> Any:
    """A learner actor (world 1, `gpu_share` of a GPU) or a LearnerGroup (`gpu_share` of a GPU per rank)."""
    args = (sizes.model, _learner_cfg(v.batch, gpu, v), sizes.obs_shape, sizes.num_actions, 0, 1)
    if world == 1:
        return ray.remote(Learner).options(num_cpus=0, num_gpus=gpu_share if gpu else 0).remote(*args)
    ranks = learner_ranks(world, cpus=0.0, gpus=gpu_share if gpu else 0.0)
    return ray.remote(LearnerGroup).options(**ranks.facade_options).remote(
        *args, bundles=ranks.bundles, rank_options=ranks.rank_options
    )


def _stop(learner: Any) -> None:
    try:
        ray.get(learner.close.remote(), timeout=30)
    except Exception:  # noqa: BLE001 - best effort
        pass
    ray.kill(getattr(learner, "actor", learner))  # a LearnerHandle's actor (colocated), or the learner actor


def _bare(sizes: Sizes, learner: Any, replay: Any, batch: int, steps: int) -> dict[str, Any]:
    one = replay[0] if isinstance(replay, list) else replay
    bare = ray.get(learner.bench_steps.remote(one.sample.remote(batch), steps))
    return {"bare_samples_per_second": bare["samples_per_second"], "bare_steps_per_second": bare["steps_per_second"],
            "bare_ms_per_step": bare["ms_per_step"], "compile": bare["compile"]}


def _timed_calls(learner: Any, replay: Any, world: int, steps: int, calls: int) -> dict[str, Any]:
    """`calls` train calls of `steps` steps, each followed by a weight fetch as the driver does; wall time and
    where it went, per call and per rank."""
    per_rank = {key: np.zeros(world) for key in PER_RANK}
    call_ms, weights_ms = [], []
    start = time.perf_counter()
    for _ in range(calls):
        t0 = time.perf_counter()
        result = ray.get(learner.train.remote(replay, steps))
        t1 = time.perf_counter()
        ray.get(learner.weights.remote())  # weight publication, as the driver does after every call
        call_ms.append(round(1e3 * (t1 - t0), 2))
        weights_ms.append(round(1e3 * (time.perf_counter() - t1), 2))
        for key in per_rank:
            per_rank[key] += result.get(f"{key}_per_rank", [result.get(key, 0.0)])
    elapsed = time.perf_counter() - start
    total = calls * steps
    return {
        "result": result, "elapsed": elapsed, "steps": total,
        "call_ms": call_ms, "weights_ms": weights_ms,
        # Per rank, ms per step: the training thread waiting for a prepared batch; automatic garbage collections
        # during the calls (0 with learner.manual_gc); launching the steps; the whole call as the rank saw it.
        "input_wait_ms_per_step": [round(float(1e3 * w / total), 3) for w in per_rank["input_wait_s"]],
        "gc_ms_per_step": [round(float(g / total), 3) for g in per_rank["gc_ms"]],
        "launch_ms_per_step": [round(float(1e3 * w / total), 3) for w in per_rank["launch_s"]],
        "rank_call_ms_per_step": [round(float(1e3 * w / total), 3) for w in per_rank["call_s"]],
        "manual_gc_ms_per_call": [round(float(g / calls), 3) for g in per_rank["manual_gc_ms"]],
    }


def _measure(sizes: Sizes, learner: Any, replay: Any, world: int, v: Variant,
             long_calls: int = 0) -> dict[str, Any]:
    row: dict[str, Any] = {"gpus": world, "batch_per_gpu": v.batch, "global_batch": v.batch * world,
                           "variant": v.label(), "prefetch": v.prefetch, "manual_gc": v.manual_gc,
                           **({"grad_sync": v.grad_sync} if world > 1 else {})}
    if not v.bare_only:
        steps = sizes.steps_per_call
        # Untimed calls first, so a device observation cache (learner.obs_cache) holds most of the replay, as
        # it does in a long run where only new positions are copied up.
        for _ in range(SETTLE_CALLS):  # (with the weight fetch: its first one is slow, see run 9 in the docs)
            ray.get(learner.train.remote(replay, steps))
            ray.get(learner.weights.remote())
        timed = _timed_calls(learner, replay, world, steps, sizes.timed_calls)
        result = timed.pop("result")
        elapsed, loop_steps = timed.pop("elapsed"), timed.pop("steps")
        row.update({
            "loop_samples_per_second": loop_steps * v.batch * world / elapsed,
            "loop_steps_per_second": loop_steps / elapsed,
            "loop_ms_per_step": 1e3 * elapsed / loop_steps,
            **timed,
            "obs_path": result.get("obs_path"), "stale_samples": result.get("stale_samples", 0.0),
            "obs_cache_uploaded": result.get("obs_cache_uploaded"),
        })
        if long_calls:  # the same learner with fewer, longer calls: how much of the loop's cost is per call
            timed = _timed_calls(learner, replay, world, long_calls, 1)
            timed.pop("result")
            elapsed, loop_steps = timed.pop("elapsed"), timed.pop("steps")
            row["long_calls"] = {"steps_per_call": long_calls,
                                 "loop_samples_per_second": loop_steps * v.batch * world / elapsed,
                                 "loop_ms_per_step": 1e3 * elapsed / loop_steps, **timed}
    row.update(_bare(sizes, learner, replay, v.batch, sizes.bare_steps))
    if "loop_samples_per_second" in row:
        row["loop_over_bare"] = row["loop_samples_per_second"] / row["bare_samples_per_second"]
    return row


def run(sizes: Sizes, gpu: bool, worlds: list[int], progress: Any = None,
        compile_mode: str = LearnerConfig.compile_mode,
        alternatives: bool = True, overlap: bool = False,
        grad_syncs: tuple[str, ...] = (LearnerConfig.grad_sync,),
        prefetches: tuple[int, ...] = (LearnerConfig.prefetch,),
        manual_gcs: tuple[bool, ...] = (LearnerConfig.manual_gc,), long_calls: int = 0) -> dict[str, Any]:
    """All rows; `progress(partial results)` after each one (a run cut off still leaves its figures).

    alternatives: also the other memory layout and an eager bare row at the largest batch (GPU).
    overlap: start the multi-GPU group (ranks on 0.6 of a GPU each) together with the one-GPU learners (0.4),
    so all compile at once; each is then measured while the others idle (one batch size, 2 GPUs).
    grad_syncs x prefetches x manual_gcs: the multi-GPU groups' learner.grad_sync, .prefetch and .manual_gc
    variants (with overlap the first starts with the one-GPU learners, the others after them; one-GPU rows for
    each prefetch and manual_gc).
    """
    began = time.perf_counter()
    replay_cfg = ReplayConfig(capacity=sizes.capacity, unroll_steps=5, td_steps=5, min_size=0, shared_obs=True)
    # One shard per rank of the largest group (each of the full capacity, filled in parallel); the one-GPU
    # rows sample shard 0, a group of w ranks shards 0..w-1.
    shards = [ray.remote(SyntheticReplay).options(num_cpus=0).remote(replay_cfg, i) for i in range(max(worlds))]
    replay = shards[0]
    filled_all = [shard.fill.remote(sizes.obs_shape, sizes.num_actions, seed=i) for i, shard in enumerate(shards)]
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    total_gpus = int(ray.cluster_resources().get("GPU", 0)) if gpu else 0

    def report(row: dict[str, Any]) -> None:
        rows.append(row)
        print(_row_text(row), flush=True)
        if progress is not None:
            progress({"rows": rows, "notes": notes, "partial": True})

    def over_budget(what: str) -> bool:
        if time.perf_counter() - began > sizes.budget_s:
            notes.append(f"skipped {what}: over the {sizes.budget_s:.0f}s budget")
            print(notes[-1], flush=True)
            return True
        return False

    # One GPU each: every variant's learner starts at once (sharing GPUs while they compile, which is CPU work);
    # they are then measured one at a time while the others idle.
    variants = [Variant(b, compile_mode=compile_mode, prefetch=p, manual_gc=m)
                for b in sizes.batches for p in prefetches for m in manual_gcs]
    if gpu and alternatives:
        top = max(sizes.batches)
        variants += [Variant(top, channels_last=True, compile_mode=compile_mode),
                     Variant(top, compile=False, bare_only=True)]
    overlapped: list[tuple[int, Variant, Any]] = []
    if overlap and gpu and total_gpus == 2 and 2 in worlds and len(sizes.batches) == 1:
        # (Only the first grad_sync variant: ranks of two groups at 0.3 each could land on one GPU.)
        share = 0.4 / len(variants)  # the one-GPU learners may all land on one GPU beside a group rank (0.6)
        v = Variant(sizes.batches[0], compile_mode=compile_mode, grad_sync=grad_syncs[0], prefetch=prefetches[0],
                    manual_gc=manual_gcs[0])
        overlapped.append((2, v, _start(sizes, 2, v, gpu, 0.6)))
    else:
        share = 1.0 / -(-len(variants) // max(1, total_gpus)) if gpu else 0.0
    learners = {v: _start(sizes, 1, v, gpu, share) for v in variants}
    fill_info = ray.get(filled_all)[0]
    print(f"replay filled: {fill_info} in {time.perf_counter() - began:.1f}s", flush=True)
    t0 = time.perf_counter()
    warm = {v: (learners[v].bench_steps.remote(replay.sample.remote(v.batch), 1, 1) if v.bare_only
                else learners[v].train.remote(replay, sizes.steps_per_call)) for v in variants}
    warm_groups = [g.train.remote(shards[:world], sizes.steps_per_call) for world, _, g in overlapped]
    for v in variants:
        try:
            info = ray.get(warm[v])
            print(f"1 x {v.batch} {v.label()}: warm at {time.perf_counter() - t0:.1f}s (compile {info['compile']})",
                  flush=True)
        except Exception as error:  # noqa: BLE001 - reported, the other variants go on
            notes.append(f"1 x {v.batch} {v.label()} failed: {type(error).__name__}: {str(error)[:2000]}")
            print(notes[-1], flush=True)
            learners.pop(v)
    if warm_groups:  # the overlapped group shares GPU 0: let its warm-up end before timing one GPU
        ready, _ = ray.wait(warm_groups, num_returns=len(warm_groups), timeout=300)
        if len(ready) < len(warm_groups):
            notes.append("the overlapped group was not warm after 300 s (placement or compilation); timing anyway")
            print(notes[-1], flush=True)
    for v, learner in learners.items():
        report(_measure(sizes, learner, replay, 1, v, long_calls))
    for learner in learners.values():
        _stop(learner)
    for (world, v, group), ref in zip(overlapped, warm_groups):
        try:
            info = ray.get(ref)
            print(f"{world} x {v.batch} {v.label()} {v.grad_sync} prefetch {v.prefetch}: warm at "
                  f"{time.perf_counter() - t0:.1f}s "
                  f"(compile {info['compile']})", flush=True)
            report(_measure(sizes, group, shards[:world], world, v, long_calls))
        except Exception as error:  # noqa: BLE001 - reported
            notes.append(f"{world} x {v.batch} {v.grad_sync} failed: {type(error).__name__}: {str(error)[:2000]}")
            print(notes[-1], flush=True)
        finally:
            _stop(group)
    # More GPUs: the faster layout at the largest batch.
    nhwc = False
    if gpu and alternatives:
        top_rows = [r for r in rows if r["gpus"] == 1 and r["batch_per_gpu"] == max(sizes.batches)
                    and "loop_samples_per_second" in r]
        if top_rows:
            nhwc = max(top_rows, key=lambda r: r["loop_samples_per_second"])["variant"].endswith("nhwc")
    done = {(world, v.batch, v.grad_sync, v.prefetch, v.manual_gc) for world, v, _ in overlapped}
    for world, b, sync, depth, manual in [(w, b, g, p, m) for w in worlds[1:] for b in sizes.batches
                                          for g in grad_syncs for p in prefetches for m in manual_gcs
                                          if (w, b, g, p, m) not in done]:
        v = Variant(b, channels_last=nhwc, compile_mode=compile_mode, grad_sync=sync, prefetch=depth,
                    manual_gc=manual)
        if over_budget(f"{world} x batch {b} {sync}"):
            continue
        t0 = time.perf_counter()
        group = None
        try:
            group = _start(sizes, world, v, gpu)
            info = ray.get(group.train.remote(shards[:world], sizes.steps_per_call))
            print(f"{world} x {b} {v.label()} {sync}: up and warm in {time.perf_counter() - t0:.1f}s "
                  f"(compile {info['compile']})", flush=True)
            report(_measure(sizes, group, shards[:world], world, v, long_calls))
        except Exception as error:  # noqa: BLE001 - reported, the other configurations go on
            notes.append(f"{world} x {b} {sync} failed: {type(error).__name__}: {str(error)[:2000]}")
            print(notes[-1], flush=True)
        finally:
            if group is not None:
                _stop(group)
    scaling = []
    for row in rows:
        if row["gpus"] > 1 and "loop_samples_per_second" in row:
            one = next((r for r in rows if r["gpus"] == 1 and r["batch_per_gpu"] == row["batch_per_gpu"]
                        and r["variant"] == row["variant"] and r["prefetch"] == row["prefetch"]
                        and r["manual_gc"] == row["manual_gc"]
                        and "loop_samples_per_second" in r), None)
            if one:
                scaling.append({
                    "gpus": row["gpus"], "batch_per_gpu": row["batch_per_gpu"], "variant": row["variant"],
                    "grad_sync": row.get("grad_sync"), "prefetch": row["prefetch"], "manual_gc": row["manual_gc"],
                    "speedup": row["loop_samples_per_second"] / one["loop_samples_per_second"],
                    "efficiency": row["loop_samples_per_second"] / (row["gpus"] * one["loop_samples_per_second"]),
                    "bare_speedup": row["bare_samples_per_second"] / one["bare_samples_per_second"],
                })
    for shard in shards:
        ray.kill(shard)
    return {"rows": rows, "scaling": scaling, "replay": fill_info, "notes": notes,
            "seconds": time.perf_counter() - began}


def preset_row(preset: str, overrides: list[str], sizes: Sizes, gpu: bool,
               colocated: bool | None = None) -> dict[str, Any]:
    """The real loop and the bare step of a preset's own learner: its learner, model and replay sections (target
    network, consistency loss, batch, steps per call) on segments of its own game played at random, on one
    whole GPU. This is the "measured alone" reference that the one-GPU-host issue compares a training run's
    learner with (observations stored whole here: replay.frame_stack=0).

    colocated (default: on a GPU where the preset sets cluster.colocate_learner): the learner runs as training
    runs it there, in a thread of the inference actor's process (`ColocatedLearner`, its own stream, the
    thread's compile mode and step graph), with no self-play, so the reference is the training's code path."""
    from rayzero import config as config_lib
    from rayzero.cluster.colocated import ColocatedLearner, LearnerHandle, thread_safe_compile
    from rayzero.envs import env_spec

    cfg = config_lib.load(preset, [*overrides, "replay.frame_stack=0", f"replay.capacity={sizes.capacity}",
                                   "replay.min_size=0", "replay.shared_obs=true"])
    spec = env_spec(cfg.env)
    device = "cuda" if gpu else "cpu"
    learner_cfg = dataclasses.replace(cfg.learner, device=device)
    colocated = gpu and cfg.cluster.colocate_learner if colocated is None else colocated
    replay = ray.remote(SyntheticReplay).options(num_cpus=0).remote(cfg.replay, 0)
    # The preset's own game, played at random, as the frames: on uniform noise the compiled step failed the
    # learner's compile check where a run's passed (docs/benchmarks.md, seventeenth session).
    filled = ray.get(replay.fill_from_env.remote(cfg.env, spec.num_actions))
    learner_args = (cfg.model, learner_cfg, spec.observation_shape, spec.num_actions, 0, 1)
    if colocated:
        inference_cfg = dataclasses.replace(cfg.inference, device=device)
        actor = ray.remote(ColocatedLearner).options(num_cpus=0, num_gpus=1 if gpu else 0,
                                                     max_concurrency=1000).remote(
            (cfg.model, inference_cfg, spec.observation_shape, spec.num_actions, 0, 1),
            {"obs_dtype": spec.observation_dtype, "search_cfg": cfg.search, "discount": cfg.replay.discount},
            learner_args)
        learner: Any = LearnerHandle(actor)
        learner_cfg = thread_safe_compile(learner_cfg)  # what the row reports: the thread's compile mode
    else:
        learner = ray.remote(Learner).options(num_cpus=0, num_gpus=1 if gpu else 0).remote(*learner_args)
    try:
        t0 = time.perf_counter()
        info = ray.get(learner.train.remote(replay, learner_cfg.steps_per_call))  # compiles and captures
        print(f"{preset} learner: warm in {time.perf_counter() - t0:.1f}s (compile {info['compile']})", flush=True)
        v = Variant(learner_cfg.batch_size, compile=learner_cfg.compile, compile_mode=learner_cfg.compile_mode,
                    channels_last=learner_cfg.channels_last, prefetch=learner_cfg.prefetch,
                    manual_gc=learner_cfg.manual_gc)
        row = _measure(dataclasses.replace(sizes, steps_per_call=learner_cfg.steps_per_call), learner, replay, 1, v)
    finally:
        _stop(learner)
        ray.kill(replay)
    row.update({"preset": preset, "overrides": overrides, "obs_shape": list(spec.observation_shape),
                "colocated": colocated, "warm_seconds": time.perf_counter() - t0, "replay": filled,
                "target_network": learner_cfg.target_update_interval > 0,
                "consistency_weight": learner_cfg.consistency_weight})
    print("  " + _row_text(row), flush=True)
    return row


def reanalyse_rates(sizes: Sizes, gpu: bool, batches: tuple[int, ...] = (256, 1024), sims: int = 50,
                    repeats: int = 3) -> list[dict[str, Any]]:
    """Positions re-searched per second by one `ReanalyseWorker` (its `targets`: root inference plus one
    batched MuZero search of `sims` simulations), on this process's GPU or CPU, net of `sizes`."""
    import torch

    from rayzero.actors.reanalyse import ReanalyseWorker
    from rayzero.tree import SearchConfig

    device = "cuda" if gpu else "cpu"
    if not gpu:
        batches, sims, repeats = (16,), 8, 2
    worker = ReanalyseWorker(sizes.model, SearchConfig(num_simulations=sims), 0.997, sizes.obs_shape,
                             sizes.num_actions, 0, 1, device)
    rng = np.random.default_rng(0)
    rows = []
    for batch in batches:
        obs = rng.integers(0, 256, size=(batch, *sizes.obs_shape), dtype=np.uint8)
        worker.targets(obs)  # warm-up
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            worker.targets(obs)  # returns host arrays: synchronised
        seconds = (time.perf_counter() - start) / repeats
        rows.append({"device": device, "batch": batch, "simulations": sims, "ms_per_call": 1e3 * seconds,
                     "positions_per_second": batch / seconds})
        print(f"reanalyse {device} batch {batch} x {sims} sims: {1e3 * seconds:.1f} ms/call, "
              f"{batch / seconds:,.0f} positions/s", flush=True)
    return rows


def _row_text(row: dict[str, Any]) -> str:
    def f(key: str, fmt: str = "{:,.0f}") -> str:
        return fmt.format(row[key]) if key in row else "-"

    return (f"{row['gpus']} x {row['batch_per_gpu']:>5} {row.get('variant', ''):<10} loop {f('loop_samples_per_second'):>9} samples/s "
            f"({f('loop_steps_per_second', '{:.1f}')} steps/s, {f('loop_ms_per_step', '{:.1f}')} ms)  "
            f"bare {f('bare_samples_per_second'):>9} samples/s ({f('bare_ms_per_step', '{:.1f}')} ms)  "
            f"compile {row.get('compile')}  obs {row.get('obs_path', '-')}"
            + (f"  grad_sync {row['grad_sync']}" if "grad_sync" in row else "") + f"  prefetch {row['prefetch']}"
            + f"  manual_gc {row['manual_gc']}"
            + (f"  input wait {row['input_wait_ms_per_step']} ms/step" if "input_wait_ms_per_step" in row else "")
            + (f"  gc {row['gc_ms_per_step']} ms/step" if "gc_ms_per_step" in row else "")
            + (f"  launch {row['launch_ms_per_step']} ms/step  rank call {row['rank_call_ms_per_step']} ms/step"
               f"  calls {row['call_ms']} ms  weights {row['weights_ms']} ms" if "call_ms" in row else "")
            + (f"  long calls ({row['long_calls']['steps_per_call']} steps): "
               f"{row['long_calls']['loop_samples_per_second']:,.0f} samples/s, "
               f"{row['long_calls']['loop_ms_per_step']:.2f} ms/step" if "long_calls" in row else ""))


def main(quick: bool = False, json_path: str | None = None, batches: tuple[int, ...] | None = None,
         compile_mode: str = LearnerConfig.compile_mode, alternatives: bool = True, overlap: bool = False,
         capacity: int | None = None, short: bool = False,
         grad_syncs: tuple[str, ...] = (LearnerConfig.grad_sync,),
         prefetches: tuple[int, ...] = (LearnerConfig.prefetch,),
         manual_gcs: tuple[bool, ...] = (LearnerConfig.manual_gc,), long_calls: int = 0,
         timed_calls: int = 0) -> dict[str, Any]:
    """The benchmark (see the module docstring); the keyword options narrow a run (e.g. one batch size,
    CUDA graphs, everything compiling at once) when device time is short."""
    sizes = QUICK if quick else FULL
    if batches:
        sizes = dataclasses.replace(sizes, batches=tuple(batches))
    if capacity:
        sizes = dataclasses.replace(sizes, capacity=capacity)
    if short:
        sizes = dataclasses.replace(sizes, timed_calls=2, bare_steps=20)
    if timed_calls:
        sizes = dataclasses.replace(sizes, timed_calls=timed_calls)
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address="local", include_dashboard=False, log_to_driver=True, **({"num_cpus": 2} if quick else {}))
    gpus = int(ray.cluster_resources().get("GPU", 0))
    gpu = gpus >= 1 and not quick
    worlds = [1, 2] if not gpu else [w for w in (1, 2, 4) if w <= gpus]
    print(f"bench learner: {'GPU' if gpu else 'CPU'}, worlds {worlds}, batches {sizes.batches}, obs {sizes.obs_shape}, "
          f"compile mode {compile_mode}", flush=True)
    header = {"quick": quick, "device": "cuda" if gpu else "cpu", "obs_shape": list(sizes.obs_shape),
              "num_actions": sizes.num_actions, "model": dataclasses.asdict(sizes.model), "unroll_steps": 5,
              "steps_per_call": sizes.steps_per_call, "timed_calls": sizes.timed_calls, "compile_mode": compile_mode,
              "replay_capacity": sizes.capacity}

    def progress(partial: dict[str, Any]) -> None:
        if json_path:
            write_json(json_path, "learner", {**header, **partial})

    try:
        results = run(sizes, gpu, worlds, progress, compile_mode, alternatives, overlap, grad_syncs, prefetches,
                      manual_gcs, long_calls)
        results["reanalyse"] = reanalyse_rates(sizes, gpu)
    finally:
        if started_here:
            ray.shutdown()
    one_1024 = max((r for r in results["rows"] if r["gpus"] == 1 and r["batch_per_gpu"] == 1024
                    and "loop_samples_per_second" in r), key=lambda r: r["loop_samples_per_second"], default=None)
    two_1024 = max((s for s in results["scaling"] if s["gpus"] == 2 and s["batch_per_gpu"] == 1024),
                   key=lambda s: s["speedup"], default=None)
    bars = {}
    if gpu:
        bars = {
            "one_gpu_loop_1024_ge_40000": None if one_1024 is None else one_1024["loop_samples_per_second"] >= 40_000,
            "two_gpu_speedup_1024_ge_1.8": None if two_1024 is None else two_1024["speedup"] >= 1.8,
        }
    document = write_json(json_path, "learner", {**header, "bars": bars, **results})
    print("\nrows:")
    for row in results["rows"]:
        print("  " + _row_text(row))
    for s in results["scaling"]:
        print(f"  scaling {s['gpus']} x {s['batch_per_gpu']} ({s['grad_sync']}, prefetch {s['prefetch']}, "
              f"manual_gc {s['manual_gc']}): "
              f"{s['speedup']:.2f}x loop "
              f"(efficiency {s['efficiency']:.0%}), {s['bare_speedup']:.2f}x bare")
    if bars:
        print(f"  bars: {bars}")
    return document


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--batches", default="", help="comma-separated batch sizes per GPU (default 1024,256)")
    parser.add_argument("--compile-mode", default=LearnerConfig.compile_mode)
    parser.add_argument("--no-alternatives", action="store_true", help="skip the other-layout and eager rows")
    parser.add_argument("--overlap", action="store_true", help="compile the 1- and 2-GPU learners at once")
    parser.add_argument("--capacity", type=int, default=0)
    parser.add_argument("--short", action="store_true", help="2 timed calls and 20 bare steps per row")
    parser.add_argument("--grad-sync", default=LearnerConfig.grad_sync,
                        help="comma-separated learner.grad_sync variants of the multi-GPU rows (ddp, flat)")
    parser.add_argument("--prefetch", default=str(LearnerConfig.prefetch),
                        help="comma-separated learner.prefetch variants of the multi-GPU rows")
    parser.add_argument("--manual-gc", default=str(LearnerConfig.manual_gc).lower(),
                        help="comma-separated learner.manual_gc variants (true, false)")
    parser.add_argument("--long-calls", type=int, default=0,
                        help="also time one call of this many steps per row (the loop's per-call cost)")
    parser.add_argument("--timed-calls", type=int, default=0, help="timed calls per row (default 3)")
    parser.add_argument("--preset", default="",
                        help="only the real loop and bare step of this preset's own learner (e.g. atari)")
    parser.add_argument("--colocated", choices=("auto", "yes", "no"), default="auto",
                        help="with --preset: the learner in the inference actor's process, as training runs it "
                             "(auto: where the preset colocates it on a GPU)")
    parser.add_argument("overrides", nargs="*", help="with --preset: section.field=value overrides")
    args = parser.parse_args()
    if args.overrides and not args.preset:
        parser.error("overrides go with --preset")
    if args.preset:
        ray.init(address="local", include_dashboard=False, **({"num_cpus": 2} if args.quick else {}))
        try:
            gpu = int(ray.cluster_resources().get("GPU", 0)) >= 1 and not args.quick
            sizes = QUICK if args.quick else FULL
            if args.capacity:
                sizes = dataclasses.replace(sizes, capacity=args.capacity)
            colocated = {"auto": None, "yes": True, "no": False}[args.colocated]
            result = preset_row(args.preset, args.overrides, sizes, gpu, colocated)
            write_json(args.json, "learner_preset", {"quick": args.quick, "rows": [result]})
        finally:
            ray.shutdown()
        raise SystemExit(0)
    main(args.quick, args.json, tuple(int(b) for b in args.batches.split(",") if b), args.compile_mode,
         not args.no_alternatives, args.overlap, args.capacity or None, args.short,
         tuple(args.grad_sync.split(",")), tuple(int(p) for p in args.prefetch.split(",")),
         tuple(m.strip().lower() in ("1", "true", "yes", "on") for m in args.manual_gc.split(",")),
         args.long_calls, args.timed_calls)
