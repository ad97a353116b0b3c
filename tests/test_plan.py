"""The resource plan (cluster/plan.py): every role's count, CPUs, GPUs and device, from the config and the host."""

import dataclasses
import json

import pytest

from rayzero import cluster
from rayzero import config as config_lib
from rayzero.cluster.build import selfplay_env
from rayzero.config import ConfigError



def host_atari(overrides: list[str] = ()):
    """The `atari` preset with self-play sized from the host (the preset itself pins one actor)."""
    return config_lib.load("atari", ["cluster.num_selfplay_actors=0", *overrides])


def test_the_atari_preset_pins_one_self_play_actor_of_64_envs_beside_the_shared_gpu():
    """At its replay ratio the preset's learner is the bound: one actor (two halves of 32 envs) feeds it, and
    further actors would only take GPU time from it (Pong run 12, docs/benchmarks.md)."""
    plan = cluster.plan(config_lib.load("atari"), {"CPU": 16.0, "GPU": 1.0})
    assert plan.selfplay.count == 1 and plan.selfplay.envs == 64
    assert plan.learner.gpus == 0.5 and plan.inference is not None and plan.inference.gpus == 0.5

def test_a_two_cpu_laptop_gets_every_role_on_the_cpu():
    cfg = config_lib.load("cartpole")
    plan = cluster.plan(cfg, {"CPU": 2.0})
    assert set(plan.roles()) == {"replay", "learner", "selfplay", "evaluation"}
    assert plan.inference is None and plan.reanalyse is None and plan.learner_group is None
    assert all(role.gpus == 0 and role.device == "cpu" for role in plan.roles().values())
    assert plan.selfplay.count == 1 and plan.selfplay.envs == cfg.env.num_envs  # the core the learner leaves
    assert plan.learner.actor_options() == {"num_cpus": cfg.cluster.learner_cpus, "num_gpus": 0.0}
    assert plan.selfplay.actor_options()["max_restarts"] == 0  # the driver replaces lost actors itself
    assert not plan.whole_search


def test_one_gpu_16_cpu_host_shares_the_gpu_and_fills_the_cores_with_self_play():
    """The learner and a central inference actor share the only GPU; self-play gets the cores that the learner,
    the inference actor, the driver and replay leave: 16 - 1 - 1 - 2 = 12."""
    plan = cluster.plan(host_atari(), {"CPU": 16.0, "GPU": 1.0})
    assert plan.learner.gpus == 0.5 and plan.learner.device == "cuda"
    assert plan.inference is not None and plan.inference.gpus == 0.5 and plan.inference.device == "cuda"
    assert plan.whole_search and plan.selfplay.count == 12


def test_pinned_values_win_over_the_host_rules():
    cfg = host_atari(["cluster.learner_gpus=1", "cluster.num_selfplay_actors=3"])
    plan = cluster.plan(cfg, {"CPU": 16.0, "GPU": 1.0})
    assert plan.learner.gpus == 1.0 and plan.inference is None and plan.selfplay.count == 3
    local = cluster.plan(host_atari(["inference.mode=local"]), {"CPU": 16.0, "GPU": 1.0})
    assert local.inference is None and local.learner.gpus == 1.0 and local.selfplay.count == 13


def test_a_second_gpu_goes_to_a_central_inference_actor_with_whole_searches():
    plan = cluster.plan(host_atari(), {"CPU": 16.0, "GPU": 2.0})
    assert plan.inference is not None and plan.inference.device == "cuda" and plan.inference.gpus == 1.0
    assert plan.learner.gpus == 1.0 and plan.selfplay.count == 12
    assert plan.inference.actor_options() == {"num_cpus": 1.0, "num_gpus": 1.0, "max_concurrency": 1000}
    assert plan.whole_search


