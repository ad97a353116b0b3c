"""Types of the batched tree search: inputs, outputs and the search configuration.

Shapes: B = batch of roots, A = number of actions, N = num_simulations + 1 nodes per tree.
This module holds types (and the numpy recurrent_fn wrapper with its output check); the search lives in
`search.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple
from collections.abc import Callable

import numpy as np
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
    virtual_loss_max_trees: int = 0
    """Virtual loss only in searches of at most this many trees (a search of more walks one path per wave);
    0 = in every search. A small search is bound by its chain of network calls, which K walks per wave shorten
    (its decision latency); a large one keeps the GPU busy either way, and keeps one walk per wave."""
    max_nodes: int = 0
    """Cap on nodes per tree (0 = num_simulations + 1); a search needing more raises a clear error."""
    triton: bool = True
    """CUDA: run the selection walk and the backup as fused Triton kernels (kernels.py) when triton imports (with
    virtual loss too); False = the torch path (the `use_triton` argument of `search()` wins when given)."""
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
            ("virtual_loss_max_trees", self.virtual_loss_max_trees >= 0, ">= 0 (0 = every search)"),
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


class NumpyRecurrentFn:
    """A recurrent_fn written on numpy arrays: `search(root, NumpyRecurrentFn(fn), ...)`.

    fn(action [B'] int64 ndarray, embedding [B', ...] ndarray (or a pytree of them, as the root's)) ->
    (RecurrentOutput(reward [B'], discount [B'], prior_logits [B', A], value [B']) of float32 ndarrays
    (float64 is accepted and rounded to float32, as the torch protocol's .float()), next_embedding of the
    input embedding's structure, dtypes and trailing shapes).

    The compiled CPU tree (tree/cpu.py) calls `fn` directly on views of its own buffers and reads its outputs
    without torch tensors: for cheap CPU models (tables, simulators, numba code) that saves the tensor
    conversions of every wave. Each wave's inputs are fresh (fn may keep them); its outputs are read before
    the next call (fn may reuse its output buffers). Everywhere else (the torch path, CUDA, pytree or large
    embeddings) the wrapper is an ordinary torch recurrent_fn: `__call__` converts the tensors to numpy and
    the results back, so a search gives the same results whichever path runs. bfloat16 embeddings have no
    numpy dtype and are refused.
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[np.ndarray, Any], tuple[RecurrentOutput, Any]]) -> None:
        if not callable(fn):
            raise ValueError(f"NumpyRecurrentFn needs a callable, got {type(fn).__name__}")
        self.fn = fn

    def __call__(self, action: torch.Tensor, embedding: Any) -> tuple[RecurrentOutput, Any]:
        """The torch protocol: tensors to numpy (via the host), `fn`, its checked outputs back as tensors."""
        device = action.device
        emb = numpy_map(_host_array, embedding)
        out, nxt = self.fn(_host_array(action), emb)
        out, nxt = check_numpy_output(out, nxt, action.shape[0], None, emb)
        return (
            RecurrentOutput(*(torch.from_numpy(x).to(device) for x in out)),
            numpy_map(lambda x: torch.from_numpy(x).to(device), nxt),
        )


def numpy_map(fn: Callable[[Any], Any], x: Any) -> Any:
    """Apply `fn` to every array or tensor leaf of a (possibly nested) tuple/list/dict."""
    if isinstance(x, (np.ndarray, torch.Tensor)):
        return fn(x)
    if isinstance(x, dict):
        return {k: numpy_map(fn, v) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # NamedTuple
        return type(x)(*(numpy_map(fn, v) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(numpy_map(fn, v) for v in x)
    raise ValueError(f"NumpyRecurrentFn: embedding leaves must be numpy arrays, got {type(x).__name__}")


def _host_array(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        raise ValueError(
            "NumpyRecurrentFn: a bfloat16 embedding has no numpy dtype; use a torch recurrent_fn or another dtype"
        )
    return t.detach().cpu().numpy()


_NUMPY_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_NUMPY_F32 = np.dtype(np.float32)


def check_numpy_output(out: Any, nxt: Any, rows: int, A: int | None, embedding: Any) -> tuple[tuple, Any]:
    """A NumpyRecurrentFn's return value, checked (ValueError naming the bad value and what is valid):
    returns (the four outputs as C-contiguous float32 arrays, next_embedding with C-contiguous leaves).
    `embedding`: the call's input (its structure, leaf dtypes and trailing shapes are what next_embedding
    must have); A = None: prior_logits' width is left to search()'s own check."""
    who = "recurrent_fn (NumpyRecurrentFn)"
    if not isinstance(out, RecurrentOutput):
        raise ValueError(  # noqa: TRY004
            f"{who} must return (RecurrentOutput, next_embedding) of numpy arrays, got {type(out).__name__} first"
        )
    fields = []
    for name, x in zip(RecurrentOutput._fields, out):
        logits = name == "prior_logits"
        want = f"[{rows}, {A if A is not None else 'A'}]" if logits else f"[{rows}]"
        if not isinstance(x, np.ndarray):
            raise ValueError(f"{who} returned {name} of type {type(x).__name__}; expected a float32 ndarray {want}")
        shape_ok = (x.ndim == 2 and x.shape[0] == rows and A in (None, x.shape[1])) if logits else x.shape == (rows,)
        if not shape_ok:
            raise ValueError(f"{who} returned {name} of shape {list(x.shape)}; expected {want}")
        if x.dtype not in _NUMPY_FLOATS:
            raise ValueError(
                f"{who} returned {name} of dtype {x.dtype}; expected float32 (or float64, rounded to float32)"
            )
        fields.append(np.ascontiguousarray(x, _NUMPY_F32))
    try:
        pairs = list(zip(_leaves(nxt), _leaves(embedding), strict=True))
    except ValueError:
        raise ValueError(
            f"{who} returned a next_embedding of another structure than its input embedding's "
            f"({type(nxt).__name__} for {type(embedding).__name__})"
        ) from None
    for new, old in pairs:
        want = f"[{rows}{''.join(f', {d}' for d in old.shape[1:])}] of dtype {old.dtype} like the input embedding"
        if not isinstance(new, np.ndarray) or new.shape != (rows, *old.shape[1:]) or new.dtype != old.dtype:
            got = f"{list(new.shape)} of dtype {new.dtype}" if isinstance(new, np.ndarray) else type(new).__name__
            raise ValueError(f"{who} returned next_embedding {got}; expected an ndarray {want}")
    return tuple(fields), numpy_map(np.ascontiguousarray, nxt)


def _leaves(x: Any) -> list:
    out: list = []
    numpy_map(out.append, x)
    return out


class SearchOutput(NamedTuple):
    """What a search returns for each root."""

    action: torch.Tensor  # [B] int64, the action to play
    action_weights: torch.Tensor  # [B, A], policy target (visit distribution or Gumbel's improved policy)
    visit_counts: torch.Tensor  # [B, A], visits of the root's children
    root_value: torch.Tensor  # [B], the search's value estimate at the root
    qvalues: torch.Tensor  # [B, A], Q of the root's children (0 where unvisited)
    tree: Any  # the final tree (tree.Tree), for tests and inspection
