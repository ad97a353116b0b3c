"""Reanalyse (MuZero Reanalyze): fresh policy targets and search values for stored positions.

A `ReanalyseWorker` (made a Ray actor in cluster/, one or more of them) takes a batch of positions from a replay
shard, runs one batched search over them with the latest published weights (on its GPU when it has one, as a
replayed CUDA graph of the whole search, falling back to eager search if the capture fails), and
writes the visit distributions and root values back over the stored ones. Later batches that include those
positions then train on targets of the current network rather than of the one that played them: the policy
targets directly, the value targets through the n-step bootstrap (the stored search value n steps ahead;
with a target network, learner.target_update_interval > 0, the bootstrap comes from the learner instead and
reanalyse refreshes the policy targets).

With a `server` (the inference actor, when it runs whole searches on a GPU) the worker holds no network: each
batch is one whole search there, with the weights the inference actor serves, batched with self-play's searches
of the same settings, so that reanalyse on a one-GPU host needs no GPU share of its own.

The driver keeps `reanalyse.fraction` positions re-searched per sample trained on (see schedule.py).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch

from rayzero.actors.network import LocalNetwork, RemoteNetwork
from rayzero.config import ModelConfig
from rayzero.logs import logger
from rayzero.models import build_model
from rayzero.tree import SearchConfig, search

log = logger(__name__)


class ReanalyseWorker:
    def __init__(self, model_cfg: ModelConfig, search_cfg: SearchConfig, discount: float,
                 obs_shape: tuple[int, ...], num_actions: int, seed: int = 0, torch_threads: int = 1,
                 device: str = "cpu", server: Any = None):
        torch.set_num_threads(torch_threads)
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.search_cfg = search_cfg
        self.remote: RemoteNetwork | None = None
        if server is not None:
            self.remote = RemoteNetwork(server, discount, f"reanalyse-{os.getpid()}", whole_search=True)
        else:
            self.network = LocalNetwork(build_model(model_cfg, obs_shape, num_actions).to(self.device), discount)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.version = -1
        # On CUDA, one whole search per batch size is captured as a CUDA graph (tree/capture.py) and replayed;
        # weights are updated in place, so the graphs stay valid across versions. None: capture failed, eager.
        self.captured: dict[int, Any] = {}
        self.capture_error: str | None = None

    def set_inference(self, server: Any) -> None:
        """Search through `server` from now on (the driver made a new inference actor after one died)."""
        if self.remote is not None:
            self.remote = self.remote.on(server)

    def set_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> int:
        if self.remote is not None:
            return self.version  # the inference actor's weights are the ones searched with
        self.network.set_weights(state_dict)
        self.version = version
        return version

    def _captured(self, root: Any) -> Any:
        """The CUDA-graph search for this batch size (captured on first use), or None to search eagerly."""
        if self.device.type != "cuda" or self.capture_error is not None:
            return None
        batch = root.prior_logits.shape[0]
        if batch not in self.captured:
            from rayzero.tree.capture import CapturedSearch

            try:
                self.captured[batch] = CapturedSearch(self.network.recurrent_fn, root,
                                                      self.search_cfg.num_simulations, self.search_cfg,
                                                      generator=self.generator)
            except Exception as error:  # noqa: BLE001 - any capture failure: keep reanalysing, eagerly
                self.capture_error = f"{type(error).__name__}: {error}"
                log.warning("search capture failed (%s); searching eagerly", self.capture_error[:300])
                return None
        return self.captured[batch]

    def targets(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(policies [B, A], root values [B]) of one batched search from observations [B, ...]."""
        if self.remote is not None:
            answer = self.remote.search(obs, self.search_cfg.temperature)
            self.version = int(answer["version"])
            return (np.asarray(answer["action_weights"], np.float32), np.asarray(answer["root_value"], np.float32))
        root = self.network.root(np.require(obs, requirements="W"))  # Ray's arrays are read-only: torch warns
        captured = self._captured(root)
        if captured is not None:
            out = captured(root, generator=self.generator)
        else:
            out = search(root, self.network.recurrent_fn, self.search_cfg.num_simulations, self.search_cfg,
                         generator=self.generator)
        self.network.release()
        return out.action_weights.float().cpu().numpy(), out.root_value.float().cpu().numpy()

    def reanalyse(self, replay: Any, weights: tuple[int, dict] | None, count: int) -> dict[str, Any]:
        """Re-search `count` positions of the replay actor `replay` and write their targets back."""
        import ray

        start = time.perf_counter()
        if weights is not None and weights[0] != self.version:
            self.set_weights(*weights)
        job = ray.get(replay.sample_positions.remote(count))
        if job is None:
            return {"positions": 0, "updated": 0, "version": self.version, "seconds": time.perf_counter() - start}
        policies, values = self.targets(job["obs"])
        updated = ray.get(replay.update_targets.remote(job["indices"], job["generations"], policies, values))
        return {"positions": len(job["indices"]), "updated": updated, "version": self.version,
                "seconds": time.perf_counter() - start}