def test_evaluations_with_their_own_simulations_need_the_evaluation_network_where_searches_run_on_the_gpu():
    """run.eval_simulations: an evaluation's request through the inference actor names no simulations, so on a
    GPU host the evaluation network's graphs (inference.pinned_eval) must hold them; on a CPU host the
    evaluation searches locally, as run.eval_simulations says. 0, or the run's own, asks for nothing more."""
    gpu_host = {"CPU": 16.0, "GPU": 1.0}
    with pytest.raises(ConfigError, match=r"run.eval_simulations=16 .*need inference.pinned_eval=true"):
        cluster.plan(config_lib.load("atari", ["run.eval_simulations=16", "inference.pinned_eval=false"]), gpu_host)
    for overrides in (["run.eval_simulations=16", "inference.pinned_eval=true"],
                      ["run.eval_simulations=0", "inference.pinned_eval=false"],
                      ["run.eval_simulations=50", "search.num_simulations=50", "inference.pinned_eval=false"]):
        # The preset's evaluations keep a K of their own as well (run.eval_virtual_loss); here they take self-play's.
        overrides = overrides + ["run.eval_virtual_loss=0"]
        assert cluster.plan(config_lib.load("atari", overrides), gpu_host).whole_search
    laptop = config_lib.load("cartpole", ["run.eval_simulations=4"])
    assert not cluster.plan(laptop, {"CPU": 2.0}).whole_search
    assert laptop.eval_search.num_simulations == 4 and laptop.search.num_simulations != 4
    assert laptop.eval_search == dataclasses.replace(laptop.search, num_simulations=4)
    plain = config_lib.load("cartpole")
    assert plain.eval_search == plain.search
    with pytest.raises(ConfigError, match=r"run.eval_simulations=-1 is invalid: must be >= 0"):
        config_lib.load("cartpole", ["run.eval_simulations=-1"])


def test_evaluations_with_their_own_virtual_loss_need_the_evaluation_network_where_searches_run_on_the_gpu():
    """run.eval_virtual_loss: the evaluations' K (0 = self-play's); like run.eval_simulations, a K of their own
    on a GPU host needs the evaluation network's graphs."""
    gpu_host = {"CPU": 16.0, "GPU": 1.0}
    own = ["search.virtual_loss=8", "run.eval_virtual_loss=1"]
    with pytest.raises(ConfigError, match=r"run.eval_virtual_loss=1 \(search.virtual_loss=8\) need inference.pinned_eval"):
        cluster.plan(config_lib.load("atari", [*own, "inference.pinned_eval=false", "run.eval_simulations=0"]), gpu_host)
    cfg = config_lib.load("atari", [*own, "inference.pinned_eval=true"])
    assert cluster.plan(cfg, gpu_host).whole_search
    assert cfg.eval_search.virtual_loss == 1 and cfg.search.virtual_loss == 8
    assert config_lib.load("atari", ["run.eval_virtual_loss=0"]).eval_search.virtual_loss == 8
    preset = config_lib.load("atari")  # K = 8 in searches of <= 16 trees, evaluations at K = 1 on their own network
    assert (preset.search.virtual_loss, preset.search.virtual_loss_max_trees, preset.eval_search.virtual_loss,
            preset.inference.pinned_eval) == (8, 16, 1, True)
    # Training's searches are halves of the one self-play actor's envs: larger than that, so one walk a wave.
    assert preset.env.num_envs // preset.env.search_groups > preset.search.virtual_loss_max_trees
    with pytest.raises(ConfigError, match=r"run.eval_virtual_loss=-1 is invalid: must be >= 0"):
        config_lib.load("cartpole", ["run.eval_virtual_loss=-1"])


