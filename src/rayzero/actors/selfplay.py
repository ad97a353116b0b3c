"""The self-play role: steps a batch of envs, runs one batched search per step, sends segments to replay.

With the inference actor (a GPU host) the envs are split into groups, each its own vector env. Whole searches
(GPU search): `env.search_groups` groups (two halves by default), each with its search in flight while the others
step their envs. CPU search (`search.device=cpu`): two halves walk their trees in two threads, so one half's
leaves are on the GPU while the other half's tree walk runs.

Each env writes its steps into preallocated per-env arrays. A segment leaves when the episode ends, or when
`segment_length + unroll_steps + td_steps` steps have piled up: then the first `segment_length` positions
are sampleable and the rest is a tail that completes their targets; the tail stays and starts the next
segment, so no position is lost or duplicated as a start. Each env's first segment is shorter by a different
amount, so envs that start together do not send their segments in bursts.

Faults: a step whose search fails because the inference actor died is not recorded (nothing of it reached the
buffers), so `collect` ends early with `inference_lost` and the driver hands over a new actor
(`set_evaluator`); a segment whose replay shard died before storing it is counted as dropped, not raised.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any
from collections.abc import Callable

import numpy as np
import torch

from rayzero.actors.network import LocalNetwork, search_observations
from rayzero.config import EnvConfig, ModelConfig, ReplayConfig
from rayzero.logs import first_line
from rayzero.envs import make_vector_env
from rayzero.models import build_model
from rayzero.replay.buffer import Segment
from rayzero.tree import SearchConfig


PHASES = ("search", "env", "record", "submit")
"""Where a collect's time goes: the search (waiting for a whole search's answer, or walking the trees here),
stepping the envs, recording steps and cutting segments, sending the next whole search (GPU search)."""
SEARCH_PARTS = ("queued", "device", "server")
"""Of the whole searches waited for: the time their requests queued in the inference actor before launch, their
batches' device time, and the time from their submission in the inference actor to their answers being ready
(queued, launch, device and finish), as the answers report them. With one env (no halves) the search phase less
`server` is the way there and back (channels, the actor's event loop); with halves a search also runs while the
other half steps, so these may exceed it."""


class SelfPlayWorker:
    def __init__(
        self,
        env_cfg: EnvConfig,
        model_cfg: ModelConfig,
        search_cfg: SearchConfig,
        replay_cfg: ReplayConfig,
        seed: int,
        sink: Callable[[Segment], Any] | None = None,
        evaluator: Any = None,
        torch_threads: int = 1,
    ):
        torch.set_num_threads(torch_threads)
        torch.manual_seed(seed)
        self.num_envs = env_cfg.num_envs
        remote = hasattr(evaluator, "submit_search")  # the inference actor serves this worker
        # GPU search: each half's whole search in flight while the other half steps. CPU search (the inference
        # actor only evaluates leaves): the two halves walk their trees in two threads, so one half's leaves are
        # on the GPU while the other's tree walk runs (the compiled tree releases the GIL).
        self.threaded = remote and not evaluator.whole_search and self.num_envs >= 2
        groups = (2 if self.threaded else env_cfg.search_groups) if remote else 1
        groups = min(groups, self.num_envs)
        sizes = [self.num_envs // groups + (g < self.num_envs % groups) for g in range(groups)]
        # One vector env per group (`halves`); env i of the worker is row i of the buffers (group h holds rows
        # offsets[h]...).
        self.halves = []
        offset = 0
        for h, size in enumerate(sizes):
            env = make_vector_env(env_cfg, size, seed + 7919 * h, training=True)
            network = evaluator.twin(f"half{h}") if self.threaded else None  # its own channel and latent slots
            self.halves.append(_Half(env, np.arange(offset, offset + size), env.reset(seed=seed + 7919 * h),
                                     network=network, generator=torch.Generator().manual_seed(seed + 7919 * h)))
            offset += size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="search") if self.threaded else None
        self.env = self.halves[0].env
        spec = self.env.spec
        self.search_cfg = search_cfg
        self.replay_cfg = replay_cfg
        self.sink = sink
        if evaluator is None:
            evaluator = LocalNetwork(build_model(model_cfg, spec.observation_shape, spec.num_actions), replay_cfg.discount)
        self.evaluator = evaluator
        self.version = -1
        self.tail = replay_cfg.unroll_steps + replay_cfg.td_steps
        self.window = replay_cfg.segment_length + self.tail
        E, W, A = self.num_envs, self.window, spec.num_actions
        self.buf_obs = np.zeros((E, W, *spec.observation_shape), dtype=spec.observation_dtype)
        self.buf_action = np.zeros((E, W), dtype=np.int64)
        self.buf_reward = np.zeros((E, W), dtype=np.float32)
        self.buf_policy = np.zeros((E, W, A), dtype=np.float32)
        self.buf_value = np.zeros((E, W), dtype=np.float32)
        self.length = np.zeros(E, dtype=np.int64)
        # Staggered first segments: env i's first segment makes (i + 1) / E of segment_length positions
        # sampleable, so envs that start together send their segments spread over segment_length steps, not in
        # one burst per segment_length (later segments and segments of new episodes are whole).
        self.emit_at = self.tail + np.maximum(1, (np.arange(1, E + 1) * replay_cfg.segment_length) // E)
        self.env_steps = 0
        self.discarded = 0  # positions dropped unsent: their episode's bootstrap value was lost with the network
        # The training rewards of the steps of the collect in progress: their sum, and how many were > 0 and < 0.
        # Games whose episodes outlast a run's minutes (Pong at 64 envs) finish none; these show how play goes.
        self._rewards = np.zeros(3, dtype=np.float64)
        self._network_lost = ""  # set by a step whose bootstrap evaluation found the inference actor dead
        # Where the collect in progress spends its time (seconds, PHASES), for `rayzero bench selfplay`.
        self._phases = dict.fromkeys(PHASES + SEARCH_PARTS, 0.0)
        self.last_deliveries: list[tuple[int, bool]] = []  # the last collect's segments: (positions, reached replay)

    def set_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> int:
        self.evaluator.set_weights(state_dict)
        self.version = version
        return version

    def set_evaluator(self, evaluator: Any) -> None:
        """Search with `evaluator` from the next step on (a new inference actor after the old one died); the
        envs and the steps already recorded are kept."""
        self.evaluator = evaluator
        for h, half in enumerate(self.halves):
            half.network = evaluator.twin(f"half{h}") if self.threaded else None
            half.searching = False

    @property
    def held(self) -> int:
        """Positions recorded but not yet sent to replay (each becomes sampleable exactly once when sent)."""
        return int(self.length.sum())

    def _emit(self, env: int, length: int, sampleable: int, terminal: bool, bootstrap: float) -> Segment:
        k = self.replay_cfg.frame_stack
        if k > 1 and self.buf_obs.ndim == 5 and self.buf_obs.shape[2] % k == 0:
            # Frame form: each step's newest frame plus the first observation's older frames (replay restacks).
            channels = self.buf_obs.shape[2] // k
            obs = self.buf_obs[env, :length, -channels:].copy()
            history = self.buf_obs[env, 0, :-channels].reshape(k - 1, channels, *self.buf_obs.shape[3:]).copy()
        else:
            obs, history = self.buf_obs[env, :length].copy(), None
        return Segment(
            obs=obs,
            history=history,
            actions=self.buf_action[env, :length].copy(),
            rewards=self.buf_reward[env, :length].copy(),
            policies=self.buf_policy[env, :length].copy(),
            root_values=self.buf_value[env, :length].copy(),
            num_sampleable=sampleable,
            terminal=terminal,
            bootstrap_value=bootstrap,
        )

    @property
    def obs(self) -> np.ndarray:
        """[E, *obs] the observations every env acts on next."""
        return np.concatenate([half.obs for half in self.halves]) if len(self.halves) > 1 else self.halves[0].obs

    def step(self, temperature: float) -> list[Segment]:
        """One env step of every env: search, act, record; returns the segments completed by this step."""
        self._last_episodes = ([], [])
        if self.threaded:
            return self._step_threaded(temperature)
        if len(self.halves) > 1:
            return self._step_pipelined(temperature)
        half = self.halves[0]
        if getattr(self.evaluator, "whole_search", False):
            t0 = time.perf_counter()
            answer = self.evaluator.search(half.obs, temperature)
            self._phases["search"] += time.perf_counter() - t0
            self._search_parts(answer)
            self.version = int(answer.get("version", self.version))  # the weights the inference actor acted with
            return self._advance(half, answer["action"], answer["action_weights"], answer["root_value"])
        config = dataclasses.replace(self.search_cfg, temperature=temperature)
        t0 = time.perf_counter()
        out = search_observations(self.evaluator, half.obs, config, half.generator)
        self._phases["search"] += time.perf_counter() - t0
        return self._advance(half, out.action.cpu().numpy(), out.action_weights.float().cpu().numpy(),
                             out.root_value.float().cpu().numpy())

    def _step_pipelined(self, temperature: float) -> list[Segment]:
        """Each group in turn: collect its search, step its envs, send its next search. The other groups'
        searches are in flight on the inference actor meanwhile; searches stay in flight between calls."""
        phases, clock = self._phases, time.perf_counter
        for slot, half in enumerate(self.halves):
            if not half.searching:
                self.evaluator.submit_search(half.obs, temperature, slot)
                half.searching = True
        segments = []
        for slot, half in enumerate(self.halves):
            t0 = clock()
            answer = self.evaluator.wait_search(slot)
            phases["search"] += clock() - t0
            self._search_parts(answer)
            half.searching = False
            self.version = int(answer.get("version", self.version))
            segments += self._advance(half, answer["action"], answer["action_weights"], answer["root_value"])
            t0 = clock()
            self.evaluator.submit_search(half.obs, temperature, slot)
            phases["submit"] += clock() - t0
            half.searching = True
        return segments

    def _search_parts(self, answer: dict[str, Any]) -> None:
        self._phases["queued"] += answer.get("queue_ms", 0.0) / 1e3
        self._phases["device"] += answer.get("device_ms", 0.0) / 1e3
        self._phases["server"] += answer.get("server_ms", 0.0) / 1e3

    def _step_threaded(self, temperature: float) -> list[Segment]:
        """Both halves search at once (the second in the pool's thread), each through its own network, then
        both step their envs."""
        config = dataclasses.replace(self.search_cfg, temperature=temperature)
        first, second = self.halves
        t0 = time.perf_counter()
        future = self._pool.submit(search_observations, second.network, second.obs, config, second.generator)
        try:
            first_out = search_observations(first.network, first.obs, config, first.generator)
        finally:  # the second half's search ends (or fails) before anything else touches its state
            wait_futures([future])
        self._phases["search"] += time.perf_counter() - t0
        outs = [first_out, future.result()]
        segments = []
        for half, out in zip(self.halves, outs):
            segments += self._advance(half, out.action.cpu().numpy(), out.action_weights.float().cpu().numpy(),
                                      out.root_value.float().cpu().numpy())
        return segments

    def _advance(self, half: _Half, actions: np.ndarray, policy: np.ndarray,
                 root_value: np.ndarray) -> list[Segment]:
        """Record one searched step of `half`'s envs, step them, and cut the segments that this completes."""
        began = time.perf_counter()
        rows = half.rows
        t = self.length[rows]
        self.buf_obs[rows, t] = half.obs
        self.buf_action[rows, t] = actions
        self.buf_policy[rows, t] = policy
        self.buf_value[rows, t] = root_value
        t0 = time.perf_counter()
        result = half.env.step(actions)
        env_s = time.perf_counter() - t0
        self._phases["env"] += env_s
        self.buf_action[rows, t] = result.actions  # the env's FIRE where `env.fire_reset` pressed it
        self.buf_reward[rows, t] = result.reward
        self._rewards += (float(result.reward.sum()), int((result.reward > 0).sum()), int((result.reward < 0).sum()))
        self.length[rows] += 1
        self.env_steps += len(rows)
        half.obs = result.obs

        segments = []
        ended = np.flatnonzero(result.terminated | result.truncated)
        bootstrap = np.zeros(len(rows), dtype=np.float32)
        truncated_only = ended[~result.terminated[ended]]
        if len(truncated_only):
            try:
                values = self.evaluator.root(result.final_obs[truncated_only]).value
                self.evaluator.release()
                bootstrap[truncated_only] = values.float().cpu().numpy()
            except Exception as error:  # noqa: BLE001 - only a dead inference actor is handled; others re-raise
                if not _actor_died(error):
                    raise
                # The envs have stepped, so the step stands; the truncated episodes' last segments cannot get
                # their bootstrap value and are dropped (counted), and the collect ends after this step.
                self._network_lost = _describe(error)
                for i in truncated_only:
                    self.discarded += int(self.length[rows[i]])
                    self.length[rows[i]] = 0
                ended = ended[result.terminated[ended]]
        for i in ended:
            env = int(rows[i])
            n = int(self.length[env])
            segments.append(self._emit(env, n, n, bool(result.terminated[i]), float(bootstrap[i])))
            self.length[env] = 0
        for env in rows[self.length[rows] == self.emit_at[rows]]:
            window = int(self.emit_at[env])
            segments.append(self._emit(env, window, window - self.tail, False, 0.0))
            keep = slice(window - self.tail, window)
            for buf in (self.buf_obs, self.buf_action, self.buf_reward, self.buf_policy, self.buf_value):
                buf[env, : self.tail] = buf[env, keep]
            self.length[env] = self.tail
            self.emit_at[env] = self.window
        self._last_episodes[0].extend(result.episode_returns)
        self._last_episodes[1].extend(result.episode_lengths)
        self._phases["record"] += time.perf_counter() - began - env_s
        return segments

    def collect(
        self, num_steps: int, temperature: float = 1.0, weights: tuple[int, dict] | None = None
    ) -> dict[str, Any]:
        """num_steps batched steps; segments go to the sink; returns counts and finished-episode returns.

        Fewer steps when the inference actor died (`inference_lost`): the failed step left nothing behind, so
        after `set_evaluator` the next collect goes on from the same env states."""
        if weights is not None and weights[0] != self.version:
            self.set_weights(*weights)
        start = time.perf_counter()
        returns: list[float] = []
        lengths: list[int] = []
        pending: list[tuple[int, Any]] = []  # (positions, what the sink returned) per segment sent
        step_seconds: list[float] = []
        inference_lost = ""
        self._rewards[:] = 0.0
        self._phases = dict.fromkeys(PHASES + SEARCH_PARTS, 0.0)
        for _ in range(num_steps):
            began = time.perf_counter()
            try:
                segments = self.step(temperature)
            except Exception as error:  # noqa: BLE001 - only a dead inference actor is handled; others re-raise
                if not _actor_died(error):
                    raise
                inference_lost = _describe(error)
                break
            step_seconds.append(time.perf_counter() - began)
            for segment in segments:
                pending.append((segment.num_sampleable, self.sink(segment) if self.sink is not None else None))
            returns.extend(self._last_episodes[0])
            lengths.extend(self._last_episodes[1])
            if self._network_lost:  # the step stood, but the network went away during it
                inference_lost, self._network_lost = self._network_lost, ""
                break
        delivered = _delivered([result for _, result in pending])
        self.last_deliveries = [(n, ok) for (n, _), ok in zip(pending, delivered)]
        result = {
            "env_steps": len(step_seconds) * self.num_envs,
            "transitions_sent": sum(n for n, ok in self.last_deliveries if ok),
            "transitions_dropped": sum(n for n, ok in self.last_deliveries if not ok),
            "transitions_held": self.held,
            "transitions_discarded": self.discarded,  # since the worker started
            "episode_returns": returns,
            "episode_lengths": lengths,
            # the training rewards (clipped where env.clip_rewards) of every env step above: sum, > 0, < 0
            "reward_sum": float(self._rewards[0]),
            "rewards_positive": int(self._rewards[1]),
            "rewards_negative": int(self._rewards[2]),
            "version": self.version,
            "seconds": time.perf_counter() - start,
            "step_seconds": step_seconds,  # each batched step: the time every env waited for its next action
            "phase_seconds": dict(self._phases),  # where those steps went (PHASES, and SEARCH_PARTS of the search)
            "half_steps": len(step_seconds) * len(self.halves),  # the halves' steps those seconds are over
        }
        if inference_lost:
            result["inference_lost"] = inference_lost
        return result


def _actor_died(error: BaseException) -> bool:
    """Whether `error` says a Ray actor this process called has died (here: the inference actor)."""
    try:
        import ray
    except ImportError:
        return False
    return isinstance(error, ray.exceptions.RayActorError) and not isinstance(error, ray.exceptions.RayTaskError)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {first_line(error, 200)}"


def _delivered(results: list[Any]) -> list[bool]:
    """Whether each segment reached replay. With Ray refs, waits for them (so replay applies backpressure); a
    segment whose replay shard died before storing it counts as not delivered instead of failing the collect."""
    if not results or not hasattr(results[0], "hex"):
        return [True] * len(results)
    import ray

    try:
        ray.get(results)
        return [True] * len(results)
    except ray.exceptions.RayActorError:
        pass
    delivered = []
    for ref in results:
        try:
            ray.get(ref)
            delivered.append(True)
        except ray.exceptions.RayActorError:
            delivered.append(False)
    return delivered


@dataclasses.dataclass
class _Half:
    """A vector env of some of the worker's envs: `rows` are their rows in the buffers; `obs` what they act on
    next; `searching`: their whole search is in flight."""

    env: Any
    rows: np.ndarray
    obs: np.ndarray
    searching: bool = False
    network: Any = None
    """CPU search with the inference actor: this half's own network (channel and latent slots)."""
    generator: torch.Generator | None = None
    """This half's random stream for search noise (the first half's is seeded with the worker's seed; threaded
    halves must not share one)."""
