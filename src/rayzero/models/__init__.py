"""Networks and value/reward supports shared by self-play, inference and the learner."""

from rayzero.models.networks import MLPNet, MuZeroNet, NetworkOutput, ResNet, build_model
from rayzero.models.support import h, h_inv, scalar_to_support, support_to_scalar

__all__ = ["MLPNet", "MuZeroNet", "NetworkOutput", "ResNet", "build_model", "h", "h_inv", "scalar_to_support",
           "support_to_scalar"]
