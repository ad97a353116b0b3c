"""Which device a role runs on: the one rule that the learner, the inference actor and reanalyse follow.

Its own module so that a role picks its device without importing another role.
"""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """'auto' (CUDA when available), 'cpu', 'cuda' or 'cuda:<i>'; a CUDA device always carries its index
    (the current device when none is given), so device ids compare equal and DDP gets the index it needs."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    elif name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} was asked for but CUDA is not available: use 'auto' or 'cpu'")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
