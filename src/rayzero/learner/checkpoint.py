"""Checkpoints on disk: one directory per checkpoint, written atomically, in safe formats.

Layout of RUN_DIR/checkpoints/:
    step_00001000/
        model.safetensors      network weights (safetensors)
        optimizer.pt           optimizer state, loadable with torch.load(weights_only=True)
        state.json             counters (learner steps, weight version, env steps, ...)
        replay.npz             the replay buffer (optional)
    latest                     name of the newest complete checkpoint

A checkpoint is built in a hidden temporary directory and renamed into place, then `latest` is replaced
atomically, so a crash at any point leaves the previous checkpoint intact and loadable.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

CHECKPOINTS = "checkpoints"
LATEST = "latest"


class CheckpointError(ValueError):
    """A checkpoint is missing or unreadable."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def staging_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """A fresh temporary directory to write checkpoint files into."""
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step_{step:08d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def commit(run_dir: str | os.PathLike, staging: Path, step: int, state: dict, keep: int = 3) -> Path:
    """Write state.json, fsync, rename staging into place, point `latest` at it, prune old ones."""
    root = Path(run_dir) / CHECKPOINTS
    with open(staging / "state.json", "w") as f:
        json.dump(state, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    for child in staging.iterdir():
        with open(child, "rb") as f:
            os.fsync(f.fileno())
    final = root / f"step_{step:08d}"
    if final.exists():
        shutil.rmtree(final)
    os.rename(staging, final)
    tmp_latest = root / (LATEST + ".tmp")
    tmp_latest.write_text(final.name + "\n")
    os.replace(tmp_latest, root / LATEST)
    _fsync_dir(root)
    complete = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(run_dir: str | os.PathLike) -> Path:
    """The newest complete checkpoint of a run dir (or the path of a checkpoint dir itself)."""
    path = Path(run_dir)
    if (path / "state.json").exists():
        return path
    root = path / CHECKPOINTS
    pointer = root / LATEST
    if not pointer.exists():
        raise CheckpointError(f"no checkpoint found in {str(path)!r} (expected {str(pointer)!r})")
    target = root / pointer.read_text().strip()
    if not (target / "state.json").exists():
        raise CheckpointError(f"checkpoint {str(target)!r} named by {str(pointer)!r} is incomplete or missing")
    return target


def read_state(checkpoint: Path) -> dict:
    try:
        return json.loads((checkpoint / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"checkpoint {str(checkpoint)!r} has an unreadable state.json: {error}") from None
