"""The environment layer: every env a self-play, evaluation or GIF-writing actor steps comes from here.

This module owns
  * resolving an `EnvConfig.id` to something runnable, and failing fast (one-line `ValueError` naming
    the id, with close matches) when it cannot be;
  * the observation format the networks see (`EnvSpec`), identical for training, evaluation and rendering;
  * `BatchedEnv`, a vector of `num_envs` envs with same-step autoreset, whole-game episode statistics,
    and training-only transforms (reward clipping, Atari episodic life);
  * `make_render_env`, one env with `render_mode='rgb_array'` whose observations match the batched env's.

Two back ends:
  * ids of the ALE namespace ('ALE/Pong-v5') run on ale-py's native C++ vector env (`AtariVectorEnv`),
    which does the MuZero/EfficientZero preprocessing in its own threads: frame skip with a max-pool over
    the last two frames, grayscale or RGB, INTER_AREA resize to `image_size`, frame stack (zero-padded
    after a reset), 0..noop_max-1 no-ops at reset, sticky actions (v5 semantics, inside ALE), minimal or
    full action set; FIRE at the start of every life with `EnvConfig.fire_reset` (done here, not natively).
    Observations are uint8 `[frame_stack * C, H, W]`, C = 1 (grayscale) or 3 (RGB), frames oldest first, the
    channels of one frame adjacent (R, G, B).
  * every other Gymnasium id runs in a `gymnasium.vector.SyncVectorEnv`. Vector observations become
    float32; uint8 images of shape HxWxC become uint8 CxHxW; a Discrete observation becomes a float32
    one-hot vector. Only Discrete action spaces are accepted.
"""

from __future__ import annotations

import abc
import difflib
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import gymnasium
import numpy as np
from gymnasium.vector import AutoresetMode

from rayzero.config import EnvConfig
from rayzero.logs import first_line

ATARI_DEFAULT_MAX_STEPS = 27_000
"""Agent steps before an Atari game is truncated when `max_episode_steps` is 0 (108k frames at skip 4)."""

_EXAMPLE_ALE_IDS = ("ALE/Pong-v5", "ALE/Breakout-v5", "ALE/MsPacman-v5", "ALE/SpaceInvaders-v5")


@dataclass(frozen=True)
class EnvSpec:
    """What the networks need to know about an env: the (preprocessed) observation and the actions."""

    observation_shape: tuple[int, ...]
    observation_dtype: np.dtype
    num_actions: int
    action_meanings: tuple[str, ...] | None


class StepResult(NamedTuple):
    obs: np.ndarray
    """[E, *observation_shape]: the observation to act on next; for envs that ended this step it is
    already the first observation of their next episode (same-step autoreset)."""
    reward: np.ndarray
    """[E] float32, clipped to [-1, 1] when training with `clip_rewards`."""
    terminated: np.ndarray
    """[E] bool: a true terminal (value 0 beyond); with Atari episodic life also a lost life."""
    truncated: np.ndarray
    """[E] bool: cut by the time limit (bootstrap beyond)."""
    final_obs: np.ndarray | None
    """[E, *observation_shape]: the last observation of the episodes that ended this step (rows of envs
    that did not end are undefined); None when no env ended."""
    episode_returns: list[float]
    """Raw (unclipped) returns of the whole games that finished this step, in env order."""
    episode_lengths: list[int]
    """Agent steps of those games, same order."""
    actions: np.ndarray
    """[E] the actions played: the agent's, except where `EnvConfig.fire_reset` pressed FIRE."""


