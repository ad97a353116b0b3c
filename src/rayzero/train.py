"""The driver: starts the roles, issues the calls that the schedule decides, records their results.

What runs next is decided in schedule.py (no Ray there); this module waits on the calls in flight (`ray.wait`,
never a sleep), records what comes back (counters, metrics, evaluations), fans the new weights out, replaces
lost self-play actors, writes checkpoints when due and, at the end, lets in-flight work finish and writes a
final checkpoint and summary.json. Ctrl-C and SIGTERM both end a run that way.

Faults it survives: a self-play actor that dies is replaced; an inference actor that dies is replaced and every
self-play actor re-pointed to the new one; a replay shard that dies is restarted by Ray from its last snapshot,
and the learner call it broke is made again. What each fault cost is in summary.json (`faults`, and
`lost_transitions` per reason, from ledger.py).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from rayzero import cluster
from rayzero.config import Config, to_yaml
from rayzero.envs import env_spec
from rayzero.gpu_monitor import GpuMonitor
from rayzero.learner import checkpoint as ckpt
from rayzero.ledger import TransitionLedger
from rayzero.logs import logger
from rayzero.replay.buffer import diagnostic_means
from rayzero.schedule import COLLECT, EVAL, LEARN, REANALYSE, Call, Counters, Rules, Schedule, Waits
from rayzero.storage import RunStorage

__all__ = ["Driver", "check_fresh", "check_resumable", "gpu_phases", "train"]

log = logger(__name__)
MAX_RESTARTS_IN_A_ROW = 5
"""Failures in a row of an evaluation or reanalyse actor (each restarted by Ray) before the run stops."""
SELFPLAY_RETURN_EPISODES = 20
"""Self-play's last episodes whose mean return the log shows, and which bring an evaluation forward once it
reaches run.stop_return (Schedule.self_play_return)."""
REWARD_ROWS = 12
"""Progress rows over which the log line counts self-play's rewards > 0 and < 0 (a minute at the default 5 s)."""
ALONE_PROBE_STEPS, ALONE_PROBE_SECONDS, ALONE_PROBE_BLOCKS = 20, 5.0, 3
"""Evaluation steps timed at the start, alone on the GPU (Driver._alone_step_seconds), the most seconds they may
take (a CPU network's search is slow), and how many such blocks are timed: the fastest counts, as the one least
slowed by the learner's compile helpers starting beside it."""
FINAL_EVAL_FLOOR = 5.0
"""The final evaluation's budget in seconds when stopping training took the run past its time limit: a few
games' worth of steps, so that the summary still scores the final weights."""
GPU_SAMPLE_S = 0.2
"""Seconds between samples of the GPUs' utilisation (the driver's machine's GPUs: a progress row's and
summary.json's `gpu`)."""
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "checkpoints")
"""What a run dir holds once a run has started in it."""


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


def _last_line(error: Exception) -> str:
    """The last line of an error's message (a Ray task error's message ends with the remote exception)."""
    text = str(error).strip()
    return text.splitlines()[-1][:300] if text else type(error).__name__


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
            line, = ax.plot(x, mean, marker="o", label="eval (greedy), at its end")
            ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.2, label="eval ± std")
            if x_key == "wall_seconds":  # the time each evaluation played (with the weights of that time)
                spans = [min(r.get("eval_seconds", 0.0), r["wall_seconds"]) for r in evals]
                ax.errorbar(x, mean, xerr=[spans, [0.0] * len(spans)], fmt="none", ecolor=line.get_color(),
                            alpha=0.6, capsize=3)
        ax.set_xlabel(label)
        ax.set_ylabel("episode return")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "learning_curve.png", dpi=100)
    plt.close(fig)


def check_fresh(run_dir: Path) -> None:
    """A CheckpointError if `run_dir` already holds a run (training there again needs --resume)."""
    found = [name for name in RUN_FILES if (run_dir / name).exists()]
    if found:
        raise ckpt.CheckpointError(f"--out {str(run_dir)!r} already holds a run ({', '.join(found)}): pass --resume "
                                   f"to continue it, or choose another directory")


def check_resumable(run_dir: Path) -> tuple[Path, dict]:
    """The latest checkpoint and its state, or a CheckpointError naming what is missing or corrupt."""
    from safetensors import safe_open

    checkpoint = ckpt.latest(run_dir)
    state = ckpt.read_state(checkpoint)
    try:
        with safe_open(str(checkpoint / ckpt.MODEL), "pt") as f:
            list(f.keys())
    except Exception as error:  # noqa: BLE001 - any failure to read is a corrupt checkpoint
        raise ckpt.CheckpointError(f"checkpoint {str(checkpoint)!r} is corrupt: model.safetensors: {error}") from None
    for key in ("learner_steps", "env_steps"):
        if key not in state:
            raise ckpt.CheckpointError(f"checkpoint {str(checkpoint)!r}: state.json lacks {key!r}")
    return checkpoint, state


