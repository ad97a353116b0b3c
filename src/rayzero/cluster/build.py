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
from rayzero.learner.reanalyse import ReanalyseWorker
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
    # address="local": a new instance even when a `ray start` cluster runs on this machine (plain ray.init()
    # would attach to that one); joining a cluster is what RAY_ADDRESS / cluster.address are for.
    # No dashboard, so no job API (and the host pinned to loopback should it ever be on); Ray turns token auth
    # on for a new local instance unless RAY_AUTH_MODE says otherwise, and then every HTTP endpoint it still
    # runs (the node agent's) and every gRPC service asks for the token.
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        print(f"rayzero: warning: RAY_AUTH_MODE={os.environ['RAY_AUTH_MODE']}: the local Ray runs without token "
              "authentication; anyone who can reach this machine can run code on it", flush=True)
    ray.init(address="local", num_cpus=cfg.num_cpus or None, include_dashboard=False, dashboard_host="127.0.0.1",
             log_to_driver=True)
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
    reanalyse: dict[str, Any] | None = None  # None: reanalyse is off


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
        raise ConfigError(f"cluster.learner_gpus={learner_gpus} x cluster.num_learners={c.num_learners} needs "
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
        reanalyse=({"num_cpus": c.reanalyse_cpus, "num_gpus": c.reanalyse_gpus, "max_restarts": -1}
                   if config.reanalyse.fraction > 0 else None),
    )


class ReplayShards:
    """The replay role: `n` ReplayBuffer actors of capacity/n transitions each, on the driver's node.

    Self-play actors spread their segments over all shards (round-robin, starting at their own index), and
    learner rank r samples shard r % n with its priorities going back there, so with one shard per rank no
    actor serves every rank. One shard is the plain single replay actor.
    """

    def __init__(self, actors: list[Any]):
        self.actors = list(actors)

    def __len__(self) -> int:
        return len(self.actors)

    def for_learner(self) -> Any:
        """What `learner.train` takes: the one actor, or the list that ranks index by rank."""
        return self.actors[0] if len(self.actors) == 1 else list(self.actors)

    def file_names(self) -> list[str]:
        return ["replay.npz"] if len(self.actors) == 1 else [f"replay-{i}.npz" for i in range(len(self.actors))]

    def snapshot(self, directory: os.PathLike | str) -> list[Any]:
        """Refs of every shard writing its snapshot (atomically) into `directory`."""
        return [a.snapshot.remote(os.path.join(directory, name)) for a, name in zip(self.actors, self.file_names())]

    def restore(self, directory: os.PathLike | str) -> list[Any]:
        missing = [name for name in self.file_names() if not os.path.exists(os.path.join(directory, name))]
        if missing:
            present = sorted(f for f in os.listdir(directory) if f.startswith("replay"))
            raise ConfigError(f"checkpoint {directory} lacks {', '.join(missing)} (it holds {present or 'no replay'});"
                             f" resume with the replay.shards it was written with")
        return [a.restore.remote(os.path.join(directory, name)) for a, name in zip(self.actors, self.file_names())]

    def stats(self, timeout: float | None = None) -> dict[str, int]:
        """The shards' counters, summed."""
        parts = ray.get([a.stats.remote() for a in self.actors], timeout=timeout)
        return {key: sum(part[key] for part in parts) for key in parts[0]}

    def all_sampleable(self) -> bool:
        """Whether every shard holds positions to sample."""
        return all(part["sampleable"] > 0 for part in ray.get([a.stats.remote() for a in self.actors]))


def check_frame_stack(config: Config, spec: EnvSpec) -> None:
    """replay.frame_stack > 1 stores single frames: only right for image observations of that many frames."""
    k = config.replay.frame_stack
    if k > 1 and (len(spec.observation_shape) != 3 or k != config.env.frame_stack):
        raise ConfigError(f"replay.frame_stack={k} needs image observations stacking {k} frames; {config.env.id} "
                          f"gives observations of shape {spec.observation_shape} with env.frame_stack="
                          f"{config.env.frame_stack}: set replay.frame_stack to 0 or to env.frame_stack")


