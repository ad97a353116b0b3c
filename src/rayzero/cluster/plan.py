"""The resource plan: every role's count, CPUs, GPUs, device and envs, from the config and what Ray offers.

The one place that decides resources: `build.py` passes `Role.actor_options()` to `.options(...)`, and the
learner group gets its placement-group bundles and rank options from here. The driver prints `Plan.table()`
at start and writes `Plan.as_dict()` to the run dir (plan.json). A new sizing rule (say, for one-GPU hosts)
changes `plan()` only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from rayzero.config import Config, ConfigError, EnvConfig


@dataclasses.dataclass(frozen=True)
class Role:
    """One role's actors: how many, and what each one gets."""

    count: int
    cpus: float
    """CPUs per actor."""
    gpus: float = 0.0
    """GPUs (or a share of one) per actor."""
    device: str = "cpu"
    """Where the role's torch work runs: 'cpu' or 'cuda'."""
    envs: int = 0
    """Envs each actor steps (self-play: env.num_envs, or the plan's where that is 0; evaluation:
    run.eval_episodes)."""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Other actor options (max_restarts, max_concurrency)."""

    def actor_options(self) -> dict[str, Any]:
        """What `ray.remote(cls).options(...)` gets for one actor of the role."""
        return {"num_cpus": self.cpus, "num_gpus": self.gpus, **self.options}

    def torch_threads(self, requested: int) -> int:
        """torch intra-op threads for one actor of the role: `requested` (cluster.torch_threads), at most the
        whole CPUs it reserves and at least 1. Many actors share a host, each with its CPU share: an actor
        running more threads than that takes cores from the others (thrashing), not speed."""
        return max(1, min(int(requested), int(self.cpus)))


@dataclasses.dataclass(frozen=True)
class LearnerRanks:
    """A learner group's ranks: one placement-group bundle and the same actor options for each."""

    bundles: tuple[dict[str, float], ...]
    rank_options: dict[str, Any]
    facade_options: dict[str, Any]
    """The `LearnerGroup` actor itself: it only forwards calls, so it holds no resources."""


def learner_ranks(num_learners: int, cpus: float, gpus: float) -> LearnerRanks:
    """STRICT_PACK bundles of `cpus` (at least 0.01: a bundle cannot be empty) and `gpus` per rank."""
    bundle: dict[str, float] = {"CPU": max(cpus, 0.01)}
    if gpus > 0:
        bundle["GPU"] = gpus
    return LearnerRanks(tuple(dict(bundle) for _ in range(num_learners)),
                        {"num_cpus": cpus, "num_gpus": gpus, "max_restarts": 0},
                        {"num_cpus": 0, "max_restarts": 0})


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-role resources and the device decisions that follow from them."""

    replay: Role
    learner: Role
    """Per rank; `count` = cluster.num_learners."""
    selfplay: Role
    evaluation: Role
    inference: Role | None
    """None: inference is 'local' (each self-play actor runs its own copy of the network)."""
    reanalyse: Role | None = None
    """None: reanalyse is off."""
    learner_group: LearnerRanks | None = None
    """With cluster.num_learners > 1: the group's bundles and options."""
    whole_search: bool = False
    """Self-play sends whole searches to the inference actor (one call per env step): it runs them on a GPU as
    CUDA-graph replays. Otherwise self-play drives the search and asks for network steps."""
    autoscaler_bundles: tuple[dict[str, float], ...] = ()
    """Bundles asked of the autoscaler at start (cluster.request_resources)."""
    reanalyse_on_inference: bool = False
    """Reanalyse searches run as whole searches on the inference actor (its GPU), not on a network of their own:
    with whole searches and no GPU share pinned for reanalyse (cluster.reanalyse_gpus)."""
    colocated: bool = False
    """The learner runs inside the inference actor's process (cluster.colocate_learner): one actor with both
    roles' CPUs and GPUs."""
    colocation_skipped: str = ""
    """Why cluster.colocate_learner was not applied here ('' when it was, or was not asked for)."""
    latent_slots: int = 0
    """The inference actor's latent pool (inference.latent_pool_size; 0 without an inference actor), raised where
    self-play walks its trees on the CPU to what they hold at once: every env's root and simulations, a quarter
    more for headroom. A pool that runs short frees the least recently active client's slots, and that client's
    search then fails."""
    env_threads: int = 0
    """Threads of each self-play actor's vector env (Atari): env.num_threads, or with 0 there the cluster's CPUs
    over its self-play actors (rounded up), at most env.num_envs. One actor gets a thread per CPU, as before; many
    actors share the CPUs, where a thread per CPU for each half-batch's vector env started many times more threads
    than cores. 0 for other envs (Gymnasium's vector envs take no thread count)."""

    def roles(self) -> dict[str, Role]:
        named = {"replay": self.replay, "learner": self.learner, "selfplay": self.selfplay,
                 "evaluation": self.evaluation, "inference": self.inference, "reanalyse": self.reanalyse}
        return {name: role for name, role in named.items() if role is not None}

    def table(self) -> str:
        """role, count, CPUs and GPUs per actor, device, envs per actor: one line per role."""
        lines = [f"{'role':<11} {'count':>5} {'CPUs':>5} {'GPUs':>5} {'device':>6} {'envs':>5}"]
        for name, role in self.roles().items():
            lines.append(f"{name:<11} {role.count:>5d} {role.cpus:>5g} {role.gpus:>5g} {role.device:>6} "
                         f"{role.envs or '-':>5}")
        if self.env_threads:
            lines.append(f"(self-play vector envs step on {self.env_threads} threads each: env.num_threads)")
        if self.colocated:
            lines.append("(the learner runs inside the inference actor's process: cluster.colocate_learner)")
        if self.colocation_skipped:
            lines.append(f"(cluster.colocate_learner not applied: {self.colocation_skipped})")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def cpu_shortfall(self, cpus: float) -> float:
        """CPUs missing from `cpus` (what the cluster has) for every fixed role and one self-play actor: above 0,
        self-play waits for a node to join, and on one machine it never starts."""
        fixed = sum(role.count * role.cpus for name, role in self.roles().items() if name != "selfplay")
        return max(0.0, fixed + self.selfplay.cpus - cpus)


