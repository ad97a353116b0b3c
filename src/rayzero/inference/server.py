"""The central inference actor: batches requests from many self-play actors into bucketed network calls.

Shapes: B = rows of a request, A = actions, M = inference.max_batch. Three request kinds, all async methods:
initial(client, obs [B, *obs]), recurrent(client, handles [B], actions [B]) and search(client, obs [B, *obs]);
clients on the actor's node may send them through shared-memory channels (channel.py). This module owns the
request side: validation (a bad request fails alone), the queues and batcher, backpressure, the latent-pool
bookkeeping (pool.py), the evaluation cache, weights, metrics and the trace; runner.py owns the device side.
How batching, the GPU thread and backpressure work: docs/architecture.md.

Channel recurrent requests (a CPU search's waves, the hot path) take a fast path that never touches the event
loop: the poller thread validates every request of a sweep with one vectorised check, applies backpressure and
puts them on the wave queue as plain `_Request`s that name their channel. When the queue is ready (a full batch,
its oldest request waited max_wait_us, or every open channel has its one request queued or running: no channel
can send another before its answer) the poller, or the GPU thread as it ends a wave batch, submits a wave job to
the GPU thread, at most WAVE_BATCHES unfinished at a time (one running, one waiting). The job takes up to
max_batch rows from the queue, runs them as one recurrent batch (slot checks, a bad request fails alone) and
writes every answer into its channel: no coroutine, task or future per request, no hop to the event loop.
Channel whole-search requests go onto the event loop batcher's queues as such `_Request`s too (checked there,
no coroutine), and the GPU thread writes their answers into their channels when their batch is done. A search
that nothing could join (the batcher idle with nothing queued or in flight, and every other open channel waiting
on an answer: one env, an evaluation) goes from the poller straight to the GPU thread as a job of its own, and
never touches the loop. Channel initial requests and every Ray call go through the batcher as coroutines,
answered through futures.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import sys
import threading
import time
from typing import Any

import numpy as np
import torch

from rayzero.config import InferenceConfig, ModelConfig
from rayzero.devices import resolve_device
from rayzero.inference import channel as channels
from rayzero.inference.cache import EvalCache, row_key
from rayzero.inference.errors import InferenceError, InferenceOverloaded
from rayzero.inference.pool import LatentPool
from rayzero.inference.runner import Flight, Runner, is_cuda, merged_search
from rayzero.logs import logger
from rayzero.models import build_model
from rayzero.tree import SearchConfig

log = logger(__name__)


def bucket_ladder(min_bucket: int, max_batch: int, steps: int = 1) -> list[int]:
    """Bucket sizes: min_bucket doubling up to (and always including) max_batch, with `steps` buckets per doubling
    (2: 8, 12, 16, 24, 32, 48, ...; a step that is not a whole number of rows is left out)."""
    if steps < 1:
        raise ValueError(f"bucket_ladder steps={steps!r}: must be >= 1 (buckets per doubling)")
    sizes, size = [], min_bucket
    while size < max_batch:
        for j in range(steps):
            if (size * j) % steps == 0 and size + size * j // steps < max_batch:
                sizes.append(size + size * j // steps)
        size *= 2
    sizes.append(max_batch)
    return sorted(set(sizes))


def _as_inference_error(kind: str, error: Exception) -> InferenceError:
    """What a request gets for a failure in its batch: the error itself when it is the actor's, else wrapped
    with the batch's kind."""
    return error if isinstance(error, InferenceError) else InferenceError(f"{kind}: {type(error).__name__}: {error}")


_ANSWERED = object()  # the result of a fast-path request already written into its channel
BUCKET_CUT_MIN_COUNT = 3  # batches of a bucket timed before inference.bucket_cut trusts its mean
BUCKET_CUT_MARGIN = 1.05  # how many times the rows per device second a cut must move to be taken
SEARCH_CONFIGS = 256  # most search overrides whose configs the actor remembers (_search_configs)
WAVE_BATCHES = 2  # most unfinished wave jobs (recurrent batches from the wave queue): one running, one waiting


def _pinned_key(key: Any) -> bool:
    """Whether a queue key is the evaluation network's (made only where the actor has one)."""
    return isinstance(key, tuple) and key[-1] == "pinned"


@dataclasses.dataclass
class _Request:
    key: Any  # 'initial', 'recurrent', ('search', SearchConfig), ('search', SearchConfig, 'rows') when merged, or
    # ('search', SearchConfig, 'pinned') on the evaluation network (inference.pinned_eval)
    client: str
    payload: Any
    rows: int
    future: asyncio.Future | None
    submitted: float
    channel: channels.ServerChannel | None = None  # a channel fast-path request: answered into its channel
    seq: int = 0


@dataclasses.dataclass
class _Batch:
    key: Any
    kind: str
    requests: list[_Request]
    results: list[Any]
    live: list[int] = dataclasses.field(default_factory=list)  # requests that reached the device
    handles: list[np.ndarray] = dataclasses.field(default_factory=list)  # per live request
    flight: Flight | None = None
    plan: dict[str, Any] | None = None  # cache plan of an initial batch
    version: int = 0
    launched: float = 0.0
    host_s: float = 0.0
    runner: Runner | None = None  # the runner it was launched on (the evaluation network's, or the served one)
    lane: int = -1  # its index in `lanes` (-1: the evaluation network's runner)
    spin: bool = True  # its wait spins rather than sleeps (Runner.wait)


