"""Fault-injection benchmark: a `cartpole` run with faults against the same run without, on a real two-node Ray.

The cluster (`ray.cluster_utils.Cluster`) has a head node that holds the learner, replay, the central inference
actor and one self-play actor, and a worker node, added once the run has started, where a second self-play
actor lands. `FaultInjector` kills,
from the main thread on a `FaultSchedule`: a random self-play actor every interval, the inference actor once, a replay shard once
(after the first checkpoint, so that it has a snapshot to come back from) and the worker node once. The report
gives, for both runs: faults injected and survived, transitions lost per reason, the final greedy evaluation
and env-step throughput. tests/test_faults.py runs a short schedule of it and checks what a user relies on.

    rayzero bench faults [--quick] [--json PATH] [--kill-every SECONDS] [--seeds N]
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from rayzero.bench.common import write_json

SELFPLAY, INFERENCE, SHARD, NODE = "selfplay_actor", "inference_actor", "replay_shard", "node"
FAULTS_DONE = "faults_done"
"""The stop reason of a run the injector ended once every fault was in and the run had gone on after them."""


@dataclasses.dataclass(frozen=True)
class FaultSchedule:
    """When each fault happens, in seconds after the driver's loop starts (None: never)."""

    selfplay_every: float | None = 10.0
    """Kill a random self-play actor that has delivered a collect, every this many seconds."""
    inference_at: float | None = 25.0
    shard_at: float | None = 40.0
    """Kill replay shard 0 at this time or at the first checkpoint after it."""
    node_at: float | None = 55.0
    """Remove the worker node (and every actor on it)."""

    def none(self) -> bool:
        return all(t is None for t in (self.selfplay_every, self.inference_at, self.shard_at, self.node_at))


NO_FAULTS = FaultSchedule(None, None, None, None)


