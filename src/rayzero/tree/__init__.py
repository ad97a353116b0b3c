"""Batched MuZero / Gumbel MuZero tree search in PyTorch (CPU, CUDA, fused Triton kernels, CUDA graphs).

Public API: `search(root, recurrent_fn, num_simulations, config, invalid_actions, generator)` and its types.
"""

from rayzero.tree.base import (
    NumpyRecurrentFn,
    RecurrentFn,
    RecurrentOutput,
    RootOutput,
    SearchConfig,
    SearchOutput,
)
from rayzero.tree.noise import SearchNoise, sample_noise
from rayzero.tree.search import search
from rayzero.tree.tree import NO_PARENT, ROOT, UNVISITED, Tree, tree_nbytes

__all__ = [
    "NO_PARENT",
    "NumpyRecurrentFn",
    "ROOT",
    "UNVISITED",
    "RecurrentFn",
    "RecurrentOutput",
    "RootOutput",
    "SearchConfig",
    "SearchNoise",
    "SearchOutput",
    "Tree",
    "sample_noise",
    "search",
    "tree_nbytes",
]
