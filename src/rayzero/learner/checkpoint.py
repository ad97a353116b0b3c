"""Checkpoints on disk: one directory per checkpoint, written atomically, in safe formats.

Layout of RUN_DIR/checkpoints/:
    step_00001000/
        model.safetensors      network weights (safetensors)
        optimizer.pt           optimizer state, loadable with torch.load(weights_only=True)
        state.json             counters (learner steps, weight version, env steps, ...)
        replay.npz             the replay buffer (optional)
        checksums.json         sha256 of every other file, written last
    latest                     name of the newest complete checkpoint

A checkpoint is built in a hidden temporary directory and renamed into place, then `latest` is replaced
atomically, so a crash at any point leaves the previous checkpoint intact and loadable. `latest` checks the
checksums: a checkpoint with a corrupt, truncated or missing file is reported in one line naming the file,
and the previous valid checkpoint is used instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Collection
from pathlib import Path

CHECKPOINTS = "checkpoints"
LATEST = "latest"
CHECKSUMS = "checksums.json"
MODEL = "model.safetensors"
_warned: set[tuple[str, Path]] = set()


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
    """Write state.json and checksums.json, fsync, rename staging into place, point `latest` at it, prune old
    ones."""
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step_{step:08d}"
    try:
        with open(staging / "state.json", "w") as f:
            json.dump(state, f, indent=2)
        sums = {child.name: _sha256(child) for child in sorted(staging.iterdir())
                if child.is_file() and child.name != CHECKSUMS}
        (staging / CHECKSUMS).write_text(json.dumps({"sha256": sums}, indent=2))
        for child in staging.iterdir():
            if child.is_file():
                with open(child, "rb") as f:
                    os.fsync(f.fileno())
    except OSError as error:  # e.g. the disk is full: drop the partial checkpoint, keep the previous one
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"could not write checkpoint {str(final)!r} ({error}); the previous checkpoint "
                              "stays valid") from None
    if final.exists():
        shutil.rmtree(final)
    os.rename(staging, final)
    try:
        tmp_latest = root / (LATEST + ".tmp")
        tmp_latest.write_text(final.name + "\n")
        os.replace(tmp_latest, root / LATEST)
        _fsync_dir(root)
    except OSError as error:  # `latest` still names the previous checkpoint, which is still valid
        raise CheckpointError(f"could not point {str(root / LATEST)!r} at {final.name} ({error}); the previous "
                              "checkpoint stays the latest") from None
    complete = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify(checkpoint: Path, files: Collection[str] | None = None) -> None:
    """Check every file of a checkpoint (or only `files`, e.g. the weights alone for an evaluation: a copy of a
    run's checkpoint without its GBs of replay snapshot) against its checksums.json; a CheckpointError names the
    first bad file. Checkpoints written before checksums existed (no checksums.json) pass unchecked."""
    sums_path = checkpoint / CHECKSUMS
    if not sums_path.exists():
        return
    try:
        sums = json.loads(sums_path.read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"checkpoint {str(checkpoint)!r}: {CHECKSUMS} is unreadable ({error})") from None
    for name, digest in sums.items():
        if files is not None and name not in files:
            continue
        path = checkpoint / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {str(checkpoint)!r}: {name} is missing")
        if _sha256(path) != digest:
            raise CheckpointError(f"checkpoint {str(checkpoint)!r}: {name} is corrupt (its sha256 does not match "
                                  f"{CHECKSUMS}; truncated or half-written?)")


def _check(checkpoint: Path, files: Collection[str] | None = None) -> None:
    if not (checkpoint / "state.json").exists():
        raise CheckpointError(f"checkpoint {str(checkpoint)!r} is incomplete or missing (no state.json)")
    verify(checkpoint, files)


def latest(run_dir: str | os.PathLike, files: Collection[str] | None = None) -> Path:
    """The newest complete, valid checkpoint of a run dir (or the path of a checkpoint dir itself, checked).

    If the checkpoint `latest` names is missing or fails its checksums, one warning line names the bad file
    and the newest older valid checkpoint is used; a CheckpointError lists every problem when none is valid.
    `files`: only these of its files need to be there and valid (default: all of them).
    """
    path = Path(run_dir)
    if (path / "state.json").exists():
        verify(path, files)
        return path
    root = path / CHECKPOINTS
    pointer = root / LATEST
    if not pointer.exists():
        raise CheckpointError(f"no checkpoint found in {str(path)!r} (expected {str(pointer)!r})")
    named = root / pointer.read_text().strip()
    older = sorted((p for p in root.glob("step_*") if p.is_dir() and p.name < named.name), reverse=True)
    problems = []
    for candidate in (named, *older):
        try:
            _check(candidate, files)
        except CheckpointError as error:
            problems.append(str(error))
            continue
        if problems and (problems[0], candidate) not in _warned:  # once per process (resume checks twice)
            _warned.add((problems[0], candidate))
            print(f"rayzero: warning: {problems[0]}; using the previous valid checkpoint {str(candidate)!r}",
                  file=sys.stderr, flush=True)
        return candidate
    raise CheckpointError(f"no valid checkpoint in {str(root)!r} ({str(pointer)!r} names {named.name!r}): "
                          + "; ".join(problems))


def read_state(checkpoint: Path) -> dict:
    try:
        return json.loads((checkpoint / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"checkpoint {str(checkpoint)!r} has an unreadable state.json: {error}") from None