def test_the_inference_actor_captures_only_the_roots_network_graphs_where_every_search_is_whole():
    """inference.network_graphs=auto: on a GPU host whose searches all run whole on the inference actor, only the
    initial step's graphs for the whole-search buckets are captured at start-up (the recurrent steps are inside
    the searches' graphs); where trees are walked elsewhere (search.device=cpu) every network graph is."""
    from rayzero.cluster.build import _inference_args
    from rayzero.envs import env_spec

    gpu_host = {"CPU": 16.0, "GPU": 1.0}

    def network_graphs(overrides: list[str]) -> tuple[bool, str]:
        config = config_lib.load("atari", overrides)
        p = cluster.plan(config, gpu_host)
        (_, inference_cfg, *_), _ = _inference_args(config, env_spec(config.env), p)
        return p.whole_search, inference_cfg.network_graphs

    assert network_graphs([]) == (True, "search")
    assert network_graphs(["search.device=cpu"]) == (False, "all")
    assert network_graphs(["inference.network_graphs=all"]) == (True, "all")  # the user's choice stands
    with pytest.raises(ConfigError, match=r"inference.network_graphs='some' is invalid: must be 'auto', 'all' or"):
        config_lib.load("atari", ["inference.network_graphs=some"])


def test_central_inference_on_the_cpu_does_not_send_whole_searches():
    plan = cluster.plan(config_lib.load("cartpole", ["inference.mode=central"]), {"CPU": 2.0})
    assert plan.inference is not None and plan.inference.device == "cpu" and not plan.whole_search


def test_a_plan_that_cannot_start_one_self_play_actor_says_how_many_cpus_it_lacks():
    """A central inference actor on a 2-CPU laptop asks for 3 CPUs (learner, inference actor, one self-play actor):
    Ray leaves self-play pending, so the run would play nothing. The driver warns with this shortfall."""
    assert cluster.plan(config_lib.load("cartpole", ["inference.mode=central"]), {"CPU": 2.0}).cpu_shortfall(2.0) == 1.0
    assert cluster.plan(config_lib.load("cartpole"), {"CPU": 2.0}).cpu_shortfall(2.0) == 0.0
    assert cluster.plan(host_atari(), {"CPU": 16.0, "GPU": 1.0}).cpu_shortfall(16.0) == 0.0
    fits = cluster.plan(config_lib.load("cartpole", ["inference.mode=central", "cluster.selfplay_cpus=0"]),
                        {"CPU": 2.0})
    assert fits.cpu_shortfall(2.0) == 0.0


def test_a_learner_group_gets_its_bundles_from_the_plan():
    cfg = config_lib.load("cartpole", ["cluster.num_learners=2", "cluster.learner_cpus=0", "reanalyse.fraction=0.5"])
    plan = cluster.plan(cfg, {"CPU": 2.0})
    assert plan.learner.count == 2 and plan.replay.count == 2
    # The group's bundles and the reanalyse worker's CPU leave one core for self-play, not two.
    assert plan.selfplay.count == 1
    group = plan.learner_group
    assert group.bundles == ({"CPU": 0.01}, {"CPU": 0.01})  # a bundle cannot be empty
    assert group.rank_options == {"num_cpus": 0.0, "num_gpus": 0.0, "max_restarts": 0}
    assert plan.reanalyse is not None and plan.reanalyse.count == cfg.cluster.num_reanalyse_workers


def test_too_few_gpus_for_the_learners_is_a_config_error():
    cfg = config_lib.load("cartpole", ["cluster.learner_gpus=1", "cluster.num_learners=2"])
    with pytest.raises(ConfigError, match="needs 2.0 GPUs"):
        cluster.plan(cfg, {"CPU": 8.0, "GPU": 1.0})


def test_the_plan_prints_as_a_table_and_saves_as_json():
    plan = cluster.plan(host_atari(), {"CPU": 16.0, "GPU": 2.0})
    lines = plan.table().splitlines()
    assert lines[0].split() == ["role", "count", "CPUs", "GPUs", "device", "envs"]
    assert [line.split()[0] for line in lines[1:7]] == ["replay", "learner", "selfplay", "evaluation", "inference",
                                                        "reanalyse"]
    # The preset asks for the colocated learner; with a GPU each, the plan says why it is off.
    assert lines[7:] == ["(self-play vector envs step on 2 threads each: env.num_threads)",
                         "(cluster.colocate_learner not applied: the learner (1) and the inference actor (1) have "
                         "GPUs of their own here)"]
    document = json.loads(json.dumps(plan.as_dict()))
    assert document["inference"]["device"] == "cuda" and document["selfplay"]["envs"] == 64


