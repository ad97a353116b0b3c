"""`python -m rayzero.bench.learner --preset`: the learner-alone reference of a training run's learner."""
import dataclasses

import ray

from rayzero.bench.learner import QUICK, preset_row

SMALL = ["learner.batch_size=8", "model.channels=16", "learner.steps_per_call=3"]


def test_the_preset_reference_runs_the_learner_where_training_runs_it():
    """With the learner colocated (as the atari preset runs it on one GPU), the bench trains it inside the
    inference actor's process, through the same handle as training, in the thread's compile mode; otherwise as
    an actor of its own. Both time real train calls: the steps they report are the steps the learner made."""
    sizes = dataclasses.replace(QUICK, capacity=2_000, timed_calls=2, bare_steps=2)
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        rows = {colocated: preset_row("atari", SMALL, sizes, gpu=False, colocated=colocated)
                for colocated in (True, False)}
    finally:
        ray.shutdown()
    for colocated, row in rows.items():
        assert row["colocated"] is colocated
        assert row["obs_shape"] == [4, 64, 64] and row["target_network"]
        assert row["loop_steps_per_second"] > 0 and row["bare_steps_per_second"] > 0
        assert len(row["call_ms"]) == sizes.timed_calls
    # A thread other than the main one compiles without inductor's CUDA graphs (cluster/colocated.py).
    assert rows[True]["variant"].startswith("default") and rows[False]["variant"].startswith("reduce-overhead")
