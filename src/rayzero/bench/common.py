"""What every benchmark records next to its figures: machine, versions, date, and the JSON writer."""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"hostname": socket.gethostname(), "cpus": os.cpu_count(), "platform": platform.platform(),
                            "processor": platform.processor()}
    try:
        import torch

        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    return info


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "ray", "gymnasium", "ale_py", "numpy", "numba", "triton", "jax", "mctx"):
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", "?")
        except Exception:  # noqa: BLE001 - absent or broken optional packages are simply not listed
            continue
    return out


def write_json(path: str | None, name: str, results: dict[str, Any]) -> dict[str, Any]:
    document = {"benchmark": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "machine": machine(), "versions": versions(), **results}
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(document, indent=2))
        print(f"wrote {path}")
    return document
