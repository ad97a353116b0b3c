"""The optional evaluation cache of initial inference, keyed by a hash of each observation row.

Shapes: C = capacity, A = actions. Host arrays hold value [C] and policy logits [C, A]; the latents live in
a device tensor [C, ...] owned by the runner, at the same entry index. Entries are reused least recently
used first. This module owns the key -> entry map, the LRU order and the hit-rate counters; the batcher
orders the device copies and host writes so that a batch reads its hits before its inserts overwrite
anything (see server.InferenceServer._launch_initial).
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np


def row_key(row: np.ndarray) -> bytes:
    """A 16-byte digest of one observation row (its bytes, dtype and shape)."""
    digest = hashlib.blake2b(np.ascontiguousarray(row).data, digest_size=16)
    digest.update(f"{row.dtype.str}{row.shape}".encode())
    return digest.digest()


class EvalCache:
    """LRU map observation key -> entry index, with host copies of each entry's value and logits."""

    def __init__(self, capacity: int, num_actions: int):
        self.capacity = capacity
        self.value = np.zeros(capacity, dtype=np.float32)
        self.logits = np.zeros((capacity, num_actions), dtype=np.float32)
        self._index: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))
        self.lookups = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._index)

    def lookup(self, keys: list[bytes]) -> np.ndarray:
        """[n] entry index of each key, -1 for a miss; hits become most recently used."""
        out = np.full(len(keys), -1, dtype=np.int64)
        for i, key in enumerate(keys):
            entry = self._index.get(key)
            if entry is not None:
                self._index.move_to_end(key)
                out[i] = entry
        self.lookups += len(keys)
        self.hits += int((out >= 0).sum())
        return out

    def insert(self, key: bytes) -> int:
        """A fresh entry index for `key` (evicting the least recently used entry when full)."""
        if self._free:
            entry = self._free.pop()
        else:
            _, entry = self._index.popitem(last=False)
        self._index[key] = entry
        return entry

    def drop(self, key: bytes) -> None:
        entry = self._index.pop(key, None)
        if entry is not None:
            self._free.append(entry)

    def clear(self) -> None:
        self._index.clear()
        self._free = list(range(self.capacity - 1, -1, -1))

    def stats(self) -> dict[str, float]:
        return {"entries": len(self._index), "capacity": self.capacity, "lookups": self.lookups, "hits": self.hits,
                "hit_rate": self.hits / self.lookups if self.lookups else 0.0}
