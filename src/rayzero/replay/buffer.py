"""The replay buffer: trajectory segments in flat ring arrays, prioritised sampling, n-step targets.

Segments are written contiguously into arrays of `capacity` transitions; when the write cursor would run
past the end it wraps to 0, and every segment that starts in the region about to be written is evicted
whole, so a stored segment is always complete. Each position records where its segment starts, its length,
and how the segment ends (terminal, or a bootstrap value), so the targets of a batch are gathered with a
few vectorised numpy operations.

A segment cut in the middle of an episode carries a tail of `unroll_steps + td_steps` extra steps whose
positions are not sampled as starts: they exist only to complete the targets of the positions before them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

from rayzero.config import ReplayConfig


class Segment(NamedTuple):
    """One env's steps, in order. T = steps stored, A = actions."""

    obs: np.ndarray  # [T, *obs_shape] observation the action was chosen on
    actions: np.ndarray  # [T] int64
    rewards: np.ndarray  # [T] float32, reward after each action
    policies: np.ndarray  # [T, A] float32, search policy targets
    root_values: np.ndarray  # [T] float32, search values at each observation
    num_sampleable: int  # positions [0, num_sampleable) can start a sampled unroll
    terminal: bool  # the episode ends with a terminal state after the last step
    bootstrap_value: float  # value after the last step when not terminal (episode truncated)


class Batch(NamedTuple):
    """A training batch. B = batch, K = unroll steps."""

    indices: np.ndarray  # [B] int64 flat positions, for update_priorities
    generations: np.ndarray  # [B] int64 write generation of those positions (stale updates are ignored)
    obs: np.ndarray  # [B, *obs_shape]
    actions: np.ndarray  # [B, K] int64
    target_values: np.ndarray  # [B, K+1] float32
    target_rewards: np.ndarray  # [B, K+1] float32 (column 0 unused, 0)
    target_policies: np.ndarray  # [B, K+1, A] float32
    value_mask: np.ndarray  # [B, K+1] float32
    reward_mask: np.ndarray  # [B, K+1] float32
    policy_mask: np.ndarray  # [B, K+1] float32
    weights: np.ndarray  # [B] float32 importance-sampling weights (max 1)


