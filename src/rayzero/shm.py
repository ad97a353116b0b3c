"""Arrays in node-local shared memory (/dev/shm): the replay's observations and the inference channels.

The replay actor creates each shared array as a `.npy` file in /dev/shm (self-describing: a learner opens it
with the path alone; mode 0600, so only the same user's processes can), maps it, keeps a descriptor open and unlinks the name at once. Learners open it as
`/proc/<replay pid>/fd/<descriptor>` and map it read-only. So the memory goes back to the system when the
replay process and the learners that mapped it are gone, however they end (Ray kills actors without running
exit handlers). A file left by a process killed between creating and unlinking it (`rayzero-<pid>-...`) is
removed by the next replay that starts on the node.
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid
import warnings
import weakref
from pathlib import Path

import numpy as np

SHM_DIR = Path("/dev/shm")
PREFIX = "rayzero-"


def pid_alive(pid: int) -> bool:
    """Whether process `pid` (of this machine) still runs; one that ended and waits to be reaped (a zombie) does
    not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def remove_stale(directory: Path = SHM_DIR) -> int:
    """Delete shared arrays whose owner process is gone; returns how many were removed."""
    removed = 0
    if not directory.is_dir():
        return 0
    for path in directory.glob(PREFIX + "*.npy"):
        try:
            pid = int(path.name[len(PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if not pid_alive(pid):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def _unlink(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


def _close(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def create(owner: object, specs: dict[str, tuple[tuple[int, ...], np.dtype]],
           directory: Path = SHM_DIR, what: str = "replay.shared_obs",
           ) -> tuple[dict[str, np.ndarray], dict[str, str]] | None:
    """Zeroed shared arrays {tag: (shape, dtype)} owned by `owner` (their descriptors close with it), and the
    paths other processes of this node open them by; None if /dev/shm cannot hold them (the caller then keeps
    private arrays). `what` names the feature in warnings."""
    if not directory.is_dir():
        return None
    remove_stale(directory)
    need = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in specs.values())
    free = shutil.disk_usage(directory).free
    if need > 0.9 * free:
        warnings.warn(f"{what}: {directory} has {free / 2**30:.1f} GiB free, {need / 2**30:.1f} GiB "
                      "are needed; falling back to private memory", stacklevel=2)
        return None
    token = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    names: list[str] = []
    fds: list[int] = []
    arrays: dict[str, np.ndarray] = {}
    paths: dict[str, str] = {}
    try:
        for tag, (shape, dtype) in specs.items():
            name = str(directory / f"{token}-{tag}.npy")
            # Owner-only (0600) from the start: other users of the node can neither read nor write it.
            os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
            names.append(name)
            arrays[tag] = np.lib.format.open_memmap(name, mode="w+", dtype=dtype, shape=shape)
            fds.append(os.open(name, os.O_RDONLY))
            paths[tag] = f"/proc/{os.getpid()}/fd/{fds[-1]}"
    except OSError as error:
        _close(fds)
        warnings.warn(f"{what}: could not create shared arrays in {directory} ({error}); "
                      "falling back to private memory", stacklevel=2)
        return None
    finally:
        _unlink(names)
    weakref.finalize(owner, _close, fds)
    return arrays, paths


# numpy reads a .npy header with ast.literal_eval, and CPython 3.11's AST constructor is not thread-safe: threads
# opening maps at once failed with "SystemError: AST constructor recursion depth mismatch" (an inference channel
# test, twelve clients opening in threads). Opening is rare; the lock costs nothing after.
_OPEN_LOCK = threading.Lock()


def open_map(path: str, mode: str) -> np.ndarray:
    """np.load(path, mmap_mode=mode) of a shared array, one thread at a time (see _OPEN_LOCK)."""
    with _OPEN_LOCK:
        return np.load(path, mmap_mode=mode)


def open_readonly(path: str) -> np.ndarray:
    """Map a shared array created by `create` (read-only)."""
    return open_map(path, "r")