class BatchedEnv(abc.ABC):
    """`num_envs` envs stepped together; what `make_vector_env` returns."""

    num_envs: int
    spec: EnvSpec

    @abc.abstractmethod
    def reset(self, seed: int | None = None) -> np.ndarray:
        """Reset every env and return `[E, *observation_shape]`.

        The first reset without a seed uses the seed given to `make_vector_env`; later resets without a
        seed continue the envs' random streams; an explicit seed reseeds all envs from it.
        """

    @abc.abstractmethod
    def step(self, actions: np.ndarray) -> StepResult:
        """Apply one action per env (`[E]` integers in [0, num_actions))."""

    @abc.abstractmethod
    def close(self) -> None: ...

    # Shared bookkeeping of the two backends: `_returns` / `_lengths` ([E]) are set up by each __init__.

    def _checked_actions(self, actions: np.ndarray) -> np.ndarray:
        actions = np.asarray(actions, dtype=np.int64)
        if actions.shape != (self.num_envs,):
            raise ValueError(f"expected actions of shape ({self.num_envs},), got {actions.shape}")
        return actions

    def _count(self, raw_reward: np.ndarray) -> None:
        self._returns += raw_reward
        self._lengths += 1

    def _end_episodes(self, ended: np.ndarray) -> tuple[list[float], list[int]]:
        """Returns and lengths of the envs in `ended` (bool [E]), whose counters restart at 0."""
        idx = np.flatnonzero(ended)
        returns, lengths = self._returns[idx].tolist(), self._lengths[idx].tolist()
        self._returns[idx] = 0.0
        self._lengths[idx] = 0
        return returns, lengths

    def __enter__(self) -> BatchedEnv:  # noqa: PYI034 (typing.Self needs 3.11)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------------
# Resolving ids


@functools.cache
def _register_ale() -> None:
    # ALE ids appear in gymnasium's registry only once ale-py registers them.
    import ale_py

    gymnasium.register_envs(ale_py)


def _unknown_id(env_id: str, candidates: list[str], hint: str) -> ValueError:
    close = difflib.get_close_matches(env_id, candidates, n=4, cutoff=0.6)
    if not close:
        # Ids differing only in case ('ALE/pong-v5') score low with difflib; compare lowercased too.
        lowered = {c.lower(): c for c in candidates}
        matches = difflib.get_close_matches(env_id.lower(), list(lowered), n=4, cutoff=0.6)
        close = [lowered[c] for c in matches]
    suggestion = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
    return ValueError(f"unknown env id {env_id!r}: {suggestion}{hint}")


def _ale_game(cfg: EnvConfig) -> str:
    """The snake_case ROM name of an 'ALE/...' id, or a ValueError saying what is wrong with the id."""
    _register_ale()
    registry = gymnasium.envs.registry
    if cfg.id not in registry:
        ale_ids = sorted(k for k in registry if k.startswith("ALE/"))
        examples = ", ".join(repr(i) for i in _EXAMPLE_ALE_IDS)
        raise _unknown_id(cfg.id, ale_ids, f"valid ALE ids look like {examples} "
                          f"({len(ale_ids)} in `gymnasium.envs.registry`)")
    kwargs = registry[cfg.id].kwargs
    if kwargs.get("obs_type", "rgb") not in ("rgb", "grayscale"):
        raise ValueError(f"env id {cfg.id!r} has obs_type={kwargs['obs_type']!r}; only image observations "
                         f"are supported for ALE ids (use e.g. 'ALE/Pong-v5')")
    return str(kwargs["game"])


def _check_gym_id(cfg: EnvConfig) -> None:
    _register_ale()  # old-style Atari ids exist (and are recognised below) only once ale-py registered them
    registry = gymnasium.envs.registry
    if ":" in cfg.id:  # 'module:Env-v0' registers itself on import; let gymnasium.make report problems.
        return
    if cfg.id not in registry:
        raise _unknown_id(cfg.id, sorted(registry), "see `gymnasium.envs.registry` for registered ids")
    entry = registry[cfg.id].entry_point
    if isinstance(entry, str) and entry.startswith("ale_py"):
        # Old-style Atari ids (PongNoFrameskip-v4) would run without any of the Atari preprocessing.
        game = str(registry[cfg.id].kwargs.get("game", ""))
        camel = "".join(part.capitalize() for part in game.split("_"))
        raise ValueError(f"env id {cfg.id!r} is an Atari id outside the ALE namespace: use "
                         f"'ALE/{camel}-v5' (native vector env with Atari preprocessing)")


