"""Messages of the driver and of every role, through `logging`, in one format.

rayzero's roles run in processes that it does not start itself (Ray workers), so the first `logger()` call of
a process gives the `rayzero` logger its handler: stderr, INFO and above, `HH:MM:SS rayzero.<module>: message`.
Ray forwards a worker's stderr to the driver. Command results (the CLI's summary line) are not messages: the
CLI prints them to stdout.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"


def first_line(error: BaseException, limit: int | None = None, empty: str = "") -> str:
    """The first line of an error's message, cut to `limit` characters; `empty` when it has none."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else empty


def logger(name: str) -> logging.Logger:
    """The logger of module `name` (pass `__name__`), under the `rayzero` logger."""
    root = logging.getLogger("rayzero")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False  # a host application's root handlers would print every message twice
    return logging.getLogger(name)