def test_search_device_cpu_keeps_the_searches_on_the_self_play_actors():
    plan = cluster.plan(host_atari(["search.device=cpu"]), {"CPU": 16.0, "GPU": 1.0})
    assert plan.inference is not None and plan.inference.device == "cuda" and not plan.whole_search


def test_the_latent_pool_holds_every_cpu_searchs_tree_at_once():
    """CPU-search mode: each env's tree keeps a latent per simulation and its root on the inference actor. 12
    actors x 128 envs x 51 (the H200's `bench selfplay` cpu128 row) need 78 K slots, more than the default 65,536,
    whose shortfall reclaimed live searches (eleventh session); the plan gives a quarter more than needed. Whole
    searches keep none between calls, and the configured size stays where it is enough."""
    cpu = cluster.plan(host_atari(["search.device=cpu", "env.num_envs=128"]), {"CPU": 16.0, "GPU": 1.0})
    needed = cpu.selfplay.count * 128 * 51
    assert cpu.selfplay.count == 12 and cpu.latent_slots == needed * 5 // 4
    small = cluster.plan(host_atari(["search.device=cpu", "env.num_envs=16"]), {"CPU": 16.0, "GPU": 1.0})
    assert small.latent_slots == 65536
    assert cluster.plan(host_atari(), {"CPU": 16.0, "GPU": 1.0}).latent_slots == 65536


def test_actors_run_at_most_as_many_torch_threads_as_the_cpus_they_reserve():
    """12 self-play actors of 1 CPU on a 16-core host: cluster.torch_threads=8 would give each 8 threads (96 on 16
    cores); each gets 1. A role of 4 CPUs gets the 3 asked for, or 4 of 6; a role of no or half a CPU gets 1."""
    cfg = host_atari(["cluster.torch_threads=8"])
    plan = cluster.plan(cfg, {"CPU": 16.0, "GPU": 1.0})
    assert plan.selfplay.count == 12 and plan.selfplay.cpus == 1.0
    assert plan.selfplay.torch_threads(cfg.cluster.torch_threads) == 1
    assert plan.inference.torch_threads(cfg.cluster.torch_threads) == 1
    assert plan.evaluation.cpus == 0.0 and plan.evaluation.torch_threads(8) == 1
    four = cluster.Role(1, 4.0)
    assert (four.torch_threads(3), four.torch_threads(6), four.torch_threads(1)) == (3, 4, 1)
    assert cluster.Role(1, 0.5).torch_threads(4) == 1


def test_reanalyse_on_a_one_gpu_host_searches_on_the_inference_actor_unless_it_has_a_gpu_share():
    """The preset's reanalyse worker holds no network on a one-GPU host, and reserves no core: self-play gets as
    many actors as without it. On a 2-core machine it searches with its own network, and the cores still go to the
    learner and one self-play actor."""
    preset = host_atari()
    assert preset.reanalyse.fraction > 0
    shared = cluster.plan(preset, {"CPU": 16.0, "GPU": 1.0})
    assert shared.reanalyse is not None and shared.reanalyse.gpus == 0 and shared.reanalyse_on_inference
    assert shared.reanalyse.count == 1 and shared.reanalyse.cpus == 0.0 and shared.selfplay.count == 12
    two_cores = cluster.plan(config_lib.load("atari"), {"CPU": 2.0})
    assert two_cores.reanalyse is not None and not two_cores.reanalyse_on_inference
    assert two_cores.reanalyse.device == "cpu"
    assert two_cores.selfplay.count == 1 and two_cores.cpu_shortfall(2.0) == 0.0
    pinned = cluster.plan(host_atari(["reanalyse.fraction=0.25", "cluster.reanalyse_gpus=0.1",
                                      "cluster.learner_gpus=0.45", "cluster.inference_gpus=0.45",
                                      "inference.mode=central"]), {"CPU": 16.0, "GPU": 1.0})
    assert pinned.reanalyse.gpus == 0.1 and not pinned.reanalyse_on_inference
    laptop = cluster.plan(config_lib.load("cartpole", ["reanalyse.fraction=0.25"]), {"CPU": 2.0})
    assert not laptop.reanalyse_on_inference  # no whole searches: the worker runs its own network