def _gym_make(cfg: EnvConfig, *, time_limit: bool = True, **kwargs: Any) -> gymnasium.Env:
    """gymnasium.make with errors turned into one-line ValueErrors naming the id.

    `time_limit`: apply cfg.max_episode_steps as the TimeLimit (non-ALE envs; ALE envs count frames).
    """
    if time_limit and cfg.max_episode_steps > 0:
        kwargs["max_episode_steps"] = cfg.max_episode_steps
    try:
        return gymnasium.make(cfg.id, disable_env_checker=True, **kwargs)
    except gymnasium.error.DependencyNotInstalled as error:
        first = first_line(error, empty=type(error).__name__)
        raise ValueError(f"env id {cfg.id!r} needs a dependency that is not installed: {first}") from None
    except (gymnasium.error.Error, ModuleNotFoundError) as error:
        first = first_line(error, empty=type(error).__name__)
        raise ValueError(f"cannot make env id {cfg.id!r}: {first}") from None


# ----------------------------------------------------------------------------------------------------
# Observation formats of non-ALE envs


_Transform = Callable[[Any], np.ndarray]


def _obs_transform(space: gymnasium.Space, env_id: str) -> tuple[_Transform, tuple[int, ...], np.dtype]:
    """A function mapping a *batch* of raw observations [E, ...] to the network format, plus its
    per-env shape and dtype. The same function serves single observations given as a batch of one."""
    if isinstance(space, gymnasium.spaces.Discrete):
        n, start = int(space.n), int(space.start)
        eye = np.eye(n, dtype=np.float32)
        return (lambda obs: eye[np.asarray(obs, dtype=np.int64) - start]), (n,), np.dtype(np.float32)
    if isinstance(space, gymnasium.spaces.Box):
        shape = tuple(int(s) for s in space.shape)
        if space.dtype == np.uint8 and len(shape) == 3:
            h, w, c = shape
            if c in (1, 3, 4) and h not in (1, 3, 4):
                # HxWxC images: channels-first like the Atari path, kept uint8 (the network scales them).
                def to_chw(obs: Any) -> np.ndarray:
                    return np.ascontiguousarray(np.asarray(obs).transpose(0, 3, 1, 2))

                return to_chw, (c, h, w), np.dtype(np.uint8)
            return (lambda obs: np.asarray(obs, dtype=np.uint8)), shape, np.dtype(np.uint8)
        return (lambda obs: np.asarray(obs, dtype=np.float32)), shape, np.dtype(np.float32)
    raise ValueError(f"env id {env_id!r} has observation space {space}: only Box and Discrete observations "
                     f"are supported")


def _check_actions(space: gymnasium.Space, env_id: str) -> gymnasium.spaces.Discrete:
    if not isinstance(space, gymnasium.spaces.Discrete):
        # ValueError like every other bad-config error, so the CLI reports it the same way.
        raise ValueError(  # noqa: TRY004
            f"env id {env_id!r} has action space {space}: MuZero here needs a Discrete action space")
    return space


def _env_seeds(seed: int, n: int) -> np.ndarray:
    """n per-env seeds in [1, 2**31 - 1) derived from one seed.

    Through SeedSequence so that the envs of actors with consecutive seeds don't share seeds (seed, seed+1,
    ... would overlap); never 0, which some ALE versions read as 'unseeded'.
    """
    words = np.random.SeedSequence(seed).generate_state(n, dtype=np.uint32).astype(np.int64)
    return words % (2**31 - 2) + 1


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# ----------------------------------------------------------------------------------------------------
# Specs


