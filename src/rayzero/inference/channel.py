"""Shared-memory request channels between the inference actor and clients on its node.

A Ray actor call costs the actor a task: a gRPC message, deserialisation, a coroutine, a serialised answer (into
the object store when it is over 100 KB). At thousands of requests per second that host work, not the GPU, bounds
the actor (docs/benchmarks.md). A client on the actor's node can instead open a channel: a few arrays in /dev/shm
that both processes map (shm.py makes them; the memory goes back when both are gone, however they end).

Layout of one channel (R = max_rows, O = obs_rows, A = actions):
  header int64 [10]: request sequence, answered sequence, kind, rows, store flag, status, version, closed flag,
    and a whole search's queue and device time (microseconds)
  handles, actions int64 [R]; obs [O, *obs_shape] (initial requests; O may be 0)
  out float32 [R, 2 + A] (value, reward, policy logits); out_handles int64 [R]; error uint8 [ERROR_BYTES]

Whole searches (kind SEARCH) carry their roots' observations in `obs` and the visit temperature in the store
slot (in millionths), or GREEDY there for a greedy search (temperature 0 and no root noise: an evaluation's);
the answer's `out` rows are (root value, action, action weights [A]).

Protocol (one request in flight per channel): the client writes the payload, then kind/rows/store, then bumps
the request sequence; the actor's poller thread sees the new sequence and hands every request of one sweep over
all channels to the server at once (recurrent waves go to the server's wave queue, not its event loop: server.py);
the answer is written into the channel, then the answered sequence is set. Only the sequence numbers order the two sides,
which relies on stores becoming visible in program order (x86-64); elsewhere clients use Ray calls.
"""

from __future__ import annotations

import os
import platform
import select
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from rayzero import shm
from rayzero.inference.errors import InferenceError, InferenceOverloaded

HEADER = 11
REQ, DONE, KIND, ROWS, STORE, STATUS, VERSION, CLOSED, QUEUE_US, DEVICE_US, SERVER_US = range(HEADER)
INITIAL, RECURRENT, SEARCH = 1, 2, 3
TEMPERATURE_SCALE = 1_000_000  # a search's temperature travels as an integer number of millionths
GREEDY = -1  # the store slot of a greedy whole search (evaluation: temperature 0, no root noise)
GREEDY_OVERRIDES = {"temperature": 0.0, "dirichlet_fraction": 0.0, "gumbel_scale": 0.0}
OVERLOADED = 2  # STATUS of a request refused by backpressure (1: any other error)
ERROR_BYTES = 1024
ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")
POLL_TIMER_SLACK_NS = 1000
"""Timer slack of the poller thread and of a client's waiting thread: Linux lets a sleep end up to the thread's slack
late (50 us by default), so 20 us sweeps would come every ~70 us, and each channel request would wait that much
longer."""
DOORBELL_WAIT_S = 0.05
"""With two or more requests in flight the poller sleeps on its doorbell (clients write a byte to it after each
request) for up to this long, rather than sweeping every `sleep_s`."""
_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30
_fine_sleeps = threading.local()  # `set`: this client thread's timer slack is POLL_TIMER_SLACK_NS already


def set_timer_slack(ns: int) -> int | None:
    """Set the calling thread's timer slack (Linux prctl) to `ns` nanoseconds; returns the slack now in force, or
    None where it cannot be set (not Linux, no libc)."""
    if not os.path.exists("/proc/self/timerslack_ns"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_TIMERSLACK, int(ns), 0, 0, 0) != 0:
            return None
        return int(libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0))
    except (OSError, AttributeError):
        return None


