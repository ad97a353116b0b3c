"""Fused Triton kernels (CUDA only) for the selection walk and the backup of the batched search.

Shapes: B trees (one Triton program each), N nodes, A actions (one block of BLOCK_A >= A lanes),
L = path buffer length (num_simulations + 1). This module owns the two kernels and their dispatch:

* `select`: at each root choose an action (MuZero PUCT with the invalid-action mask, or Gumbel MuZero's
  sequential-halving rule), then walk down while the chosen child exists, scoring each node's children
  (PUCT, or Gumbel's interior rule), and record the path, its depth and its leaf edge;
* `expand_backup`: write the new node (network value, reward, discount, parent links, child index),
  then walk the path back up from it, updating node visits / value sums, the statistics of every edge on
  the path and (MuZero) the tree's min/max Q.

So a simulation on CUDA is: select kernel, gather of the parents' embeddings, recurrent_fn, softmax of
its logits (torch, shared with the torch path so the priors are the same bits), expand_backup kernel.

With virtual loss K > 1 (MuZero only), a wave of K simulations per tree is: K `select_claim` launches (each walk
sees the pending visits of the walks before it, then claims its leaf edge and adds its pending visits), one
network call for the K * B leaves, `expand_wave` (the K new nodes of each tree), and K `backup` launches, in
order. The walks and backups of a wave are separate launches so that each sees the previous one's writes through
a kernel boundary. The chain of network calls that bounds a small batch's search is K times shorter.

Both compute the same float32 operations in the same order as the torch path (action_selection.py,
qtransforms.py, search._backup) with fused multiply-add disabled and round-to-nearest division, so MuZero
visit counts are bit-identical to the torch path's. (The Gumbel interior rule sums over actions and uses
exp/log, whose last bits may differ from torch's; only a near-exact tie could then pick another action.)
The kernels are launched with fixed grids and no host synchronisation, so they can be captured in a CUDA
graph. `search.triton=false` turns them off.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from rayzero.tree.context import KernelPath, KernelWave, _Context
from rayzero.tree.tree import DISCOUNT, EDGE_CHANNELS, PRIOR, REWARD, VALUE, VISITS

if TYPE_CHECKING:  # pragma: no cover
    from rayzero.tree.tree import Tree

try:  # pragma: no cover - exercised on CUDA hosts only
    import triton
    import triton.language as tl

    _TRITON = True
except Exception:  # noqa: BLE001 - ImportError, or a broken install
    _TRITON = False


def triton_importable() -> bool:
    """Whether triton imports here."""
    return _TRITON


def available(device: torch.device) -> bool:
    """Whether the fused kernels can run for tensors on `device` (CUDA and an importable triton)."""
    return device.type == "cuda" and _TRITON


@functools.cache
def _block(num_actions: int) -> int:
    return max(16, 1 << (num_actions - 1).bit_length())


if _TRITON:  # pragma: no cover - compiled on CUDA hosts only
    TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny, as qtransforms
    RESCALE_EPSILON = tl.constexpr(1e-8)  # qtransforms.RESCALE_EPSILON
    LOW_LOGIT = tl.constexpr(-1e9)  # action_selection.LOW_LOGIT

    @triton.jit
    def _load_edges(edges_ptr, row, A, offs, amask, C: tl.constexpr, CH: tl.constexpr):
        """One channel [BLOCK_A] of the edges of node `row` (= b * N + node); 0 on padding lanes."""
        return tl.load(edges_ptr + row * (C * A) + CH * A + offs, mask=amask, other=0.0)

    @triton.jit
    def _puct(prior, cvis, q, coef, low, spread, node_value):
        """MuZero PUCT, as action_selection.muzero_scores (same operations, same order)."""
        first_play = tl.minimum(tl.maximum(tl.div_rn(node_value - low, spread), 0.0), 1.0)
        qn = tl.where(cvis > 0, tl.div_rn(q - low, spread), first_play)
        return qn + tl.div_rn(prior * coef, 1.0 + cvis)

    @triton.jit
    def _sigma_completed(prior, cvis, q, raw, amask, maxvisit_init, value_scale):
        """sigma(completed Q) [BLOCK_A] and sum N, as qtransforms.completed_qvalues."""
        visited = cvis > 0
        sum_vis = tl.sum(cvis, 0)
        p = tl.maximum(prior, TINY)
        sum_p = tl.sum(tl.where(visited, p, 0.0), 0)
        wq = tl.div_rn(tl.sum(tl.where(visited, p * q, 0.0), 0), tl.maximum(sum_p, TINY))
        mixed = tl.div_rn(raw + sum_vis * wq, sum_vis + 1.0)
        completed = tl.where(visited, q, mixed)
        lo = tl.min(tl.where(amask, completed, float("inf")), 0)
        hi = tl.max(tl.where(amask, completed, float("-inf")), 0)
        completed = tl.div_rn(completed - lo, tl.maximum(hi - lo, RESCALE_EPSILON))
        scale = (maxvisit_init + tl.max(cvis, 0)) * value_scale
        return scale * completed, sum_vis

    @triton.jit
    def _backup_path(edges_ptr, visits_ptr, sums_ptr, vmin_ptr, vmax_ptr, path_nodes_ptr, path_actions_ptr, b, N, A,
                     L, last, v, cv, cval, r_leaf, d_leaf, LEAF_IN_REGISTERS: tl.constexpr, MINMAX: tl.constexpr,
                     C: tl.constexpr, CH_VISITS: tl.constexpr, CH_VALUE: tl.constexpr, CH_REWARD: tl.constexpr,
                     CH_DISCOUNT: tl.constexpr):
        """Walk tree b's path (edges 0..last) up from its leaf, whose updated visits/value are cv/cval: the edge
        statistics, the nodes' visits and value sums (returns G = r + d * G from the leaf value v), and the
        tree's min/max Q (returned: lo, hi). LEAF_IN_REGISTERS: the leaf edge's reward/discount are r_leaf/d_leaf
        (stored by this program just before, so not read back)."""
        lo = tl.load(vmin_ptr + b)
        hi = tl.load(vmax_ptr + b)
        k = last
        g = v
        while k >= 0:
            p = tl.load(path_nodes_ptr + b * L + k)
            a = tl.load(path_actions_ptr + b * L + k)
            e = edges_ptr + (b * N + p) * (C * A) + a
            if LEAF_IN_REGISTERS:
                r = tl.where(k == last, r_leaf, tl.load(e + CH_REWARD * A))
                d = tl.where(k == last, d_leaf, tl.load(e + CH_DISCOUNT * A))
            else:
                r = tl.load(e + CH_REWARD * A)
                d = tl.load(e + CH_DISCOUNT * A)
            tl.store(e + CH_VISITS * A, cv)
            tl.store(e + CH_VALUE * A, cval)
            if MINMAX:
                qk = r + d * cval
                lo = tl.minimum(lo, qk)
                hi = tl.maximum(hi, qk)
            g = r + d * g
            cv = tl.load(visits_ptr + b * N + p) + 1.0
            cs = tl.load(sums_ptr + b * N + p) + g
            tl.store(visits_ptr + b * N + p, cv)
            tl.store(sums_ptr + b * N + p, cs)
            cval = tl.div_rn(cs, cv)
            k -= 1
        return lo, hi

    @triton.jit
    def _select_kernel(
        edges_ptr,
        visits_ptr,
        sums_ptr,
        raw_ptr,
        children_ptr,
        coef_ptr,
        vmin_ptr,
        vmax_ptr,
        invalid_ptr,
        gumbel_ptr,
        logp_ptr,
        considered_ptr,
        considered_stride,
        path_nodes_ptr,
        path_actions_ptr,
        depth_ptr,
        parent_ptr,
        action_ptr,
        flat_parent_ptr,
        N,
        A,
        L,
        maxvisit_init,
        value_scale,
        min_range,
        GUMBEL: tl.constexpr,
        HAS_INVALID: tl.constexpr,
        C: tl.constexpr,
        CH_PRIOR: tl.constexpr,
        CH_VISITS: tl.constexpr,
        CH_VALUE: tl.constexpr,
        CH_REWARD: tl.constexpr,
        CH_DISCOUNT: tl.constexpr,
        BLOCK_A: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_A)
        amask = offs < A
        if not GUMBEL:  # qtransforms.minmax_bounds
            vmin = tl.load(vmin_ptr + b)
            spread = tl.load(vmax_ptr + b) - vmin
            has_spread = spread > 0
            low = tl.where(has_spread, vmin, 0.0)
            spread = tl.where(has_spread, tl.maximum(spread, min_range), float("inf"))
        # Root step (search._root_action): invalid actions masked; Gumbel's sequential-halving rule.
        row = b * N
        prior = _load_edges(edges_ptr, row, A, offs, amask, C, CH_PRIOR)
        cvis = _load_edges(edges_ptr, row, A, offs, amask, C, CH_VISITS)
        cval = _load_edges(edges_ptr, row, A, offs, amask, C, CH_VALUE)
        crew = _load_edges(edges_ptr, row, A, offs, amask, C, CH_REWARD)
        cdis = _load_edges(edges_ptr, row, A, offs, amask, C, CH_DISCOUNT)
        q = crew + cdis * cval
        if GUMBEL:
            sigma, sum_vis = _sigma_completed(
                prior, cvis, q, tl.load(raw_ptr + row), amask, maxvisit_init, value_scale
            )
            g = tl.load(gumbel_ptr + b * A + offs, mask=amask, other=0.0)
            lp = tl.load(logp_ptr + b * A + offs, mask=amask, other=float("-inf"))
            score = tl.maximum(g + lp + sigma, LOW_LOGIT)
            considered = tl.load(considered_ptr + b * considered_stride)
            score = tl.where(cvis == considered, score, float("-inf"))
        else:
            node_visits = tl.load(visits_ptr + row)
            coef = tl.load(coef_ptr + node_visits.to(tl.int32))
            score = _puct(prior, cvis, q, coef, low, spread, tl.div_rn(tl.load(sums_ptr + row), node_visits))
        if HAS_INVALID:
            invalid = tl.load(invalid_ptr + b * A + offs, mask=amask, other=1)
            score = tl.where(invalid != 0, float("-inf"), score)
        score = tl.where(amask, score, float("-inf"))
        a = tl.argmax(score, 0, tie_break_left=True).to(tl.int64)
        node = b * 0
        tl.store(path_nodes_ptr + b * L, node)
        tl.store(path_actions_ptr + b * L, a)
        child = tl.load(children_ptr + row * A + a)
        depth = node + 1
        parent = node
        act = a
        # Interior steps: walk on while the chosen child exists.
        while (child != -1) & (depth < L):
            node = child
            row = b * N + node
            prior = _load_edges(edges_ptr, row, A, offs, amask, C, CH_PRIOR)
            cvis = _load_edges(edges_ptr, row, A, offs, amask, C, CH_VISITS)
            cval = _load_edges(edges_ptr, row, A, offs, amask, C, CH_VALUE)
            crew = _load_edges(edges_ptr, row, A, offs, amask, C, CH_REWARD)
            cdis = _load_edges(edges_ptr, row, A, offs, amask, C, CH_DISCOUNT)
            q = crew + cdis * cval
            if GUMBEL:  # action_selection.gumbel_interior_scores
                sigma, sum_vis = _sigma_completed(
                    prior, cvis, q, tl.load(raw_ptr + row), amask, maxvisit_init, value_scale
                )
                logits = tl.where(amask, tl.log(prior) + sigma, float("-inf"))
                ex = tl.exp(logits - tl.max(logits, 0))
                improved = tl.div_rn(ex, tl.sum(ex, 0))
                score = improved - tl.div_rn(cvis, 1.0 + sum_vis)
            else:
                node_visits = tl.load(visits_ptr + row)
                coef = tl.load(coef_ptr + node_visits.to(tl.int32))
                score = _puct(prior, cvis, q, coef, low, spread, tl.div_rn(tl.load(sums_ptr + row), node_visits))
            score = tl.where(amask, score, float("-inf"))
            a = tl.argmax(score, 0, tie_break_left=True).to(tl.int64)
            tl.store(path_nodes_ptr + b * L + depth, node)
            tl.store(path_actions_ptr + b * L + depth, a)
            depth += 1
            parent = node
            act = a
            child = tl.load(children_ptr + row * A + a)
        tl.store(depth_ptr + b, depth)
        tl.store(parent_ptr + b, parent)
        tl.store(action_ptr + b, act)
        tl.store(flat_parent_ptr + b, b * N + parent)

    @triton.jit(do_not_specialize=["leaf"])
    def _expand_backup_kernel(
        edges_ptr,
        visits_ptr,
        sums_ptr,
        raw_ptr,
        rewards_ptr,
        discounts_ptr,
        parents_ptr,
        afp_ptr,
        children_ptr,
        vmin_ptr,
        vmax_ptr,
        path_nodes_ptr,
        path_actions_ptr,
        depth_ptr,
        parent_ptr,
        action_ptr,
        value_ptr,
        reward_ptr,
        discount_ptr,
        value_stride,
        reward_stride,
        discount_stride,
        leaf,
        N,
        A,
        L,
        MINMAX: tl.constexpr,
        C: tl.constexpr,
        CH_VISITS: tl.constexpr,
        CH_VALUE: tl.constexpr,
        CH_REWARD: tl.constexpr,
        CH_DISCOUNT: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        v = tl.load(value_ptr + b * value_stride)
        r_leaf = tl.load(reward_ptr + b * reward_stride)
        d_leaf = tl.load(discount_ptr + b * discount_stride)
        parent = tl.load(parent_ptr + b)
        act = tl.load(action_ptr + b)
        # Expansion (search._expand): the new node `leaf` hangs off edge (parent, act).
        node_row = b * N + leaf
        tl.store(raw_ptr + node_row, v)
        tl.store(rewards_ptr + node_row, r_leaf)
        tl.store(discounts_ptr + node_row, d_leaf)
        tl.store(parents_ptr + node_row, parent)
        tl.store(afp_ptr + node_row, act)
        tl.store(children_ptr + (b * N + parent) * A + act, node_row - b * N)
        e = edges_ptr + (b * N + parent) * (C * A) + act
        tl.store(e + CH_REWARD * A, r_leaf)
        tl.store(e + CH_DISCOUNT * A, d_leaf)
        # Backup (search._backup): the new node's first visit, then up the path.
        cv = tl.load(visits_ptr + node_row) + 1.0
        cs = tl.load(sums_ptr + node_row) + v
        tl.store(visits_ptr + node_row, cv)
        tl.store(sums_ptr + node_row, cs)
        cval = tl.div_rn(cs, cv)
        lo, hi = _backup_path(edges_ptr, visits_ptr, sums_ptr, vmin_ptr, vmax_ptr, path_nodes_ptr, path_actions_ptr,
                              b, N, A, L, tl.load(depth_ptr + b) - 1, v, cv, cval, r_leaf, d_leaf,
                              True, MINMAX, C, CH_VISITS, CH_VALUE, CH_REWARD, CH_DISCOUNT)
        if MINMAX:
            tl.store(vmin_ptr + b, lo)
            tl.store(vmax_ptr + b, hi)


    @triton.jit
    def _puct_vl(prior, cvis, q, vv, coef_ptr, node_visits, low, spread, node_value):
        """MuZero PUCT with pending visits `vv` (virtual loss), as action_selection.muzero_scores with
        virtual_visits (same operations, same order): a pending visit counts as a visit that returned normalised
        Q 0, for the child and for the node."""
        first_play = tl.minimum(tl.maximum(tl.div_rn(node_value - low, spread), 0.0), 1.0)
        qn = tl.where(cvis > 0, tl.div_rn(q - low, spread), 0.0)
        eff = cvis + vv
        qn = tl.where(cvis > 0, tl.div_rn(qn * cvis, tl.maximum(eff, 1.0)), tl.where(vv > 0, 0.0, first_play))
        coef = tl.load(coef_ptr + (node_visits + tl.sum(vv, 0)).to(tl.int32))
        return qn + tl.div_rn(prior * coef, 1.0 + eff)

    @triton.jit
    def _select_claim_kernel(
        edges_ptr,
        visits_ptr,
        sums_ptr,
        children_ptr,
        coef_ptr,
        vmin_ptr,
        vmax_ptr,
        invalid_ptr,
        vv_ptr,
        path_nodes_ptr,
        path_actions_ptr,
        depth_ptr,
        parent_ptr,
        action_ptr,
        flat_parent_ptr,
        leaf_ptr,
        dup_ptr,
        wave_start,
        new_index,
        N,
        A,
        L,
        min_range,
        HAS_INVALID: tl.constexpr,
        C: tl.constexpr,
        CH_PRIOR: tl.constexpr,
        CH_VISITS: tl.constexpr,
        CH_VALUE: tl.constexpr,
        CH_REWARD: tl.constexpr,
        CH_DISCOUNT: tl.constexpr,
        BLOCK_A: tl.constexpr,
    ):
        """One virtual-loss walk per tree (search._select with wave_start, then search._claim): walk on while
        the chosen child is a complete node (< wave_start); claim the leaf edge for `new_index` unless an earlier
        walk of the wave claimed it (dup: the leaf is that pending node); one pending visit on every path edge."""
        b = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_A)
        amask = offs < A
        vmin = tl.load(vmin_ptr + b)
        spread = tl.load(vmax_ptr + b) - vmin
        has_spread = spread > 0
        low = tl.where(has_spread, vmin, 0.0)
        spread = tl.where(has_spread, tl.maximum(spread, min_range), float("inf"))
        node = b * 0
        depth = node
        child = node
        walking = node == 0
        while walking:
            row = b * N + node
            prior = _load_edges(edges_ptr, row, A, offs, amask, C, CH_PRIOR)
            cvis = _load_edges(edges_ptr, row, A, offs, amask, C, CH_VISITS)
            cval = _load_edges(edges_ptr, row, A, offs, amask, C, CH_VALUE)
            crew = _load_edges(edges_ptr, row, A, offs, amask, C, CH_REWARD)
            cdis = _load_edges(edges_ptr, row, A, offs, amask, C, CH_DISCOUNT)
            vv = tl.load(vv_ptr + row * A + offs, mask=amask, other=0.0)
            q = crew + cdis * cval
            node_visits = tl.load(visits_ptr + row)
            score = _puct_vl(prior, cvis, q, vv, coef_ptr, node_visits, low, spread,
                             tl.div_rn(tl.load(sums_ptr + row), node_visits))
            if HAS_INVALID:
                if depth == 0:
                    invalid = tl.load(invalid_ptr + b * A + offs, mask=amask, other=1)
                    score = tl.where(invalid != 0, float("-inf"), score)
            score = tl.where(amask, score, float("-inf"))
            a = tl.argmax(score, 0, tie_break_left=True).to(tl.int64)
            tl.store(path_nodes_ptr + b * L + depth, node)
            tl.store(path_actions_ptr + b * L + depth, a)
            # This walk's pending visit on edge (node, a); no later step of the walk reads this node's row.
            tl.store(vv_ptr + row * A + a, tl.sum(tl.where(offs == a, vv, 0.0), 0) + 1.0)
            depth += 1
            child = tl.load(children_ptr + row * A + a)
            walking = (child != -1) & (child < wave_start) & (depth < L)
            if walking:
                node = child
            else:
                tl.store(parent_ptr + b, node)
                tl.store(action_ptr + b, a)
                tl.store(flat_parent_ptr + b, row)
                dup = child != -1
                tl.store(children_ptr + row * A + a, tl.where(dup, child, new_index))
                tl.store(leaf_ptr + b, tl.where(dup, child, new_index))
                tl.store(dup_ptr + b, dup.to(tl.int8))
        tl.store(depth_ptr + b, depth)

    @triton.jit
    def _expand_wave_kernel(
        edges_ptr,
        raw_ptr,
        rewards_ptr,
        discounts_ptr,
        parents_ptr,
        afp_ptr,
        parent_ptr,
        action_ptr,
        dup_ptr,
        value_ptr,
        reward_ptr,
        discount_ptr,
        value_stride,
        reward_stride,
        discount_stride,
        first,
        K,
        B,
        N,
        A,
        C: tl.constexpr,
        CH_REWARD: tl.constexpr,
        CH_DISCOUNT: tl.constexpr,
    ):
        """The K new nodes of tree b (search._expand with virtual loss): node first + k takes leaf k's network
        value, reward and discount; it hangs off its walk's leaf edge unless that walk was a duplicate (then it
        has no parent, and the edge keeps the reward of the walk that claimed it)."""
        b = tl.program_id(0).to(tl.int64)
        for k in range(K):
            i = k * B + b
            v = tl.load(value_ptr + i * value_stride)
            r = tl.load(reward_ptr + i * reward_stride)
            d = tl.load(discount_ptr + i * discount_stride)
            parent = tl.load(parent_ptr + i)
            act = tl.load(action_ptr + i)
            dup = tl.load(dup_ptr + i)
            node_row = b * N + first + k
            tl.store(raw_ptr + node_row, v)
            tl.store(rewards_ptr + node_row, r)
            tl.store(discounts_ptr + node_row, d)
            tl.store(parents_ptr + node_row, tl.where(dup != 0, -1, parent))
            tl.store(afp_ptr + node_row, tl.where(dup != 0, -1, act))
            if dup == 0:
                e = edges_ptr + (b * N + parent) * (C * A) + act
                tl.store(e + CH_REWARD * A, r)
                tl.store(e + CH_DISCOUNT * A, d)

    @triton.jit
    def _backup_kernel(
        edges_ptr,
        visits_ptr,
        sums_ptr,
        vmin_ptr,
        vmax_ptr,
        path_nodes_ptr,
        path_actions_ptr,
        depth_ptr,
        leaf_ptr,
        value_ptr,
        value_stride,
        N,
        A,
        L,
        C: tl.constexpr,
        CH_VISITS: tl.constexpr,
        CH_VALUE: tl.constexpr,
        CH_REWARD: tl.constexpr,
        CH_DISCOUNT: tl.constexpr,
    ):
        """search._backup of one walk per tree (virtual loss): its leaf node's value up its path (MuZero)."""
        b = tl.program_id(0).to(tl.int64)
        v = tl.load(value_ptr + b * value_stride)
        node_row = b * N + tl.load(leaf_ptr + b)
        cv = tl.load(visits_ptr + node_row) + 1.0
        cs = tl.load(sums_ptr + node_row) + v
        tl.store(visits_ptr + node_row, cv)
        tl.store(sums_ptr + node_row, cs)
        lo, hi = _backup_path(edges_ptr, visits_ptr, sums_ptr, vmin_ptr, vmax_ptr, path_nodes_ptr, path_actions_ptr,
                              b, N, A, L, tl.load(depth_ptr + b) - 1, v, cv, tl.div_rn(cs, cv), 0.0, 0.0,
                              False, True, C, CH_VISITS, CH_VALUE, CH_REWARD, CH_DISCOUNT)
        tl.store(vmin_ptr + b, lo)
        tl.store(vmax_ptr + b, hi)