def num_replay_shards(config: Config) -> int:
    return config.replay.shards or config.cluster.num_learners


def shard_config(config: Config) -> Any:
    """Each shard's ReplayConfig: capacity and min_size divided among the shards."""
    n, ranks = num_replay_shards(config), config.cluster.num_learners
    r = config.replay
    if ranks % n:
        raise ConfigError(f"replay.shards={n} must divide cluster.num_learners={ranks} (rank r samples shard r % "
                          f"shards, so every shard is trained on); valid: 0 (one per rank) or a divisor of {ranks}")
    if n == 1:
        return r
    if r.capacity // n < r.segment_length + r.unroll_steps + r.td_steps:
        raise ConfigError(f"replay.capacity={r.capacity} split over {n} shards leaves {r.capacity // n} transitions "
                          f"per shard, less than one segment ({r.segment_length + r.unroll_steps + r.td_steps}); "
                          f"raise replay.capacity or lower replay.shards")
    return dataclasses.replace(r, capacity=r.capacity // n, min_size=-(-r.min_size // n))


@dataclasses.dataclass
class Handles:
    replay: ReplayShards
    learner: Any
    selfplay: list[Any]
    evaluator: Any
    inference: Any | None
    plan: Plan
    reanalyse: list[Any] = dataclasses.field(default_factory=list)


def build(config: Config, spec: EnvSpec) -> Handles:
    """Starts replay, learner, evaluator, the inference actor (central mode) and the self-play actors."""
    p = plan(config, ray.cluster_resources())
    c, seed = config.cluster, config.run.seed
    check_frame_stack(config, spec)
    # Replay lives on the driver's node: removing any other node loses no replay data, and its snapshots
    # land in the driver's run directory.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    shard_cfg = shard_config(config)
    replay = ReplayShards([
        ray.remote(ReplayBuffer).options(**p.replay, scheduling_strategy=here).remote(shard_cfg, seed * 1000 + i)
        for i in range(num_replay_shards(config))
    ])
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
    reanalyse = []
    if p.reanalyse is not None:
        device = "cuda" if p.reanalyse["num_gpus"] > 0 else "cpu"
        reanalyse = [
            ray.remote(ReanalyseWorker).options(**p.reanalyse).remote(
                config.model, config.search, config.replay.discount, spec.observation_shape, spec.num_actions,
                seed * 1000 + 500 + i, c.torch_threads, device)
            for i in range(c.num_reanalyse_workers)
        ]
    return Handles(replay, learner, selfplay, evaluator, inference, p, reanalyse)


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


def make_selfplay(config: Config, p: Plan, replay: ReplayShards, inference: Any, index: int) -> Any:
    return ray.remote(_RemoteSelfPlay).options(**p.selfplay).remote(
        config.env, config.model, config.search, config.replay, config.run.seed * 1000 + index + 1,
        config.cluster.torch_threads, replay.actors, inference, f"selfplay-{index}", index,
        # On a GPU the inference actor runs whole searches as CUDA-graph replays: one call per env step.
        whole_search=p.inference_device == "cuda",
    )


class _RemoteSelfPlay(SelfPlayWorker):
    """A self-play worker whose segments go to the replay actor and whose evaluator may be the inference actor."""

    def __init__(self, env_cfg, model_cfg, search_cfg, replay_cfg, seed, torch_threads, shards, inference, name,
                 index=0, whole_search=False):
        from rayzero.actors.evaluator import RemoteEvaluator

        evaluator = None
        if inference is not None:
            # The pid makes a restarted actor a new client, so its predecessor's slots get reclaimed.
            evaluator = RemoteEvaluator(inference, replay_cfg.discount, f"{name}-{os.getpid()}",
                                        whole_search=whole_search)
        self._shards, self._next_shard = list(shards), index

        def sink(segment: Any) -> Any:  # round-robin over the replay shards
            shard = self._shards[self._next_shard % len(self._shards)]
            self._next_shard += 1
            return shard.add.remote(segment)

        super().__init__(env_cfg, model_cfg, search_cfg, replay_cfg, seed=seed, sink=sink,
                         evaluator=evaluator, torch_threads=torch_threads)
