"""Resident memory of a training run's processes over time, from /proc (Linux).

    python3 scripts/memory_watch.py --out mem.jsonl --seconds 1260 --every 15 [--table]
    python3 scripts/memory_watch.py --report mem.jsonl

Every `--every` seconds it writes one row: the RSS (MiB) of each Ray actor process, keyed by its actor class
(`ray::Learner`, `ray::_RemoteSelfPlay`, ...; several of a class are summed and counted), of the driver
(`rayzero train`), and the size of /dev/shm. `--report` prints each key's RSS at 2 and 10 minutes and at the end,
and its growth per minute over the second half of the run: the figure a memory leak shows in.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict


def _processes() -> dict[str, list[float]]:
    found: dict[str, list[float]] = defaultdict(list)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{pid}/status") as f:
                rss = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0) / 1024
        except OSError:
            continue
        if cmd.startswith("ray::"):
            key = cmd.split()[0].split(".")[0]
            if key in ("ray::IDLE", "ray::"):
                continue
        elif "rayzero" in cmd and " train" in cmd:
            key = "driver"
        elif "raylet" in cmd or "gcs_server" in cmd:
            key = "ray-system"
        else:
            continue
        found[key].append(rss)
    return found


def _shm_mib() -> float:
    total = 0
    for name in os.listdir("/dev/shm"):
        try:
            total += os.stat(os.path.join("/dev/shm", name)).st_blocks * 512
        except OSError:
            pass
    return total / 2**20


def watch(out: str, seconds: float, every: float) -> None:
    start = time.time()
    with open(out, "w") as f:
        while time.time() - start < seconds:
            row = {"t": round(time.time() - start, 1), "shm": round(_shm_mib(), 1)}
            for key, values in _processes().items():
                row[key] = round(sum(values), 1)
                row[key + "#"] = len(values)
            f.write(json.dumps(row) + "\n")
            f.flush()
            time.sleep(every)


def report(path: str) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    end = rows[-1]["t"]
    keys = sorted({k for r in rows for k in r if k != "t" and not k.endswith("#")})

    def at(key: str, t: float) -> float | None:
        before = [r for r in rows if r["t"] <= t and key in r]
        return before[-1][key] if before else None

    print(f"{'process':28s} {'count':>5s} {'2 min':>8s} {'10 min':>8s} {'end':>8s} {'MiB/min, 2nd half':>18s}")
    for key in keys:
        half = [r for r in rows if r["t"] >= end / 2 and key in r]
        slope = (half[-1][key] - half[0][key]) / max(1e-9, (half[-1]["t"] - half[0]["t"]) / 60) if len(half) > 1 else 0
        count = max((r.get(key + "#", 1) for r in rows if key in r), default=1)
        cells = [at(key, 120), at(key, 600), at(key, end)]
        print(f"{key:28s} {count:5d} " + " ".join(f"{c:8.1f}" if c is not None else f"{'-':>8s}" for c in cells)
              + f" {slope:18.2f}")
    print(f"({len(rows)} samples over {end / 60:.1f} min; RSS in MiB, several processes of one class summed)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="mem.jsonl")
    parser.add_argument("--seconds", type=float, default=1260)
    parser.add_argument("--every", type=float, default=15)
    parser.add_argument("--report", default=None)
    args = parser.parse_args()
    if args.report:
        report(args.report)
    else:
        watch(args.out, args.seconds, args.every)


if __name__ == "__main__":
    main()
