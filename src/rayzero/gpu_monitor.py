"""GPU utilisation, power and energy of this machine's GPUs, sampled in a background thread.

Its own module because two parts read it: the benches (a row's utilisation and energy per step) and the training
driver, which logs the utilisation of its machine's GPUs with every progress row and says in summary.json where a
run's GPU time went (its start, training, its end). NVML through pynvml, else libnvidia-ml through ctypes, else
`nvidia-smi` polling; on a machine with none of them `available` is False and every reading is empty. A sample is
NVML's utilisation counter (the share of its last sampling period in which a kernel ran), so sampling often reads
most of the time; the mean over several GPUs is their plain mean.
"""

from __future__ import annotations

import ctypes
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

Sample = tuple[float, float, float]
"""(time.monotonic(), utilisation in %, power in W), each the mean (power: the sum) over the monitored GPUs."""


def _nvml_pynvml(indices: list[int] | None) -> tuple[Callable[[], float], Callable[[], float], Callable[[], float], int]:
    import pynvml

    pynvml.nvmlInit()
    indices = list(range(pynvml.nvmlDeviceGetCount())) if indices is None else indices
    if not indices:
        raise OSError("no NVML device")
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
    return (lambda: float(np.mean([pynvml.nvmlDeviceGetUtilizationRates(h).gpu for h in handles])),
            lambda: sum(float(pynvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in handles) / 1e3,
            lambda: sum(float(pynvml.nvmlDeviceGetPowerUsage(h)) for h in handles) / 1e3, len(handles))


def _nvml_ctypes(indices: list[int] | None) -> tuple[Callable[[], float], Callable[[], float], Callable[[], float], int]:
    lib = ctypes.CDLL("libnvidia-ml.so.1")
    if lib.nvmlInit_v2() != 0:
        raise OSError("nvmlInit failed")
    if indices is None:
        count = ctypes.c_uint()
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            raise OSError("no NVML device count")
        indices = list(range(count.value))
    handles = []
    for index in indices:
        handle = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
            raise OSError(f"no NVML device {index}")
        handles.append(handle)
    if not handles:
        raise OSError("no NVML device")

    class Utilization(ctypes.Structure):
        _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]

    def util() -> float:
        values = []
        for handle in handles:
            u = Utilization()
            if lib.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(u)) != 0:
                raise OSError("no utilisation counter")
            values.append(u.gpu)
        return float(np.mean(values))

    def energy() -> float:
        total = 0
        for handle in handles:
            e = ctypes.c_ulonglong()
            if lib.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(e)) != 0:
                raise OSError("no energy counter")
            total += e.value
        return total / 1e3

    def power() -> float:
        total = 0
        for handle in handles:
            p = ctypes.c_uint()
            lib.nvmlDeviceGetPowerUsage(handle, ctypes.byref(p))
            total += p.value
        return total / 1e3

    util()
    try:
        energy()
    except OSError:  # a GPU without the counter (pre-Volta): utilisation and power still come
        energy = None  # type: ignore[assignment]
    return util, energy, power, len(handles)


class GpuMonitor:
    """Samples the utilisation and power of GPU `index` of this machine (None: all of them) every `period_s`
    once started; `read` may be given instead (a function returning (utilisation %, power W)), for a source of
    one's own."""

    def __init__(self, index: int | None = 0, read: Callable[[], tuple[float, float]] | None = None):
        self.index = index
        self.backend = "none"
        self.devices = 0
        self._samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._energy: Callable[[], float] | None = None
        self._read: Callable[[], tuple[float, float]] | None = None
        if read is not None:
            self._read, self.backend, self.devices = read, "given", 1
            return
        indices = None if index is None else [index]
        for backend, probe in (("pynvml", _nvml_pynvml), ("nvml-ctypes", _nvml_ctypes)):
            try:
                util, self._energy, power, self.devices = probe(indices)
            except Exception:  # noqa: BLE001 - fall through to the next backend
                continue
            self._read, self.backend = (lambda u=util, p=power: (u(), p())), backend
            return
        try:
            listed = subprocess.run(["nvidia-smi", "-L"], check=True, capture_output=True, timeout=10, text=True)
            self.devices = 1 if index is not None else max(1, len(listed.stdout.strip().splitlines()))
            self.backend = "nvidia-smi"
        except Exception:  # noqa: BLE001
            self.backend = "none"

    @property
    def available(self) -> bool:
        return self.backend != "none"

    def energy_j(self) -> float | None:
        """The total energy counter in joules (None without NVML's)."""
        if self._energy is None:
            return None
        try:
            return self._energy()
        except Exception:  # noqa: BLE001
            return None

    def start(self, period_s: float = 0.1) -> None:
        with self._lock:
            self._samples = []
        self._stop.clear()
        if self.backend == "nvidia-smi":
            self._thread = threading.Thread(target=self._smi_loop, args=(period_s,), daemon=True, name="gpu-monitor")
        elif self.available:
            self._thread = threading.Thread(target=self._loop, args=(period_s,), daemon=True, name="gpu-monitor")
        if self._thread is not None:
            self._thread.start()

    def _append(self, util: float, power: float) -> None:
        with self._lock:
            self._samples.append((time.monotonic(), util, power))

    def _loop(self, period_s: float) -> None:
        while not self._stop.is_set():
            try:
                self._append(*self._read())
            except Exception:  # noqa: BLE001 - a failed reading is a missing sample
                pass
            self._stop.wait(period_s)

    def _smi_loop(self, period_s: float) -> None:
        ids = [] if self.index is None else [f"--id={self.index}"]
        cmd = ["nvidia-smi", *ids, "--query-gpu=timestamp,utilization.gpu,power.draw", "--format=csv,noheader,nounits",
               f"-lms={max(50, int(period_s * 1e3))}"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        stamp, rows = None, []  # one line per GPU at each timestamp: a sample is their mean
        try:
            for line in proc.stdout:
                if self._stop.is_set():
                    break
                try:
                    when, util, power = (x.strip() for x in line.split(","))
                    row = (float(util), float(power))
                except ValueError:
                    continue
                if when != stamp and rows:
                    self._append(float(np.mean([r[0] for r in rows])), float(sum(r[1] for r in rows)))
                    rows = []
                stamp = when
                rows.append(row)
        finally:
            proc.terminate()
            proc.wait(timeout=5)

    def samples(self, since: float = -np.inf) -> list[Sample]:
        """The samples taken at or after `since` (time.monotonic()), while running or after stop()."""
        with self._lock:
            return [s for s in self._samples if s[0] >= since]

    def stop(self) -> list[Sample]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        return self.samples()

    @staticmethod
    def mean_util(samples: list[Sample], start: float = -np.inf, end: float = np.inf) -> float | None:
        """The mean utilisation (%) of the samples in [start, end] (None if there are none)."""
        window = [s[1] for s in samples if start <= s[0] <= end]
        return float(np.mean(window)) if window else None

    @staticmethod
    def summarize(samples: list[Sample], start: float, end: float) -> dict[str, Any]:
        window = [s for s in samples if start <= s[0] <= end]
        if not window:
            return {"samples": 0}
        utils = np.array([s[1] for s in window])
        powers = np.array([s[2] for s in window])
        return {"samples": len(window), "util_mean": float(utils.mean()), "util_p10": float(np.percentile(utils, 10)),
                "util_min": float(utils.min()), "power_mean_w": float(powers.mean()),
                "energy_from_power_j": float(powers.mean() * (end - start))}