@functools.lru_cache(maxsize=64)
def env_spec(cfg: EnvConfig) -> EnvSpec:
    """The observation/action spec of `cfg`'s env (builds one env and closes it; cached per config)."""
    if cfg.is_atari:
        _ale_game(cfg)
        env = _gym_make(cfg, time_limit=False, full_action_space=cfg.full_action_space)
        try:
            meanings = tuple(env.unwrapped.get_action_meanings())  # type: ignore[attr-defined]
            num_actions = int(_check_actions(env.action_space, cfg.id).n)
        finally:
            env.close()
        channels = 1 if cfg.grayscale else 3
        return EnvSpec((cfg.frame_stack * channels, cfg.image_size, cfg.image_size), np.dtype(np.uint8),
                       num_actions, meanings)
    _check_gym_id(cfg)
    env = _gym_make(cfg)
    try:
        actions = _check_actions(env.action_space, cfg.id)
        _, shape, dtype = _obs_transform(env.observation_space, cfg.id)
    finally:
        env.close()
    return EnvSpec(shape, dtype, int(actions.n), None)


# ----------------------------------------------------------------------------------------------------
# Batched envs


class _GymBatchedEnv(BatchedEnv):
    """Any Gymnasium env with a Discrete action space, in a SyncVectorEnv with same-step autoreset."""

    def __init__(self, cfg: EnvConfig, num_envs: int, seed: int, training: bool) -> None:
        self.spec = env_spec(cfg)
        self.num_envs = num_envs
        self._seed: int | None = seed
        self._clip = training and cfg.clip_rewards
        self._vec = gymnasium.vector.SyncVectorEnv(
            [functools.partial(_gym_make, cfg) for _ in range(num_envs)],
            autoreset_mode=AutoresetMode.SAME_STEP,
        )
        space = self._vec.single_action_space
        self._action_start = int(space.start) if isinstance(space, gymnasium.spaces.Discrete) else 0
        self._transform, _, _ = _obs_transform(self._vec.single_observation_space, cfg.id)
        self._returns = np.zeros(num_envs, dtype=np.float64)
        self._lengths = np.zeros(num_envs, dtype=np.int64)

    def reset(self, seed: int | None = None) -> np.ndarray:
        if seed is None:
            seed, self._seed = self._seed, None
        seeds = None if seed is None else [int(s) for s in _env_seeds(seed, self.num_envs)]
        obs, _ = self._vec.reset(seed=seeds)
        self._returns[:] = 0.0
        self._lengths[:] = 0
        return self._transform(obs)

    def step(self, actions: np.ndarray) -> StepResult:
        played = self._checked_actions(actions)
        obs, reward, terminated, truncated, info = self._vec.step(
            played + self._action_start if self._action_start else played)
        raw = np.asarray(reward, dtype=np.float32)
        self._count(raw)
        done = terminated | truncated
        final_obs = None
        returns: list[float] = []
        lengths: list[int] = []
        if done.any():
            returns, lengths = self._end_episodes(done)
            # SyncVectorEnv (same-step) puts the last observations in an object array, None for envs
            # that did not end: fill those rows with the current observation to get one dense batch.
            finals = info["final_obs"]
            rows = [finals[i] if done[i] else obs[i] for i in range(self.num_envs)]
            final_obs = self._transform(np.stack(rows))
        out = self._transform(obs)
        return StepResult(out, np.clip(raw, -1.0, 1.0) if self._clip else raw, np.asarray(terminated, bool),
                          np.asarray(truncated, bool), final_obs, returns, lengths, played)

    def close(self) -> None:
        self._vec.close()


FIRE_RESET_STEPS = 2
"""Steps of FIRE at the start of a life with `EnvConfig.fire_reset`. Two: a sticky action (the previous action
repeated, frame by frame) can swallow one step's FIRE, with probability sticky_action_prob ** frame_skip (0.4 %
at the v5 defaults); a game whose serve it swallowed would wait to the step cap."""


def _fire_action(cfg: EnvConfig, spec: EnvSpec) -> int | None:
    """The index of FIRE in `spec`'s actions when `cfg.fire_reset` is on and the game has it, else None."""
    if not cfg.fire_reset or not spec.action_meanings or "FIRE" not in spec.action_meanings:
        return None
    return spec.action_meanings.index("FIRE")


