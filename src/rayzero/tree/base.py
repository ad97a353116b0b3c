"""Types of the batched tree search: inputs, outputs and the search configuration.

Shapes: B = batch of roots, A = number of actions, N = num_simulations + 1 nodes per tree.
This module holds types only; the search lives in `search.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple
from collections.abc import Callable

import torch

POLICIES = ("muzero", "gumbel")
CPU_BACKENDS = ("auto", "numba", "torch")


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """Settings of one batched search (the `search` section of the run config)."""

    num_simulations: int = 50
    """Simulations per search (the `search()` argument of the same name wins when both are given)."""
    policy: str = "muzero"
    """'muzero' (PUCT with Dirichlet root noise) or 'gumbel' (Gumbel MuZero, sequential halving)."""
    pb_c_init: float = 1.25
    """PUCT exploration constant c1."""
    pb_c_base: float = 19652.0
    """PUCT exploration constant c2."""
    dirichlet_alpha: float = 0.3
    """Concentration of the Dirichlet noise added to root priors (muzero policy)."""
    dirichlet_fraction: float = 0.25
    """Weight of the root noise; 0 turns noise off."""
    temperature: float = 1.0
    """Temperature applied to root visit counts when choosing the action; 0 = argmax."""
    max_num_considered_actions: int = 16
    """Gumbel: actions sampled at the root by Gumbel-top-k (m)."""
    gumbel_scale: float = 1.0
    """Gumbel: scale of the Gumbel noise; 0 makes the search deterministic."""
    value_scale: float = 0.1
    """Gumbel: sigma(q) = (maxvisit_init + max_n) * value_scale * q."""
    maxvisit_init: float = 50.0
    """Gumbel: see value_scale."""
    min_q_range: float = 0.0
    """MuZero: the smallest max - min Q range of a tree that normalises its Q values (a tree that spans less is
    divided by this instead). EfficientZero and LightZero use 0.01, so that rounding-level Q differences in a
    tree the values do not yet tell apart are not stretched to [0, 1]; 0 = MuZero's and mctx's rule."""
    virtual_loss: int = 1
    """Simulations per tree per wave (K); K > 1 applies virtual loss so the K paths differ."""
    max_nodes: int = 0
    """Cap on nodes per tree (0 = num_simulations + 1); a search needing more raises a clear error."""
    triton: bool = True
    """CUDA: run the selection walk and the backup as fused Triton kernels (kernels.py) when triton imports and
    virtual_loss=1; False = the torch path (the `use_triton` argument of `search()` wins when given)."""
    device: str = "auto"
    """With a central inference actor on a GPU, where self-play's searches run: 'gpu' (whole searches as
    CUDA-graph replays in the inference actor), 'cpu' (each self-play actor walks its trees on its CPU and sends
    one batch of leaves per simulation wave; the latents stay on the GPU as handles), 'auto' = 'gpu'."""
    cpu_backend: str = "auto"
    """Tree walk of searches on CPU tensors: 'numba' (compiled, tree/cpu.py), 'torch' (the eager torch
    path), 'auto' = numba when it imports (and RAYZERO_TREE_NUMBA != 0), else torch. Same results."""

    def __post_init__(self) -> None:
        checks = [
            ("num_simulations", self.num_simulations >= 1, "an integer >= 1"),
            ("policy", self.policy in POLICIES, f"one of {POLICIES}"),
            ("pb_c_init", self.pb_c_init > 0, "> 0"),
            ("pb_c_base", self.pb_c_base > 0, "> 0"),
            ("dirichlet_alpha", self.dirichlet_alpha > 0, "> 0"),
            ("dirichlet_fraction", 0.0 <= self.dirichlet_fraction <= 1.0, "in [0, 1]"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("max_num_considered_actions", self.max_num_considered_actions >= 1, ">= 1"),
            ("gumbel_scale", self.gumbel_scale >= 0, ">= 0"),
            ("min_q_range", self.min_q_range >= 0, ">= 0 (0 = no floor)"),
            ("virtual_loss", self.virtual_loss >= 1, ">= 1"),
            ("max_nodes", self.max_nodes >= 0, ">= 0"),
            ("device", self.device in ("auto", "gpu", "cpu"), "'auto', 'gpu' or 'cpu'"),
            ("cpu_backend", self.cpu_backend in CPU_BACKENDS, f"one of {CPU_BACKENDS}"),
        ]
        for name, ok, valid in checks:
            if not ok:
                raise ValueError(f"search.{name}={getattr(self, name)!r} is invalid: must be {valid}")


class RootOutput(NamedTuple):
    """The network's output at the roots."""

    prior_logits: torch.Tensor  # [B, A]
    value: torch.Tensor  # [B]
    embedding: Any  # [B, ...] tensor (or a pytree of [B, ...] tensors)


class RecurrentOutput(NamedTuple):
    """The network's output for one step from a batch of nodes."""

    reward: torch.Tensor  # [B]
    discount: torch.Tensor  # [B]; 0 marks a terminal transition
    prior_logits: torch.Tensor  # [B, A]
    value: torch.Tensor  # [B]


# recurrent_fn(action [B] int64, embedding [B, ...]) -> (RecurrentOutput, next_embedding [B, ...])
RecurrentFn = Callable[[torch.Tensor, Any], "tuple[RecurrentOutput, Any]"]


class SearchOutput(NamedTuple):
    """What a search returns for each root."""

    action: torch.Tensor  # [B] int64, the action to play
    action_weights: torch.Tensor  # [B, A], policy target (visit distribution or Gumbel's improved policy)
    visit_counts: torch.Tensor  # [B, A], visits of the root's children
    root_value: torch.Tensor  # [B], the search's value estimate at the root
    qvalues: torch.Tensor  # [B, A], Q of the root's children (0 where unvisited)
    tree: Any  # the final tree (tree.Tree), for tests and inspection
