"""Published weights: a CPU state dict that crosses Ray as numpy buffers, and the in-place copy that receives it.

The learner publishes a new version after every train call and the driver hands it to inference, self-play,
reanalyse and evaluation actors; each hop pickles the state dict. Torch pickles every tensor on its own, numpy
arrays go to Ray's object store as out-of-band buffers (pickle protocol 5), so `StateDict` pickles as numpy
(docs/benchmarks.md has the round-trip times).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch

__all__ = ["StateDict", "copy_into", "snapshot"]


class StateDict(dict):
    """{name: CPU tensor}; pickles as numpy arrays (tensors of a dtype numpy lacks, e.g. bfloat16, as tensors)
    and unpickles into tensors that own their memory."""

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        return _rebuild, ({name: _as_numpy(value) for name, value in self.items()},)


def _as_numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and not value.requires_grad:
        try:
            return value.numpy()
        except TypeError:  # a dtype numpy has no type for
            return value
    return value


def _rebuild(arrays: dict[str, Any]) -> StateDict:
    # np.array copies: arrays unpickled from Ray's object store are read-only views of it.
    return StateDict({name: torch.from_numpy(np.array(value)) if isinstance(value, np.ndarray) else value
                      for name, value in arrays.items()})


def snapshot(state: dict[str, torch.Tensor]) -> StateDict:
    """A CPU copy of a (device) state dict with one device-to-host copy per dtype instead of one per tensor.

    Each tensor of the result owns its memory: torch pickles a view with its whole storage, so views of one flat
    buffer put in a plain dict would each carry every weight."""
    groups: dict[torch.dtype, list[str]] = defaultdict(list)
    for name, tensor in state.items():
        groups[tensor.dtype].append(name)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for names in groups.values():
            tensors = [state[name].detach() for name in names]
            flat = torch.cat([t.reshape(-1) for t in tensors]).cpu() if len(tensors) > 1 else \
                tensors[0].reshape(-1).to("cpu", copy=True)
            for name, tensor, part in zip(names, tensors, flat.split([t.numel() for t in tensors])):
                out[name] = part.view(tensor.shape).clone()
    return StateDict((name, out[name]) for name in state)


def copy_into(module: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy `state_dict` into the parameters and buffers of `module` in place, so optimizers, CUDA graphs and
    compiled code that hold them keep seeing the live weights."""
    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            tensor.copy_(state_dict[name])