class _AtariBatchedEnv(BatchedEnv):
    """ALE ids on ale-py's native vector env.

    Episodic life (training only) uses the native `life_loss_info` flag: a lost life reports terminated
    while the game goes on, and the env is reset only at game over or truncation. (The native
    `episodic_life` flag instead resets the whole game at every lost life, which would never let the
    agent see later lives.) Rewards are always taken unclipped from the native env so that whole-game
    returns stay raw; clipping is applied here.
    """

    def __init__(self, cfg: EnvConfig, num_envs: int, seed: int, training: bool) -> None:
        from ale_py.vector_env import AtariVectorEnv

        game = _ale_game(cfg)
        self.spec = env_spec(cfg)
        self.num_envs = num_envs
        self._seed: int | None = seed
        self._clip = training and cfg.clip_rewards
        self._life_loss = training and cfg.episodic_life
        self._rgb = not cfg.grayscale
        max_steps = cfg.max_episode_steps or ATARI_DEFAULT_MAX_STEPS
        sticky = cfg.sticky_action_prob
        if training and cfg.train_sticky_action_prob is not None:
            sticky = cfg.train_sticky_action_prob
        self._env = AtariVectorEnv(
            game,
            num_envs,
            num_threads=cfg.num_threads or max(1, min(num_envs, _available_cpus())),
            max_num_frames_per_episode=max_steps * cfg.frame_skip,  # the native limit counts frames
            repeat_action_probability=sticky,
            full_action_space=cfg.full_action_space,
            autoreset_mode=AutoresetMode.SAME_STEP,
            img_height=cfg.image_size,
            img_width=cfg.image_size,
            grayscale=cfg.grayscale,
            stack_num=cfg.frame_stack,
            frameskip=cfg.frame_skip,
            maxpool=True,
            noop_max=cfg.noop_max,
            episodic_life=False,
            life_loss_info=self._life_loss,
            reward_clipping=False,
            use_fire_reset=False,
        )
        if int(self._env.single_action_space.n) != self.spec.num_actions:  # type: ignore[attr-defined]
            raise RuntimeError(f"{cfg.id}: native vector env has {self._env.single_action_space} but the "
                               f"spec says {self.spec.num_actions} actions")
        self._returns = np.zeros(num_envs, dtype=np.float64)
        self._lengths = np.zeros(num_envs, dtype=np.int64)
        self._lives = np.zeros(num_envs, dtype=np.int32)
        self._frames = np.zeros(num_envs, dtype=np.int32)
        self._fire = _fire_action(cfg, self.spec)
        self._fire_left = np.zeros(num_envs, dtype=np.int64)  # steps of FIRE still to press in each env

    def _format(self, obs: np.ndarray) -> np.ndarray:
        if not self._rgb:
            return obs  # already [E, stack, H, W]
        # [E, stack, H, W, 3] -> [E, stack * 3, H, W]
        e, s, h, w, c = obs.shape
        return np.ascontiguousarray(obs.transpose(0, 1, 4, 2, 3)).reshape(e, s * c, h, w)

    def reset(self, seed: int | None = None) -> np.ndarray:
        if seed is None:
            seed, self._seed = self._seed, None
        obs, info = self._env.reset(seed=None if seed is None else _env_seeds(seed, self.num_envs))
        self._returns[:] = 0.0
        self._lengths[:] = 0
        self._lives = np.array(info["lives"], dtype=np.int32)
        self._frames = np.array(info["episode_frame_number"], dtype=np.int32)
        self._fire_left[:] = FIRE_RESET_STEPS
        return self._format(obs)

    def step(self, actions: np.ndarray) -> StepResult:
        actions = self._checked_actions(actions)
        if self._fire is not None:
            actions = np.where(self._fire_left > 0, self._fire, actions)
            np.subtract(self._fire_left, 1, out=self._fire_left, where=self._fire_left > 0)
        obs, reward, terminated, truncated, info = self._env.step(actions)
        raw = reward.astype(np.float32)
        self._count(raw)
        done = terminated | truncated
        final_obs = None
        returns: list[float] = []
        lengths: list[int] = []
        if done.any():
            if self._life_loss:
                # A lost life that did not end the game: lives went down and the episode frame counter
                # kept counting (a reset restarts it near 0 and restores all lives). Everything else that
                # ended was a game over or a truncation, after which the native env has reset.
                lives, frames = info["lives"], info["episode_frame_number"]
                life_only = terminated & (lives < self._lives) & (frames > self._frames)
                game_over = done & ~life_only
            else:
                life_only = None
                game_over = done
            final = info.get("final_obs")
            if final is None:
                final = obs.copy()
            elif life_only is not None and life_only.any():
                # The native final_obs holds only the rows of envs it reset; after a lost life the
                # last observation of the episode is the current one.
                if not final.flags.writeable:
                    final = final.copy()
                final[life_only] = obs[life_only]
            final_obs = self._format(final)
            if game_over.any():
                returns, lengths = self._end_episodes(game_over)
        if self._fire is not None:
            # A life starts with a new game (the native env has reset) or after a lost life.
            self._fire_left[done | (info["lives"] < self._lives)] = FIRE_RESET_STEPS
        if self._life_loss or self._fire is not None:
            self._lives = np.array(info["lives"], dtype=np.int32)
            self._frames = np.array(info["episode_frame_number"], dtype=np.int32)
        return StepResult(self._format(obs), np.clip(raw, -1.0, 1.0) if self._clip else raw, terminated,
                          truncated, final_obs, returns, lengths, actions)

    def close(self) -> None:
        self._env.close()


