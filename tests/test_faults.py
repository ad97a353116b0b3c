"""Fault injection: a real `cartpole` run on a two-node Ray (ray.cluster_utils.Cluster) survives a killed
self-play actor, a killed inference actor, a killed replay shard and a removed node, and accounts for every
transition (bench/faults.py injects; the bench runs the longer schedule). Plus the ledger's reconciliation
on numbers whose answer is known."""

import numpy as np
import pytest

from rayzero import config as config_lib
from rayzero.bench import faults
from rayzero.ledger import ACTOR_KILLED, INFERENCE_KILLED, SHARD_DOWN, SHARD_RESTORED, UNEXPLAINED, TransitionLedger

# Loop-start seconds of each fault: a self-play kill every 10 s, then the inference actor, a replay shard (after
# the first checkpoint) and the worker node, each once the run has gone on since the fault before. The injector
# ends the run once they are in (two self-play kills at least) and env and learner steps grew after them: a
# minute here, longer on a slower host, which gets the same faults later. TIME_LIMIT only caps a run that hangs.
SCHEDULE = faults.FaultSchedule(selfplay_every=10.0, inference_at=14.0, shard_at=20.0, node_at=26.0)
TIME_LIMIT = 300.0
END_TO_END = pytest.mark.slow  # the tests of the one faulted run (about a minute, shared through `faulted`)


@pytest.fixture(scope="module")
def faulted(tmp_path_factory):
    return faults.run(SCHEDULE, tmp_path_factory.mktemp("faults") / "run", TIME_LIMIT, quick=True,
                      end_after_faults=True, min_selfplay_kills=2)


def _of(result, kind):
    return [f for f in result["injected"] if f["kind"] == kind]


@END_TO_END
def test_training_completes_through_every_fault_and_the_learner_step_never_goes_back(faulted):
    summary, rows = faulted["summary"], faulted["rows"]
    assert summary["stop_reason"] == faults.FAULTS_DONE  # every fault in, and the run went on after them
    counts = faults.survived(faulted)
    assert {kind: c["injected"] for kind, c in counts.items()} == {
        faults.SELFPLAY: counts[faults.SELFPLAY]["injected"], faults.INFERENCE: 1, faults.SHARD: 1, faults.NODE: 1}
    assert counts[faults.SELFPLAY]["injected"] >= 2
    assert all(c["survived"] == c["injected"] for c in counts.values()), counts
    # The worker node's one CPU held a self-play actor (or a replacement inference actor): it was replaced too.
    f = summary["faults"]
    beyond_kills = (f["selfplay_actors_replaced"] - counts[faults.SELFPLAY]["injected"]
                    + f["inference_actors_replaced"] - counts[faults.INFERENCE]["injected"])
    assert beyond_kills >= 1, f
    steps = [r["learner_steps"] for r in rows if "learner_steps" in r] + [summary["learner_steps"]]
    assert all(a <= b for a, b in zip(steps, steps[1:])), steps
    # Both self-play and the learner went on after the last of the single faults (self-play kills go on).
    last = max(f["wall_seconds"] for f in faulted["injected"] if f["kind"] != faults.SELFPLAY)
    before = [r for r in rows if r["wall_seconds"] <= last and "env_steps_per_second" in r][-1]
    assert summary["env_steps"] > before["env_steps"]
    assert summary["learner_steps"] > before["learner_steps"]


@END_TO_END
def test_the_inference_actor_is_replaced_and_self_play_acts_through_the_new_one(faulted):
    summary, rows = faulted["summary"], faulted["rows"]
    assert summary["faults"]["inference_actors_replaced"] >= 1  # twice if the replacement went to the worker
    # The actor serving at the end is the replacement (the killed one cannot answer), with the final weights.
    assert faulted["inference_version"] == summary["weights_version"]
    killed = _of(faulted, faults.INFERENCE)[0]["wall_seconds"]
    at_kill = [r["env_steps"] for r in rows if "env_steps_per_second" in r and r["wall_seconds"] <= killed][-1]
    cfg = config_lib.load("cartpole", faults.overrides(TIME_LIMIT, quick=True))
    assert summary["env_steps"] >= at_kill + 2 * cfg.run.selfplay_steps_per_call * cfg.env.num_envs


@END_TO_END
def test_a_killed_replay_shard_comes_back_from_its_last_snapshot(faulted):
    summary = faulted["summary"]
    kill = _of(faulted, faults.SHARD)[0]
    (restore,) = summary["faults"]["replay_restores"]
    assert restore["restored_from"] is not None
    # That snapshot or a newer one (a checkpoint may have been committed between reading it and the kill).
    assert restore["restored_total_added"] >= kill["snapshot_total_added"]