_CHANNELS = {
    "C": EDGE_CHANNELS,
    "CH_VISITS": VISITS,
    "CH_VALUE": VALUE,
    "CH_REWARD": REWARD,
    "CH_DISCOUNT": DISCOUNT,
}


def select(tree: Tree, ctx: _Context, sim: int) -> KernelPath:
    """Fused selection walk of simulation `sim` (root step included) -> the path buffers of the search."""
    path = ctx.triton_path
    if path is None:
        path = ctx.triton_path = KernelPath(ctx)
    B, N, A = ctx.B, ctx.N, ctx.A
    gumbel = ctx.gumbel
    invalid = ctx.invalid.view(torch.uint8) if ctx.invalid is not None else tree.edges
    if gumbel:
        gumbel_noise, logp = ctx.root_gumbel, ctx.root_log_prior
        considered, considered_stride = ctx.considered[:, sim], ctx.considered.stride(0)
    else:
        gumbel_noise = logp = considered = tree.edges  # unused pointers
        considered_stride = 0
    _select_kernel[(B,)](
        tree.edges,
        tree.node_visits,
        tree.value_sums,
        tree.raw_values,
        tree.children_index,
        ctx.coef,
        tree.value_min,
        tree.value_max,
        invalid,
        gumbel_noise,
        logp,
        considered,
        considered_stride,
        path.nodes,
        path.actions,
        path.depth,
        path.parent,
        path.action,
        path.flat_parent,
        N,
        A,
        path.nodes.shape[1],
        float(ctx.config.maxvisit_init),
        float(ctx.config.value_scale),
        float(ctx.config.min_q_range),
        GUMBEL=gumbel,
        HAS_INVALID=ctx.invalid is not None,
        CH_PRIOR=PRIOR,
        BLOCK_A=_block(A),
        num_warps=1,
        enable_fp_fusion=False,
        **_CHANNELS,
    )
    return path