def test_self_play_vector_envs_get_the_cpus_over_the_actors():
    """env.num_threads=0: each self-play actor's vector env steps on the cluster's CPUs over its self-play actors
    (rounded up, at most its envs); one actor keeps a thread per CPU. A pinned value wins, and the actors get it."""
    host = cluster.plan(host_atari(), {"CPU": 16.0, "GPU": 1.0})
    assert host.selfplay.count == 12 and host.env_threads == 2  # ceil(16 / 12)
    one = cluster.plan(host_atari(["cluster.num_selfplay_actors=1"]), {"CPU": 16.0, "GPU": 1.0})
    assert one.env_threads == 16
    few_envs = cluster.plan(host_atari(["cluster.num_selfplay_actors=1", "env.num_envs=4"]), {"CPU": 16.0, "GPU": 1.0})
    assert few_envs.env_threads == 4
    laptop = cluster.plan(config_lib.load("atari"), {"CPU": 2.0})
    assert laptop.selfplay.count == 1 and laptop.env_threads == 2
    pinned_cfg = host_atari(["env.num_threads=5"])
    pinned = cluster.plan(pinned_cfg, {"CPU": 16.0, "GPU": 1.0})
    assert pinned.env_threads == 5
    env = selfplay_env(host_atari(), host)
    assert env.num_threads == 2 and env == dataclasses.replace(host_atari().env, num_threads=2)
    assert "2 threads each" in host.table()
    assert cluster.plan(config_lib.load("cartpole"), {"CPU": 16.0}).env_threads == 0  # no ALE threads to set


def test_env_num_envs_0_lets_the_plan_size_each_actors_envs_for_where_the_searches_run():
    """With whole searches on a GPU an actor's groups step while the others' searches are out, so the plan gives
    each actor more envs (a group's step then covers a search); elsewhere the config's default. The actors, the
    schedule and the bench see the plan's count; a pinned count is kept."""
    gpu_cfg = host_atari(["env.num_envs=0"])
    gpu = cluster.plan(gpu_cfg, {"CPU": 16.0, "GPU": 1.0})
    assert gpu.whole_search and gpu.selfplay.envs == 128 and gpu.selfplay.count == 12
    assert selfplay_env(gpu_cfg, gpu).num_envs == 128
    assert cluster.sized(gpu_cfg, gpu).env.num_envs == 128
    assert gpu.env_threads == 2
    cpu_search = cluster.plan(host_atari(["env.num_envs=0", "search.device=cpu"]), {"CPU": 16.0, "GPU": 1.0})
    assert not cpu_search.whole_search and cpu_search.selfplay.envs == 16
    laptop_cfg = config_lib.load("cartpole", ["env.num_envs=0"])
    laptop = cluster.plan(laptop_cfg, {"CPU": 2.0})
    assert laptop.selfplay.envs == 16 and cluster.sized(laptop_cfg, laptop).env.num_envs == 16
    pinned_cfg = host_atari()
    pinned = cluster.plan(pinned_cfg, {"CPU": 16.0, "GPU": 1.0})
    assert pinned.selfplay.envs == 64 and cluster.sized(pinned_cfg, pinned) is pinned_cfg
    with pytest.raises(ConfigError, match="num_envs.*-1.*plan's choice"):
        config_lib.load("atari", ["env.num_envs=-1"])
