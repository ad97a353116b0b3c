"""Random inputs of a search, sampled with an explicit torch.Generator, or precomputed by the caller.

Shapes: B = roots, A = actions. This module owns every random draw a search makes:

* root noise of the MuZero policy: log-Gamma(alpha) samples [B, A]. The search turns them into a
  Dirichlet(alpha) sample over each row's *valid* actions with a masked softmax (a Dirichlet is Gamma
  samples normalised; doing it in log space cannot underflow for small alpha);
* root noise of the Gumbel policy: standard Gumbel(0, 1) samples [B, A] (the search scales them);
* action noise: standard Gumbel samples [B, A] for sampling the played action from visits^(1/T) with the
  Gumbel-max trick (argmax(log w / T + g) is a draw from w^(1/T) / sum), which needs no multinomial.

Gamma sampling: torch's Dirichlet/Gamma samplers take no generator, so Gamma(a) is drawn here with
Marsaglia & Tsang's method from torch.randn/torch.rand given the generator. The rejection loop is
unrolled into a fixed number of proposals (GAMMA_PROPOSALS, evaluated at once; the first accepted one is
kept) so the draw has a fixed shape and no host sync. For a >= 1 a proposal is accepted with probability
> 0.95, so all of them are rejected with probability < 1e-10; then the proposal's mode d is used. For
a < 1 we draw Gamma(a + 1) and multiply by U^(1/a) (in log space: + log(U) / a).

For CUDA-graph capture, draw a `SearchNoise` with `sample_noise` outside the graph and copy it into the
graph's static buffers (see capture.py): the captured search then only reads tensors.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from rayzero.tree.base import SearchConfig

GAMMA_PROPOSALS = 8


class SearchNoise(NamedTuple):
    """Precomputed random inputs of one search; a None field is drawn inside `search` if it is needed."""

    root: torch.Tensor | None = None
    """[B, A]: log-Gamma(dirichlet_alpha) samples (policy 'muzero') or standard Gumbel (policy 'gumbel')."""
    action: torch.Tensor | None = None
    """[B, A]: standard Gumbel samples for temperature sampling of the played action (policy 'muzero')."""
    root_fraction: torch.Tensor | None = None
    """[B] per-row settings of a batch that mixes requests (the inference actor's merged searches), None = the
    config's: policy 'muzero', each row's Dirichlet fraction (it replaces config.dirichlet_fraction, which must be
    > 0 for any noise to enter); policy 'gumbel', each row's factor on config.gumbel_scale."""
    temperature: torch.Tensor | None = None
    """[B] each row's temperature for the played action (policy 'muzero'; 0 = argmax of visits), replacing
    config.temperature, which must be > 0 so that `action` is drawn. None = the config's."""


def row_defaults(config: SearchConfig) -> dict[str, float]:
    """The per-row settings (SearchNoise.root_fraction, temperature) that give every row `config`'s own."""
    if config.policy == "muzero":
        return {"root_fraction": config.dirichlet_fraction, "temperature": config.temperature}
    return {"root_fraction": 1.0}


def _uniform_open(
    shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """Uniform samples in (0, 1): torch.rand gives [0, 1), and 0 would make log() infinite."""
    u = torch.rand(shape, generator=generator, device=device)
    return u.clamp_min(torch.finfo(torch.float32).tiny)


def sample_gumbel(
    shape: tuple[int, ...], *, generator: torch.Generator | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Standard Gumbel(0, 1) samples of `shape`: -log(-log(U))."""
    u = _uniform_open(shape, generator, torch.device(device))
    return -torch.log(-torch.log(u))


def sample_log_gamma(
    alpha: float,
    shape: tuple[int, ...],
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """log of Gamma(alpha, 1) samples of `shape` (Marsaglia-Tsang, fixed number of proposals)."""
    if not alpha > 0:
        raise ValueError(f"alpha={alpha!r} is invalid: the Gamma concentration must be > 0")
    device = torch.device(device)
    a = alpha + 1.0 if alpha < 1.0 else alpha
    d = a - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    x = torch.randn((GAMMA_PROPOSALS, *shape), generator=generator, device=device)
    u = _uniform_open((GAMMA_PROPOSALS, *shape), generator, device)
    v = (1.0 + c * x) ** 3
    positive = v > 0
    log_v = torch.log(torch.where(positive, v, torch.ones_like(v)))
    accept = positive & (torch.log(u) < 0.5 * x * x + d - d * v + d * log_v)
    # argmax over {0, 1} returns the first accepted proposal (first maximum).
    first = accept.to(torch.uint8).argmax(dim=0, keepdim=True)
    log_sample = math.log(d) + torch.gather(log_v, 0, first).squeeze(0)
    log_sample = torch.where(accept.any(dim=0), log_sample, torch.full_like(log_sample, math.log(d)))
    if alpha < 1.0:
        log_sample = log_sample + torch.log(_uniform_open(tuple(shape), generator, device)) / alpha
    return log_sample


def sample_dirichlet(
    alpha: float,
    shape: tuple[int, ...],
    *,
    invalid: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Dirichlet(alpha) samples over the last axis of `shape`, restricted to the entries not `invalid`."""
    return dirichlet_from_log_gamma(
        sample_log_gamma(alpha, shape, generator=generator, device=device), invalid
    )


def dirichlet_from_log_gamma(log_gamma: torch.Tensor, invalid: torch.Tensor | None) -> torch.Tensor:
    """[B, A] log-Gamma samples -> Dirichlet over each row's valid actions (0 on invalid ones)."""
    if invalid is not None:
        log_gamma = log_gamma.masked_fill(invalid, float("-inf"))
    return torch.softmax(log_gamma, dim=-1)


def sample_noise(
    config: SearchConfig,
    batch_size: int,
    num_actions: int,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> SearchNoise:
    """Draw every random input a search with `config` needs ([B, A] each; None where not needed)."""
    shape = (batch_size, num_actions)
    if config.policy == "gumbel":
        root = sample_gumbel(shape, generator=generator, device=device) if config.gumbel_scale > 0 else None
        return SearchNoise(root=root, action=None)
    root = None
    if config.dirichlet_fraction > 0:
        root = sample_log_gamma(config.dirichlet_alpha, shape, generator=generator, device=device)
    action = sample_gumbel(shape, generator=generator, device=device) if config.temperature > 0 else None
    return SearchNoise(root=root, action=action)