class Driver:
    """One training run: the roles' handles, the counters, the calls in flight."""

    def __init__(self, config: Config, out: str, resume: bool, started: float | None = None):
        self.config = config
        self.storage = RunStorage(out, config.run.local_dir)
        self.run_dir = self.storage.local
        self.resume = resume
        self.spec = env_spec(config.env)
        self.counters = Counters()
        self.at_start = Counters()  # the counters restored from the checkpoint (zero for a new run)
        self.replay_at_start = {"size": 0, "total_added": 0}
        self.wall_before = 0.0
        self.started = started  # the clock's origin if given (`rayzero train`'s start), else the roles' build
        self.start = time.perf_counter() if started is None else started  # (until run() builds them)
        self.last_eval: dict[str, Any] | None = None
        self.best_eval = -math.inf
        self.train_returns: list[float] = []
        # Self-play's training rewards per progress row: (sum, > 0, < 0, env steps) since the last row, and the
        # last rows' counts for the log line (games whose episodes outlast the run finish none).
        self.selfplay_rewards = np.zeros(4)
        self.recent_rewards: collections.deque[tuple[int, int]] = collections.deque(maxlen=REWARD_ROWS)
        self.last_metrics: dict[str, float] = {}
        self.waits: Waits | None = None  # which side of the replay ratio waits (set when training starts)
        self.stop_reason = ""
        self.interrupt_requested = False  # set by Ctrl-C or SIGTERM
        self.stop_requested = ""  # a reason set by request_stop (from another thread)
        self.schedule: Schedule | None = None
        self.pending: dict[Any, Call] = {}  # ref -> the call it answers: what is in flight
        self.actors: dict[int, Any] = {}  # live self-play actors by index
        self.active: set[int] = set()  # actors that have delivered at least one collect
        self.next_index = 0
        self.losses_in_a_row = 0
        self.weights: Any = None  # ref of the latest published (version, state_dict), made by the learner
        # Learner weights() calls queued behind train calls, oldest first: the newest one made becomes `weights`,
        # so that calls handed `weights` never wait for the learner.
        self.pending_weights: list[Any] = []
        self.eval_weights: Any = None  # the weights the evaluation in flight plays with
        self.eval_token = 0  # names the evaluation in flight, so the run's end can cancel it
        self.solved_weights: Any = None  # the weights whose evaluation met run.stop_return
        self.failures: dict[tuple[str, int], int] = {}  # (role, index) -> failures in a row of restartable actors
        self.learner_version = 0  # of the weights the learner last published
        self.acting_versions: dict[int, int] = {}  # self-play actor -> weight version of its last collect
        self.replay_stats_before: dict | None = None  # replay diagnostics at the previous progress row
        self.handles: cluster.Handles | None = None  # the roles, once built
        self.prewarm: list[Any] = []  # learner.early_compile's helper processes
        self.prewarm_dir: Path | None = None  # where they report
        self.ledger: TransitionLedger | None = None  # what self-play sent, what replay holds, what was lost
        # The driver's machine's GPUs, sampled from the driver's start (None without any), and when (monotonic) the
        # run's phases began: the first update, the end of training, the end (the final evaluation and checkpoint).
        self.gpu: GpuMonitor | None = None
        self.gpu_marks: dict[str, float] = {}
        self.faults: dict[str, int] = {"selfplay_actors_replaced": 0, "inference_actors_replaced": 0,
                                       "learner_calls_broken_by_replay": 0}

    # -- checkpoints -----------------------------------------------------------------------------------

    def save_checkpoint(self, handles: cluster.Handles, before_commit: Callable[[], None] | None = None) -> Path:
        """The learner's state and the replay's snapshot, then the checkpoint's state (counters, best evaluation)
        and its commit. before_commit: called between the two (the run's end collects its final evaluation,
        which played while the snapshot was written, so that the state counts it)."""
        staging = ckpt.staging_dir(self.run_dir, self.counters.learner_steps)
        for attempt in range(3):
            try:
                ray.get([handles.learner.save.remote(str(staging)), *handles.replay.snapshot(staging)])
                break
            except ray.exceptions.RayActorError as error:
                if isinstance(error, ray.exceptions.RayTaskError) or attempt == 2:
                    raise
                # A replay shard died mid-snapshot (Ray restarts it from the previous one): once it answers
                # again, the whole checkpoint once more.
                log.warning("a role died while writing checkpoint %s (%s); writing it again", staging.name,
                            _last_line(error))
                self._wait_for_replay(handles)
        if before_commit is not None:
            before_commit()
        counters = ray.get(handles.learner.counters.remote())
        self.counters.learner_steps = counters["learner_steps"]
        state = {
            "env_steps": self.counters.env_steps, "learner_steps": counters["learner_steps"],
            "version": counters["version"], "episodes": self.counters.episodes, "wall_seconds": self.wall(),
            "env_id": self.config.env.id, "best_eval_return": None if self.best_eval == -math.inf else self.best_eval,
        }
        path = ckpt.commit(self.run_dir, staging, counters["learner_steps"], state)
        self.storage.sync()
        return path

    def wall(self) -> float:
        """Seconds this run has trained, across resumes (the clock of metrics rows)."""
        return self.wall_before + time.perf_counter() - self.start

    # -- start and end ---------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        config, run_dir = self.config, self.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self._start_gpu_monitor()
        checkpoint = self._read_checkpoint() if self.resume else None
        (run_dir / "config.yaml").write_text(to_yaml(config))
        how = cluster.connect(config.cluster)
        resources = ray.cluster_resources()
        log.info("Ray %s, resources %s", how, resources)
        plan = cluster.plan(config, resources)
        config = self.config = cluster.sized(config, plan)
        (run_dir / "plan.json").write_text(json.dumps(plan.as_dict(), indent=2))
        log.info("resource plan (per actor; also in %s):\n%s", run_dir / "plan.json", plan.table())
        missing = plan.cpu_shortfall(resources.get("CPU", 0.0))
        if missing > 0:
            log.warning("the plan needs %g more CPUs than the cluster's %g to start one self-play actor: self-play "
                        "waits for a node with room (on one machine it never starts). Lower cluster.selfplay_cpus "
                        "or another role's CPUs, or give Ray more with cluster.num_cpus", missing,
                        resources.get("CPU", 0.0))
        if self.started is None:
            self.start = time.perf_counter()
        try:
            handles = self.handles = cluster.build(self._early_compile(how, plan), self.spec, plan,
                                                   run_dir=str(run_dir))
            return self._run(handles, checkpoint)
        finally:
            self._end_early_compile()
            if self.gpu is not None:
                self.gpu.stop()

    def _start_gpu_monitor(self) -> None:
        """Sample the utilisation of this machine's GPUs from now to the run's end, if it has any."""
        monitor = GpuMonitor(index=None)
        if monitor.available:
            self.gpu = monitor
            self.gpu_marks = {"start": time.monotonic(), "start_wall": self.wall_before + time.perf_counter() - self.start}
            monitor.start(GPU_SAMPLE_S)

    def _run(self, handles: cluster.Handles, checkpoint: Path | None) -> dict[str, Any]:
        run_dir = self.run_dir
        if checkpoint is not None:
            ray.get([handles.learner.load.remote(str(checkpoint)), *handles.replay.restore(checkpoint)])
            self.replay_at_start = handles.replay.stats()
            log.info("resumed from %s at env_steps=%d learner_steps=%d, replay %d transitions", checkpoint,
                     self.counters.env_steps, self.counters.learner_steps, self.replay_at_start["size"])
        self.ledger = TransitionLedger(len(handles.replay), handles.replay.arrivals())
        self.counters.replay_transitions = self.replay_at_start["total_added"]
        metrics = MetricsLog(run_dir)
        with self._signals():  # through the final evaluation and checkpoint: a signal there changes nothing
            try:
                self._loop(handles, metrics)
            except KeyboardInterrupt:  # a second signal: stop waiting for in-flight work
                self.stop_reason = "interrupted"
                log.info("interrupted; writing a checkpoint and the summary")
            return self._finish(handles, metrics)

    def _early_compile(self, how: str, plan: cluster.Plan) -> Config:
        """learner.early_compile: start the background compile's helpers now, on a batch of the run's shapes, if
        the learner is to compile on a GPU of this machine; returns the config to build the roles from (the
        learner's section then names where the helpers report)."""
        config, learner = self.config, self.config.learner
        if not (learner.early_compile and learner.background_compile and learner.compile is not False
                and how == "local" and plan.learner.device == "cuda" and plan.learner_group is None):
            return config
        from rayzero.cluster.colocated import thread_safe_compile
        from rayzero.learner import background

        cfg = dataclasses.replace(learner, device="cuda")  # as cluster.build gives it to the learner
        if plan.colocated:
            cfg = thread_safe_compile(cfg, say=False)
        spec = self.spec
        tensors = background.synthetic_batch(config.replay, spec.observation_shape, spec.observation_dtype,
                                             spec.num_actions, cfg.batch_size, config.run.seed)
        self.prewarm_dir = Path(tempfile.mkdtemp(prefix="rayzero_prewarm."))
        self.prewarm = background.prewarm(config.model, cfg, spec.observation_shape, spec.num_actions,
                                          torch.device("cuda"), tensors, self.prewarm_dir)
        log.info("learner.early_compile: %d helper processes compile the learner's step from now, on a batch of "
                 "the run's shapes", len(self.prewarm))
        return dataclasses.replace(config, learner=dataclasses.replace(learner, prewarm_dir=str(self.prewarm_dir)))

    def _end_early_compile(self) -> None:
        """Stop the early compile's helpers if any still runs, and remove their directory."""
        from rayzero.learner import background

        for helper in self.prewarm:
            if helper.poll() is None:
                helper.terminate()
                helper.wait(timeout=10)
            background.clean_up(helper)
        if self.prewarm_dir is not None:
            shutil.rmtree(self.prewarm_dir, ignore_errors=True)

    def _read_checkpoint(self) -> Path:
        self.storage.fetch()
        checkpoint, state = check_resumable(self.run_dir)
        self.counters.env_steps, self.counters.learner_steps = state["env_steps"], state["learner_steps"]
        self.counters.episodes, self.wall_before = state.get("episodes", 0), state.get("wall_seconds", 0.0)
        self.at_start = Counters(env_steps=self.counters.env_steps, learner_steps=self.counters.learner_steps)
        if state.get("best_eval_return") is not None:
            self.best_eval = state["best_eval_return"]
        return checkpoint

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach only the main thread (a benchmark's, which runs this driver in another)
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def request_stop(self, reason: str) -> None:
        """End the run at the loop's next turn as its time limit would (in-flight work finishes, then the final
        evaluation, checkpoint and summary, whose `stop_reason` is `reason`); safe from another thread."""
        if not reason:
            raise ValueError("request_stop needs a reason (the summary's stop_reason), got ''")
        self.stop_requested = reason

    def _on_signal(self, *_: Any) -> None:
        """Ctrl-C or SIGTERM (`ray job stop`, Kubernetes): the loop stops at its next turn (within a second or
        so), lets in-flight work finish and writes a checkpoint; a flag rather than an exception, so no library
        call in between can swallow it. A second signal raises at once."""
        if self.interrupt_requested:
            raise KeyboardInterrupt
        self.interrupt_requested = True

    # -- the loop --------------------------------------------------------------------------------------

    def _loop(self, handles: cluster.Handles, metrics: MetricsLog) -> None:
        compiles = handles.plan.learner.device == "cuda" and self.config.learner.compile is not False
        rules = Rules.from_config(self.config, len(handles.selfplay), len(handles.replay), len(handles.reanalyse),
                                  learner_compiles=compiles)
        schedule = self.schedule = Schedule(rules, self.start, self.counters.learner_steps, time.perf_counter())
        self.actors = dict(enumerate(handles.selfplay))
        self.next_index = len(self.actors)
        self._publish(handles, wait=True)
        log.info("every role is up and has the first weights %.1f s into the run", time.perf_counter() - self.start)
        self.waits = Waits(time.perf_counter())
        if rules.time_limit and rules.final_reserve:
            schedule.alone_step_seconds = self._alone_step_seconds(handles)
        while True:
            self.stop_reason = self.stop_reason or self.stop_requested or schedule.stop_reason(
                self.counters, time.perf_counter(), self.interrupt_requested)
            if self.stop_reason:
                if self.stop_reason == "time_limit" and schedule.reserve:
                    log.info("training stops %.0f s before the time limit, for the final evaluation",
                             schedule.reserve)
                self.gpu_marks["training_end"] = time.monotonic()
                break
            in_flight = {call.key for call in self.pending.values()}
            for call in schedule.next_calls(self.counters, in_flight, self.actors, time.perf_counter(),
                                            handles.replay.all_sampleable):
                self.pending[self._issue(call, handles)] = call
            self.waits.busy(any(call.role == LEARN for call in self.pending.values()), len(self.actors),
                            sum(1 for call in self.pending.values() if call.role == COLLECT and call.index in self.actors))
            timeout = schedule.wait_timeout(time.perf_counter())
            waiting = list(self.pending) + self.pending_weights
            ready, _ = ray.wait(waiting, num_returns=1, timeout=timeout)
            self.waits.tick(time.perf_counter())
            for ref in ready:
                if ref in self.pending:
                    self._record(ref, self.pending.pop(ref), handles, metrics)
            self._take_weights()
            if schedule.log_due(time.perf_counter()):
                self._log_progress(metrics, handles)
        if self.stop_reason == "interrupted":
            log.info("interrupted; finishing in-flight work, then a checkpoint and the summary")
        if any(call.role == EVAL for call in self.pending.values()):
            # The final evaluation plays the final weights; this one's result would not be used.
            log.info("cancelling the evaluation in play (the final one follows)")
            handles.evaluation.cancel.remote(self.eval_token)
        self._drain()
        if self.solved_weights is not None:
            # The learner ran on while the deciding evaluation played; keep the weights that met the bar,
            # so the checkpoint and the summary describe the same agent.
            ray.get(handles.learner.set_weights.remote(*ray.get(self.solved_weights)))

    def _alone_step_seconds(self, handles: cluster.Handles) -> float:
        """Seconds an evaluation step takes with nothing else running, as in the final evaluation (the schedule
        stops training for it): blocks of a few steps of an evaluation's games with the first weights, after two
        untimed ones, before self-play and the learner start; the fastest block counts. The learner's compile
        helpers start at the same time and slow some blocks (Pong run 26a's single block: 12.4 ms a step, where
        its final evaluation, alone, took 6.7; training stopped 82 s early for a 53 s evaluation). 0 if it failed
        (the schedule then reserves the whole budget)."""
        run = self.config.run
        started = time.perf_counter()
        blocks: list[dict[str, float]] = []
        try:
            # The first steps pay for first calls (warm-up, not timed).
            for steps in (2,) + (ALONE_PROBE_STEPS,) * ALONE_PROBE_BLOCKS:
                result = ray.get(handles.evaluation.evaluate.remote(self.weights, run.eval_episodes, steps,
                                                                    run.seed + 20_000, None, ALONE_PROBE_SECONDS))
                if steps == ALONE_PROBE_STEPS:
                    blocks.append(result)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as error:
            log.warning("timing an evaluation step failed (%s); the final evaluation gets its whole budget",
                        _last_line(error))
            return 0.0

        def per_step(result: dict[str, Any], *keys: str) -> float:
            return sum(result.get(f"{key}_seconds", 0.0) for key in keys) / max(1, result["steps"])

        times = [per_step(block, "search", "env") for block in blocks]
        seconds = min(times)
        fastest = blocks[times.index(seconds)]
        log.info("an evaluation step alone: %.1f ms (search %.1f, on the GPU %.1f, env %.1f; the fastest of %s ms "
                 "over %d steps each; the probe took %.1f s, first calls included)", 1e3 * seconds,
                 1e3 * per_step(fastest, "search"), 1e3 * per_step(fastest, "device"), 1e3 * per_step(fastest, "env"),
                 ", ".join(f"{1e3 * t:.1f}" for t in times), fastest["steps"], time.perf_counter() - started)
        return seconds

    def _publish(self, handles: cluster.Handles, wait: bool = False) -> None:
        """The learner's latest weights, to the inference actor; self-play and the rest get them with their next
        call once the learner has made them (`_take_weights`). wait: until both are done (at start and end)."""
        ref = handles.learner.weights.remote()
        done = handles.inference.set_published.remote(ref) if handles.inference is not None else None
        if wait:
            ray.get([ref] + ([done] if done is not None else []))
            self.weights, self.pending_weights = ref, []
        else:
            self.pending_weights.append(ref)

    def _take_weights(self) -> None:
        """The newest pending weights that the learner has made become the published ones (the learner makes
        them in order, so older pending ones are dropped with it)."""
        if not self.pending_weights:
            return
        made, _ = ray.wait(self.pending_weights, num_returns=len(self.pending_weights), timeout=0)
        if made:
            newest = max(self.pending_weights.index(ref) for ref in made)
            self.weights = self.pending_weights[newest]
            self.pending_weights = self.pending_weights[newest + 1:]

    def _issue(self, call: Call, handles: cluster.Handles) -> Any:
        """Start `call`; returns its ref."""
        run = self.config.run
        if call.role == COLLECT:
            return self.actors[call.index].collect.remote(run.selfplay_steps_per_call, call.temperature, self.weights)
        if call.role == LEARN:
            return handles.learner.train.remote(handles.replay.for_learner(), self.config.learner.steps_per_call)
        if call.role == REANALYSE:
            shard = handles.replay.actors[call.shard]
            return handles.reanalyse[call.index].reanalyse.remote(shard, self.weights, self.config.reanalyse.batch_size)
        self.eval_weights = self.weights
        self.eval_token += 1
        return handles.evaluation.evaluate.remote(self.weights, run.eval_episodes, run.eval_max_steps,
                                                  run.seed + 10_000, self.eval_token)

    def _record(self, ref: Any, call: Call, handles: cluster.Handles, metrics: MetricsLog) -> None:
        """Take in the result of a finished call."""
        if call.role == COLLECT:
            try:
                result = ray.get(ref)
            except ray.exceptions.RayActorError as error:
                self._replace_actor(call.index, error, handles)
                return
            except ray.exceptions.RayTaskError as error:  # alive, but its envs and searches are mid-step
                log.warning("self-play actor %d failed a collect: %s", call.index, _last_line(error))
                self._replace_actor(call.index, error, handles)
                return
            self.active.add(call.index)
            self.acting_versions[call.index] = result["version"]
            self.losses_in_a_row = 0
            self._add_collect(result, call.index)
            if "inference_lost" in result:
                self._inference_lost(call.index, result["inference_lost"], handles)
        elif call.role == LEARN:
            try:
                result = ray.get(ref)
            except ray.exceptions.RayTaskError as error:
                if not isinstance(error, ray.exceptions.RayActorError):
                    raise
                # The learner is alive but a replay shard it sampled died: Ray restarts the shard from its last
                # snapshot, and the schedule calls the learner again.
                self.faults["learner_calls_broken_by_replay"] += 1
                self._restartable_failed("replay", 0, error)
                self._wait_for_replay(handles)
                return
            except ray.exceptions.RayActorError as error:  # the learner's own process died: its state with it
                raise RuntimeError(self._learner_lost(error)) from error
            self.failures.pop(("replay", 0), None)
            self._add_learn(result)
            self._publish(handles)
            if self.schedule.checkpoint_due(self.counters.learner_steps):
                self.save_checkpoint(handles)
        elif call.role == REANALYSE:
            try:
                positions = ray.get(ref)["positions"]
            except ray.exceptions.RayActorError as error:  # Ray restarts the worker; the schedule calls it again
                self._restartable_failed("reanalyse", call.index, error)
                return
            self.failures.pop(("reanalyse", call.index), None)
            self.counters.reanalysed += positions
        else:
            try:
                result = ray.get(ref)
            except ray.exceptions.RayActorError as error:  # Ray restarts the evaluation actor
                self._restartable_failed("evaluation", call.index, error)
                self.schedule.evaluated(time.perf_counter())  # the next one at the next interval
                return
            except ray.exceptions.RayTaskError as error:  # the actor lives on; one failed evaluation ends no run
                log.warning("an evaluation failed (%s); the next one comes at the next interval", _last_line(error))
                self.failures[("evaluation", call.index)] = self.failures.get(("evaluation", call.index), 0) + 1
                if self.failures[("evaluation", call.index)] > MAX_RESTARTS_IN_A_ROW:
                    raise
                self.schedule.evaluated(time.perf_counter())
                return
            self.failures.pop(("evaluation", call.index), None)
            self._record_eval(result, metrics)
            self.schedule.evaluated(time.perf_counter(), int(result.get("steps", 0)))
            if self.config.run.stop_return and result["mean"] >= self.config.run.stop_return:
                self.stop_reason = "stop_return"
                self.solved_weights = self.eval_weights

    def _learner_lost(self, error: Exception) -> str:
        """What ends a run whose learner died: the learner's weights and optimizer lived in that process, so the
        run goes on only from a checkpoint."""
        try:
            last = f"the last checkpoint is {ckpt.latest(self.run_dir)}; `rayzero train --resume --out " \
                   f"{self.run_dir}` goes on from it"
        except ckpt.CheckpointError:
            last = "no checkpoint was written yet (learner.checkpoint_interval)"
        where = ""
        if self.config.cluster.colocate_learner:
            where = (" The learner may have shared the inference actor's process (cluster.colocate_learner): a "
                     "CUDA error there, a device-side assert say, ends both; its log is in the actor's stderr.")
        return f"the learner's actor died ({_last_line(error)}); {last}.{where}"

    def _restartable_failed(self, role: str, index: int, error: Exception) -> None:
        """A role that Ray restarts lost its actor: the schedule calls it again; many failures in a row are a bug,
        not a lost node, and stop the run."""
        key = (role, index)
        self.failures[key] = self.failures.get(key, 0) + 1
        if self.failures[key] > MAX_RESTARTS_IN_A_ROW:
            raise RuntimeError(f"the {role} actor failed {self.failures[key]} times in a row; last: {error}") from error
        what = "a replay shard the learner sampled" if role == "replay" else f"{role} actor {index}"
        log.warning("%s failed (%s); Ray restarts it and it is called again", what, type(error).__name__)

    def _wait_for_replay(self, handles: cluster.Handles, patience: float = 120.0) -> None:
        """Until every replay shard answers again (Ray restarts a dead one, which reloads its last snapshot), so
        the learner is not called into a shard that is still starting; then says what each restart restored."""
        deadline = time.monotonic() + patience
        while True:
            try:
                restarts = handles.replay.restarts(timeout=10)
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as error:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"a replay shard did not come back within {patience:.0f} s: "
                                       f"{_last_line(error)}") from error
                time.sleep(0.5)  # unavailable (not yet known dead) fails at once: a pause before asking again
        for shard, restart in enumerate(restarts):
            if restart["restarted"]:
                log.info("replay shard %d was restarted from %s (%d positions)", shard,
                         restart["restored_from"] or "nothing (no checkpoint yet)", restart["restored_total_added"])

    def _add_collect(self, result: dict[str, Any], index: int) -> None:
        self.ledger.collected(cluster.selfplay_name(index), result)
        self.counters.env_steps += result["env_steps"]
        self.counters.replay_transitions += result["transitions_sent"]
        self.counters.episodes += len(result["episode_returns"])
        self.train_returns.extend(result["episode_returns"])
        if self.schedule is not None and len(self.train_returns) >= SELFPLAY_RETURN_EPISODES:  # the log's mean
            self.schedule.self_play_return(float(np.mean(self.train_returns[-SELFPLAY_RETURN_EPISODES:])),
                                           time.perf_counter())
        self.selfplay_rewards += (result.get("reward_sum", 0.0), result.get("rewards_positive", 0),
                                  result.get("rewards_negative", 0), result["env_steps"])

    def _add_learn(self, result: dict[str, Any]) -> None:
        if result["learner_steps"] < self.counters.learner_steps:
            log.info("the learner group restarted from its last checkpoint (learner steps %d -> %d)",
                     self.counters.learner_steps, result["learner_steps"])
        self.counters.learner_steps = result["learner_steps"]
        if self.counters.learner_steps > self.at_start.learner_steps:
            self.gpu_marks.setdefault("first_update", time.monotonic())
        self.learner_version = result["version"]
        self.schedule.learned(self.counters)
        # The learner's float metrics, and how many of its updates went through the step graph
        # (learner.step_graph).
        self.last_metrics = {k: v for k, v in result.items() if isinstance(v, float) or k == "graph_updates"}

    def _replace_actor(self, index: int, error: Exception, handles: cluster.Handles) -> None:
        """A self-play actor's node went away (or it crashed): a new one starts wherever there is room, or waits
        pending until a node joins. Segments it already sent stay in replay."""
        self.losses_in_a_row += 1
        if self.losses_in_a_row > 2 * len(self.actors) + 2:
            # Actors die as fast as they are made: a bug or a bad env, not a lost node.
            raise RuntimeError(f"self-play actors keep failing; last error: {error}") from error
        lost = self.actors.pop(index)
        self.active.discard(index)
        self.ledger.actor_lost(cluster.selfplay_name(index))
        self.faults["selfplay_actors_replaced"] += 1
        ray.kill(lost, no_restart=True)
        self.actors[self.next_index] = cluster.make_selfplay(
            self.config, handles.plan, handles.replay, handles.inference, self.next_index)
        log.info("self-play actor %d lost (%s); replaced by actor %d", index, type(error).__name__, self.next_index)
        self.next_index += 1

    def _inference_lost(self, index: int, reason: str, handles: cluster.Handles) -> None:
        """Self-play actor `index` could not reach the inference actor. If it is dead, a new one starts with the
        latest weights, and every self-play actor is pointed to it (before its next collect: calls from here to
        one actor run in order). Later reports of the same death find the new actor alive and change nothing."""
        try:
            ray.get(handles.inference.get_version.remote(), timeout=60)
            return  # alive: this report came from an actor that was still on a replaced one
        except ray.exceptions.RayActorError:
            pass
        if handles.plan.colocated:
            raise RuntimeError(f"the inference actor died, and the learner inside it (cluster.colocate_learner; "
                               f"self-play actor {index}: {reason}); resume the run from its last checkpoint")
        log.warning("the inference actor died (self-play actor %d: %s); starting a new one", index, reason)
        handles.inference = cluster.make_inference(self.config, self.spec, handles.plan)
        self.faults["inference_actors_replaced"] += 1
        self._publish(handles, wait=True)
        for actor in [*self.actors.values(), handles.evaluation, *handles.reanalyse]:
            actor.set_inference.remote(handles.inference)

    def _drain(self) -> None:
        """Let in-flight work end, so the learner and replay are consistent for the checkpoint. A collect of an
        actor that never started (pending until a node with room joins) would never end: not waited for."""
        waited = [ref for ref, call in self.pending.items() if call.role != COLLECT or call.index in self.active]
        if not waited:
            return
        ray.wait(waited, num_returns=len(waited), timeout=120)
        failed = None
        for ref, call in self.pending.items():
            try:
                result = ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:  # cut off at shutdown (or an actor that never started)
                continue
            except Exception as error:  # noqa: BLE001 - logged; a learner's failure is raised below
                log.warning("%s call %d failed while the run ended: %s", call.role, call.index, _last_line(error))
                # A learner call that a dying replay shard broke left a consistent learner (the steps it took
                # stand); any other learner failure leaves nothing to checkpoint.
                broken_by_replay = isinstance(error, ray.exceptions.RayTaskError) and \
                    isinstance(error, ray.exceptions.RayActorError)
                if call.role == LEARN and not broken_by_replay:
                    failed = error
                continue
            if call.role == COLLECT:
                self._add_collect(result, call.index)
            elif call.role == LEARN:
                self.counters.learner_steps = result["learner_steps"]
            elif call.role == REANALYSE:
                self.counters.reanalysed += result["positions"]
        self.pending.clear()
        if failed is not None:  # a NaN loss or a dead learner: no checkpoint of what it left
            raise failed

    # -- records ---------------------------------------------------------------------------------------

    def _record_eval(self, result: dict[str, Any], metrics: MetricsLog) -> None:
        self.last_eval = result
        self.best_eval = max(self.best_eval, result["mean"])
        now, wall = time.time(), self.wall()
        # When it ended on the run's clock: the row is written when the driver collects it, which for the final
        # evaluation is after the checkpoint's snapshot, and a time-limited run's bar counts its end.
        ended = {"eval_ended_seconds": wall - max(0.0, now - result["ended"])} if "ended" in result else {}
        metrics.write({
            "time": now, "wall_seconds": wall, **ended, "env_steps": self.counters.env_steps,
            "learner_steps": self.counters.learner_steps, "version": result["version"],
            "eval_return_mean": result["mean"], "eval_return_std": result["std"],
            "eval_episodes": len(result["returns"]), "eval_returns": result["returns"],
            **{f"eval_{key}": result[key] for key in ("seconds", "steps", "unfinished", "lengths", "pinned",
                                                       "last_version",
                                                       "search_seconds", "env_seconds", "queue_seconds",
                                                       "device_seconds")
               if key in result},
        })
        unfinished = result.get("unfinished", 0)
        log.info("eval v%d: %.1f ± %.1f over %d episodes%s", result["version"], result["mean"], result["std"],
                 len(result["returns"]), f" ({unfinished} cut short by its budget)" if unfinished else "")

    def _log_progress(self, metrics: MetricsLog, handles: cluster.Handles) -> None:
        elapsed = time.perf_counter() - self.start
        counters, recent = self.counters, self.train_returns[-SELFPLAY_RETURN_EPISODES:]
        row = {
            "time": time.time(), "wall_seconds": self.wall_before + elapsed, "env_steps": counters.env_steps,
            "selfplay_actors_active": len(self.active), "replay_transitions": counters.replay_transitions,
            "learner_steps": counters.learner_steps,
            "env_steps_per_second": (counters.env_steps - self.at_start.env_steps) / elapsed,
            "learner_steps_per_second": (counters.learner_steps - self.at_start.learner_steps) / elapsed,
            "episodes": counters.episodes, "reanalysed": counters.reanalysed,
            **self.faults, **self.last_metrics,
        }
        if self.waits is not None:
            row.update(self.waits.read(time.perf_counter()))
        if self.gpu is not None:  # the GPUs' utilisation since the last row
            now = time.monotonic()
            util = GpuMonitor.mean_util(self.gpu.samples(since=self.gpu_marks.get("row", -math.inf)))
            self.gpu_marks["row"] = now
            if util is not None:
                row["gpu_util"] = util
        if recent:
            row["train_return_mean"] = float(np.mean(recent))
        reward_sum, positive, negative, steps = self.selfplay_rewards
        self.selfplay_rewards = np.zeros(4)
        self.recent_rewards.append((int(positive), int(negative)))
        if steps:
            row["selfplay_reward_per_1k_steps"] = 1e3 * float(reward_sum) / float(steps)
            if positive + negative:
                row["selfplay_positive_reward_share"] = float(positive / (positive + negative))
        acting = [self.acting_versions[i] for i in self.active if i in self.acting_versions]
        if acting:  # how many published versions behind the learner self-play acts
            row["selfplay_version_lag"] = float(self.learner_version - np.mean(acting))
        try:
            replay_stats = handles.replay.stats(timeout=10)
            row["replay_size"] = replay_stats["size"]
            row.update(diagnostic_means(replay_stats, self.replay_stats_before))
            self.replay_stats_before = replay_stats
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):  # a shard restarting: no row
            pass
        metrics.write(row)
        last = f"{self.last_eval['mean']:.1f}" if self.last_eval else "-"
        train = f"{row.get('train_return_mean', float('nan')):.1f}"
        won, lost = (sum(counts) for counts in zip(*self.recent_rewards))
        span = len(self.recent_rewards) * self.config.run.log_interval
        gpu = f"  GPU {row['gpu_util']:.0f} %" if "gpu_util" in row else ""
        log.info(f"[{elapsed:6.0f}s] env steps {counters.env_steps:>9,d} ({row['env_steps_per_second']:.0f}/s)  "
                 f"learner steps {counters.learner_steps:>7,d} ({row['learner_steps_per_second']:.1f}/s)  "
                 f"train return {train}  rewards +{won}/-{lost} ({span:.0f} s)  eval {last}{gpu}")

    def _finish(self, handles: cluster.Handles, metrics: MetricsLog) -> dict[str, Any]:
        """The final evaluation (unless the last one played the final weights), checkpoint and summary.json."""
        run = self.config.run
        self.gpu_marks.setdefault("training_end", time.monotonic())  # (a loop ended by a second signal)
        self._publish(handles, wait=True)  # the inference actor (which evaluation may search with) serves them too
        final_weights = self.weights
        version = ray.get(final_weights)[0]
        collect = None
        if self.last_eval is None or self.last_eval["version"] != version or \
                len(self.last_eval["returns"]) != run.eval_episodes:
            # It plays while the checkpoint is written (other actors), and is collected before the commit;
            # run.final_eval_seconds bounds it. With a time limit, training stopped up to that long before it
            # (Schedule.reserve): the evaluation ends by the limit, games still playing then count with their
            # score so far. (A floor of half the budget let Pong run 23a's end 19 s past its limit.) Only if
            # stopping took the run past its limit does it get FINAL_EVAL_FLOOR seconds after it.
            budget = run.final_eval_seconds
            if run.time_limit and budget:
                left = self.start + run.time_limit - time.perf_counter()
                budget = min(budget, left if left > 0 else FINAL_EVAL_FLOOR)
            args = (final_weights, run.eval_episodes, run.final_steps, run.seed + 10_000, None, budget)
            playing = handles.evaluation.evaluate.remote(*args)

            def collect() -> None:
                self._record_eval(self._final_evaluation(handles, args, playing), metrics)
        path = self.save_checkpoint(handles, before_commit=collect)
        summary = self._summary(handles, version, path)
        summary["gpu"] = self._gpu_summary()
        tmp = self.run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2))
        tmp.replace(self.run_dir / "summary.json")
        metrics.close()
        self.storage.sync()
        gpu = summary["gpu"]
        gpu = "" if not gpu or gpu["util_mean"] is None else \
            f"; GPU {gpu['util_mean']:.0f} % mean" + "".join(
                f", {gpu[f'util_{name}']:.0f} % over its {name} ({gpu[f'seconds_{name}']:.0f} s)"
                for name in ("start", "training", "end") if gpu.get(f"util_{name}") is not None)
        log.info("done (%s): %s env steps, %s learner steps in %.0fs; eval %.1f ± %.1f%s", self.stop_reason,
                 f"{self.counters.env_steps:,d}", f"{self.counters.learner_steps:,d}", summary["wall_seconds"],
                 summary["eval_return_mean"], summary["eval_return_std"], gpu)
        return summary

    def _gpu_summary(self) -> dict[str, Any] | None:
        """Where the run's GPU time went (`gpu_phases`; None without a GPU on the driver's machine)."""
        if self.gpu is None:
            return None
        end = time.monotonic()
        samples = self.gpu.stop()
        return {"backend": self.gpu.backend, "devices": self.gpu.devices,
                "from_seconds": round(self.gpu_marks["start_wall"], 1), **gpu_phases(samples, self.gpu_marks, end)}

    def _final_evaluation(self, handles: cluster.Handles, args: tuple, playing: Any) -> dict[str, Any]:
        """The final evaluation's result (`playing`: its ObjectRef); once more if its actor died (Ray restarts
        it)."""
        try:
            return ray.get(playing)
        except ray.exceptions.RayActorError as error:
            log.warning("the evaluation actor failed in the final evaluation (%s); once more", type(error).__name__)
            return ray.get(handles.evaluation.evaluate.remote(*args))

    def _summary(self, handles: cluster.Handles, version: int, checkpoint: Path) -> dict[str, Any]:
        replay_stats = handles.replay.stats()
        counters, last_eval = self.counters, self.last_eval
        restarts = handles.replay.restarts()
        accounts = self.ledger.reconcile(handles.replay.arrivals(), [r["restarted"] for r in restarts])
        faults = {**self.faults, "replay_shards_restarted": sum(r["restarted"] for r in restarts),
                  "replay_restores": [{"shard": i, **r} for i, r in enumerate(restarts) if r["restarted"]]}
        return {
            "env_id": self.config.env.id,
            "env_steps": counters.env_steps,
            "learner_steps": counters.learner_steps,
            "wall_seconds": self.wall(),
            "eval_return_mean": last_eval["mean"],
            "eval_return_std": last_eval["std"],
            "eval_episodes": len(last_eval["returns"]),
            "eval_unfinished": last_eval.get("unfinished", 0),
            "eval_returns": last_eval["returns"],
            "eval_lengths": last_eval.get("lengths"),
            "best_eval_return": self.best_eval,
            "episodes": counters.episodes,
            "reanalysed_this_run": counters.reanalysed,
            "weights_version": version,
            "checkpoint": str(checkpoint),
            "stop_reason": self.stop_reason,
            "env_steps_this_run": counters.env_steps - self.at_start.env_steps,
            "learner_steps_this_run": counters.learner_steps - self.at_start.learner_steps,
            "replay_size": replay_stats["size"],
            "replay_total_added": replay_stats["total_added"],
            "replay_size_at_start": self.replay_at_start["size"],
            "replay_total_added_at_start": self.replay_at_start["total_added"],
            "seed": self.config.run.seed,
            "faults": faults,
            **accounts,
        }