def expand_backup(
    tree: Tree,
    ctx: _Context,
    path: KernelPath,
    leaf: int,
    value: torch.Tensor,
    reward: torch.Tensor,
    discount: torch.Tensor,
) -> None:
    """Fused expansion of node `leaf` on each tree's path edge and backup of its value [B] (any stride)."""
    B, N, A = ctx.B, ctx.N, ctx.A
    _expand_backup_kernel[(B,)](
        tree.edges,
        tree.node_visits,
        tree.value_sums,
        tree.raw_values,
        tree.rewards,
        tree.discounts,
        tree.parents,
        tree.action_from_parent,
        tree.children_index,
        tree.value_min,
        tree.value_max,
        path.nodes,
        path.actions,
        path.depth,
        path.parent,
        path.action,
        value,
        reward,
        discount,
        value.stride(0),
        reward.stride(0),
        discount.stride(0),
        leaf,
        N,
        A,
        path.nodes.shape[1],
        MINMAX=not ctx.gumbel,
        num_warps=1,
        enable_fp_fusion=False,
        **_CHANNELS,
    )


def select_claim(tree: Tree, ctx: _Context, wave: KernelWave, k: int, wave_start: int) -> None:
    """Walk k of a virtual-loss wave (MuZero): its path into wave.*[k], its leaf node (new_index
    wave_start + k, or the pending node an earlier walk claimed) into wave.leaf[k] and wave.dup[k]."""
    B, N, A = ctx.B, ctx.N, ctx.A
    assert tree.virtual_visits is not None
    invalid = ctx.invalid.view(torch.uint8) if ctx.invalid is not None else tree.edges
    _select_claim_kernel[(B,)](
        tree.edges,
        tree.node_visits,
        tree.value_sums,
        tree.children_index,
        ctx.coef,
        tree.value_min,
        tree.value_max,
        invalid,
        tree.virtual_visits,
        wave.nodes[k],
        wave.actions[k],
        wave.depth[k],
        wave.parent[k],
        wave.action[k],
        wave.flat_parent[k],
        wave.leaf[k],
        wave.dup[k],
        wave_start,
        wave_start + k,
        N,
        A,
        wave.nodes.shape[2],
        float(ctx.config.min_q_range),
        HAS_INVALID=ctx.invalid is not None,
        CH_PRIOR=PRIOR,
        BLOCK_A=_block(A),
        num_warps=1,
        enable_fp_fusion=False,
        **_CHANNELS,
    )


