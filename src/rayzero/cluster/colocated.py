"""The learner inside the inference actor's process (`cluster.colocate_learner`): one CUDA context on a host's
only GPU instead of two.

Two processes on one GPU take turns on it (time slices), so the learner's step waited whenever a search batch
ran, and the other way round. In one process their kernels go to separate CUDA streams and can run side by
side. The inference server keeps its event loop and threads; every learner call runs in one thread of its own
(with its own stream), so a training call never blocks the batcher. The driver keeps two handles: the actor as
the inference actor, and a `LearnerHandle` that turns `learner.train.remote(...)` into the actor's
`learner_call`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import importlib
import threading
import time
from typing import Any

import torch

from rayzero.config import LearnerConfig
from rayzero.inference.runner import HIGHEST_PRIORITY
from rayzero.inference.server import InferenceServer
from rayzero.learner import Learner
from rayzero.logs import logger

log = logger(__name__)

__all__ = ["ColocatedLearner", "LearnerHandle"]


class ColocatedLearner(InferenceServer):
    """An inference server that also hosts the run's learner (a single learner, no DDP)."""

    def __init__(self, inference_args: tuple, inference_kwargs: dict[str, Any], learner_args: tuple):
        super().__init__(*inference_args, **inference_kwargs)
        self._learner_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner")
        # The other end of the priorities from the inference streams' (inference.stream_priority).
        priority = HIGHEST_PRIORITY if self.cfg.stream_priority == "low" else 0
        started = time.perf_counter()
        self.learner: Learner = self._learner_thread.submit(self._make_learner, learner_args, priority).result()
        log.info("colocated learner built in %.1f s", time.perf_counter() - started)
        if self.learner.compile_state == "background":
            # Inductor's modules, imported while replay fills, not in the stall of the learner's own compile once
            # the helpers are done; in a thread of their own: in the learner's they held back its first call, the
            # weights the run starts from, and with it self-play's start.
            threading.Thread(target=importlib.import_module, args=("torch._inductor.compile_fx",),
                             name="import-inductor", daemon=True).start()

    @staticmethod
    def _make_learner(learner_args: tuple, priority: int = 0) -> Learner:
        """In the learner thread: its CUDA work goes to a stream of its own, beside the inference streams."""
        learner_args = (learner_args[0], thread_safe_compile(learner_args[1]), *learner_args[2:])
        if learner_args[1].device != "cpu" and torch.cuda.is_available():
            torch.cuda.set_stream(torch.cuda.Stream(priority=priority))  # before the learner's first CUDA work
        return Learner(*learner_args)

    async def learner_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`Learner.<method>(*args, **kwargs)` in the learner thread (calls run one at a time, in order)."""
        if method.startswith("_") or not callable(getattr(self.learner, method, None)):
            raise AttributeError(f"learner_call: {method!r} is not a method of the learner")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._learner_thread,
                                          functools.partial(getattr(self.learner, method), *args, **kwargs))


def thread_safe_compile(cfg: LearnerConfig, say: bool = True) -> LearnerConfig:
    """The learner's settings for a thread other than the main one. Inductor's CUDA graphs ('reduce-overhead')
    keep per-thread state that torch before the fix of pytorch/pytorch#123177 (torch 2.11 on the GPU host) sets up
    for the main thread only, so the colocated learner compiles in mode 'default' and replays the whole step as one
    CUDA graph of its own (learner.step_graph, which does not use inductor's). The background helper, a process of
    its own, compiles the same mode, so the cache it fills is the one looked up here."""
    if cfg.compile_mode == "reduce-overhead" and cfg.step_graph:
        if say:
            log.info("colocated learner: compiling in mode 'default', the whole step replayed as one CUDA graph "
                     "(learner.step_graph), not with inductor's CUDA graphs, which need the main thread")
        return dataclasses.replace(cfg, compile_mode="default")
    return cfg


class _Method:
    def __init__(self, actor: Any, name: str):
        self.actor, self.name = actor, name

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.actor.learner_call.remote(self.name, *args, **kwargs)


class LearnerHandle:
    """The learner role's handle on a `ColocatedLearner` actor: `handle.train.remote(...)` and the rest, as on a
    `Learner` actor."""

    def __init__(self, actor: Any):
        self.actor = actor

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self.actor, name)
