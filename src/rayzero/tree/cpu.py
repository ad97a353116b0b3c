"""Compiled CPU tree: a whole `search()` on CPU tensors (`run_search`): root initialisation, the selection
walk, the expansion writes, the backup and the outputs as numba-compiled loops over the B trees, with one
compiled call and one `recurrent_fn` call per wave. Python keeps only what must stay torch: the random
draws, the logs and softmaxes whose bits the torch path defines (so MuZero trees are bit-identical to it;
Gumbel ones equal within float tolerance), the `recurrent_fn` call and the tensors handed out. The tree
lives in two flat buffers per search (its tensors are views of them) so a wave call takes few arguments, and
recurrent outputs are read by address, not through a numpy view per tensor. Inside the kernels, views of the
buffers are made from their addresses (`_at`): numba's slices count references atomically, per view and call.

Small batches (B * K <= SMALL_ROWS, one-tensor embeddings): each wave's prior softmax is compiled (torch's is
~1 us a call, most of a one-root wave's glue) and selection uses it; at the end the tree's priors are
rewritten from torch's softmax of every wave's logits at once (a row's bits do not depend on the other rows),
so the returned tree still holds the torch path's priors. The compiled softmax can differ from torch's in the
last bits, which could change a decision only where two scores tie to within that: results are then within fp
tolerance of the torch path, not bit for bit (no such tie occurs in the tests, which ask for equal trees).

A `NumpyRecurrentFn` (base.py) with a one-tensor embedding takes `_numpy_waves`: its function gets numpy
views of the search's buffers and returns numpy arrays, which `_wave_arrays` takes as they are (numba's
dispatch reads an array faster than numpy hands its address to Python), so a wave makes no tensor; the
softmax rules and so the bits are those of the torch protocol.

Why numba: pip wheels for every platform and no compiler at install time (a C++ extension needs one, or a
wheel per platform), native loops over numpy arrays, an on-disk cache so only a machine's first process
compiles, and `nogil=True`, so self-play threads walk trees while another thread waits for the network.
Single-threaded on purpose: the actors already use every core. `search.cpu_backend=torch` (or
RAYZERO_TREE_NUMBA=0) selects the torch path. How a search runs and the equality argument in full:
docs/architecture.md; timings: docs/results/tree_one_root.md.
"""
from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rayzero.tree.base import NumpyRecurrentFn, RecurrentOutput, SearchOutput, check_numpy_output
from rayzero.tree.noise import GAMMA_PROPOSALS
from rayzero.tree.tree import (
    DISCOUNT,
    NO_PARENT,
    PRIOR,
    REWARD,
    UNVISITED,
    VALUE,
    VISITS,
    Tree,
    tree_map,
    tree_map2,
)

if TYPE_CHECKING:  # pragma: no cover
    from rayzero.tree.base import RecurrentFn

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
# Inlined into their callers at numba's IR level (small helpers: the views of the flat buffers, the softmax).
_jit_inline = njit(cache=True, nogil=True, error_model="numpy", inline="always") if _NUMBA else _identity


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
    min_range,  # f32 floor of the min-max range (search.min_q_range)
    first,  # index of the first node this wave creates
    num_walks,  # walks per tree in this wave (Kw); > 1 = virtual loss
    path_nodes,  # out [Kw, B, L] i64
    path_actions,  # out [Kw, B, L] i64
    depth,  # out [Kw, B] i64 edges on each path
    leaf,  # out [Kw, B] i64 node each walk's value is backed up into
    dup,  # out [Kw, B] bool walk ended on an edge an earlier walk of this wave claimed
    flat_parent,  # out [Kw * B] i64 (k-major) leaf parent's index in the [B * N] node views
    leaf_action,  # out [Kw * B] i64 (k-major) action of the leaf edge
    score,  # scratch [A] f32
):
    B, N = node_visits.shape
    A = children.shape[2]
    L = path_nodes.shape[2]
    use_vv = num_walks > 1
    for b in range(B):
        # qtransforms.minmax_bounds: min/max only change in the backup, so once per tree and wave.
        spread = value_max[b] - value_min[b]
        if spread > _ZERO:
            low = value_min[b]
            spread = max(spread, min_range)
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


# --------------------------------------------------------------------------- whole-search kernels

if _NUMBA:
    from numba import carray, types
    from numba.extending import intrinsic

    @intrinsic
    def _pointer_like(typingctx, address, like):  # noqa: ARG001 - numba's intrinsic signature
        """(int address, array) -> a pointer of the array's dtype at `address` (to view a torch tensor's
        memory with numba.carray without a .numpy() call per tensor)."""
        ptr_type = types.CPointer(like.dtype)

        def codegen(context, builder, signature, args):  # noqa: ARG001
            return builder.inttoptr(args[0], context.get_value_type(ptr_type))

        return ptr_type(address, like), codegen

else:  # pragma: no cover - only the torch path runs without numba

    def _pointer_like(address: Any, like: Any) -> Any:
        raise RuntimeError("numba is not available")

    def carray(*args: Any) -> Any:
        raise RuntimeError("numba is not available")


_C = 5  # tree.EDGE_CHANNELS
_NDIMS = 16  # length of the shape and flag vector (`_dims`)


def float_layout(B: int, N: int, A: int, K: int) -> list[tuple[str, tuple[int, ...]]]:
    """The Tree's float32 fields in the order they sit in one search's float buffer (`_float_views`)."""
    return [
        ("edges", (B, N, _C, A)),
        ("node_visits", (B, N)),
        ("value_sums", (B, N)),
        ("raw_values", (B, N)),
        ("rewards", (B, N)),
        ("discounts", (B, N)),
        ("value_min", (B,)),
        ("value_max", (B,)),
        ("virtual_visits", (B, N, A) if K > 1 else (1, 1, 1)),
    ]


def int_layout(B: int, N: int, A: int) -> list[tuple[str, tuple[int, ...]]]:
    """The Tree's int64 fields in the order they sit in one search's int buffer (`_int_views`)."""
    return [("parents", (B, N)), ("action_from_parent", (B, N)), ("children_index", (B, N, A))]


@_jit_inline
def _at(buf, o, shape):
    """View of buf[o : o + prod(shape)] as `shape`, made from its address: an array without a reference
    count (numba's slices and reshapes of a buffer count references atomically, per view and wave)."""
    return carray(_pointer_like(buf.ctypes.data + o * buf.itemsize, buf), shape)


