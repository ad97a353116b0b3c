"""The replay buffer: trajectory segments in flat ring arrays, prioritised sampling, n-step targets.

Segments are written contiguously into arrays of `capacity` transitions; when the write cursor would run
past the end it wraps to 0, and every segment that starts in the region about to be written is evicted
whole, so a stored segment is always complete. Each position records where its segment starts, its length,
and how the segment ends (terminal, or a bootstrap value), so the targets of a batch are gathered with a
few vectorised numpy operations.

A segment cut in the middle of an episode carries a tail of `unroll_steps + td_steps` extra steps whose
positions are not sampled as starts: they exist only to complete the targets of the positions before them.

With `replay.frame_stack = k > 1` (stacked image frames, newest last along channels) the "obs" array holds
single frames: a segment of n steps takes k - 1 + n slots, the k - 1 older frames of its first observation
followed by each step's newest frame, and the observation at a position is the k frames ending there
(`frames.stack_at`). Blocks are written and evicted whole, history slots included ("held").

Sampling draws from a sum tree of priority**alpha (`replay/sumtree.py`), O(B log capacity) per batch. With
`replay.shared_obs`, observations and write generations live in /dev/shm (`shm.py`): a learner on
the same node asks `sample(B, with_obs=False)` and gathers the observations itself, and checks afterwards
that the generations of its positions did not change (a write bumps them before it touches observations).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from rayzero.config import ReplayConfig
from rayzero import shm
from rayzero.replay.sumtree import SumTree


def frame_slots(positions: np.ndarray, stack: int) -> np.ndarray:
    """The slots holding the observations at `positions`: the positions themselves (stack 1), or in frame mode
    [*positions.shape, stack], the frames ending at each position (oldest first: the stacked layout)."""
    return positions if stack == 1 else positions[..., None] + np.arange(1 - stack, 1)


DIAGNOSTIC_SUMS = ("batches", "age_seconds", "age_transitions", "is_weight_mean", "is_weight_ess", "reward_nonzero")
"""Running sums over sampled batches kept by `ReplayBuffer.stats` (each a batch mean, summed over batches)."""


def diagnostic_means(now: dict, before: dict | None) -> dict[str, float]:
    """Per-batch means of the replay diagnostics between two `stats()` readings (`before` None: since start)."""
    before = before or {}
    batches = now.get("sampled_batches", 0.0) - before.get("sampled_batches", 0.0)
    if batches <= 0:
        return {}
    return {f"sample_{name}": (now[f"sampled_{name}"] - before.get(f"sampled_{name}", 0.0)) / batches
            for name in DIAGNOSTIC_SUMS if name != "batches"}


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
    history: np.ndarray | None = None
    # Frame form (replay.frame_stack = k): obs holds each step's newest frame [T, C, H, W] and history the
    # k - 1 older frames of the first step's observation [k - 1, C, H, W], a quarter of the bytes to send.

    def stacked_obs(self) -> np.ndarray:
        """[T, k * C, H, W] the observations, restacked when the segment is in frame form."""
        if self.history is None:
            return self.obs
        frames = np.concatenate([self.history, self.obs])
        k = len(self.history) + 1
        return np.stack([frames[t:t + k].reshape(-1, *frames.shape[2:]) for t in range(len(self.obs))])


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
    # Optional, behind ReplayConfig flags (None otherwise). *_obs are None when sampled with with_obs=False.
    next_index: np.ndarray | None = None  # [B, K] int64 positions of the observations at t+1..t+K (next_obs)
    next_mask: np.ndarray | None = None  # [B, K] float32, 1 where t+k is inside the segment (next_obs)
    next_obs: np.ndarray | None = None  # [B, K, *obs_shape] (next_obs)
    bootstrap_index: np.ndarray | None = None  # [B, K+1] int64 positions of the obs n steps ahead (bootstrap_obs)
    bootstrap_scale: np.ndarray | None = None  # [B, K+1] float32 gamma^n where that obs exists, else 0;
    # target_values then leave that term out: the learner adds bootstrap_scale * v_target(bootstrap_obs).
    bootstrap_obs: np.ndarray | None = None  # [B, K+1, *obs_shape] (bootstrap_obs)


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
        self.reanalysed = 0  # positions whose targets reanalyse replaced
        self.max_priority = 1.0
        self.tree = SumTree(cfg.capacity)  # leaf i = priority_i**alpha if position i is sampleable, else 0
        self.shared_paths: dict[str, str] | None = None  # obs and generation arrays live in /dev/shm
        self.stack = cfg.frame_stack if cfg.frame_stack > 1 else 1  # frames per observation
        self.history = self.stack - 1  # slots before a segment's first step (its first obs's older frames)
        self.obs_shape: tuple[int, ...] | None = None  # of one (stacked) observation
        # Learning diagnostics of the batches sampled so far (running sums; see `stats`).
        self.diagnostics = dict.fromkeys(DIAGNOSTIC_SUMS, 0.0)
        self.added_by_source: dict[str, int] = {}  # sampleable positions added per sender (`add(source=...)`)

    # -- storage -------------------------------------------------------------------------------------

    def _segment_obs_shape(self, segment: Segment) -> tuple[int, ...]:
        if segment.history is None:
            return tuple(segment.obs.shape[1:])
        if len(segment.history) + 1 != self.stack or segment.history.shape[1:] != segment.obs.shape[1:]:
            raise ValueError(f"replay.add: a segment in frame form with history {segment.history.shape} and frames "
                             f"{segment.obs.shape} does not fit replay.frame_stack={self.cfg.frame_stack}")
        return (segment.obs.shape[1] * self.stack, *segment.obs.shape[2:])

    def _allocate(self, segment: Segment) -> None:
        cap = self.capacity
        self.obs_shape = self._segment_obs_shape(segment)
        if self.stack > 1 and (len(self.obs_shape) != 3 or self.obs_shape[0] % self.stack):
            raise ValueError(f"replay.frame_stack={self.stack} needs image observations [frame_stack * C, H, W]; "
                             f"got observations of shape {self.obs_shape}")
        self._arrays = {
            "obs": np.zeros((cap, *self._slot_shape()), dtype=segment.obs.dtype),
            "action": np.zeros(cap, dtype=np.int64),
            "reward": np.zeros(cap, dtype=np.float32),
            "policy": np.zeros((cap, segment.policies.shape[1]), dtype=np.float32),
            "root_value": np.zeros(cap, dtype=np.float32),
            "seg_start": np.zeros(cap, dtype=np.int64),
            "seg_len": np.zeros(cap, dtype=np.int64),
            "seg_terminal": np.zeros(cap, dtype=bool),
            "seg_bootstrap": np.zeros(cap, dtype=np.float32),
            "alive": np.zeros(cap, dtype=bool),
            "held": np.zeros(cap, dtype=bool),  # part of a stored block (a step or a history frame)
            "sampleable": np.zeros(cap, dtype=bool),
            "priority": np.zeros(cap, dtype=np.float64),
            "generation": np.zeros(cap, dtype=np.int64),
            "added_time": np.zeros(cap, dtype=np.float64),  # wall-clock time the position was stored
            "added_count": np.zeros(cap, dtype=np.int64),  # total_added when it was stored
        }
        self._share(keep=False)

    def _share(self, keep: bool) -> None:
        """With replay.shared_obs, move obs and generation into /dev/shm (keep: with their contents)."""
        if not self.cfg.shared_obs or self.shared_paths is not None:
            return
        a = self._arrays
        created = shm.create(self, {"obs": (a["obs"].shape, a["obs"].dtype),
                                    "generation": (a["generation"].shape, a["generation"].dtype)})
        if created is None:
            return
        arrays, self.shared_paths = created
        if keep:
            for name, array in arrays.items():
                array[...] = a[name]
        a.update(arrays)

    def _slot_shape(self) -> tuple[int, ...]:
        """What one slot of the "obs" array holds: an observation, or one frame of it."""
        assert self.obs_shape is not None
        if self.stack == 1:
            return self.obs_shape
        return (self.obs_shape[0] // self.stack, *self.obs_shape[1:])

    def obs_at(self, positions: np.ndarray) -> np.ndarray:
        """[*positions.shape, *obs_shape] the observations at data positions (restacked in frame mode)."""
        return self._arrays["obs"][frame_slots(positions, self.stack)].reshape(*positions.shape, *self.obs_shape)

    def _check(self, segment: Segment) -> None:
        length = len(segment.actions)
        if length == 0:
            raise ValueError("replay.add: empty segment")
        if length + self.history > self.capacity:
            raise ValueError(f"replay.add: segment of {length} steps (+{self.history} history frames) exceeds "
                             f"replay.capacity={self.capacity}")
        for name in ("obs", "rewards", "policies", "root_values"):
            if len(getattr(segment, name)) != length:
                raise ValueError(
                    f"replay.add: segment.{name} has {len(getattr(segment, name))} steps, actions has {length}"
                )
        if not 0 < segment.num_sampleable <= length:
            raise ValueError(f"replay.add: num_sampleable={segment.num_sampleable} must be in [1, {length}]")
        # Checked here, on the host: on a GPU an action out of range or a non-finite target only shows as a
        # device-side assert in the learner's one-hot or two-hot scatter, which kills its process.
        num_actions = segment.policies.shape[1]
        actions = np.asarray(segment.actions)
        bad = (actions < 0) | (actions >= num_actions)
        if bad.any():
            raise ValueError(f"replay.add: segment.actions holds {actions[bad][:4].tolist()} at steps "
                             f"{np.flatnonzero(bad)[:4].tolist()}; valid actions are 0..{num_actions - 1}")
        for name in ("rewards", "policies", "root_values"):
            values = np.asarray(getattr(segment, name))
            if not np.isfinite(values).all():
                raise ValueError(f"replay.add: segment.{name} holds non-finite values at steps "
                                 f"{np.flatnonzero(~np.isfinite(values).reshape(length, -1).all(1))[:4].tolist()}")
        if self._arrays is not None:
            a = self._arrays
            obs_shape = self._segment_obs_shape(segment)
            if obs_shape != self.obs_shape or segment.policies.shape[1] != a["policy"].shape[1]:
                raise ValueError(
                    f"replay.add: segment obs {obs_shape} / actions {segment.policies.shape[1]} "
                    f"do not match the buffer's {self.obs_shape} / {a['policy'].shape[1]}"
                )

    def _evict(self, start: int, stop: int) -> None:
        a = self._arrays
        starts = np.unique(a["seg_start"][start:stop][a["held"][start:stop]])
        for s in starts:
            end = s + a["seg_len"][s]
            first = s - self.history  # the block starts with its history frames
            self.size -= int(a["alive"][s:end].sum())
            self.num_sampleable -= int(a["sampleable"][s:end].sum())
            a["alive"][s:end] = False
            a["held"][first:end] = False
            a["sampleable"][s:end] = False
            a["priority"][s:end] = 0.0
            a["generation"][first:end] += 1  # readers of any position of an evicted segment see it changed
            self.tree.set_range(s, end, 0.0)

    def add(self, segment: Segment, source: str | None = None) -> int:
        """Store one segment; returns the transitions now held. `source`: who sent it (a self-play actor's
        name), counted in `arrivals()` so the driver can tell what each sender's segments became."""
        self._check(segment)
        if self._arrays is None:
            self._allocate(segment)
        a = self._arrays
        length = len(segment.actions)
        if self.cursor + self.history + length > self.capacity:
            self.cursor = 0
        block = self.cursor
        self._evict(block, block + self.history + length)
        start, stop = block + self.history, block + self.history + length  # the steps
        a["generation"][block:stop] += 1  # before the data: a reader that checks afterwards sees the write
        if self.stack == 1:
            a["obs"][start:stop] = segment.obs
        else:
            if segment.history is not None:  # already in frame form
                a["obs"][block:start] = segment.history
                a["obs"][start:stop] = segment.obs
            else:
                channels = self.obs_shape[0] // self.stack
                a["obs"][block:start] = segment.obs[0, :-channels].reshape(self.history, channels,
                                                                           *self.obs_shape[1:])
                a["obs"][start:stop] = segment.obs[:, -channels:]
            a["seg_start"][block:start] = start  # history slots belong to the block (eviction finds them)
            a["seg_len"][block:start] = length
            a["held"][block:start] = True
        a["action"][start:stop] = segment.actions
        a["reward"][start:stop] = segment.rewards
        a["policy"][start:stop] = segment.policies
        a["root_value"][start:stop] = segment.root_values
        a["seg_start"][start:stop] = start
        a["seg_len"][start:stop] = length
        a["seg_terminal"][start:stop] = segment.terminal
        a["seg_bootstrap"][start:stop] = segment.bootstrap_value
        a["alive"][start:stop] = True
        a["held"][start:stop] = True
        a["sampleable"][start:stop] = False
        a["sampleable"][start : start + segment.num_sampleable] = True
        a["added_time"][start:stop] = time.time()
        a["added_count"][start:stop] = self.total_added + segment.num_sampleable  # age 0 until more arrive
        a["priority"][start:stop] = 0.0
        a["priority"][start : start + segment.num_sampleable] = self.max_priority
        self.tree.set_range(start, stop, 0.0)
        self.tree.set_range(start, start + segment.num_sampleable, self._weight(self.max_priority))
        self.cursor = stop
        self.size += length
        self.num_sampleable += segment.num_sampleable
        self.total_added += segment.num_sampleable
        self.segments_added += 1
        if source is not None:
            self.added_by_source[source] = self.added_by_source.get(source, 0) + segment.num_sampleable
        return self.size

    # -- sampling ------------------------------------------------------------------------------------

    def _weight(self, priority: np.ndarray | float) -> np.ndarray | float:
        alpha = self.cfg.priority_alpha
        return priority if alpha == 1.0 else np.power(priority, alpha)

    def sample(self, batch_size: int, with_obs: bool = True) -> Batch:
        """batch_size positions drawn with probability priority**alpha, with their K-step targets.

        with_obs=False leaves the observation fields None (a learner that maps the shared arrays gathers them).
        """
        if self._arrays is None or self.num_sampleable == 0:
            raise ValueError("replay.sample: the buffer is empty")
        if batch_size < 1:
            raise ValueError(f"replay.sample: batch_size={batch_size} must be >= 1")
        index = self.tree.sample(self.rng, batch_size)
        probs = self.tree.weights(index) / self.tree.total
        is_weights = (self.num_sampleable * probs) ** (-self.cfg.priority_beta)
        is_weights = (is_weights / is_weights.max()).astype(np.float32)
        batch = self._targets(index, is_weights, with_obs)
        self._record_diagnostics(batch)
        return batch

    def _record_diagnostics(self, batch: Batch) -> None:
        """Adds one batch's data age, importance weights and reward density to the running sums."""
        a, d = self._arrays, self.diagnostics
        w = batch.weights.astype(np.float64)
        mask = batch.reward_mask[:, 1:] > 0
        d["batches"] += 1
        d["age_seconds"] += float(time.time() - a["added_time"][batch.indices].mean())
        d["age_transitions"] += float(self.total_added - a["added_count"][batch.indices].mean())
        d["is_weight_mean"] += float(w.mean())
        # Kish's effective sample size over the batch size: 1 = uniform weights, 1/B = one sample counts.
        d["is_weight_ess"] += float(w.sum() ** 2 / max(1e-30, (w * w).sum()) / len(w))
        d["reward_nonzero"] += float((batch.target_rewards[:, 1:][mask] != 0).mean()) if mask.any() else 0.0

    def obs_store(self) -> dict | None:
        """Where learners find the shared observation and generation arrays (None when they are private)."""
        if self.shared_paths is None:
            return None
        return {**self.shared_paths, "node": node_id(), "frame_stack": self.stack, "obs_shape": self.obs_shape}

    def _targets(self, index: np.ndarray, is_weights: np.ndarray, with_obs: bool = True) -> Batch:
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
        # With bootstrap_obs the learner supplies the in-segment bootstraps from its target network.
        stored = 0.0 if cfg.bootstrap_obs else gather("root_value", boot_pos) * gamma**n
        boot_value = np.where(
            boot_inside,
            stored,
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
        extra = {}
        if cfg.next_obs:
            next_pos = pos[:, 1:]
            extra["next_index"] = seg_start[:, None] + np.minimum(next_pos, seg_len[:, None] - 1)
            extra["next_mask"] = (next_pos < seg_len[:, None]).astype(np.float32)
            extra["next_obs"] = self.obs_at(extra["next_index"]) if with_obs else None
        if cfg.bootstrap_obs:
            extra["bootstrap_index"] = seg_start[:, None] + np.minimum(boot_pos, seg_len[:, None] - 1)
            extra["bootstrap_scale"] = np.where(boot_inside, gamma**n, 0.0).astype(np.float32)
            extra["bootstrap_obs"] = self.obs_at(extra["bootstrap_index"]) if with_obs else None
        return Batch(
            indices=index.astype(np.int64),
            generations=a["generation"][index].copy(),
            obs=self.obs_at(index) if with_obs else None,
            actions=actions.astype(np.int64),
            target_values=values,
            target_rewards=target_rewards,
            target_policies=policies.astype(np.float32),
            value_mask=value_mask.astype(np.float32),
            reward_mask=reward_mask.astype(np.float32),
            policy_mask=inside.astype(np.float32),
            weights=is_weights,
            **extra,
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
        self.tree.set(indices[fresh], self._weight(a["priority"][indices[fresh]]))
        if fresh.any():
            self.max_priority = max(self.max_priority, float(priorities[fresh].max()))

    # -- reanalyse ------------------------------------------------------------------------------------

    def sample_positions(self, count: int) -> dict[str, np.ndarray] | None:
        """`count` stored positions drawn uniformly (with replacement) for reanalyse: their indices,
        generations and observations; None while replay is empty."""
        a = self._arrays
        if count < 1:
            raise ValueError(f"replay.sample_positions: count={count} must be >= 1")
        if a is None or self.size == 0:
            return None
        alive = np.flatnonzero(a["alive"])
        index = alive[self.rng.integers(0, len(alive), size=count)]
        return {"indices": index, "generations": a["generation"][index].copy(), "obs": self.obs_at(index)}

    def update_targets(self, indices: np.ndarray, generations: np.ndarray, policies: np.ndarray,
                       root_values: np.ndarray) -> int:
        """Replace the policy targets and search values of positions (reanalyse); positions overwritten since
        they were drawn are skipped. Returns how many were updated."""
        a = self._arrays
        if a is None:
            return 0
        indices = np.asarray(indices, dtype=np.int64)
        policies = np.asarray(policies, dtype=np.float32)
        root_values = np.asarray(root_values, dtype=np.float32)
        if policies.shape != (len(indices), a["policy"].shape[1]) or root_values.shape != (len(indices),):
            raise ValueError(f"replay.update_targets: policies {policies.shape} / root_values {root_values.shape} "
                             f"do not match {len(indices)} indices and {a['policy'].shape[1]} actions")
        if not (np.all(np.isfinite(policies)) and np.all(np.isfinite(root_values))):
            raise ValueError("replay.update_targets: policies and root_values must be finite")
        fresh = (a["generation"][indices] == generations) & a["alive"][indices]
        a["policy"][indices[fresh]] = policies[fresh]
        a["root_value"][indices[fresh]] = root_values[fresh]
        updated = int(fresh.sum())
        self.reanalysed += updated
        return updated

    def stats(self) -> dict:
        """Counters, and the running sums of the sampled batches' diagnostics (`sampled_*`, over
        `sampled_batches`): callers take differences between two calls and divide by the batches between."""
        return {
            "size": self.size,
            "sampleable": self.num_sampleable,
            "total_added": self.total_added,
            "segments_added": self.segments_added,
            "reanalysed": self.reanalysed,
            **{f"sampled_{name}": value for name, value in self.diagnostics.items()},
        }

    def arrivals(self) -> dict[str, int]:
        """Sampleable positions added per sender since the buffer was made (snapshots keep them: after a
        restore they count what the restored data holds)."""
        return dict(self.added_by_source)

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
            "max_priority": self.max_priority, "capacity": self.capacity, "frame_stack": self.stack,
            "obs_shape": self.obs_shape, "added_by_source": self.added_by_source,
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
            if meta.get("frame_stack", 1) != self.stack:
                raise ValueError(f"replay snapshot {path} was written with replay.frame_stack="
                                 f"{meta.get('frame_stack', 1)}, the config asks {self.cfg.frame_stack}")
            names = [k for k in data.files if k != "meta"]
            previous = self._arrays if self.shared_paths is not None else None
            self._arrays = {k: data[k].copy() for k in names} if names else None
        for key in ("cursor", "size", "num_sampleable", "total_added", "segments_added", "max_priority"):
            setattr(self, key, meta[key])
        self.added_by_source = dict(meta.get("added_by_source", {}))
        a = self._arrays
        if a is not None:
            self.obs_shape = tuple(meta["obs_shape"]) if meta.get("obs_shape") else tuple(a["obs"].shape[1:])
            a.setdefault("held", a["alive"].copy())  # snapshots from before frame storage
            a.setdefault("added_time", np.zeros(self.capacity, dtype=np.float64))  # before diagnostics
            a.setdefault("added_count", np.zeros(self.capacity, dtype=np.int64))
        if a is None:
            self.tree.set_all(np.zeros(self.capacity))
            return
        self.tree.set_all(np.where(a["sampleable"], self._weight(a["priority"]), 0.0))
        if previous is not None and all(previous[k].shape == a[k].shape for k in ("obs", "generation")):
            for name in ("obs", "generation"):  # same shared arrays: learners' mappings stay valid
                previous[name][...] = a[name]
                a[name] = previous[name]
        else:
            self.shared_paths = None
            self._share(keep=True)


def node_id() -> str:
    """The Ray node this process runs on (the hostname outside Ray): shared arrays are visible within it."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside a Ray worker the hostname identifies the machine
        pass
    import socket

    return socket.gethostname()
