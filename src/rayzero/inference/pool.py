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
        self._reclaimed: set[str] = set()  # clients whose slots were taken back, until they allocate again

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

    def _reclaim(self, client: str) -> None:
        self._release(client)
        self.reclaimed_clients += 1
        self._reclaimed.add(client)

    def _unknown(self, client: str) -> InferenceError:
        if client in self._reclaimed:
            why = (f"reclaimed: the pool of inference.latent_pool_size={self.size} ran short, so this idle client's "
                   "slots went to others; raise it" + (f" or inference.latent_timeout_s={self.timeout_s:g}"
                                                       if self.timeout_s > 0 else ""))
        else:
            why = "released or never allocated"
        return InferenceError(f"unknown latent handles for client {client!r} ({why})")

    def _expire(self, now: float, keep: str) -> None:
        if self.timeout_s <= 0:
            return
        for client, last in list(self._active.items()):
            if now - last <= self.timeout_s:
                break
            if client != keep and client in self._slots:
                self._reclaim(client)

    def allocate(self, client: str, count: int) -> np.ndarray:
        """[count] int64 fresh slots for `client` (reclaiming idle or least recent clients if needed)."""
        with self._lock:
            now = self.clock()
            self._expire(now, keep=client)
            while self._top < count:
                victim = next((c for c in self._active if c != client and c in self._slots), None)
                if victim is None:
                    break
                self._reclaim(victim)
            if self._top < count:
                raise InferenceError(
                    f"latent pool exhausted: {count} slots asked, {self._top} free of inference.latent_pool_size="
                    f"{self.size}; release finished searches or raise inference.latent_pool_size"
                )
            slots = self._free[self._top - count:self._top][::-1].copy()
            self._top -= count
            self._reclaimed.discard(client)
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
                raise self._unknown(client)
            self._touch(client, self.clock())

    def check_allocate(self, clients: list[str], handles: list[np.ndarray], store: list[bool]
                       ) -> list[np.ndarray | InferenceError]:
        """For each request i of a batch, in order: `check(clients[i], handles[i])`, then its new slots
        `allocate(clients[i], len(handles[i]))` if store[i], else -1 per row; or the InferenceError that request
        alone gets (the others are served). One lock and one vectorised check for the whole batch when the pool
        has the slots and no timeout can reclaim a client meanwhile; otherwise request by request, as above."""
        n = len(clients)
        counts = [len(h) for h in handles]
        with self._lock:
            wanted = sum(c for c, s in zip(counts, store) if s)
            if self.timeout_s <= 0 and self._top >= wanted and n:
                return self._check_allocate_at_once(clients, handles, store, counts, wanted)
        out: list[np.ndarray | InferenceError] = []
        for client, h, keep, count in zip(clients, handles, store, counts):
            try:
                self.check(client, h)
                out.append(self.allocate(client, count) if keep else np.full(count, -1, np.int64))
            except InferenceError as error:
                out.append(error)
        return out

    def _check_allocate_at_once(self, clients: list[str], handles: list[np.ndarray], store: list[bool],
                                counts: list[int], wanted: int) -> list[np.ndarray | InferenceError]:
        """`check_allocate` under the lock, with `wanted` <= free slots: nothing is reclaimed, so checking every
        request first and then allocating gives what request-by-request order does."""
        n = len(clients)
        now = self.clock()
        flat = np.concatenate(handles) if n > 1 else handles[0]
        cids = [self._ids.get(c, -2) if c in self._slots else -2 for c in clients]
        refused: list[InferenceError | None] = [None] * n
        if len(flat):
            expected = np.repeat(np.asarray(cids, np.int64), counts) if n > 1 else cids[0]
            if flat.min() < 0 or flat.max() >= self.size:
                in_range = (flat >= 0) & (flat < self.size)
                wrong = ~in_range | (self._owner[np.where(in_range, flat, 0)] != expected)
            else:
                in_range, wrong = None, self._owner[flat] != expected
            if wrong.any():  # the rare case: say which requests, and why (range first, as `check` does)
                offset = 0
                for i, (client, count) in enumerate(zip(clients, counts)):
                    rows = slice(offset, offset + count)
                    offset += count
                    if in_range is not None and not in_range[rows].all():
                        h = handles[i]
                        refused[i] = InferenceError(
                            f"latent handle out of range [0, {self.size}): {int(h.min())}..{int(h.max())}")
                    elif wrong[rows].any():
                        refused[i] = self._unknown(client)
        fresh = self._free[self._top - wanted:self._top][::-1].copy()
        out: list[np.ndarray | InferenceError] = []
        owners: list[int] = []
        lengths: list[int] = []
        offset = 0
        for client, count, keep, error in zip(clients, counts, store, refused):
            if error is not None:
                out.append(error)
                continue
            if count or keep:
                self._touch(client, now)
            if not keep:
                out.append(np.full(count, -1, np.int64))
                continue
            slots = fresh[offset:offset + count]
            offset += count
            owners.append(self._ids.setdefault(client, len(self._ids)))
            lengths.append(count)
            self._slots.setdefault(client, []).append(slots)
            self._reclaimed.discard(client)
            out.append(slots)
        if offset:
            taken = fresh[:offset]
            self._owner[taken] = owners[0] if len(owners) == 1 else np.repeat(np.asarray(owners, np.int64), lengths)
        self._top -= offset  # what refused requests would have had stays on the stack, where it was
        return out

    def release(self, client: str) -> int:
        """Free every slot of `client`; returns how many."""
        with self._lock:
            return self._release(client)

