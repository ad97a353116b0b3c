"""Host-side bookkeeping of the latent pool: which slot belongs to which client, and when slots come back.

Shapes: S = pool size. The latents themselves live in one device tensor [S + max_batch, ...] owned by the
runner (runner.py); this module owns only the slot numbers: a free stack, the owner of each slot, the
slots of each client, and each client's last activity (for LRU and timeout reclamation).

Slots of a client are freed by `release(client)`. A client that disappears without releasing is reclaimed
when it has been idle `timeout_s` (if > 0), or, least recently active first, when the pool runs short.
An exhausted pool raises InferenceError for the request that asked; the others are unaffected.
Thread-safe (the batcher's GPU thread allocates, the event loop releases).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

import numpy as np

from rayzero.inference.errors import InferenceError


class LatentPool:
    """Slot handles [0, size) of the device latent pool, owned by clients."""

    def __init__(self, size: int, timeout_s: float = 0.0, clock: Callable[[], float] = time.monotonic):
        self.size = size
        self.timeout_s = timeout_s
        self.clock = clock
        self._free = np.arange(size - 1, -1, -1, dtype=np.int64)  # a stack: the top is _free[_top - 1]
        self._top = size
        self._owner = np.full(size, -1, dtype=np.int64)
        self._ids: dict[str, int] = {}
        self._slots: dict[str, list[np.ndarray]] = {}
        self._active: collections.OrderedDict[str, float] = collections.OrderedDict()  # oldest first
        self._lock = threading.Lock()
        self.reclaimed_clients = 0

    @property
    def free(self) -> int:
        return self._top

    @property
    def clients(self) -> int:
        return len(self._slots)

    def _touch(self, client: str, now: float) -> None:
        self._active[client] = now
        self._active.move_to_end(client)

    def _release(self, client: str) -> int:
        parts = self._slots.pop(client, [])
        self._active.pop(client, None)
        if not parts:
            return 0
        slots = np.concatenate(parts)
        self._owner[slots] = -1
        self._free[self._top:self._top + len(slots)] = slots
        self._top += len(slots)
        return len(slots)

    def _expire(self, now: float, keep: str) -> None:
        if self.timeout_s <= 0:
            return
        for client, last in list(self._active.items()):
            if now - last <= self.timeout_s:
                break
            if client != keep and client in self._slots:
                self._release(client)
                self.reclaimed_clients += 1

    def allocate(self, client: str, count: int) -> np.ndarray:
        """[count] int64 fresh slots for `client` (reclaiming idle or least recent clients if needed)."""
        with self._lock:
            now = self.clock()
            self._expire(now, keep=client)
            while self._top < count:
                victim = next((c for c in self._active if c != client and c in self._slots), None)
                if victim is None:
                    break
                self._release(victim)
                self.reclaimed_clients += 1
            if self._top < count:
                raise InferenceError(
                    f"latent pool exhausted: {count} slots asked, {self._top} free of inference.latent_pool_size="
                    f"{self.size}; release finished searches or raise inference.latent_pool_size"
                )
            slots = self._free[self._top - count:self._top][::-1].copy()
            self._top -= count
            cid = self._ids.setdefault(client, len(self._ids))
            self._owner[slots] = cid
            self._slots.setdefault(client, []).append(slots)
            self._touch(client, now)
            return slots

    def check(self, client: str, handles: np.ndarray) -> None:
        """Raise InferenceError unless every handle [n] is a live slot of `client`."""
        with self._lock:
            if handles.size == 0:
                return
            low, high = int(handles.min()), int(handles.max())
            if low < 0 or high >= self.size:
                raise InferenceError(f"latent handle out of range [0, {self.size}): {low}..{high}")
            cid = self._ids.get(client)
            if cid is None or client not in self._slots or not (self._owner[handles] == cid).all():
                raise InferenceError(f"unknown latent handles for client {client!r} (released or never allocated)")
            self._touch(client, self.clock())

    def release(self, client: str) -> int:
        """Free every slot of `client`; returns how many."""
        with self._lock:
            return self._release(client)

