"""The central inference role: batches requests from many self-play actors into one network call.

Requests (initial inference from observations, recurrent inference from latent handles plus actions) enter
an asyncio queue. The batcher takes the first request, gathers more of the same kind until the rows reach
the largest bucket of the ladder or `max_wait_us` has passed, pads the rows up to a bucket size, runs the
network on one dedicated thread (never on the event loop), and answers each request with its own rows.

Latents never leave this actor: they live in a preallocated pool on the device, and clients hold slot
handles. A client's slots are freed by `release(client_id)`; a client that disappears without releasing
is reclaimed oldest-first when the pool runs short. An exhausted pool fails only the request that asked.

This is the CPU version; CUDA graphs per bucket, bf16 trunks and pinned double buffers plug in behind
`_run_batch` (the inference issue).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import time
from typing import Any

import numpy as np
import torch

from rayzero.config import InferenceConfig, ModelConfig
from rayzero.learner.learner import resolve_device
from rayzero.models import build_model


class InferenceError(ValueError):
    """A request was malformed or could not be served; only that request fails."""


def bucket_ladder(min_bucket: int, max_batch: int) -> list[int]:
    sizes, size = [], min_bucket
    while size < max_batch:
        sizes.append(size)
        size *= 2
    sizes.append(max_batch)
    return sizes


class LatentPool:
    """Fixed slots of latent states on the device; handles are slot indices."""

    def __init__(self, size: int, device: torch.device):
        self.size = size
        self.device = device
        self.latents: torch.Tensor | None = None
        self.free = list(range(size - 1, -1, -1))
        self.owned: collections.OrderedDict[str, list[int]] = collections.OrderedDict()

    def allocate(self, client: str, latents: torch.Tensor) -> np.ndarray:
        count = latents.shape[0]
        if self.latents is None:
            self.latents = torch.zeros(self.size, *latents.shape[1:], dtype=latents.dtype, device=self.device)
        if latents.shape[1:] != self.latents.shape[1:]:
            raise InferenceError(f"latent shape {tuple(latents.shape[1:])} does not match the pool's")
        # Reclaim the least recently active other clients until there is room.
        while len(self.free) < count and any(c != client for c in self.owned):
            oldest = next(c for c in self.owned if c != client)
            self.release(oldest)
        if len(self.free) < count:
            raise InferenceError(
                f"latent pool exhausted: {count} slots asked, {len(self.free)} free of inference.latent_pool_size="
                f"{self.size}; release finished searches or raise inference.latent_pool_size"
            )
        slots = [self.free.pop() for _ in range(count)]
        self.owned.setdefault(client, []).extend(slots)
        self.owned.move_to_end(client)
        index = torch.tensor(slots, device=self.device)
        self.latents[index] = latents
        return np.asarray(slots, dtype=np.int64)

    def gather(self, client: str, handles: np.ndarray) -> torch.Tensor:
        if self.latents is None or handles.size == 0:
            raise InferenceError("unknown latent handles: nothing was allocated")
        if handles.min() < 0 or handles.max() >= self.size:
            raise InferenceError(f"latent handle out of range [0, {self.size}): {handles.min()}..{handles.max()}")
        mine = self.owned.get(client)
        if mine is None or not np.isin(handles, mine).all():
            raise InferenceError(f"unknown latent handles for client {client!r} (released or never allocated)")
        self.owned.move_to_end(client)
        return self.latents[torch.as_tensor(handles, device=self.device)]

    def release(self, client: str) -> int:
        slots = self.owned.pop(client, [])
        self.free.extend(slots)
        return len(slots)


class InferenceServer:
    def __init__(self, model_cfg: ModelConfig, cfg: InferenceConfig, obs_shape: tuple[int, ...], num_actions: int,
                 seed: int = 0, torch_threads: int = 1):
        torch.set_num_threads(torch_threads)
        torch.manual_seed(seed)
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.obs_shape = tuple(obs_shape)
        self.num_actions = num_actions
        self.model = build_model(model_cfg, obs_shape, num_actions).to(self.device).eval()
        self.pool = LatentPool(cfg.latent_pool_size, self.device)
        self.ladder = bucket_ladder(cfg.min_bucket, cfg.max_batch)
        self.version = 0
        self.gpu = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")
        self.queue: asyncio.Queue | None = None
        self.batcher: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.metrics: dict[int, dict[str, float]] = {b: {"count": 0, "rows": 0, "padded": 0, "wait_s": 0.0,
                                                          "compute_s": 0.0} for b in self.ladder}
        self.errors = 0

    # -- public API (async actor methods) -------------------------------------------------------------

    async def initial(self, client: str, obs: np.ndarray) -> dict[str, np.ndarray]:
        try:
            obs = self._check_initial(obs)
        except InferenceError:
            self.errors += 1
            raise
        return await self._submit("initial", client, obs)

    def _check_initial(self, obs: np.ndarray) -> np.ndarray:
        obs = np.asarray(obs)
        if obs.ndim != len(self.obs_shape) + 1 or tuple(obs.shape[1:]) != self.obs_shape:
            raise InferenceError(f"initial: obs shape {obs.shape} must be [B, {', '.join(map(str, self.obs_shape))}]")
        if obs.dtype.kind == "f" and not np.isfinite(obs).all():
            raise InferenceError("initial: obs contains NaN or inf")
        return obs

    async def recurrent(self, client: str, handles: np.ndarray, actions: np.ndarray) -> dict[str, np.ndarray]:
        try:
            payload = self._check_recurrent(handles, actions)
        except InferenceError:
            self.errors += 1
            raise
        return await self._submit("recurrent", client, payload)

    def _check_recurrent(self, handles: np.ndarray, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        handles, actions = np.asarray(handles), np.asarray(actions)
        if handles.ndim != 1 or actions.shape != handles.shape or actions.dtype.kind not in "iu":
            raise InferenceError(
                f"recurrent: handles {handles.shape} and actions {actions.shape} ({actions.dtype}) must be "
                "equal-length 1-D integer arrays"
            )
        if actions.size and (actions.min() < 0 or actions.max() >= self.num_actions):
            raise InferenceError(f"recurrent: actions must be in [0, {self.num_actions})")
        return handles.astype(np.int64), actions.astype(np.int64)

    async def release(self, client: str) -> int:
        return self.pool.release(client)

    def set_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> int:
        # In place, between batches (on the GPU thread), so that captured graphs keep pointing at the weights.
        def copy() -> None:
            with torch.no_grad():
                for name, tensor in self.model.state_dict().items():
                    tensor.copy_(state_dict[name])
            self.version = version

        self.gpu.submit(copy).result()
        return version

    def get_version(self) -> int:
        return self.version

    def stats(self) -> dict[str, Any]:
        return {"version": self.version, "errors": self.errors, "buckets": self.metrics,
                "free_slots": len(self.pool.free)}

    # -- batching ------------------------------------------------------------------------------------

    async def _submit(self, kind: str, client: str, payload: Any) -> dict[str, np.ndarray]:
        loop = asyncio.get_running_loop()
        if self.queue is None or self._loop is not loop:
            # One batcher per event loop (a Ray async actor has one; in-process callers may start several).
            self._loop = loop
            self.queue = asyncio.Queue()
            self.batcher = loop.create_task(self._batch_loop())
        future = asyncio.get_running_loop().create_future()
        await self.queue.put((kind, client, payload, future, time.perf_counter()))
        try:
            return await future
        except InferenceError:
            self.errors += 1
            raise

    @staticmethod
    def _rows(kind: str, payload: Any) -> int:
        return len(payload) if kind == "initial" else len(payload[0])

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        held = None
        while True:
            first = held or await self.queue.get()
            held = None
            batch, rows = [first], self._rows(first[0], first[2])
            deadline = loop.time() + self.cfg.max_wait_us / 1e6
            while rows < self.cfg.max_batch:
                try:
                    item = self.queue.get_nowait() if loop.time() >= deadline else await asyncio.wait_for(
                        self.queue.get(), deadline - loop.time())
                except (asyncio.TimeoutError, asyncio.QueueEmpty):
                    break
                if item[0] != first[0] or rows + self._rows(item[0], item[2]) > self.cfg.max_batch:
                    held = item  # another kind or too big: it starts the next batch
                    break
                batch.append(item)
                rows += self._rows(item[0], item[2])
            try:
                results = await loop.run_in_executor(self.gpu, self._run_batch, first[0], batch)
            except Exception as error:  # noqa: BLE001 - one bad batch must not kill the actor
                results = [error] * len(batch)
            for (_, _, _, future, _), result in zip(batch, results):
                if future.done():
                    continue
                if isinstance(result, Exception):
                    future.set_exception(result if isinstance(result, InferenceError) else InferenceError(str(result)))
                else:
                    future.set_result(result)

    def _bucket(self, rows: int) -> int:
        for size in self.ladder:
            if rows <= size:
                return size
        return rows

    @torch.inference_mode()
    def _run_batch(self, kind: str, batch: list) -> list:
        start = time.perf_counter()
        results: list = [None] * len(batch)
        # Requests whose handles are bad fail alone; the others still run.
        inputs, good = [], []
        for i, (_, client, payload, _, _) in enumerate(batch):
            try:
                if kind == "initial":
                    inputs.append(torch.as_tensor(payload, device=self.device))
                else:
                    handles, actions = payload
                    inputs.append((self.pool.gather(client, handles), torch.as_tensor(actions, device=self.device)))
                good.append(i)
            except InferenceError as error:
                results[i] = error
        if not good:
            return results
        rows = sum(self._rows(kind, batch[i][2]) for i in good)
        bucket = self._bucket(rows)
        if kind == "initial":
            x = torch.cat(inputs)
            x = torch.cat([x, x[-1:].expand(bucket - rows, *x.shape[1:])]) if bucket > rows else x
            out = self.model.initial(x)
        else:
            latents = torch.cat([latent for latent, _ in inputs])
            actions = torch.cat([action for _, action in inputs])
            if bucket > rows:
                latents = torch.cat([latents, latents[-1:].expand(bucket - rows, *latents.shape[1:])])
                actions = torch.cat([actions, actions[-1:].expand(bucket - rows)])
            out = self.model.recurrent(latents, actions)
        value, reward = out.value[:rows].float().cpu().numpy(), out.reward[:rows].float().cpu().numpy()
        logits = out.policy_logits[:rows].float().cpu().numpy()
        offset = 0
        for i in good:
            n = self._rows(kind, batch[i][2])
            sl = slice(offset, offset + n)
            if not (np.isfinite(value[sl]).all() and np.isfinite(logits[sl]).all()):
                results[i] = InferenceError(f"{kind}: the network produced NaN for this request (NaN input?)")
            else:
                try:
                    handles = self.pool.allocate(batch[i][1], out.latent[offset:offset + n])
                    results[i] = {"handles": handles, "value": value[sl], "reward": reward[sl],
                                  "policy_logits": logits[sl]}
                except InferenceError as error:
                    results[i] = error
            offset += n
        stats = self.metrics.setdefault(bucket, {"count": 0, "rows": 0, "padded": 0, "wait_s": 0.0, "compute_s": 0.0})
        stats["count"] += 1
        stats["rows"] += rows
        stats["padded"] += bucket - rows
        stats["wait_s"] += sum(start - item[4] for item in batch)
        stats["compute_s"] += time.perf_counter() - start
        return results
