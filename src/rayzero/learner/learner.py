"""The learner role: MuZero updates with AdamW (or SGD with momentum), a weight version counter, save and load.

`Learner` is a plain class (tests use it in-process); `cluster/` makes it a Ray actor, or `LearnerGroup`
(learner/group.py) runs several as DDP ranks. One update (`_update`) is: optional target-network bootstraps,
the loss module's forward under bf16 autocast, backward, global-norm clipping, AdamW or SGD (fused on CUDA).
On CUDA the loss module is torch.compile'd, by default with CUDA graphs ('reduce-overhead'), since the
compiled step is otherwise bound by Python launching its kernels (docs/benchmarks.md). If compiling or the
first steps fail, the learner falls back to the plain compile mode, then to eager, and logs why (compiler errors
only: an OOM or an error in the loss propagates). Nothing in the update waits for the device:
metrics are summed on the device and read once per `train` call, priorities go back through
`PriorityOutbox`, and batches arrive through `Prefetcher` (learner/prefetch.py), so sampling, gathering and
the copy overlap the update.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import inspect
import math
import pickle
import sys
import time
import traceback
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
try:
    from safetensors import SafetensorError
except ImportError:  # older safetensors
    SafetensorError = Exception  # type: ignore[misc,assignment]
from safetensors.torch import load_file, save_file

from rayzero.config import LearnerConfig, ModelConfig
from rayzero.devices import resolve_device
from rayzero.learner import background
from rayzero.learner.checkpoint import MODEL, CheckpointError
from rayzero.learner.loss import STAT_NAMES, CompiledRegions, ConsistencyHeads, MuZeroLoss, bootstrap_values
from rayzero.learner.prefetch import PriorityOutbox, Prefetcher, Staging, Uploaded
from rayzero.learner.step_graph import StepGraph
from rayzero.logs import first_line, logger
from rayzero.models import build_model
from rayzero.models.state import StateDict, copy_into, snapshot
from rayzero.replay.buffer import Batch

METRIC_NAMES = ("loss", *STAT_NAMES, "grad_norm", "stale_samples")
EXTRA_FILE = "learner_extra.safetensors"  # target network and consistency heads (not part of the published net)


class _Switch(torch.nn.Module):
    """forward(batch) -> the loss module's output, through its compiled form when one is set."""

    def __init__(self, inner: torch.nn.Module, compiled: Any | None):
        super().__init__()
        self.inner = inner
        self.__dict__["compiled"] = compiled  # not a submodule: its parameters are the inner module's

    def use(self, compiled: Any | None) -> None:
        self.__dict__["compiled"] = compiled

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        compiled = self.__dict__["compiled"]
        return (compiled if compiled is not None else self.inner)(batch)


_GC = {"count": 0, "seconds": 0.0, "start": None}  # collections in this process (any thread) and their time


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _GC["start"] = time.perf_counter()
    elif _GC["start"] is not None:
        _GC["count"] += 1
        _GC["seconds"] += time.perf_counter() - _GC["start"]
        _GC["start"] = None


gc.callbacks.append(_on_gc)
FULL_GC_EVERY = 20  # train calls between full collections with learner.manual_gc
EAGER_BEFORE_GRAPH = 2  # eager updates (cuDNN's algorithm search, the optimizer's state) before the step graph


log = logger(__name__)


_COMPILER_DIRS = tuple(str(Path(torch.__file__).parent / part)
                       for part in ("_dynamo", "_inductor", "cuda/graphs.py"))


def avoid_miscompiles() -> None:
    """Inductor settings the learner's step needs to be computed right. Mix-order reduction (on by default since
    torch 2.10) dropped writes of fused backward reductions (pytorch/pytorch#193061, fixed by #193103), which gave
    the compiled step wrong gradients at some batch sizes on the GPU host (docs/benchmarks.md, ninth session).
    Set in every process that compiles the step, so the compile cache keys agree."""
    import torch._inductor.config as inductor

    if hasattr(inductor.triton, "mix_order_reduction"):
        inductor.triton.mix_order_reduction = False


def _optimizer(cfg: LearnerConfig, params: Any, cuda: bool, graphed: bool) -> torch.optim.Optimizer:
    """SGD with momentum or AdamW, fused on CUDA. graphed (learner.step_graph may capture the step): AdamW keeps
    its step counter on the GPU (`capturable`), which a CUDA graph needs; SGD keeps none."""
    kernels: dict[str, bool] = {"fused": True} if cuda else {"foreach": True}
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **kernels)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **kernels,
                             **({"capturable": True} if graphed else {}))


def _worst_gradients(compiled: dict[str, torch.Tensor], module: torch.nn.Module, count: int = 4) -> str:
    """The `count` parameters whose compiled gradients differ most from the eager ones now in `module`: where a
    miscompiled kernel wrote (the compile check's report)."""
    rows = []
    for name, param in module.named_parameters():
        if param.grad is not None and name in compiled:
            eager = param.grad.detach().float()
            rows.append(((compiled[name] - eager).norm().item(), name, compiled[name].norm().item(), eager.norm().item()))
    rows.sort(reverse=True)
    return ", ".join(f"{name} {c:.3g} / {e:.3g}" for _, name, c, e in rows[:count]) or "none"


def is_compile_error(error: BaseException) -> bool:
    """Whether a failure of a compiled step is the compiler's (worth a plainer mode): one of torch.compile's
    exception types, or raised from inside dynamo, inductor or CUDA-graph capture. Out-of-memory errors and
    errors raised by the loss code itself are not."""
    import torch._dynamo.exc

    if isinstance(error, torch.OutOfMemoryError):
        return False
    if isinstance(error, torch._dynamo.exc.TorchDynamoException):
        return True
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_COMPILER_DIRS)


class _SideStep:
    """A no-grad computation the step's inputs need (the target network's bootstraps, the consistency targets):
    compiled when the step is, without CUDA graphs; after a compiler failure (logged once) it runs eagerly, and
    an out-of-memory error or a bug still raises."""

    def __init__(self, fn: Callable[..., torch.Tensor], what: str, use_compile: bool, backend: str = "inductor",
                 later: bool = False):
        """later: stay eager until `start_compiling` (the learner's background compile)."""
        self.fn, self.what, self.backend, self.wanted = fn, what, backend, use_compile
        self.compiled = None
        if use_compile and not later:
            self.start_compiling()

    def start_compiling(self) -> None:
        self.compiled = torch.compile(self.fn, dynamic=False, backend=self.backend)

    def __call__(self, *args: Any) -> torch.Tensor:
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as error:
                if not is_compile_error(error):
                    raise
                log.warning(f"torch.compile of {self.what} failed ({type(error).__name__}); running it eagerly")
                self.compiled = None
        return self.fn(*args)