class FaultInjector:
    """Kills roles of a running `train.Driver` on a schedule, from the main thread (Ray adds and removes nodes
    only there; the driver runs in another). `injected` records each fault: kind, time, target, and for a
    replay shard what it had stored before the kill and at its last snapshot."""

    def __init__(self, driver: Any, schedule: FaultSchedule, cluster: Any, seed: int = 0,
                 end_after_faults: bool = False, min_selfplay_kills: int = 0):
        """`cluster`: the `ray.cluster_utils.Cluster`; its worker node joins once the driver's loop runs (so
        every fixed role is on the head), and is removed on schedule."""
        self.driver, self.schedule, self.cluster = driver, schedule, cluster
        self.end_after_faults, self.min_selfplay_kills = end_after_faults, min_selfplay_kills
        self.random = random.Random(seed)
        self.injected: list[dict[str, Any]] = []
        self.worker: Any = None

    def run_while(self, running: threading.Thread) -> None:
        """Inject faults until `running` (the driver's thread) ends. A fault waits, past its time, until the run
        has gone on since the one before (env steps grew; for the shard, a checkpoint exists), so a slow host
        gets the same faults, later, rather than faults that starve the run of the progress the next one needs.
        With `end_after_faults`, the injector ends the run (stop reason FAULTS_DONE) once every single fault is
        in, at least `min_selfplay_kills` self-play kills too, and both env and learner steps grew after them."""
        while self.driver.schedule is None and running.is_alive():  # the loop has not started yet
            time.sleep(0.2)
        if not running.is_alive():
            return
        self.worker = self.cluster.add_node(num_cpus=1)
        start, s = time.monotonic(), self.schedule
        next_selfplay = s.selfplay_every
        done: set[str] = set()
        singles = {kind for kind, at in ((INFERENCE, s.inference_at), (SHARD, s.shard_at), (NODE, s.node_at))
                   if at is not None}
        mark = self._progress()  # env and learner steps at the last fault
        while running.is_alive():
            running.join(timeout=0.2)
            now = time.monotonic() - start
            if self.driver.stop_reason or self.driver.stop_requested:  # the run is ending: no more faults
                continue
            progress = self._progress()
            moved = progress[0] > mark[0]
            before = len(self.injected)
            if next_selfplay is not None and now >= next_selfplay and moved:
                next_selfplay = now + s.selfplay_every
                self._kill_selfplay(now)
            elif s.inference_at is not None and now >= s.inference_at and INFERENCE not in done and moved:
                done.add(INFERENCE)
                self._kill_inference(now)
            elif (s.shard_at is not None and now >= s.shard_at and SHARD not in done and moved
                  and self._has_checkpoint()):
                done.add(SHARD)
                self._kill_shard(now)
            elif s.node_at is not None and now >= s.node_at and NODE not in done and moved:
                done.add(NODE)
                self.cluster.remove_node(self.worker)
                self._record(NODE, now)
            if len(self.injected) > before:
                mark = progress
            elif (self.end_after_faults and done == singles and moved and progress[1] > mark[1]
                  and sum(f["kind"] == SELFPLAY for f in self.injected) >= self.min_selfplay_kills):
                self.driver.request_stop(FAULTS_DONE)

    def _progress(self) -> tuple[int, int]:
        counters = self.driver.counters
        return counters.env_steps, counters.learner_steps

    def _kill_selfplay(self, now: float) -> None:
        import ray

        started = [(i, a) for i, a in list(self.driver.actors.items()) if i in self.driver.active]
        if not started:
            return
        index, actor = self.random.choice(started)
        ray.kill(actor, no_restart=True)
        self._record(SELFPLAY, now, target=index)

    def _kill_inference(self, now: float) -> None:
        import ray

        ray.kill(self.driver.handles.inference, no_restart=True)
        self._record(INFERENCE, now)

    def _has_checkpoint(self) -> bool:
        from rayzero.learner import checkpoint as ckpt

        try:
            ckpt.latest(self.driver.run_dir)
            return True
        except ckpt.CheckpointError:
            return False

    def _kill_shard(self, now: float) -> None:
        import ray

        from rayzero.learner import checkpoint as ckpt

        shards = self.driver.handles.replay
        snapshot = Path(ckpt.latest(self.driver.run_dir)) / shards.file_names()[0]
        with np.load(snapshot) as data:
            snapshot_added = json.loads(bytes(data["meta"]).decode())["total_added"]
        held = ray.get(shards.actors[0].stats.remote())["total_added"]
        ray.kill(shards.actors[0], no_restart=False)  # a crash: Ray restarts it
        self._record(SHARD, now, target=0, total_added_before=held, snapshot_total_added=snapshot_added,
                     snapshot=str(snapshot.parent))

    def _record(self, kind: str, now: float, **details: Any) -> None:
        """`at`: seconds since the loop started; `wall_seconds`: on the clock of the run's metrics rows."""
        self.injected.append({"kind": kind, "at": now, "wall_seconds": self.driver.wall(), **details})


def overrides(time_limit: float, quick: bool) -> list[str]:
    """The `cartpole` preset with one inference actor, one self-play actor on the head and one on the worker,
    and a checkpoint every learner call (so a killed shard has a recent snapshot)."""
    out = ["inference.mode=central", "cluster.num_selfplay_actors=1", "cluster.max_selfplay_actors=2",
           f"run.time_limit={time_limit}", "run.stop_return=0", "run.log_interval=2",
           "learner.checkpoint_interval=25"]
    if quick:
        out += ["run.eval_interval=1000", "run.eval_episodes=3", "run.eval_max_steps=200"]
    return out


