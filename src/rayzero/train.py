"""The driver loop: starts the roles, keeps the self-play-to-learning ratio, evaluates, checkpoints, logs.

The driver never sleeps to poll: it waits on the futures of whichever roles are busy (`ray.wait`) and
schedules the next piece of work from the counters. Self-play runs while the learner keeps up
(learner samples >= replay_ratio * env steps, minus a slack); the learner runs while it is behind.
"""

from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray

from rayzero import cluster
from rayzero.config import Config, to_yaml
from rayzero.envs import env_spec
from rayzero.learner import checkpoint as ckpt
from rayzero.replay.buffer import diagnostic_means
from rayzero.storage import RunStorage


class Interrupted(Exception):
    pass


def temperature_at(schedule: tuple[tuple[int, float], ...], learner_steps: int) -> float:
    value = schedule[0][1] if schedule else 1.0
    for step, temperature in schedule:
        if learner_steps >= step:
            value = temperature
    return value


class MetricsLog:
    """metrics.jsonl, TensorBoard scalars and the learning-curve plot of one run dir."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = run_dir
        self.file = open(run_dir / "metrics.jsonl", "a")
        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, row: dict[str, Any]) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        step = int(row.get("env_steps", 0))
        for key, value in row.items():
            if isinstance(value, (int, float)) and key not in ("env_steps", "time"):
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.file.close()
        self.writer.close()
        plot_learning_curve(self.run_dir)


def plot_learning_curve(run_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if line.strip()]
    evals = [r for r in rows if "eval_return_mean" in r]
    train = [r for r in rows if "train_return_mean" in r]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, x_key, label in ((axes[0], "env_steps", "env steps"), (axes[1], "wall_seconds", "wall seconds")):
        if train:
            ax.plot([r[x_key] for r in train], [r["train_return_mean"] for r in train], alpha=0.5, label="self-play")
        if evals:
            mean = np.array([r["eval_return_mean"] for r in evals])
            std = np.array([r["eval_return_std"] for r in evals])
            x = [r[x_key] for r in evals]
            ax.plot(x, mean, marker="o", label="eval (greedy)")
            ax.fill_between(x, mean - std, mean + std, alpha=0.2)
        ax.set_xlabel(label)
        ax.set_ylabel("episode return")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "learning_curve.png", dpi=100)
    plt.close(fig)


def check_resumable(run_dir: Path) -> tuple[Path, dict]:
    """The latest checkpoint and its state, or a CheckpointError naming what is missing or corrupt."""
    from safetensors import safe_open

    checkpoint = ckpt.latest(run_dir)
    state = ckpt.read_state(checkpoint)
    try:
        with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
            list(f.keys())
    except Exception as error:  # noqa: BLE001 - any failure to read is a corrupt checkpoint
        raise ckpt.CheckpointError(f"checkpoint {str(checkpoint)!r} is corrupt: model.safetensors: {error}") from None
    for key in ("learner_steps", "env_steps"):
        if key not in state:
            raise ckpt.CheckpointError(f"checkpoint {str(checkpoint)!r}: state.json lacks {key!r}")
    return checkpoint, state


class Driver:
    def __init__(self, config: Config, out: str, resume: bool):
        self.config = config
        self.storage = RunStorage(out, config.run.local_dir)
        self.run_dir = self.storage.local
        self.resume = resume
        self.spec = env_spec(config.env)
        self.env_steps = 0
        self.learner_steps = 0
        self.episodes = 0
        self.reanalysed = 0  # positions re-searched by reanalyse workers in this run
        self.wall_before = 0.0
        self.last_eval: dict[str, Any] | None = None
        self.best_eval = -math.inf
        self.train_returns: list[float] = []
        self.last_metrics: dict[str, float] = {}
        self.stop_reason = ""
        self.solved_weights: Any = None
        self.interrupt_requested = False  # set by Ctrl-C (SIGINT)
        self.learner_version = 0  # of the weights the learner last published
        self.acting_versions: dict[int, int] = {}  # self-play actor -> weight version of its last collect
        self.replay_stats_before: dict | None = None  # replay diagnostics at the previous progress row

    # -- checkpoints -----------------------------------------------------------------------------------

    def save_checkpoint(self, handles: cluster.Handles) -> Path:
        staging = ckpt.staging_dir(self.run_dir, self.learner_steps)
        ray.get([handles.learner.save.remote(str(staging)), *handles.replay.snapshot(staging)])
        counters = ray.get(handles.learner.counters.remote())
        self.learner_steps = counters["learner_steps"]
        state = {
            "env_steps": self.env_steps, "learner_steps": counters["learner_steps"], "version": counters["version"],
            "episodes": self.episodes, "wall_seconds": self.wall_before + time.perf_counter() - self.start,
            "env_id": self.config.env.id, "best_eval_return": None if self.best_eval == -math.inf else self.best_eval,
        }
        path = ckpt.commit(self.run_dir, staging, counters["learner_steps"], state)
        self.storage.sync()
        return path

    # -- the loop --------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        config, run_dir = self.config, self.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        checkpoint = None
        if self.resume:
            self.storage.fetch()
            checkpoint, state = check_resumable(run_dir)
            self.env_steps, self.learner_steps = state["env_steps"], state["learner_steps"]
            self.episodes, self.wall_before = state.get("episodes", 0), state.get("wall_seconds", 0.0)
            if state.get("best_eval_return") is not None:
                self.best_eval = state["best_eval_return"]
        (run_dir / "config.yaml").write_text(to_yaml(config))
        how = cluster.connect(config.cluster)
        print(f"rayzero: Ray {how}, resources {ray.cluster_resources()}", flush=True)
        self.start = time.perf_counter()
        handles = cluster.build(config, self.spec)
        self.env_steps_at_start, self.learner_steps_at_start = self.env_steps, self.learner_steps
        self.replay_at_start = {"size": 0, "total_added": 0}
        if checkpoint is not None:
            ray.get([handles.learner.load.remote(str(checkpoint)), *handles.replay.restore(checkpoint)])
            self.replay_at_start = handles.replay.stats()
            print(f"rayzero: resumed from {checkpoint} at env_steps={self.env_steps} "
                  f"learner_steps={self.learner_steps}, replay {self.replay_at_start['size']} transitions", flush=True)
        self.replay_transitions = self.replay_at_start["total_added"]
        log = MetricsLog(run_dir)
        previous_term = signal.signal(signal.SIGTERM, self._on_sigterm)
        previous_int = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            self._loop(handles, log)
        except (KeyboardInterrupt, Interrupted):
            self.stop_reason = "interrupted"
            print("\nrayzero: interrupted; writing a checkpoint and the summary", flush=True)
        finally:
            signal.signal(signal.SIGTERM, previous_term)
            signal.signal(signal.SIGINT, previous_int)
        summary = self._finish(handles, log)
        return summary

    def _on_sigterm(self, *_: Any) -> None:
        raise Interrupted()

    def _on_sigint(self, *_: Any) -> None:
        """Ctrl-C: the loop stops at its next turn (within a second or so), lets in-flight work finish and writes
        a checkpoint; a flag rather than an exception, so no library call in between can swallow it. A second
        Ctrl-C raises at once."""
        if self.interrupt_requested:
            raise KeyboardInterrupt
        self.interrupt_requested = True

    def _loop(self, handles: cluster.Handles, log: MetricsLog) -> None:
        config = self.config
        run, learner_cfg, replay_cfg = config.run, config.learner, config.replay
        num_envs = config.env.num_envs
        collect_env_steps = run.selfplay_steps_per_call * num_envs
        slack = learner_cfg.replay_ratio * max(replay_cfg.min_size, 2 * collect_env_steps * len(handles.selfplay))
        ranks = config.cluster.num_learners  # each rank trains on its own batch of batch_size
        samples_per_call = learner_cfg.steps_per_call * learner_cfg.batch_size * ranks
        weights = handles.learner.weights.remote()
        if handles.inference is not None:
            ray.get(handles.inference.set_weights.remote(*ray.get(weights)))
        pending: dict[Any, tuple[str, int]] = {}
        self.actors = dict(enumerate(handles.selfplay))
        self.active: set[int] = set()  # actors that have delivered at least one collect
        next_index = len(self.actors)
        losses_in_a_row = 0
        busy: set[int] = set()
        learner_busy = eval_busy = False
        reanalyse_cfg = config.reanalyse
        reanalysing: set[int] = set()
        reanalyse_calls = 0
        shards_filled = len(handles.replay) == 1
        next_eval = time.perf_counter() + run.eval_interval
        next_log = time.perf_counter() + run.log_interval
        next_checkpoint = (self.learner_steps // learner_cfg.checkpoint_interval + 1) * learner_cfg.checkpoint_interval
        env_steps_at_start = self.env_steps
        learner_steps_at_start = self.learner_steps
        start = self.start
        # Transitions the ratio does not count: what self-play added while the learner's first call (and its
        # compilation) ran, so the learner does not start a minute behind with self-play stalled.
        ratio_base = 0.0

        while True:
            now = time.perf_counter()
            elapsed = now - start
            if self.interrupt_requested:
                self.stop_reason = "interrupted"
                print("\nrayzero: interrupted; finishing in-flight work, then a checkpoint and the summary", flush=True)
            elif run.time_limit and elapsed >= run.time_limit:
                self.stop_reason = "time_limit"
            elif run.max_env_steps and self.env_steps >= run.max_env_steps:
                self.stop_reason = "max_env_steps"
            elif run.max_learner_steps and self.learner_steps >= run.max_learner_steps:
                self.stop_reason = "max_learner_steps"
            if self.stop_reason:
                break
            learner_samples = self.learner_steps * learner_cfg.batch_size * ranks
            # Ratio of learner samples to transitions that reached replay (env steps still in an actor's
            # segment buffer cannot be trained on yet).
            target = learner_cfg.replay_ratio * (self.replay_transitions - ratio_base)
            learner_ready = self.replay_transitions >= max(1, replay_cfg.min_size)
            if learner_ready and not shards_filled:  # every rank's shard must hold something to sample
                shards_filled = learner_ready = handles.replay.all_sampleable()
            # Schedule self-play while the learner keeps up (always, until replay can feed the learner).
            temperature = temperature_at(run.temperature_schedule, self.learner_steps)
            # Until the learner's first call returns (its compilation can take a minute) self-play runs freely.
            throttle = learner_ready and self.learner_steps > learner_steps_at_start
            for i, actor in list(self.actors.items()):
                if i not in busy and (not throttle or target <= learner_samples + slack):
                    ref = actor.collect.remote(run.selfplay_steps_per_call, temperature, weights)
                    pending[ref] = ("collect", i)
                    busy.add(i)
            # Schedule the learner while it is behind.
            if not learner_busy and learner_ready and learner_samples < target + samples_per_call:
                pending[handles.learner.train.remote(handles.replay.for_learner(), learner_cfg.steps_per_call)] = ("learn", 0)
                learner_busy = True
            # Reanalyse while it is behind its share of the samples trained on (round-robin over shards).
            for i, worker in enumerate(handles.reanalyse):
                if i not in reanalysing and learner_ready and self.reanalysed < reanalyse_cfg.fraction * learner_samples:
                    shard = handles.replay.actors[reanalyse_calls % len(handles.replay)]
                    reanalyse_calls += 1
                    pending[worker.reanalyse.remote(shard, weights, reanalyse_cfg.batch_size)] = ("reanalyse", i)
                    reanalysing.add(i)
            if not eval_busy and now >= next_eval and self.learner_steps > 0:
                eval_weights = weights
                ref = handles.evaluator.evaluate.remote(weights, run.eval_episodes, run.eval_max_steps,
                                                        run.seed + 10_000)
                pending[ref] = ("eval", 0)
                eval_busy = True
            # At most a second, so a Ctrl-C (a flag, see _on_sigint) is noticed promptly.
            timeout = max(0.01, min(next_log, next_eval, time.perf_counter() + 1.0) - time.perf_counter())
            if run.time_limit:
                timeout = min(timeout, max(0.01, start + run.time_limit - time.perf_counter()))
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            for ref in ready:
                kind, index = pending.pop(ref)
                if kind == "collect":
                    busy.discard(index)
                    try:
                        result = ray.get(ref)
                    except ray.exceptions.RayActorError as error:
                        # Its node went away (or it crashed): replace it; the new one starts wherever there is
                        # room, or waits pending until a node joins. Segments already sent stay in replay.
                        losses_in_a_row += 1
                        if losses_in_a_row > 2 * len(self.actors) + 2:
                            # Actors die as fast as they are made: a bug or a bad env, not a lost node.
                            raise RuntimeError(f"self-play actors keep failing; last error: {error}") from error
                        lost = self.actors.pop(index)
                        self.active.discard(index)
                        ray.kill(lost, no_restart=True)
                        self.actors[next_index] = cluster.make_selfplay(
                            config, handles.plan, handles.replay, handles.inference, next_index)
                        print(f"rayzero: self-play actor {index} lost ({type(error).__name__}); "
                              f"replaced by actor {next_index}", flush=True)
                        next_index += 1
                        continue
                    self.active.add(index)
                    self.acting_versions[index] = result["version"]
                    losses_in_a_row = 0
                    self.env_steps += result["env_steps"]
                    self.replay_transitions += result["transitions_sent"]
                    self.episodes += len(result["episode_returns"])
                    self.train_returns.extend(result["episode_returns"])
                elif kind == "learn":
                    learner_busy = False
                    result = ray.get(ref)
                    if result["learner_steps"] < self.learner_steps:
                        print(f"rayzero: the learner group restarted from its last checkpoint "
                              f"(learner steps {self.learner_steps} -> {result['learner_steps']})", flush=True)
                    if self.learner_steps == learner_steps_at_start:  # the first call of this run
                        samples = result["learner_steps"] * learner_cfg.batch_size * ranks
                        ratio_base = max(0.0, self.replay_transitions - samples / learner_cfg.replay_ratio)
                    self.learner_steps = result["learner_steps"]
                    self.learner_version = result["version"]
                    self.last_metrics = {k: v for k, v in result.items() if isinstance(v, float)}
                    weights = handles.learner.weights.remote()
                    if handles.inference is not None:
                        handles.inference.set_weights.remote(*ray.get(weights))
                    if self.learner_steps >= next_checkpoint:
                        self.save_checkpoint(handles)
                        next_checkpoint += learner_cfg.checkpoint_interval
                elif kind == "reanalyse":
                    reanalysing.discard(index)
                    try:
                        self.reanalysed += ray.get(ref)["positions"]
                    except ray.exceptions.RayActorError as error:  # Ray restarts the worker; the loop goes on
                        print(f"rayzero: reanalyse worker {index} failed ({type(error).__name__}); retrying",
                              flush=True)
                else:
                    eval_busy = False
                    result = ray.get(ref)
                    self._record_eval(result, log)
                    next_eval = time.perf_counter() + run.eval_interval
                    if run.stop_return and result["mean"] >= run.stop_return:
                        self.stop_reason = "stop_return"
                        self.solved_weights = eval_weights
            if time.perf_counter() >= next_log:
                self._log_progress(log, env_steps_at_start, learner_steps_at_start, handles)
                next_log = time.perf_counter() + run.log_interval
        # Let in-flight work end cleanly, so the learner and replay are consistent for the checkpoint. A collect
        # of an actor that never started (pending until a node with room joins) would never end: not waited for.
        waited = [ref for ref, (kind, i) in pending.items() if kind != "collect" or i in self.active]
        if waited:
            ray.wait(waited, num_returns=len(waited), timeout=120)
            for ref, (kind, _) in pending.items():
                try:
                    result = ray.get(ref, timeout=0)
                except Exception:  # noqa: BLE001 - work cut off at shutdown is dropped
                    continue
                if kind == "collect":
                    self.env_steps += result["env_steps"]
                    self.episodes += len(result["episode_returns"])
                elif kind == "learn":
                    self.learner_steps = result["learner_steps"]
                elif kind == "reanalyse":
                    self.reanalysed += result["positions"]
        if self.solved_weights is not None:
            # The learner ran on while the deciding evaluation played; keep the weights that met the bar,
            # so the checkpoint and the summary describe the same agent.
            ray.get(handles.learner.set_weights.remote(*ray.get(self.solved_weights)))

    def _record_eval(self, result: dict[str, Any], log: MetricsLog) -> None:
        self.last_eval = result
        self.best_eval = max(self.best_eval, result["mean"])
        log.write({
            "time": time.time(), "wall_seconds": self.wall_before + time.perf_counter() - self.start,
            "env_steps": self.env_steps, "learner_steps": self.learner_steps, "version": result["version"],
            "eval_return_mean": result["mean"], "eval_return_std": result["std"],
            "eval_episodes": len(result["returns"]),
            **{f"eval_{key}": result[key] for key in ("seconds", "steps", "last_version") if key in result},
        })
        print(f"rayzero: eval v{result['version']}: {result['mean']:.1f} ± {result['std']:.1f} "
              f"over {len(result['returns'])} episodes", flush=True)

    def _log_progress(self, log: MetricsLog, env0: int, learn0: int, handles: cluster.Handles) -> None:
        elapsed = time.perf_counter() - self.start
        recent = self.train_returns[-20:]
        row = {
            "time": time.time(), "wall_seconds": self.wall_before + elapsed, "env_steps": self.env_steps,
            "selfplay_actors_active": len(self.active), "replay_transitions": self.replay_transitions,
            "learner_steps": self.learner_steps, "env_steps_per_second": (self.env_steps - env0) / elapsed,
            "learner_steps_per_second": (self.learner_steps - learn0) / elapsed, "episodes": self.episodes,
            "reanalysed": self.reanalysed,
            **self.last_metrics,
        }
        if recent:
            row["train_return_mean"] = float(np.mean(recent))
        acting = [self.acting_versions[i] for i in self.active if i in self.acting_versions]
        if acting:  # how many published versions behind the learner self-play acts
            row["selfplay_version_lag"] = float(self.learner_version - np.mean(acting))
        try:
            replay_stats = handles.replay.stats(timeout=10)
            row["replay_size"] = replay_stats["size"]
            row.update(diagnostic_means(replay_stats, self.replay_stats_before))
            self.replay_stats_before = replay_stats
        except ray.exceptions.GetTimeoutError:
            pass
        log.write(row)
        last = f"{self.last_eval['mean']:.1f}" if self.last_eval else "-"
        train = f"{row.get('train_return_mean', float('nan')):.1f}"
        print(f"[{elapsed:6.0f}s] env steps {self.env_steps:>9,d} ({row['env_steps_per_second']:.0f}/s)  "
              f"learner steps {self.learner_steps:>7,d} ({row['learner_steps_per_second']:.1f}/s)  "
              f"train return {train}  eval {last}", flush=True)

    def _finish(self, handles: cluster.Handles, log: MetricsLog) -> dict[str, Any]:
        run = self.config.run
        final_weights = handles.learner.weights.remote()
        version = ray.get(final_weights)[0]
        if self.last_eval is None or self.last_eval["version"] != version or \
                len(self.last_eval["returns"]) != run.eval_episodes:
            result = ray.get(handles.evaluator.evaluate.remote(final_weights, run.eval_episodes, run.eval_max_steps,
                                                               run.seed + 10_000))
            self._record_eval(result, log)
        path = self.save_checkpoint(handles)
        replay_stats = handles.replay.stats()
        wall = self.wall_before + time.perf_counter() - self.start
        summary = {
            "env_id": self.config.env.id,
            "env_steps": self.env_steps,
            "learner_steps": self.learner_steps,
            "wall_seconds": wall,
            "eval_return_mean": self.last_eval["mean"],
            "eval_return_std": self.last_eval["std"],
            "eval_episodes": len(self.last_eval["returns"]),
            "eval_returns": self.last_eval["returns"],
            "best_eval_return": self.best_eval,
            "episodes": self.episodes,
            "reanalysed_this_run": self.reanalysed,
            "weights_version": version,
            "checkpoint": str(path),
            "stop_reason": self.stop_reason,
            "env_steps_this_run": self.env_steps - self.env_steps_at_start,
            "learner_steps_this_run": self.learner_steps - self.learner_steps_at_start,
            "replay_size": replay_stats["size"],
            "replay_total_added": replay_stats["total_added"],
            "replay_size_at_start": self.replay_at_start["size"],
            "replay_total_added_at_start": self.replay_at_start["total_added"],
            "seed": run.seed,
        }
        tmp = self.run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2))
        tmp.replace(self.run_dir / "summary.json")
        log.close()
        self.storage.sync()
        print(f"rayzero: done ({self.stop_reason}): {self.env_steps:,d} env steps, {self.learner_steps:,d} learner "
              f"steps in {wall:.0f}s; eval {summary['eval_return_mean']:.1f} ± {summary['eval_return_std']:.1f}",
              flush=True)
        return summary


def train(config: Config, out: str | Path, resume: bool = False) -> dict[str, Any]:
    """Train; `out` is a run directory or a storage URI (s3://, gs://, file://)."""
    return Driver(config, str(out), resume).run()