class InferenceServer:
    def __init__(self, model_cfg: ModelConfig, cfg: InferenceConfig, obs_shape: tuple[int, ...], num_actions: int,
                 seed: int = 0, torch_threads: int = 1, *, obs_dtype: Any = None,
                 search_cfg: SearchConfig | None = None, discount: float = 0.997, eval_rows: int = 0,
                 eval_search: SearchConfig | None = None):
        """obs_dtype: of the observations (default uint8 for [C, H, W], float32 otherwise); search_cfg and
        discount: of whole-search requests (the run's `search` section and `replay.discount`); eval_rows: the
        roots of an evaluation's greedy searches (run.eval_episodes), which inference.pinned_eval sizes the
        evaluation network's graphs by; eval_search: those searches' section (`Config.eval_search`: its
        simulations and virtual loss; None = search_cfg's), made greedy, on the evaluation network's graphs (a
        greedy request of any other client searches with search_cfg's)."""
        started = time.perf_counter()
        torch.set_num_threads(torch_threads)
        torch.manual_seed(seed)
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.obs_shape = tuple(obs_shape)
        self.num_actions = num_actions
        default = np.uint8 if len(self.obs_shape) == 3 else np.float32
        self.obs_dtype = np.dtype(obs_dtype if obs_dtype is not None else default)
        self.search_cfg = search_cfg if search_cfg is not None else SearchConfig()
        self.model = build_model(model_cfg, obs_shape, num_actions).to(self.device).eval()
        self.pool = LatentPool(cfg.latent_pool_size, cfg.latent_timeout_s)
        self.cache = EvalCache(cfg.cache_size, num_actions) if cfg.cache_size else None
        self.ladder = bucket_ladder(cfg.min_bucket, cfg.max_batch, cfg.ladder_steps)
        self.version = 0
        cuda = is_cuda(self.device)
        if cuda and cfg.switch_interval_us > 0:
            sys.setswitchinterval(cfg.switch_interval_us / 1e6)
        self.gpu = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="inference-gpu",
            initializer=(lambda: torch.cuda.set_device(self.device)) if cuda else None)
        self.runner: Runner = self.gpu.submit(
            Runner, self.model, cfg, self.obs_shape, self.obs_dtype, num_actions, self.ladder, self.search_cfg,
            discount, seed).result()
        if self.cache is not None:
            self.gpu.submit(self.runner.enable_cache, cfg.cache_size).result()
        self._greedy_cfg = dataclasses.replace(self.search_cfg, **channels.GREEDY_OVERRIDES)
        self.eval_search_cfg = dataclasses.replace(eval_search if eval_search is not None else self.search_cfg,
                                                   **channels.GREEDY_OVERRIDES)
        self.eval_runner = (self._eval_runner(model_cfg, eval_rows, discount, seed)
                            if cfg.pinned_eval and eval_rows > 0 else None)
        self._init_lanes(model_cfg, discount, seed)
        self._configs: dict[tuple, tuple[SearchConfig, Any]] = {}  # _search_configs' (any thread: dict ops are atomic)
        self.waits = {"slept": 0, "spun": 0}  # GPU thread: CUDA batch waits that slept, or spun
        self.eval_version = 0
        if cuda:  # where a run's start goes (its first update waits for this actor)
            self._log_start(started)
        self._pinned_clients: set[str] = set()
        self._queues: dict[Any, collections.deque[_Request]] = {}
        self._queued_rows: collections.Counter = collections.Counter()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.batcher: asyncio.Task | None = None
        self.metrics: dict[str, dict[str, float]] = {}  # written by the GPU thread, under _metrics_lock
        self._metrics_lock = threading.Lock()
        self.errors = 0
        self.requests = 0
        self.max_queue = cfg.max_queue or 4 * cfg.max_batch  # rows
        self.overloaded = 0  # requests refused by backpressure (inference.max_queue)
        self.peak_queued_rows = 0
        self._t0 = time.perf_counter()
        self._trace: list[dict[str, Any]] | None = None
        self._poller: channels.Poller | None = None
        self._stager = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference-weights")
        self.gone_clients = 0  # channel clients whose process ended (their latent slots were freed)
        self._channel_loop: asyncio.AbstractEventLoop | None = None
        # Channel requests handed on (to the event loop; to the wave queue) and those answered, each counter written
        # by one thread only (the loop; the poller; the loop's coroutine answers; the GPU thread's fast-path
        # answers): outstanding = the difference.
        self._channel_handed = 0
        self._wave_handed = 0
        self._lone_handed = 0  # the poller's: lone searches it handed straight to the GPU thread
        self._lone_done = 0  # the GPU thread's: those it has answered
        self._batcher_unfinished = 0  # batches the batcher launched and has not finished (set as its steps end)
        self._channel_answered_loop = 0
        self._channel_answered_gpu = 0
        self._channel_errors = 0  # requests the poller thread refused (its own counter: no race with the loop's)
        self._gpu_errors = 0  # fast-path requests the GPU thread answered with an error
        self._init_waves()

    def _log_start(self, started: float) -> None:
        """The start-up's log lines: how long it took, and where the captures' time went."""
        log.info("inference actor up in %.1f s: %d network graphs and %d whole searches captured in %.1f s%s%s",
                 time.perf_counter() - started, len(self.runner.graphs), len(self.runner.searches),
                 self.runner.capture_s, "" if self.eval_runner is None else
                 f", the evaluation network's {len(self.eval_runner.searches)} in {self.eval_runner.capture_s:.1f} s",
                 "" if len(self.lanes) == 1 else f", {len(self.lanes) - 1} more search lanes in "
                 f"{sum(lane.capture_s for lane in self.lanes[1:]):.1f} s")
        if self.runner.capture_parts:  # where a cold machine's start goes: the first of each kind compiles
            log.info("inference actor's start: %.1f s before the captures; %s",
                     self.runner.capture_started - started,
                     ", ".join(f"{part} {seconds:.1f} s" for part, seconds in self.runner.capture_parts.items()))

    def _init_waves(self) -> None:
        """The wave queue (channel recurrent requests, poller thread -> GPU thread), under _wave_lock, and the
        poller thread's own counters (requests, refusals, peak rows), as the loop has its own."""
        self._wave_lock = threading.Lock()
        self._waves: collections.deque[_Request] = collections.deque()
        self._wave_rows = 0
        self._wave_jobs = 0  # wave jobs submitted to the GPU thread and not finished
        self._wave_waiting = 0  # of those, not started yet
        self._wave_jobs_peak = 0
        self._wave_requests_n = 0
        self._wave_overloaded = 0
        self._wave_peak_rows = 0

    def _init_lanes(self, model_cfg: ModelConfig, discount: float, seed: int) -> None:
        """inference.search_lanes: the served runner first, then one runner per further lane, for whole searches."""
        lanes = self.cfg.search_lanes if self.runner.search_ladder else 1
        self.lanes = [self.runner] + [self._lane_runner(model_cfg, discount, seed + 2 + i) for i in range(lanes - 1)]
        self._lane_unfinished = [0] * len(self.lanes)  # GPU thread: batches launched on each and not finished
        self._lane_launched = [0.0] * len(self.lanes)  # GPU thread: when each last had a batch launched
        self.lane_batches = [0] * len(self.lanes)  # batches launched on each

    def _lane_runner(self, model_cfg: ModelConfig, discount: float, seed: int) -> Runner:
        """A further search lane: a copy of the served network with its own stream, buffers and whole-search
        graphs (the served runner's search ladder and configs), for whole searches only."""
        top = max(self.runner.search_ladder)
        lane_cfg = dataclasses.replace(self.cfg, max_batch=top, search_max_batch=top, latent_pool_size=top,
                                       cache_size=0, search_lanes=1, network_graphs="search")
        model = build_model(model_cfg, self.obs_shape, self.num_actions).to(self.device).eval()
        model.load_state_dict(self.model.state_dict())
        return self.gpu.submit(Runner, model, lane_cfg, self.obs_shape, self.obs_dtype, self.num_actions,
                               self.runner.search_ladder, self.search_cfg, discount, seed).result()

    def _eval_runner(self, model_cfg: ModelConfig, eval_rows: int, discount: float, seed: int) -> Runner:
        """inference.pinned_eval: the evaluation network, its greedy search captured now for one bucket (the
        smallest of the ladder that holds an evaluation's roots)."""
        bucket = next((b for b in self.ladder if b >= eval_rows), self.ladder[-1])
        eval_cfg = dataclasses.replace(self.cfg, max_batch=bucket, min_bucket=bucket, search_max_batch=bucket,
                                       merge_searches=False, latent_pool_size=bucket, cache_size=0,
                                       network_graphs="search")
        model = build_model(model_cfg, self.obs_shape, self.num_actions).to(self.device).eval()
        model.load_state_dict(self.model.state_dict())
        return self.gpu.submit(Runner, model, eval_cfg, self.obs_shape, self.obs_dtype, self.num_actions, [bucket],
                               self.eval_search_cfg, discount, seed + 1).result()

    # -- public API (async actor methods) -------------------------------------------------------------

    async def initial(self, client: str, obs: np.ndarray) -> dict[str, np.ndarray]:
        """obs [B, *obs_shape] -> {handles [B], value [B], reward [B], policy_logits [B, A], version}."""
        self._checked(self._check_client, "initial", client)
        obs = self._checked(self._check_obs, "initial", obs)
        if len(obs) == 0:
            return self._empty(handles=True)
        return await self._submit("initial", client, obs, len(obs))

    async def recurrent(self, client: str, handles: np.ndarray, actions: np.ndarray,
                        store: bool = True) -> dict[str, np.ndarray]:
        """handles [B] (this client's slots), actions [B] -> the next states' outputs and handles.

        store=False: the next latents are not kept (handles come back as -1), for leaves never expanded.
        """
        self._checked(self._check_client, "recurrent", client)
        payload = self._checked(self._check_recurrent, handles, actions)
        if len(payload[0]) == 0:
            return self._empty(handles=True)
        return await self._submit("recurrent", client, (*payload, bool(store)), len(payload[0]))

    async def search(self, client: str, obs: np.ndarray, invalid_actions: np.ndarray | None = None,
                     **overrides: Any) -> dict[str, np.ndarray]:
        """A whole search for B roots: obs [B, *obs_shape], invalid_actions [B, A] bool (True = illegal).

        overrides: SearchConfig fields for this request (e.g. temperature=0.5, num_simulations=25); a new
        combination captures its CUDA graphs on first use. Returns action [B] int64, action_weights [B, A],
        visit_counts [B, A] int64, root_value [B], version.
        """
        prepared = self._search_request(client, obs, invalid_actions, overrides)
        if isinstance(prepared, dict):
            return prepared
        return await self._submit(*prepared)

    def _search_request(self, client: str, obs: np.ndarray, invalid_actions: np.ndarray | None,
                        overrides: dict[str, Any], count_errors: bool = True
                        ) -> tuple[Any, str, Any, int] | dict[str, np.ndarray]:
        """A search request checked: its (queue key, client, payload, rows), or the answer of one with no roots.
        Raises InferenceError for bad input, counted in `errors` (the event loop's counter) with count_errors."""
        try:
            return self._search_request_checked(client, obs, invalid_actions, overrides)
        except InferenceError:
            if count_errors:
                self.errors += 1
            raise

    def _search_request_checked(self, client: str, obs: np.ndarray, invalid_actions: np.ndarray | None,
                                overrides: dict[str, Any]) -> tuple[Any, str, Any, int] | dict[str, np.ndarray]:
        self._check_client("search", client)
        obs = self._check_obs("search", obs)
        mask = self._check_mask(invalid_actions, len(obs))
        config, merged = self._search_configs(overrides)
        if len(obs) == 0:
            return {"action": np.zeros(0, np.int64), "action_weights": np.zeros((0, self.num_actions), np.float32),
                    "visit_counts": np.zeros((0, self.num_actions), np.int64), "root_value": np.zeros(0, np.float32),
                    "version": self.version}
        if self.eval_runner is not None and self._pinned(client):
            # An evaluation's client (set_eval_weights): its searches play the evaluation network's weights.
            if len(obs) > self.eval_runner.M:
                raise InferenceError(f"search: {len(obs)} roots for the evaluation network, which takes at most "
                                     f"{self.eval_runner.M} (the server's eval_rows)")
            if config not in (self._greedy_cfg, self.eval_search_cfg):
                raise InferenceError(f"search: the evaluation network only searches greedily "
                                     f"({channels.GREEDY_OVERRIDES}); got overrides {overrides}")
            config = self.eval_search_cfg  # with the evaluation's simulations (a channel request names none)
            return ("search", config, "pinned"), client, (obs, mask), len(obs)
        if merged is not None:  # one batch for every request of the same search shape, each row its settings
            shape, settings = merged
            return ("search", shape, "rows"), client, (obs, mask, settings), len(obs)
        return ("search", config), client, (obs, mask), len(obs)

    def _search_configs(self, overrides: dict[str, Any]) -> tuple[SearchConfig, Any]:
        """A request's search config (the run's with `overrides`) and its merged batch's (`merged_search`; None
        where it joins none), remembered per overrides: a channel's requests repeat a few, and building them is
        two dataclass copies with their checks on every search."""
        try:
            key = tuple(sorted((name, type(value).__name__, value) for name, value in overrides.items()))
            hash(key)
        except TypeError:
            key = None
        known = self._configs.get(key) if key is not None else None
        if known is not None:
            return known
        try:
            config = dataclasses.replace(self.search_cfg, **overrides) if overrides else self.search_cfg
        except (TypeError, ValueError) as error:
            raise InferenceError(f"search: bad search config override {overrides}: {error}") from None
        known = config, merged_search(config, self.search_cfg) if self.cfg.merge_searches else None
        if key is not None:
            if len(self._configs) >= SEARCH_CONFIGS:
                self._configs.clear()
            self._configs[key] = known
        return known

    async def open_channel(self, client: str, max_rows: int, obs_rows: int = 0,
                           node_id: str | None = None, pid: int | None = None) -> dict[str, Any] | None:
        """A shared-memory channel for `client` (replacing its previous one): recurrent requests of up to max_rows
        rows and initial requests of up to obs_rows observations. Returns {'paths': {tag: path}} for
        `channel.InferenceClient`, or None when the client must use Ray calls: channels off, `node_id` (the
        client's Ray node) not this actor's node, stores not ordered on this machine, or no room in /dev/shm.
        pid: the client's process; when it ends, its channel closes and its latent slots are freed."""
        for name, value, low in (("max_rows", max_rows, 1), ("obs_rows", obs_rows, 0)):
            if not isinstance(value, (int, np.integer)) or not low <= value <= 1 << 20:
                self.errors += 1
                raise InferenceError(f"open_channel: {name}={value!r} must be an integer in [{low}, {1 << 20}]")
        if pid is not None and (not isinstance(pid, (int, np.integer)) or pid <= 0):
            self.errors += 1
            raise InferenceError(f"open_channel: pid={pid!r} must be a positive integer (the client's process id)")
        if not self.cfg.channels or not channels.ORDERED_STORES or node_id != self._node_id():
            return None
        made = channels.create(client, int(max_rows), int(obs_rows), self.obs_shape, self.obs_dtype, self.num_actions,
                               None if pid is None else int(pid))
        if made is None:
            return None
        channel, paths = made
        if self._poller is None:
            self._channel_loop = asyncio.get_running_loop()
            self._poller = channels.Poller(self._on_channel_requests, self.cfg.latent_timeout_s,
                                           sleep_s=self.cfg.poll_interval_us * 1e-6, on_gone=self._on_client_gone,
                                           on_idle=self._dispatch_waves)
        self._poller.add(channel)
        return {"paths": paths, "doorbell": self._poller.doorbell_path}

    def _on_client_gone(self, client: str) -> None:
        """Poller thread: the process of a channel's client ended; free its latent slots (the pool locks)."""
        self.pool.release(client)
        self.gone_clients += 1

    async def close_channel(self, client: str) -> bool:
        """Close `client`'s channel (its latent slots stay until `release`)."""
        return self._poller is not None and self._poller.remove(client)

    @staticmethod
    def _node_id() -> str | None:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None

    def _on_channel_requests(self, new: list[tuple[channels.ServerChannel, int]]) -> None:
        """Poller thread: the new requests of one sweep. Recurrent ones are checked here, all at once, and go to
        the wave queue as `_Request`s; initial and search requests go to the event loop (the coroutine path)."""
        waves: list[tuple[channels.ServerChannel, int, int, bool]] = []
        others: list[tuple[channels.ServerChannel, int]] = []
        for channel, seq in new:
            h = channel.header
            kind = int(h[channels.KIND])
            if kind == channels.SEARCH and len(new) == 1 and self._lone_search(channel, seq):
                continue
            if kind != channels.RECURRENT:
                others.append((channel, seq))
                continue
            rows, limit = int(h[channels.ROWS]), len(channel.arrays["handles"])
            if not 0 <= rows <= limit:
                self._channel_errors += 1
                channel.fail(seq, InferenceError(f"recurrent: channel rows={rows} must be in [0, {limit}] "
                                                 "(the channel's max_rows)"))
                continue
            if rows == 0:
                channel.reply(seq, self._empty(handles=True))
                continue
            waves.append((channel, seq, rows, bool(h[channels.STORE])))
        if waves:
            self._queue_waves(self._wave_requests(waves))
        if others:
            self._channel_loop.call_soon_threadsafe(self._serve_channels, others)

    def _wave_requests(self, waves: list[tuple[channels.ServerChannel, int, int, bool]]) -> list[_Request]:
        """Poller thread: copy the waves' handles and actions out of their channels (one concatenation each),
        check every action at once, and fail the requests with an action outside [0, A) alone."""
        handles = np.concatenate([c.arrays["handles"][:n] for c, _, n, _ in waves])
        actions = np.concatenate([c.arrays["actions"][:n] for c, _, n, _ in waves])
        bad_rows = (actions < 0) | (actions >= self.num_actions)
        any_bad = bool(bad_rows.any())  # one check for the sweep; rows per request only when one is bad
        now = time.perf_counter()
        requests, offset = [], 0
        for channel, seq, rows, store in waves:
            sl = slice(offset, offset + rows)
            offset += rows
            if any_bad and bad_rows[sl].any():
                row = int(np.flatnonzero(bad_rows[sl])[0])
                self._channel_errors += 1
                channel.fail(seq, InferenceError(
                    f"recurrent: actions must be in [0, {self.num_actions}), got {int(actions[sl][row])} at row {row}"))
                continue
            requests.append(_Request("recurrent", channel.client, (handles[sl], actions[sl], store), rows, None, now,
                                     channel, seq))
        return requests

    def _queue_waves(self, requests: list[_Request]) -> None:
        """Poller thread: a sweep's recurrent requests onto the wave queue (backpressure per request, as
        `_submit`: the rows queued on the event loop count too), then a wave job if the queue is ready."""
        refused: list[tuple[_Request, InferenceOverloaded]] = []
        loop_rows = self._loop_queued_rows()
        with self._wave_lock:
            for request in requests:
                queued = loop_rows + self._wave_rows
                if queued and queued + request.rows > self.max_queue:
                    self._wave_overloaded += 1  # not an error (as in _submit): the client sends it again
                    refused.append((request, self._overloaded(queued, request.rows)))
                    continue
                self._wave_peak_rows = max(self._wave_peak_rows, queued + request.rows)
                self._waves.append(request)
                self._wave_rows += request.rows
                self._wave_requests_n += 1
                self._wave_handed += 1
        for request, error in refused:
            request.channel.fail(request.seq, error)
        if loop_rows and self._wake is not None:  # the batcher may be waiting for these channels (`_fill`)
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # that loop is closed
                pass
        self._dispatch_waves()

    def _serve_channels(self, others: list[tuple[channels.ServerChannel, int]]) -> None:
        """Event loop: start the coroutine of each of a sweep's initial and search requests."""
        for channel, seq in others:
            self._serve_channel(channel, seq)

    def _serve_channel(self, channel: channels.ServerChannel, seq: int) -> None:
        """Event loop: a channel's initial (or, unvalidated, recurrent) request through its coroutine; a search
        request onto the batcher's queue (`_queue_channel_search`)."""
        kind, rows, payload = channel.request()
        if kind == channels.RECURRENT:
            coro = self.recurrent(channel.client, *payload)
        elif kind == channels.INITIAL and payload is not None:
            coro = self.initial(channel.client, payload)
        elif kind == channels.SEARCH and payload is not None:
            self._channel_handed += 1
            self._queue_channel_search(channel, seq, *payload)
            return
        else:
            self.errors += 1
            channel.fail(seq, InferenceError(f"channel: unknown request kind {kind} (or no obs buffer)"))
            return

        self._channel_handed += 1

        def answer(task: asyncio.Task) -> None:
            self._channel_answered_loop += 1
            error = InferenceError("request cancelled") if task.cancelled() else task.exception()
            if error is not None:
                channel.fail(seq, error)
            else:
                channel.reply(seq, task.result())

        self._channel_loop.create_task(coro).add_done_callback(answer)

    def _queue_channel_search(self, channel: channels.ServerChannel, seq: int, obs: np.ndarray, temperature: float,
                              greedy: bool) -> None:
        """Event loop: a channel's search request straight onto the batcher's queue, answered into its channel by
        the GPU thread (`_answer_channels`) as soon as the batch is done: no coroutine, and no hop back through
        the event loop before the answer (one env's search pays each hop on every step)."""
        try:
            request = self._channel_search(channel, seq, obs, temperature, greedy)
            if isinstance(request, dict):
                self._channel_answered_loop += 1
                channel.reply(seq, request)
                return
            self._enqueue(request)
        except InferenceError as error:  # bad input (counted where raised) or overloaded: this one fails alone
            self._channel_answered_loop += 1
            channel.fail(seq, error)

    def _channel_search(self, channel: channels.ServerChannel, seq: int, obs: np.ndarray, temperature: float,
                        greedy: bool, count_errors: bool = True) -> _Request | dict[str, np.ndarray]:
        """A channel's search request checked (`_search_request`): the `_Request` that names its channel, or the
        answer of one with no roots."""
        overrides = channels.GREEDY_OVERRIDES if greedy else {"temperature": temperature}
        prepared = self._search_request(channel.client, obs, None, overrides, count_errors)
        if isinstance(prepared, dict):
            return prepared
        key, client, payload, rows = prepared
        return _Request(key, client, payload, rows, None, time.perf_counter(), channel, seq)

    def _lone_search(self, channel: channels.ServerChannel, seq: int) -> bool:
        """Poller thread: hand a search request straight to the GPU thread when nothing could join its batch (the
        batcher with nothing queued or in flight, no wave job, no other lone search, and every other open channel
        waiting on an answer), so one client's search (one env, an evaluation) skips the event loop both ways.
        The GPU thread runs its jobs one at a time, so a batch the batcher launches meanwhile runs before or after
        it. Returns False, touching nothing, where the batcher should take it."""
        if not (self._batcher_unfinished == 0 and self._loop_queued_rows() == 0 and self._lone_handed == self._lone_done
                and not self._waves and self._wave_jobs == 0):
            return False
        self._lone_handed += 1
        if not self._channels_all_waiting():
            self._lone_handed -= 1
            return False
        kind, rows, payload = channel.request()
        try:
            if payload is None:
                raise InferenceError(f"channel: search request without an obs buffer (kind {kind})")
            request = self._channel_search(channel, seq, *payload, count_errors=False)
            if isinstance(request, dict):
                self._lone_handed -= 1  # answered here, without the GPU thread: not outstanding
                channel.reply(seq, request)
                return True
            self.gpu.submit(self._lone_job, request)
        except (InferenceError, RuntimeError) as error:  # bad input, or the executor shut down (the actor ends)
            self._channel_errors += 1
            self._lone_handed -= 1
            channel.fail(seq, error if isinstance(error, InferenceError) else InferenceError(f"search: {error}"))
        return True

    def _lone_job(self, request: _Request) -> None:
        """GPU thread: a lone search launched, waited for and answered into its channel, in one job. It counts as
        done before its answer is written: its client may send the next one at once, and that one may be lone
        too."""
        try:
            batch = self._launch(request.key, [request])
            batch.spin = True  # its client waits on nothing else: spin, for the answer as soon as it is ready
            self._finish(batch, answer_channels=False)  # a failed launch or wait is the request's answer
        except Exception as error:  # noqa: BLE001 - anything else fails this request alone, and the path stays open
            self._lone_done += 1
            self._channel_answered_gpu += 1
            request.channel.fail(request.seq, _as_inference_error("search", error))
            return
        self._lone_done += 1
        self._answer_channels(batch)

    # -- the wave queue (poller thread -> GPU thread) --------------------------------------------------------

    def _loop_queued_rows(self) -> int:
        """Rows queued on the event loop (any thread may read it: a sum over a dict, done under the GIL)."""
        return sum(self._queued_rows.values())

    def _waves_ready(self, now: float) -> bool:
        """Under _wave_lock: the wave queue has a batch to run now (a full one, its oldest request has waited
        max_wait_us, or no open channel can add rows before an answer)."""
        if not self._waves:
            return False
        return (self._wave_rows >= self.cfg.max_batch or now >= self._waves[0].submitted + self.cfg.max_wait_us / 1e6
                or self._channels_all_waiting())

    def _dispatch_waves(self) -> bool:
        """Poller or GPU thread: submit a wave job when the queue is ready, none is waiting to start and fewer
        than WAVE_BATCHES are unfinished (on CUDA also while one runs: the next takes the rows that come
        meanwhile). Returns whether requests are queued (the poller then keeps sweeping at its fast pace)."""
        if not self._waves:
            return False
        with self._wave_lock:
            if self._wave_waiting or self._wave_jobs >= WAVE_BATCHES:
                return bool(self._waves)
            if not (self._waves_ready(time.perf_counter()) or (self.runner.cuda and self._wave_jobs)):
                return bool(self._waves)
            self._wave_jobs += 1
            self._wave_waiting += 1
            self._wave_jobs_peak = max(self._wave_jobs_peak, self._wave_jobs)
        try:
            self.gpu.submit(self._wave_job)
        except RuntimeError:  # the executor is shut down: the actor is ending
            with self._wave_lock:
                self._wave_jobs -= 1
                self._wave_waiting -= 1
        return True

    def _wave_job(self) -> None:
        """GPU thread: one recurrent batch of up to max_batch rows from the wave queue, answered into the
        channels. On the CPU the queue must still be ready as the job starts (as the batcher's `_fill` after a
        batch: rows that came while the last one ran wait for the other channels' next waves, up to max_wait)."""
        requests: list[_Request] = []
        try:
            with self._wave_lock:
                self._wave_waiting -= 1
                if self._waves and (self.runner.cuda or self._waves_ready(time.perf_counter())):
                    requests, rows = self._pop_batch(self._waves, self.cfg.max_batch)
                    self._wave_rows -= rows
            if requests:
                self._finish(self._launch("recurrent", requests))
        except Exception as error:  # noqa: BLE001 - _launch and _finish catch their own; a last resort
            for request in requests:
                if int(request.channel.header[channels.DONE]) != request.seq:
                    self._gpu_errors += 1
                    self._channel_answered_gpu += 1
                    request.channel.fail(request.seq, _as_inference_error("recurrent", error))
        finally:
            with self._wave_lock:
                self._wave_jobs -= 1
            self._dispatch_waves()

    async def release(self, client: str) -> int:
        """Free every latent slot of `client` (call when its search ends); returns how many."""
        return self.pool.release(client)

    async def set_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> int:
        """Copy `state_dict` into the served model in place, between batches; returns the version now served.

        Batches launched before the swap are computed with the old weights, later ones with the new; every
        answer carries the version it was computed with. The evaluation cache is cleared. The event loop keeps
        serving meanwhile: a staging thread checks and stages the weights (the slow, host-side part), then the
        GPU thread copies them in between two batches. Swaps land in the order of the calls.
        """
        def swap() -> None:  # the staging thread: swaps in call order, one at a time (they share the buffers)
            staged = [lane.stage_weights(state_dict) for lane in self.lanes]
            self.gpu.submit(self._apply_weights, version, staged).result()

        await asyncio.wrap_future(self._stager.submit(swap))
        return version

    async def set_eval_weights(self, version: int, state_dict: dict[str, torch.Tensor], client: str) -> bool:
        """inference.pinned_eval: copy `state_dict` into the evaluation network, and search for every client whose
        id starts with `client` (an evaluation's, its channels' included) with it from now on. Returns whether
        this actor has an evaluation network (False: nothing changed, its searches play the served weights)."""
        if self.eval_runner is None:
            return False
        runner = self.eval_runner

        def swap() -> None:  # on the staging thread, in call order with set_weights' swaps
            staged = runner.stage_weights(state_dict)
            self.gpu.submit(self._apply_eval_weights, version, staged).result()

        await asyncio.wrap_future(self._stager.submit(swap))
        self._pinned_clients.add(client)
        return True

    def _pinned(self, client: str) -> bool:
        """Whether `client` is an evaluation's (set_eval_weights named it, or it is one of its channels)."""
        return any(client == name or client.startswith(name + "-") for name in self._pinned_clients)

    def _apply_eval_weights(self, version: int, staged: dict[str, torch.Tensor]) -> None:
        """GPU thread, between batches: the staged weights into the evaluation network."""
        assert self.eval_runner is not None
        self.eval_runner.apply_weights(staged)
        self.eval_version = version

    async def set_published(self, weights: tuple[int, dict[str, torch.Tensor]]) -> int:
        """set_weights with a learner's `weights()` result as one argument: the driver hands over the ref, and Ray
        delivers the weights here once the learner has made them, without the driver waiting for them."""
        version, state_dict = weights
        return await self.set_weights(version, state_dict)

    def _apply_weights(self, version: int, staged: list[dict[str, torch.Tensor]]) -> None:
        """GPU thread, between batches: the staged weights into every lane's network (each on its own stream, so
        in order with that lane's batches), the new version, a clear cache."""
        for lane, weights in zip(self.lanes, staged):
            lane.apply_weights(weights)
        self.version = version
        if self.cache is not None:
            self.cache.clear()

    def get_version(self) -> int:
        return self.version

    def stats(self) -> dict[str, Any]:
        """Version, error and request counts, per-bucket metrics, pool and cache state.

        A plain method: it only reads (the metrics under a lock the GPU thread holds for microseconds), so it
        never waits for the GPU thread."""
        with self._metrics_lock:  # the GPU thread adds buckets while serving
            metrics = {key: dict(m) for key, m in self.metrics.items()}
        buckets = {}
        for key, m in metrics.items():
            served = m["rows"] + m["padded"]
            buckets[key] = {**m, "padding_fraction": m["padded"] / served if served else 0.0,
                            "mean_wait_ms": 1e3 * m["wait_s"] / max(1, m["requests"]),
                            "mean_gpu_ms": 1e3 * m["gpu_s"] / max(1, m["count"])}
        errors = self.errors + self._channel_errors + self._gpu_errors
        return {"version": self.version, "errors": errors,
                "requests": self.requests + self._wave_requests_n + self._lone_handed,
                "buckets": buckets, "overloaded": self.overloaded + self._wave_overloaded,
                "queued_rows": self._loop_queued_rows() + self._wave_rows,
                "peak_queued_rows": max(self.peak_queued_rows, self._wave_peak_rows), "max_queue": self.max_queue,
                "wave_jobs_peak": self._wave_jobs_peak,
                "free_slots": self.pool.free, "clients": self.pool.clients,
                "reclaimed_clients": self.pool.reclaimed_clients, "device": str(self.device),
                "channel_clients": [] if self._poller is None else sorted(self._poller.channels),
                "poller_sweeps": 0 if self._poller is None else self._poller.sweeps,
                "gone_clients": self.gone_clients,
                "channel_answers": {"event_loop": self._channel_answered_loop, "gpu_thread": self._channel_answered_gpu},
                "lone_searches": self._lone_done, "batch_waits": dict(self.waits),
                "cuda_graphs": len(self.runner.graphs), "search_graphs": len(self.runner.searches),
                "lane_batches": list(self.lane_batches),
                "capture_s": self.runner.capture_s + (self.eval_runner.capture_s if self.eval_runner else 0.0),
                "eval_version": self.eval_version if self.eval_runner is not None else None,
                "cache": self.cache.stats() if self.cache is not None else None}

    def start_trace(self) -> None:
        """Record the batcher's timeline (queueing, launches, device work, waits) from now on."""
        self._trace = []

    def stop_trace(self) -> dict[str, Any]:
        """The recorded timeline as a Chrome trace ({'traceEvents': [...]}, chrome://tracing or Perfetto)."""
        events, self._trace = self._trace or [], None
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    async def profile(self, kind: str, bucket: int, iters: int = 20, graph: bool = True) -> float:
        """Benchmarks: seconds per (kind, bucket) call back to back on the device (see Runner.profile)."""
        return await asyncio.wrap_future(self.gpu.submit(self.runner.profile, kind, bucket, iters, graph))

    # -- validation --------------------------------------------------------------------------------------

    def _checked(self, check, *args):
        try:
            return check(*args)
        except InferenceError:
            self.errors += 1
            raise

    def _empty(self, handles: bool) -> dict[str, np.ndarray]:
        out = {"value": np.zeros(0, np.float32), "reward": np.zeros(0, np.float32),
               "policy_logits": np.zeros((0, self.num_actions), np.float32), "version": self.version}
        if handles:
            out["handles"] = np.zeros(0, np.int64)
        return out

    @staticmethod
    def _check_client(kind: str, client: str) -> None:
        # Checked up front: a client name that breaks the pool's bookkeeping would fail its whole batch.
        if not isinstance(client, str):
            raise InferenceError(f"{kind}: client must be a str (the name its latent slots are kept under), "
                                 f"got {type(client).__name__}")

    @staticmethod
    def _array(kind: str, name: str, value: Any) -> np.ndarray:
        try:
            return np.asarray(value)
        except (ValueError, TypeError) as error:  # e.g. ragged nested lists
            raise InferenceError(f"{kind}: {name} is not an array: {error}") from None

    def _check_obs(self, kind: str, obs: np.ndarray) -> np.ndarray:
        obs = self._array(kind, "obs", obs)
        if obs.ndim != len(self.obs_shape) + 1 or tuple(obs.shape[1:]) != self.obs_shape:
            raise InferenceError(f"{kind}: obs shape {obs.shape} must be [B, {', '.join(map(str, self.obs_shape))}]")
        if obs.dtype.kind not in "biuf" or not np.can_cast(obs.dtype, self.obs_dtype, casting="same_kind"):
            raise InferenceError(f"{kind}: obs dtype {obs.dtype} cannot be served as {self.obs_dtype}")
        if obs.dtype.kind == "f" and not np.isfinite(obs).all():
            raise InferenceError(f"{kind}: obs contains NaN or inf")
        if self.obs_dtype.kind in "iu" and obs.dtype != self.obs_dtype and obs.size:
            info = np.iinfo(self.obs_dtype)
            if obs.min() < info.min or obs.max() > info.max:
                raise InferenceError(f"{kind}: obs values outside the range of {self.obs_dtype}")
        return obs

    def _check_mask(self, mask: np.ndarray | None, rows: int) -> np.ndarray | None:
        if mask is None:
            return None
        mask = self._array("search", "invalid_actions", mask)
        if mask.shape != (rows, self.num_actions) or mask.dtype != np.bool_:
            raise InferenceError(f"search: invalid_actions must be bool [{rows}, {self.num_actions}], got "
                                 f"{mask.dtype} {mask.shape}")
        if mask.all(axis=1).any():
            raise InferenceError(f"search: invalid_actions marks every action invalid in rows "
                                 f"{np.flatnonzero(mask.all(axis=1))[:10].tolist()}")
        return mask

    def _check_recurrent(self, handles: np.ndarray, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        handles, actions = self._array("recurrent", "handles", handles), self._array("recurrent", "actions", actions)
        if (handles.ndim != 1 or actions.shape != handles.shape or actions.dtype.kind not in "iu"
                or handles.dtype.kind not in "iu"):
            raise InferenceError(
                f"recurrent: handles {handles.shape} ({handles.dtype}) and actions {actions.shape} ({actions.dtype}) "
                "must be equal-length 1-D integer arrays"
            )
        if actions.size and (actions.min() < 0 or actions.max() >= self.num_actions):
            bad = actions[(actions < 0) | (actions >= self.num_actions)]
            raise InferenceError(f"recurrent: actions must be in [0, {self.num_actions}), got {int(bad[0])}")
        return handles.astype(np.int64), actions.astype(np.int64)

    # -- batching ------------------------------------------------------------------------------------

    def _ensure_batcher(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # One batcher per event loop (a Ray async actor has one; in-process callers may start several).
            self._loop = loop
            self._queues, self._queued_rows = {}, collections.Counter()
            self._wake = asyncio.Event()
            self.batcher = loop.create_task(self._batch_loop())
        return loop

    def _overloaded(self, queued: int, rows: int) -> InferenceOverloaded:
        return InferenceOverloaded(f"inference actor overloaded: {queued} rows queued, {rows} more would pass "
                                   f"inference.max_queue={self.max_queue} rows; retry later")

    async def _submit(self, key: Any, client: str, payload: Any, rows: int) -> dict[str, np.ndarray]:
        future = self._ensure_batcher().create_future()
        self._enqueue(_Request(key, client, payload, rows, future, time.perf_counter()))
        try:
            return await future
        except InferenceError:
            self.errors += 1
            raise

    def _enqueue(self, request: _Request) -> None:
        """Event loop: `request` onto its key's queue for the batcher, or InferenceOverloaded (backpressure)."""
        self._ensure_batcher()
        queued = self._loop_queued_rows() + self._wave_rows
        if queued and queued + request.rows > self.max_queue:
            self.overloaded += 1
            raise self._overloaded(queued, request.rows)
        self.peak_queued_rows = max(self.peak_queued_rows, queued + request.rows)
        self._queues.setdefault(request.key, collections.deque()).append(request)
        self._queued_rows[request.key] += request.rows
        self.requests += 1
        self._wake.set()

    def _oldest_key(self) -> Any:
        heads = [(q[0].submitted, i, k) for i, (k, q) in enumerate(self._queues.items()) if q]
        return min(heads)[2] if heads else None

    def _limit(self, key: Any) -> int:
        if _pinned_key(key):
            return self.eval_runner.M
        if isinstance(key, tuple) and self.cfg.search_max_batch > 0:
            return self.cfg.search_max_batch
        return self.cfg.max_batch

    async def _fill(self, key: Any, until: float = float("inf")) -> None:
        """Wait until `key` has a full batch queued, its oldest request has waited max_wait_us, or `until`."""
        deadline = min(self._queues[key][0].submitted + self.cfg.max_wait_us / 1e6, until)
        while self._queued_rows[key] < self._limit(key) and not self._channels_all_waiting():
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), remaining)
            except asyncio.TimeoutError:
                return

    def _channels_all_waiting(self) -> bool:
        """Every open channel has its one request queued or running: no channel can add rows before an answer."""
        poller = self._poller
        if poller is None:
            return False
        waiting = (self._channel_handed + self._wave_handed + self._lone_handed - self._channel_answered_loop
                   - self._channel_answered_gpu)
        return 0 < len(poller.channels) <= waiting

    @staticmethod
    def _pop_batch(queue: collections.deque[_Request], limit: int) -> tuple[list[_Request], int]:
        """The oldest requests of `queue` up to `limit` rows (at least one), and their rows."""
        batch = [queue.popleft()]
        rows = batch[0].rows
        while queue and rows + queue[0].rows <= limit:
            rows += queue[0].rows
            batch.append(queue.popleft())
        return batch, rows

    def _take(self, key: Any, busy: bool = False) -> list[_Request]:
        """The next batch of `key`'s queue, oldest first; `busy`: a batch is on the device already."""
        queue = self._queues[key]
        limit = self._limit(key)
        if busy and self.cfg.bucket_cut and isinstance(key, tuple) and not _pinned_key(key):
            limit = self._bucket_cut(queue, limit)
        batch, rows = self._pop_batch(queue, limit)
        self._queued_rows[key] -= rows
        if not queue:
            del self._queues[key]
        return batch

    def _bucket_cut(self, queue: collections.deque[_Request], limit: int) -> int:
        """inference.bucket_cut: the rows to take of queued whole searches, cut at a smaller bucket of the ladder
        where that moves more rows per device second, by the mean device time of each bucket so far (a few
        rows past a bucket would otherwise run the next, larger graph, mostly padding). The rest go first in the
        next batch, which launches when the one on the device is done. Unknown times: `limit`."""
        def rows_per_s(rows: int) -> float | None:
            bucket = self.runner.search_bucket(rows)
            seconds = self._mean_gpu_s("search", bucket, min_count=BUCKET_CUT_MIN_COUNT) if bucket else 0.0
            return rows / seconds if seconds else None

        prefixes, rows = [], 0
        for request in queue:
            if rows + request.rows > limit:
                break
            rows += request.rows
            prefixes.append(rows)
        best = rows_per_s(prefixes[-1]) if prefixes else None
        if best is None:
            return limit
        cut = prefixes[-1]
        for rows in prefixes[:-1]:
            rate = rows_per_s(rows)
            if rate is not None and rate > best * BUCKET_CUT_MARGIN:
                cut, best = rows, rate
        return cut

    def _mean_gpu_s(self, kind: str, bucket: int, min_count: int = 1) -> float:
        """Mean device time of `kind` batches in `bucket` so far (0 with fewer than `min_count`)."""
        m = self.metrics.get(f"{kind}/{bucket}")
        return m["gpu_s"] / m["count"] if m and m["count"] >= min_count else 0.0

    def _expected_gpu_s(self, batch: _Batch) -> float:
        """Mean device time of batches like `batch` so far (0 when unknown)."""
        return 0.0 if batch.flight is None else self._mean_gpu_s(batch.kind, batch.flight.bucket)

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        unfinished: collections.deque[_Batch] = collections.deque()  # launched, oldest first; at most one per lane
        fill_until = 0.0  # with batches in flight: gather until shortly before a lane should be free
        while True:
            key = self._oldest_key()
            if key is None:
                if unfinished:
                    done = unfinished.popleft()
                    self._deliver(done, await loop.run_in_executor(self.gpu, self._finish, done))
                    self._batcher_unfinished = len(unfinished)
                    continue
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._fill(key, float("inf") if not unfinished else fill_until)
            requests = self._take(key, busy=bool(unfinished))
            launched, done = await loop.run_in_executor(self.gpu, self._step, key, requests, unfinished)
            # The oldest batches are done, so at most one per lane is left running (none on the CPU, or where
            # nothing else was queued).
            fill_until = (time.perf_counter() + 0.75 * self._expected_gpu_s(launched) / len(self.lanes)
                          if launched is not None else 0.0)
            for batch, results in done:
                self._deliver(batch, results)

    def _step(self, key: Any, requests: list[_Request], unfinished: collections.deque[_Batch]
              ) -> tuple[_Batch | None, list[tuple[_Batch, list]]]:
        """GPU thread: launch the new batch behind the ones in flight, then wait for and unpack the oldest until
        at most one per lane is left (with one lane: the batch that was running); returns the batch launched
        (None when none is left in flight) and the finished (batch, results). `unfinished` is the batcher's,
        which awaits this call. On the CPU a launch computes the batch, so it is finished at once (its answers
        would otherwise wait for the next batch's compute). With nothing queued on the event loop every batch is
        finished here too: the batcher would wait for them next, having nothing to launch, and this saves its
        answers the two thread hops back to the loop and into this thread again (one env's whole search pays
        them on every step)."""
        launched = self._launch(key, requests)
        unfinished.append(launched)
        done = []
        pipelined = self.runner.cuda and self._loop_queued_rows() > 0
        while len(unfinished) > (len(self.lanes) if pipelined else 0):
            oldest = unfinished.popleft()
            done.append((oldest, self._finish(oldest)))
        self._batcher_unfinished = len(unfinished)
        return (launched if unfinished else None), done

    def _pick_lane(self) -> int:
        """The lane for the next whole search: the one with the fewest batches in flight, of those the one whose
        last launch is the oldest (so a search queues behind the one that should end first)."""
        return min(range(len(self.lanes)), key=lambda i: (self._lane_unfinished[i], self._lane_launched[i]))

    def _deliver(self, batch: _Batch, results: list) -> None:
        for request, result in zip(batch.requests, results):
            if request.channel is not None:  # answered into its channel by the GPU thread (_answer_channels)
                continue
            if request.future.done():
                continue
            if isinstance(result, Exception):
                request.future.set_exception(_as_inference_error(batch.kind, result))
            else:
                request.future.set_result(result)

    # -- launch and finish (GPU thread) ---------------------------------------------------------------------

    def _launch(self, key: Any, requests: list[_Request]) -> _Batch:
        start = time.perf_counter()
        kind = key if isinstance(key, str) else "search"
        pinned = _pinned_key(key)
        lane = -1 if pinned else self._pick_lane() if kind == "search" else 0
        batch = _Batch(key, kind, requests, [None] * len(requests), version=self.eval_version if pinned else
                       self.version, launched=start, runner=self.eval_runner if pinned else self.lanes[lane],
                       lane=lane, spin=not self.cfg.sleep_waits)
        if lane >= 0:
            self._lane_unfinished[lane] += 1
            self._lane_launched[lane] = start
            self.lane_batches[lane] += 1
        try:
            if kind == "initial":
                self._launch_initial(batch)
            elif kind == "recurrent":
                self._launch_recurrent(batch)
            else:
                self._launch_search(batch)
        except Exception as error:  # noqa: BLE001 - one bad batch must not kill the actor
            batch.flight = None
            batch.results = [r if isinstance(r, Exception) else error for r in batch.results]
        batch.host_s = time.perf_counter() - start
        if self._trace is not None:
            self._span("queue", min(r.submitted for r in requests), start, "batcher", rows=sum(r.rows for r in requests))
            self._span(f"launch {kind}", start, start + batch.host_s, "gpu thread")
        return batch

    def _launch_recurrent(self, batch: _Batch) -> None:
        payloads = [request.payload for request in batch.requests]
        # Every request's check and new slots at once (a request with a bad handle fails alone).
        answers = self.pool.check_allocate([r.client for r in batch.requests], [p[0] for p in payloads],
                                           [p[2] for p in payloads])
        src, actions = [], []
        for i, slots in enumerate(answers):
            if isinstance(slots, InferenceError):
                batch.results[i] = slots
                continue
            batch.live.append(i)
            batch.handles.append(slots)
            src.append(payloads[i][0])
            actions.append(payloads[i][1])
        if batch.live:
            one = len(batch.live) == 1
            batch.flight = self.runner.launch_recurrent(
                src[0] if one else np.concatenate(src), actions[0] if one else np.concatenate(actions),
                batch.handles[0] if one else np.concatenate(batch.handles))

    def _allocate_all(self, batch: _Batch) -> None:
        for i, request in enumerate(batch.requests):
            try:
                slots = self.pool.allocate(request.client, request.rows)
            except InferenceError as error:
                batch.results[i] = error
                continue
            batch.live.append(i)
            batch.handles.append(slots)

    def _launch_initial(self, batch: _Batch) -> None:
        self._allocate_all(batch)
        if not batch.live:
            return
        obs = [batch.requests[i].payload for i in batch.live]
        dst = np.concatenate(batch.handles)
        if self.cache is None:
            batch.flight = self.runner.launch_initial(obs, dst)
            return
        # Lookups first, then inserts (first occurrence of each missing key), so that a batch's hits never
        # see its own inserts: the device copies hits before inserts, and _finish reads hits before writing.
        keys = [row_key(row) for part in obs for row in part]
        entry = self.cache.lookup(keys)
        hit = entry >= 0
        insert = np.full(len(keys), -1, dtype=np.int64)
        fresh: set[bytes] = set()
        for pos in np.flatnonzero(~hit):
            if keys[pos] not in fresh:
                fresh.add(keys[pos])
                insert[pos] = self.cache.insert(keys[pos])
        inserted = insert >= 0
        parts, offset = [], 0
        for part in obs:
            miss = ~hit[offset:offset + len(part)]
            parts.append(part if miss.all() else part[miss])
            offset += len(part)
        cache_ops = {"hit_src": entry[hit], "hit_dst": dst[hit], "ins_entry": insert[inserted],
                     "ins_slot": dst[inserted]}
        batch.plan = {"keys": keys, "entry": entry, "hit": hit, "insert": insert}
        batch.flight = self.runner.launch_initial(parts, dst[~hit], cache_ops)

    def _launch_search(self, batch: _Batch) -> None:
        batch.live = list(range(len(batch.requests)))
        obs = [r.payload[0] for r in batch.requests]
        masks = [r.payload[1] for r in batch.requests]
        mask = None
        if any(m is not None for m in masks):
            mask = np.concatenate([m if m is not None else np.zeros((len(o), self.num_actions), bool)
                                   for m, o in zip(masks, obs)])
        rows = None
        if batch.key[-1] == "rows":  # a merged batch: each request's settings over its rows
            names = batch.requests[0].payload[2]
            rows = {name: np.concatenate([np.full(len(r.payload[0]), r.payload[2][name], np.float32)
                                          for r in batch.requests]) for name in names}
        batch.flight = (batch.runner or self.runner).launch_search(obs, mask, batch.key[1], rows)

    def _finish(self, batch: _Batch, answer_channels: bool = True) -> list:
        """GPU thread: wait for the batch's outputs and split them into per-request answers (and, with
        answer_channels, write the channel requests' answers)."""
        if batch.lane >= 0:
            self._lane_unfinished[batch.lane] -= 1
        try:
            if batch.flight is not None:
                wait_start = time.perf_counter()
                runner = batch.runner or self.runner
                outputs = runner.wait(batch.flight, batch.spin)
                self.waits["spun" if batch.spin else "slept"] += batch.flight.end is not None
                if self._trace is not None:
                    self._span("wait", wait_start, time.perf_counter(), "gpu thread")
                    span = runner.device_span(batch.flight)
                    if span is not None:
                        f = batch.flight
                        self._span(f"{f.kind} {f.rows}/{f.bucket}{' graph' if f.graph else ''}", *span, "device",
                                   rows=f.rows, bucket=f.bucket)
                if batch.kind == "search":
                    self._split_search(batch, outputs)
                else:
                    self._split_net(batch, outputs)
                self._record(batch)
        except Exception as error:  # noqa: BLE001 - fail this batch's requests, keep serving
            batch.results = [r if r is not None else error for r in batch.results]
        if answer_channels:
            self._answer_channels(batch)
        return batch.results

    def _answer_channels(self, batch: _Batch) -> None:
        """GPU thread: write the answers of the batch's fast-path requests into their channels now."""
        for request, result in zip(batch.requests, batch.results):
            if request.channel is None:
                continue
            if result is _ANSWERED:
                self._channel_answered_gpu += 1
                continue
            if result is None:
                result = InferenceError(f"{batch.kind}: the batch ended without an answer for this request")
            elif isinstance(result, Exception):
                result = _as_inference_error(batch.kind, result)
            try:
                if isinstance(result, Exception):
                    self._gpu_errors += 1
                    request.channel.fail(request.seq, result)
                else:
                    request.channel.reply(request.seq, result)
            except Exception as error:  # noqa: BLE001 - one unwritable answer must not stop the batcher
                request.channel.fail(request.seq, InferenceError(f"{batch.kind}: answer not written: {error}"))
            self._channel_answered_gpu += 1

    def _split_net(self, batch: _Batch, outputs: dict[str, np.ndarray]) -> None:
        out = outputs["out"]
        if batch.plan is None:
            value, reward, logits = out[:, 0], out[:, 1], out[:, 2:]
        else:  # initial with the cache: assemble network rows and cached rows, then store the new entries
            plan, cache = batch.plan, self.cache
            hit, entry, insert = plan["hit"], plan["entry"], plan["insert"]
            value = np.empty(len(hit), np.float32)
            logits = np.empty((len(hit), self.num_actions), np.float32)
            value[~hit], logits[~hit] = out[:, 0], out[:, 2:]
            value[hit], logits[hit] = cache.value[entry[hit]], cache.logits[entry[hit]]
            rows = insert >= 0
            cache.value[insert[rows]] = value[rows]
            cache.logits[insert[rows]] = logits[rows]
            reward = np.zeros(len(hit), np.float32)
        finite = np.isfinite(value) & np.isfinite(logits).all(axis=1)
        all_finite = bool(finite.all())  # one check for the batch; rows per request only when one is not
        offset = 0
        for i, handles in zip(batch.live, batch.handles):
            n = len(handles)
            sl = slice(offset, offset + n)
            offset += n
            if not all_finite and not finite[sl].all():
                batch.results[i] = InferenceError(f"{batch.kind}: the network produced NaN for this request (NaN input?)")
                if batch.plan is not None:
                    for pos in range(sl.start, sl.stop):
                        if batch.plan["insert"][pos] >= 0:
                            self.cache.drop(batch.plan["keys"][pos])
                continue
            request = batch.requests[i]
            if request.channel is not None and batch.plan is None:  # the fast path: one copy into the channel
                try:
                    request.channel.reply_rows(request.seq, out[sl], handles, batch.version)
                    batch.results[i] = _ANSWERED
                except Exception as error:  # noqa: BLE001 - answered as an error by _answer_channels
                    batch.results[i] = InferenceError(f"{batch.kind}: answer not written: {error}")
                continue
            batch.results[i] = {"handles": handles, "value": value[sl].copy(), "reward": reward[sl].copy(),
                                "policy_logits": logits[sl].copy(), "version": batch.version}

    def _split_search(self, batch: _Batch, outputs: dict[str, np.ndarray]) -> None:
        offset = 0
        for i, request in enumerate(batch.requests):
            sl = slice(offset, offset + request.rows)
            offset += request.rows
            answer = {name: array[sl].copy() for name, array in outputs.items()}
            if not (np.isfinite(answer["root_value"]).all() and np.isfinite(answer["action_weights"]).all()):
                batch.results[i] = InferenceError("search: the search produced NaN for this request (NaN input?)")
                continue
            answer["version"] = batch.version
            # Where a caller's wait went (evaluation reports it): queued before launch, and the batch's device time.
            answer["queue_ms"] = 1e3 * (batch.launched - request.submitted)
            answer["device_ms"] = 1e3 * batch.flight.gpu_s if batch.flight is not None else 0.0
            answer["server_ms"] = 1e3 * (time.perf_counter() - request.submitted)  # submitted to answered
            batch.results[i] = answer

    def _record(self, batch: _Batch) -> None:
        flight = batch.flight
        name = f"{batch.kind}/{flight.bucket}"
        wait_s = sum(batch.launched - r.submitted for r in batch.requests)
        with self._metrics_lock:
            m = self.metrics.setdefault(name, {"count": 0, "requests": 0, "rows": 0, "padded": 0, "graph": 0,
                                               "wait_s": 0.0, "gpu_s": 0.0, "host_s": 0.0})
            m["count"] += 1
            m["requests"] += len(batch.requests)
            m["rows"] += flight.rows
            m["padded"] += flight.bucket - flight.rows if flight.graph else 0
            m["graph"] += int(flight.graph)
            m["wait_s"] += wait_s
            m["gpu_s"] += flight.gpu_s
            m["host_s"] += batch.host_s

    def _span(self, name: str, start: float, end: float, thread: str, **args: Any) -> None:
        self._trace.append({"name": name, "ph": "X", "pid": 0, "tid": thread, "ts": (start - self._t0) * 1e6,
                            "dur": max(0.0, end - start) * 1e6, "args": args})