def run(schedule: FaultSchedule, out: Path, time_limit: float, quick: bool = False, seed: int = 0,
        head_cpus: int = 3, end_after_faults: bool = False, min_selfplay_kills: int = 0) -> dict[str, Any]:
    """One training run on a new head + worker cluster, with the faults of `schedule` injected. Returns the
    summary, the metrics rows, the faults injected and the weights version of the inference actor at the end;
    an error of the driver is raised. With `end_after_faults` the run ends once its faults are in and it has
    gone on after them (`time_limit` is then a cap), so its length follows the host's speed."""
    import ray
    from ray.cluster_utils import Cluster

    from rayzero import config as config_lib
    from rayzero.train import Driver

    config = config_lib.load("cartpole", [*overrides(time_limit, quick), f"run.seed={seed}"])
    # Head: learner, inference actor, one self-play actor; the second self-play actor waits for the worker.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "include_dashboard": False})
    outcome: dict[str, Any] = {}
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        driver = Driver(config, str(out), resume=False)

        def train() -> None:
            try:
                outcome["summary"] = driver.run()
            except BaseException as error:  # noqa: BLE001 - raised again in the main thread below
                outcome["error"] = error

        thread = threading.Thread(target=train, name="driver")
        thread.start()
        injector = FaultInjector(driver, schedule, cluster, seed=seed, end_after_faults=end_after_faults,
                                 min_selfplay_kills=min_selfplay_kills)
        try:
            injector.run_while(thread)
        finally:
            thread.join()
        if "error" in outcome:
            raise outcome["error"]
        # The weights the inference actor serving at the end holds (after a kill: its replacement's).
        outcome["inference_version"] = ray.get(driver.handles.inference.get_version.remote(), timeout=60)
    finally:
        ray.shutdown()
        cluster.shutdown()
    rows = [json.loads(line) for line in open(out / "metrics.jsonl") if line.strip()]
    return {"summary": outcome["summary"], "rows": rows, "injected": injector.injected,
            "inference_version": outcome["inference_version"]}


