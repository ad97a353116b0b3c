"""The learner's data path: replay batches into pinned memory, onto the device, and priorities back.

`Staging.upload(batch)` copies the fields the loss needs into a ring of pinned host buffers and issues the
host-to-device copies on a side CUDA stream (on the CPU it only wraps the arrays). When the replay keeps its
observations in shared memory (`replay.shared_obs`) and this process is on the replay's node, the batch
comes without observations and `ObsStore` gathers them straight from /dev/shm into the pinned buffers with a
few threads (numpy releases the GIL), then drops samples whose positions were rewritten meanwhile (their
loss weight becomes 0).

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

from rayzero.replay.buffer import Batch, node_id
from rayzero.replay import shared

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
        self.obs = shared.open_readonly(info["obs"])
        self.generation = shared.open_readonly(info["generation"])
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

    def gather(self, index: np.ndarray, out: np.ndarray) -> None:
        """index [N] positions -> out [N, *obs_shape] (a pinned buffer), in `threads` chunks."""
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


class Staging:
    """Batches -> device tensors through a ring of pinned buffers and a side stream (CUDA), or in place (CPU)."""

    def __init__(self, device: torch.device, store: ObsStore | None = None, slots: int = 3):
        self.device = device
        self.store = store
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.slots: list[dict[str, torch.Tensor]] = [{} for _ in range(slots)]
        self.slot_events: list[Any] = [None] * slots
        self.next_slot = 0

    def _host_arrays(self, batch: Batch, slot: dict[str, torch.Tensor] | None) -> tuple[dict[str, np.ndarray], int]:
        arrays: dict[str, np.ndarray] = {}
        for name in DEVICE_FIELDS:
            value = getattr(batch, name)
            index_name = OBS_FIELDS.get(name)
            from_store = value is None and index_name is not None and getattr(batch, index_name) is not None
            if value is None and not from_store:
                continue
            if from_store:
                if self.store is None:
                    raise ValueError(f"learner: the batch has no {name} and no shared observation store is mapped")
                index = getattr(batch, index_name)
                shape, dtype = index.shape + self.store.obs.shape[1:], self.store.obs.dtype
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
        if self.store is not None and batch.obs is None:
            # A writer bumps a segment's generations before touching its observations: checked after the gather,
            # an unchanged generation means every observation gathered belongs to the sampled segment.
            changed = self.store.generation[batch.indices] != batch.generations
            stale = int(changed.sum())
            if stale:
                arrays["weights"][changed] = 0.0
        return arrays, stale

    def upload(self, batch: Batch) -> Uploaded:
        if not self.cuda:
            arrays, stale = self._host_arrays(batch, None)
            tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
            return Uploaded(tensors, batch.indices, batch.generations, stale, None)
        i = self.next_slot
        self.next_slot = (i + 1) % len(self.slots)
        if self.slot_events[i] is not None:
            self.slot_events[i].synchronize()  # the previous copy out of this slot is done
        arrays, stale = self._host_arrays(batch, self.slots[i])
        with torch.cuda.stream(self.stream):
            tensors = {k: self.slots[i][k].to(self.device, non_blocking=True) for k in arrays}
            event = torch.cuda.Event()
            event.record(self.stream)
        self.slot_events[i] = event
        return Uploaded(tensors, batch.indices, batch.generations, stale, event)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


class Prefetcher:
    """A thread keeping `depth` uploaded batches ready (and `depth` sample calls in flight) for one replay."""

    def __init__(self, replay: Any, batch_size: int, device: torch.device, depth: int, gather_threads: int):
        import ray

        self.replay = replay
        store = ObsStore.open(ray.get(replay.obs_store.remote()), gather_threads)
        self.with_obs = store is None
        self.staging = Staging(device, store, slots=depth + 2)
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
