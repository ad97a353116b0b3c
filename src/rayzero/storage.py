"""Where a run directory lives: a local path, or a URI (s3://, gs://, file://, ...) through fsspec.

Everything is written to a local directory first (checkpoints are built and renamed atomically there), then
mirrored to the URI after each checkpoint and at exit. `--resume` with a URI downloads the run first.
Remote filesystems need their fsspec package (`pip install rayzero[cloud]` brings s3fs and gcsfs).
"""

from __future__ import annotations

import tempfile
from pathlib import Path


def is_uri(path: str) -> bool:
    return "://" in str(path)


class RunStorage:
    def __init__(self, out: str, local_dir: str = ""):
        self.out = str(out)
        self.uri = self.out if is_uri(self.out) else None
        if self.uri is None:
            self.local = Path(self.out)
        else:
            import fsspec

            try:
                self.fs, self.remote = fsspec.core.url_to_fs(self.uri)
            except (ImportError, ValueError) as error:
                raise ValueError(f"cannot open storage {self.uri!r}: {error} (for s3:// or gs:// install "
                                 "rayzero[cloud])") from None
            self.local = Path(local_dir) if local_dir else Path(tempfile.mkdtemp(prefix="rayzero-run-"))
        self.local.mkdir(parents=True, exist_ok=True)

    def fetch(self) -> None:
        """Copy an existing remote run into the local directory (for --resume)."""
        if self.uri is None or not self.fs.exists(self.remote):
            return
        self.fs.get(self.remote.rstrip("/") + "/", str(self.local) + "/", recursive=True)

    def sync(self) -> None:
        """Mirror the local run directory to the URI; checkpoints pruned locally are pruned remotely."""
        if self.uri is None:
            return
        remote = self.remote.rstrip("/")
        self.fs.makedirs(remote, exist_ok=True)
        for path in sorted(self.local.rglob("*")):
            if path.is_file() and ".tmp" not in path.name and not any(p.name.startswith(".tmp") for p in path.parents):
                target = f"{remote}/{path.relative_to(self.local).as_posix()}"
                self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
                self.fs.put_file(str(path), target)
        remote_checkpoints = f"{remote}/checkpoints"
        if self.fs.exists(remote_checkpoints):
            local_names = {p.name for p in (self.local / "checkpoints").iterdir()} if (
                self.local / "checkpoints").exists() else set()
            for entry in self.fs.ls(remote_checkpoints, detail=False):
                name = entry.rstrip("/").rsplit("/", 1)[-1]
                if name.startswith("step_") and name not in local_names:
                    self.fs.rm(entry, recursive=True)