class Learner:
    """One learner (or one DDP rank, with `distributed=True` inside an initialised process group)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        cfg: LearnerConfig,
        obs_shape: tuple[int, ...],
        num_actions: int,
        seed: int = 0,
        torch_threads: int = 0,
        distributed: bool = False,
    ):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        torch.manual_seed(seed)
        self.cfg = cfg
        self._build_args = (model_cfg, tuple(obs_shape), num_actions)  # for the background compile's helper
        self.device = resolve_device(cfg.device)
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # batch shapes are fixed: let cuDNN time its conv algorithms
        self.model = build_model(model_cfg, obs_shape, num_actions).to(self.device)
        self.model.train()
        self.channels_last = cfg.channels_last and len(obs_shape) == 3
        if self.channels_last:
            self.model.to(memory_format=torch.channels_last)
        self.consistency = None
        if cfg.consistency_weight > 0:
            self.model.eval()  # a probe that leaves the BatchNorm statistics alone
            with torch.no_grad():
                features = self.model.represent(torch.zeros(2, *obs_shape, device=self.device)).flatten(1).shape[1]
            self.model.train()
            self.consistency = ConsistencyHeads(features, cfg.consistency_dim).to(self.device)
        self.loss_module = MuZeroLoss(self.model, cfg.value_loss_weight, self.consistency, cfg.consistency_weight,
                                      self.channels_last, cfg.shift_pixels, cfg.dynamics_grad_scale,
                                      cfg.unroll_step_weight)
        use_compile = cfg.compile if cfg.compile is not None else self.device.type == "cuda"
        self._init_compile(use_compile, distributed)
        self.world_size, self.rank = 1, 0
        self._forward: torch.nn.Module = self._switch
        if distributed:
            self._join_ranks()
        cuda = self.device.type == "cuda"
        self.optimizer = _optimizer(cfg, self.loss_module.parameters(), cuda, cuda and cfg.step_graph and not distributed)
        self.target = None
        if cfg.target_update_interval:
            self.target = copy.deepcopy(self.model).eval().requires_grad_(False)
        # Its forward over [B, K+1] observations costs more GPU time than the step's own: compiled too.
        side_compile = use_compile and cfg.compile_side_steps
        side = {"backend": cfg.compile_backend, "later": self._background}
        self._bootstrap = _SideStep(bootstrap_values, "the target network", side_compile and self.target is not None,
                                    **side)
        self._consistency_targets = _SideStep(self.loss_module.consistency_targets, "the consistency targets",
                                              side_compile and self.consistency is not None
                                              and cfg.consistency_targets == "separate", **side)
        if (self.consistency is not None and cfg.consistency_targets == "step" and use_compile
                and cfg.compile_mode == "reduce-overhead" and self.device.type == "cuda"):
            log.warning("learner.consistency_targets=step with CUDA graphs: the consistency loss did not train this "
                        "way on an H200 (torch 2.11); 'separate' does")
        # learner.step_graph: where the update runs eagerly on CUDA, it replays as one CUDA graph (a DDP rank
        # never: its all-reduce hooks are not captured). Captured after a few eager updates (learner/step_graph.py).
        self._step_graph = (StepGraph(self._graph_body, self.optimizer, self.device)
                            if cfg.step_graph and cuda and not distributed else None)
        self._eager_updates = 0  # eager updates outside the graph (the graph is captured after EAGER_BEFORE_GRAPH)
        self.graph_updates = 0
        self.steps = 0
        self.version = 0
        self.samples = 0
        self._sums = torch.zeros(len(METRIC_NAMES), device=self.device)
        self._sum_steps = 0
        self._staging: Staging | None = None
        self._prefetcher: Prefetcher | None = None
        self._outbox: PriorityOutbox | None = None
        self._calls = 0
        self._published: tuple[int, int, StateDict] | None = None  # (version, steps, weights) of `weights`
        self._train_ended: float | None = None  # perf_counter() when the last train call ended
        self._weights_s = 0.0  # seconds in `weights` since then
        self._prewarm: background.PrewarmWatch | None = None
        if self._background and cfg.prewarm_dir:
            self._prewarm = background.PrewarmWatch(cfg.prewarm_dir)  # learner.early_compile: the driver's helpers
        elif self._background:
            self._spawn_helpers()

    def _init_compile(self, use_compile: bool, distributed: bool) -> None:
        """The compile state: the modes to try (the first steps of each are watched, a failure moves to the next,
        then eager), and with learner.background_compile eager until the helper process has filled the cache."""
        cfg = self.cfg
        if use_compile:
            avoid_miscompiles()
        # The inner loss module is what gets compiled, so the graph (and the compile cache entry it reuses across
        # processes) is the same with and without DDP; DDP reduces the gradients after the compiled backward.
        self._switch = _Switch(self.loss_module, None)
        fallback = ["default"] if cfg.compile_mode != "default" else []
        self._modes = ([cfg.compile_mode] + fallback) if use_compile else []
        self._graphs = False
        self._watch_steps = 0
        self._check_steps = 0  # compiled updates still to check against eager (learner.compile_check_steps)
        self._check_counts: dict[str, int] | None = None  # compile counters at a mode's first checked update
        self._check_enabled = not distributed
        self.compile_state = "off"  # "pending:<mode>", then "on:<mode>", or "failed"; "background" before those
        # With learner.background_compile: eager until the helper process has filled the compile cache.
        self._background = use_compile and cfg.background_compile and not distributed
        self._background_helpers: list[Any] = []  # the helper processes (started with the learner)
        self._helper_parts: list[str] = []  # the part each of them compiles (background.PARTS)
        self._cache_counts: dict[str, int] | None = None  # the compile cache's counters before compiling here
        self.compile_cache_use: dict[str, int] | None = None  # hits and misses of that compile, once done
        self._graph_cache_counts: dict[str, int] | None = None  # the counters when the compiled step began
        self._background_started = 0.0
        self.background_compile_s: float | None = None  # how long the helper took (None: none ran, or not yet)
        # The loss as regions (learner.compile_regions), or with learner.regions_first as regions until the whole
        # loss's helper is done (then `_whole_waiting` turns False and the compile moves to the whole loss).
        can_split = not self.model.value_prefix
        self._whole_waiting = self._background and cfg.regions_first and not cfg.compile_regions and can_split
        self._regions = can_split and (cfg.compile_regions or self._whole_waiting)
        self._regions_fallback: str | None = None  # the mode the regions compiled in, while the whole loss is tried
        if self._background:
            self.compile_state = "background"
        else:
            self._next_compile_mode()

    def _join_ranks(self) -> None:
        """As one rank of the initialised process group: wrap the loss in DDP, or (grad_sync 'flat') start from
        rank 0's parameters and buffers, as DDP does."""
        import torch.distributed as dist

        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        if self.cfg.grad_sync == "ddp":
            # Buffers (BatchNorm statistics) are not broadcast before each forward: training normalises
            # with batch statistics, so only rank 0's running statistics, which it publishes, matter.
            DDP = torch.nn.parallel.DistributedDataParallel
            no_sync = ({"forward_sync_buffers": False}  # torch >= 2.13 (broadcast_buffers is deprecated)
                       if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                       else {"broadcast_buffers": False})
            self._forward = DDP(
                self._switch, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                bucket_cap_mb=64, gradient_as_bucket_view=True, **no_sync,
            )
        else:
            with torch.no_grad():
                for tensor in self.loss_module.state_dict().values():
                    dist.broadcast(tensor, 0)

    # -- one update ------------------------------------------------------------------------------------

    def _lr_factor(self, step: int) -> float:
        cfg = self.cfg
        if cfg.lr_warmup_steps and step < cfg.lr_warmup_steps:
            return (step + 1) / cfg.lr_warmup_steps
        if not cfg.lr_decay_steps:
            return 1.0
        progress = min(1.0, (step - cfg.lr_warmup_steps) / cfg.lr_decay_steps)
        final = cfg.lr_final_fraction
        return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress))

    def _next_compile_mode(self) -> None:
        """Compile with the next mode in line (eager when none is left; with learner.regions_first, back to the
        regions' step when the whole loss's failed)."""
        if not self._modes and self._regions_fallback is not None:
            log.warning("the whole loss's compiled step failed; training on its regions' step")
            self._modes, self._regions, self._regions_fallback = [self._regions_fallback], True, None
        if not self._modes:
            self._switch.use(None)
            self._graphs, self._watch_steps = False, 0
            if self.compile_state != "off":
                self.compile_state = "failed"
            return
        mode = self._modes.pop(0)
        if getattr(self, "_step_graph", None) is not None:
            self._step_graph.drop()  # the compiled step takes over from the eager one's graph
        compile = self._compiler(mode)
        if self._regions:
            self._switch.use(CompiledRegions(self.loss_module, compile))
        else:
            self._switch.use(compile(self.loss_module))
        # CUDA graphs (reduce-overhead) reuse their output memory at the next replay: outputs are consumed within
        # the step, and each step is marked, so a replay never overwrites what is still needed.
        self._graphs = (mode == "reduce-overhead" and self.device.type == "cuda"
                        and self.cfg.compile_backend == "inductor")
        self._watch_steps = 3  # compilation, then CUDA-graph warm-up and recording, happen in the first steps
        self._check_steps = self.cfg.compile_check_steps if self._check_enabled else 0
        self._check_counts = None
        self.compile_state = f"pending:{mode}"

    def _what_next(self) -> str:
        """What `_next_compile_mode` will do, for the log line of a compiled step that failed."""
        if self._modes:
            return f"trying mode {self._modes[0]}"
        return "going back to the regions' step" if self._regions_fallback is not None else "training eagerly"

    def _compiler(self, mode: str) -> Any:
        """torch.compile as the learner compiles its step in `mode`."""
        if self.cfg.compile_backend == "inductor":
            return functools.partial(torch.compile, dynamic=False, mode=mode)
        return functools.partial(torch.compile, dynamic=False, backend=self.cfg.compile_backend)  # modes: inductor's

    # -- background compile ----------------------------------------------------------------------------

    def _spawn_helpers(self) -> None:
        """learner.background_compile: start the helpers now, so they are ready to compile at the first batch."""
        model_cfg, obs_shape, num_actions = self._build_args
        self._helper_parts = background.parts(self.cfg, model_cfg)
        self._background_helpers = [background.spawn(model_cfg, self.cfg, obs_shape, num_actions, self.device, part)
                                    for part in self._helper_parts]

    def _background_turn(self, tensors: dict[str, torch.Tensor], stale: int) -> None:
        """Hand the first batch to the helpers; once all have ended, compile here (from the cache they filled).
        With helpers the driver started (learner.early_compile), wait on those instead: they may be done already."""
        first = not self._background_started
        if first:
            self._background_started = time.perf_counter()
        # learner.regions_first: the regions' helpers first; the whole loss's ("step") is awaited later.
        skip = ("step",) if self._whole_waiting else ()
        if self._prewarm is not None:
            codes = self._prewarm.codes(skip)
            if codes is None:
                if first:
                    log.info("the helpers started with the run are compiling the learner's step; updates run eagerly "
                             "until they are done")
                return
            done = "were done by the first update" if first else (
                f"were done {time.perf_counter() - self._background_started:.0f} s after the first update")
        else:
            helpers = self._background_helpers
            if first:
                for helper in helpers:
                    background.hand_over(helper, tensors, stale)
                log.info(f"compiling the learner's step in {len(helpers)} helper processes; updates run eagerly "
                         "until they are done")
                return
            helpers = [helper for part, helper in zip(self._helper_parts, helpers) if part not in skip]
            if any(helper.poll() is None for helper in helpers):
                return
            for helper in helpers:
                background.clean_up(helper)
            codes = [helper.returncode for helper in helpers]
            done = f"compiled the step in {time.perf_counter() - self._background_started:.0f} s"
        self.background_compile_s = time.perf_counter() - self._background_started
        failed = [code for code in codes if code != 0]
        if failed:
            log.warning(f"a helper process failed to compile the step (exit code {failed[0]}); compiling it here")
        elif self._whole_waiting and self._whole_code() == 0:
            # The whole loss's helper is done too (a warm cache): compile the whole loss at once, not the regions'
            # step and its checked updates first; the regions' step is what a failed check goes back to.
            self._whole_waiting, self._regions = False, False
            self._regions_fallback, self._modes = self._modes[0], self._modes[:1]
            log.info(f"the helpers {done}, and the whole loss's helper is done too: compiling the whole loss here "
                     "from the warm cache (its regions' step kept to fall back on)")
        else:
            log.info(f"the helpers {done}; compiling it here from the warm cache")
        self._background = False
        self._cache_counts = _compile_cache_counts()
        self._next_compile_mode()
        for side in (self._bootstrap, self._consistency_targets):
            if side.wanted and side.compiled is None:
                side.start_compiling()

    def _whole_turn(self) -> None:
        """learner.regions_first, once the regions' step is compiled and checked (or has failed): when the whole
        loss's helper is done, compile the whole loss here from the cache it filled (its first updates watched and
        checked as any compiled step's), the regions' step kept to fall back on."""
        code = self._whole_code()
        if code is None:
            return
        self._whole_waiting = False
        if code != 0:
            log.warning(f"the whole loss's helper failed (exit code {code}); training on its regions' step")
            return
        regions_on = self.compile_state.startswith("on:")  # else the regions' step failed, and it trains eagerly
        mode = self.compile_state.split(":", 1)[1] if regions_on else self.cfg.compile_mode
        log.info(f"the whole loss's helper is done (update {self.steps}); compiling it here from the warm cache")
        self._regions, self._regions_fallback, self._modes = False, mode if regions_on else None, [mode]
        self._cache_counts = _compile_cache_counts()
        self._next_compile_mode()

    def _whole_code(self) -> int | None:
        """The whole loss's helper's exit code once it has ended, else None."""
        if self._prewarm is not None:
            return self._prewarm.code("step")
        helper = self._background_helpers[self._helper_parts.index("step")]
        code = helper.poll()
        if code is not None:
            background.clean_up(helper)
        return code

    def close_background_compile(self) -> None:
        """Stop helper processes still compiling (the learner is going away); training stays eager until the
        next update compiles here."""
        for helper in self._background_helpers:
            if helper.poll() is None:
                helper.terminate()
                helper.wait(timeout=10)
                background.clean_up(helper)

    def _autocast(self, in_graph: bool = False) -> torch.autocast:
        """bf16 autocast on CUDA (learner.bf16); in_graph: for the step graph, without the cache of cast weights,
        which CUDA-graph capture does not support."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16,
                              enabled=self.cfg.bf16 and self.device.type == "cuda", cache_enabled=not in_graph)

    def _loss_and_backward(self, tensors: dict[str, torch.Tensor], in_graph: bool = False) -> tuple[torch.Tensor, ...]:
        if self._graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with self._autocast(in_graph):
            loss, stats, priorities = self._forward(tensors)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        return loss, stats, priorities

    def _update(self, tensors: dict[str, torch.Tensor], stale: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on device tensors; returns (priorities [B], metrics [len(METRIC_NAMES)]), unsynced."""
        cfg = self.cfg
        if self._background:
            self._background_turn(tensors, stale)
        elif self._whole_waiting and (self.compile_state == "failed"
                                      or self.compile_state.startswith("on:") and not self._check_steps):
            self._whole_turn()
        if self.target is not None:
            if "bootstrap_obs" not in tensors:
                raise ValueError("learner.target_update_interval > 0 needs batches with bootstrap observations: "
                                 "set replay.bootstrap_obs=true")
            if self.steps % cfg.target_update_interval == 0:
                self.sync_target()
        if self.consistency is not None and "next_obs" not in tensors:
            raise ValueError("learner.consistency_weight > 0 needs batches with next observations: "
                             "set replay.next_obs=true")
        lr = cfg.lr * self._lr_factor(self.steps)
        graph = self._step_graph
        if self._graph_ready():
            captures = graph.captures
            loss, stats, priorities, grad_norm = graph(tensors, lr)
            priorities = priorities.clone()  # the graph's outputs are rewritten by its next replay
            if graph.captures > captures:
                what = "eager" if self._switch.compiled is None else self.compile_state.split(":")[-1] + " compiled"
                since = ""
                if self._graph_cache_counts is not None and self._switch.compiled is not None:
                    # Compiles the capture itself caused (a guard that failed under it recompiles the step).
                    now = _compile_cache_counts()
                    since = (f"; compiles since the compiled step began: "
                             f"{now['graph_cache_hit'] - self._graph_cache_counts['graph_cache_hit']} from the cache, "
                             f"{now['graph_cache_miss'] - self._graph_cache_counts['graph_cache_miss']} new")
                log.info(f"the {what} step replays as one CUDA graph from update {self.steps + 1} "
                         f"(learner.step_graph){since}")
            self.graph_updates += 1
        else:
            loss, stats, priorities, grad_norm = self._plain_update(tensors, lr)
        with torch.no_grad():
            metrics = torch.cat([loss.detach().float().view(1), stats.float(), grad_norm.detach().float().view(1),
                                 torch.full((1,), float(stale), device=self.device)])
            self._sums += metrics
        self._sum_steps += 1
        self.steps += 1
        self.samples += len(tensors["weights"]) * self.world_size
        return priorities, metrics

    def _graph_ready(self) -> bool:
        """Whether this update goes through learner.step_graph: an eager step after its first updates, or a
        compiled one without CUDA graphs of its own once its first steps are watched and checked."""
        graph = self._step_graph
        if graph is None or graph.failed:
            return False
        if self._switch.compiled is None:
            return self._eager_updates >= EAGER_BEFORE_GRAPH
        return not self._graphs and not self._watch_steps and not self._check_steps

    def _step_inputs(self, tensors: dict[str, torch.Tensor], in_graph: bool = False) -> dict[str, torch.Tensor]:
        """The batch with what the loss needs computed beforehand: target-network bootstraps folded into the value
        targets, and the consistency targets in place of the next observations. in_graph: for the step graph."""
        cfg = self.cfg
        if self.target is not None:
            with self._autocast(in_graph):
                boot = self._bootstrap(self.target, tensors["bootstrap_obs"], self.channels_last).float()
            tensors = dict(tensors, target_values=tensors["target_values"] + tensors["bootstrap_scale"] * boot)
        if self.consistency is not None and cfg.consistency_targets == "separate":
            with self._autocast(in_graph):
                targets = self._consistency_targets(tensors["next_obs"])
            tensors = {**{k: v for k, v in tensors.items() if k != "next_obs"}, "consistency_targets": targets}
        return tensors

    def _clip_and_step(self, lr: float | None) -> torch.Tensor:
        """Global-norm clipping and the optimizer step on the gradients in place; returns the norm. lr: the rate to
        set first (None: the one set, as in the step graph, which reads it from a device tensor)."""
        cfg = self.cfg
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self.world_size > 1 and cfg.grad_sync == "flat":
            self._all_reduce_flat(params)
        if cfg.grad_clip:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip, foreach=True)
        else:
            grad_norm = torch.zeros((), device=self.device)
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()
        return grad_norm

    def _graph_body(self, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The whole update (eager, or compiled without CUDA graphs), as learner.step_graph captures it: no host
        sync, no Python-side state."""
        loss, stats, priorities = self._loss_and_backward(self._step_inputs(tensors, in_graph=True), in_graph=True)
        grad_norm = self._clip_and_step(None)
        return loss.detach(), stats, priorities, grad_norm

    def _plain_update(self, tensors: dict[str, torch.Tensor], lr: float) -> tuple[torch.Tensor, ...]:
        """An update without the step graph: compiled (its first steps watched, and checked against eager) or
        eager."""
        tensors = self._step_inputs(tensors)
        before = self._check_point() if self._check_steps and self._switch.compiled is not None else None
        while True:
            if not self._watch_steps:
                loss, stats, priorities = self._loss_and_backward(tensors)
                break
            try:
                loss, stats, priorities = self._loss_and_backward(tensors)
            except Exception as error:
                self.optimizer.zero_grad(set_to_none=True)
                if not is_compile_error(error):  # an OOM or a bug in the loss: eager would not help
                    raise
                log.warning(f"torch.compile ({self.compile_state.split(':')[-1]}) failed ({type(error).__name__}: "
                    f"{first_line(error, 300)}); "
                    f"{self._what_next()}")
                self._next_compile_mode()
                continue
            self._watch_steps -= 1
            if not self._watch_steps:
                self.compile_state = "on:" + self.compile_state.split(":", 1)[1]
                self._log_cache_use()
            break
        if before is not None and self._switch.compiled is not None:
            loss, stats, priorities = self._check_against_eager(tensors, before, loss, stats)
        if self._switch.compiled is None:
            self._eager_updates += 1
        return loss, stats, priorities, self._clip_and_step(lr)

    def _log_cache_use(self) -> None:
        """After a background compile: how the compile here used the cache the helpers filled (a miss means
        the helpers compiled something other than what this learner runs, and it compiled here from scratch)."""
        if self._cache_counts is None:
            return
        now = _compile_cache_counts()
        used = {name: now.get(name, 0) - self._cache_counts.get(name, 0) for name in now}
        self._cache_counts = None
        self.compile_cache_use = used
        if self.cfg.compile_backend == "inductor":
            text = ", ".join(f"{count} {name.replace('_', ' ')}" for name, count in used.items())
            (log.warning if used.get("graph_cache_miss") else log.info)(
                f"the compile here from the helpers' cache: {text}; {_compile_phases()}")
            self._graph_cache_counts = now

    def _check_point(self) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
        """What a step changes besides the gradients: the BatchNorm statistics, and the RNG (augmentation)."""
        buffers = [b.detach().clone() for b in self.loss_module.buffers()]
        cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return buffers, torch.get_rng_state(), cuda_rng

    def _grad_norm(self) -> float:
        return torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in self.loss_module.parameters()
                                                     if p.grad is not None])).item()

    def _rerun(self, tensors: dict[str, torch.Tensor], before: tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None],
               eager: bool) -> tuple[torch.Tensor, ...]:
        """The update's loss and gradients once more from the state `before` it (BatchNorm statistics, RNG):
        eagerly, or through the compiled step."""
        buffers, cpu_rng, cuda_rng = before
        with torch.no_grad():
            for buffer, saved in zip(self.loss_module.buffers(), buffers):
                buffer.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, self.device)
        if not eager:
            return self._loss_and_backward(tensors)
        with self._autocast():
            loss, stats, priorities = self.loss_module(tensors)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        return loss, stats, priorities

    def _check_against_eager(self, tensors: dict[str, torch.Tensor],
                             before: tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None],
                             compiled_loss: torch.Tensor, compiled_stats: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The compiled step has left its gradients: rerun the step eagerly from the state before it, compare the
        gradient norms, and keep the eager outputs and gradients. A mismatch moves to the next compile mode; its
        warning gives the forward's loss terms of both too (equal terms point at the backward)."""
        compiled_norm = self._grad_norm()
        compiled_terms = _loss_terms(compiled_loss, compiled_stats)
        compiled = {name: p.grad.detach().float().clone() for name, p in self.loss_module.named_parameters()
                    if p.grad is not None}
        loss, stats, priorities = self._rerun(tensors, before, eager=True)
        eager_norm = self._grad_norm()
        self._check_steps -= 1
        mode = self.compile_state.split(":")[-1]
        counts, first_check = _compile_counts(), self._check_counts is None
        if first_check:  # the first checked update compiled the step; what compiles after it is a recompile
            self._check_counts = counts
        if not (math.isfinite(compiled_norm) and abs(compiled_norm - eager_norm) <= 0.25 * eager_norm + 1e-6):
            terms = ", ".join(f"{name} {c:.4g} / {e:.4g}" for name, c, e in
                              zip(("loss", *STAT_NAMES[:4]), compiled_terms, _loss_terms(loss, stats)))
            grown = {name: counts[name] - self._check_counts[name] for name in counts}
            since = "" if first_check else (
                f" Since the first checked update this process compiled {grown['frames']} frames"
                f" ({grown['graph_cache_hit']} graphs from the cache, {grown['graph_cache_miss']} new).")
            worst = _worst_gradients(compiled, self.loss_module)
            # The compiled step once more from the same state: the same wrong norm points at a kernel wrong for these
            # inputs, another one at something that differs between calls (memory read before it is written).
            self._rerun(tensors, before, eager=False)
            again = self._grad_norm()
            loss, stats, priorities = self._rerun(tensors, before, eager=True)  # eager's gradients and statistics
            log.warning(f"the compiled step ({mode}) computed a gradient norm of {compiled_norm:.4g} where eager "
                        f"computes {eager_norm:.4g} on the same batch (update {self.steps}), and {again:.4g} when "
                        f"run again on it; {self._what_next()}.{since} The forward (compiled / eager): {terms}. "
                        f"Largest differences (compiled / eager gradient norm): {worst}")
            self._next_compile_mode()
        elif not self._check_steps:
            log.info(f"the compiled step ({mode}) followed eager over {self.cfg.compile_check_steps} updates")
        return loss, stats, priorities

    def _all_reduce_flat(self, params: list[torch.Tensor]) -> None:
        """Average the gradients over the ranks with one all-reduce of one packed buffer (learner.grad_sync)."""
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        with_grad = [p for p in params if p.grad is not None]
        grads = [p.grad for p in with_grad]
        flat = _flatten_dense_tensors(grads).div_(self.world_size)
        dist.all_reduce(flat)
        reduced = _unflatten_dense_tensors(flat, grads)  # contiguous views of `flat`
        # A parameter in another memory layout (channels_last convolutions) gets its gradient copied into a tensor
        # of its own strides: CUDA's fused AdamW refuses a gradient whose strides differ from its parameter's.
        moved: list[tuple[torch.Tensor, torch.Tensor]] = []
        for param, grad in zip(with_grad, reduced):
            if grad.stride() != param.stride():
                grad, source = torch.empty_like(param), grad
                moved.append((grad, source))
            param.grad = grad
        if moved:
            torch._foreach_copy_([dst for dst, _ in moved], [src for _, src in moved])

    def sync_target(self) -> None:
        """Copy the network into the target network."""
        if self.target is not None:
            copy_into(self.target, self.model.state_dict())

    def _read_sums(self) -> dict[str, float]:
        """Means of the metrics since the last read: the one device sync of a `train` call."""
        values = self._sums.tolist()
        count = max(1, self._sum_steps)
        self._sums.zero_()
        self._sum_steps = 0
        if not math.isfinite(values[0]):
            raise FloatingPointError(f"learner: the loss became {values[0]} by step {self.steps}")
        result = {name: value / count for name, value in zip(METRIC_NAMES, values)}
        result["stale_samples"] = values[-1]
        return result

    def _upload(self, batch: Batch) -> Uploaded:
        if self._staging is None:
            self._staging = Staging(self.device)
        return self._staging.upload(batch)

    def step(self, batch: Batch) -> tuple[dict[str, float], np.ndarray]:
        """One update on a batch with observations; returns (metrics, new priorities [B]). Waits for the device."""
        item = self._upload(batch)
        priorities, metrics = self._update(item.ready(), item.stale)
        values = metrics.tolist()
        if not math.isfinite(values[0]):
            raise FloatingPointError(f"learner step {self.steps - 1}: loss is {values[0]}")
        self._sums.zero_()
        self._sum_steps = 0
        result = dict(zip(METRIC_NAMES, values))
        result["lr"] = self.cfg.lr * self._lr_factor(self.steps - 1)
        return result, priorities.float().cpu().numpy() + 1e-6

    # -- remote API ------------------------------------------------------------------------------------

    def _result(self, num_steps: int, start: float, samples_before: int) -> dict[str, Any]:
        result: dict[str, Any] = self._read_sums()
        if self.world_size > 1:
            import torch.distributed as dist

            # Mean of the ranks' metrics (one small all-reduce per call, after the sync above).
            keys = [k for k in result if k != "stale_samples"]
            values = torch.tensor([result[k] for k in keys], dtype=torch.float64)
            if self.device.type == "cuda":
                values = values.to(self.device)
            dist.all_reduce(values)
            result.update({k: v / self.world_size for k, v in zip(keys, values.tolist())})
        self.version += 1
        elapsed = time.perf_counter() - start
        result.update(
            lr=self.cfg.lr * self._lr_factor(max(0, self.steps - 1)),
            learner_steps=self.steps, version=self.version, samples=self.samples,
            steps_per_second=num_steps / elapsed,
            samples_per_second=(self.samples - samples_before) / elapsed,
            compile=self.compile_state, graph_updates=self.graph_updates,
        )
        return result

    @contextlib.contextmanager
    def _gc_control(self) -> Any:
        """learner.manual_gc around a train call; yields a dict that gets the call's collection count and time."""
        stats: dict[str, float] = {}
        count, seconds = _GC["count"], _GC["seconds"]
        enabled = gc.isenabled()
        if self.cfg.manual_gc:
            gc.disable()
        try:
            yield stats
        finally:
            stats.update(gc_collections=_GC["count"] - count, gc_ms=1e3 * (_GC["seconds"] - seconds))
            if self.cfg.manual_gc:
                self._calls += 1
                collect_start = time.perf_counter()
                gc.collect(2 if self._calls % FULL_GC_EVERY == 0 else 1)
                stats["manual_gc_ms"] = 1e3 * (time.perf_counter() - collect_start)
                if enabled:
                    gc.enable()

    def train(self, replay: Any, num_steps: int) -> dict[str, Any]:
        """num_steps updates on batches from a replay actor; publishes a new version at the end.

        Batches come `learner.prefetch` ahead from a background thread (kept between calls); priorities go back
        without waiting for the device. The device is synced once, at the end.
        """
        began = time.perf_counter()
        with self._gc_control() as gc_stats:
            result = self._train(replay, num_steps)
        result.update(gc_stats)
        if self._train_ended is not None:
            # Where the learner's time outside its train calls goes: the gap since the last one ended (no call
            # queued, the call's way through Ray, or the learner's other calls), and `weights` within it.
            result["between_calls_s"] = began - self._train_ended
            result["weights_s"] = self._weights_s
        self._weights_s = 0.0
        self._train_ended = time.perf_counter()
        return result

    def _train(self, replay: Any, num_steps: int) -> dict[str, Any]:
        import ray

        if isinstance(replay, (list, tuple)):
            if len(replay) != 1:
                raise ValueError(f"train: a single learner samples one replay actor, got a list of {len(replay)}")
            replay = replay[0]
        start, samples_before = time.perf_counter(), self.samples
        input_wait = 0.0
        if self._outbox is None:
            self._outbox = PriorityOutbox(self.device)
        if self.cfg.prefetch == 0:
            for _ in range(num_steps):
                item = self._upload(ray.get(replay.sample.remote(self.cfg.batch_size)))
                priorities, _ = self._update(item.ready(), item.stale)
                self._outbox.put(replay, item.indices, item.generations, priorities)
        else:
            prefetcher = self._prefetcher
            if prefetcher is None or not prefetcher.alive or prefetcher.replay != replay:
                if prefetcher is not None:
                    prefetcher.close()
                prefetcher = self._prefetcher = Prefetcher(
                    replay, self.cfg.batch_size, self.device, self.cfg.prefetch, self.cfg.gather_threads,
                    self.cfg.obs_cache,
                )
            for _ in range(num_steps):
                waited = time.perf_counter()
                item = prefetcher.get()
                input_wait += time.perf_counter() - waited
                priorities, _ = self._update(item.ready(), item.stale)
                self._outbox.put(replay, item.indices, item.generations, priorities)
        launched = time.perf_counter()
        result = self._result(num_steps, start, samples_before)
        # Seconds the training thread waited for a prepared batch (the input pipeline falling behind).
        result["input_wait_s"] = input_wait
        # Seconds the training thread took to launch the call's steps: near the whole call (call_s), the host, not
        # the device, set the pace.
        result["launch_s"] = launched - start
        self._outbox.flush()
        result["call_s"] = time.perf_counter() - start
        prefetcher = self._prefetcher
        result["obs_path"] = "shared" if prefetcher is not None and not prefetcher.with_obs else "ray"
        if prefetcher is not None and prefetcher.staging.cache is not None:
            result["obs_path"] = "device_cache"
            result["obs_cache_uploaded"] = prefetcher.staging.cache.uploaded
        return result

    def train_on(self, batches: list[Batch]) -> dict[str, Any]:
        """Updates on explicit batches (with observations), in order; the result adds their priorities."""
        start, samples_before = time.perf_counter(), self.samples
        priorities = []
        for batch in batches:
            item = self._upload(batch)
            p, _ = self._update(item.ready(), item.stale)
            priorities.append(p.clone())
        result = self._result(len(batches), start, samples_before)
        result["priorities"] = [p.float().cpu().numpy() + 1e-6 for p in priorities]
        return result

    def bench_steps(self, batch: Batch, num_steps: int, warmup: int = 3) -> dict[str, float]:
        """Bare update rate on one batch kept on the device (no sampling, no Ray): after `warmup` steps,
        num_steps updates, one sync. Changes the weights: for benchmarks only."""
        tensors = self._upload(batch).ready()
        for _ in range(warmup):
            self._update(tensors)
        self._read_sums()
        start = time.perf_counter()
        for _ in range(num_steps):
            self._update(tensors)
        self._read_sums()
        elapsed = time.perf_counter() - start
        size = len(batch.indices) * self.world_size
        return {"ms_per_step": 1e3 * elapsed / num_steps, "steps_per_second": num_steps / elapsed,
                "samples_per_second": num_steps * size / elapsed, "compile": self.compile_state}

    def weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, CPU state_dict) to publish to self-play and inference: a `StateDict`, copied from the device
        once per version and sent through Ray as numpy buffers."""
        began = time.perf_counter()
        if self._published is None or self._published[:2] != (self.version, self.steps):
            self._published = (self.version, self.steps, snapshot(self.model.state_dict()))
        self._weights_s += time.perf_counter() - began
        return self.version, self._published[2]

    def set_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> int:
        """Put published weights back (the driver rolls back to the version that met run.stop_return)."""
        copy_into(self.model, state_dict)
        self.version = version
        self._published = None
        return version

    def counters(self) -> dict[str, int]:
        return {"learner_steps": self.steps, "version": self.version, "samples": self.samples}

    def _extra_modules(self) -> dict[str, torch.nn.Module]:
        modules: dict[str, torch.nn.Module] = {}
        if self.target is not None:
            modules["target"] = self.target
        if self.consistency is not None:
            modules["consistency"] = self.consistency
        return modules

    def save(self, directory: str) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in self.model.state_dict().items()}
        save_file(state, str(path / MODEL))
        extra = {f"{prefix}.{k}": v.detach().cpu().contiguous()
                 for prefix, module in self._extra_modules().items() for k, v in module.state_dict().items()}
        if extra:
            save_file(extra, str(path / EXTRA_FILE))
        torch.save(
            {"optimizer": self.optimizer.state_dict(), "counters": self.counters(), "rng": torch.get_rng_state()},
            path / "optimizer.pt",
        )

    def load(self, directory: str) -> None:
        path = Path(directory)
        try:
            state = load_file(str(path / MODEL), device=str(self.device))
            extra_path = path / EXTRA_FILE
            extra = load_file(str(extra_path), device=str(self.device)) if extra_path.exists() else {}
            other = torch.load(path / "optimizer.pt", map_location=self.device, weights_only=True)
        except pickle.UnpicklingError as error:  # a pickle of anything but tensors and plain containers
            raise CheckpointError(f"checkpoint {str(path)!r}: optimizer.pt refused, it is not a weights-only torch "
                                  f"file ({str(error).splitlines()[0]})") from None
        except (OSError, SafetensorError, RuntimeError, EOFError, ValueError) as error:
            raise CheckpointError(f"checkpoint {str(path)!r} is corrupt or unreadable: {error}") from None
        self.model.load_state_dict(state)
        self._published = None
        for prefix, module in self._extra_modules().items():
            part = {k[len(prefix) + 1:]: v for k, v in extra.items() if k.startswith(prefix + ".")}
            if part:
                module.load_state_dict(part)
            elif prefix == "target":
                self.sync_target()
        try:
            self.optimizer.load_state_dict(other["optimizer"])
        except ValueError as error:  # e.g. the checkpoint was written with consistency heads on, now off
            raise CheckpointError(f"checkpoint {str(path)!r}: optimizer state does not fit this learner "
                                  f"configuration ({error})") from None
        if self._step_graph is not None:
            self._step_graph.drop()  # it reads the optimizer's state tensors, which loading replaced
        self.steps = int(other["counters"]["learner_steps"])
        self.version = int(other["counters"]["version"])
        self.samples = int(other["counters"]["samples"])
        torch.set_rng_state(other["rng"].cpu())

    def close(self) -> None:
        """Stop the background threads (they are daemons: a process that exits needs no call) and a background
        compile still running (it also ends by itself when this process does)."""
        self.close_background_compile()
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
        if self._outbox is not None:
            self._outbox.close()
            self._outbox = None


HELPER_UPDATES = 2  # the background compile happens in the first; the second runs what it compiled (or recompiles)


def _compile_cache_counts() -> dict[str, int]:
    """This process's compile cache counters so far: inductor's graph cache and AOTAutograd's cache, hits and
    misses."""
    from torch._dynamo.utils import counters

    return {"graph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
            "graph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
            "autograd_cache_hit": counters["aot_autograd"]["autograd_cache_hit"],
            "autograd_cache_miss": counters["aot_autograd"]["autograd_cache_miss"]}


def _loss_terms(loss: torch.Tensor, stats: torch.Tensor) -> list[float]:
    """The loss and its terms (STAT_NAMES) as floats, in one device sync."""
    return torch.cat([loss.detach().float().view(1), stats.detach().float()]).tolist()


def _compile_counts() -> dict[str, int]:
    """_compile_cache_counts and the frames torch._dynamo compiled in this process so far (a recompile after a
    guard failed counts one more)."""
    from torch._dynamo.utils import counters

    return {"frames": counters["frames"]["ok"], **_compile_cache_counts()}


def compile_in_helper(work: str) -> int:
    """A background compile's helper process (learner/background.py starts it): a learner of the same
    configuration compiles its part on the first batch (the step or some of its regions, or one side step that
    makes its inputs); exit code 0 when it compiled. It prints its time and the compile's longest phases, for the
    run's log."""
    entered = time.perf_counter()
    args = background.read_args(work)
    code = 1
    try:
        code = _compile_part(args, entered, work)
        return code
    finally:
        background.write_report(args, code)


