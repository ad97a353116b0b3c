"""Actor construction: every role started with the options of the plan (plan.py)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayzero.actors.evaluate import EvalWorker
from rayzero.actors.network import RemoteNetwork
from rayzero.actors.reanalyse import ReanalyseWorker
from rayzero.actors.selfplay import SelfPlayWorker
from rayzero.cluster.colocated import ColocatedLearner, LearnerHandle
from rayzero.cluster.plan import Plan, plan
from rayzero.config import ClusterConfig, Config, ConfigError, EnvConfig
from rayzero.envs import EnvSpec
from rayzero.inference.server import InferenceServer
from rayzero.learner import checkpoint as ckpt
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

    def arrivals(self, timeout: float | None = None) -> list[dict[str, int]]:
        """Per shard: the positions each sender's segments added (`ReplayBuffer.arrivals`)."""
        return ray.get([a.arrivals.remote() for a in self.actors], timeout=timeout)

    def restarts(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Per shard: how often Ray restarted it and what its latest start restored (`_RemoteReplay.restart`)."""
        return ray.get([a.restart.remote() for a in self.actors], timeout=timeout)


def shard_config(config: Config, shards: int) -> Any:
    """Each shard's ReplayConfig: capacity and min_size divided among the shards (Config checks they fit)."""
    r = config.replay
    if shards == 1:
        return r
    return dataclasses.replace(r, capacity=r.capacity // shards, min_size=-(-r.min_size // shards))


@dataclasses.dataclass
class Handles:
    replay: ReplayShards
    learner: Any
    selfplay: list[Any]
    evaluation: Any
    inference: Any | None
    plan: Plan
    reanalyse: list[Any] = dataclasses.field(default_factory=list)


def make_replay(config: Config, p: Plan, run_dir: str | None = None) -> ReplayShards:
    """The replay shards, on the driver's node: removing any other node loses no replay data, and their
    snapshots land in the driver's run directory, where a shard that Ray restarts finds its latest one."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    shard_cfg = shard_config(config, p.replay.count)
    names = ReplayShards([None] * p.replay.count).file_names()
    return ReplayShards([
        ray.remote(_RemoteReplay).options(**p.replay.actor_options(), scheduling_strategy=here).remote(
            shard_cfg, config.run.seed * 1000 + i, run_dir, names[i])
        for i in range(p.replay.count)
    ])


class _RemoteReplay(ReplayBuffer):
    """A replay shard that, when Ray restarts it after a crash, reloads its file of the run's latest complete
    checkpoint: what it stored since that snapshot is lost, the rest is back (the driver counts the loss)."""

    def __init__(self, cfg: Any, seed: int, run_dir: str | None, file_name: str):
        super().__init__(cfg, seed)
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.restored_from: str | None = None
        if self.restarted and run_dir is not None:
            try:
                checkpoint = ckpt.latest(run_dir)
            except ckpt.CheckpointError:  # no checkpoint yet: the shard starts empty
                return
            self.restore(os.path.join(checkpoint, file_name))
            self.restored_from = str(checkpoint)
        self.restored_total_added = self.total_added

    def restart(self) -> dict[str, Any]:
        """Whether this process is a restart, the checkpoint it restored (None: none yet, it started empty) and
        the positions that snapshot had stored (`total_added`)."""
        return {"restarted": self.restarted, "restored_from": self.restored_from,
                "restored_total_added": self.restored_total_added}


def _inference_args(config: Config, spec: EnvSpec, p: Plan) -> tuple[tuple, dict[str, Any]]:
    assert p.inference is not None
    network_graphs = config.inference.network_graphs
    if network_graphs == "auto":  # whole searches only: their roots' graphs are all the network's that are used
        network_graphs = "search" if p.whole_search else "all"
    inference_cfg = dataclasses.replace(config.inference, device=p.inference.device,
                                        latent_pool_size=p.latent_slots or config.inference.latent_pool_size,
                                        network_graphs=network_graphs)
    return ((config.model, inference_cfg, spec.observation_shape, spec.num_actions, config.run.seed,
             p.inference.torch_threads(config.cluster.torch_threads)),
            {"obs_dtype": spec.observation_dtype, "search_cfg": config.search, "discount": config.replay.discount,
             "eval_rows": config.run.eval_episodes, "eval_search": config.eval_search})


def make_inference(config: Config, spec: EnvSpec, p: Plan) -> Any | None:
    """The central inference actor (None when inference is local to each self-play actor)."""
    if p.inference is None:
        return None
    args, kwargs = _inference_args(config, spec, p)
    return ray.remote(InferenceServer).options(**p.inference.actor_options()).remote(*args, **kwargs)


def colocated_options(p: Plan) -> dict[str, Any]:
    """The `ColocatedLearner` actor's options: the inference actor's, with the learner's CPUs and GPUs added."""
    assert p.inference is not None
    options = p.inference.actor_options()
    options["num_cpus"] = p.inference.cpus + p.learner.cpus
    options["num_gpus"] = p.inference.gpus + p.learner.gpus
    return options


def make_colocated(config: Config, spec: EnvSpec, p: Plan) -> tuple[LearnerHandle, Any]:
    """(learner handle, inference actor) of one `ColocatedLearner` actor with both roles' CPUs and GPUs."""
    actor = ray.remote(ColocatedLearner).options(**colocated_options(p)).remote(
        *_inference_args(config, spec, p), _learner_args(config, spec, p))
    return LearnerHandle(actor), actor


def build(config: Config, spec: EnvSpec, p: Plan | None = None, run_dir: str | None = None) -> Handles:
    """Starts replay, learner, evaluation, the inference actor (central mode) and the self-play actors.
    `run_dir`: where checkpoints go (a replay shard that Ray restarts restores its latest snapshot there)."""
    p = p or plan(config, ray.cluster_resources())
    c, seed = config.cluster, config.run.seed
    replay = make_replay(config, p, run_dir)
    if p.colocated:
        learner, inference = make_colocated(config, spec, p)
    else:
        learner = build_learner_group(config, spec, p)
        inference = make_inference(config, spec, p)
    # On a GPU, evaluation searches through the inference actor, as self-play does.
    evaluation = ray.remote(EvalWorker).options(**p.evaluation.actor_options()).remote(
        config.env, config.model, config.eval_search, config.replay.discount,
        p.evaluation.torch_threads(c.torch_threads), server=inference if p.whole_search else None,
    )
    if p.autoscaler_bundles:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=list(p.autoscaler_bundles))
    selfplay = [make_selfplay(config, p, replay, inference, i) for i in range(p.selfplay.count)]
    reanalyse = []
    if p.reanalyse is not None:
        reanalyse = [
            ray.remote(ReanalyseWorker).options(**p.reanalyse.actor_options()).remote(
                config.model, config.search, config.replay.discount, spec.observation_shape, spec.num_actions,
                seed * 1000 + 500 + i, p.reanalyse.torch_threads(c.torch_threads), p.reanalyse.device,
                server=inference if p.reanalyse_on_inference else None)
            for i in range(p.reanalyse.count)
        ]
    return Handles(replay, learner, selfplay, evaluation, inference, p, reanalyse)


def _learner_args(config: Config, spec: EnvSpec, p: Plan) -> tuple:
    """`Learner(...)`'s arguments, on the plan's device."""
    learner_cfg = dataclasses.replace(config.learner, device=p.learner.device)
    return (config.model, learner_cfg, spec.observation_shape, spec.num_actions, config.run.seed,
            config.cluster.torch_threads)


def build_learner_group(config: Config, spec: EnvSpec, p: Plan, checkpoint_root: str | None = None) -> Any:
    """The learner role: a `Learner` actor when cluster.num_learners == 1, else a `LearnerGroup` actor of
    that many DDP ranks (in one STRICT_PACK placement group: the plan's bundles).
    Both answer train/weights/set_weights/counters/save/load with `.remote(...)`."""
    args = _learner_args(config, spec, p)
    if p.learner_group is None:
        return ray.remote(Learner).options(**p.learner.actor_options()).remote(*args)
    group = p.learner_group
    return ray.remote(LearnerGroup).options(**group.facade_options).remote(
        *args, bundles=group.bundles, rank_options=group.rank_options, checkpoint_root=checkpoint_root,
    )


def selfplay_env(config: Config, p: Plan) -> EnvConfig:
    """The env section a self-play actor gets: the config's, its envs and its vector env's threads from the plan."""
    return dataclasses.replace(config.env, num_envs=p.selfplay.envs, num_threads=p.env_threads)


def make_selfplay(config: Config, p: Plan, replay: ReplayShards, inference: Any, index: int) -> Any:
    return ray.remote(_RemoteSelfPlay).options(**p.selfplay.actor_options()).remote(
        selfplay_env(config, p), config.model, config.search, config.replay, config.run.seed * 1000 + index + 1,
        p.selfplay.torch_threads(config.cluster.torch_threads), replay.actors, inference, selfplay_name(index), index,
        whole_search=p.whole_search,
    )


def selfplay_name(index: int) -> str:
    """Self-play actor `index`'s name: its latent slots' client id, and the source its segments carry."""
    return f"selfplay-{index}"


class _RemoteSelfPlay(SelfPlayWorker):
    """A self-play worker whose segments go to the replay actor and whose network may be the inference actor."""

    def __init__(self, env_cfg, model_cfg, search_cfg, replay_cfg, seed, torch_threads, shards, inference, name,
                 index=0, whole_search=False):
        self._name, self._discount, self._whole_search = name, replay_cfg.discount, whole_search
        network = self._network(inference) if inference is not None else None
        self._shards, self._next_shard = list(shards), index
        self._segment_shards: list[int] = []  # the shard of each segment sent in the current collect

        def sink(segment: Any) -> Any:  # round-robin over the replay shards
            shard = self._next_shard % len(self._shards)
            self._next_shard += 1
            self._segment_shards.append(shard)
            return self._shards[shard].add.remote(segment, name)

        super().__init__(env_cfg, model_cfg, search_cfg, replay_cfg, seed=seed, sink=sink,
                         evaluator=network, torch_threads=torch_threads)

    def _network(self, inference: Any) -> RemoteNetwork:
        # The pid makes a restarted actor a new client, so its predecessor's slots get reclaimed; the count of
        # servers makes a client of a new inference actor a new client too.
        self._servers = getattr(self, "_servers", 0) + 1
        return RemoteNetwork(inference, self._discount, f"{self._name}-{os.getpid()}-{self._servers}",
                             whole_search=self._whole_search)

    def set_inference(self, inference: Any) -> None:
        """Search through `inference` from now on: the driver made a new inference actor after this one died."""
        self.set_evaluator(self._network(inference))

    def collect(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """`SelfPlayWorker.collect`, plus `sent_by_shard`: the positions that reached each replay shard."""
        self._segment_shards = []
        result = super().collect(*args, **kwargs)
        sent_by_shard = [0] * len(self._shards)
        for shard, (positions, delivered) in zip(self._segment_shards, self.last_deliveries):
            if delivered:
                sent_by_shard[shard] += positions
        result["sent_by_shard"] = sent_by_shard
        return result
