"""A Transformer representation / dynamics (reward) model behind the MuZeroNet interface.

Shapes: B = batch, T = input tokens (<= max_tokens, 512 by default), Z = latent tokens, D = width.
Tokens: an image observation [C, H, W] is cut into p x p patches (one strided conv, p chosen so that
T = (H/p)(W/p) <= max_tokens: 96x96 -> p=6, T=256); a sequence [T, F] gives one token per frame (a linear
map of its F features); a vector [F] gives one token per feature.

representation: tokens + learned positions, followed by Z learned latent queries, through `layers` pre-LN
blocks with fused attention (F.scaled_dot_product_attention); the latent is the final LayerNorm of the Z
query positions: [B, Z, D].
dynamics: the Z latent tokens plus one action-embedding token through `layers` blocks; the next latent is
the first Z outputs, the reward is read from the action token's output.
prediction: policy and value heads on the mean of the latent tokens.

Value, reward and policy heads are small MLPs that run in float32 when `heads_fp32` is set (see
networks.MuZeroNet._head), so under bf16 autocast the attention and MLP trunk is bf16 and the heads are not.

Sizes come from the `transformer_*` fields of ModelConfig; `head_hidden` and `support_size` are shared with the
other nets.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from rayzero.config import ModelConfig
from rayzero.models.layers import mlp
from rayzero.models.networks import MuZeroNet

SIZES = ("dim", "heads", "layers", "latent_tokens", "patch", "max_tokens")


def transformer_sizes(cfg: ModelConfig) -> dict[str, int]:
    """The transformer's sizes: the `transformer_<name>` fields of a ModelConfig."""
    return {name: int(getattr(cfg, f"transformer_{name}")) for name in SIZES}


def auto_patch(height: int, width: int, max_tokens: int) -> int:
    """The smallest patch side p dividing H and W with (H/p)(W/p) <= max_tokens."""
    for p in range(1, min(height, width) + 1):
        if height % p == 0 and width % p == 0 and (height // p) * (width // p) <= max_tokens:
            return p
    raise ValueError(f"no patch size divides a {height}x{width} image into <= {max_tokens} tokens")


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(LN(x)), then x + MLP(LN(x)); x [B, T, D]."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4):
        super().__init__()
        if dim % heads:
            raise ValueError(f"transformer width {dim} is not divisible by {heads} heads")
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        qkv = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # [B, heads, T, D / heads]
        x = x + self.proj(attn.transpose(1, 2).reshape(B, T, D))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TransformerNet(MuZeroNet):
    """obs [B, *obs_shape] -> latent [B, Z, D]; see the module docstring for the token layouts."""

    def __init__(self, obs_shape: tuple[int, ...], num_actions: int, cfg):
        super().__init__()
        sizes = transformer_sizes(cfg)
        D, heads, layers, Z = sizes["dim"], sizes["heads"], sizes["layers"], sizes["latent_tokens"]
        bins = 2 * cfg.support_size + 1
        self.support_size = cfg.support_size
        self.num_actions = num_actions
        self.latent_tokens = Z
        self.obs_shape = tuple(obs_shape)
        if len(obs_shape) == 3:
            channels, height, width = obs_shape
            p = sizes["patch"] or auto_patch(height, width, sizes["max_tokens"])
            self.embed = nn.Conv2d(channels, D, p, stride=p)
            tokens = (height // p) * (width // p)
        elif len(obs_shape) == 2:
            tokens = obs_shape[0]
            self.embed = nn.Linear(obs_shape[1], D)
        elif len(obs_shape) == 1:
            tokens = obs_shape[0]
            self.embed = nn.Linear(1, D)
        else:
            raise ValueError(f"model.kind='transformer' needs [C, H, W], [T, F] or [F] observations, got {obs_shape}")
        if tokens > sizes["max_tokens"]:
            raise ValueError(f"observation {obs_shape} gives {tokens} tokens > transformer_max_tokens="
                             f"{sizes['max_tokens']}; use a larger transformer_patch")
        self.tokens = tokens
        self.pos = nn.Parameter(torch.randn(1, tokens, D) * 0.02)
        self.queries = nn.Parameter(torch.randn(1, Z, D) * 0.02)
        self.repr_blocks = nn.ModuleList(Block(D, heads) for _ in range(layers))
        self.repr_norm = nn.LayerNorm(D)
        self.action_embed = nn.Embedding(num_actions, D)
        self.dyn_pos = nn.Parameter(torch.randn(1, Z + 1, D) * 0.02)
        self.dyn_blocks = nn.ModuleList(Block(D, heads) for _ in range(layers))
        self.dyn_norm = nn.LayerNorm(D)
        self.reward_head = mlp([D, cfg.head_hidden, bins])
        self.value_head = mlp([D, cfg.head_hidden, bins])
        self.policy_head = mlp([D, cfg.head_hidden, num_actions])
        for head in (self.reward_head, self.value_head, self.policy_head):
            nn.init.zeros_(head[-1].weight)
            nn.init.zeros_(head[-1].bias)

    def _tokens(self, obs: torch.Tensor) -> torch.Tensor:
        """obs [B, *obs_shape] -> [B, T, D]."""
        x = obs.float() / 255.0 if obs.dtype == torch.uint8 else obs.float()
        if len(self.obs_shape) == 3:
            return self.embed(x).flatten(2).transpose(1, 2)
        if len(self.obs_shape) == 2:
            return self.embed(x)
        return self.embed(x.unsqueeze(-1))

    def represent(self, obs: torch.Tensor) -> torch.Tensor:
        x = self._tokens(obs) + self.pos
        x = torch.cat([x, self.queries.expand(x.shape[0], -1, -1).to(x.dtype)], dim=1)
        for block in self.repr_blocks:
            x = block(x)
        return self.repr_norm(x[:, -self.latent_tokens:])

    def dynamics(self, latent: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        act = self.action_embed(action.long()).unsqueeze(1).to(latent.dtype)
        x = torch.cat([latent, act], dim=1) + self.dyn_pos
        for block in self.dyn_blocks:
            x = block(x)
        x = self.dyn_norm(x)
        next_latent = x[:, : self.latent_tokens].contiguous()
        return next_latent, self._head(self.reward_head, x[:, self.latent_tokens])

    def predict(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = latent.mean(1)
        return self._head(self.policy_head, pooled), self._head(self.value_head, pooled)