def expand_wave(tree: Tree, ctx: _Context, wave: KernelWave, first: int, k_wave: int, value: torch.Tensor,
                reward: torch.Tensor, discount: torch.Tensor) -> None:
    """Write nodes first..first + k_wave - 1 of every tree from the wave's network outputs ([k_wave * B] each,
    walk-major, any stride)."""
    B, N, A = ctx.B, ctx.N, ctx.A
    _expand_wave_kernel[(B,)](
        tree.edges,
        tree.raw_values,
        tree.rewards,
        tree.discounts,
        tree.parents,
        tree.action_from_parent,
        wave.parent,
        wave.action,
        wave.dup,
        value,
        reward,
        discount,
        value.stride(0),
        reward.stride(0),
        discount.stride(0),
        first,
        k_wave,
        B,
        N,
        A,
        C=EDGE_CHANNELS,
        CH_REWARD=REWARD,
        CH_DISCOUNT=DISCOUNT,
        num_warps=1,
    )


def backup(tree: Tree, ctx: _Context, wave: KernelWave, k: int, value: torch.Tensor) -> None:
    """Back walk k's leaf value [B] (any stride) up its path (virtual loss, MuZero)."""
    B, N, A = ctx.B, ctx.N, ctx.A
    _backup_kernel[(B,)](
        tree.edges,
        tree.node_visits,
        tree.value_sums,
        tree.value_min,
        tree.value_max,
        wave.nodes[k],
        wave.actions[k],
        wave.depth[k],
        wave.leaf[k],
        value,
        value.stride(0),
        N,
        A,
        wave.nodes.shape[2],
        num_warps=1,
        enable_fp_fusion=False,
        **_CHANNELS,
    )
