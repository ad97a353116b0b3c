"""Building blocks shared by the networks (networks.py, transformer.py): MLPs, residual blocks, latent scaling."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def scale_latent(latent: torch.Tensor) -> torch.Tensor:
    flat = latent.flatten(1)
    low = flat.min(1, keepdim=True).values
    high = flat.max(1, keepdim=True).values
    return ((flat - low) / (high - low).clamp_min(1e-5)).view_as(latent)


def mlp(sizes: list[int], final_activation: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or final_activation:
            layers.append(nn.LayerNorm(sizes[i + 1]))
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class ResidualBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(out)))