SHARED_GPU_LEARNER = 0.5
"""The learner's share of a host's only GPU; the inference actor takes the rest."""


def _shares_one_gpu(config: Config, gpus: float) -> bool:
    """One GPU and nothing pinned: the learner and the inference actor share it (the learner alone on it left
    self-play searching with a CPU copy of the network, at a few dozen env steps per second)."""
    c = config.cluster
    return (1 <= gpus < 2 and c.num_learners == 1 and c.learner_gpus == 0 and c.inference_gpus == 0
            and config.learner.device in ("auto", "cuda") and config.inference.mode in ("auto", "central")
            and config.inference.device in ("auto", "cuda"))


def selfplay_actors(config: Config, cpus: int, central: bool) -> int:
    """cluster.num_selfplay_actors, or with 0 the whole CPUs that the other roles' requests (a learner group's
    bundles at least 0.01 each), the inference actor and (above 4 CPUs) 2 for the driver and replay leave,
    at least 1."""
    c = config.cluster
    if c.num_selfplay_actors:
        return c.num_selfplay_actors
    learner = (max(c.learner_cpus, 0.01) if c.num_learners > 1 else c.learner_cpus) * c.num_learners
    reanalyse = c.reanalyse_cpus * c.num_reanalyse_workers if config.reanalyse.fraction > 0 else 0.0
    shards = config.replay.shards or c.num_learners
    reserved = (learner + (1.0 if central else 0.0) + reanalyse + c.replay_cpus * shards + c.eval_cpus
                + (2.0 if cpus > 4 else 0.0))
    return max(1, int((cpus - reserved) // max(c.selfplay_cpus, 1.0)))


WHOLE_SEARCH_ENVS = 128
"""Envs per self-play actor when env.num_envs is 0 and whole searches run on a GPU. A group's search must come
back while the other groups step; with fewer envs an actor waits on it (docs/benchmarks.md, thirty-fifth
session: 64 against 128 per actor)."""
CPU_SEARCH_ENVS = EnvConfig.num_envs
"""Envs per self-play actor when env.num_envs is 0 otherwise: the config's default."""


def selfplay_envs(config: Config, whole_search: bool) -> int:
    """env.num_envs, or with 0 the plan's choice for where the searches run."""
    return config.env.num_envs or (WHOLE_SEARCH_ENVS if whole_search else CPU_SEARCH_ENVS)


def sized(config: Config, p: Plan) -> Config:
    """`config` with env.num_envs as the plan sized it (the same config when it was pinned): what the schedule
    and every reader of the env section after the plan should see."""
    if config.env.num_envs == p.selfplay.envs:
        return config
    return dataclasses.replace(config, env=dataclasses.replace(config.env, num_envs=p.selfplay.envs))


def plan(config: Config, available: dict[str, float]) -> Plan:
    """Every CPU/GPU request from the config and what the cluster has (`ray.cluster_resources()`)."""
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
    share = _shares_one_gpu(config, gpus)
    if share:
        learner_gpus, all_learner_gpus, mode = SHARED_GPU_LEARNER, SHARED_GPU_LEARNER, "central"
    if mode == "auto":
        mode = "central" if gpus >= all_learner_gpus + 1 else "local"
    inference_gpus = c.inference_gpus or (1.0 if mode == "central" and gpus >= all_learner_gpus + 1 else 0.0)
    if share:
        inference_gpus = 1.0 - SHARED_GPU_LEARNER
    inference_device = "cuda" if inference_gpus > 0 else "cpu"
    # Colocation is for a learner and an inference actor that share one GPU (or have none): in one process their
    # kernels share the GPU by streams instead of time slices. On GPUs of their own it would put both roles on
    # the first; without an inference actor there is nothing to share. So a preset can ask for it everywhere.
    skipped = ""
    if c.colocate_learner and mode != "central":
        skipped = f"inference is {mode!r} here (inference.mode={config.inference.mode!r}, {gpus:g} GPUs)"
    elif c.colocate_learner and learner_gpus + inference_gpus > 1.0:
        skipped = (f"the learner ({learner_gpus:g}) and the inference actor ({inference_gpus:g}) have GPUs of their "
                   "own here")
    whole_search = mode == "central" and inference_device == "cuda" and config.search.device != "cpu"
    if whole_search and config.eval_search != config.search and not config.inference.pinned_eval:
        # An evaluation's request names no simulations or K (channel.py); the evaluation network's graphs hold them.
        raise ConfigError(f"run.eval_simulations={config.run.eval_simulations} (search.num_simulations="
                          f"{config.search.num_simulations}) and run.eval_virtual_loss={config.run.eval_virtual_loss} "
                          f"(search.virtual_loss={config.search.virtual_loss}) need inference.pinned_eval=true here, "
                          f"where searches run whole on the GPU; or set run.eval_simulations=0 and "
                          f"run.eval_virtual_loss=0")
    # The driver replaces lost self-play actors itself (elastic pool), so Ray does not restart them. Actors
    # beyond what fits now stay pending: that is the demand an autoscaler acts on.
    num_selfplay = max(selfplay_actors(config, int(available.get("CPU", 1)), mode == "central"), c.max_selfplay_actors)
    num_envs = selfplay_envs(config, whole_search)
    env_threads = (config.env.num_threads or min(num_envs,
                                                 max(1, math.ceil(available.get("CPU", 1) / num_selfplay)))
                   if config.env.is_atari else 0)
    latent_slots = 0
    if mode == "central":
        latent_slots = config.inference.latent_pool_size
        if not whole_search:  # each env's tree keeps its root's and every simulation's latent until it is done
            trees = num_selfplay * num_envs * (config.search.num_simulations + 1)
            latent_slots = max(latent_slots, trees * 5 // 4)
    return Plan(
        # A replay shard that crashes is restarted by Ray and reloads its last snapshot (build._RemoteReplay).
        replay=Role(config.replay.shards or c.num_learners, c.replay_cpus, options={"max_restarts": -1}),
        learner=Role(c.num_learners, c.learner_cpus, learner_gpus, "cuda" if learner_gpus > 0 else "cpu"),
        selfplay=Role(num_selfplay, c.selfplay_cpus, envs=num_envs, options={"max_restarts": 0}),
        # Two threads: the run's end cancels an evaluation in play (EvalWorker.cancel).
        evaluation=Role(1, c.eval_cpus, envs=config.run.eval_episodes,
                        options={"max_restarts": -1, "max_concurrency": 2}),
        # The inference actor serves every self-play actor at once from its event loop: many calls in flight.
        inference=(Role(1, 1.0, inference_gpus, inference_device, options={"max_concurrency": 1000})
                   if mode == "central" else None),
        reanalyse=(Role(c.num_reanalyse_workers, c.reanalyse_cpus, c.reanalyse_gpus,
                        "cuda" if c.reanalyse_gpus > 0 else "cpu", options={"max_restarts": -1})
                   if config.reanalyse.fraction > 0 else None),
        learner_group=learner_ranks(c.num_learners, c.learner_cpus, learner_gpus) if c.num_learners > 1 else None,
        whole_search=whole_search,
        autoscaler_bundles=tuple({"CPU": c.selfplay_cpus} for _ in range(num_selfplay)) if c.request_resources else (),
        colocated=c.colocate_learner and not skipped,
        colocation_skipped=skipped,
        latent_slots=latent_slots,
        env_threads=env_threads,
        reanalyse_on_inference=config.reanalyse.fraction > 0 and c.reanalyse_gpus == 0 and whole_search,
    )
