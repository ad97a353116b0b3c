"""The device side of the inference actor: the network, the latent pool tensor, CUDA graphs, streams, copies.

Shapes: M = inference.max_batch, A = actions, P = latent_pool_size, n = rows of a batch, b = its bucket.
Every method runs on the actor's one GPU thread (the batcher's executor); nothing here touches the event loop.
One CUDA graph per (kind, bucket), uploads on their own stream through two pinned slots, bf16 trunk with fp32
heads; the CPU path (and batches beyond the ladder) runs eagerly. Memory layout and stream order:
docs/architecture.md.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from typing import Any

import numpy as np
import torch

from rayzero.config import InferenceConfig
from rayzero.inference.errors import InferenceError
from rayzero.logs import logger
from rayzero.models.networks import MuZeroNet, hold_trunk_in_bf16
from rayzero.tree import RecurrentOutput, RootOutput, SearchConfig, SearchNoise, sample_noise, search
from rayzero.tree.noise import row_defaults

IDX_ROWS = 7  # src slot, action, dst slot, cache hit entry, cache hit dst slot, cache insert entry, its slot
SRC, ACT, DST, HIT_SRC, HIT_DST, INS_ENTRY, INS_SLOT = range(IDX_ROWS)
HIGHEST_PRIORITY = -100  # torch maps a stream priority beyond the device's range to the range's end
ROW_SETTINGS = 4  # per-row search settings a staging slot holds (tree/noise.py's row_defaults has at most 2)
NOISE_POOL_ROWS = 4096  # roots' worth of search noise a runner draws at once per (search config, bucket)
NOISE_POOLS = 64  # most (config, bucket) pools a runner keeps
SEARCH_GRAPHS_PER_BUCKET = 4  # captured search configs kept per bucket (least recently used evicted)

log = logger(__name__)


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=dtype)).dtype


# Seams of the CUDA path (tests emulate it on the CPU by replacing these three and torch.cuda's streams/events).
def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host tensor (fast, asynchronous host<->device copies)."""
    return torch.zeros(shape, dtype=dtype, pin_memory=True)