def specs(max_rows: int, obs_rows: int, obs_shape: tuple[int, ...], obs_dtype: np.dtype,
          num_actions: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    out = {"header": ((HEADER,), np.dtype(np.int64)), "handles": ((max_rows,), np.dtype(np.int64)),
           "actions": ((max_rows,), np.dtype(np.int64)), "out": ((max_rows, 2 + num_actions), np.dtype(np.float32)),
           "out_handles": ((max_rows,), np.dtype(np.int64)), "error": ((ERROR_BYTES,), np.dtype(np.uint8))}
    if obs_rows:
        out["obs"] = ((obs_rows, *obs_shape), np.dtype(obs_dtype))
    return out


def process_token(pid: int) -> str | None:
    """Something that stays the same while process `pid` (on this node) lives: its start time from /proc on
    Linux (a reused pid gets another), else "alive"; None when there is no such process or it is a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ... starttime at 19
        return None if fields[0] in ("Z", "X") else fields[19]
    except FileNotFoundError:
        return None
    except OSError:  # no /proc: a signal 0 says whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "alive"


class ServerChannel:
    """The actor's side of one client's channel; `pid`: the client's process, if it said (the poller then closes
    the channel, and the server frees the client's latent slots, soon after that process ends)."""

    def __init__(self, client: str, arrays: dict[str, np.ndarray], owner: object = None, pid: int | None = None):
        self.client = client
        # Plain ndarray views: slicing a np.memmap runs Python code (__array_finalize__) on every access.
        self.arrays = {tag: array.view(np.ndarray) for tag, array in arrays.items()}
        self.owner = owner  # the shared arrays' descriptors close when it goes
        self.header = self.arrays["header"]
        self.seen = int(self.header[REQ])
        self.last_active = time.monotonic()
        self.pid = pid
        self.token = process_token(pid) if pid is not None else None

    def client_gone(self) -> bool:
        return self.pid is not None and process_token(self.pid) != self.token

    def request(self) -> tuple[int, int, Any]:
        """(kind, rows, payload) of the request just seen; the payload views the channel."""
        h, a = self.header, self.arrays
        kind, rows = int(h[KIND]), int(h[ROWS])
        if kind == RECURRENT:
            return kind, rows, (a["handles"][:rows], a["actions"][:rows], bool(h[STORE]))
        if kind == INITIAL and "obs" in a:
            return kind, rows, a["obs"][:rows]
        if kind == SEARCH and "obs" in a:
            store = int(h[STORE])
            if store == GREEDY:
                return kind, rows, (a["obs"][:rows], 0.0, True)
            return kind, rows, (a["obs"][:rows], store / TEMPERATURE_SCALE, False)
        return kind, rows, None

    def reply(self, seq: int, answer: dict[str, Any]) -> None:
        out = self.arrays["out"]
        if "action_weights" in answer:  # a whole search
            n = len(answer["action"])
            out[:n, 0] = answer["root_value"]
            out[:n, 1] = answer["action"]
            out[:n, 2:] = answer["action_weights"]
            self.header[QUEUE_US] = int(1e3 * answer.get("queue_ms", 0.0))
            self.header[DEVICE_US] = int(1e3 * answer.get("device_ms", 0.0))
            self.header[SERVER_US] = int(1e3 * answer.get("server_ms", 0.0))
        else:
            n = len(answer["value"])
            out[:n, 0] = answer["value"]
            out[:n, 1] = answer["reward"]
            out[:n, 2:] = answer["policy_logits"]
            self.arrays["out_handles"][:n] = answer["handles"]
        self.header[VERSION] = answer["version"]
        self.header[STATUS] = 0
        self.header[DONE] = seq

    def reply_rows(self, seq: int, rows: np.ndarray, handles: np.ndarray, version: int) -> None:
        """Answer a recurrent request with the batch's packed output rows [n, 2 + A] (value, reward, logits: the
        channel's own layout) in one copy."""
        n = len(rows)
        self.arrays["out"][:n] = rows
        self.arrays["out_handles"][:n] = handles
        self.header[VERSION] = version
        self.header[STATUS] = 0
        self.header[DONE] = seq

    def fail(self, seq: int, error: BaseException) -> None:
        text = (str(error) or type(error).__name__).encode()[:ERROR_BYTES]
        buffer = self.arrays["error"]
        buffer[:] = 0
        buffer[:len(text)] = np.frombuffer(text, np.uint8)
        self.header[STATUS] = OVERLOADED if isinstance(error, InferenceOverloaded) else 1
        self.header[DONE] = seq

    def close(self) -> None:
        self.header[CLOSED] = 1


class Poller:
    """A thread that watches every open channel and hands the new requests of each sweep to
    `on_requests([(channel, seq), ...])` at once (called on this thread; the server validates recurrent waves
    here and queues them for its GPU thread). A sweep with no new request calls `on_idle()` (if given; the
    server's wave queue uses it for max_wait deadlines): while it returns True the poller does not back off.
    Once a second it closes the channels of clients
    whose process ended (then calls `on_gone(client)`) and those idle longer than `idle_timeout_s` (if > 0): a
    client that comes back opens a new one. It sweeps every `sleep_s` while requests come, and backs off to
    `idle_sleep_s` once none has come, and none has been in flight, for `idle_after_s` (self-play held back by the
    replay ratio leaves every channel quiet for seconds, and a spinning sweep takes a core and the actor's GIL; a
    client waiting on a search longer than that sends its next request right after the answer).

    The doorbell (Linux): a pipe that clients open as `doorbell_path` and write a byte to after each request. The
    poller's sleeps end at a ring, and with two or more requests in flight (many clients: a GPU host's self-play)
    it sleeps on the doorbell alone, up to DOORBELL_WAIT_S, instead of sweeping every `sleep_s`: tens of thousands
    of wake-ups a second, each taking the actor's GIL and part of a core. With one request in flight (one env, an
    evaluation alone) it keeps its fast sweeps, as one env's latency was measured with them."""

    def __init__(self, on_requests: Callable[[list[tuple[ServerChannel, int]]], None], idle_timeout_s: float = 0.0,
                 sleep_s: float = 20e-6, on_gone: Callable[[str], None] | None = None, idle_after_s: float = 0.005,
                 idle_sleep_s: float = 500e-6, on_idle: Callable[[], bool] | None = None, doorbell: bool = True):
        self.on_requests = on_requests
        self.on_gone = on_gone
        self.on_idle = on_idle
        self.idle_timeout_s = idle_timeout_s
        self.sleep_s = sleep_s
        self.idle_after_s, self.idle_sleep_s = idle_after_s, idle_sleep_s
        self.channels: dict[str, ServerChannel] = {}
        self.timer_slack_ns: int | None = None  # the poller thread's, once it runs (None: left as it was)
        self.sweeps = 0  # how many sweeps the poller has made
        self.doorbell_path, self._bell = None, None
        if doorbell:
            self.doorbell_path, self._bell = _doorbell()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="inference-channels", daemon=True)
        self._thread.start()

    def add(self, channel: ServerChannel) -> None:
        with self._lock:
            old = self.channels.pop(channel.client, None)
            if old is not None:
                old.close()
            self.channels[channel.client] = channel

    def remove(self, client: str) -> bool:
        with self._lock:
            channel = self.channels.pop(client, None)
        if channel is not None:
            channel.close()
        return channel is not None

    def _drop(self, channel: ServerChannel) -> None:
        """Close `channel` if it is still its client's (the client may have opened a new one meanwhile)."""
        with self._lock:
            if self.channels.get(channel.client) is channel:
                del self.channels[channel.client]
        channel.close()

    def _run(self) -> None:
        self.timer_slack_ns = set_timer_slack(POLL_TIMER_SLACK_NS)  # sleeps of sleep_s, not sleep_s + 50 us
        last_sweep = last_request = time.monotonic()
        while True:  # a daemon thread: it ends with the actor's process
            with self._lock:
                channels = list(self.channels.values())
            new = []
            now = time.monotonic()
            self.sweeps += 1
            for channel in channels:
                seq = int(channel.header[REQ])
                if seq != channel.seen:
                    channel.seen = seq
                    channel.last_active = now
                    new.append((channel, seq))
            if new:
                last_request = now
                try:
                    self.on_requests(new)
                except Exception as error:  # noqa: BLE001 - these requests fail, the poller goes on
                    for channel, seq in new:
                        if int(channel.header[DONE]) != seq:
                            channel.fail(seq, InferenceError(f"channel: {type(error).__name__}: {error}"))
            now = time.monotonic()
            if now - last_sweep > 1.0:
                last_sweep = now
                for channel in channels:
                    if channel.client_gone():
                        if self.on_gone is not None:
                            try:
                                self.on_gone(channel.client)
                            except Exception:  # noqa: BLE001 - clean-up of a gone client; the poller goes on
                                pass
                        self._drop(channel)
                    elif (self.idle_timeout_s > 0 and now - channel.last_active > self.idle_timeout_s
                          and channel.seen == int(channel.header[DONE])):
                        self._drop(channel)
            if not new:
                busy = False
                if self.on_idle is not None:
                    try:
                        busy = bool(self.on_idle())
                    except Exception:  # noqa: BLE001 - the poller goes on
                        pass
                in_flight = sum(channel.seen != int(channel.header[DONE]) for channel in channels)
                if in_flight:
                    last_request = now  # a request in flight: its client comes back right after the answer
                idle = not busy and now - last_request > self.idle_after_s
                if self._bell is not None and not busy and in_flight >= 2:
                    self._sleep(DOORBELL_WAIT_S)
                else:
                    self._sleep(self.idle_sleep_s if idle else self.sleep_s)

    def _sleep(self, seconds: float) -> None:
        """Sleep for `seconds`, or until a client rings the doorbell (then empty it)."""
        if self._bell is None:
            time.sleep(seconds)
            return
        if select.select([self._bell], [], [], seconds)[0]:
            try:
                while os.read(self._bell, 65536):
                    pass
            except BlockingIOError:
                pass


