"""The driver's handling of failed calls (train.Driver, real Ray, no training run): an evaluation or reanalyse
actor that dies is called again (Ray restarts it) unless it keeps dying, and so is an evaluation that fails; a learner failure in the shutdown drain
is raised, not swallowed; a dead learner ends the run saying what to resume from; other calls cut off at
shutdown are dropped."""

import os

import pytest
import ray

from rayzero import config as config_lib
from rayzero.schedule import COLLECT, EVAL, LEARN, REANALYSE, Call, Rules, Schedule
from rayzero.train import MAX_RESTARTS_IN_A_ROW, Driver


@ray.remote(max_restarts=-1)
class Flaky:
    def die(self):
        os._exit(1)



@ray.remote(num_cpus=0)
def nan_loss():
    raise FloatingPointError("learner: the loss became nan by step 7")


@ray.remote(num_cpus=0)
def slow():
    import time

    time.sleep(30)


@pytest.fixture(scope="module")
def flaky():
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield Flaky.remote()
    ray.shutdown()


def driver(tmp_path):
    cfg = config_lib.load("cartpole")
    d = Driver(cfg, str(tmp_path / "run"), resume=False)
    d.schedule = Schedule(Rules.from_config(cfg, 1, 1, 1), start=0.0, now=0.0)
    return d


def test_a_dead_evaluation_or_reanalyse_actor_is_called_again_until_it_keeps_dying(tmp_path, flaky):
    d = driver(tmp_path)
    d.schedule.next_eval = 0.0
    d._record(flaky.die.remote(), Call(EVAL), handles=None, metrics=None)  # no exception: the loop goes on
    assert d.schedule.next_eval > 0.0  # the next evaluation is due an interval later
    d._record(flaky.die.remote(), Call(REANALYSE, 0), handles=None, metrics=None)
    assert d.failures == {("evaluation", 0): 1, ("reanalyse", 0): 1}
    for _ in range(MAX_RESTARTS_IN_A_ROW - 1):
        d._record(flaky.die.remote(), Call(EVAL), handles=None, metrics=None)
    with pytest.raises(RuntimeError, match="evaluation actor failed 6 times in a row"):
        d._record(flaky.die.remote(), Call(EVAL), handles=None, metrics=None)


@ray.remote(num_cpus=0)
def failed_search():
    raise RuntimeError("search: AcceleratorError: CUDA error: an illegal memory access was encountered")


def test_a_failed_evaluation_is_logged_and_skipped_until_evaluations_keep_failing(tmp_path, flaky):
    d = driver(tmp_path)
    d.schedule.next_eval = 0.0
    d._record(failed_search.remote(), Call(EVAL), handles=None, metrics=None)  # no exception: the loop goes on
    assert d.schedule.next_eval > 0.0 and d.failures == {("evaluation", 0): 1}
    for _ in range(MAX_RESTARTS_IN_A_ROW - 1):
        d._record(failed_search.remote(), Call(EVAL), handles=None, metrics=None)
    with pytest.raises(ray.exceptions.RayTaskError, match="illegal memory access"):
        d._record(failed_search.remote(), Call(EVAL), handles=None, metrics=None)


def test_a_learner_failure_in_the_shutdown_drain_is_raised_and_cut_off_work_is_dropped(tmp_path, flaky):
    d = driver(tmp_path)
    d.active = {0}
    d.pending = {slow.remote(): Call(COLLECT, 0)}  # still running when the drain gives up: dropped
    import rayzero.train as train_module

    waits = []
    real_wait = ray.wait
    train_module.ray.wait = lambda refs, **kw: waits.append(kw) or real_wait(refs, num_returns=len(refs), timeout=5)
    try:
        d._drain()  # nothing failed: no exception
        d.pending = {nan_loss.remote(): Call(LEARN)}
        with pytest.raises(FloatingPointError, match="nan"):
            d._drain()
    finally:
        train_module.ray.wait = real_wait
    assert d.pending == {} and len(waits) == 2


@ray.remote(num_cpus=0)
def failed_collect():
    raise ValueError("search: AcceleratorError: CUDA error: operation failed during capture")


def test_a_collect_that_raises_replaces_its_self_play_actor_instead_of_ending_the_run(tmp_path, flaky):
    d = driver(tmp_path)
    replaced = []
    d._replace_actor = lambda index, error, handles: replaced.append((index, str(error)))
    d._record(failed_collect.remote(), Call(COLLECT, 3), handles=None, metrics=None)  # no exception
    assert [i for i, _ in replaced] == [3] and "operation failed during capture" in replaced[0][1]
    assert 3 not in d.active


@ray.remote(num_cpus=0)
def learn_from_a_dying_shard(shard):
    ray.get(shard.die.remote())  # raises here: the learner's call fails with the shard's death as its cause


def test_a_learner_call_broken_by_a_dying_replay_shard_does_not_fail_the_shutdown_drain(tmp_path, flaky):
    d = driver(tmp_path)
    d.pending = {learn_from_a_dying_shard.remote(flaky): Call(LEARN)}
    d._drain()  # no exception: the learner is consistent, the final checkpoint can be written
    assert d.pending == {}


def test_a_dead_learner_ends_the_run_with_what_to_resume_from(tmp_path, flaky):
    """The learner's process dying (its weights and optimizer with it) ends the run with a message that says
    so and where it can go on from, instead of Ray's bare ActorDiedError."""
    d = driver(tmp_path)
    with pytest.raises(RuntimeError, match="learner's actor died .*no checkpoint was written yet") as info:
        d._record(flaky.die.remote(), Call(LEARN, 0), handles=None, metrics=None)
    assert isinstance(info.value.__cause__, ray.exceptions.RayActorError)

