"""The K-step unrolled MuZero loss, EfficientZero's consistency loss, and target-network value bootstraps.

Policy: cross-entropy against the search policy. Value and reward: cross-entropy against two-hot targets on
the h-transformed support. The gradient entering each dynamics step is scaled (MuZero's 0.5 by default), and the
losses of the K unrolled steps are weighted (1/K by default, so that deeper unrolls do not dominate).

Value prefix (optional, EfficientZero, `model.value_prefix`): the reward term fits, at each unrolled step, the
LSTM's value-prefix prediction to the sum of the rewards since the root (restarting every horizon steps).

Random shift (optional, `shift_pixels`): image observations are shifted by a random offset before the
representation sees them, as EfficientZero and LightZero do for their consistency loss.

Consistency (optional, EfficientZero): the latent after k dynamics steps goes through a projection and a
prediction head; the representation of the real observation at t+k goes through the same projection under
stop-gradient; the loss is their negative cosine similarity (SimSiam), masked past the segment's end.

`MuZeroLoss` is an `nn.Module` whose forward computes everything from a batch of device tensors, so that
DDP and torch.compile each wrap a single forward. It holds the network (and the consistency heads), never
the target network: bootstraps are computed beforehand by `bootstrap_values` and folded into the targets.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from rayzero.models.networks import MuZeroNet
from rayzero.models.support import scalar_to_support, support_to_scalar

STAT_NAMES = ("policy_loss", "value_loss", "reward_loss", "consistency_loss",
              # Learning diagnostics, batch means: |v_0 - z_0| and |r_k - u_k| in reward units (decoded from the
              # supports), the entropy of the search policy at the root of the unroll, and KL(search || prior).
              "value_error", "reward_error", "target_entropy", "policy_kl")


def scale_gradient(x: torch.Tensor, scale: float) -> torch.Tensor:
    if scale == 1.0:
        return x
    return x * scale + x.detach() * (1.0 - scale)


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return -(target * F.log_softmax(logits.float(), dim=-1)).sum(-1)


class ConsistencyHeads(nn.Module):
    """[N, latent_features] latents -> projection [N, dim] and prediction [N, dim] (SimSiam heads)."""

    def __init__(self, latent_features: int, dim: int):
        super().__init__()
        self.projection = nn.Sequential(
            nn.Linear(latent_features, dim), nn.BatchNorm1d(dim), nn.ReLU(),
            nn.Linear(dim, dim), nn.BatchNorm1d(dim),
        )
        self.prediction = nn.Sequential(nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.ReLU(), nn.Linear(dim, dim))

    def project(self, latent: torch.Tensor) -> torch.Tensor:
        return self.projection(latent.flatten(1))

    def predict(self, latent: torch.Tensor) -> torch.Tensor:
        return self.prediction(self.project(latent))


class MuZeroLoss(nn.Module):
    """forward(batch) -> (loss [], stats [len(STAT_NAMES)] detached means, priorities [B] detached).

    batch: device tensors of a replay `Batch`: obs [B, *obs], actions [B, K], target_values/target_rewards
    [B, K+1], target_policies [B, K+1, A], value/reward/policy_mask [B, K+1], weights [B]; with consistency
    also next_obs [B, K, *obs] and next_mask [B, K], or instead of next_obs the targets computed beforehand by
    `consistency_targets` (consistency_targets [B, K, dim]).
    """

    def __init__(self, model: MuZeroNet, value_loss_weight: float, consistency: ConsistencyHeads | None = None,
                 consistency_weight: float = 0.0, channels_last: bool = False, shift_pixels: int = 0,
                 dynamics_grad_scale: float = 0.5, unroll_step_weight: float | None = None):
        super().__init__()
        self.dynamics_grad_scale = dynamics_grad_scale
        self.unroll_step_weight = unroll_step_weight
        self.model = model
        self.consistency = consistency
        self.value_loss_weight = value_loss_weight
        self.consistency_weight = consistency_weight
        self.channels_last = channels_last
        self.shift_pixels = shift_pixels

    def _images(self, obs: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] observations as the representation gets them: shifted (when on) and laid out."""
        if self.shift_pixels and obs.dim() == 4:
            obs = random_shift(obs, self.shift_pixels)
        return _layout(obs, self.channels_last)

    @torch.no_grad()
    def consistency_targets(self, next_obs: torch.Tensor) -> torch.Tensor:
        """next_obs [B, K, *obs] -> [B, K, dim] the stop-gradient projections the consistency loss aims at (the
        network in its current mode: BatchNorm in training mode uses these observations' statistics)."""
        latent = self.model.represent(self._images(next_obs.flatten(0, 1)))
        return self.consistency.project(latent).float().view(next_obs.shape[0], next_obs.shape[1], -1)

    def root_terms(self, obs: torch.Tensor, target_policy: torch.Tensor, target_value: torch.Tensor,
                   policy_mask: torch.Tensor, value_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The unroll's root: obs [B, *obs] and its targets [B, A] / [B] / masks [B] -> (latent, policy loss,
        value loss, priorities, target entropy, KL(search || prior)), per sample."""
        model = self.model
        support = model.support_size
        latent = model.represent(self._images(obs))
        policy_logits, value_logits = model.predict(latent)
        policy_loss = _cross_entropy(policy_logits, target_policy) * policy_mask
        value_loss = _cross_entropy(value_logits, scalar_to_support(target_value, support)) * value_mask
        priorities = (support_to_scalar(value_logits.detach(), support) - target_value).abs()
        with torch.no_grad():
            target = target_policy.float()
            target_entropy = -(target * target.clamp_min(1e-12).log()).sum(-1)
            policy_kl = policy_loss.detach() - target_entropy * policy_mask
        return latent, policy_loss, value_loss, priorities, target_entropy, policy_kl

    def step_terms(self, latent: torch.Tensor, action: torch.Tensor, target_policy: torch.Tensor,
                   target_value: torch.Tensor, target_reward: torch.Tensor, policy_mask: torch.Tensor,
                   value_mask: torch.Tensor, reward_mask: torch.Tensor, consistency_target: torch.Tensor | None,
                   next_mask: torch.Tensor | None, step_scale: float) -> tuple[torch.Tensor, ...]:
        """One unrolled dynamics step (without a value prefix): the latent before it and the step's targets ->
        (next latent, and its weighted policy, value and reward losses, reward error and consistency loss)."""
        model = self.model
        support = model.support_size
        latent, reward_logits = model.dynamics(scale_gradient(latent, self.dynamics_grad_scale), action)
        policy_logits, value_logits = model.predict(latent)
        policy_loss = step_scale * _cross_entropy(policy_logits, target_policy) * policy_mask
        value_loss = step_scale * _cross_entropy(value_logits, scalar_to_support(target_value, support)) * value_mask
        reward_loss = step_scale * _cross_entropy(reward_logits, scalar_to_support(target_reward, support)) * reward_mask
        with torch.no_grad():
            reward_error = step_scale * reward_mask * (
                support_to_scalar(reward_logits.detach(), support) - target_reward).abs()
        consistency_loss = torch.zeros_like(policy_loss)
        if consistency_target is not None:
            online = self.consistency.predict(latent).float()
            cosine = F.cosine_similarity(online, consistency_target, dim=-1, eps=1e-5)
            consistency_loss = step_scale * cosine * next_mask
        return latent, policy_loss, value_loss, reward_loss, reward_error, consistency_loss

    def forward(self, batch: dict[str, torch.Tensor], regions: CompiledRegions | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """regions: run the root, each unrolled step and the consistency targets through their compiled forms
        (`CompiledRegions`); the arithmetic is the same either way."""
        model = self.model
        support = model.support_size
        actions = batch["actions"]
        num_unroll = actions.shape[1]
        step_scale = 1.0 / num_unroll if self.unroll_step_weight is None else self.unroll_step_weight
        grad_scale = self.dynamics_grad_scale
        policy_mask, value_mask, reward_mask = batch["policy_mask"], batch["value_mask"], batch["reward_mask"]
        root_terms = self.root_terms if regions is None else regions.root
        latent, policy_loss, value_loss, priorities, target_entropy, policy_kl = root_terms(
            batch["obs"], batch["target_policies"][:, 0], batch["target_values"][:, 0], policy_mask[:, 0],
            value_mask[:, 0])
        reward_loss = torch.zeros_like(policy_loss)
        consistency_loss = torch.zeros_like(policy_loss)
        reward_error = torch.zeros_like(priorities)

        use_consistency = self.consistency is not None and self.consistency_weight > 0
        targets = None
        if use_consistency:
            targets = batch.get("consistency_targets")
            if targets is None:
                targets = (self.consistency_targets if regions is None else regions.targets)(batch["next_obs"])

        if not model.value_prefix:
            step_terms = self.step_terms if regions is None else regions.step
            for k in range(1, num_unroll + 1):
                latent, policy_k, value_k, reward_k, error_k, consistency_k = step_terms(
                    latent, actions[:, k - 1], batch["target_policies"][:, k], batch["target_values"][:, k],
                    batch["target_rewards"][:, k], policy_mask[:, k], value_mask[:, k], reward_mask[:, k],
                    None if targets is None else targets[:, k - 1],
                    batch["next_mask"][:, k - 1] if use_consistency else None, step_scale)
                policy_loss = policy_loss + policy_k
                value_loss = value_loss + value_k
                reward_loss = reward_loss + reward_k
                reward_error = reward_error + error_k
                if use_consistency:
                    consistency_loss = consistency_loss - consistency_k
        else:
            value_targets = scalar_to_support(batch["target_values"], support)  # [B, K+1, bins]
            reward_targets = scalar_to_support(value_prefix_targets(
                batch["target_rewards"] * reward_mask, model.prefix_horizon), support)
            state = model.prefix_state(actions.shape[0], actions.device, latent.dtype)
            for k in range(1, num_unroll + 1):
                latent = model.transition(scale_gradient(latent, grad_scale), actions[:, k - 1])
                reward_logits, state = model.prefix_step(latent, state)
                if k % model.prefix_horizon == 0:
                    state = model.prefix_state(actions.shape[0], actions.device, latent.dtype)
                policy_logits, value_logits = model.predict(latent)
                policy_loss = policy_loss + step_scale * _cross_entropy(
                    policy_logits, batch["target_policies"][:, k]
                ) * policy_mask[:, k]
                value_loss = value_loss + step_scale * _cross_entropy(value_logits, value_targets[:, k]) * value_mask[:, k]
                reward_loss = reward_loss + step_scale * _cross_entropy(
                    reward_logits, reward_targets[:, k]
                ) * reward_mask[:, k]
                if use_consistency:
                    online = self.consistency.predict(latent).float()
                    cosine = F.cosine_similarity(online, targets[:, k - 1], dim=-1, eps=1e-5)
                    consistency_loss = consistency_loss - step_scale * cosine * batch["next_mask"][:, k - 1]

        per_sample = policy_loss + self.value_loss_weight * value_loss + reward_loss
        if use_consistency:
            per_sample = per_sample + self.consistency_weight * consistency_loss
        loss = (batch["weights"] * per_sample).mean()
        stats = torch.stack([policy_loss.mean(), value_loss.mean(), reward_loss.mean(), consistency_loss.mean(),
                             (priorities * value_mask[:, 0]).mean(), reward_error.mean(), target_entropy.mean(),
                             policy_kl.mean()])
        return loss, stats.detach(), priorities


class CompiledRegions:
    """A `MuZeroLoss` whose root, unrolled step and consistency targets are compiled each on its own
    (`learner.compile_regions`): the K unrolled steps share one traced graph instead of K copies of it in one
    whole-loss graph, so compiling takes a fraction of the time; the loss's few glue ops between them stay eager.
    Under the learner's step graph (one CUDA graph for the whole update) the extra graph boundaries add no
    launches. `compile` is torch.compile with the learner's mode, or any callable of the same shape. only: the
    REGIONS to compile (the others run eagerly), for the background compile's helpers, which compile one region
    each in parallel into the cache that the learner's compile of all of them then reads."""

    REGIONS = ("root", "step", "targets")

    def __init__(self, loss: MuZeroLoss, compile, only: tuple[str, ...] | None = None):
        unknown = sorted(set(only or ()) - set(self.REGIONS))
        if unknown:
            raise ValueError(f"compile regions {unknown}: expected some of {self.REGIONS}")
        self.loss = loss
        eager = {"root": loss.root_terms, "step": loss.step_terms, "targets": loss.consistency_targets}
        for name, fn in eager.items():
            setattr(self, name, compile(fn) if only is None or name in only else fn)

    def __call__(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.loss(batch, regions=self)


def value_prefix_targets(rewards: torch.Tensor, horizon: int) -> torch.Tensor:
    """[B, K+1] rewards (index k: the reward of unroll step k; index 0 unused) -> value-prefix targets: the
    sum of the rewards since the last restart, restarting after every `horizon` steps."""
    prefixes = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for k in range(1, rewards.shape[1]):
        running = running + rewards[:, k]
        prefixes[:, k] = running
        if k % horizon == 0:
            running = torch.zeros_like(running)
    return prefixes


def random_shift(images: torch.Tensor, pad: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """[N, C, H, W] images, each moved by its own random offset in [-pad, pad] along each axis, the edge pixels
    replicated into what it uncovers (a replicate-pad then a random crop, done as one gather on clamped indices,
    so uint8 stays uint8)."""
    n, _, height, width = images.shape
    offsets = torch.randint(0, 2 * pad + 1, (2, n), device=images.device, generator=generator) - pad
    rows = (torch.arange(height, device=images.device) + offsets[0, :, None]).clamp(0, height - 1)  # [N, H]
    cols = (torch.arange(width, device=images.device) + offsets[1, :, None]).clamp(0, width - 1)  # [N, W]
    rows = rows[:, None, :, None].expand(-1, images.shape[1], -1, width)
    cols = cols[:, None, None, :].expand(-1, images.shape[1], height, -1)
    return images.gather(2, rows).gather(3, cols)


def _layout(obs: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """[N, C, H, W] images in NHWC memory order when asked (other shapes untouched)."""
    if channels_last and obs.dim() == 4:
        return obs.contiguous(memory_format=torch.channels_last)
    return obs


@torch.no_grad()
def bootstrap_values(target: MuZeroNet, obs: torch.Tensor, channels_last: bool = False) -> torch.Tensor:
    """obs [B, K+1, *obs_shape] -> [B, K+1] value estimates of the target network."""
    latent = target.represent(_layout(obs.flatten(0, 1), channels_last))
    _, value_logits = target.predict(latent)
    return support_to_scalar(value_logits, target.support_size).view(obs.shape[0], obs.shape[1])