def _doorbell() -> tuple[str | None, int | None]:
    """A pipe the poller sleeps on: (the path clients of this node open its write end by, its read end), or (None,
    None) where there is none (no /proc: the poller then sweeps on its timer alone). Both ends stay open with the
    process, so a reader never sees the end of the pipe."""
    if not os.path.isdir(f"/proc/{os.getpid()}/fd"):
        return None, None
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    return f"/proc/{os.getpid()}/fd/{write}", read


class InferenceClient:
    """A client of the inference actor: `initial` and `recurrent` as the actor's methods, through a shared-memory
    channel when the client runs on the actor's node (else, and for requests larger than the channel, or with
    arrays of another dtype than the channel's, through Ray calls that validate them).

    server: the actor handle; client_id: the client's name for latent slots; max_rows / obs_rows: the largest
    recurrent / initial request the channel carries; channel=False: Ray calls only.
    """

    def __init__(self, server: Any, client_id: str, max_rows: int, obs_rows: int = 0, channel: bool = True,
                 timeout_s: float = 300.0):
        self.server = server
        self.client_id = client_id
        self.max_rows, self.obs_rows = int(max_rows), int(obs_rows)
        self.timeout_s = timeout_s
        self.arrays: dict[str, np.ndarray] | None = None
        self._bell: int | None = None  # the write end of the poller's doorbell
        self._inflight: tuple[Any, np.ndarray, float, bool] | None = None  # (sequence or ObjectRef, obs,
        # temperature, greedy)
        # of the search that submit_search sent and wait_search collects
        if channel and ORDERED_STORES:
            self._open()

    @property
    def transport(self) -> str:
        return "channel" if self.arrays is not None else "ray"

    def _open(self) -> None:
        import ray

        here = ray.get_runtime_context().get_node_id()
        info = ray.get(self.server.open_channel.remote(self.client_id, self.max_rows, self.obs_rows, here,
                                                       os.getpid()))
        if info is None:  # another node, channels off, or no room in /dev/shm
            self.arrays = None
            return
        # Plain ndarray views of the maps (a np.memmap's slicing runs Python code on every access).
        self.arrays = {tag: shm.open_map(path, "r+").view(np.ndarray) for tag, path in info["paths"].items()}
        self._ring_off()
        if info.get("doorbell"):  # a poller asleep on its doorbell hears only clients that ring it: else Ray calls
            try:
                self._bell = os.open(info["doorbell"], os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                self.close()

    def close(self) -> None:
        import ray

        self._ring_off()
        if self.arrays is not None:
            self.arrays = None
            ray.get(self.server.close_channel.remote(self.client_id))

    def _ring_off(self) -> None:
        if self._bell is not None:
            os.close(self._bell)
            self._bell = None

    # -- requests ------------------------------------------------------------------------------------------

    def initial(self, obs: np.ndarray) -> dict[str, Any]:
        return self._patient(self._initial, obs)

    def recurrent(self, handles: np.ndarray, actions: np.ndarray, store: bool = True) -> dict[str, Any]:
        return self._patient(self._recurrent, handles, actions, store)

    def _patient(self, send: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
        """Backpressure: a request the actor refused as overloaded is sent again after a pause (1 ms, doubling
        up to 50 ms), until timeout_s; so clients block, not fail, while the actor's queues are full."""
        deadline = time.monotonic() + self.timeout_s
        pause = 1e-3
        while True:
            try:
                return send(*args)
            except InferenceOverloaded:
                if time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
                pause = min(2 * pause, 0.05)

    def _initial(self, obs: np.ndarray) -> dict[str, Any]:
        obs = np.asarray(obs)
        a = self.arrays
        if a is None or "obs" not in a or obs.ndim != a["obs"].ndim or obs.shape[1:] != a["obs"].shape[1:] \
                or obs.dtype != a["obs"].dtype or not 0 < len(obs) <= self.obs_rows:
            import ray

            return ray.get(self.server.initial.remote(self.client_id, obs))
        a["obs"][:len(obs)] = obs
        return self._request(INITIAL, len(obs), False, lambda: self._initial(obs))

    def _recurrent(self, handles: np.ndarray, actions: np.ndarray, store: bool = True) -> dict[str, Any]:
        handles, actions = np.asarray(handles), np.asarray(actions)
        a = self.arrays
        if a is None or handles.ndim != 1 or actions.shape != handles.shape or handles.dtype.kind not in "iu" \
                or actions.dtype.kind not in "iu" or not 0 < len(handles) <= self.max_rows:
            import ray

            return ray.get(self.server.recurrent.remote(self.client_id, handles, actions, store))
        n = len(handles)
        a["handles"][:n] = handles
        a["actions"][:n] = actions
        return self._request(RECURRENT, n, store, lambda: self._recurrent(handles, actions, store))

    def search(self, obs: np.ndarray, temperature: float, greedy: bool = False) -> dict[str, Any]:
        """A whole search for len(obs) roots: action [B] int64, action_weights [B, A], root_value [B], version.
        greedy: temperature 0 and no root noise (an evaluation's search; `temperature` is then ignored)."""
        self.submit_search(obs, temperature, greedy)
        return self.wait_search()

    def submit_search(self, obs: np.ndarray, temperature: float, greedy: bool = False) -> None:
        """Send a whole search and return at once; `wait_search` gets its answer (one in flight per client)."""
        if self._inflight is not None:
            raise InferenceError(f"{self.client_id}: a search is already in flight on this client")
        obs = np.asarray(obs)
        if self.arrays is not None and self.arrays["header"][CLOSED]:  # dropped by the actor: open a new one
            self._open()
        a = self.arrays
        if a is None or a["header"][CLOSED] or "obs" not in a or obs.ndim != a["obs"].ndim \
                or obs.shape[1:] != a["obs"].shape[1:] or obs.dtype != a["obs"].dtype \
                or not 0 < len(obs) <= self.obs_rows or not 0 <= temperature < 1e6:
            overrides = GREEDY_OVERRIDES if greedy else {"temperature": temperature}
            self._inflight = (self.server.search.remote(self.client_id, obs, **overrides), obs, temperature, greedy)
            return
        a["obs"][:len(obs)] = obs
        seq = self._send(SEARCH, len(obs), GREEDY if greedy else int(round(temperature * TEMPERATURE_SCALE)))
        self._inflight = (seq, obs, temperature, greedy)

    def wait_search(self) -> dict[str, Any]:
        """The answer of the search `submit_search` sent; refused as overloaded, it is sent again after a pause
        (as `initial` and `recurrent` are)."""
        if self._inflight is None:
            raise InferenceError(f"{self.client_id}: no search in flight on this client")
        _, obs, temperature, greedy = self._inflight
        try:
            return self._collect_search()
        except InferenceOverloaded:
            return self._patient(self._search_once, obs, temperature, greedy)

    def _search_once(self, obs: np.ndarray, temperature: float, greedy: bool = False) -> dict[str, Any]:
        self.submit_search(obs, temperature, greedy)
        return self._collect_search()

    def _collect_search(self) -> dict[str, Any]:
        request, obs, temperature, greedy = self._inflight
        self._inflight = None
        if not isinstance(request, int):  # a Ray call's ObjectRef
            import ray

            return ray.get(request)
        if not self._wait(request):  # the channel closed under the request: send it again
            return self._search_once(obs, temperature, greedy)
        a = self.arrays
        out = a["out"]
        rows = len(obs)
        h = a["header"]
        return {"action": out[:rows, 1].astype(np.int64), "action_weights": out[:rows, 2:].copy(),
                "root_value": out[:rows, 0].copy(), "version": int(h[VERSION]),
                "queue_ms": int(h[QUEUE_US]) / 1e3, "device_ms": int(h[DEVICE_US]) / 1e3,
                "server_ms": int(h[SERVER_US]) / 1e3}

    def _send(self, kind: int, rows: int, store: int) -> int:
        h = self.arrays["header"]
        h[KIND], h[ROWS], h[STORE] = kind, rows, store
        seq = int(h[REQ]) + 1
        h[REQ] = seq
        if self._bell is not None:
            try:
                os.write(self._bell, b"\1")
            except (BlockingIOError, BrokenPipeError):  # full: the poller wakes anyway; gone: the wait finds out
                pass
        return seq

    def _request(self, kind: int, rows: int, store: bool, again: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        a = self.arrays
        h = a["header"]
        if h[CLOSED]:  # the actor dropped this channel (idle too long): open a new one and send again
            self._open()
            return again()
        seq = self._send(kind, rows, int(store))
        if not self._wait(seq):
            return again()
        out = a["out"]
        return {"handles": a["out_handles"][:rows].copy(), "value": out[:rows, 0].copy(),
                "reward": out[:rows, 1].copy(), "policy_logits": out[:rows, 2:].copy(), "version": int(h[VERSION])}

    def _wait(self, seq: int) -> bool:
        """Wait for the answer to request `seq`: True when it came (an error answer raises), False when the actor
        closed the channel meanwhile (a new one is open then; the caller sends again)."""
        a = self.arrays
        h = a["header"]
        start = time.monotonic()
        next_ping = start + 2.0
        spins = 0
        while h[DONE] != seq:
            spins += 1
            if spins > 100:
                if not getattr(_fine_sleeps, "set", False):  # this thread's 20 us sleeps, not ~70 us
                    set_timer_slack(POLL_TIMER_SLACK_NS)
                    _fine_sleeps.set = True
                time.sleep(20e-6)
                if spins % 1000 == 0:
                    if h[CLOSED]:
                        self._open()
                        return False
                    now = time.monotonic()
                    if now > start + self.timeout_s:
                        raise InferenceError(f"{self.client_id}: no answer from the inference actor through its "
                                             f"channel within {self.timeout_s:.0f} s")
                    if now > next_ping:  # a dead actor raises here (RayActorError), as a Ray call would
                        import ray

                        ray.get(self.server.get_version.remote(), timeout=60)
                        next_ping = time.monotonic() + 2.0
        if h[STATUS]:
            error = InferenceOverloaded if h[STATUS] == OVERLOADED else InferenceError
            raise error(bytes(a["error"]).rstrip(b"\0").decode(errors="replace"))
        return True


def create(client: str, max_rows: int, obs_rows: int, obs_shape: tuple[int, ...],
           obs_dtype: np.dtype, num_actions: int, pid: int | None = None
           ) -> tuple[ServerChannel, dict[str, str]] | None:
    """A new channel in /dev/shm (None if there is no room); the paths the client maps it by."""
    owner = _Owner()
    made = shm.create(owner, specs(max_rows, obs_rows, obs_shape, obs_dtype, num_actions),
                      what="inference channels")
    if made is None:
        return None
    arrays, paths = made
    return ServerChannel(client, arrays, owner, pid), paths


class _Owner:
    """Holds a channel's shared-memory descriptors open (see shm.create)."""
