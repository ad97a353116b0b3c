"""Prioritised replay with n-step targets (the replay role)."""

from rayzero.replay.buffer import Batch, ReplayBuffer, Segment

__all__ = ["Batch", "ReplayBuffer", "Segment"]