def capture_graph(fn, pool, stream=None) -> Any:
    """Record fn() into a torch.cuda.CUDAGraph (call on a non-default stream, after a warm-up), captured on
    `stream` (None: torch's one default capture stream; see Runner for why a runner passes its own)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        fn()
    return graph


@dataclasses.dataclass
class Flight:
    """One launched batch: its kind, size, and where and when its outputs appear."""

    kind: str
    rows: int
    bucket: int
    graph: bool
    outputs: dict[str, np.ndarray]
    """Numpy views of the outputs ([rows] / [rows, ...]); valid after `Runner.wait`, until the next launch."""
    start: Any = None  # CUDA events (timing enabled) around the device work; None on the CPU
    end: Any = None
    slot: Any = None  # the staging slot (CUDA)
    cpu_s: float = 0.0  # CPU path: compute time
    gpu_s: float = 0.0


class _Slot:
    """One of two staging slots: pinned host buffers, their device twins, and the events that order them."""

    def __init__(self, runner: Runner):
        M, A, S = runner.M, runner.A, runner.search_rows
        dev = runner.device
        self.obs = pinned((M, *runner.obs_shape), runner.obs_dtype)
        self.idx = pinned((IDX_ROWS, M), torch.int64)
        self.mask = pinned((M, A), torch.bool)
        self.out = pinned((M, 2 + A), torch.float32)
        self.s_action = pinned((S,), torch.int64)
        self.s_weights = pinned((S, A), torch.float32)
        self.s_visits = pinned((S, A), torch.int64)
        self.s_value = pinned((S,), torch.float32)
        self.settings = pinned((ROW_SETTINGS, S), torch.float32)  # a merged search's per-row settings
        self.settings_np = self.settings.numpy()
        self.settings_read = torch.cuda.Event()  # the compute stream has copied `settings` up
        self.obs_np, self.idx_np, self.mask_np = self.obs.numpy(), self.idx.numpy(), self.mask.numpy()
        self.obs_dev = torch.zeros((M, *runner.obs_shape), dtype=runner.obs_dtype, device=dev)
        self.idx_dev = torch.zeros((IDX_ROWS, M), dtype=torch.int64, device=dev)
        self.mask_dev = torch.zeros((M, A), dtype=torch.bool, device=dev)
        self.uploaded = torch.cuda.Event()  # the copy stream finished reading the pinned buffers
        self.consumed = torch.cuda.Event()  # the compute stream finished reading the device buffers
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.done = torch.cuda.Event(blocking=True)  # recorded right after `end`: a wait that sleeps (Runner.wait)
        self.busy = False  # launched and not yet waited for


def merged_search(config: SearchConfig, base: SearchConfig) -> tuple[SearchConfig, dict[str, float]] | None:
    """A request's search `config` as (the config its merged batch searches with, its rows' settings), or None
    when it cannot join one: a noise that `base` (the run's search config) has off cannot be turned on per row.
    MuZero batches draw the played action at temperature 1 and noise at base's fraction; each row then gets its
    own fraction and temperature. Gumbel rows scale base's root noise."""
    if config.policy == "muzero":
        if config.dirichlet_fraction > 0 and base.dirichlet_fraction == 0:
            return None
        shape = dataclasses.replace(config, temperature=1.0, dirichlet_fraction=base.dirichlet_fraction,
                                    gumbel_scale=base.gumbel_scale)
        return shape, {"root_fraction": config.dirichlet_fraction, "temperature": config.temperature}
    if config.gumbel_scale > 0 and base.gumbel_scale == 0:
        return None
    shape = dataclasses.replace(config, temperature=base.temperature, gumbel_scale=base.gumbel_scale,
                                dirichlet_fraction=base.dirichlet_fraction)
    return shape, {"root_fraction": config.gumbel_scale / base.gumbel_scale if base.gumbel_scale > 0 else 1.0}


class Runner:
    """Runs batches of one kind ('initial', 'recurrent', 'search') on the device; see the module docstring."""

    def __init__(self, model: MuZeroNet, cfg: InferenceConfig, obs_shape: tuple[int, ...], obs_dtype: np.dtype,
                 num_actions: int, ladder: list[int], search_cfg: SearchConfig, discount: float, seed: int):
        self.model = model
        self.device = next(model.parameters()).device
        self.cuda = is_cuda(self.device)
        self.bf16 = cfg.bf16 and self.cuda
        model.heads_fp32 = cfg.fp32_heads
        if self.bf16:
            hold_trunk_in_bf16(model)  # no weight casts inside the captured searches
        if self.cuda and cfg.channels_last:
            model.to(memory_format=torch.channels_last)
        self.use_graphs = cfg.cuda_graphs and self.cuda
        # The recurrent step as inductor's fused kernels (one compile for every batch size), inside the captured
        # graphs too: a small batch's search is bound by its kernel count, ~70 of them per simulation eagerly.
        # The parameters stay inputs of the compiled code, so weights copied in place are what it computes with.
        mode = None if cfg.compile_mode == "default" else cfg.compile_mode
        self._recurrent = (torch.compile(model.recurrent, dynamic=True, mode=mode) if cfg.compile_recurrent
                           else model.recurrent)
        self.M, self.A = cfg.max_batch, num_actions
        self.P = cfg.latent_pool_size
        self.ladder = list(ladder)
        self.search_ladder = [b for b in self.ladder if b <= cfg.search_max_batch] if self.use_graphs else []
        self.search_rows = max(self.search_ladder, default=0)
        self.obs_shape = tuple(obs_shape)
        self.obs_dtype_np = np.dtype(obs_dtype)
        self.obs_dtype = torch_dtype(self.obs_dtype_np)
        self.search_cfg = search_cfg
        self.discount = discount
        with torch.no_grad(), self.autocast():
            probe = model.initial(torch.zeros((1, *self.obs_shape), dtype=self.obs_dtype, device=self.device))
        self.latent_shape, self.latent_dtype = tuple(probe.latent.shape[1:]), probe.latent.dtype
        self.latents = torch.zeros((self.P + self.M, *self.latent_shape), dtype=self.latent_dtype, device=self.device)
        self.scratch = np.arange(self.P, self.P + self.M, dtype=np.int64)
        self.cache_latents: torch.Tensor | None = None
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.searches: collections.OrderedDict[tuple[int, SearchConfig, bool], Any] = collections.OrderedDict()
        self.capture_s = 0.0
        self._noise_pools: collections.OrderedDict[tuple, list] = collections.OrderedDict()  # _pooled_noise's
        self.noise_draws = 0  # pools of search noise drawn
        self.capture_parts: dict[str, float] = {}  # start-up seconds: the network's graphs, each bucket's search
        self.capture_started = 0.0  # perf_counter() when the start-up captures began
        self.serving = False  # set once the start-up captures are done
        self._weights_copied: Any = None
        self._weight_stage: dict[str, torch.Tensor] | None = None
        if not self.cuda:
            self.generator = torch.Generator().manual_seed(seed)
            return
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # Where the learner shares this process (cluster.colocate_learner), the stream priorities say whose waiting
        # blocks the GPU schedules first (inference.stream_priority; the colocated learner takes the other end).
        priority = HIGHEST_PRIORITY if cfg.stream_priority == "high" else 0
        # Every graph of this runner is captured on its compute stream. A captured GEMM keeps the cuBLAS
        # workspace of its capture stream (PyTorch keys workspaces by handle and stream), and torch's graphs
        # share one default capture stream: two runners' graphs (the served and the evaluation network's)
        # replayed at once on their own streams would otherwise share one workspace.
        self.stream = torch.cuda.Stream(self.device, priority=priority)
        self.copy_stream = torch.cuda.Stream(self.device, priority=priority)
        self.mempool = torch.cuda.graph_pool_handle()
        M, A = self.M, self.A
        self.static = {
            "obs": torch.zeros((M, *self.obs_shape), dtype=self.obs_dtype, device=self.device),
            "idx": torch.zeros((IDX_ROWS, M), dtype=torch.int64, device=self.device),
            "mask": torch.zeros((M, A), dtype=torch.bool, device=self.device),
            "out": torch.zeros((M, 2 + A), dtype=torch.float32, device=self.device),
        }
        scratch = torch.from_numpy(self.scratch).to(self.device)
        for row in (SRC, DST):
            self.static["idx"][row].copy_(scratch)
        self.slots = [_Slot(self), _Slot(self)]
        self._next_slot = 0
        torch.cuda.synchronize(self.device)  # set-up writes (default stream) land before the compute stream reads
        self._ref = torch.cuda.Event(enable_timing=True)
        self._ref.record(self.stream)
        self.stream.synchronize()
        self._ref_host = time.perf_counter()
        if self.use_graphs:
            start = self.capture_started = time.perf_counter()
            with torch.no_grad(), torch.cuda.stream(self.stream):
                search_only = cfg.network_graphs == "search"  # whole searches' roots: their graphs hold the rest
                for bucket in self.search_ladder if search_only else self.ladder:
                    for kind in ("initial",) if search_only else ("initial", "recurrent"):
                        self.graphs[(kind, bucket)] = self._capture(kind, bucket)
                self.capture_parts["network graphs"] = time.perf_counter() - start
                merged = merged_search(search_cfg, search_cfg) if cfg.merge_searches else None
                for bucket in self.search_ladder:
                    begun = time.perf_counter()  # the first of a kind of search compiles its kernels too
                    if merged is not None:
                        self._search_graph(bucket, merged[0], per_row=True)
                    else:
                        self._search_graph(bucket, search_cfg)
                    self.capture_parts[f"search {bucket}"] = time.perf_counter() - begun
            self.stream.synchronize()
            self.capture_s = time.perf_counter() - start
        self.serving = True

    # -- helpers ------------------------------------------------------------------------------------------

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16, cache_enabled=False)

    def bucket(self, rows: int) -> int | None:
        """The smallest ladder bucket >= rows; None above max_batch."""
        for size in self.ladder:
            if rows <= size:
                return size
        return None

    def enable_cache(self, capacity: int) -> None:
        self.cache_latents = torch.zeros((capacity, *self.latent_shape), dtype=self.latent_dtype, device=self.device)

    def _pack(self, o, out: torch.Tensor) -> None:
        torch.cat([o.value.float().unsqueeze(1), o.reward.float().unsqueeze(1), o.policy_logits.float()], 1, out=out)

    def _body(self, kind: str, n: int) -> None:
        """The captured work of a (kind, n) batch on the static buffers: network, pool writes, packed outputs."""
        s = self.static
        idx = s["idx"]
        with self.autocast():
            if kind == "initial":
                o = self.model.initial(s["obs"][:n])
            else:
                o = self._recurrent(self.latents.index_select(0, idx[SRC, :n]), idx[ACT, :n])
        self.latents.index_copy_(0, idx[DST, :n], o.latent.to(self.latent_dtype))
        self._pack(o, s["out"][:n])

    def _capture(self, kind: str, bucket: int) -> torch.cuda.CUDAGraph:
        for _ in range(2):  # warm-up on the (non-default) compute stream: cuDNN/cuBLAS plans, allocator
            self._body(kind, bucket)
        return capture_graph(lambda: self._body(kind, bucket), self.mempool, self.stream)

    def search_fn(self, action: torch.Tensor, embedding: torch.Tensor) -> tuple[RecurrentOutput, torch.Tensor]:
        """recurrent_fn of the whole-search requests: the model's recurrent step under the actor's autocast."""
        with self.autocast():
            o = self._recurrent(embedding, action)
        value = o.value.float()
        out = RecurrentOutput(o.reward.float(), torch.full_like(value, self.discount), o.policy_logits.float(), value)
        return out, o.latent

    def _search_root(self, bucket: int) -> RootOutput:
        out = self.static["out"]
        return RootOutput(out[:bucket, 2:], out[:bucket, 0], self.latents[self.P:self.P + bucket])

    def _search_graph(self, bucket: int, config: SearchConfig, per_row: bool = False):
        """The CapturedSearch of (bucket, config), captured now if new (call on the compute stream); per_row:
        one that reads per-row settings (a merged batch)."""
        from rayzero.tree.capture import CapturedSearch

        key = (bucket, config, per_row)
        captured = self.searches.get(key)
        if captured is None:
            same_bucket = [k for k in self.searches if k[0] == bucket]
            if len(same_bucket) >= SEARCH_GRAPHS_PER_BUCKET:
                del self.searches[same_bucket[0]]
            if self.serving:  # a device-side assert that follows is the first thing to tie to this capture
                log.warning(f"capturing a whole-search graph mid-run (bucket {bucket}, config {config}); with a "
                            "learner in this process, inference.merge_searches=true captures every search "
                            "shape at start")
            start = time.perf_counter()
            captured = CapturedSearch(self.search_fn, self._search_root(bucket), config.num_simulations, config,
                                      pool=self.mempool, generator=self.generator, per_row=per_row,
                                      stream=self.stream)
            self.capture_s += time.perf_counter() - start
            self.searches[key] = captured
        self.searches.move_to_end(key)
        return captured

    def _acquire(self) -> _Slot:
        """The staging slot of the next launch: the one after the last, unless that one's batch is still in
        flight and the other's is not (the server's wave jobs run between the batcher's launch of a batch and
        its finish, so slots are not always taken in turn); at most two batches are ever unfinished."""
        index = self._next_slot
        if self.slots[index].busy and not self.slots[index ^ 1].busy:
            index ^= 1
        slot = self.slots[index]
        self._next_slot = index ^ 1
        if slot.busy:  # two batches in flight already (the callers avoid it): wait for this one's uploads
            slot.uploaded.synchronize()
            slot.settings_read.synchronize()
        slot.busy = True
        return slot

    def _upload(self, slot: _Slot, obs_rows: int = 0, mask_rows: int = 0) -> None:
        """Copy stream: pinned slot -> device slot (obs rows, all idx rows, mask rows)."""
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(slot.consumed)
            if obs_rows:
                slot.obs_dev[:obs_rows].copy_(slot.obs[:obs_rows], non_blocking=True)
            slot.idx_dev.copy_(slot.idx, non_blocking=True)
            if mask_rows:
                slot.mask_dev[:mask_rows].copy_(slot.mask[:mask_rows], non_blocking=True)
            slot.uploaded.record(self.copy_stream)

    def _to_static(self, slot: _Slot, obs_rows: int = 0, mask_rows: int = 0) -> None:
        """Compute stream: wait for the upload, start timing, move the rows into the static buffers."""
        self.stream.wait_event(slot.uploaded)
        slot.start.record(self.stream)
        if obs_rows:
            self.static["obs"][:obs_rows].copy_(slot.obs_dev[:obs_rows])
        self.static["idx"].copy_(slot.idx_dev)
        if mask_rows:
            self.static["mask"][:mask_rows].copy_(slot.mask_dev[:mask_rows])
        slot.consumed.record(self.stream)

    @staticmethod
    def _fill_obs(slot: _Slot, parts: list[np.ndarray]) -> int:
        offset = 0
        for part in parts:
            np.copyto(slot.obs_np[offset:offset + len(part)], part, casting="unsafe")
            offset += len(part)
        return offset

    def _run(self, kind: str, n: int, bucket: int) -> bool:
        graph = self.graphs.get((kind, bucket)) if self.use_graphs else None
        if graph is not None:
            graph.replay()
            return True
        self._body(kind, n)
        return False

    # -- launches -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def launch_initial(self, parts: list[np.ndarray], dst: np.ndarray,
                       cache_ops: dict[str, np.ndarray] | None = None) -> Flight:
        """obs parts (concatenated: [n, *obs]) -> latents into slots dst [n]; outputs 'out' [n, 2 + A].

        cache_ops (optional): hit_src/hit_dst [h] (cache entry -> pool slot), ins_entry/ins_slot [k]
        (pool slot -> cache entry); run after the network, hits before inserts.
        """
        n = len(dst)
        bucket = self.bucket(n)
        if not self.cuda or bucket is None or (cache_ops and max(len(v) for v in cache_ops.values()) > self.M):
            with self._eager_stream():
                return self._eager_initial(parts, dst, cache_ops)
        slot = self._acquire()
        self._fill_obs(slot, parts)
        idx = slot.idx_np
        idx[DST, :n] = dst
        idx[DST, n:bucket] = self.scratch[n:bucket]
        if cache_ops:
            for row, name in ((HIT_SRC, "hit_src"), (HIT_DST, "hit_dst"), (INS_ENTRY, "ins_entry"),
                              (INS_SLOT, "ins_slot")):
                idx[row, :len(cache_ops[name])] = cache_ops[name]
        self._upload(slot, obs_rows=n)
        graph = False
        with torch.cuda.stream(self.stream):
            self._to_static(slot, obs_rows=n)
            if n:
                graph = self._run("initial", n, bucket)
            if cache_ops:
                self._cache_ops(self.static["idx"], len(cache_ops["hit_src"]), len(cache_ops["ins_entry"]))
            slot.out[:n].copy_(self.static["out"][:n], non_blocking=True)
            slot.end.record(self.stream)
            slot.done.record(self.stream)
        return Flight("initial", n, bucket, graph, {"out": slot.out.numpy()[:n]}, slot.start, slot.end, slot)

    def _cache_ops(self, idx: torch.Tensor, hits: int, inserts: int) -> None:
        assert self.cache_latents is not None
        if hits:
            self.latents.index_copy_(0, idx[HIT_DST, :hits], self.cache_latents.index_select(0, idx[HIT_SRC, :hits]))
        if inserts:
            self.cache_latents.index_copy_(0, idx[INS_ENTRY, :inserts],
                                           self.latents.index_select(0, idx[INS_SLOT, :inserts]))

    @torch.no_grad()
    def launch_recurrent(self, src: np.ndarray, action: np.ndarray, dst: np.ndarray) -> Flight:
        """Latents of slots src [n] and actions [n] -> next latents into slots dst [n] (-1: not kept)."""
        n = len(src)
        bucket = self.bucket(n)
        if not self.cuda or bucket is None:
            with self._eager_stream():
                return self._eager_recurrent(src, action, dst)
        slot = self._acquire()
        idx = slot.idx_np
        idx[SRC, :n] = src
        idx[ACT, :n] = action
        idx[DST, :n] = np.where(dst >= 0, dst, self.scratch[:n])
        idx[SRC, n:bucket] = self.scratch[n:bucket]
        idx[ACT, n:bucket] = 0
        idx[DST, n:bucket] = self.scratch[n:bucket]
        self._upload(slot)
        with torch.cuda.stream(self.stream):
            self._to_static(slot)
            graph = self._run("recurrent", n, bucket)
            slot.out[:n].copy_(self.static["out"][:n], non_blocking=True)
            slot.end.record(self.stream)
            slot.done.record(self.stream)
        return Flight("recurrent", n, bucket, graph, {"out": slot.out.numpy()[:n]}, slot.start, slot.end, slot)

    def _pooled_noise(self, config: SearchConfig, bucket: int) -> SearchNoise:
        """Fresh noise for one whole search of `bucket` roots: the next slice of a pool drawn for NOISE_POOL_ROWS
        roots at once. A draw is a few dozen small kernels (the Gamma sampler's unrolled proposals, the Gumbel
        draws) whatever the batch, each a launch on the host: per search they stood between the batch's start and
        its graph, which one env alone waits on every step. Slices of one i.i.d. draw are independent draws."""
        key = (config, bucket)
        pool = self._noise_pools.get(key)
        if pool is None or pool[1] == pool[2]:
            self._noise_pools.pop(key, None)
            if len(self._noise_pools) >= NOISE_POOLS:  # the least recently drawn (a config no longer asked for)
                self._noise_pools.popitem(last=False)
            count = max(1, NOISE_POOL_ROWS // bucket)
            drawn = sample_noise(config, count * bucket, self.A, generator=self.generator, device=self.device)
            pool = self._noise_pools[key] = [[None if t is None else t.view(count, bucket, *t.shape[1:])
                                              for t in drawn], 0, count]
            self.noise_draws += 1
        tensors, index, _ = pool
        pool[1] += 1
        return SearchNoise(*(None if t is None else t[index] for t in tensors))

    def _row_noise(self, config: SearchConfig, rows: dict[str, np.ndarray], size: int,
                   slot: _Slot | None = None) -> SearchNoise:
        """Noise for `size` roots with the per-row settings `rows` (arrays of n <= size rows; padding rows get
        the config's). With a staging `slot` the settings go up from its pinned buffer without blocking (a copy
        from pageable memory may wait for the stream, and so for the batch in flight before this one)."""
        noise = (self._pooled_noise(config, size) if slot is not None
                 else sample_noise(config, size, self.A, generator=self.generator, device=self.device))
        settings, defaults = {}, row_defaults(config)
        pinned_rows = slot is not None and len(rows) <= len(slot.settings_np)
        for i, (name, values) in enumerate(rows.items()):
            column = slot.settings_np[i, :size] if pinned_rows else np.empty(size, np.float32)
            column[:] = defaults[name]
            column[:len(values)] = values
            settings[name] = (slot.settings[i, :size].to(self.device, non_blocking=True) if pinned_rows
                              else torch.from_numpy(column).to(self.device))
        if pinned_rows:
            slot.settings_read.record(self.stream)
        return noise._replace(**settings)

    def search_bucket(self, rows: int) -> int | None:
        """The smallest whole-search bucket that holds `rows` (None: beyond the ladder, run eagerly)."""
        return next((b for b in self.search_ladder if rows <= b), None)

    @torch.no_grad()
    def launch_search(self, parts: list[np.ndarray], mask: np.ndarray | None, config: SearchConfig,
                      rows: dict[str, np.ndarray] | None = None) -> Flight:
        """Roots from obs parts ([n, *obs]) and invalid-action mask [n, A] (None: all legal) -> a whole search.
        rows: per-row settings of a merged batch (`root_fraction`, `temperature`: [n] each; tree/noise.py).

        Outputs: action [n] int64, action_weights [n, A], visit_counts [n, A] int64, root_value [n].
        """
        n = sum(len(p) for p in parts)
        bucket = self.search_bucket(n)
        if bucket is None:
            with self._eager_stream():
                return self._eager_search(parts, mask, config, rows)
        slot = self._acquire()
        self._fill_obs(slot, parts)
        slot.idx_np[DST, :bucket] = self.scratch[:bucket]
        slot.mask_np[:n] = False if mask is None else mask
        slot.mask_np[n:bucket] = False
        self._upload(slot, obs_rows=n, mask_rows=bucket)
        with torch.cuda.stream(self.stream):
            self._to_static(slot, obs_rows=n, mask_rows=bucket)
            self.graphs[("initial", bucket)].replay()
            captured = self._search_graph(bucket, config, per_row=rows is not None)
            noise = (self._row_noise(config, rows, bucket, slot) if rows is not None
                     else self._pooled_noise(config, bucket))
            out = captured(self._search_root(bucket), invalid_actions=self.static["mask"][:bucket],
                           generator=self.generator, noise=noise)
            slot.s_action[:n].copy_(out.action[:n], non_blocking=True)
            slot.s_weights[:n].copy_(out.action_weights[:n], non_blocking=True)
            slot.s_visits[:n].copy_(out.visit_counts[:n], non_blocking=True)
            slot.s_value[:n].copy_(out.root_value[:n], non_blocking=True)
            slot.end.record(self.stream)
            slot.done.record(self.stream)
        outputs = {"action": slot.s_action.numpy()[:n], "action_weights": slot.s_weights.numpy()[:n],
                   "visit_counts": slot.s_visits.numpy()[:n], "root_value": slot.s_value.numpy()[:n]}
        return Flight("search", n, bucket, True, outputs, slot.start, slot.end, slot)

    # -- eager paths (CPU, or batches beyond the ladder) ----------------------------------------------------

    def _eager_stream(self):
        """CUDA: eager batches run on the compute stream too, so stream order puts them after the weight copies
        and the pool writes of earlier batches queued there (on the default stream nothing would order them)."""
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        array = np.ascontiguousarray(array)
        if not array.flags.writeable:  # a read-only view of Ray's object store
            array = array.copy()
        return torch.from_numpy(array).to(self.device)

    def _obs_tensor(self, parts: list[np.ndarray]) -> torch.Tensor:
        obs = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return self._tensor(obs.astype(self.obs_dtype_np, copy=False))

    def _eager_done(self, kind: str, n: int, outputs: dict[str, torch.Tensor], start: float) -> Flight:
        arrays = {k: v.cpu().numpy() for k, v in outputs.items()}  # on CUDA this waits for the batch
        return Flight(kind, n, self.bucket(n) or n, False, arrays, cpu_s=time.perf_counter() - start)

    @torch.no_grad()
    def _eager_initial(self, parts, dst, cache_ops) -> Flight:
        start = time.perf_counter()
        n = len(dst)
        out = torch.zeros((n, 2 + self.A), dtype=torch.float32, device=self.device)
        if n:
            with self.autocast():
                o = self.model.initial(self._obs_tensor(parts))
            self.latents.index_copy_(0, self._tensor(dst), o.latent.to(self.latent_dtype))
            self._pack(o, out)
        if cache_ops:
            idx = torch.zeros((IDX_ROWS, max(1, *(len(v) for v in cache_ops.values()))), dtype=torch.int64)
            for row, name in ((HIT_SRC, "hit_src"), (HIT_DST, "hit_dst"), (INS_ENTRY, "ins_entry"),
                              (INS_SLOT, "ins_slot")):
                idx[row, :len(cache_ops[name])] = torch.from_numpy(cache_ops[name])
            self._cache_ops(idx.to(self.device), len(cache_ops["hit_src"]), len(cache_ops["ins_entry"]))
        return self._eager_done("initial", n, {"out": out}, start)

    @torch.no_grad()
    def _eager_recurrent(self, src, action, dst) -> Flight:
        start = time.perf_counter()
        n = len(src)
        with self.autocast():
            o = self._recurrent(self.latents.index_select(0, self._tensor(src)), self._tensor(action))
        keep = np.flatnonzero(dst >= 0)
        if len(keep):
            rows = self._tensor(keep)
            self.latents.index_copy_(0, self._tensor(dst[keep]), o.latent.index_select(0, rows).to(self.latent_dtype))
        out = torch.empty((n, 2 + self.A), dtype=torch.float32, device=self.device)
        self._pack(o, out)
        return self._eager_done("recurrent", n, {"out": out}, start)

    @torch.no_grad()
    def _eager_search(self, parts, mask, config: SearchConfig, rows: dict[str, np.ndarray] | None = None) -> Flight:
        start = time.perf_counter()
        obs = self._obs_tensor(parts)
        with self.autocast():
            o = self.model.initial(obs)
        root = RootOutput(o.policy_logits.float(), o.value.float(), o.latent)
        invalid = self._tensor(mask) if mask is not None else None
        noise = self._row_noise(config, rows, len(obs)) if rows is not None else None
        out = search(root, self.search_fn, config.num_simulations, config, invalid, generator=self.generator,
                     noise=noise)
        outputs = {"action": out.action, "action_weights": out.action_weights.float(),
                   "visit_counts": out.visit_counts, "root_value": out.root_value.float()}
        return self._eager_done("search", len(obs), outputs, start)

    # -- results, weights, timing ---------------------------------------------------------------------------

    def wait(self, flight: Flight, spin: bool = True) -> dict[str, np.ndarray]:
        """Block until the flight's outputs are on the host (the one synchronisation per batch). A CUDA wait
        spins a core for as long as the GPU works (the driver's default with fewer CUDA contexts than cores);
        with spin=False this thread sleeps in the driver on a blocking event recorded after the flight's end
        instead, leaving the core to the host's other work, and wakes some microseconds later."""
        if flight.end is not None:
            if not spin:
                flight.slot.done.synchronize()
            flight.end.synchronize()
            flight.slot.busy = False
            flight.gpu_s = flight.start.elapsed_time(flight.end) / 1e3
        else:
            flight.gpu_s = flight.cpu_s
        return flight.outputs

    def device_span(self, flight: Flight) -> tuple[float, float] | None:
        """(start, end) of the flight's device work in time.perf_counter() seconds (CUDA flights, after wait)."""
        if flight.end is None:
            return None
        return (self._ref_host + self._ref.elapsed_time(flight.start) / 1e3,
                self._ref_host + self._ref.elapsed_time(flight.end) / 1e3)

    @torch.no_grad()
    def set_weights(self, state_dict: dict[str, Any]) -> None:
        """Copy a state dict into the model in place (captured graphs keep pointing at the same memory)."""
        self.apply_weights(self.stage_weights(state_dict))

    @torch.no_grad()
    def stage_weights(self, state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Check a state dict and stage it on the host: the slow half of a weight swap, safe off the GPU thread
        (one call at a time: CUDA stages into one set of pinned buffers, reused once the last copy is done)."""
        target = self.model.state_dict()
        missing = [k for k in target if k not in state_dict]
        if missing:
            raise InferenceError(f"set_weights: state dict lacks {len(missing)} entries, e.g. {missing[:3]}")
        for name, tensor in target.items():
            shape = tuple(np.shape(state_dict[name]))
            if shape != tuple(tensor.shape):
                raise InferenceError(f"set_weights: {name} has shape {shape}, the model's is {tuple(tensor.shape)}")
        if not self.cuda:
            return {name: torch.as_tensor(state_dict[name]) for name in target}
        if self._weight_stage is None:
            self._weight_stage = {k: pinned(tuple(t.shape), t.dtype) for k, t in target.items()}
            self._weights_copied = torch.cuda.Event()
        self._weights_copied.synchronize()  # the previous update has left the staging buffers
        for name, stage in self._weight_stage.items():
            stage.copy_(torch.as_tensor(state_dict[name]))
        return self._weight_stage

    @torch.no_grad()
    def apply_weights(self, staged: dict[str, torch.Tensor]) -> None:
        """GPU thread: copy staged weights into the model, between batches.

        CUDA: on the compute stream, so they land between batches in stream order (eager batches run on that
        stream too).
        """
        target = self.model.state_dict()
        if not self.cuda:
            for name, tensor in target.items():
                tensor.copy_(staged[name])
            return
        with torch.cuda.stream(self.stream):
            for name, tensor in target.items():
                tensor.copy_(staged[name], non_blocking=True)
            self._weights_copied.record(self.stream)

    @torch.no_grad()
    def profile(self, kind: str, bucket: int, iters: int, graph: bool) -> float:
        """Seconds per call of the (kind, bucket) work, back to back on the compute stream (benchmarks).

        kind 'initial'/'recurrent': the graph replay or the same body run eagerly on the static buffers;
        'search': the initial step plus the whole search at that bucket (CapturedSearch or eager `search`).
        """
        if not self.cuda:
            raise InferenceError("profile needs CUDA")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            self.static["idx"][SRC, :bucket].copy_(torch.from_numpy(self.scratch[:bucket]))
            self.static["idx"][DST, :bucket].copy_(torch.from_numpy(self.scratch[:bucket]))
            step = self._profile_step(kind, bucket, graph)
            step()
            step()
            start.record(self.stream)
            for _ in range(iters):
                step()
            end.record(self.stream)
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters

    def _profile_step(self, kind: str, bucket: int, graph: bool):
        if kind == "search":
            config = self.search_cfg
            if graph:
                captured = self._search_graph(bucket, config)

                def run_graph():
                    self.graphs[("initial", bucket)].replay()
                    captured(self._search_root(bucket), generator=self.generator)
                return run_graph

            def run_eager():
                self._body("initial", bucket)
                search(self._search_root(bucket), self.search_fn, config.num_simulations, config,
                       generator=self.generator)
            return run_eager
        if graph:
            if (kind, bucket) not in self.graphs:
                raise ValueError(f"profile: no {kind} graph for bucket {bucket}: inference.network_graphs='search' "
                                 f"captures the initial step's for the whole-search buckets only; profile with "
                                 f"graph=False, or set 'all'")
            return self.graphs[(kind, bucket)].replay
        return lambda: self._body(kind, bucket)
