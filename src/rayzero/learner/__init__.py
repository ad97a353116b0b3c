"""The learner role: the MuZero loss, updates, versioned weights and checkpoints."""

from rayzero.learner.checkpoint import CheckpointError
from rayzero.learner.learner import Learner, load_model_weights

__all__ = ["CheckpointError", "Learner", "load_model_weights"]