def make_vector_env(cfg: EnvConfig, num_envs: int, seed: int, training: bool) -> BatchedEnv:
    """`num_envs` envs of `cfg.id`, reproducible from `seed`.

    `training` turns on the training-only transforms: reward clipping (if `cfg.clip_rewards`) and, for
    Atari, episodic life (if `cfg.episodic_life`). Evaluation (`training=False`) never uses either.
    """
    if num_envs < 1:
        raise ValueError(f"num_envs={num_envs} must be >= 1")
    if cfg.is_atari:
        return _AtariBatchedEnv(cfg, num_envs, seed, training)
    env_spec(cfg)  # validates the id and the spaces before building num_envs copies
    return _GymBatchedEnv(cfg, num_envs, seed, training)


# ----------------------------------------------------------------------------------------------------
# Single env for rendering


@functools.lru_cache(maxsize=8)
def _area_taps(src: int, dst: int) -> tuple[np.ndarray, np.ndarray]:
    """Area-averaging downscale along one axis with OpenCV INTER_AREA's weights, as taps.

    Output pixel i covers the source interval [i*s, (i+1)*s), s = src/dst; each source pixel contributes
    its overlap with that interval divided by s; partial pixels covering under 1e-3 are dropped, as
    OpenCV does, so that the two pipelines weigh the same pixels. Returns (index, weight), both [dst, K]:
    output i = sum_k weight[i, k] * source[index[i, k]] (unused taps have weight 0).
    """
    scale = src / dst
    taps: list[list[tuple[int, float]]] = []
    for i in range(dst):
        lo = i * scale
        hi = lo + scale
        cell = min(scale, src - lo)
        last = min(int(np.floor(hi)), src - 1)
        first = min(int(np.ceil(lo)), src - 1, last)
        row = []
        if first - lo > 1e-3:
            row.append((first - 1, (first - lo) / cell))
        row += [(j, 1.0 / cell) for j in range(first, last)]
        if hi - last > 1e-3:
            row.append((last, min(hi - last, 1.0) / cell))
        taps.append(row)
    width = max(len(row) for row in taps)
    index = np.zeros((dst, width), dtype=np.int64)
    weight = np.zeros((dst, width), dtype=np.float64)
    for i, row in enumerate(taps):
        for k, (j, w) in enumerate(row):
            index[i, k], weight[i, k] = j, w
    return index, weight


