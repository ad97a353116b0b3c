"""The learner's data path: replay batches into pinned memory, onto the device, and priorities back.

`Staging.upload(batch)` copies the fields the loss needs into a ring of pinned host buffers and issues the
host-to-device copies on a side CUDA stream (on the CPU it only wraps the arrays). When the replay keeps its
observations in shared memory (`replay.shared_obs`) and this process is on the replay's node, the batch
comes without observations and `ObsStore` gathers them straight from /dev/shm into the pinned buffers with a
few threads (numpy releases the GIL), then drops samples whose positions were rewritten meanwhile (their
loss weight becomes 0). On a GPU with room for it, `DeviceObsCache` keeps a copy of those observations in
device memory, so only positions written since they were last sampled cross the host.

`Prefetcher` runs this in a background thread, `depth` batches ahead of the update, with `depth` sample
calls in flight to the replay actor. `PriorityOutbox` copies each step's priorities to pinned memory without
a sync and sends them to the replay from another thread once the copy is done.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch

from rayzero.replay.buffer import Batch, frame_slots, node_id
from rayzero import shm

# Batch fields the loss reads; indices and generations stay on the host.
DEVICE_FIELDS = ("obs", "actions", "target_values", "target_rewards", "target_policies", "value_mask",
                 "reward_mask", "policy_mask", "weights", "next_obs", "next_mask", "bootstrap_obs", "bootstrap_scale")
OBS_FIELDS = {"obs": "indices", "next_obs": "next_index", "bootstrap_obs": "bootstrap_index"}


class Uploaded(NamedTuple):
    tensors: dict[str, torch.Tensor]  # device tensors (valid on the current stream after `ready`)
    indices: np.ndarray  # [B]
    generations: np.ndarray  # [B]
    stale: int  # samples dropped because their segment was rewritten while being gathered
    event: Any  # torch.cuda.Event to wait on, or None

    def ready(self) -> dict[str, torch.Tensor]:
        """Make the copies visible to the current stream; returns the tensors."""
        if self.event is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(self.event)
            for tensor in self.tensors.values():
                tensor.record_stream(stream)
        return self.tensors


class ObsStore:
    """The replay's shared observation and generation arrays, mapped read-only."""

    def __init__(self, info: dict, threads: int):
        self.obs = shm.open_readonly(info["obs"])  # observations, or single frames (replay.frame_stack)
        self.generation = shm.open_readonly(info["generation"])
        self.stack = int(info.get("frame_stack") or 1)
        self.obs_shape = tuple(info.get("obs_shape") or self.obs.shape[1:])  # of one (stacked) observation
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="rayzero-gather") if threads > 1 else None
        self.threads = threads

    @staticmethod
    def open(info: dict | None, threads: int) -> ObsStore | None:
        """None unless `info` (from replay.obs_store()) names arrays on this node that can be opened."""
        if not info or info.get("node") != node_id():
            return None
        try:
            return ObsStore(info, threads)
        except (OSError, ValueError):
            return None

    def slots(self, index: np.ndarray) -> np.ndarray:
        """The slots of the shared array that hold the observations at positions `index` (replay's layout)."""
        return frame_slots(index, self.stack)

    def gather(self, index: np.ndarray, out: np.ndarray) -> None:
        """index [N] positions -> out [N, *obs_shape] (a pinned buffer), in `threads` chunks; in frame mode the
        frames of each observation land next to each other, which is the stacked layout."""
        self.gather_slots(self.slots(index.reshape(-1)), out)

    def gather_slots(self, index: np.ndarray, out: np.ndarray) -> None:
        """Slots [...] of the shared array -> out (their contents, back to back)."""
        index = index.reshape(-1)
        out = out.reshape((len(index),) + self.obs.shape[1:])
        if self.pool is None or len(index) < 2 * self.threads:
            np.take(self.obs, index, axis=0, out=out, mode="clip")
            return
        bounds = np.linspace(0, len(index), self.threads + 1).astype(int)
        jobs = [self.pool.submit(np.take, self.obs, index[a:b], 0, out[a:b], "clip")
                for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        for job in jobs:
            job.result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False)