def narrow_to_part(learner: Learner, part: str) -> list[_SideStep]:
    """Leave eager what `part` does not compile (another helper compiles it); returns the side steps it does."""
    sides = {"bootstrap": learner._bootstrap, "consistency": learner._consistency_targets}
    if part in background.SIDE_PARTS:
        for name, side in sides.items():
            if name != part:
                side.compiled = None
        return [sides[part]]
    regions = background.LOSS_PARTS[part]
    if regions is not None and isinstance(learner._switch.compiled, CompiledRegions):
        mode = learner.compile_state.split(":", 1)[1]
        narrowed = CompiledRegions(learner.loss_module, learner._compiler(mode), only=regions)
        if "root" not in regions:
            narrowed.root = _root_without_autograd(learner.loss_module.root_terms)
        learner._switch.use(narrowed)
    return []


def _root_without_autograd(root_terms: Callable[..., tuple[torch.Tensor, ...]]) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The unroll's root, eager and outside autograd, its latent made a leaf that requires grad, as the compiled
    steps after it get theirs: for a helper that compiles the steps alone. With autograd, the eager root's backward
    fails: eager batch norm keeps its running statistics for the backward, and the compiled steps' in-place update
    of the same (shared prediction head's) statistics changes them under it."""
    def root(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            latent, *rest = root_terms(*args)
        return (latent.requires_grad_(), *rest)
    return root


def run_part(learner: Learner, sides: list[_SideStep], tensors: dict[str, torch.Tensor], stale: int) -> None:
    """A helper's updates on its batch, which compile its part: the side steps alone for a side part (SIDES from
    `narrow_to_part`), else whole updates (the step's regions that the part leaves eager run eagerly)."""
    for _ in range(HELPER_UPDATES):
        if sides:
            learner._step_inputs(tensors)
        else:
            learner._update(tensors, stale)


def _compile_part(args: dict[str, Any], entered: float, work: str) -> int:
    learner = Learner(args["model_cfg"], args["cfg"], args["obs_shape"], args["num_actions"])
    part = args.get("part", "step")
    sides = narrow_to_part(learner, part)
    import torch._inductor.compile_fx  # noqa: F401  (imported while waiting, not while compiling)

    ready = time.perf_counter()
    batch, stale = background.wait_for_batch(work)
    started = time.perf_counter()
    run_part(learner, sides, {k: v.to(learner.device) for k, v in batch.items()}, stale)
    if learner.device.type == "cuda":
        torch.cuda.synchronize()
    print(f"rayzero background compile ({part}): up in {ready - entered:.0f} s, waited {started - ready:.0f} s for "
          f"the batch, compiled in {time.perf_counter() - started:.0f} s; {_compile_phases()}", file=sys.stderr)
    broken = [side.what for side in sides if side.wanted and side.compiled is None]
    if broken:
        print(f"rayzero background compile: {', '.join(broken)} did not compile", file=sys.stderr)
        return 1
    if not sides and not learner.compile_state.startswith(("pending", "on")):
        print(f"rayzero background compile: the step did not compile ({learner.compile_state})", file=sys.stderr)
        return 1
    return 0


# torch._dynamo's timed phases that say where a compile's time went: all of it, tracing, lowering and code
# generation, waiting for the parallel (Triton) kernel compiles, and the backward's (compiled at its first call).
PHASES = ("_compile.compile_inner", "bytecode_tracing", "create_aot_dispatcher_function", "Scheduler.codegen",
          "async_compile.wait", "backward._backward_impl")


def _compile_phases() -> str:
    """The seconds of this process's compiles so far in each of PHASES (torch._dynamo's timings)."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    seconds = dict(zip(names, values))
    return ", ".join(f"{name} {float(seconds[name]):.1f} s" for name in PHASES if name in seconds)


def load_model_weights(model: torch.nn.Module, checkpoint_dir: str | Path) -> None:
    """Load only the network weights of a checkpoint into `model` (for eval and inference)."""
    path = Path(checkpoint_dir) / MODEL
    try:
        state = load_file(str(path))
        model.load_state_dict(state)
    except (OSError, SafetensorError, RuntimeError) as error:
        raise CheckpointError(f"checkpoint {str(checkpoint_dir)!r} is corrupt or unreadable: {error}") from None