def _resize_area(frame: np.ndarray, size: int) -> np.ndarray:
    """Area-resize a uint8 [H, W] frame to [size, size] uint8."""
    iy, wy = _area_taps(frame.shape[0], size)
    ix, wx = _area_taps(frame.shape[1], size)
    src = frame.astype(np.float64)
    rows = sum(wy[:, k, None] * src[iy[:, k]] for k in range(iy.shape[1]))
    out = sum(wx[None, :, k] * rows[:, ix[:, k]] for k in range(ix.shape[1]))
    # Round to 4 decimals first so that exact halves (common at scale 2.5) round half-to-even, as
    # OpenCV's cvRound does, instead of going by float64 noise.
    return np.clip(np.rint(np.round(out, 4)), 0, 255).astype(np.uint8)


class _AtariEvalPreprocessing(gymnasium.Wrapper):
    """One ALE env (frameskip=1) with the native vector env's evaluation preprocessing, in Python.

    It mirrors ale-py 0.12's C++ pipeline step for step so that a network trained on `make_vector_env`
    observations acts on these unchanged: the same number of no-ops at reset (uniform in 0..noop_max-1),
    the raw frames of the last two skipped frames max-pooled (not refreshed when the game ends inside the
    skip), the same zero-padded frame stack, truncation after max_episode_steps * frame_skip frames, and no
    episodic life or reward clipping. gymnasium's AtariPreprocessing is not used because it needs OpenCV
    (not a dependency) and differs in these details (1..noop_max no-ops, stack padded with the reset frame).

    The one numerical difference: the resize is an area average computed in float64 here (same weights,
    exact halves rounded half-to-even like cvRound) where the native env runs OpenCV's INTER_AREA with
    float32 accumulation. Over 1000-step random episodes observations were bit-identical for Pong,
    Breakout and MsPacman at 84 and 96; SpaceInvaders and Seaquest at 84 had about 1 pixel in 10^4-10^5
    off by one grey level.
    """

    def __init__(self, env: gymnasium.Env, cfg: EnvConfig) -> None:
        super().__init__(env)
        atari = env.unwrapped
        self._ale = atari.ale  # type: ignore[attr-defined]
        self._action_set = list(atari._action_set)  # type: ignore[attr-defined]
        self._noop = type(self._action_set[0]).NOOP  # ale_py.Action.NOOP, whatever the action set
        self._frame_skip = cfg.frame_skip
        self._noop_max = cfg.noop_max
        self._size = cfg.image_size
        self._gray = cfg.grayscale
        self._max_frames = (cfg.max_episode_steps or ATARI_DEFAULT_MAX_STEPS) * cfg.frame_skip
        height, width = self._ale.getScreenDims()
        raw_shape = (height, width) if self._gray else (height, width, 3)
        self._raw = [np.zeros(raw_shape, np.uint8), np.zeros(raw_shape, np.uint8)]
        channels = 1 if self._gray else 3
        self._channels = channels
        self._stack = np.zeros((cfg.frame_stack * channels, self._size, self._size), np.uint8)
        self._elapsed = 0
        self.observation_space = gymnasium.spaces.Box(0, 255, self._stack.shape, np.uint8)
        self.action_space = gymnasium.spaces.Discrete(len(self._action_set))
        fire = type(self._action_set[0]).FIRE
        self._fire = self._action_set.index(fire) if cfg.fire_reset and fire in self._action_set else None
        self._fire_left = 0
        self._lives = 0

    def _grab(self, buffer: np.ndarray) -> None:
        if self._gray:
            self._ale.getScreenGrayscale(buffer)
        else:
            self._ale.getScreenRGB(buffer)

    def _push(self) -> np.ndarray:
        # The native env pools into its first buffer in place; keep that, it matters when the next step
        # ends before refreshing the buffers.
        np.maximum(self._raw[0], self._raw[1], out=self._raw[0])
        raw = self._raw[0]
        if self._gray:
            frame = _resize_area(raw, self._size)[None]
        else:  # channel by channel, straight into channels-first order
            frame = np.stack([_resize_area(raw[:, :, c], self._size) for c in range(3)])
        self._stack = np.roll(self._stack, -self._channels, axis=0)
        self._stack[-self._channels:] = frame
        return self._stack.copy()

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        _, info = self.env.reset(seed=seed, options=options)
        noops = int(self.env.unwrapped.np_random.integers(0, self._noop_max)) if self._noop_max > 0 else 0
        for _ in range(noops):
            self._ale.act(self._noop)
            if self._ale.game_over(with_truncation=False):
                self._ale.reset_game()
        self._stack[:] = 0
        self._grab(self._raw[0])
        self._raw[1][:] = 0
        self._elapsed = 0
        self._fire_left, self._lives = FIRE_RESET_STEPS, self._ale.lives()
        return self._push(), info

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """As the vector env's step; with `fire_reset` the played action is `info['action']`."""
        if self._fire is not None and self._fire_left > 0:
            action, self._fire_left = self._fire, self._fire_left - 1
        ale_action = self._action_set[int(action)]
        reward = 0.0
        game_over = False
        for skip in range(self._frame_skip, 0, -1):
            reward += self._ale.act(ale_action)
            game_over = self._ale.game_over(with_truncation=False)
            self._elapsed += 1
            if game_over or self._elapsed >= self._max_frames:
                break
            if skip <= 2:
                self._grab(self._raw[skip - 1])
        truncated = self._elapsed >= self._max_frames and not game_over
        lives = self._ale.lives()
        if lives < self._lives:
            self._fire_left = FIRE_RESET_STEPS
        self._lives = lives
        info = {"lives": lives, "episode_frame_number": self._ale.getEpisodeFrameNumber(), "action": int(action)}
        return self._push(), float(reward), bool(game_over), bool(truncated), info


