"""Networks and value/reward supports shared by self-play, inference and the learner.

`build_model` lives here, above the three networks, so that no network module imports another to pick one.
"""

from rayzero.config import ModelConfig
from rayzero.models.networks import MLPNet, MuZeroNet, NetworkOutput, ResNet
from rayzero.models.support import h, h_inv, scalar_to_support, support_to_scalar
from rayzero.models.transformer import TransformerNet

__all__ = ["MLPNet", "MuZeroNet", "NetworkOutput", "ResNet", "TransformerNet", "build_model", "h", "h_inv",
           "scalar_to_support", "support_to_scalar"]


def build_model(cfg: ModelConfig, obs_shape: tuple[int, ...], num_actions: int) -> MuZeroNet:
    """The network that `cfg.kind` names ('auto': a ResNet for images [C, H, W], else an MLP)."""
    kind = cfg.kind
    if kind == "auto":
        kind = "resnet" if len(obs_shape) == 3 else "mlp"
    if kind == "mlp":
        return MLPNet(obs_shape, num_actions, cfg)
    if kind == "resnet":
        if len(obs_shape) != 3:
            raise ValueError(f"model.kind='resnet' needs image observations [C, H, W], got shape {obs_shape}")
        return ResNet(obs_shape, num_actions, cfg)
    if kind == "transformer":
        return TransformerNet(obs_shape, num_actions, cfg)
    raise ValueError(f"model.kind={kind!r} is not available: use 'mlp', 'resnet' or 'transformer'")
