"""Resource planning and actor construction (see the package docstring)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayzero.actors.evaluate import EvalWorker
from rayzero.actors.selfplay import SelfPlayWorker
from rayzero.config import ClusterConfig, Config, ConfigError
from rayzero.envs import EnvSpec
from rayzero.inference.server import InferenceServer
from rayzero.learner.group import LearnerGroup
from rayzero.learner.learner import Learner
from rayzero.replay.buffer import ReplayBuffer


def connect(cfg: ClusterConfig) -> str:
    """Join the cluster named by cluster.address or RAY_ADDRESS (set by `ray job submit`), else start one.

    Returns how Ray was reached: 'existing' or 'local'.
    """
    if ray.is_initialized():
        return "existing"
    address = cfg.address or os.environ.get("RAY_ADDRESS", "")
    # Workers of a local Ray find the package through the driver's sys.path only if it is installed;
    # rayzero is installed (pip install -e .), so no runtime_env is needed.
    if address:
        ray.init(address=address, log_to_driver=True)
        return "existing"
    ray.init(num_cpus=cfg.num_cpus or None, include_dashboard=False, log_to_driver=True)
    return "local"


@dataclasses.dataclass(frozen=True)
class Plan:
    """Actor options per role, as passed to `.options(...)`."""

    replay: dict[str, Any]
    learner: dict[str, Any]
    selfplay: dict[str, Any]
    evaluator: dict[str, Any]
    inference: dict[str, Any] | None
    learner_device: str
    inference_device: str


def plan(config: Config, available: dict[str, float]) -> Plan:
    """Computes every CPU/GPU request from the config and what the cluster has (`ray.cluster_resources()`)."""
    c = config.cluster
    gpus = available.get("GPU", 0.0)
    learner_gpus = c.learner_gpus
    if config.learner.device == "cuda" and learner_gpus == 0:
        learner_gpus = 1.0
    if config.learner.device == "auto" and learner_gpus == 0 and gpus >= 1:
        learner_gpus = 1.0
    all_learner_gpus = learner_gpus * c.num_learners
    if all_learner_gpus > gpus:
        raise ValueError(f"cluster.learner_gpus={learner_gpus} x cluster.num_learners={c.num_learners} needs "
                         f"{all_learner_gpus} GPUs but the cluster has {gpus}")
    mode = config.inference.mode
    if mode == "auto":
        mode = "central" if gpus >= all_learner_gpus + 1 else "local"
    inference_gpus = c.inference_gpus or (1.0 if mode == "central" and gpus >= all_learner_gpus + 1 else 0.0)
    return Plan(
        replay={"num_cpus": c.replay_cpus, "max_restarts": 0},
        learner={"num_cpus": c.learner_cpus, "num_gpus": learner_gpus},
        # The driver replaces lost self-play actors itself (elastic pool), so Ray does not restart them.
        selfplay={"num_cpus": c.selfplay_cpus, "max_restarts": 0},
        evaluator={"num_cpus": c.eval_cpus, "max_restarts": -1},
        inference=({"num_gpus": inference_gpus, "num_cpus": 1, "max_concurrency": 1000} if mode == "central" else None),
        learner_device="cuda" if learner_gpus > 0 else "cpu",
        inference_device="cuda" if inference_gpus > 0 else "cpu",
    )


@dataclasses.dataclass
class Handles:
    replay: Any
    learner: Any
    selfplay: list[Any]
    evaluator: Any
    inference: Any | None
    plan: Plan


def build(config: Config, spec: EnvSpec) -> Handles:
    """Starts replay, learner, evaluator, the inference actor (central mode) and the self-play actors."""
    p = plan(config, ray.cluster_resources())
    c, seed = config.cluster, config.run.seed
    # Replay lives on the driver's node: removing any other node loses no replay data, and its snapshots
    # land in the driver's run directory.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    replay = ray.remote(ReplayBuffer).options(**p.replay, scheduling_strategy=here).remote(config.replay, seed)
    learner = build_learner_group(config, spec, p)
    evaluator = ray.remote(EvalWorker).options(**p.evaluator).remote(
        config.env, config.model, config.search, config.replay.discount, c.torch_threads
    )
    inference = None
    if p.inference is not None:
        inference_cfg = dataclasses.replace(config.inference, device=p.inference_device)
        inference = ray.remote(InferenceServer).options(**p.inference).remote(
            config.model, inference_cfg, spec.observation_shape, spec.num_actions, seed, c.torch_threads,
            obs_dtype=spec.observation_dtype, search_cfg=config.search, discount=config.replay.discount,
        )
    # Elastic self-play: actors beyond what fits now stay pending; pending actors are the resource demand
    # that an autoscaler acts on, and they start as soon as a node with room joins.
    target = max(c.num_selfplay_actors, c.max_selfplay_actors)
    if c.request_resources:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[{"CPU": c.selfplay_cpus}] * target)
    selfplay = [make_selfplay(config, p, replay, inference, i) for i in range(target)]
    return Handles(replay, learner, selfplay, evaluator, inference, p)


def build_learner_group(config: Config, spec: EnvSpec, p: Plan, checkpoint_root: str | None = None) -> Any:
    """The learner role: a `Learner` actor when cluster.num_learners == 1, else a `LearnerGroup` actor of
    that many DDP ranks (each with the plan's learner CPUs and GPUs, in one STRICT_PACK placement group).
    Both answer train/weights/set_weights/counters/save/load with `.remote(...)`."""
    learner_cfg = dataclasses.replace(config.learner, device=p.learner_device)
    if learner_cfg.target_update_interval and not config.replay.bootstrap_obs:
        raise ConfigError("learner.target_update_interval > 0 needs replay.bootstrap_obs=true")
    if learner_cfg.consistency_weight > 0 and not config.replay.next_obs:
        raise ConfigError("learner.consistency_weight > 0 needs replay.next_obs=true")
    c, seed = config.cluster, config.run.seed
    args = (config.model, learner_cfg, spec.observation_shape, spec.num_actions, seed, c.torch_threads)
    if c.num_learners == 1:
        return ray.remote(Learner).options(**p.learner).remote(*args)
    return ray.remote(LearnerGroup).options(num_cpus=0, max_restarts=0).remote(
        *args, num_learners=c.num_learners, gpus_per_rank=p.learner.get("num_gpus", 0.0),
        cpus_per_rank=p.learner.get("num_cpus", 1.0), checkpoint_root=checkpoint_root,
    )


def make_selfplay(config: Config, p: Plan, replay: Any, inference: Any, index: int) -> Any:
    return ray.remote(_RemoteSelfPlay).options(**p.selfplay).remote(
        config.env, config.model, config.search, config.replay, config.run.seed * 1000 + index + 1,
        config.cluster.torch_threads, replay, inference, f"selfplay-{index}",
        # On a GPU the inference actor runs whole searches as CUDA-graph replays: one call per env step.
        whole_search=p.inference_device == "cuda",
    )


class _RemoteSelfPlay(SelfPlayWorker):
    """A self-play worker whose segments go to the replay actor and whose evaluator may be the inference actor."""

    def __init__(self, env_cfg, model_cfg, search_cfg, replay_cfg, seed, torch_threads, replay, inference, name,
                 whole_search=False):
        from rayzero.actors.evaluator import RemoteEvaluator

        evaluator = None
        if inference is not None:
            # The pid makes a restarted actor a new client, so its predecessor's slots get reclaimed.
            evaluator = RemoteEvaluator(inference, replay_cfg.discount, f"{name}-{os.getpid()}",
                                        whole_search=whole_search)
        super().__init__(env_cfg, model_cfg, search_cfg, replay_cfg, seed=seed, sink=replay.add.remote,
                         evaluator=evaluator, torch_threads=torch_threads)
