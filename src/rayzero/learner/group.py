"""A learner group: N DDP ranks in Ray actors behind one actor with the `Learner` remote API.

`LearnerGroup` reserves a STRICT_PACK placement group of the bundles that the resource plan gives it
(cluster/plan.py), starts a `LearnerRank` in each and joins them in one torch.distributed group (NCCL on GPUs,
with every rank seeing the group's GPUs so NCCL can go peer-to-peer; gloo on the CPU). Rank r samples its own
batch from replay shard r % shards and sends the priorities back there; the gradients are averaged, so the
ranks stay identical. Rank 0 answers `weights`, `counters` and `save`; `load` and `set_weights` go to all.
If a rank dies, the group restarts all ranks from the newest checkpoint it knows (`_checkpoint_path`) and
makes the failed call once more.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayzero.learner import checkpoint as ckpt
from rayzero.logs import logger


# Timings of a train call that differ between ranks (the group's result is rank 0's, plus these as lists).
PER_RANK = ("input_wait_s", "gc_ms", "manual_gc_ms", "launch_s", "call_s")


log = logger(__name__)


class LearnerRank:
    """One rank: `setup` joins the process group and builds a `Learner(distributed=True)`; the rest forwards."""

    def __init__(self) -> None:
        self.learner: Any = None

    def node_info(self) -> dict[str, Any]:
        return {"ip": ray.util.get_node_ip_address(), "gpus": [str(g) for g in ray.get_gpu_ids()]}

    def free_port(self) -> int:
        with socket.socket() as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def setup(self, rank: int, world_size: int, init_method: str, visible_gpus: list[str] | None,
              learner_args: tuple, timeout_s: float) -> str:
        import torch
        import torch.distributed as dist

        from rayzero.learner.learner import Learner

        backend = "gloo"
        if visible_gpus:
            own = str(ray.get_gpu_ids()[0])
            # Before CUDA starts in this process: see the whole group's GPUs (NCCL peer-to-peer), use our own.
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_gpus)
            # NVLink multicast buys nothing for a few-MB all-reduce; keep it off unless asked for.
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            torch.cuda.set_device(visible_gpus.index(own))
            backend = "nccl"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        self.learner = Learner(*learner_args, distributed=True)
        return str(self.learner.device)

    def train(self, replay: Any, num_steps: int) -> dict[str, Any]:
        return self.learner.train(replay, num_steps)

    def train_on(self, batches: list) -> dict[str, Any]:
        return self.learner.train_on(batches)

    def bench_steps(self, batch: Any, num_steps: int, warmup: int = 3) -> dict[str, float]:
        return self.learner.bench_steps(batch, num_steps, warmup)

    def weights(self) -> tuple[int, dict]:
        return self.learner.weights()

    def set_weights(self, version: int, state_dict: dict) -> int:
        return self.learner.set_weights(version, state_dict)

    def counters(self) -> dict[str, int]:
        return self.learner.counters()

    def save(self, directory: str) -> None:
        self.learner.save(directory)

    def load(self, directory: str) -> None:
        self.learner.load(directory)


class LearnerGroup:
    """The facade: the remote methods of `Learner` (train, weights, set_weights, counters, save, load,
    train_on, bench_steps) over N ranks, restarting the whole group from a checkpoint when a rank dies.

    learner_args: (model_cfg, learner_cfg, obs_shape, num_actions, seed, torch_threads) as for `Learner`;
    learner_cfg.device is set per rank ('cuda' when the rank options hold GPUs, else 'cpu'). `bundles` (one
    per rank) and `rank_options` come from the resource plan (`cluster.learner_ranks`).
    """

    def __init__(self, model_cfg: Any, cfg: Any, obs_shape: tuple[int, ...], num_actions: int, seed: int = 0,
                 torch_threads: int = 1, *, bundles: Sequence[dict[str, float]], rank_options: dict[str, Any],
                 checkpoint_root: str | None = None, setup_timeout_s: float = 600.0,
                 collective_timeout_s: float = 600.0):
        import dataclasses

        device = "cuda" if rank_options.get("num_gpus", 0) > 0 else "cpu"
        self.learner_args = (model_cfg, dataclasses.replace(cfg, device=device), tuple(obs_shape), num_actions,
                             seed, torch_threads)
        self.bundles = [dict(b) for b in bundles]
        self.rank_options = dict(rank_options)
        self.num_learners = len(self.bundles)
        self.use_gpus = device == "cuda"
        self.checkpoint_root = checkpoint_root
        self.setup_timeout_s = setup_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.last_checkpoint: str | None = None
        self.restarts = 0
        self.ranks: list[Any] = []
        self.pg: Any = None
        self._start()

    # -- life cycle ------------------------------------------------------------------------------------

    def _start(self) -> None:
        n = self.num_learners
        self.pg = placement_group(self.bundles, strategy="STRICT_PACK")
        try:
            ray.get(self.pg.ready(), timeout=self.setup_timeout_s)
        except GetTimeoutError:
            remove_placement_group(self.pg)
            raise RuntimeError(f"learner group: no node can hold {n} bundles of {self.bundles[0]} together "
                               f"(STRICT_PACK) within {self.setup_timeout_s:.0f}s; cluster has "
                               f"{ray.cluster_resources()}") from None
        rank_cls = ray.remote(LearnerRank)
        self.ranks = [
            rank_cls.options(
                **self.rank_options,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            ).remote()
            for i in range(n)
        ]
        infos = ray.get([r.node_info.remote() for r in self.ranks], timeout=self.setup_timeout_s)
        port = ray.get(self.ranks[0].free_port.remote())
        init_method = f"tcp://{infos[0]['ip']}:{port}"
        visible = None
        if self.use_gpus:
            visible = sorted({g for info in infos for g in info["gpus"]}, key=lambda g: (len(g), g))
        devices = ray.get([r.setup.remote(i, n, init_method, visible, self.learner_args, self.collective_timeout_s)
                           for i, r in enumerate(self.ranks)], timeout=self.setup_timeout_s)
        log.info(f"{n} ranks up on {devices} ({'nccl' if visible else 'gloo'})")

    def _stop(self) -> None:
        for rank in self.ranks:
            try:
                ray.kill(rank, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.ranks = []
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - already removed
                pass
            self.pg = None

    def _checkpoint_path(self) -> str | None:
        """The newest checkpoint under checkpoint_root, given or inferred from the directories passed to
        `save`/`load` (a directory inside RUN_DIR/checkpoints/ names RUN_DIR), else the last such directory
        itself; None: start fresh."""
        roots = [self.checkpoint_root] if self.checkpoint_root else []
        if self.last_checkpoint:
            parent = Path(self.last_checkpoint).parent
            if parent.name == ckpt.CHECKPOINTS:
                roots.append(str(parent.parent))
        for root in roots:
            try:
                return str(ckpt.latest(root))
            except ckpt.CheckpointError:
                continue
        if self.last_checkpoint and (Path(self.last_checkpoint) / ckpt.MODEL).exists():
            return self.last_checkpoint
        return None

    def restart(self) -> str | None:
        """Kill every rank, start the group again and load the newest known checkpoint; returns its path."""
        started = time.perf_counter()
        self._stop()
        self._start()
        path = self._checkpoint_path()
        if path is not None:
            ray.get([r.load.remote(path) for r in self.ranks])
        self.restarts += 1
        log.info(f"restarted ({self.restarts}) in {time.perf_counter() - started:.1f}s from "
            f"{path or 'fresh weights (no checkpoint known)'}")
        return path

    def close(self) -> None:
        self._stop()

    # -- calls -----------------------------------------------------------------------------------------

    def _wait_all(self, refs: list[Any]) -> list[Any]:
        """Results of all ranks. A dead rank raises RayActorError at once; any other error is raised once every
        rank has answered, or after a grace period in which the others may be stuck in a collective (then
        the group is restarted first)."""
        pending = list(refs)
        error: BaseException | None = None
        deadline = None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:  # ranks still busy after another rank failed: stuck in a collective
                self.restart()
                raise error  # type: ignore[misc]
            try:
                ray.get(ready[0])
            except RayActorError:
                raise
            except Exception as exc:  # noqa: BLE001 - re-raised below
                if error is None:
                    error, deadline = exc, time.monotonic() + 30.0
        if error is not None:
            raise error
        return ray.get(refs)

    def _retrying(self, who: str, method: str, call: Any) -> Any:
        """call(); if a rank died, restart the group from the last checkpoint and call once more."""
        try:
            return call()
        except RayActorError as error:
            log.info(f"{who} died during {method} ({type(error).__name__}); restarting the group")
            self.restart()
        return call()

    def _all(self, method: str, per_rank_args: list[tuple] | None = None, *args: Any) -> list[Any]:
        return self._retrying("a rank", method, lambda: self._wait_all([
            getattr(r, method).remote(*(per_rank_args[i] if per_rank_args else args))
            for i, r in enumerate(self.ranks)]))

    def _rank0(self, method: str, *args: Any) -> Any:
        return self._retrying("rank 0", method, lambda: ray.get(getattr(self.ranks[0], method).remote(*args)))

    def train(self, replay: Any, num_steps: int) -> dict[str, Any]:
        """num_steps DDP updates, each rank on its own batches; rank 0's result (metrics averaged over ranks).

        replay: one replay actor that every rank samples, or a list of shards (rank r samples r % len).
        """
        shards = list(replay) if isinstance(replay, (list, tuple)) else [replay]
        if not shards:
            raise ValueError("train: an empty list of replay shards")
        per_rank = [(shards[r % len(shards)], num_steps) for r in range(self.num_learners)]
        results = self._all("train", per_rank)
        result = results[0]
        result.update(restarts=self.restarts, num_learners=self.num_learners)
        result.update({f"{key}_per_rank": [r.get(key, 0.0) for r in results] for key in PER_RANK})
        return result

    def train_on(self, per_rank_batches: list[list[Any]]) -> dict[str, Any]:
        """Updates on explicit batches: per_rank_batches[r] is rank r's list (all of the same length)."""
        if len(per_rank_batches) != self.num_learners:
            raise ValueError(f"train_on: {len(per_rank_batches)} batch lists for {self.num_learners} ranks")
        results = self._all("train_on", [(b,) for b in per_rank_batches])
        result = results[0]
        result["priorities"] = [r["priorities"] for r in results]
        return result

    def bench_steps(self, batch: Any, num_steps: int, warmup: int = 3) -> dict[str, float]:
        return self._all("bench_steps", None, batch, num_steps, warmup)[0]

    def weights(self) -> tuple[int, dict]:
        return self._rank0("weights")

    def counters(self) -> dict[str, int]:
        return self._rank0("counters")

    def save(self, directory: str) -> None:
        self._rank0("save", directory)
        self.last_checkpoint = directory

    def load(self, directory: str) -> None:
        self._all("load", None, directory)
        self.last_checkpoint = directory

    def set_weights(self, version: int, state_dict: dict) -> int:
        return self._all("set_weights", None, version, state_dict)[0]

    def rank_handles(self) -> list[Any]:
        """The rank actors (tests kill one to exercise the restart)."""
        return list(self.ranks)

    def status(self) -> dict[str, Any]:
        return {"num_learners": self.num_learners, "restarts": self.restarts, "last_checkpoint": self.last_checkpoint,
                "checkpoint_root": self.checkpoint_root}