class ReplayBuffer:
    """Prioritised replay of segments; capacity counted in transitions."""

    def __init__(self, cfg: ReplayConfig, seed: int = 0):
        self.cfg = cfg
        self.capacity = cfg.capacity
        self.rng = np.random.default_rng(seed)
        self._arrays: dict[str, np.ndarray] | None = None
        self.cursor = 0
        self.size = 0  # transitions held
        self.num_sampleable = 0
        self.total_added = 0  # transitions ever added
        self.segments_added = 0
        self.max_priority = 1.0

    # -- storage -------------------------------------------------------------------------------------

    def _allocate(self, segment: Segment) -> None:
        cap = self.capacity
        self._arrays = {
            "obs": np.zeros((cap, *segment.obs.shape[1:]), dtype=segment.obs.dtype),
            "action": np.zeros(cap, dtype=np.int64),
            "reward": np.zeros(cap, dtype=np.float32),
            "policy": np.zeros((cap, segment.policies.shape[1]), dtype=np.float32),
            "root_value": np.zeros(cap, dtype=np.float32),
            "seg_start": np.zeros(cap, dtype=np.int64),
            "seg_len": np.zeros(cap, dtype=np.int64),
            "seg_terminal": np.zeros(cap, dtype=bool),
            "seg_bootstrap": np.zeros(cap, dtype=np.float32),
            "alive": np.zeros(cap, dtype=bool),
            "sampleable": np.zeros(cap, dtype=bool),
            "priority": np.zeros(cap, dtype=np.float64),
            "generation": np.zeros(cap, dtype=np.int64),
        }

    def _check(self, segment: Segment) -> None:
        length = len(segment.actions)
        if length == 0:
            raise ValueError("replay.add: empty segment")
        if length > self.capacity:
            raise ValueError(f"replay.add: segment of {length} steps exceeds replay.capacity={self.capacity}")
        for name in ("obs", "rewards", "policies", "root_values"):
            if len(getattr(segment, name)) != length:
                raise ValueError(
                    f"replay.add: segment.{name} has {len(getattr(segment, name))} steps, actions has {length}"
                )
        if not 0 < segment.num_sampleable <= length:
            raise ValueError(f"replay.add: num_sampleable={segment.num_sampleable} must be in [1, {length}]")
        if self._arrays is not None:
            a = self._arrays
            if segment.obs.shape[1:] != a["obs"].shape[1:] or segment.policies.shape[1] != a["policy"].shape[1]:
                raise ValueError(
                    f"replay.add: segment obs {segment.obs.shape[1:]} / actions {segment.policies.shape[1]} "
                    f"do not match the buffer's {a['obs'].shape[1:]} / {a['policy'].shape[1]}"
                )

    def _evict(self, start: int, stop: int) -> None:
        a = self._arrays
        starts = np.unique(a["seg_start"][start:stop][a["alive"][start:stop]])
        for s in starts:
            end = s + a["seg_len"][s]
            self.size -= int(a["alive"][s:end].sum())
            self.num_sampleable -= int(a["sampleable"][s:end].sum())
            a["alive"][s:end] = False
            a["sampleable"][s:end] = False
            a["priority"][s:end] = 0.0

    def add(self, segment: Segment) -> int:
        """Store one segment; returns the transitions now held."""
        self._check(segment)
        if self._arrays is None:
            self._allocate(segment)
        a = self._arrays
        length = len(segment.actions)
        if self.cursor + length > self.capacity:
            self.cursor = 0
        start, stop = self.cursor, self.cursor + length
        self._evict(start, stop)
        a["obs"][start:stop] = segment.obs
        a["action"][start:stop] = segment.actions
        a["reward"][start:stop] = segment.rewards
        a["policy"][start:stop] = segment.policies
        a["root_value"][start:stop] = segment.root_values
        a["seg_start"][start:stop] = start
        a["seg_len"][start:stop] = length
        a["seg_terminal"][start:stop] = segment.terminal
        a["seg_bootstrap"][start:stop] = segment.bootstrap_value
        a["alive"][start:stop] = True
        a["sampleable"][start:stop] = False
        a["sampleable"][start : start + segment.num_sampleable] = True
        a["priority"][start:stop] = 0.0
        a["priority"][start : start + segment.num_sampleable] = self.max_priority
        a["generation"][start:stop] += 1
        self.cursor = stop
        self.size += length
        self.num_sampleable += segment.num_sampleable
        self.total_added += segment.num_sampleable
        self.segments_added += 1
        return self.size

    # -- sampling ------------------------------------------------------------------------------------

    def sample(self, batch_size: int) -> Batch:
        """batch_size positions drawn with probability priority**alpha, with their K-step targets."""
        if self._arrays is None or self.num_sampleable == 0:
            raise ValueError("replay.sample: the buffer is empty")
        if batch_size < 1:
            raise ValueError(f"replay.sample: batch_size={batch_size} must be >= 1")
        a, cfg = self._arrays, self.cfg
        weights = a["priority"] ** cfg.priority_alpha if cfg.priority_alpha != 1.0 else a["priority"].copy()
        weights[~a["sampleable"]] = 0.0
        total = weights.sum()
        probs = weights / total
        index = self.rng.choice(self.capacity, size=batch_size, p=probs)
        is_weights = (self.num_sampleable * probs[index]) ** (-cfg.priority_beta)
        is_weights = (is_weights / is_weights.max()).astype(np.float32)
        return self._targets(index, is_weights)

    def _targets(self, index: np.ndarray, is_weights: np.ndarray) -> Batch:
        a, cfg = self._arrays, self.cfg
        num_actions = a["policy"].shape[1]
        K, n, gamma = cfg.unroll_steps, cfg.td_steps, cfg.discount
        seg_start, seg_len = a["seg_start"][index], a["seg_len"][index]
        terminal, bootstrap = a["seg_terminal"][index], a["seg_bootstrap"][index]
        offset = index - seg_start  # position inside the segment
        steps = np.arange(K + 1)
        pos = offset[:, None] + steps[None, :]  # [B, K+1] position of state k
        inside = pos < seg_len[:, None]

        def gather(name: str, positions: np.ndarray) -> np.ndarray:
            shape = (-1,) + (1,) * (positions.ndim - 1)
            flat = seg_start.reshape(shape) + np.minimum(positions, seg_len.reshape(shape) - 1)
            return a[name][flat]

        # Actions: real ones inside the segment, random ones past its end (their targets are masked or absorbing).
        action_pos = pos[:, :K]
        actions = gather("action", action_pos)
        past_end = action_pos >= seg_len[:, None]
        actions = np.where(past_end, self.rng.integers(0, num_actions, size=actions.shape), actions)

        # n-step value targets: z_j = sum_{i<n} gamma^i r_{j+i} + gamma^n v_{j+n}, cut at the segment's end.
        reward_pos = pos[:, :, None] + np.arange(n)[None, None, :]  # [B, K+1, n]
        rewards = gather("reward", reward_pos) * (reward_pos < seg_len[:, None, None])
        values = (rewards * gamma ** np.arange(n)).sum(-1)
        boot_pos = pos + n
        boot_inside = boot_pos < seg_len[:, None]
        boot_value = np.where(
            boot_inside,
            gather("root_value", boot_pos) * gamma**n,
            np.where(terminal[:, None], 0.0, bootstrap[:, None] * gamma ** np.maximum(seg_len[:, None] - pos, 0)),
        )
        values = (values + boot_value).astype(np.float32)
        # State k exists if inside; at the end of a terminal segment states are absorbing (value 0); after a
        # truncation only the state right at the cut has a known value (the bootstrap).
        values = np.where(inside, values, np.where(terminal[:, None], 0.0, bootstrap[:, None])).astype(np.float32)
        value_mask = inside | terminal[:, None] | (pos == seg_len[:, None])

        target_rewards = np.zeros((len(index), K + 1), dtype=np.float32)
        prev = pos[:, 1:] - 1  # transition that leads into state k
        target_rewards[:, 1:] = gather("reward", prev) * (prev < seg_len[:, None])
        reward_mask = np.ones((len(index), K + 1), dtype=bool)
        reward_mask[:, 0] = False
        reward_mask[:, 1:] = (prev < seg_len[:, None]) | terminal[:, None]

        policies = gather("policy", pos)
        policies[~inside] = 1.0 / num_actions
        return Batch(
            indices=index.astype(np.int64),
            generations=a["generation"][index].copy(),
            obs=a["obs"][index],
            actions=actions.astype(np.int64),
            target_values=values,
            target_rewards=target_rewards,
            target_policies=policies.astype(np.float32),
            value_mask=value_mask.astype(np.float32),
            reward_mask=reward_mask.astype(np.float32),
            policy_mask=inside.astype(np.float32),
            weights=is_weights,
        )

    def update_priorities(self, indices: np.ndarray, generations: np.ndarray, priorities: np.ndarray) -> None:
        """Set new priorities; entries whose position was overwritten since sampling are ignored."""
        a = self._arrays
        if a is None:
            return
        indices = np.asarray(indices, dtype=np.int64)
        priorities = np.asarray(priorities, dtype=np.float64)
        if not np.all(np.isfinite(priorities)) or np.any(priorities < 0):
            raise ValueError("replay.update_priorities: priorities must be finite and >= 0")
        fresh = (a["generation"][indices] == generations) & a["sampleable"][indices]
        a["priority"][indices[fresh]] = np.maximum(priorities[fresh], 1e-6)
        if fresh.any():
            self.max_priority = max(self.max_priority, float(priorities[fresh].max()))

    def stats(self) -> dict:
        return {
            "size": self.size,
            "sampleable": self.num_sampleable,
            "total_added": self.total_added,
            "segments_added": self.segments_added,
        }

    def __len__(self) -> int:
        return self.size

    # -- persistence ---------------------------------------------------------------------------------

    def snapshot(self, path: str | os.PathLike) -> None:
        """Write everything to `path` (.npz) atomically: a crash mid-write leaves the previous snapshot."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        meta = {
            "cursor": self.cursor, "size": self.size, "num_sampleable": self.num_sampleable,
            "total_added": self.total_added, "segments_added": self.segments_added,
            "max_priority": self.max_priority, "capacity": self.capacity,
        }
        arrays = {} if self._arrays is None else self._arrays
        with open(tmp, "wb") as f:
            np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def restore(self, path: str | os.PathLike) -> None:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(bytes(data["meta"]).decode())
            if meta["capacity"] != self.capacity:
                raise ValueError(
                    f"replay snapshot {path} has capacity {meta['capacity']}, the config asks {self.capacity}"
                )
            names = [k for k in data.files if k != "meta"]
            self._arrays = {k: data[k].copy() for k in names} if names else None
        for key in ("cursor", "size", "num_sampleable", "total_added", "segments_added", "max_priority"):
            setattr(self, key, meta[key])