def gpu_phases(samples: list[tuple[float, float, float]], marks: dict[str, float], end: float) -> dict[str, Any]:
    """The GPUs' mean utilisation (%) over a run's samples (GpuMonitor's, from `marks['start']` to `end`), and over
    its phases: `start` until the learner's first call returned (`marks['first_update']`), `training` from there
    to the end of training (`marks['training_end']`, else `end`), and `end` (the final evaluation and checkpoint).
    A phase that did not happen is left out (a run whose learner never returned has no `training`); with it, the
    phase's seconds."""
    first, stopped = marks.get("first_update"), marks.get("training_end", end)
    spans = {"start": (marks["start"], first if first is not None else stopped),
             "training": (first, stopped) if first is not None else None, "end": (stopped, end)}
    out: dict[str, Any] = {"samples": len(samples), "util_mean": GpuMonitor.mean_util(samples)}
    for name, span in spans.items():
        if span is not None:
            out[f"util_{name}"] = GpuMonitor.mean_util(samples, *span)
            out[f"seconds_{name}"] = round(span[1] - span[0], 1)
    return out


def train(config: Config, out: str | Path, resume: bool = False, started: float | None = None) -> dict[str, Any]:
    """Train; `out` is a run directory or a storage URI (s3://, gs://, file://). `started`: the
    `time.perf_counter()` the run's clock (run.time_limit, metrics' wall_seconds) counts from: `rayzero train`
    passes its own start, so that start-up (imports, Ray) counts; default: when the roles are built."""
    return Driver(config, str(out), resume, started).run()
