"""Compiled CPU tree: the selection walk, the expansion writes and the backup of `search()` for CPU tensors,
as numba-compiled loops over the B trees of a wave (one compiled call each per wave; search.py keeps the root
initialisation, the outputs and the loop that calls `recurrent_fn`). The code reads and writes the torch
`Tree`'s own tensors through numpy views, in float32 and in the torch path's order, so MuZero trees are
bit-identical to the torch path and Gumbel ones equal within float tolerance.

Why numba: pip wheels for every platform and no compiler at install time (a C++ extension needs one, or a
wheel per platform), native loops over numpy arrays, an on-disk cache so only a machine's first process
compiles, and `nogil=True`, so self-play threads walk trees while another thread waits for the network.
Single-threaded on purpose: the actors already use every core. `search.cpu_backend=torch` (or
RAYZERO_TREE_NUMBA=0) selects the torch path. How a wave runs and the equality argument in full:
docs/architecture.md; timings: docs/benchmarks.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rayzero.tree.base import RecurrentOutput
from rayzero.tree.tree import (
    DISCOUNT,
    NO_PARENT,
    PRIOR,
    REWARD,
    UNVISITED,
    VALUE,
    VISITS,
    tree_map,
    tree_map2,
)

if TYPE_CHECKING:  # pragma: no cover
    from rayzero.tree.base import RecurrentFn
    from rayzero.tree.tree import Tree

try:
    from numba import njit

    _NUMBA = True
except Exception:  # noqa: BLE001 - ImportError, or a broken install (llvmlite)
    _NUMBA = False


def numba_importable() -> bool:
    """Whether numba imports here."""
    return _NUMBA


def use_numba(device: torch.device, cpu_backend: str) -> bool:
    """Whether a search on `device` with `search.cpu_backend` runs the compiled tree (ValueError if
    'numba' was asked for and cannot be used)."""
    if device.type != "cpu" or cpu_backend == "torch":
        return False
    enabled = _NUMBA and os.environ.get("RAYZERO_TREE_NUMBA", "1") != "0"
    if cpu_backend == "numba" and not enabled:
        why = "numba does not import" if not _NUMBA else "RAYZERO_TREE_NUMBA=0 is set"
        raise ValueError(f"search.cpu_backend='numba' but {why}: pip install numba, or use 'auto'/'torch'")
    return enabled


# ----------------------------------------------------------------------------------- compiled kernels

_F32 = np.float32
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_INF = np.float32(np.inf)
_NEG_INF = np.float32(-np.inf)
_TINY = np.float32(np.finfo(np.float32).tiny)  # qtransforms.mixed_value's clamp
_RESCALE_EPSILON = np.float32(1e-8)  # qtransforms.RESCALE_EPSILON
_LOW_LOGIT = np.float32(-1e9)  # action_selection.LOW_LOGIT


def _identity(fn: Any) -> Any:
    return fn


# error_model="numpy": float division by zero gives inf/nan as in torch instead of raising.
_jit = njit(cache=True, nogil=True, error_model="numpy") if _NUMBA else _identity


@_jit
def _argmax(score: np.ndarray) -> int:
    """First maximum, NaN counting as the maximum (torch.argmax)."""
    best = score[0]
    best_a = 0
    if best != best:
        return 0
    for a in range(1, score.shape[0]):
        s = score[a]
        if s != s:
            return a
        if s > best:
            best = s
            best_a = a
    return best_a


@_jit
def _puct_scores(edges, node_visits, value_sums, vv, use_vv, coef, b, node, low, spread, score):
    """action_selection.muzero_scores of node `node` of tree b into score [A] (same float32 operations)."""
    A = score.shape[0]
    nv = node_visits[b, node]
    first_play = (value_sums[b, node] / nv - low) / spread  # action_selection.first_play_q
    first_play = min(max(first_play, _ZERO), _ONE)
    if use_vv:
        pending = _ZERO
        for a in range(A):
            pending += vv[b, node, a]
        c = coef[np.int64(nv + pending)]
    else:
        c = coef[np.int64(nv)]
    for a in range(A):
        visits = edges[b, node, VISITS, a]
        if visits > _ZERO:
            q = edges[b, node, REWARD, a] + edges[b, node, DISCOUNT, a] * edges[b, node, VALUE, a]
            qn = (q - low) / spread
        else:
            qn = first_play
        if use_vv:
            pend = vv[b, node, a]
            eff = visits + pend
            if visits > _ZERO:
                qn = qn * visits / max(eff, _ONE)
            elif pend > _ZERO:
                qn = _ZERO
            visits = eff
        score[a] = qn + edges[b, node, PRIOR, a] * c / (_ONE + visits)


@_jit
def _sigma_completed(edges, raw_values, b, node, maxvisit_init, value_scale, out):
    """qtransforms.completed_qvalues of node `node` of tree b into out [A]; returns sum of child visits."""
    A = out.shape[0]
    sum_visits = _ZERO
    sum_p = _ZERO
    sum_pq = _ZERO
    max_visits = _NEG_INF
    for a in range(A):
        visits = edges[b, node, VISITS, a]
        q = edges[b, node, REWARD, a] + edges[b, node, DISCOUNT, a] * edges[b, node, VALUE, a]
        out[a] = q
        sum_visits += visits
        max_visits = max(max_visits, visits)
        if visits > _ZERO:
            p = max(edges[b, node, PRIOR, a], _TINY)
            sum_p += p
            sum_pq += p * q
    weighted_q = sum_pq / max(sum_p, _TINY)
    mixed = (raw_values[b, node] + sum_visits * weighted_q) / (sum_visits + _ONE)
    lo = _INF
    hi = _NEG_INF
    for a in range(A):
        if not edges[b, node, VISITS, a] > _ZERO:
            out[a] = mixed
        lo = min(lo, out[a])
        hi = max(hi, out[a])
    spread = max(hi - lo, _RESCALE_EPSILON)
    scale = (maxvisit_init + max_visits) * value_scale
    for a in range(A):
        out[a] = scale * ((out[a] - lo) / spread)
    return sum_visits


@_jit
def _gumbel_interior_scores(edges, raw_values, log_priors, b, node, maxvisit_init, value_scale, score):
    """action_selection.gumbel_interior_scores: softmax(log prior + sigma) - N(a) / (1 + sum N)."""
    A = score.shape[0]
    sum_visits = _sigma_completed(edges, raw_values, b, node, maxvisit_init, value_scale, score)
    top = _NEG_INF
    for a in range(A):
        score[a] = log_priors[b, node, a] + score[a]
        top = max(top, score[a])
    total = _ZERO
    for a in range(A):
        score[a] = np.exp(score[a] - top)
        total += score[a]
    denom = _ONE + sum_visits
    for a in range(A):
        score[a] = score[a] / total - edges[b, node, VISITS, a] / denom


@_jit
def _select_wave(
    edges,  # [B, N, C, A] f32
    node_visits,  # [B, N] f32
    value_sums,  # [B, N] f32
    raw_values,  # [B, N] f32
    log_priors,  # [B, N, A] f32 log of each non-root node's priors (gumbel), written by the expansion
    children,  # [B, N, A] i64
    vv,  # [B, N, A] f32 pending visits (virtual loss); unused unless num_walks > 1
    coef,  # [n + K + 2] f32 PUCT coefficient table
    value_min,  # [B] f32
    value_max,  # [B] f32
    invalid,  # [B, A] bool; unused unless has_invalid
    has_invalid,
    gumbel,
    root_gumbel,  # [B, A] f32 scaled Gumbel noise (gumbel)
    root_log_prior,  # [B, A] f32 (gumbel)
    considered,  # [B, n] f32 sequential-halving schedule (gumbel)
    sim,  # simulation index of the wave (gumbel schedule column)
    maxvisit_init,  # f32
    value_scale,  # f32
    first,  # index of the first node this wave creates
    num_walks,  # walks per tree in this wave (Kw); > 1 = virtual loss
    path_nodes,  # out [Kw, B, L] i64
    path_actions,  # out [Kw, B, L] i64
    depth,  # out [Kw, B] i64 edges on each path
    leaf,  # out [Kw, B] i64 node each walk's value is backed up into
    dup,  # out [Kw, B] bool walk ended on an edge an earlier walk of this wave claimed
    flat_parent,  # out [Kw * B] i64 (k-major) leaf parent's index in the [B * N] node views
    leaf_action,  # out [Kw * B] i64 (k-major) action of the leaf edge
):
    B, N = node_visits.shape
    A = children.shape[2]
    L = path_nodes.shape[2]
    use_vv = num_walks > 1
    score = np.empty(A, dtype=np.float32)
    for b in range(B):
        # qtransforms.minmax_bounds: min/max only change in the backup, so once per tree and wave.
        spread = value_max[b] - value_min[b]
        if spread > _ZERO:
            low = value_min[b]
        else:
            low = _ZERO
            spread = _INF
        for k in range(num_walks):
            # Root step: invalid actions masked; Gumbel: only actions with the schedule's visit count.
            if gumbel:
                _sigma_completed(edges, raw_values, b, 0, maxvisit_init, value_scale, score)
                target = considered[b, sim]
                for a in range(A):
                    s = max(root_gumbel[b, a] + root_log_prior[b, a] + score[a], _LOW_LOGIT)
                    score[a] = s if edges[b, 0, VISITS, a] == target else _NEG_INF
            else:
                _puct_scores(edges, node_visits, value_sums, vv, use_vv, coef, b, 0, low, spread, score)
            if has_invalid:
                for a in range(A):
                    if invalid[b, a]:
                        score[a] = _NEG_INF
            a = _argmax(score)
            node = 0
            d = 0
            path_nodes[k, b, 0] = node
            path_actions[k, b, 0] = a
            d = 1
            child = children[b, node, a]
            # Interior steps; with virtual loss, nodes >= first are pending (claimed this wave): stop there.
            while child != UNVISITED and child < first and d < L:
                node = child
                if gumbel:
                    _gumbel_interior_scores(
                        edges, raw_values, log_priors, b, node, maxvisit_init, value_scale, score
                    )
                else:
                    _puct_scores(
                        edges, node_visits, value_sums, vv, use_vv, coef, b, node, low, spread, score
                    )
                a = _argmax(score)
                path_nodes[k, b, d] = node
                path_actions[k, b, d] = a
                d += 1
                child = children[b, node, a]
            depth[k, b] = d
            flat_parent[k * B + b] = b * N + node
            leaf_action[k * B + b] = a
            if use_vv:  # search._claim: claim the leaf edge, add a pending visit along the path
                if child != UNVISITED:
                    dup[k, b] = True
                    leaf[k, b] = child
                else:
                    dup[k, b] = False
                    leaf[k, b] = first + k
                    children[b, node, a] = first + k
                for j in range(d):
                    vv[b, path_nodes[k, b, j], path_actions[k, b, j]] += _ONE
            else:
                dup[k, b] = False
                leaf[k, b] = first + k
        if use_vv:  # the wave's pending visits end with its selection (search.py zeroes them there)
            for k in range(num_walks):
                for j in range(depth[k, b]):
                    vv[b, path_nodes[k, b, j], path_actions[k, b, j]] = _ZERO


@_jit
def _expand_backup_wave(
    edges,  # [B, N, C, A] f32
    node_visits,  # [B, N] f32
    value_sums,  # [B, N] f32
    raw_values,  # [B, N] f32
    log_priors,  # [B, N, A] f32 (gumbel; written here)
    rewards,  # [B, N] f32
    discounts,  # [B, N] f32
    parents,  # [B, N] i64
    action_from_parent,  # [B, N] i64
    children,  # [B, N, A] i64
    value_min,  # [B] f32
    value_max,  # [B] f32
    gumbel,  # Gumbel MuZero: keep the log priors, no min/max Q
    first,
    path_nodes,  # [Kw, B, L] i64
    path_actions,  # [Kw, B, L] i64
    depth,  # [Kw, B] i64
    leaf,  # [Kw, B] i64
    dup,  # [Kw, B] bool
    flat_parent,  # [Kw * B] i64
    leaf_action,  # [Kw * B] i64
    prior,  # [Kw * B, A] f32 softmax of the network's logits (k-major rows)
    value,  # [Kw * B] f32
    reward,  # [Kw * B] f32
    discount,  # [Kw * B] f32
):
    """search._expand then search._backup for every walk of the wave, in walk order."""
    K, B = depth.shape
    N = node_visits.shape[1]
    A = children.shape[2]
    for b in range(B):
        for k in range(K):
            i = k * B + b
            node = first + k
            for a in range(A):
                edges[b, node, PRIOR, a] = prior[i, a]
            if gumbel:  # once per node, not at every visit of the interior rule
                for a in range(A):
                    log_priors[b, node, a] = np.log(prior[i, a])
            raw_values[b, node] = value[i]
            rewards[b, node] = reward[i]
            discounts[b, node] = discount[i]
            parent = flat_parent[i] - b * N
            act = leaf_action[i]
            if dup[k, b]:  # the earlier walk's node keeps its edge and reward
                parents[b, node] = NO_PARENT
                action_from_parent[b, node] = -1
            else:
                parents[b, node] = parent
                action_from_parent[b, node] = act
                children[b, parent, act] = node
                edges[b, parent, REWARD, act] = reward[i]
                edges[b, parent, DISCOUNT, act] = discount[i]
        for k in range(K):
            v = value[k * B + b]
            lf = leaf[k, b]
            node_visits[b, lf] += _ONE
            value_sums[b, lf] += v
            child_visits = node_visits[b, lf]
            child_value = value_sums[b, lf] / child_visits
            lo = value_min[b]
            hi = value_max[b]
            g = v
            for j in range(depth[k, b] - 1, -1, -1):
                p = path_nodes[k, b, j]
                a = path_actions[k, b, j]
                r = edges[b, p, REWARD, a]
                dsc = edges[b, p, DISCOUNT, a]
                edges[b, p, VISITS, a] = child_visits
                edges[b, p, VALUE, a] = child_value
                if not gumbel:
                    q = r + dsc * child_value
                    lo = min(lo, q)
                    hi = max(hi, q)
                g = r + dsc * g
                node_visits[b, p] += _ONE
                value_sums[b, p] += g
                child_visits = node_visits[b, p]
                child_value = value_sums[b, p] / child_visits
            if not gumbel:
                value_min[b] = lo
                value_max[b] = hi


# ------------------------------------------------------------------------------------------- the loop


def _np(t: torch.Tensor) -> np.ndarray:
    """A float32 C-contiguous numpy view (or copy) of a CPU tensor."""
    if t.dtype != torch.float32 or t.requires_grad or not t.is_contiguous():
        t = t.detach().float().contiguous()
    return t.numpy()


_NUMPY_DTYPES = {
    torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool,
}  # fmt: skip


class _Embeddings:
    """The tree's node embeddings [B, N, ...]: gathered and written with numpy when they are one tensor of a
    numpy dtype (a few µs less per wave than torch's indexing at small B), with torch otherwise."""

    def __init__(self, embeddings: Any) -> None:
        self.tree = embeddings
        self.fast = isinstance(embeddings, torch.Tensor) and embeddings.dtype in _NUMPY_DTYPES
        if self.fast:
            B, N = embeddings.shape[:2]
            self.rest = tuple(embeddings.shape[2:])
            self.nodes = embeddings.numpy().reshape(B, N, -1)  # a view: the tensor is contiguous
            self.flat = self.nodes.reshape(B * N, -1)

    def gather(self, flat_parent: np.ndarray) -> Any:
        """[Kw * B, ...] embeddings of the nodes `flat_parent` (indices into the [B * N] node views)."""
        if self.fast:
            rows = np.take(self.flat, flat_parent, axis=0)
            return torch.from_numpy(rows.reshape(flat_parent.shape[0], *self.rest))
        flat = torch.from_numpy(flat_parent)
        return tree_map(lambda t: t.flatten(0, 1).index_select(0, flat), self.tree)

    def write(self, first: int, kw: int, next_embedding: Any) -> None:
        """Store the [Kw * B, ...] (k-major) new embeddings as nodes first .. first + kw - 1."""
        if (
            self.fast
            and isinstance(next_embedding, torch.Tensor)
            and next_embedding.dtype == self.tree.dtype
            and not next_embedding.requires_grad
        ):
            src = next_embedding.numpy().reshape(kw, -1, self.nodes.shape[2])
            if kw == 1:
                self.nodes[:, first] = src[0]
            else:
                self.nodes[:, first : first + kw] = src.transpose(1, 0, 2)
            return
        if kw == 1:
            tree_map2(lambda dst, src: dst[:, first].copy_(src), self.tree, next_embedding)
            return
        # rows are k-major: [Kw * B, ...] -> [B, Kw, ...]
        tree_map2(
            lambda dst, src: dst[:, first : first + kw].copy_(
                src.reshape(kw, -1, *src.shape[1:]).transpose(0, 1)
            ),
            self.tree,
            next_embedding,
        )


def _same_shapes(out: Any, next_embedding: Any, rows: int, A: int, embedding_shape: tuple | None) -> bool:
    """Cheap re-check of a recurrent_fn output after the first wave's full check (the compiled code does
    no bounds checks, so every wave's arrays must have the right sizes)."""
    if type(out) is not RecurrentOutput:
        return False
    r = (rows,)
    for t in out:
        if type(t) is not torch.Tensor:
            return False
    if out.reward.shape != r or out.discount.shape != r or out.value.shape != r:
        return False
    if out.prior_logits.shape != (rows, A):
        return False
    return (
        embedding_shape is not None
        and type(next_embedding) is torch.Tensor
        and (next_embedding.shape == (rows, *embedding_shape))
    )


class _Arrays:
    """numpy views of one search's tree and per-search constants (made once per search)."""

    def __init__(self, tree: Tree, ctx: Any) -> None:
        B, A, K, N = ctx.B, ctx.A, ctx.K, ctx.N
        self.edges = tree.edges.numpy()
        self.node_visits = tree.node_visits.numpy()
        self.value_sums = tree.value_sums.numpy()
        self.raw_values = tree.raw_values.numpy()
        self.rewards = tree.rewards.numpy()
        self.discounts = tree.discounts.numpy()
        self.parents = tree.parents.numpy()
        self.action_from_parent = tree.action_from_parent.numpy()
        self.children = tree.children_index.numpy()
        self.value_min = tree.value_min.numpy()
        self.value_max = tree.value_max.numpy()
        vv = tree.virtual_visits
        self.vv = vv.numpy() if vv is not None else np.zeros((1, 1, 1), np.float32)
        self.coef = _np(ctx.coef)
        self.has_invalid = ctx.invalid is not None
        self.invalid = ctx.invalid.contiguous().numpy() if self.has_invalid else np.zeros((1, 1), np.bool_)
        if ctx.gumbel:
            self.root_gumbel = _np(ctx.root_gumbel)
            self.root_log_prior = _np(ctx.root_log_prior)
            self.considered = _np(ctx.considered)
        else:
            self.root_gumbel = self.root_log_prior = np.zeros((B, A), np.float32)
            self.considered = np.zeros((1, 1), np.float32)
        self.log_priors = np.empty((B, N, A) if ctx.gumbel else (1, 1, 1), np.float32)
        # Path buffers of a wave, reused by every wave (a last, partial wave uses the first rows).
        self.path_nodes = np.zeros((K, B, N), np.int64)
        self.path_actions = np.zeros((K, B, N), np.int64)
        self.depth = np.zeros((K, B), np.int64)
        self.leaf = np.zeros((K, B), np.int64)
        self.dup = np.zeros((K, B), np.bool_)
        self.flat_parent = np.zeros(K * B, np.int64)


def simulate(
    tree: Tree,
    ctx: Any,
    recurrent_fn: RecurrentFn,
    check_recurrent: Callable[[Any, Any, int, int, Any], None],
) -> None:
    """Run the search's simulations on `tree` (root already initialised): one compiled selection call,
    one `recurrent_fn` call and one compiled expansion + backup call per wave of B * K leaves.

    ctx: search._Context (B, N, A, K, num_simulations, config, gumbel, invalid, coef and the Gumbel root
    tensors); check_recurrent: search._check_recurrent.
    """
    x = _Arrays(tree, ctx)
    emb = _Embeddings(tree.embeddings)
    emb_shape = emb.rest if emb.fast else None
    B, A, K, n = ctx.B, ctx.A, ctx.K, ctx.num_simulations
    config = ctx.config
    maxvisit_init, value_scale = _F32(config.maxvisit_init), _F32(config.value_scale)
    gumbel = bool(ctx.gumbel)
    checked_rows = -1
    for w in range(-(-n // K)):
        first = 1 + w * K
        kw = min(K, n - w * K)
        if kw < K:
            path_nodes, path_actions = x.path_nodes[:kw], x.path_actions[:kw]
            depth, leaf, dup, flat_parent = x.depth[:kw], x.leaf[:kw], x.dup[:kw], x.flat_parent[: kw * B]
        else:
            path_nodes, path_actions = x.path_nodes, x.path_actions
            depth, leaf, dup, flat_parent = x.depth, x.leaf, x.dup, x.flat_parent
        action = np.empty(kw * B, np.int64)  # fresh: recurrent_fn may keep it
        _select_wave(
            x.edges, x.node_visits, x.value_sums, x.raw_values, x.log_priors, x.children, x.vv, x.coef,
            x.value_min, x.value_max, x.invalid, x.has_invalid, gumbel, x.root_gumbel,
            x.root_log_prior, x.considered, w, maxvisit_init, value_scale, first, kw,
            path_nodes, path_actions, depth, leaf, dup, flat_parent, action,
        )  # fmt: skip
        rows = kw * B
        out, next_embedding = recurrent_fn(torch.from_numpy(action), emb.gather(flat_parent))
        if rows != checked_rows or not _same_shapes(out, next_embedding, rows, A, emb_shape):
            check_recurrent(out, next_embedding, rows, A, tree.embeddings)
            checked_rows = rows
        emb.write(first, kw, next_embedding)
        prior = torch.softmax(out.prior_logits.float(), dim=-1)
        _expand_backup_wave(
            x.edges, x.node_visits, x.value_sums, x.raw_values, x.log_priors, x.rewards, x.discounts,
            x.parents, x.action_from_parent, x.children, x.value_min, x.value_max, gumbel, first,
            path_nodes, path_actions, depth, leaf, dup, flat_parent, action,
            _np(prior), _np(out.value), _np(out.reward), _np(out.discount),
        )  # fmt: skip
