"""The network as a search sees it: `LocalNetwork` (a model in this process) or `RemoteNetwork` (the inference actor).

Both give the same two calls, batched over roots:
    root(obs [B, ...] numpy) -> RootOutput(prior_logits [B, A], value [B], embedding [B, ...])
    recurrent_fn(action [B], embedding [B, ...]) -> (RecurrentOutput, next_embedding)
With the inference actor the "embedding" is a tensor of latent-slot handles [B] int64: latents stay on the
inference device and only handles, actions, rewards, values and priors travel, through a shared-memory channel
when the actor is on this node (inference/channel.py), else through Ray calls.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from rayzero.inference.channel import GREEDY_OVERRIDES, InferenceClient
from rayzero.inference.errors import InferenceError
from rayzero.logs import first_line
from rayzero.models.networks import MuZeroNet
from rayzero.models.state import copy_into
from rayzero.tree import RecurrentOutput, RootOutput, SearchConfig, SearchOutput, search

log = logging.getLogger(__name__)
SEARCH_RETRIES = 2  # a whole search the inference actor failed is sent again this many times in a row


class LocalNetwork:
    """Evaluates with a network held in this process (the default on a CPU-only machine)."""

    def __init__(self, model: MuZeroNet, discount: float):
        self.model = model.eval()
        self.discount = discount
        self.device = next(model.parameters()).device

    def set_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        copy_into(self.model, state_dict)

    def pin(self, version: int, state_dict: dict[str, torch.Tensor]) -> bool:
        """Search with these weights from now on (this process's own copy: always pinned)."""
        self.set_weights(state_dict)
        return True

    @torch.inference_mode()
    def root(self, obs: np.ndarray) -> RootOutput:
        out = self.model.initial(torch.as_tensor(obs, device=self.device))
        return RootOutput(prior_logits=out.policy_logits, value=out.value, embedding=out.latent)

    @torch.inference_mode()
    def recurrent_fn(self, action: torch.Tensor, embedding: torch.Tensor) -> tuple[RecurrentOutput, torch.Tensor]:
        out = self.model.recurrent(embedding, action)
        discount = torch.full_like(out.value, self.discount)
        return RecurrentOutput(out.reward, discount, out.policy_logits, out.value), out.latent

    def release(self) -> None:
        """Nothing to free: the latents of a local search are ordinary tensors."""


def _tensor(array: np.ndarray) -> torch.Tensor:
    # Arrays that arrive through Ray are read-only views of the object store.
    return torch.from_numpy(array if array.flags.writeable else array.copy())


class RemoteNetwork:
    """Evaluates through the central inference actor; latents stay there, referred to by slot handles."""

    def __init__(self, server: Any, discount: float, client_id: str, whole_search: bool = False,
                 channel: bool = True):
        self.server = server
        self.discount = discount
        self.client_id = client_id
        self.whole_search = whole_search
        self.channel = channel
        self.client: Any = None  # an InferenceClient, opened at the first root (sized by its batch)
        self.search_clients: dict[int, Any] = {}  # slot -> the InferenceClient its whole searches go through
        # slot -> the search in flight (obs, temperature, greedy), sent again on failure
        self._sent: dict[int, tuple[np.ndarray, float, bool]] = {}

    def search(self, obs: np.ndarray, temperature: float, **overrides: Any) -> dict[str, np.ndarray]:
        """A whole search on the inference actor: action [B], action_weights [B, A], root_value [B], version (of
        the weights it searched with). overrides: other SearchConfig fields for this search, through a Ray call;
        a greedy one (temperature 0, no root noise: an evaluation's) and one without overrides go through a
        shared-memory channel where there is one."""
        greedy = {"temperature": temperature, **overrides} == GREEDY_OVERRIDES
        if overrides and not greedy:
            import ray

            return ray.get(self.server.search.remote(self.client_id, obs, temperature=temperature, **overrides))
        self.submit_search(obs, temperature, greedy=greedy)
        return self.wait_search()

    def on(self, server: Any) -> RemoteNetwork:
        """The same client on another inference actor (the driver made a new one after this one's died)."""
        return RemoteNetwork(server, self.discount, self.client_id, self.whole_search, self.channel)

    def twin(self, suffix: str) -> RemoteNetwork:
        """Another client of the same inference actor, with its own channel and latent slots (a search of its
        own can run beside this one's, in another thread)."""
        return RemoteNetwork(self.server, self.discount, f"{self.client_id}-{suffix}", self.whole_search, self.channel)

    def submit_search(self, obs: np.ndarray, temperature: float, slot: int = 0, greedy: bool = False) -> None:
        """Send a whole search without waiting; `wait_search(slot)` collects it. Each slot holds one search in
        flight (its own channel), so a caller can keep two going: one per half of its envs."""
        client = self.search_clients.get(slot)
        if client is None or len(obs) > client.obs_rows:
            if client is not None:
                client.close()
            client = InferenceClient(self.server, f"{self.client_id}-search{slot}", len(obs), len(obs),
                                     channel=self.channel)
            self.search_clients[slot] = client
        client.submit_search(obs, temperature, greedy)
        self._sent[slot] = (obs, temperature, greedy)

    def wait_search(self, slot: int = 0) -> dict[str, np.ndarray]:
        """The answer of the search in flight in `slot`. A search the inference actor failed (a CUDA error while
        it captured a graph, say) is sent again, up to SEARCH_RETRIES times in a row, so that one failed batch
        does not end a self-play actor; a request that keeps failing raises."""
        for attempt in range(SEARCH_RETRIES + 1):
            try:
                return self.search_clients[slot].wait_search()
            except InferenceError as error:
                if attempt == SEARCH_RETRIES:
                    raise
                log.warning("%s: whole search failed on the inference actor (%s); sending it again",
                            self.client_id, first_line(error, 200))
                self.search_clients[slot].submit_search(*self._sent[slot])
        raise AssertionError("unreachable")

    def set_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """The inference actor receives weights from the driver directly."""

    def pin(self, version: int, state_dict: dict[str, torch.Tensor]) -> bool:
        """Search with these weights from now on, on the inference actor's evaluation network
        (inference.pinned_eval); False where it has none (the searches then play its served weights)."""
        import ray

        return bool(ray.get(self.server.set_eval_weights.remote(version, state_dict, self.client_id)))

    def _client(self, rows: int) -> Any:
        if self.client is None or rows > self.client.obs_rows:
            if self.client is not None:
                self.client.close()
            # Recurrent requests carry one row per root (several with virtual loss): room for 4 per root.
            self.client = InferenceClient(self.server, self.client_id, 4 * rows, rows, channel=self.channel)
        return self.client

    def root(self, obs: np.ndarray) -> RootOutput:
        out = self._client(len(obs)).initial(obs)
        return RootOutput(
            prior_logits=_tensor(out["policy_logits"]),
            value=_tensor(out["value"]),
            embedding=_tensor(out["handles"]),
        )

    def recurrent_fn(self, action: torch.Tensor, embedding: torch.Tensor) -> tuple[RecurrentOutput, torch.Tensor]:
        client = self.client if self.client is not None else self._client(len(action))
        out = client.recurrent(embedding.numpy(), action.numpy())
        value = _tensor(out["value"])
        return (
            RecurrentOutput(
                _tensor(out["reward"]), torch.full_like(value, self.discount),
                _tensor(out["policy_logits"]), value,
            ),
            _tensor(out["handles"]),
        )

    def release(self) -> None:
        import ray

        ray.get(self.server.release.remote(self.client_id))


def search_observations(network: Any, obs: np.ndarray, config: SearchConfig,
                        generator: torch.Generator | None = None) -> SearchOutput:
    """One batched search from observations [B, ...] with `network` (either kind): the roots, the search, and the
    release of the latents it made. Under inference mode: no autograd bookkeeping on the many small ops."""
    with torch.inference_mode():
        root = network.root(obs)
        out = search(root, network.recurrent_fn, config.num_simulations, config, generator=generator)
    network.release()
    return out
