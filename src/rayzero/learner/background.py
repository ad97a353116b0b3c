"""The learner's background compile: a helper process that compiles the learner's step once, from the first real
batch, so that the compile cache (inductor's, on the machine's disk) is warm when the learner compiles it.

A cold compile of the Atari step takes minutes, during which a learner that compiles in line makes no update. With
`learner.background_compile` the learner trains eagerly meanwhile and then compiles from the warm cache, which
takes seconds (scripts/compile_cost.py measures both). The helper is a plain subprocess (`python -c`), not a
multiprocessing child, so that it does not re-import a Ray worker's main module; it exits if its parent does.
The helper (`compile_in_helper` in learner.py) compiles with the learner's own configuration on the same device,
so its cache entries are the ones the learner looks up (the weights are inputs of the compiled graph: their values
do not enter the cache key). One helper runs per PART, all at once: compiling is mostly one Python thread per
process, so the parts overlap and the cache is warm after the longest of them, not their sum. The step is one part
("step": its forward and backward), or with `learner.compile_regions` two ("root": the unroll's root and the
consistency targets; "unroll": one unrolled step); each no-grad side step that makes the step's inputs is one
("bootstrap": the target network's; "consistency": the consistency targets). The helpers start with the learner
(`spawn`): Python, torch, CUDA and their own learner are up by the time the first batch reaches them
(`hand_over`), and they compile from there.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rayzero.config import LearnerConfig, ModelConfig, ReplayConfig
from rayzero.replay.buffer import ReplayBuffer, Segment
from rayzero.shm import pid_alive


# A part of the loss's compile: the loss's regions its helper compiles (`CompiledRegions`; None: the whole loss).
LOSS_PARTS: dict[str, tuple[str, ...] | None] = {"step": None, "root": ("root", "targets"), "unroll": ("step",)}
SIDE_PARTS = ("bootstrap", "consistency")  # the side steps, one part each
PARTS = (*LOSS_PARTS, *SIDE_PARTS)
WAIT_S = 0.1  # how often a waiting helper looks for its batch


def parts(cfg: LearnerConfig, model_cfg: ModelConfig) -> list[str]:
    """The PARTS a background compile of this configuration runs: the step whole, or its regions with
    learner.compile_regions (as the learner compiles it: not for a value-prefix model), and each side step that is
    compiled (the target network's bootstraps, the consistency targets computed beforehand). With
    learner.regions_first both: the regions, then the whole loss that the learner moves to."""
    regions = not model_cfg.value_prefix and (cfg.compile_regions or cfg.regions_first)
    loss = (["root", "unroll"] if regions else []) + ([] if cfg.compile_regions and regions else ["step"])
    side = []
    if cfg.compile_side_steps and cfg.target_update_interval > 0:
        side.append("bootstrap")
    if cfg.compile_side_steps and cfg.consistency_weight > 0 and cfg.consistency_targets == "separate":
        side.append("consistency")
    return loss + side


def spawn(model_cfg: ModelConfig, cfg: LearnerConfig, obs_shape: tuple[int, ...], num_actions: int,
          device: torch.device, part: str = "step", report: Path | None = None) -> subprocess.Popen:
    """Start a helper that builds a learner of this configuration and waits for `hand_over`'s batch to compile
    `part` (one of PARTS) on: the step or some of its regions, with the side steps left eager, or one side step.
    report: a file the helper writes its exit code to when it ends (for a learner in another process than the
    one starting it)."""
    helper_cfg = helper_config(cfg, device, part)
    work = Path(tempfile.mkdtemp(prefix="rayzero_compile."))
    with open(work / "args.pkl", "wb") as f:
        pickle.dump({"model_cfg": model_cfg, "cfg": helper_cfg, "obs_shape": tuple(obs_shape), "part": part,
                     "num_actions": num_actions, "parent": os.getpid(),
                     "report": None if report is None else str(report)}, f)
    entry = "import sys; from rayzero.learner.learner import compile_in_helper; sys.exit(compile_in_helper(sys.argv[1]))"
    helper = subprocess.Popen([sys.executable, "-c", entry, str(work)])
    helper.work_dir = work  # type: ignore[attr-defined]  # removed by `clean_up` (the helper's own may not run)
    return helper


def helper_config(cfg: LearnerConfig, device: torch.device, part: str) -> LearnerConfig:
    """The learner configuration of `part`'s helper: it compiles at once, with no background compile, compile
    check or step graph of its own (it only fills the cache), and the side steps only in their parts."""
    if part not in PARTS:
        raise ValueError(f"background compile part {part!r}: expected one of {PARTS}")
    loss_regions = cfg.compile_regions if part not in LOSS_PARTS else LOSS_PARTS[part] is not None
    return dataclasses.replace(cfg, background_compile=False, early_compile=False, prewarm_dir="", compile=True,
                               compile_regions=loss_regions, regions_first=False,
                               device=device.type, compile_check_steps=0,
                               compile_side_steps=cfg.compile_side_steps and part in SIDE_PARTS, step_graph=False)


def hand_over(helper: subprocess.Popen, tensors: dict[str, torch.Tensor], stale: int) -> None:
    """Give a spawned helper its batch (a copy of `tensors`, the first batch as the learner's update takes it);
    nothing to do for one that has already ended (it failed: the learner compiles on its own)."""
    work = getattr(helper, "work_dir", None)
    if work is None or helper.poll() is not None:
        return
    partial = work / "batch.partial"
    torch.save({"tensors": {k: v.detach().cpu() for k, v in tensors.items()}, "stale": stale}, partial)
    os.replace(partial, work / "batch.pt")  # whole or absent, for the helper that polls for it


def write_report(args: dict[str, Any], code: int) -> None:
    """In the helper, as it ends: its exit code into `spawn`'s report file, if it was given one."""
    if args.get("report"):
        partial = Path(args["report"] + ".partial")
        partial.write_text(str(code))
        os.replace(partial, args["report"])


def prewarm(model_cfg: ModelConfig, cfg: LearnerConfig, obs_shape: tuple[int, ...], num_actions: int,
            device: torch.device, tensors: dict[str, torch.Tensor], directory: Path) -> list[subprocess.Popen]:
    """learner.early_compile, in the driver: start the helpers of `parts(cfg)` and hand them `tensors` at once.
    Each writes its pid (now) and exit code (when it ends) into `directory`, which the learner watches
    (`PrewarmWatch`) instead of starting helpers of its own."""
    directory.mkdir(parents=True, exist_ok=True)
    helpers = []
    for part in parts(cfg, model_cfg):
        helper = spawn(model_cfg, cfg, obs_shape, num_actions, device, part, report=directory / f"{part}.rc")
        (directory / f"{part}.pid").write_text(str(helper.pid))
        hand_over(helper, tensors, 0)
        helpers.append(helper)
    return helpers


class PrewarmWatch:
    """In the learner: the helpers `prewarm` started in another process, by their pid and report files."""

    def __init__(self, directory: str):
        self.directory = Path(directory)

    def codes(self, skip: tuple[str, ...] = ()) -> list[int] | None:
        """The helpers' exit codes once all have ended (-1 for one that ended without a report: killed or
        crashed), None while any still runs. skip: parts not to wait for."""
        codes = []
        for pid_file in sorted(self.directory.glob("*.pid")):
            if pid_file.stem not in skip:
                code = self.code(pid_file.stem)
                if code is None:
                    return None
                codes.append(code)
        return codes or [-1]  # no helper at all: nothing will fill the cache

    def code(self, part: str) -> int | None:
        """One part's helper's exit code once it has ended (-1: none, or it ended without a report), else None."""
        pid_file = self.directory / f"{part}.pid"
        report = pid_file.with_suffix(".rc")
        if report.exists():  # a helper reports before it exits
            return int(report.read_text())
        if pid_file.exists() and pid_alive(int(pid_file.read_text())):
            return None
        return -1


def synthetic_batch(replay_cfg: ReplayConfig, obs_shape: tuple[int, ...], obs_dtype: np.dtype, num_actions: int,
                    batch_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch with the fields, shapes and dtypes the learner gets from a replay of `replay_cfg`, on the host:
    random segments through the replay's own sampling (observations kept stacked, which is what a frame-stacking
    replay restacks them to) and the learner's own staging. Values are noise; a compile depends on the rest."""
    length = max(64, replay_cfg.unroll_steps + replay_cfg.td_steps + 2)
    cfg = dataclasses.replace(replay_cfg, capacity=4 * length, min_size=0, frame_stack=0, shared_obs=False,
                              shards=0)
    replay = ReplayBuffer(cfg, seed=seed)
    rng = np.random.default_rng(seed)
    for _ in range(4):
        if np.issubdtype(obs_dtype, np.integer):
            obs = rng.integers(0, 256, size=(length, *obs_shape)).astype(obs_dtype)
        else:
            obs = rng.normal(size=(length, *obs_shape)).astype(obs_dtype)
        replay.add(Segment(obs=obs, actions=rng.integers(0, num_actions, size=length),
                           rewards=rng.normal(size=length).astype(np.float32),
                           policies=rng.dirichlet(np.ones(num_actions), size=length).astype(np.float32),
                           root_values=rng.normal(size=length).astype(np.float32),
                           num_sampleable=length - 2, terminal=False, bootstrap_value=0.0))
    from rayzero.learner.prefetch import Staging

    return Staging(torch.device("cpu")).upload(replay.sample(batch_size)).tensors


def clean_up(helper: subprocess.Popen) -> None:
    """Remove the helper's batch copy, once it has ended (a killed helper leaves it behind)."""
    work = getattr(helper, "work_dir", None)
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)


def _exit_with_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(1.0)


def read_args(work: str) -> dict[str, Any]:
    """In the helper: the arguments `spawn` wrote; a thread then ends the helper if its parent (the learner) goes
    away, also while it waits for its batch."""
    with open(Path(work) / "args.pkl", "rb") as f:
        args = pickle.load(f)  # written by spawn(), in a private temporary directory
    threading.Thread(target=_exit_with_parent, args=(args["parent"],), daemon=True).start()
    return args


def wait_for_batch(work: str) -> tuple[dict[str, torch.Tensor], int]:
    """In the helper: (the batch, its staleness) once `hand_over` has written them; the directory is removed
    once read."""
    path = Path(work)
    while not (path / "batch.pt").exists():
        time.sleep(WAIT_S)
    try:
        job = torch.load(path / "batch.pt", map_location="cpu", weights_only=True)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return job["tensors"], int(job["stale"])
