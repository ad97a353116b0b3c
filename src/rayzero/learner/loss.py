"""The K-step unrolled MuZero loss.

Policy: cross-entropy against the search policy. Value and reward: cross-entropy against two-hot targets on
the h-transformed support. The gradient entering each dynamics step is halved (MuZero's scale 0.5), and the
losses of the K unrolled steps are scaled by 1/K so that deeper unrolls do not dominate.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn import functional as F

from rayzero.models.networks import MuZeroNet
from rayzero.models.support import scalar_to_support, support_to_scalar


class LossOutput(NamedTuple):
    loss: torch.Tensor  # scalar, weighted by importance weights
    policy_loss: torch.Tensor
    value_loss: torch.Tensor
    reward_loss: torch.Tensor
    priorities: torch.Tensor  # [B] |v_0 - z_0|


def scale_gradient(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x * scale + x.detach() * (1.0 - scale)


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return -(target * F.log_softmax(logits.float(), dim=-1)).sum(-1)


def muzero_loss(model: MuZeroNet, batch: dict[str, torch.Tensor], value_loss_weight: float) -> LossOutput:
    """batch: tensors of a replay `Batch` (obs [B,...], actions [B,K], target_* [B,K+1(,A)], masks, weights)."""
    support = model.support_size
    actions = batch["actions"]
    num_unroll = actions.shape[1]
    out = model.initial(batch["obs"])
    latent = out.latent
    value_targets = scalar_to_support(batch["target_values"], support)  # [B, K+1, bins]
    reward_targets = scalar_to_support(batch["target_rewards"], support)

    policy_loss = _cross_entropy(out.policy_logits, batch["target_policies"][:, 0]) * batch["policy_mask"][:, 0]
    value_loss = _cross_entropy(out.value_logits, value_targets[:, 0]) * batch["value_mask"][:, 0]
    reward_loss = torch.zeros_like(policy_loss)
    priorities = (support_to_scalar(out.value_logits.detach(), support) - batch["target_values"][:, 0]).abs()

    for k in range(1, num_unroll + 1):
        latent, reward_logits = model.dynamics(scale_gradient(latent, 0.5), actions[:, k - 1])
        policy_logits, value_logits = model.predict(latent)
        step_scale = 1.0 / num_unroll
        policy_loss = policy_loss + step_scale * _cross_entropy(
            policy_logits, batch["target_policies"][:, k]
        ) * batch["policy_mask"][:, k]
        value_loss = value_loss + step_scale * _cross_entropy(value_logits, value_targets[:, k]) * batch["value_mask"][:, k]
        reward_loss = reward_loss + step_scale * _cross_entropy(
            reward_logits, reward_targets[:, k]
        ) * batch["reward_mask"][:, k]

    weights = batch["weights"]
    per_sample = policy_loss + value_loss_weight * value_loss + reward_loss
    return LossOutput(
        loss=(weights * per_sample).mean(),
        policy_loss=policy_loss.mean().detach(),
        value_loss=value_loss.mean().detach(),
        reward_loss=reward_loss.mean().detach(),
        priorities=priorities,
    )