@END_TO_END
def test_every_transition_sent_is_in_replay_or_lost_with_a_reason_within_the_bounds(faulted):
    summary = faulted["summary"]
    lost = summary["lost_transitions"]
    assert lost[UNEXPLAINED] == 0
    assert summary["transitions_sent"] == summary["transitions_in_replay"] + lost[SHARD_RESTORED] + lost[SHARD_DOWN]
    # Every position replay counts came with its sender's name.
    assert summary["transitions_in_replay"] == summary["replay_total_added"]
    cfg = config_lib.load("cartpole", faults.overrides(TIME_LIMIT, quick=True))
    window = cfg.replay.segment_length + cfg.replay.unroll_steps + cfg.replay.td_steps
    # A killed actor loses at most the segment each of its envs had not sent yet.
    killed_actors = summary["faults"]["selfplay_actors_replaced"]
    assert lost[ACTOR_KILLED] <= killed_actors * cfg.env.num_envs * (window - 1)
    # A killed inference actor costs at most, per self-play actor, the episodes its time limit cut in that step.
    actors = 1 + killed_actors + cfg.cluster.max_selfplay_actors
    assert lost[INFERENCE_KILLED] <= actors * cfg.env.num_envs * (window - 1)
    # A killed shard loses what it stored since its snapshot, plus the segments in flight to it when it died: at
    # most one collect's sends per self-play actor, and a collect sends what its envs held (segments complete
    # together: the envs step in lock-step) and what it played. (Two collects' steps alone, the bound before,
    # failed in CI: 1,104 positions in flight against 1,024.)
    kill = _of(faulted, faults.SHARD)[0]
    alive = max(cfg.cluster.num_selfplay_actors, cfg.cluster.max_selfplay_actors)
    in_flight = alive * cfg.env.num_envs * (window - 1 + cfg.run.selfplay_steps_per_call)
    assert lost[SHARD_RESTORED] + lost[SHARD_DOWN] <= (kill["total_added_before"] - kill["snapshot_total_added"]
                                                       + in_flight)


def test_the_ledger_sorts_each_position_sent_into_replay_or_a_reason():
    ledger = TransitionLedger(num_shards=2)
    ledger.collected("a", {"sent_by_shard": [100, 50], "transitions_held": 30})
    ledger.collected("b", {"sent_by_shard": [40, 60], "transitions_held": 70, "transitions_dropped": 5})
    ledger.collected("b", {"sent_by_shard": [10, 0], "transitions_held": 20, "transitions_discarded": 3})
    ledger.actor_lost("b")  # its last collect got 8 positions to shard 1 before it died
    # Shard 0 came back from a snapshot that lacked 25 of a's positions; shard 1 never restarted.
    accounts = ledger.reconcile([{"a": 75, "b": 50}, {"a": 50, "b": 68}], restarted=[True, False])
    assert accounts == {
        "transitions_sent": 75 + 50 + 50 + 68 + 25 + 5, "transitions_in_replay": 75 + 50 + 50 + 68,
        "lost_transitions": {SHARD_RESTORED: 25, SHARD_DOWN: 5, ACTOR_KILLED: 20 - 8, INFERENCE_KILLED: 3,
                             UNEXPLAINED: 0}}
    # The same shortfall on a shard that never restarted is a bug, and reported as one.
    accounts = ledger.reconcile([{"a": 75, "b": 50}, {"a": 50, "b": 68}], restarted=[False, False])
    assert accounts["lost_transitions"][UNEXPLAINED] == 25


def test_the_ledger_counts_only_this_runs_arrivals_of_a_resumed_replay():
    ledger = TransitionLedger(num_shards=1, arrivals_at_start=[{"a": 500}])
    ledger.collected("a", {"sent_by_shard": [100], "transitions_held": 0})
    accounts = ledger.reconcile([{"a": 600}], restarted=[False])
    assert accounts["transitions_sent"] == 100 and accounts["transitions_in_replay"] == 100
    with pytest.raises(ValueError, match="2 arrivals and 1 restart flags for 1 shards"):
        ledger.reconcile([{}, {}], restarted=[False])


def test_evaluations_compare_by_the_spread_between_runs_when_there_are_several():
    # Two runs a side: standard errors from the between-run spread. Fault-free 500 and 146 (what one seed gave
    # on two occasions), faulted 251 and 137: se = hypot(250.3 / sqrt 2, 80.6 / sqrt 2) = 185.9, noise 371.9.
    evals = faults.compare_evals([500.0, 146.0], [251.0, 137.0], [(0.0, 10)] * 4)
    assert evals["noise_basis"] == "between runs"
    assert evals["noise"] == pytest.approx(2 * np.hypot(np.std([500, 146], ddof=1), np.std([251, 137], ddof=1))
                                           / np.sqrt(2))
    assert evals["not_below_within_noise"]
    # One run a side: only the episodes' spread, which says the same gap is well beyond noise.
    one = faults.compare_evals([500.0], [251.0], [(0.0, 10), (102.0, 10)])
    assert one["noise_basis"] == "within each evaluation" and one["noise"] == pytest.approx(2 * 102 / np.sqrt(10))
    assert not one["not_below_within_noise"]
