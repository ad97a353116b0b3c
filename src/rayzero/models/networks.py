"""The MuZero networks: representation h(o), dynamics g(s, a) and prediction f(s).

Two trunks share one interface: `MLPNet` for vector observations and `ResNet` (EfficientZero-sized) for
stacked image frames (a third, `TransformerNet`, lives in transformer.py). All return logits; `initial` and
`recurrent` also return scalars decoded from the categorical supports, which is what search needs. Latent
states are min-max scaled to [0, 1] per sample, as in MuZero, so the dynamics see inputs of a fixed range.

Value prefix (EfficientZero, `model.value_prefix`): instead of a reward head after each dynamics step, an
LSTM reads each unrolled state and a head predicts the value prefix, the sum of the rewards since the root
(the LSTM state and the prefix restart every `value_prefix_horizon` steps). Training (`prefix_step`) fits
the prefixes directly. For search the latent that `initial`/`recurrent` hand out is packed, flat:
[latent, LSTM h, LSTM c, parent prefix, depth], so a step's reward is its prefix minus the parent's inside
`recurrent`, and trees, inference pools and graphs keep treating latents as opaque tensors.

Mixed precision: with `heads_fp32 = True` (the inference actor sets it) the value, reward and policy heads run
in float32 with autocast disabled, so under a bf16 autocast only the trunk is bf16. Without autocast, or with
`heads_fp32 = False` (the default, what the learner uses), `_head` is a plain call: fp32 outputs are unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from rayzero.config import ModelConfig
from rayzero.models.layers import ResidualBlock, mlp, scale_latent
from rayzero.models.support import support_to_scalar


class NetworkOutput(NamedTuple):
    latent: torch.Tensor  # [B, ...]
    value: torch.Tensor  # [B] scalar (decoded)
    reward: torch.Tensor  # [B] scalar (decoded); 0 for initial inference
    policy_logits: torch.Tensor  # [B, A]
    value_logits: torch.Tensor  # [B, 2S+1]
    reward_logits: torch.Tensor  # [B, 2S+1]


def _unscaled(latent: torch.Tensor) -> torch.Tensor:
    return latent


class MuZeroNet(nn.Module):
    """Base: subclasses define represent(obs), dynamics(latent, action) -> (latent, reward_logits), predict(latent)."""

    support_size: int
    num_actions: int
    heads_fp32: bool = False
    """Run the heads in float32 (autocast off) even inside a bf16 autocast region (inference sets it)."""

    def _head(self, head, x: torch.Tensor) -> torch.Tensor:
        """head(x) for a value/reward/policy head; in float32 when heads_fp32 and autocast is on."""
        if self.heads_fp32 and torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                return head(x.float())
        return head(x)

    value_prefix: bool = False
    latent_shape: tuple[int, ...]

    def represent(self, obs: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def transition(self, latent: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """The next latent state (the dynamics without its reward head)."""
        raise NotImplementedError

    def dynamics(self, latent: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def predict(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def prefix_features(self, latent: torch.Tensor) -> torch.Tensor:
        """[B, F] what the value-prefix LSTM reads from a state."""
        raise NotImplementedError

    def trunk(self) -> list[nn.Module]:
        """The modules that always run under the caller's autocast (not the heads, which heads_fp32 keeps in
        float32): `hold_trunk_in_bf16` may keep their convolutions' weights in bf16."""
        return []

    # -- value prefix ------------------------------------------------------------------------------------

    def _init_value_prefix(self, cfg: ModelConfig, features: int) -> None:
        self.value_prefix = True
        self.lstm_hidden = cfg.lstm_hidden
        self.prefix_horizon = cfg.value_prefix_horizon
        self.prefix_lstm = nn.LSTMCell(features, cfg.lstm_hidden)
        self.prefix_head = nn.Sequential(nn.LayerNorm(cfg.lstm_hidden), nn.ReLU(),
                                         nn.Linear(cfg.lstm_hidden, 2 * cfg.support_size + 1))
        nn.init.zeros_(self.prefix_head[-1].weight)
        nn.init.zeros_(self.prefix_head[-1].bias)

    def prefix_state(self, batch: int, device: torch.device, dtype: torch.dtype = torch.float32
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The zero LSTM state (h, c) [B, lstm_hidden] of a root or of a restart."""
        zeros = torch.zeros(batch, self.lstm_hidden, device=device, dtype=dtype)
        return zeros, zeros.clone()

    def prefix_step(self, latent: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One LSTM step on an unrolled state: (value-prefix logits [B, bins], new (h, c))."""
        features = self.prefix_features(latent)
        if self.heads_fp32 and torch.is_autocast_enabled(features.device.type):
            with torch.autocast(features.device.type, enabled=False):
                h, c = self.prefix_lstm(features.float(), (state[0].float(), state[1].float()))
                return self.prefix_head(h), (h, c)
        h, c = self.prefix_lstm(features, state)
        return self.prefix_head(h), (h, c)

    def pack(self, latent: torch.Tensor, h: torch.Tensor, c: torch.Tensor, prefix: torch.Tensor,
             depth: torch.Tensor) -> torch.Tensor:
        """The flat search latent [B, latent + 2 lstm_hidden + 2] of a value-prefix model, in float32 (so the
        parent prefix that rewards are differences from keeps its precision under a bf16 trunk)."""
        return torch.cat([latent.flatten(1).float(), h.float(), c.float(), prefix.float().unsqueeze(1),
                          depth.float().unsqueeze(1)], dim=1)

    def unpack(self, packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(latent [B, *latent_shape], h, c, parent prefix [B] fp32, depth [B] fp32) of a packed latent."""
        size = 1
        for d in self.latent_shape:
            size *= d
        L = self.lstm_hidden
        latent = packed[:, :size].reshape(packed.shape[0], *self.latent_shape)
        h, c = packed[:, size:size + L], packed[:, size + L:size + 2 * L]
        return latent, h, c, packed[:, -2].float(), packed[:, -1].float()

    # -- what search sees ----------------------------------------------------------------------------------

    def _scalars(self, *logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The scalars of several [B, bins] heads in one pass over them stacked: a search step is bound by its
        number of kernels (tens per simulation at small batches), and each support_to_scalar is ~15 of them."""
        return support_to_scalar(torch.stack([x.float() for x in logits]), self.support_size).unbind(0)

    def initial(self, obs: torch.Tensor) -> NetworkOutput:
        """obs [B, *obs_shape] -> NetworkOutput with reward 0."""
        latent = self.represent(obs)
        policy_logits, value_logits = self.predict(latent)
        batch = obs.shape[0]
        reward_logits = torch.zeros(batch, 2 * self.support_size + 1, device=obs.device)
        reward_logits[:, self.support_size] = 1e4  # a point mass on 0
        if self.value_prefix:
            h, c = self.prefix_state(batch, obs.device, latent.dtype)
            zero = torch.zeros(batch, device=obs.device)
            latent = self.pack(latent, h, c, zero, zero)
        return NetworkOutput(
            latent,
            support_to_scalar(value_logits, self.support_size),
            torch.zeros(batch, device=obs.device),
            policy_logits.float(),
            value_logits.float(),
            reward_logits,
        )

    def recurrent(self, latent: torch.Tensor, action: torch.Tensor) -> NetworkOutput:
        """latent [B, ...], action [B] int64 -> NetworkOutput of the next state."""
        if self.value_prefix:
            return self._recurrent_prefix(latent, action)
        next_latent, reward_logits = self.dynamics(latent, action)
        policy_logits, value_logits = self.predict(next_latent)
        value, reward = self._scalars(value_logits, reward_logits)
        return NetworkOutput(
            next_latent,
            value,
            reward,
            policy_logits.float(),
            value_logits.float(),
            reward_logits.float(),
        )


    def _recurrent_prefix(self, packed: torch.Tensor, action: torch.Tensor) -> NetworkOutput:
        latent, h, c, parent_prefix, depth = self.unpack(packed)
        next_latent = self.transition(latent, action)
        prefix_logits, (h, c) = self.prefix_step(next_latent, (h, c))
        policy_logits, value_logits = self.predict(next_latent)
        value, prefix = self._scalars(value_logits, prefix_logits)
        reward = prefix - parent_prefix
        depth = depth + 1
        # At the horizon the children start a new prefix from zero, with a fresh LSTM state.
        restart = (torch.remainder(depth, self.prefix_horizon) == 0).unsqueeze(1)
        h, c = torch.where(restart, 0.0, h), torch.where(restart, 0.0, c)
        prefix = torch.where(restart.squeeze(1), 0.0, prefix)
        return NetworkOutput(
            self.pack(next_latent, h, c, prefix, depth),
            value,
            reward,
            policy_logits.float(),
            value_logits.float(),
            prefix_logits.float(),
        )


class MLPNet(MuZeroNet):
    """For vector observations [B, D]."""

    def __init__(self, obs_shape: tuple[int, ...], num_actions: int, cfg: ModelConfig):
        super().__init__()
        obs_dim = int(torch.tensor(obs_shape).prod())
        bins = 2 * cfg.support_size + 1
        self.support_size = cfg.support_size
        self.num_actions = num_actions
        self._norm = scale_latent if cfg.latent_norm == "minmax" else _unscaled
        self.latent_shape = (cfg.latent_dim,)
        self.representation = mlp([obs_dim, cfg.hidden, cfg.latent_dim])
        self.dynamics_trunk = mlp([cfg.latent_dim + num_actions, cfg.hidden, cfg.latent_dim])
        self.value_head = mlp([cfg.latent_dim, cfg.hidden, bins])
        self.policy_head = mlp([cfg.latent_dim, cfg.hidden, num_actions])
        heads = [self.value_head, self.policy_head]
        if cfg.value_prefix:
            self._init_value_prefix(cfg, cfg.latent_dim)
        else:
            self.reward_head = mlp([cfg.latent_dim, cfg.hidden, bins])
            heads.append(self.reward_head)
        # Heads start at zero output so early values/rewards decode to 0 and priors are uniform.
        for head in heads:
            nn.init.zeros_(head[-1].weight)
            nn.init.zeros_(head[-1].bias)

    def represent(self, obs: torch.Tensor) -> torch.Tensor:
        return self._norm(self.representation(obs.flatten(1).float()))

    def transition(self, latent: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        one_hot = F.one_hot(action.long(), self.num_actions).to(latent.dtype)
        return self._norm(self.dynamics_trunk(torch.cat([latent, one_hot], dim=1)))

    def dynamics(self, latent: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        next_latent = self.transition(latent, action)
        return next_latent, self._head(self.reward_head, next_latent)

    def prefix_features(self, latent: torch.Tensor) -> torch.Tensor:
        return latent

    def predict(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._head(self.policy_head, latent), self._head(self.value_head, latent)


class ResNet(MuZeroNet):
    """For stacked frames [B, C, H, W] uint8 (96x96 -> 6x6 latent, as in EfficientZero; or, with
    model.downsample=8, 64x64 -> 8x8, as in LightZero's Atari net)."""

    def __init__(self, obs_shape: tuple[int, ...], num_actions: int, cfg: ModelConfig):
        super().__init__()
        in_channels, height, width = obs_shape
        c = cfg.channels
        bins = 2 * cfg.support_size + 1
        self.support_size = cfg.support_size
        self.num_actions = num_actions
        self._norm = scale_latent if cfg.latent_norm == "minmax" else _unscaled
        # Downsample x16: stride-2 conv, res, stride-2 conv, res, avgpool, res, avgpool (x8: without the last).
        down = [
            nn.Conv2d(in_channels, c // 2, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(c // 2),
            nn.ReLU(),
            ResidualBlock(c // 2),
            nn.Conv2d(c // 2, c, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(c),
            nn.ReLU(),
            ResidualBlock(c),
            nn.AvgPool2d(3, stride=2, padding=1),
            ResidualBlock(c),
            nn.AvgPool2d(3, stride=2, padding=1),
        ]
        self.down = nn.Sequential(*(down if cfg.downsample == 16 else down[:-1]))
        self.repr_blocks = nn.Sequential(*[ResidualBlock(c) for _ in range(cfg.blocks)])
        latent_h, latent_w = -(-height // cfg.downsample), -(-width // cfg.downsample)
        self.latent_shape = (c, latent_h, latent_w)
        # The action enters the dynamics as one-hot planes (LightZero's Atari encoding), not EfficientZero's one
        # plane of a / A: distinct actions whose codes are close (Pong's RIGHT and LEFT) then differ as much as any.
        self.dyn_conv = nn.Sequential(nn.Conv2d(c + num_actions, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))
        self.dyn_blocks = nn.Sequential(*[ResidualBlock(c) for _ in range(cfg.blocks)])
        flat = cfg.reduced_channels * latent_h * latent_w
        self.reward_conv = nn.Conv2d(c, cfg.reduced_channels, 1)
        self.pred_blocks = nn.Sequential(*[ResidualBlock(c) for _ in range(cfg.blocks)])
        self.value_conv = nn.Conv2d(c, cfg.reduced_channels, 1)
        self.value_fc = mlp([flat, cfg.head_hidden, bins])
        self.policy_conv = nn.Conv2d(c, cfg.reduced_channels, 1)
        self.policy_fc = mlp([flat, cfg.head_hidden, num_actions])
        heads = [self.value_fc, self.policy_fc]
        if cfg.value_prefix:  # the LSTM reads the reward conv's features, as in EfficientZero
            self._init_value_prefix(cfg, flat)
        else:
            self.reward_fc = mlp([flat, cfg.head_hidden, bins])
            heads.append(self.reward_fc)
        for head in heads:
            nn.init.zeros_(head[-1].weight)
            nn.init.zeros_(head[-1].bias)

    def trunk(self) -> list[nn.Module]:
        return [self.down, self.repr_blocks, self.dyn_conv, self.dyn_blocks, self.pred_blocks]

    def represent(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs.float() / 255.0
        return self._norm(self.repr_blocks(self.down(x)))

    def transition(self, latent: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = latent.shape
        planes = F.one_hot(action.long(), self.num_actions).to(latent.dtype).view(batch, -1, 1, 1)
        planes = planes.expand(batch, self.num_actions, height, width)
        x = F.relu(self.dyn_conv(torch.cat([latent, planes], dim=1)) + latent)
        return self._norm(self.dyn_blocks(x))

    def dynamics(self, latent: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        next_latent = self.transition(latent, action)
        return next_latent, self._head(self._reward_head, next_latent)

    def prefix_features(self, latent: torch.Tensor) -> torch.Tensor:
        return F.relu(self.reward_conv(latent)).flatten(1)

    def _reward_head(self, x: torch.Tensor) -> torch.Tensor:
        return self.reward_fc(F.relu(self.reward_conv(x)).flatten(1))

    def _policy_head(self, x: torch.Tensor) -> torch.Tensor:
        return self.policy_fc(F.relu(self.policy_conv(x)).flatten(1))

    def _value_head(self, x: torch.Tensor) -> torch.Tensor:
        return self.value_fc(F.relu(self.value_conv(x)).flatten(1))

    def predict(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.pred_blocks(latent)
        return self._head(self._policy_head, x), self._head(self._value_head, x)


def hold_trunk_in_bf16(model: MuZeroNet) -> int:
    """Keep the weights of the trunk's convolutions in bf16, for an inference copy run under bf16 autocast with
    its cast cache off (as in CUDA graphs): autocast would otherwise cast each weight at every call, one kernel per
    convolution per simulation of a captured search. The results are the same bit for bit (that cast is all
    autocast does to them); BatchNorm and the heads stay float32, and weights copied in are cast on the way.
    Returns how many convolutions it converted."""
    convs = [m for module in model.trunk() for m in module.modules() if isinstance(m, nn.Conv2d)]
    for conv in convs:
        conv.to(torch.bfloat16)
    return len(convs)
