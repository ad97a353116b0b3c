"""The GPU monitor's sampling and the driver's account of where a run's GPU time went (summary.json's `gpu`)."""

import itertools
import time

import pytest

from rayzero.gpu_monitor import GpuMonitor
from rayzero.train import gpu_phases


def test_a_monitor_samples_its_source_until_stopped():
    values = itertools.cycle([(10.0, 100.0), (90.0, 300.0)])
    monitor = GpuMonitor(read=lambda: next(values))
    assert monitor.available and monitor.backend == "given"
    monitor.start(period_s=0.002)
    time.sleep(0.2)
    samples = monitor.stop()
    assert len(samples) >= 10, len(samples)
    assert {(s[1], s[2]) for s in samples} == {(10.0, 100.0), (90.0, 300.0)}
    assert [s[0] for s in samples] == sorted(s[0] for s in samples)
    assert len(samples) // 2 <= sum(s[1] == 10.0 for s in samples) <= len(samples) // 2 + 1  # alternating
    time.sleep(0.02)
    assert len(monitor.samples()) == len(samples)  # nothing after stop()
    middle = samples[len(samples) // 2][0]
    assert monitor.samples(since=middle) == [s for s in samples if s[0] >= middle]
    mean = GpuMonitor.mean_util(samples)
    assert mean == pytest.approx(sum(s[1] for s in samples) / len(samples))
    assert GpuMonitor.mean_util(samples, start=samples[-1][0] + 1) is None


def test_a_failed_reading_is_a_missing_sample_not_the_end_of_sampling():
    calls = itertools.count()

    def read():
        if next(calls) % 2:
            raise OSError("NVML hiccup")
        return 50.0, 200.0

    monitor = GpuMonitor(read=read)
    monitor.start(period_s=0.002)
    time.sleep(0.1)
    samples = monitor.stop()
    assert len(samples) >= 5 and all(s[1] == 50.0 for s in samples)


def sample(t: float, util: float) -> tuple[float, float, float]:
    return t, util, 0.0


def test_the_runs_phases_are_known_answers():
    # Idle to the first update (t 0-2), busy while training (3-7), half busy in the final evaluation (8-9).
    samples = [sample(t, 0.0 if t < 3 else 100.0 if t < 8 else 50.0) for t in range(10)]
    out = gpu_phases(samples, {"start": 0.0, "first_update": 2.5, "training_end": 7.5}, end=9.0)
    assert out["samples"] == 10
    assert out["util_mean"] == pytest.approx(60.0)  # (3 x 0 + 5 x 100 + 2 x 50) / 10
    assert (out["util_start"], out["util_training"], out["util_end"]) == (0.0, 100.0, 50.0)
    assert (out["seconds_start"], out["seconds_training"], out["seconds_end"]) == (2.5, 5.0, 1.5)


def test_a_run_whose_learner_never_returned_has_no_training_phase():
    samples = [sample(t, 20.0 * t) for t in range(5)]
    out = gpu_phases(samples, {"start": 0.0, "training_end": 3.5}, end=4.0)
    assert "util_training" not in out and "seconds_training" not in out
    assert out["util_start"] == pytest.approx(30.0)  # 0, 20, 40, 60
    assert out["util_end"] == 80.0 and out["seconds_end"] == 0.5
    # Stopped before training ended (an error): the start runs to the end.
    out = gpu_phases(samples, {"start": 0.0}, end=4.0)
    assert out["util_start"] == pytest.approx(40.0) and out["util_end"] == 80.0 and out["seconds_end"] == 0.0
