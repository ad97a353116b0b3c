"""Greedy evaluation: play whole episodes with search (no noise, the most visited action) and report returns."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from rayzero.actors.network import LocalNetwork, RemoteNetwork, search_observations
from rayzero.config import EnvConfig, ModelConfig
from rayzero.envs import BatchedEnv, make_render_env, make_vector_env
from rayzero.inference.channel import GREEDY_OVERRIDES
from rayzero.models import build_model
from rayzero.tree import SearchConfig


def greedy(search_cfg: SearchConfig) -> SearchConfig:
    return dataclasses.replace(search_cfg, **GREEDY_OVERRIDES)


def play_episodes(
    env_cfg: EnvConfig, network: Any, search_cfg: SearchConfig, episodes: int, max_steps: int, seed: int,
    versions: list[int] | None = None, stop: Callable[[], bool] | None = None,
    timing: dict[str, float] | None = None, finished: list[bool] | None = None, lengths: list[int] | None = None,
    env: BatchedEnv | None = None,
) -> list[float]:
    """One episode in each of `episodes` parallel envs; returns their undiscounted, unclipped returns.

    A network with `whole_search` (the inference actor on a GPU) runs each step's search there, with the
    weights it holds at that moment; `versions`, when given, receives the weight version of every step.
    `stop`, asked before every step, ends the episodes where they are (their returns so far). `timing`, when
    given, adds up seconds: `search` (each step's search, a round trip when remote), `env` (the env steps), and
    for remote searches `queue` and `device` (the inference actor's: before launch, and the batch on the GPU);
    and `steps`, the batched steps played. `finished`, when given, receives whether each episode ended (not cut
    by `max_steps` or `stop`). `env`: `episodes` envs of env_cfg to play in (reset with `seed` first, so the
    games are those of new envs) and leave open; None: new ones, closed at the end."""
    own = env is None
    if env is None:
        env = make_vector_env(env_cfg, episodes, seed, training=False)
    elif env.num_envs != episodes:
        raise ValueError(f"play_episodes: episodes={episodes} but the env given has {env.num_envs} envs")
    config = greedy(search_cfg)
    generator = torch.Generator().manual_seed(seed)
    remote = getattr(network, "whole_search", False)
    try:
        obs = env.reset(seed=seed)
        returns = np.zeros(episodes)
        done = np.zeros(episodes, dtype=bool)
        steps = np.zeros(episodes, dtype=np.int64)
        clock = {"search": 0.0, "env": 0.0, "queue": 0.0, "device": 0.0, "steps": 0}
        for _ in range(max_steps):
            if stop is not None and stop():
                break
            start = time.perf_counter()
            if remote:
                answer = network.search(obs, config.temperature, dirichlet_fraction=config.dirichlet_fraction,
                                        gumbel_scale=config.gumbel_scale)
                action = np.asarray(answer["action"])
                if versions is not None:
                    versions.append(int(answer["version"]))
                clock["queue"] += answer.get("queue_ms", 0.0) / 1e3
                clock["device"] += answer.get("device_ms", 0.0) / 1e3
            else:
                action = search_observations(network, obs, config, generator).action.cpu().numpy()
            searched = time.perf_counter()
            clock["search"] += searched - start
            result = env.step(action)
            clock["env"] += time.perf_counter() - searched
            clock["steps"] += 1
            returns += np.where(done, 0.0, result.reward)
            steps += ~done
            done |= result.terminated | result.truncated
            obs = result.obs
            if done.all():
                break
    finally:
        if own:
            env.close()
        if finished is not None:
            finished.extend(bool(d) for d in done)
        if lengths is not None:
            lengths.extend(int(n) for n in steps)
        if timing is not None:
            for key, seconds in clock.items():
                timing[key] = timing.get(key, 0.0) + seconds
    return returns.tolist()


class EvalWorker:
    """Evaluates published weights in its own process (a Ray actor made in cluster/, with two threads, so that
    `cancel` reaches an evaluation while it plays)."""

    def __init__(self, env_cfg: EnvConfig, model_cfg: ModelConfig, search_cfg: SearchConfig, discount: float,
                 torch_threads: int = 1, server: Any = None):
        """server: the inference actor, when it runs whole searches on a GPU: evaluation then searches there
        (a CPU copy of an image network would take minutes per evaluation)."""
        from rayzero.envs import env_spec

        torch.set_num_threads(torch_threads)
        spec = env_spec(env_cfg)
        self.env_cfg, self.search_cfg = env_cfg, search_cfg
        if server is not None:
            self.network = RemoteNetwork(server, discount, f"eval-{os.getpid()}", whole_search=True)
        else:
            self.network = LocalNetwork(build_model(model_cfg, spec.observation_shape, spec.num_actions), discount)
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        # The envs of the last evaluation, kept for the next one of as many games (each resets them with its
        # seed, so it plays the games of new envs): making Atari envs costs more than most of an evaluation's
        # steps at the start, when the probe of the step time plays four short ones in a row (train.py;
        # docs/benchmarks.md, thirty-sixth session). One evaluation uses them at a time.
        self._envs: BatchedEnv | None = None
        self._envs_lock = threading.Lock()

    def set_inference(self, server: Any) -> None:
        """Search through `server` from now on (the driver made a new inference actor after one died)."""
        if isinstance(self.network, RemoteNetwork):
            self.network = self.network.on(server)

    def evaluate(self, weights: tuple[int, dict], episodes: int, max_steps: int, seed: int,
                 token: int | None = None, seconds: float = 0.0) -> dict[str, Any]:
        """Greedy episodes with `weights`; through the inference actor on its evaluation network, which holds
        them (`pinned` true), or where it has none (inference.pinned_eval off) with the served weights of each
        moment (the result's `version` is then the first step's, `last_version` the last step's).
        `token`: an id that `cancel` can name; a cancelled evaluation returns at once with `cancelled` true
        (and its episodes' returns so far). `seconds` > 0: a wall-clock budget, after which the episodes end
        where they are. `unfinished` counts the episodes that a budget (of steps or seconds) or a cancel cut;
        `lengths` gives each episode's steps (a greedy agent that stalls shows as games at the step cap);
        `ended` the wall-clock time (time.time()) it ended at."""
        start = time.perf_counter()  # the budget counts the weights' pinning too
        version, state_dict = weights
        pinned = self.network.pin(version, state_dict)
        versions: list[int] = []

        def cancelled() -> bool:
            with self._lock:
                return token is not None and token in self._cancelled

        def stop() -> bool:
            return cancelled() or (seconds > 0 and time.perf_counter() - start >= seconds)

        timing: dict[str, float] = {}
        finished: list[bool] = []
        lengths: list[int] = []
        with self._kept_envs(episodes, seed) as env:
            returns = play_episodes(self.env_cfg, self.network, self.search_cfg, episodes, max_steps, seed,
                                    versions, stop, timing, finished, lengths, env)
        result = {"version": versions[0] if versions else version, "returns": returns,
                  "mean": float(np.mean(returns)), "std": float(np.std(returns)),
                  "seconds": time.perf_counter() - start, "ended": time.time(), "steps": int(timing.pop("steps", 0)),
                  "cancelled": cancelled(), "unfinished": finished.count(False), "lengths": lengths,
                  "pinned": pinned,
                  **{f"{key}_seconds": value for key, value in timing.items()}}
        if versions:
            result["last_version"] = versions[-1]
        with self._lock:
            self._cancelled.discard(token)
        return result

    @contextlib.contextmanager
    def _kept_envs(self, episodes: int, seed: int) -> Iterator[BatchedEnv | None]:
        """The kept envs when they hold `episodes` games (made anew when not); None while another evaluation
        plays in them (play_episodes then makes its own). Envs that an evaluation left in an error are dropped."""
        if not self._envs_lock.acquire(blocking=False):
            yield None
            return
        try:
            if self._envs is not None and self._envs.num_envs != episodes:
                self._envs.close()
                self._envs = None
            if self._envs is None:
                self._envs = make_vector_env(self.env_cfg, episodes, seed, training=False)
            try:
                yield self._envs
            except BaseException:
                self._envs.close()
                self._envs = None
                raise
        finally:
            self._envs_lock.release()

    def cancel(self, token: int) -> None:
        """End the evaluation `token` at its next step (the run's end does not wait for one whose result it
        would not use); a token whose evaluation has not started yet is cancelled when it does."""
        with self._lock:
            self._cancelled.add(token)


def record_gif(env_cfg: EnvConfig, network: Any, search_cfg: SearchConfig, path: str, max_steps: int,
               seed: int) -> tuple[float, int, bool]:
    """Play one greedy episode in a rendering env and write its frames as a GIF; returns the episode's return,
    its length in steps, and whether it ended (False: cut at max_steps)."""
    from PIL import Image

    env = make_render_env(env_cfg, seed)
    config = greedy(search_cfg)
    obs, _ = env.reset(seed=seed)
    frames = [env.render()]
    total, steps, ended = 0.0, 0, False
    while steps < max_steps and not ended:
        out = search_observations(network, np.asarray(obs)[None], config)
        obs, reward, terminated, truncated, _ = env.step(int(out.action[0]))
        total += float(reward)
        steps += 1
        ended = bool(terminated or truncated)
        frames.append(env.render())
    env.close()
    images = [Image.fromarray(np.asarray(f)) for f in frames[:: max(1, len(frames) // 500)]]
    images[0].save(path, save_all=True, append_images=images[1:], duration=40, loop=0)
    return total, steps, ended