def survived(result: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per kind of fault: how many were injected, and how many the run recovered from. A run that did not
    reach its time limit (or, ended by the injector, the end of its faults) survived none. Otherwise a kill is
    survived when the summary shows its replacement or restart; a node removal when the run went on (what it
    cost, a self-play or an inference actor that was on the node, is replaced beyond the direct kills)."""
    summary, injected = result["summary"], result["injected"]
    faults = summary["faults"]
    count = {kind: sum(f["kind"] == kind for f in injected) for kind in (SELFPLAY, INFERENCE, SHARD, NODE)}
    completed = summary["stop_reason"] in ("time_limit", FAULTS_DONE)
    recovered = {
        SELFPLAY: min(count[SELFPLAY], faults["selfplay_actors_replaced"]),
        INFERENCE: min(count[INFERENCE], faults["inference_actors_replaced"]),
        SHARD: min(count[SHARD], faults["replay_shards_restarted"]),
        NODE: count[NODE],
    }
    return {kind: {"injected": count[kind], "survived": recovered[kind] if completed else 0} for kind in count}


def throughput(rows: list[dict[str, Any]]) -> float:
    """Env steps per second from the first collect to the last progress row: start-up (a few seconds of Ray
    and actors starting, which varies with the machine's load) and the final evaluation are left out."""
    progress = [r for r in rows if "env_steps_per_second" in r and r["env_steps"] > 0]
    if len(progress) < 2:
        return 0.0
    first, last = progress[0], progress[-1]
    return (last["env_steps"] - first["env_steps"]) / (last["wall_seconds"] - first["wall_seconds"])


def figures(result: dict[str, Any]) -> dict[str, Any]:
    summary = result["summary"]
    return {
        "env_steps": summary["env_steps_this_run"],
        "learner_steps": summary["learner_steps_this_run"],
        "wall_seconds": summary["wall_seconds"],
        "env_steps_per_second": throughput(result["rows"]),
        "final_eval_mean": summary["eval_return_mean"],
        "final_eval_std": summary["eval_return_std"],
        "eval_episodes": summary["eval_episodes"],
        "transitions_sent": summary["transitions_sent"],
        "transitions_in_replay": summary["transitions_in_replay"],
        "lost_transitions": summary["lost_transitions"],
        "faults": survived(result),
        "driver_faults": result["summary"]["faults"],  # what the driver replaced and restarted
        "injected": result["injected"],
    }


def compare_evals(free: list[float], faulted: list[float], within: list[tuple[float, int]]) -> dict[str, Any]:
    """Whether the faulted runs' final evaluations are "not below the fault-free runs' within noise": the
    faulted mean at most two standard errors of the difference of the means below the fault-free mean. With
    two or more runs a side the standard errors come from the spread between runs (what a repeat of the run
    shows: same-seed runs of this bench ended 146 and 500); with one run a side, from the spread over the
    episodes of each evaluation (`within`: (std, episodes) of each run), which understates it."""
    if min(len(free), len(faulted)) >= 2:
        se = float(np.hypot(np.std(free, ddof=1) / np.sqrt(len(free)), np.std(faulted, ddof=1) / np.sqrt(len(faulted))))
        basis = "between runs"
    else:
        se = float(np.hypot(*(std / np.sqrt(max(1, n)) for std, n in within)))
        basis = "within each evaluation"
    noise = 2.0 * se
    return {"fault_free_mean": float(np.mean(free)), "faulted_mean": float(np.mean(faulted)), "noise": noise,
            "noise_basis": basis, "not_below_within_noise": bool(np.mean(faulted) >= np.mean(free) - noise)}


def main(quick: bool = False, json_path: str | None = None, selfplay_every: float = 10.0,
         seeds: int = 1) -> dict[str, Any]:
    """`selfplay_every`: seconds between self-play actor kills; `seeds`: runs a side (seeds 0, 1, ...)."""
    time_limit = 60.0 if quick else 240.0
    schedule = (FaultSchedule(selfplay_every, 15.0, 25.0, 35.0) if quick
                else FaultSchedule(selfplay_every, 60.0, 100.0, 140.0))
    results: dict[str, list[dict[str, Any]]] = {"fault_free": [], "faulted": []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(seeds):
            for name, faults in (("fault_free", NO_FAULTS), ("faulted", schedule)):
                result = run(faults, Path(tmp) / f"{name}_{seed}", time_limit, quick=quick, seed=seed)
                results[name].append(figures(result))
                print(f"{name} seed {seed}: done", flush=True)
    print(f"\n{'run':<11} {'seed':>4} {'faults inj/surv':>15} {'lost':>6} {'sent':>7} {'env steps/s':>11} "
          f"{'final eval':>13}")
    for name, runs in results.items():
        for seed, r in enumerate(runs):
            injected = sum(f["injected"] for f in r["faults"].values())
            ok = sum(f["survived"] for f in r["faults"].values())
            print(f"{name:<11} {seed:>4d} {f'{injected}/{ok}':>15} {sum(r['lost_transitions'].values()):>6d} "
                  f"{r['transitions_sent']:>7d} {r['env_steps_per_second']:>11.1f} "
                  f"{r['final_eval_mean']:>7.1f} ± {r['final_eval_std']:<5.1f}")
    free, faulted = results["fault_free"], results["faulted"]
    ratio = float(np.mean([r["env_steps_per_second"] for r in faulted]) /
                  np.mean([r["env_steps_per_second"] for r in free]))
    evals = compare_evals([r["final_eval_mean"] for r in free], [r["final_eval_mean"] for r in faulted],
                          [(r["final_eval_std"], r["eval_episodes"]) for r in free + faulted])
    print(f"throughput ratio (faulted / fault-free, mean env steps/s): {ratio:.2f}  (bar: >= 0.70)")
    print(f"final eval: faulted {evals['faulted_mean']:.1f} vs fault-free {evals['fault_free_mean']:.1f}, noise "
          f"(2 standard errors of the difference, {evals['noise_basis']}) {evals['noise']:.1f}: "
          f"{'within' if evals['not_below_within_noise'] else 'below'}")
    for seed, r in enumerate(faulted):
        print(f"  seed {seed}: " + ", ".join(f"{kind} {f['injected']}/{f['survived']}" for kind, f in r["faults"].items())
              + f"; lost transitions: {r['lost_transitions']}")
    document = {"time_limit": time_limit, "schedule": dataclasses.asdict(schedule), "seeds": seeds, "runs": results,
                "throughput_ratio": ratio, "evals": evals, "cpus": os.cpu_count()}
    return write_json(json_path, "faults", document)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--seeds", type=int, default=1)
    args = parser.parse_args()
    main(args.quick, args.json, seeds=args.seeds)