@_jit_inline
def _float_views(fbuf, B, N, A, K):
    o = 0
    edges = _at(fbuf, o, (B, N, _C, A))
    o += B * N * _C * A
    node_visits = _at(fbuf, o, (B, N))
    o += B * N
    value_sums = _at(fbuf, o, (B, N))
    o += B * N
    raw_values = _at(fbuf, o, (B, N))
    o += B * N
    rewards = _at(fbuf, o, (B, N))
    o += B * N
    discounts = _at(fbuf, o, (B, N))
    o += B * N
    value_min = _at(fbuf, o, (B,))
    o += B
    value_max = _at(fbuf, o, (B,))
    o += B
    if K > 1:
        vv = _at(fbuf, o, (B, N, A))
    else:
        vv = _at(fbuf, o, (1, 1, 1))
    return edges, node_visits, value_sums, raw_values, rewards, discounts, value_min, value_max, vv


@_jit_inline
def _int_views(ibuf, B, N, A):
    parents = _at(ibuf, 0, (B, N))
    action_from_parent = _at(ibuf, B * N, (B, N))
    children = _at(ibuf, 2 * B * N, (B, N, A))
    return parents, action_from_parent, children


def _work_sizes(B: int, N: int, A: int, K: int, n: int, gumbel: bool, small: bool) -> tuple[int, int]:
    """Lengths of the int64 and float32 working parts after the tree's fields (`_path_views` plus every
    wave's actions, `_root_views` plus the selection's score scratch of A floats; with `small`, from
    `_small_offset` on, every wave's logits and one wave's compiled softmax)."""
    W = -(-n // K)
    si = 2 * K * B * N + 4 * K * B + W * K * B
    sf = _small_offset(B, N, A, n, gumbel) + ((W + 1) * K * B * A if small else 0)
    return si, sf


def _small_offset(B: int, N: int, A: int, n: int, gumbel: bool) -> int:
    """Where the small-batch logits store starts in the float working part (then one wave's softmax)."""
    return 2 * B * A + B * n + (B * N * A if gumbel else 1) + A


@_jit_inline
def _path_views(ibuf, o, B, N, K, n):
    path_nodes = _at(ibuf, o, (K, B, N))
    o += K * B * N
    path_actions = _at(ibuf, o, (K, B, N))
    o += K * B * N
    depth = _at(ibuf, o, (K, B))
    o += K * B
    leaf = _at(ibuf, o, (K, B))
    o += K * B
    dup = _at(ibuf, o, (K, B))
    o += K * B
    flat_parent = _at(ibuf, o, (K * B,))
    o += K * B
    W = -(-n // K)
    act_all = _at(ibuf, o, (W, K * B))  # every wave's actions (recurrent_fn's inputs)
    return path_nodes, path_actions, depth, leaf, dup, flat_parent, act_all


@_jit_inline
def _root_views(fbuf, o, B, N, A, K, n, gumbel):
    root_gumbel = _at(fbuf, o, (B, A))
    o += B * A
    root_log_prior = _at(fbuf, o, (B, A))
    o += B * A
    considered = _at(fbuf, o, (B, n))
    o += B * n
    if gumbel:
        log_priors = _at(fbuf, o, (B, N, A))
        o += B * N * A
    else:
        log_priors = _at(fbuf, o, (1, 1, 1))
        o += 1
    score = _at(fbuf, o, (A,))  # the selection's scratch
    return root_gumbel, root_log_prior, considered, log_priors, score


@_jit
def _init_search(
    fbuf, ibuf, dims, cf, prior, dirichlet, mix, root_value, root_noise, gumbel_scale, log_prior, table,
    invalid, emb_nodes, root_emb,
):  # fmt: skip
    """search._init_root on the flat buffers: the root priors (mixed with the Dirichlet sample when
    mix[0] is set: mix[1] * prior + mix[2] * dirichlet, the torch path's float32 operations), one visit,
    the root value and embedding, the min/max bounds and the Gumbel root inputs. Also copies dims, cf and
    the mask into the buffers' tails, where `_wave` reads them (fewer arguments per wave call)."""
    B, N, A, K, n = dims[0], dims[1], dims[2], dims[3], dims[4]
    gumbel, has_invalid, D, m = dims[5] != 0, dims[6] != 0, dims[7], dims[9]
    for i in range(dims[11]):  # the tree's int fields: parents, actions from parents, children
        ibuf[i] = UNVISITED
    tail_dims = _at(ibuf, ibuf.shape[0] - _NDIMS, (_NDIMS,))
    for i in range(_NDIMS):
        tail_dims[i] = dims[i]
    tail_cf = _at(fbuf, fbuf.shape[0] - dims[13], (dims[13],))
    for i in range(dims[13]):
        tail_cf[i] = cf[i]
    if has_invalid:
        tail_inv = _at(ibuf, dims[14], (B, A))
        for b in range(B):
            for a in range(A):
                tail_inv[b, a] = 1 if invalid[b, a] else 0
    edges, node_visits, value_sums, raw_values, _, _, value_min, value_max, _ = _float_views(fbuf, B, N, A, K)
    root_gumbel, root_log_prior, considered, _, _ = _root_views(fbuf, dims[10], B, N, A, K, n, gumbel)
    for b in range(B):
        value_min[b] = _INF
        value_max[b] = _NEG_INF
        for a in range(A):
            p = prior[b, a]
            if mix[0] != _ZERO:
                p = mix[1] * p + mix[2] * dirichlet[b, a]
            edges[b, 0, PRIOR, a] = p
        node_visits[b, 0] = _ONE
        value_sums[b, 0] = root_value[b]
        raw_values[b, 0] = root_value[b]
        if gumbel:
            valid = A
            for a in range(A):
                root_log_prior[b, a] = log_prior[b, a]
                root_gumbel[b, a] = gumbel_scale * root_noise[b, a] if gumbel_scale > _ZERO else _ZERO
                if has_invalid and invalid[b, a]:
                    valid -= 1
            row = min(valid, m)
            for j in range(n):
                considered[b, j] = table[row, j]
        for j in range(D):
            emb_nodes[b, 0, j] = root_emb[b, j]


@_jit_inline
def _softmax_rows(logits, store, prior):
    """prior = softmax(logits) row by row (float32, torch's steps: max, exp of the differences, times the
    reciprocal of their sum); the logits are copied into store."""
    rows, A = logits.shape
    for i in range(rows):
        top = _NEG_INF
        for a in range(A):
            x = logits[i, a]
            store[i, a] = x
            if x > top or x != x:
                top = x
        total = _ZERO
        for a in range(A):
            e = np.exp(logits[i, a] - top)
            prior[i, a] = e
            total += e
        inv = _ONE / total
        for a in range(A):
            prior[i, a] = prior[i, a] * inv


@_jit
def _rewrite_priors(fbuf, dims, prior_all):
    """Small batches: every expanded node's priors from torch's softmax of all waves' logits at once
    (prior_all [W * K * B, A]), so the returned tree holds the torch path's bits."""
    B, N, A, K, n = dims[0], dims[1], dims[2], dims[3], dims[4]
    W = dims[8]
    edges = _at(fbuf, 0, (B, N, _C, A))
    for pw in range(W):
        kw = min(K, n - pw * K)
        for k in range(kw):
            for b in range(B):
                row = pw * K * B + k * B + b
                for a in range(A):
                    edges[b, 1 + pw * K + k, PRIOR, a] = prior_all[row, a]


@_jit
def _wave(fbuf, ibuf, emb_nodes, emb_in, w, p_prior, p_value, p_reward, p_discount, p_emb):
    """One call per simulation wave: expand and back up wave w - 1 from its recurrent_fn outputs (given
    as addresses of float32 CPU tensors; p_emb = 0: the embeddings were written by the caller), then walk
    wave w and gather its leaves' parent embeddings into emb_in (dims[7] > 0). dims, cf and the mask are
    in the buffers' tails (`_init_search`)."""
    _wave_step(fbuf, ibuf, emb_nodes, emb_in, w, p_prior, p_value, p_reward, p_discount, p_emb)


@_jit
def _wave_arrays(fbuf, ibuf, emb_nodes, emb_in, w, prior, value, reward, discount, nxt):
    """`_wave` for a NumpyRecurrentFn: wave w - 1's outputs as C-contiguous float32 arrays of the checked
    shapes (prior: the logits for small batches) and nxt the next embeddings (C-contiguous, the tree's
    dtype, any rank); size-0 arrays on the first wave. Arrays pass numba's dispatch faster than numpy
    gives their addresses to Python."""
    p_emb = np.int64(nxt.ctypes.data) if nxt.size > 0 else np.int64(0)
    _wave_step(
        fbuf, ibuf, emb_nodes, emb_in, w, np.int64(prior.ctypes.data), np.int64(value.ctypes.data),
        np.int64(reward.ctypes.data), np.int64(discount.ctypes.data), p_emb,
    )  # fmt: skip


@_jit_inline
def _wave_step(fbuf, ibuf, emb_nodes, emb_in, w, p_prior, p_value, p_reward, p_discount, p_emb):
    """The body of `_wave` and `_wave_arrays`."""
    dims = _at(ibuf, ibuf.shape[0] - _NDIMS, (_NDIMS,))
    cf = _at(fbuf, fbuf.shape[0] - dims[13], (dims[13],))
    B, N, A, K, n = dims[0], dims[1], dims[2], dims[3], dims[4]
    gumbel, has_invalid, D, W = dims[5] != 0, dims[6] != 0, dims[7], dims[8]
    invalid = _at(ibuf, dims[14], (B, A) if has_invalid else (1, 1))
    edges, node_visits, value_sums, raw_values, rewards, discounts, value_min, value_max, vv = _float_views(
        fbuf, B, N, A, K
    )
    parents, action_from_parent, children = _int_views(ibuf, B, N, A)
    path_nodes, path_actions, depth, leaf, dup, flat_parent, act_all = _path_views(ibuf, dims[11], B, N, K, n)
    root_gumbel, root_log_prior, considered, log_priors, score = _root_views(
        fbuf, dims[10], B, N, A, K, n, gumbel
    )
    if w > 0:
        pw = w - 1
        first = 1 + pw * K
        kw = min(K, n - pw * K)
        rows = kw * B
        value = carray(_pointer_like(p_value, fbuf), (rows,))
        reward = carray(_pointer_like(p_reward, fbuf), (rows,))
        discount = carray(_pointer_like(p_discount, fbuf), (rows,))
        if dims[12] != 0:  # small batch: p_prior holds the logits; the compiled softmax, logits kept
            logits = carray(_pointer_like(p_prior, fbuf), (rows, A))
            store = _at(fbuf, dims[12] + pw * K * B * A, (rows, A))
            prior = _at(fbuf, dims[12] + W * K * B * A, (rows, A))
            _softmax_rows(logits, store, prior)
        else:
            prior = carray(_pointer_like(p_prior, fbuf), (rows, A))  # torch's softmax: the torch path's bits
        if p_emb != 0:
            nxt = carray(_pointer_like(p_emb, emb_nodes), (rows, D))
            for k in range(kw):
                for b in range(B):
                    for j in range(D):
                        emb_nodes[b, first + k, j] = nxt[k * B + b, j]
        _expand_backup_wave(
            edges, node_visits, value_sums, raw_values, log_priors, rewards, discounts, parents,
            action_from_parent, children, value_min, value_max, gumbel, first, path_nodes[:kw],
            path_actions[:kw], depth[:kw], leaf[:kw], dup[:kw], flat_parent[:rows], act_all[pw, :rows],
            prior, value, reward, discount,
        )  # fmt: skip
    if w < W:
        first = 1 + w * K
        kw = min(K, n - w * K)
        rows = kw * B
        _select_wave(
            edges, node_visits, value_sums, raw_values, log_priors, children, vv, cf[3:], value_min,
            value_max, invalid, has_invalid, gumbel, root_gumbel, root_log_prior, considered, w, cf[0],
            cf[1], cf[2], first, kw, path_nodes[:kw], path_actions[:kw], depth[:kw], leaf[:kw], dup[:kw],
            flat_parent[:rows], act_all[w, :rows], score,
        )  # fmt: skip
        if D > 0:
            e = w % emb_in.shape[0]
            for i in range(rows):
                b = flat_parent[i] // N
                node = flat_parent[i] - b * N
                for j in range(D):
                    emb_in[e, i, j] = emb_nodes[b, node, j]


@_jit
def _outputs(fbuf, dims, cf, invalid, temperature, log_visits, action_noise, out_f, out_i):
    """search._outputs: played action, policy target, visit counts, root value and Q of every root.
    MuZero's temperature sampling takes torch's log of the visits (log_visits) and the Gumbel draws."""
    B, N, A, K, n = dims[0], dims[1], dims[2], dims[3], dims[4]
    gumbel, has_invalid = dims[5] != 0, dims[6] != 0
    edges, node_visits, value_sums, raw_values, _, _, _, _, _ = _float_views(fbuf, B, N, A, K)
    root_gumbel, root_log_prior, _, _, _ = _root_views(fbuf, dims[10], B, N, A, K, n, gumbel)
    weights = out_f[: B * A].reshape((B, A))
    qvalues = out_f[B * A : 2 * B * A].reshape((B, A))
    root_value = out_f[2 * B * A : 2 * B * A + B]
    visit_counts = out_i[: B * A].reshape((B, A))
    action = out_i[B * A : B * A + B]
    sigma = np.empty(A, dtype=np.float32)
    score = np.empty(A, dtype=np.float32)
    for b in range(B):
        total = _ZERO
        top = _NEG_INF
        for a in range(A):
            v = edges[b, 0, VISITS, a]
            total += v
            top = max(top, v)
            visit_counts[b, a] = np.int64(v)
            q = edges[b, 0, REWARD, a] + edges[b, 0, DISCOUNT, a] * edges[b, 0, VALUE, a]
            qvalues[b, a] = q if v > _ZERO else _ZERO
        root_value[b] = value_sums[b, 0] / node_visits[b, 0]
        if gumbel:
            _sigma_completed(edges, raw_values, b, 0, cf[0], cf[1], sigma)
            hi = _NEG_INF
            for a in range(A):
                t = root_log_prior[b, a] + sigma[a]
                weights[b, a] = t
                hi = max(hi, t)
            s = _ZERO
            for a in range(A):
                e = np.exp(weights[b, a] - hi)
                weights[b, a] = e
                s += e
            for a in range(A):
                weights[b, a] = weights[b, a] / s
                sc = max(root_gumbel[b, a] + root_log_prior[b, a] + sigma[a], _LOW_LOGIT)
                score[a] = sc if edges[b, 0, VISITS, a] == top else _NEG_INF
                if has_invalid and invalid[b, a]:
                    score[a] = _NEG_INF
            action[b] = _argmax(score)
        else:
            for a in range(A):
                weights[b, a] = edges[b, 0, VISITS, a] / total
            if temperature == _ZERO:  # search._most_visited: the most visited, ties to the higher Q
                for a in range(A):
                    score[a] = qvalues[b, a] if edges[b, 0, VISITS, a] == top else _NEG_INF
            else:
                for a in range(A):
                    score[a] = log_visits[b, a] / temperature + action_noise[b, a]
            action[b] = _argmax(score)


# ----------------------------------------------------------- noise: torch's draws, fewer torch calls


@_jit
def _clamp_tiny(u):
    flat = u.reshape(u.size)
    for i in range(flat.size):
        flat[i] = max(flat[i], _TINY)


@_jit
def _negate(x):
    flat = x.reshape(x.size)
    for i in range(flat.size):
        flat[i] = -flat[i]


@_jit
def _gamma_proposals(x, u, u_small, c, v, v_pos):
    """Marsaglia-Tsang proposals v = (1 + c x)^3 (torch's pow(3) is b * b * b) and where(v > 0, v, 1);
    u and u_small are clamped to (0, 1) in place (noise._uniform_open)."""
    xf, uf, vf, pf = x.reshape(x.size), u.reshape(u.size), v.reshape(v.size), v_pos.reshape(v_pos.size)
    for i in range(xf.size):
        uf[i] = max(uf[i], _TINY)
        t = xf[i] * c + _ONE
        t = t * t * t
        vf[i] = t
        pf[i] = t if t > _ZERO else _ONE
    sf = u_small.reshape(u_small.size)
    for i in range(sf.size):
        sf[i] = max(sf[i], _TINY)


@_jit
def _gamma_accept(x, v, log_u, log_v, d, log_d, log_u_small, alpha, out):
    """noise.sample_log_gamma's acceptance: the first accepted proposal's log(d) + log(v), else log(d);
    then + log(u_small) / alpha when alpha < 1 (log_u_small has out's size then)."""
    P = x.shape[0]
    size = out.size
    xf, vf = x.reshape((P, size)), v.reshape((P, size))
    luf, lvf = log_u.reshape((P, size)), log_v.reshape((P, size))
    of = out.reshape(size)
    half = np.float32(0.5)
    for i in range(size):
        res = log_d
        for p in range(P):
            xi = xf[p, i]
            vi = vf[p, i]
            rhs = half * xi * xi + d - d * vi + d * lvf[p, i]
            if vi > _ZERO and luf[p, i] < rhs:
                res = log_d + lvf[p, i]
                break
        of[i] = res
    if log_u_small.size == size:
        lsf = log_u_small.reshape(size)
        for i in range(size):
            of[i] = of[i] + lsf[i] / alpha


_EMPTY_T = torch.empty(0)
_EMPTY_NP = np.empty(0, np.float32)


def sample_gumbel(shape: tuple[int, int], generator: torch.Generator | None) -> torch.Tensor:
    """noise.sample_gumbel's draw and bits (-log(-log(U))): torch's rand and logs (in place: the same
    elementwise kernel on the same shape), the clamp and the negations compiled."""
    u = torch.rand(shape, generator=generator)
    un = u.numpy()
    _clamp_tiny(un)
    u.log_()
    _negate(un)
    u.log_()
    _negate(un)
    return u


@functools.lru_cache(maxsize=16)
def _gamma_constants(alpha: float) -> tuple:
    """(c, d, log d, alpha) of Marsaglia-Tsang as float32 (noise.sample_log_gamma's Python floats, which
    torch rounds to float32 in its float32 arithmetic), and whether alpha < 1."""
    a = alpha + 1.0 if alpha < 1.0 else alpha
    d = a - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    return _F32(c), _F32(d), _F32(math.log(d)), _F32(alpha), alpha < 1.0


def sample_log_gamma(alpha: float, shape: tuple[int, int], generator: torch.Generator | None) -> torch.Tensor:
    """noise.sample_log_gamma's draws and bits: torch's randn, rand and logs on the same shapes (the logs
    in place, the same elementwise kernel); the float32 arithmetic between them compiled."""
    c, d, log_d, alpha32, small_alpha = _gamma_constants(alpha)
    full = (GAMMA_PROPOSALS, *shape)
    x = torch.randn(full, generator=generator)
    u = torch.rand(full, generator=generator)
    u_small = torch.rand(shape, generator=generator) if small_alpha else _EMPTY_T
    xs, un, usn = x.numpy(), u.numpy(), u_small.numpy()
    v = np.empty(xs.shape, np.float32)
    vp = np.empty(xs.shape, np.float32)
    v_pos = torch.from_numpy(vp)
    _gamma_proposals(xs, un, usn, c, v, vp)
    u.log_()
    v_pos.log_()
    if small_alpha:
        u_small.log_()
    out = np.empty(shape, np.float32)
    _gamma_accept(xs, v, un, vp, d, log_d, usn if small_alpha else _EMPTY_NP, alpha32, out)
    return torch.from_numpy(out)


# ------------------------------------------------------------------------------------------- the search


def _np(t: torch.Tensor) -> np.ndarray:
    """A float32 C-contiguous numpy view (or copy) of a CPU tensor."""
    if t.dtype != torch.float32 or t.requires_grad or not t.is_contiguous():
        t = t.detach().float().contiguous()
    return t.numpy()


_F32T = torch.float32
_FAST_EMBEDDINGS = {
    torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8,
}  # fmt: skip
_NUMPY_DTYPES = {t: torch.empty(0, dtype=t).numpy().dtype for t in _FAST_EMBEDDINGS}


def _f32(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself when it is a contiguous float32 CPU tensor (its address is read by `_wave`),
    else a float32 contiguous CPU copy."""
    if t.dtype is _F32T and t.is_cpu and t.is_contiguous():
        return t
    if not t.is_cpu:
        raise ValueError(f"recurrent_fn returned a tensor on {t.device} for a search on the CPU")
    return t.detach().float().contiguous()


_TENSOR = torch.Tensor


def _addresses(out: Any, nxt: Any, shapes: tuple, emb_dtype: Any, small: bool) -> tuple | None:
    """((prior, value, reward, discount, embedding) addresses, tensors to keep alive) for `_wave`, or None
    when the recurrent_fn output is not a RecurrentOutput of tensors of the expected shapes with a one-tensor
    embedding (then the caller runs the full check). `shapes`: ([rows], [rows, A], [rows, ...] embedding).
    Checked on every wave: the compiled code reads these by address and does no bounds checks. Outputs of
    other dtypes or layouts are copied to contiguous float32 (the torch path's .float()); an embedding that
    is not a contiguous CPU tensor of the tree's dtype gets address 0 and the caller writes it with torch.
    `small`: the "prior" address is the logits' (the compiled softmax, `_softmax_rows`); else torch's
    softmax of them."""
    if type(out) is not RecurrentOutput or type(nxt) is not _TENSOR or emb_dtype is None:
        return None
    reward, discount, logits, value = out
    if type(reward) is not _TENSOR or type(discount) is not _TENSOR or type(value) is not _TENSOR:
        return None
    if type(logits) is not _TENSOR:
        return None
    r, ra, re = shapes
    if reward.shape != r or discount.shape != r or value.shape != r or logits.shape != ra or nxt.shape != re:
        return None
    if not (
        reward.dtype is _F32T and discount.dtype is _F32T and logits.dtype is _F32T and value.dtype is _F32T
        and reward.is_cpu and discount.is_cpu and logits.is_cpu and value.is_cpu
        and reward.is_contiguous() and discount.is_contiguous() and logits.is_contiguous()
        and value.is_contiguous()
    ):  # fmt: skip
        reward, discount, logits, value = _f32(reward), _f32(discount), _f32(logits), _f32(value)
    # The torch path's softmax (vectorised; MuZero needs its bits), or for small batches the compiled one
    # (its bits are replaced by torch's at the end of the search, `_rewrite_priors`).
    prior = logits if small else torch.softmax(logits, dim=-1)
    p_emb = nxt.data_ptr() if nxt.dtype is emb_dtype and nxt.is_cpu and nxt.is_contiguous() else 0
    return prior.data_ptr(), value.data_ptr(), reward.data_ptr(), discount.data_ptr(), p_emb, (
        prior, value, reward, discount, nxt
    )


def _converted(out: RecurrentOutput, small: bool) -> tuple:
    """`_addresses` for an output that passed the full check but not `_addresses`' shape test (a pytree
    embedding): float32 contiguous copies, the embedding written by the caller (address 0)."""
    logits = _f32(out.prior_logits)
    prior = logits if small else torch.softmax(logits, dim=-1)
    value, reward, discount = _f32(out.value), _f32(out.reward), _f32(out.discount)
    return prior.data_ptr(), value.data_ptr(), reward.data_ptr(), discount.data_ptr(), 0, (
        prior, value, reward, discount
    )


@functools.lru_cache(maxsize=64)
def _considered_table(m: int, n: int) -> np.ndarray:
    """seq_halving.considered_visits_table on the CPU, as numpy (read-only)."""
    from rayzero.tree.seq_halving import considered_visits_table

    table = considered_visits_table(m, n, _CPU).numpy()
    table.flags.writeable = False
    return table


@functools.lru_cache(maxsize=64)
def _mix(f: float) -> np.ndarray:
    """[1, 1 - f, f] float32: the Dirichlet mix of `_init_search` (read-only)."""
    mix = np.array([1.0, 1.0 - f, f], np.float32)
    mix.flags.writeable = False
    return mix


_CPU = torch.device("cpu")
_CONSTANTS: dict[tuple, np.ndarray] = {}
SMALL_ROWS = 16
"""Searches of at most this many rows per wave (B * K) take the compiled per-wave softmax."""


@functools.lru_cache(maxsize=64)
def _layout(B: int, N: int, A: int, K: int, n: int, gumbel: bool, small: bool) -> tuple:
    """(tree field views (name, buffer 0 = float / 1 = int, start, stop, shape), tree float and int sizes,
    working float and int sizes) of a search shape."""
    views = []
    sizes = []
    for i, layout in enumerate((float_layout(B, N, A, K), int_layout(B, N, A))):
        o = 0
        for name, shape in layout:
            size = math.prod(shape)
            if K > 1 or name != "virtual_visits":
                views.append((name, i, o, o + size, shape))
            o += size
        sizes.append(o)
    work_i, work_f = _work_sizes(B, N, A, K, n, gumbel, small)
    # Tails: the PUCT constants (n + K + 5 floats), the mask as int64 [B, A] and the dims vector.
    work_f += n + K + 5
    work_i += B * A + _NDIMS
    return tuple(views), sizes[0], sizes[1], work_f, work_i


@functools.lru_cache(maxsize=64)
def _dims_cached(*values: int) -> np.ndarray:
    dims = np.array(values, np.int64)
    dims.flags.writeable = False
    return dims


def _dims(*values: int) -> np.ndarray:
    """The int64 shape and flag vector the kernels read (cached, read-only; _NDIMS long; ints and bools)."""
    return _dims_cached(*values, *(0,) * (_NDIMS - len(values)))


def _constants(n: int, K: int, config: Any) -> np.ndarray:
    """float32 [maxvisit_init, value_scale, min_q_range, PUCT coefficient table...] of a search setting (cached)."""
    key = (n, K, config.pb_c_init, config.pb_c_base, config.maxvisit_init, config.value_scale, config.min_q_range)
    cf = _CONSTANTS.get(key)
    if cf is None:
        from rayzero.tree.action_selection import puct_coefficients

        coef = puct_coefficients(n + K + 1, config.pb_c_init, config.pb_c_base, torch.device("cpu"))
        head = np.array([config.maxvisit_init, config.value_scale, config.min_q_range], np.float32)
        cf = np.concatenate([head, coef.numpy()]).astype(np.float32)
        _CONSTANTS[key] = cf
    return cf


_DUMMY_F3 = np.zeros((1, 1, 1), np.float32)
_DUMMY_F2 = np.zeros((1, 1), np.float32)
_DUMMY_B2 = np.zeros((1, 1), np.bool_)
_NO_MIX = np.zeros(3, np.float32)


def run_search(
    logits: torch.Tensor,
    value: torch.Tensor,
    embedding: Any,
    invalid: torch.Tensor | None,
    recurrent_fn: RecurrentFn,
    n: int,
    K: int,
    config: Any,
    noise: Any,
    generator: torch.Generator | None,
    check_recurrent: Callable[[Any, Any, int, int, Any], None],
    check_noise: Callable[[str, torch.Tensor, int, int, torch.device], None],
) -> SearchOutput:
    """A whole `search()` on CPU tensors (inputs already checked by search.py): root initialisation, one
    compiled `_wave` call and one `recurrent_fn` call per wave of B * K leaves, and the outputs.

    Torch work per search is the random draws, the logs and softmaxes the torch path computes (so MuZero
    gets its bits) and the tensors handed out; per wave, `recurrent_fn` and (MuZero) the prior softmax.
    """
    cpu_dev = _CPU
    B, A = logits.shape
    N = n + 1
    W = -(-n // K)
    gumbel = config.policy == "gumbel"
    # Root priors and noise: the torch path's ops on the same tensors (search._init_root).
    masked = logits if invalid is None else logits.masked_fill(invalid, float("-inf"))
    prior = torch.softmax(masked, dim=-1)
    dirichlet, mix = _DUMMY_F2, _NO_MIX
    root_noise, log_prior, table, gumbel_scale = _DUMMY_F2, _DUMMY_F2, _DUMMY_F2, _ZERO
    if not gumbel and config.dirichlet_fraction > 0:
        log_gamma = noise.root if noise is not None and noise.root is not None else None
        if log_gamma is None:
            log_gamma = sample_log_gamma(config.dirichlet_alpha, (B, A), generator)
        check_noise("noise.root", log_gamma, B, A, cpu_dev)
        lg = log_gamma.float()
        if invalid is not None:
            lg = lg.masked_fill(invalid, float("-inf"))
        dirichlet = _np(torch.softmax(lg, dim=-1))
        mix = _mix(config.dirichlet_fraction)
    if gumbel:
        log_prior = _np(torch.log_softmax(masked, dim=-1))
        if config.gumbel_scale > 0:
            g = noise.root if noise is not None and noise.root is not None else None
            if g is None:
                g = sample_gumbel((B, A), generator)
            check_noise("noise.root", g, B, A, cpu_dev)
            root_noise = _np(g)
            gumbel_scale = _F32(config.gumbel_scale)
        table = _considered_table(config.max_num_considered_actions, n)
    inv = invalid.contiguous().numpy() if invalid is not None else _DUMMY_B2

    # The tree and the search's working arrays: two flat buffers, fresh per search (the output keeps the
    # tree, and searches in other threads have their own), the tree's tensors views of their heads.
    fast = isinstance(embedding, torch.Tensor) and embedding.dtype in _FAST_EMBEDDINGS
    # Small batches (one root, a few): each wave's prior softmax compiled (torch's costs ~1 us a call),
    # the tree's priors rewritten from one torch softmax of every wave's logits at the end.
    small = fast and K * B <= SMALL_ROWS
    views, tree_f, tree_i, work_f, work_i = _layout(B, N, A, K, n, gumbel, small)
    fbuf = np.zeros(tree_f + work_f, np.float32)
    ibuf = np.empty(tree_i + work_i, np.int64)  # the tree's part filled with UNVISITED by _init_search
    bufs = (fbuf, ibuf)
    fields = {name: torch.from_numpy(bufs[i][a:b].reshape(shape)) for name, i, a, b, shape in views}
    if fast:
        rest = tuple(embedding.shape[1:])
        D = math.prod(rest)
        emb_nodes = np.zeros((B, N, D), _NUMPY_DTYPES[embedding.dtype])
        tree_embeddings = torch.from_numpy(emb_nodes.reshape(B, N, *rest))
        if embedding.requires_grad or not embedding.is_contiguous():
            embedding = embedding.detach().contiguous()
        root_emb = embedding.numpy().reshape(B, D)
        # Every wave's parent embeddings in one buffer (each wave's recurrent_fn input is a view of its
        # own row), unless that is large: then a fresh one-wave buffer per wave.
        per_search = W * K * B * D * root_emb.itemsize <= 4 << 20
        emb_in = np.empty((W if per_search else 1, K * B, D), root_emb.dtype)
    else:
        rest, D = None, 0
        tree_embeddings = tree_map(
            lambda e: torch.zeros((B, N, *e.shape[1:]), dtype=e.dtype), embedding
        )
        tree_map2(lambda dst, src: dst[:, 0].copy_(src), tree_embeddings, embedding)
        emb_nodes, root_emb = _DUMMY_F3, _DUMMY_F2
        emb_in, per_search = _DUMMY_F3, True
    tree = Tree(embeddings=tree_embeddings, **fields)
    small_at = tree_f + _small_offset(B, N, A, n, gumbel) if small else 0
    cf = _constants(n, K, config)
    if len(cf) > n + K + 5:  # the float tail `_layout` keeps for it
        raise AssertionError(f"PUCT table of {len(cf)} floats for n={n}, K={K}")
    dims = _dims(
        B, N, A, K, n, gumbel, invalid is not None, D, W, config.max_num_considered_actions, tree_f, tree_i,
        small_at, len(cf), tree_i + work_i - _NDIMS - B * A,
    )  # fmt: skip
    _init_search(
        fbuf, ibuf, dims, cf, _np(prior), dirichlet, mix, _np(value), root_noise, gumbel_scale,
        log_prior, table, inv, emb_nodes, root_emb,
    )  # fmt: skip

    # Each wave's actions: a row of the search's own buffer (recurrent_fn may keep its inputs).
    o = tree_i + 2 * K * B * N + 3 * K * B
    act_np = ibuf[o + K * B : o + K * B + W * K * B].reshape(W, K * B)
    numpy_io = fast and per_search and isinstance(recurrent_fn, NumpyRecurrentFn)
    if numpy_io:  # the outputs are numpy arrays: no tensors per wave
        _numpy_waves(
            recurrent_fn.fn, fbuf, ibuf, emb_nodes, emb_in, emb_in.reshape(W, K * B, *rest), act_np, n, K, B, A,
            small,
        )  # fmt: skip
    else:
        flat_parent = torch.from_numpy(ibuf[o : o + K * B])
        act_views = torch.from_numpy(act_np).unbind(0)
        emb_views = torch.from_numpy(emb_in.reshape(emb_in.shape[0], K * B, *rest)).unbind(0) if fast else ()
    p_prior = p_value = p_reward = p_discount = p_emb = 0
    emb_dtype = embedding.dtype if fast else None
    shapes = ((K * B,), (K * B, A), (K * B, *rest)) if fast else None
    kw = K
    if fast and per_search and not numpy_io:  # a one-tensor embedding: a lean loop, same steps as below
        acts, embs = list(act_views), list(emb_views)
        wl = W - 1 if n % K else -1  # a last, partial wave
        if wl >= 0:
            kl = n - wl * K
            acts[wl], embs[wl] = acts[wl][: kl * B], embs[wl][: kl * B]
        r, ra, re = shapes
        one = K * B == 1  # a [1] tensor is contiguous whatever its stride
        RO, T, F = RecurrentOutput, _TENSOR, _F32T
        for w in range(W):
            _wave(fbuf, ibuf, emb_nodes, emb_in, w, p_prior, p_value, p_reward, p_discount, p_emb)
            if w == wl:
                kw = kl
                r, ra, re = (kw * B,), (kw * B, A), (kw * B, *rest)
                one = kw * B == 1
            out, nxt = recurrent_fn(acts[w], embs[w])
            # The locals below keep every tensor whose address _wave reads alive until that call.
            ok = False
            if type(out) is RO and type(nxt) is T:
                reward, discount, logits, value = out
                try:
                    ok = (
                        reward.shape == r and discount.shape == r and value.shape == r and logits.shape == ra
                        and nxt.shape == re
                        and reward.dtype is F and discount.dtype is F and logits.dtype is F and value.dtype is F
                    )  # fmt: skip
                except AttributeError:  # not tensors: the full check below raises
                    pass
                if ok and not (
                    reward.is_cpu and discount.is_cpu and logits.is_cpu and value.is_cpu
                    and logits.is_contiguous()
                    and (one or (reward.is_contiguous() and discount.is_contiguous() and value.is_contiguous()))
                ):  # fmt: skip
                    ok = False
            if ok:
                if small:
                    p_prior = logits.data_ptr()
                else:
                    prior = torch.softmax(logits, dim=-1)  # the torch path's softmax (MuZero's bits)
                    p_prior = prior.data_ptr()
                p_value, p_reward, p_discount = value.data_ptr(), reward.data_ptr(), discount.data_ptr()
            else:  # other dtypes or layouts (converted), or a bad output (the full check raises)
                held = _addresses(out, nxt, (r, ra, re), emb_dtype, small)
                if held is None:
                    check_recurrent(out, nxt, kw * B, A, tree_embeddings)
                    held = _converted(out, small)
                p_prior, p_value, p_reward, p_discount, _, _ = held
            p_emb = nxt.data_ptr() if nxt.dtype is emb_dtype and nxt.is_cpu and nxt.is_contiguous() else 0
            if p_emb == 0:
                _write_embeddings(tree_embeddings, 1 + w * K, kw, nxt)
        _wave(fbuf, ibuf, emb_nodes, emb_in, W, p_prior, p_value, p_reward, p_discount, p_emb)
    for w in range(W + 1 if not (fast and per_search) else 0):  # pytree or large embeddings
        if not per_search and w < W:
            emb_in = np.empty((1, K * B, D), root_emb.dtype)
            emb_views = (torch.from_numpy(emb_in.reshape(1, K * B, *rest))[0],)
        _wave(fbuf, ibuf, emb_nodes, emb_in, w, p_prior, p_value, p_reward, p_discount, p_emb)
        if w == W:
            break
        if n - w * K < K:  # the last wave, partial
            kw = n - w * K
            if fast:
                shapes = ((kw * B,), (kw * B, A), (kw * B, *rest))
        rows = kw * B
        action = act_views[w] if kw == K else act_views[w][:rows]
        if fast:
            parent_embedding = emb_views[w % len(emb_views)]
            if kw < K:
                parent_embedding = parent_embedding[:rows]
        else:
            fp = flat_parent[:rows]
            parent_embedding = tree_map(lambda t, fp=fp: t.flatten(0, 1).index_select(0, fp), tree_embeddings)
        out, next_embedding = recurrent_fn(action, parent_embedding)
        # `held` keeps every tensor whose address _wave reads alive until that call.
        held = _addresses(out, next_embedding, shapes, emb_dtype, small)
        if held is None:  # a pytree embedding, or a bad output: the full check (it raises for the latter)
            check_recurrent(out, next_embedding, rows, A, tree_embeddings)
            held = _converted(out, small)
        p_prior, p_value, p_reward, p_discount, p_emb, _ = held
        if p_emb == 0:
            _write_embeddings(tree_embeddings, 1 + w * K, kw, next_embedding)
    if small:  # the tree's priors: torch's softmax of every wave's logits (the torch path's bits)
        store = torch.from_numpy(fbuf[small_at : small_at + W * K * B * A].reshape(W * K * B, A))
        _rewrite_priors(fbuf, dims, torch.softmax(store, dim=-1).numpy())

    log_visits, action_noise, temperature = _DUMMY_F2, _DUMMY_F2, _ZERO
    if not gumbel and config.temperature != 0:
        g = noise.action if noise is not None and noise.action is not None else None
        if g is None:
            g = sample_gumbel((B, A), generator)
        check_noise("noise.action", g, B, A, cpu_dev)
        action_noise = _np(g)
        # The torch path's log, on a view of the same layout (tree.edges[:, ROOT, VISITS]).
        edges_np = fbuf[: B * N * _C * A].reshape(B, N, _C, A)
        log_visits = torch.log(torch.from_numpy(edges_np[:, 0, VISITS])).numpy()
        temperature = _F32(config.temperature)
    out_f = np.empty(2 * B * A + B, np.float32)
    out_i = np.empty(B * A + B, np.int64)
    _outputs(fbuf, dims, cf, inv, temperature, log_visits, action_noise, out_f, out_i)
    return SearchOutput(
        action=torch.from_numpy(out_i[B * A :]),
        action_weights=torch.from_numpy(out_f[: B * A].reshape(B, A)),
        visit_counts=torch.from_numpy(out_i[: B * A].reshape(B, A)),
        root_value=torch.from_numpy(out_f[2 * B * A :]),
        qvalues=torch.from_numpy(out_f[B * A : 2 * B * A].reshape(B, A)),
        tree=tree,
    )


_NP_F32 = np.dtype(np.float32)
_NO_OUTPUT_1 = np.zeros(0, np.float32)
_NO_OUTPUT_2 = np.zeros((0, 0), np.float32)


@functools.lru_cache(maxsize=32)
def _no_embedding(dtype: np.dtype, ndim: int) -> np.ndarray:
    """A size-0 array of the embeddings' type for `_wave_arrays`' first wave (one compile per type)."""
    return np.zeros((0,) * ndim, dtype)


def _numpy_waves(
    fn: Callable, fbuf: np.ndarray, ibuf: np.ndarray, emb_nodes: np.ndarray, emb_in: np.ndarray,
    embs: np.ndarray, acts: np.ndarray, n: int, K: int, B: int, A: int, small: bool,
) -> None:  # fmt: skip
    """Every wave of a search with a NumpyRecurrentFn's `fn` (one-tensor embedding): `_wave_arrays`, then
    fn on wave w's rows of `acts` [W, K * B] and `embs` [W, K * B, ...] (a view of emb_in [W, K * B, D]; the
    search's buffers: each wave's rows are its own, fn may keep them). Outputs that are not C-contiguous float32 arrays of the wave's shapes with a
    next embedding like the input take `check_numpy_output` (it converts, or raises)."""
    W = acts.shape[0]
    rest = embs.shape[2:]
    nxt = _no_embedding(embs.dtype, 1 + len(rest))
    prior = logits = _NO_OUTPUT_2
    value = reward = discount = _NO_OUTPUT_1
    rows = K * B
    r, ra, re = (rows,), (rows, A), (rows, *rest)
    one = rows == 1 and not rest  # arrays of shape [1]: C-contiguous whatever their stride
    wl = W - 1 if n % K else -1  # a last, partial wave
    F, E, ND, RO = _NP_F32, embs.dtype, np.ndarray, RecurrentOutput
    for w in range(W):
        _wave_arrays(fbuf, ibuf, emb_nodes, emb_in, w, prior, value, reward, discount, nxt)
        if w == wl:
            rows = (n - w * K) * B
            r, ra, re = (rows,), (rows, A), (rows, *rest)
            one = rows == 1 and not rest
            emb = embs[w, :rows]
            out, nxt = fn(acts[w, :rows], emb)
        else:
            emb = embs[w]
            out, nxt = fn(acts[w], emb)
        ok = False
        if type(out) is RO and type(nxt) is ND:
            reward, discount, logits, value = out
            if type(reward) is ND and type(discount) is ND and type(logits) is ND and type(value) is ND:
                ok = (
                    reward.dtype is F and discount.dtype is F and logits.dtype is F and value.dtype is F
                    and nxt.dtype is E and reward.shape == r and discount.shape == r and value.shape == r
                    and logits.shape == ra and nxt.shape == re and logits.flags.c_contiguous
                    and (one or (reward.flags.c_contiguous and discount.flags.c_contiguous
                                 and value.flags.c_contiguous and nxt.flags.c_contiguous))
                )  # fmt: skip
        if not ok:
            (reward, discount, logits, value), nxt = check_numpy_output(out, nxt, rows, A, emb)
        # The torch path's softmax for large batches (MuZero's bits); small ones: the compiled softmax.
        prior = logits if small else torch.softmax(torch.from_numpy(logits), dim=-1).numpy()
    _wave_arrays(fbuf, ibuf, emb_nodes, emb_in, W, prior, value, reward, discount, nxt)


def _write_embeddings(tree_embeddings: Any, first: int, kw: int, next_embedding: Any) -> None:
    """Store the [Kw * B, ...] (k-major) new embeddings as nodes first .. first + kw - 1, with torch."""
    if kw == 1:
        tree_map2(lambda dst, src: dst[:, first].copy_(src), tree_embeddings, next_embedding)
        return
    tree_map2(
        lambda dst, src: dst[:, first : first + kw].copy_(src.reshape(kw, -1, *src.shape[1:]).transpose(0, 1)),
        tree_embeddings,
        next_embedding,
    )