class _ObsFormat(gymnasium.ObservationWrapper):
    """Applies the batched env's observation transform to a single env."""

    def __init__(self, env: gymnasium.Env, env_id: str) -> None:
        super().__init__(env)
        self._transform, shape, dtype = _obs_transform(env.observation_space, env_id)
        low, high = (0, 255) if dtype == np.uint8 else (-np.inf, np.inf)
        self.observation_space = gymnasium.spaces.Box(low, high, shape, dtype)

    def observation(self, observation: Any) -> np.ndarray:
        return self._transform(np.asarray(observation)[None])[0]


def make_render_env(cfg: EnvConfig, seed: int) -> gymnasium.Env:
    """One env with render_mode='rgb_array' and evaluation preprocessing (for a GIF of a greedy episode).

    Its observations have the shape, dtype and channel order of `make_vector_env`'s (see
    `_AtariEvalPreprocessing` for the one numerical difference of the Atari resize). `seed` seeds the
    first `reset()` called without a seed.
    """
    if cfg.is_atari:
        _ale_game(cfg)
        # max_num_frames_per_episode=0: no ALE-side limit, the wrapper truncates like the native env.
        env = _gym_make(cfg, time_limit=False, render_mode="rgb_array", frameskip=1,
                        repeat_action_probability=cfg.sticky_action_prob,
                        full_action_space=cfg.full_action_space, max_num_frames_per_episode=0)
        wrapped: gymnasium.Env = _AtariEvalPreprocessing(env, cfg)
    else:
        _check_gym_id(cfg)
        env = _gym_make(cfg, render_mode="rgb_array")
        _check_actions(env.action_space, cfg.id)
        wrapped = _ObsFormat(env, cfg.id)
    return _SeedFirstReset(wrapped, int(_env_seeds(seed, 1)[0]))


class _SeedFirstReset(gymnasium.Wrapper):
    """Makes the first reset() without a seed use the seed given at construction."""

    def __init__(self, env: gymnasium.Env, seed: int) -> None:
        super().__init__(env)
        self._pending: int | None = seed

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        if seed is None:
            seed, self._pending = self._pending, None
        else:
            self._pending = None
        return self.env.reset(seed=seed, options=options)