class DeviceObsCache:
    """A copy of the replay's shared observations in device memory, filled as positions are sampled.

    Each cached position remembers the replay generation it was copied at; a batch's positions whose generation
    moved on (new data) are gathered from /dev/shm into pinned memory, copied up and scattered into the cache,
    and every observation field of the batch is then one gather on the device. In steady state only positions
    written since they were last sampled cross the host, instead of every observation of every batch.

    A position is only committed for samples whose segment was intact from sampling until after its gather (the
    same check as the host path), so the cache never holds a half-written observation under a valid generation.
    """

    def __init__(self, store: ObsStore, device: torch.device):
        self.store = store
        self.device = device
        capacity = store.obs.shape[0]
        self.obs = torch.zeros((capacity, *store.obs.shape[1:]), dtype=torch.from_numpy(np.empty(0, store.obs.dtype)).dtype,
                               device=device)
        self.held = np.full(capacity, -1, dtype=np.int64)  # generation of each cached copy; -1: none
        self.uploaded = 0  # positions copied up so far

    @staticmethod
    def fits(store: ObsStore, device: torch.device, fraction: float = 0.5) -> bool:
        """Whether a cache of the whole replay takes at most `fraction` of the device's free memory."""
        if device.type != "cuda":
            return True
        free, _ = torch.cuda.mem_get_info(device)
        return store.obs.nbytes <= fraction * free

    def prepare(self, batch: Batch, positions: dict[str, np.ndarray], slot: dict[str, torch.Tensor] | None
                ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
        """Host side: gathers the positions the cache lacks into `slot`'s pinned buffer (or a plain array).

        Returns the samples whose segment changed since sampling (their loss weight must be 0), and the
        (slots, generations, observations or frames) to commit, or None."""
        positions = {name: self.store.slots(p) for name, p in positions.items()}  # frame mode: frame slots
        everything = np.concatenate([p.reshape(-1) for p in positions.values()])
        unique = np.unique(everything)
        current = self.store.generation[unique]  # read before the gather (see the class docstring)
        lacking = self.held[unique] != current
        miss, miss_generation = unique[lacking], current[lacking]
        host = None
        if len(miss):
            shape = (len(miss), *self.store.obs.shape[1:])  # one slot each (an observation or a frame)
            if slot is not None:
                buffer = slot.get("_cache_miss")
                if buffer is None or buffer.shape[0] < len(miss):
                    buffer = torch.from_numpy(np.empty((max(len(miss), 2 * len(everything)), *shape[1:]),
                                                       dtype=self.store.obs.dtype)).pin_memory()
                    slot["_cache_miss"] = buffer
                host = buffer.numpy()[: len(miss)]
            else:
                host = np.empty(shape, dtype=self.store.obs.dtype)
            self.store.gather_slots(miss, host)
        changed = self.store.generation[batch.indices] != batch.generations
        if not len(miss):
            return changed, None
        if changed.any():  # positions of rewritten segments are not committed
            bad = np.unique(np.concatenate([p[changed].reshape(-1) for p in positions.values()]))
            keep = ~np.isin(miss, bad)
            miss, miss_generation, host = miss[keep], miss_generation[keep], host[keep]
        return changed, (miss, miss_generation, host)

    def commit(self, update: tuple[np.ndarray, np.ndarray, np.ndarray] | None) -> None:
        """Device side (on the current stream): copy the gathered observations up and into the cache."""
        if update is None or not len(update[0]):
            return
        miss, generation, host = update
        index = torch.from_numpy(miss).to(self.device, non_blocking=True)
        self.obs.index_copy_(0, index, torch.from_numpy(host).to(self.device, non_blocking=True))
        self.held[miss] = generation
        self.uploaded += len(miss)

    def lookup(self, index: np.ndarray) -> torch.Tensor:
        """[*index.shape, *obs_shape] observations from the cache (on the current stream)."""
        slots = self.store.slots(np.array(index, dtype=np.int64))
        flat = torch.from_numpy(slots.reshape(-1)).to(self.device, non_blocking=True)
        return self.obs.index_select(0, flat).reshape(*index.shape, *self.store.obs_shape)


class Staging:
    """Batches -> device tensors through a ring of pinned buffers and a side stream (CUDA), or in place (CPU).

    With `obs_cache` (and a mapped store) observations come from a `DeviceObsCache` instead of being gathered
    for every batch."""

    def __init__(self, device: torch.device, store: ObsStore | None = None, slots: int = 3, obs_cache: bool = False):
        self.device = device
        self.store = store
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.slots: list[dict[str, torch.Tensor]] = [{} for _ in range(slots)]
        self.slot_events: list[Any] = [None] * slots
        self.next_slot = 0
        self.cache = DeviceObsCache(store, device) if obs_cache and store is not None else None

    def _cached_positions(self, batch: Batch) -> dict[str, np.ndarray]:
        """The observation fields to take from the cache: {field: positions}."""
        if self.cache is None:
            return {}
        return {name: np.asarray(getattr(batch, index_name)) for name, index_name in OBS_FIELDS.items()
                if getattr(batch, name) is None and getattr(batch, index_name) is not None}

    def _host_arrays(self, batch: Batch, slot: dict[str, torch.Tensor] | None, skip: tuple[str, ...] = ()
                     ) -> tuple[dict[str, np.ndarray], int]:
        arrays: dict[str, np.ndarray] = {}
        for name in DEVICE_FIELDS:
            if name in skip:
                continue
            value = getattr(batch, name)
            index_name = OBS_FIELDS.get(name)
            from_store = value is None and index_name is not None and getattr(batch, index_name) is not None
            if value is None and not from_store:
                continue
            if from_store:
                if self.store is None:
                    raise ValueError(f"learner: the batch has no {name} and no shared observation store is mapped")
                index = getattr(batch, index_name)
                shape, dtype = index.shape + self.store.obs_shape, self.store.obs.dtype
            else:
                value = np.asarray(value)
                shape, dtype = value.shape, value.dtype
            if slot is not None:
                buffer = slot.get(name)
                if buffer is None or tuple(buffer.shape) != shape or buffer.numpy().dtype != dtype:
                    buffer = torch.from_numpy(np.empty(shape, dtype=dtype)).pin_memory()
                    slot[name] = buffer
                target = buffer.numpy()
            else:
                target = np.empty(shape, dtype=dtype)
            if from_store:
                self.store.gather(index, target)
            else:
                np.copyto(target, value)  # one copy out of Ray's read-only object store
            arrays[name] = target
        stale = 0
        if self.store is not None and batch.obs is None and not skip:
            # A writer bumps a segment's generations before touching its observations: checked after the gather,
            # an unchanged generation means every observation gathered belongs to the sampled segment.
            changed = self.store.generation[batch.indices] != batch.generations
            stale = int(changed.sum())
            if stale:
                arrays["weights"][changed] = 0.0
        return arrays, stale

    def upload(self, batch: Batch) -> Uploaded:
        cached = self._cached_positions(batch)
        slot = None
        if self.cuda:
            i = self.next_slot
            self.next_slot = (i + 1) % len(self.slots)
            if self.slot_events[i] is not None:
                self.slot_events[i].synchronize()  # the previous copy out of this slot is done
            slot = self.slots[i]
        arrays, stale = self._host_arrays(batch, slot, skip=tuple(cached))
        update = None
        if cached:
            assert self.cache is not None
            changed, update = self.cache.prepare(batch, cached, slot)
            stale = int(changed.sum())
            if stale:
                arrays["weights"][changed] = 0.0
        if not self.cuda:
            tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
            if cached:
                self.cache.commit(update)
                tensors.update({name: self.cache.lookup(index) for name, index in cached.items()})
            return Uploaded(tensors, batch.indices, batch.generations, stale, None)
        with torch.cuda.stream(self.stream):
            tensors = {k: slot[k].to(self.device, non_blocking=True) for k in arrays}
            if cached:
                self.cache.commit(update)
                tensors.update({name: self.cache.lookup(index) for name, index in cached.items()})
            event = torch.cuda.Event()
            event.record(self.stream)
        self.slot_events[i] = event
        return Uploaded(tensors, batch.indices, batch.generations, stale, event)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


class Prefetcher:
    """A thread keeping `depth` uploaded batches ready (and `depth` sample calls in flight) for one replay."""

    def __init__(self, replay: Any, batch_size: int, device: torch.device, depth: int, gather_threads: int,
                 obs_cache: bool | None = None):
        import ray

        self.replay = replay
        store = ObsStore.open(ray.get(replay.obs_store.remote()), gather_threads)
        self.with_obs = store is None
        if obs_cache is None:  # default: on CUDA, when the whole replay fits in half the free memory
            obs_cache = store is not None and device.type == "cuda" and DeviceObsCache.fits(store, device)
        self.staging = Staging(device, store, slots=depth + 2, obs_cache=bool(obs_cache))
        self.batch_size = batch_size
        self.depth = depth
        self.device = device
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="rayzero-prefetch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import ray

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        pending: deque = deque()
        try:
            for _ in range(max(1, self.depth)):
                pending.append(self.replay.sample.remote(self.batch_size, with_obs=self.with_obs))
            while not self.stopping.is_set():
                batch = ray.get(pending.popleft())
                pending.append(self.replay.sample.remote(self.batch_size, with_obs=self.with_obs))
                item = self.staging.upload(batch)
                while not self.stopping.is_set():
                    try:
                        self.queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as error:  # noqa: BLE001 - handed to the training thread, which re-raises it
            self.queue.put(error)

    def get(self) -> Uploaded:
        item = self.queue.get()
        if isinstance(item, BaseException):
            self.stopping.set()
            raise item
        return item

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self.stopping.is_set()

    def close(self) -> None:
        self.stopping.set()
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        self.thread.join(timeout=10)
        self.staging.close()


class PriorityOutbox:
    """Sends each step's priorities [B] to the replay without making the training thread wait for the GPU."""

    def __init__(self, device: torch.device, slots: int = 8):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.slots: list[torch.Tensor | None] = [None] * slots
            self.next_slot = 0
            self.queue: queue.Queue = queue.Queue(maxsize=slots - 2)
            self.error: BaseException | None = None
            self.thread = threading.Thread(target=self._run, name="rayzero-priorities", daemon=True)
            self.thread.start()

    def put(self, replay: Any, indices: np.ndarray, generations: np.ndarray, priorities: torch.Tensor) -> None:
        if not self.cuda:
            replay.update_priorities.remote(indices, generations, priorities.float().numpy() + 1e-6)
            return
        if self.error is not None:
            raise self.error
        i = self.next_slot
        self.next_slot = (i + 1) % len(self.slots)
        host = self.slots[i]
        if host is None or host.shape != priorities.shape:
            host = self.slots[i] = torch.empty(priorities.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(priorities.detach(), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.queue.put((replay, indices, generations, host, event))

    def _run(self) -> None:
        torch.cuda.set_device(self.device)
        while True:
            item = self.queue.get()
            if item is None:
                self.queue.task_done()
                return
            replay, indices, generations, host, event = item
            try:
                event.synchronize()
                replay.update_priorities.remote(indices, generations, host.numpy() + 1e-6)
            except BaseException as error:  # noqa: BLE001 - raised in the training thread on the next put
                self.error = error
            finally:
                self.queue.task_done()

    def flush(self) -> None:
        """Wait until every queued update was sent."""
        if self.cuda:
            self.queue.join()
            if self.error is not None:
                raise self.error

    def close(self) -> None:
        if self.cuda:
            self.queue.put(None)
            self.thread.join(timeout=10)
