"""The learner inside the inference actor's process (cluster.colocate_learner, cluster/colocated.py)."""

import json

import pytest

from rayzero import cluster
from rayzero import config as config_lib
from rayzero.cluster.build import colocated_options
from rayzero.config import ConfigError
from test_train import SMALL, rayzero


def test_one_gpu_host_gets_one_actor_with_the_whole_gpu_for_the_learner_and_inference():
    """The `atari` preset as it is, on a 1-GPU/16-CPU host: one actor for both roles; the preset on a 2-CPU laptop
    (inference local) runs without it, and `cluster.colocate_learner=false` gives two processes."""
    cfg = config_lib.load("atari")
    plan = cluster.plan(cfg, {"CPU": 16.0, "GPU": 1.0})
    assert plan.colocated and plan.whole_search
    assert plan.learner.gpus + plan.inference.gpus == 1.0
    options = colocated_options(plan)
    assert options["num_gpus"] == 1.0 and options["num_cpus"] == plan.inference.cpus + plan.learner.cpus
    assert options["max_concurrency"] == 1000  # the inference server's many calls in flight
    assert "inside the inference actor" in plan.table()
    assert not cluster.plan(config_lib.load("atari", ["cluster.colocate_learner=false"]),
                            {"CPU": 16.0, "GPU": 1.0}).colocated
    laptop = cluster.plan(cfg, {"CPU": 2.0})
    assert not laptop.colocated and laptop.inference is None and "not applied" in laptop.table()


def test_colocation_applies_only_where_the_learner_shares_the_inference_actors_gpu():
    """A preset may ask for it everywhere: a laptop (inference local) and a host whose two roles get GPUs of their
    own run without it, and the plan's table says why; learner ranks contradict it (a config error)."""
    local = cluster.plan(config_lib.load("cartpole", ["cluster.colocate_learner=true"]), {"CPU": 2.0})
    assert not local.colocated and local.inference is None
    assert "colocate_learner not applied: inference is 'local'" in local.table()
    two = cluster.plan(config_lib.load("atari", ["cluster.colocate_learner=true", "cluster.learner_gpus=1",
                                                 "cluster.inference_gpus=1"]), {"CPU": 16.0, "GPU": 2.0})
    assert not two.colocated and "GPUs of their own" in two.table()
    cpu_central = cluster.plan(config_lib.load("cartpole", ["cluster.colocate_learner=true",
                                                            "inference.mode=central"]), {"CPU": 4.0})
    assert cpu_central.colocated and not cpu_central.colocation_skipped
    with pytest.raises(ConfigError, match=r"colocate_learner.*num_learners > 1"):
        config_lib.load("cartpole", ["cluster.colocate_learner=true", "cluster.num_learners=2"])


def test_the_colocated_learner_compiles_without_inductors_cuda_graphs_and_graphs_the_step_itself():
    """In the learner thread, reduce-overhead (inductor's CUDA graphs, main-thread only before torch's fix of
    pytorch/pytorch#123177) becomes mode 'default' under the learner's own step graph; with the step graph off, or
    another mode asked for, the settings stay as they are."""
    from rayzero.cluster.colocated import thread_safe_compile

    preset = config_lib.load("atari").learner
    assert preset.compile_mode == "reduce-overhead" and preset.step_graph
    assert thread_safe_compile(preset).compile_mode == "default"
    assert thread_safe_compile(preset).step_graph
    no_graph = config_lib.load("atari", ["learner.step_graph=false"]).learner
    assert thread_safe_compile(no_graph) == no_graph
    other = config_lib.load("atari", ["learner.compile_mode=max-autotune"]).learner
    assert thread_safe_compile(other) == other


@pytest.mark.slow
def test_a_colocated_run_trains_serves_self_play_and_resumes(tmp_path):
    """On a real local Ray (CPU): the learner trains through the colocated actor while it serves self-play's
    network calls, checkpoints, and a resumed run loads the checkpoint into it."""
    colocated = ["inference.mode=central", "cluster.colocate_learner=true", "cluster.num_cpus=3", *SMALL]
    rayzero("train", "--config", "cartpole", "--out", str(tmp_path), "run.max_learner_steps=30", *colocated)
    first = json.loads((tmp_path / "summary.json").read_text())
    assert first["learner_steps"] >= 30 and first["env_steps"] > 0
    assert json.loads((tmp_path / "plan.json").read_text())["colocated"] is True
    rayzero("train", "--config", "cartpole", "--out", str(tmp_path), "--resume", "run.max_learner_steps=60",
            *colocated)
    second = json.loads((tmp_path / "summary.json").read_text())
    assert second["learner_steps"] == first["learner_steps"] + second["learner_steps_this_run"]
    assert second["learner_steps_this_run"] > 0 and second["env_steps_this_run"] > 0
