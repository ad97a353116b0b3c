"""Per-search state shared by the torch path (search.py) and the fused kernels (kernels.py).

Its own module so that neither of the two imports the other for it.
"""

from __future__ import annotations

import torch

from rayzero.tree.action_selection import puct_coefficients
from rayzero.tree.base import SearchConfig
from rayzero.tree.tree import EDGE_CHANNELS, Tree


class KernelPath:
    """The fused walk's outputs (buffers reused by every simulation of a search): nodes/actions [B, L],
    depth [B], the leaf edge (parent, action) [B] and parent's index in the [B * N] node views."""

    __slots__ = ("action", "actions", "depth", "flat_parent", "nodes", "parent")

    def __init__(self, ctx: _Context) -> None:
        B, L = ctx.B, ctx.num_simulations + 1
        i64 = {"dtype": torch.int64, "device": ctx.device}
        self.nodes = torch.zeros((B, L), **i64)
        self.actions = torch.zeros((B, L), **i64)
        self.depth = torch.zeros((B,), **i64)
        self.parent = torch.zeros((B,), **i64)
        self.action = torch.zeros((B,), **i64)
        self.flat_parent = torch.zeros((B,), **i64)


class KernelWave:
    """The fused walks of a virtual-loss wave (K walks per tree, walk-major): nodes/actions [K, B, L], depth,
    the leaf edge (parent, action), its parent's index in the [B * N] node views, the leaf node and whether an
    earlier walk of the wave had claimed it (dup, int8) [K, B] each."""

    __slots__ = ("action", "actions", "depth", "dup", "flat_parent", "leaf", "nodes", "parent")

    def __init__(self, ctx: _Context) -> None:
        K, B, L = ctx.K, ctx.B, ctx.num_simulations + 1
        i64 = {"dtype": torch.int64, "device": ctx.device}
        self.nodes = torch.zeros((K, B, L), **i64)
        self.actions = torch.zeros((K, B, L), **i64)
        self.depth = torch.zeros((K, B), **i64)
        self.parent = torch.zeros((K, B), **i64)
        self.action = torch.zeros((K, B), **i64)
        self.flat_parent = torch.zeros((K, B), **i64)
        self.leaf = torch.zeros((K, B), **i64)
        self.dup = torch.zeros((K, B), dtype=torch.int8, device=ctx.device)


class _Context:
    """Per-search constants and flat views shared by the steps (no tensors are allocated per step here)."""

    def __init__(
        self,
        tree: Tree,
        config: SearchConfig,
        invalid: torch.Tensor | None,
        n: int,
        K: int,
        device: torch.device,
    ) -> None:
        B, N, A = tree.batch_size, tree.num_nodes, tree.num_actions
        self.config = config
        self.gumbel = config.policy == "gumbel"
        self.invalid = invalid
        self.num_simulations = n
        self.K = K
        self.device = device
        self.on_cpu = device.type == "cpu"
        self.B, self.N, self.A = B, N, A
        self.rows = torch.arange(B, device=device) * N  # [B] offset of each tree's node 0 in [B * N] views
        self.edges_flat = tree.edges.view(B * N, EDGE_CHANNELS, A)
        self.edges_1d = tree.edges.view(-1)
        self.children_flat = tree.children_index.view(-1)
        self.visits_flat = tree.node_visits.view(-1)
        self.sums_flat = tree.value_sums.view(-1)
        self.raw_flat = tree.raw_values.view(-1)
        self.vv_flat = tree.virtual_visits.view(B * N, A) if tree.virtual_visits is not None else None
        self.steps = torch.arange(n + 1, device=device)  # [L] path positions
        # Node visits never exceed 1 + n (+ K - 1 pending visits with virtual loss).
        self.coef = puct_coefficients(n + K + 1, config.pb_c_init, config.pb_c_base, device)
        self.root_log_prior: torch.Tensor | None = None  # [B, A] gumbel: log of masked root priors
        self.root_gumbel: torch.Tensor | None = None  # [B, A] gumbel: scaled Gumbel noise
        self.considered: torch.Tensor | None = None  # [B, n] gumbel: schedule row of each tree
        self.low: torch.Tensor | None = None  # [B, 1] muzero: Q normalisation bounds of the current walk
        self.spread: torch.Tensor | None = None
        self.triton_path: KernelPath | None = None  # the fused walk's buffers
        self.triton_wave: KernelWave | None = None  # the fused virtual-loss walks' buffers
