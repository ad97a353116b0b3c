"""The learner role: MuZero updates with AdamW, a weight version counter, save and load.

`Learner` is a plain class (tests use it in-process); `cluster/` makes it a Ray actor. `train` pulls
batches from a replay actor with the next batch always in flight, so sampling overlaps the update.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
try:
    from safetensors import SafetensorError
except ImportError:  # older safetensors
    SafetensorError = Exception  # type: ignore[misc,assignment]
from safetensors.torch import load_file, save_file

from rayzero.config import LearnerConfig, ModelConfig
from rayzero.learner.checkpoint import CheckpointError
from rayzero.learner.loss import muzero_loss
from rayzero.models import build_model
from rayzero.replay.buffer import Batch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but CUDA is not available: use 'auto' or 'cpu'")
    return torch.device(name)


class Learner:
    def __init__(
        self,
        model_cfg: ModelConfig,
        cfg: LearnerConfig,
        obs_shape: tuple[int, ...],
        num_actions: int,
        seed: int = 0,
        torch_threads: int = 0,
    ):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        torch.manual_seed(seed)
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.model = build_model(model_cfg, obs_shape, num_actions).to(self.device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True
        )
        self.steps = 0
        self.version = 0
        self.samples = 0

    def _lr_factor(self, step: int) -> float:
        cfg = self.cfg
        if cfg.lr_warmup_steps and step < cfg.lr_warmup_steps:
            return (step + 1) / cfg.lr_warmup_steps
        if not cfg.lr_decay_steps:
            return 1.0
        progress = min(1.0, (step - cfg.lr_warmup_steps) / cfg.lr_decay_steps)
        final = cfg.lr_final_fraction
        return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress))

    def _to_device(self, batch: Batch) -> dict[str, torch.Tensor]:
        pin = self.device.type == "cuda"
        out = {}
        for name, value in batch._asdict().items():
            if name in ("indices", "generations"):
                continue
            # Arrays from Ray's object store are read-only views; torch needs writable memory.
            array = np.ascontiguousarray(value)
            tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
            if pin:
                tensor = tensor.pin_memory()
            out[name] = tensor.to(self.device, non_blocking=True)
        return out

    def step(self, batch: Batch) -> tuple[dict[str, float], np.ndarray]:
        """One update; returns (metrics, new priorities [B])."""
        tensors = self._to_device(batch)
        use_bf16 = self.cfg.bf16 and self.device.type == "cuda"
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=use_bf16):
            out = muzero_loss(self.model, tensors, self.cfg.value_loss_weight)
        if not torch.isfinite(out.loss):
            raise FloatingPointError(f"learner step {self.steps}: loss is {out.loss.item()}")
        lr = self.cfg.lr * self._lr_factor(self.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = (
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            if self.cfg.grad_clip
            else torch.zeros(())
        )
        self.optimizer.step()
        self.steps += 1
        self.samples += len(batch.indices)
        metrics = {
            "loss": out.loss.item(),
            "policy_loss": out.policy_loss.item(),
            "value_loss": out.value_loss.item(),
            "reward_loss": out.reward_loss.item(),
            "grad_norm": float(grad_norm),
            "lr": lr,
        }
        return metrics, out.priorities.float().cpu().numpy() + 1e-6

    def train(self, replay: Any, num_steps: int) -> dict[str, Any]:
        """num_steps updates on batches from a replay actor; publishes a new version at the end."""
        import ray

        start = time.perf_counter()
        pending = replay.sample.remote(self.cfg.batch_size)
        totals: dict[str, float] = {}
        for i in range(num_steps):
            batch = ray.get(pending)
            if i + 1 < num_steps:
                pending = replay.sample.remote(self.cfg.batch_size)
            metrics, priorities = self.step(batch)
            replay.update_priorities.remote(batch.indices, batch.generations, priorities)
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value
        self.version += 1
        result = {key: value / num_steps for key, value in totals.items()}
        result.update(
            learner_steps=self.steps, version=self.version, samples=self.samples,
            steps_per_second=num_steps / (time.perf_counter() - start),
        )
        return result

    def weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, CPU state_dict) to publish to self-play and inference."""
        return self.version, {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def set_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> int:
        """Put published weights back (the driver rolls back to the version that met run.stop_return)."""
        with torch.no_grad():
            for name, tensor in self.model.state_dict().items():
                tensor.copy_(state_dict[name])
        self.version = version
        return version

    def counters(self) -> dict[str, int]:
        return {"learner_steps": self.steps, "version": self.version, "samples": self.samples}

    def save(self, directory: str) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in self.model.state_dict().items()}
        save_file(state, str(path / "model.safetensors"))
        torch.save(
            {"optimizer": self.optimizer.state_dict(), "counters": self.counters(), "rng": torch.get_rng_state()},
            path / "optimizer.pt",
        )

    def load(self, directory: str) -> None:
        path = Path(directory)
        try:
            state = load_file(str(path / "model.safetensors"), device=str(self.device))
            extra = torch.load(path / "optimizer.pt", map_location=self.device, weights_only=True)
        except (OSError, SafetensorError, RuntimeError, EOFError, ValueError) as error:
            raise CheckpointError(f"checkpoint {str(path)!r} is corrupt or unreadable: {error}") from None
        self.model.load_state_dict(state)
        self.optimizer.load_state_dict(extra["optimizer"])
        self.steps = int(extra["counters"]["learner_steps"])
        self.version = int(extra["counters"]["version"])
        self.samples = int(extra["counters"]["samples"])
        torch.set_rng_state(extra["rng"].cpu())


def load_model_weights(model: torch.nn.Module, checkpoint_dir: str | Path) -> None:
    """Load only the network weights of a checkpoint into `model` (for eval and inference)."""
    path = Path(checkpoint_dir) / "model.safetensors"
    try:
        state = load_file(str(path))
        model.load_state_dict(state)
    except (OSError, SafetensorError, RuntimeError) as error:
        raise CheckpointError(f"checkpoint {str(checkpoint_dir)!r} is corrupt or unreadable: {error}") from None
