"""Batched MuZero / Gumbel MuZero tree search over B trees at once (one recurrent_fn call per wave).

Shapes: B = trees, A = actions, N = num_simulations + 1 nodes, K = config.virtual_loss paths per tree and
wave, L = steps of a selection walk. This module owns the search loop: root initialisation, the selection
walk, expansion through `recurrent_fn`, the backup, and the played action. Everything is batched over trees
with static shapes, so a whole search can be captured as one CUDA graph (capture.py); the Triton kernels
(kernels.py) and the compiled CPU tree (cpu.py) replace the walk and the backup with the same arithmetic.
What callers should know (masks, root value, Q normalisation, virtual loss): docs/architecture.md.
"""

from __future__ import annotations

from typing import Any

import torch

from rayzero.tree import cpu, kernels
from rayzero.tree.action_selection import (
    gumbel_interior_scores,
    gumbel_root_scores,
    mask_root,
    muzero_scores,
)
from rayzero.tree.base import RecurrentFn, RecurrentOutput, RootOutput, SearchConfig, SearchOutput
from rayzero.tree.context import KernelWave, _Context
from rayzero.tree.noise import SearchNoise, dirichlet_from_log_gamma, sample_gumbel, sample_log_gamma
from rayzero.tree.qtransforms import completed_qvalues, minmax_bounds
from rayzero.tree.seq_halving import considered_visits_table
from rayzero.tree.tree import (
    DISCOUNT,
    EDGE_CHANNELS,
    NO_PARENT,
    PRIOR,
    REWARD,
    ROOT,
    UNVISITED,
    VALUE,
    VISITS,
    Tree,
    allocate_tree,
    tree_leaves,
    tree_map,
    tree_map2,
)


def search(
    root: RootOutput,
    recurrent_fn: RecurrentFn,
    num_simulations: int,
    config: SearchConfig = SearchConfig(),  # noqa: B008 - frozen dataclass, never mutated
    invalid_actions: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    *,
    noise: SearchNoise | None = None,
    use_triton: bool | None = None,
) -> SearchOutput:
    """Run `num_simulations` simulations on each of B trees; returns a SearchOutput of [B] / [B, A] tensors.

    root: RootOutput(prior_logits [B, A], value [B], embedding [B, ...] tensor or pytree of them).
    recurrent_fn(action [B'] int64, embedding [B', ...]) -> (RecurrentOutput([B'], [B'], [B', A], [B']),
        next_embedding [B', ...]), with B' = B (B * K with virtual loss K; less on a last partial wave).
        A `NumpyRecurrentFn` (base.py) wraps a function on numpy arrays instead: the compiled CPU tree calls it
        without tensors; elsewhere it converts.
    invalid_actions: [B, A] bool, True = illegal at the root; None = all legal.
    generator: torch.Generator on the inputs' device, for every random draw; None = torch's default.
    noise: precomputed random inputs (noise.sample_noise); fields left None are drawn with `generator`.
    use_triton: None = fused Triton kernels if config.triton, on CUDA and Triton imports; False = torch;
        True = require the kernels (ValueError if they can't be used).
    """
    n = _check_num_simulations(num_simulations)
    if not isinstance(config, SearchConfig):
        raise ValueError(f"config must be a SearchConfig, got {type(config).__name__}")  # noqa: TRY004
    logits, value, embedding, invalid = _check_root(root, invalid_actions)
    B, A = logits.shape
    device = logits.device
    K = min(config.virtual_loss, n)
    if K > 1 and config.policy != "muzero":
        raise ValueError(
            f"search.virtual_loss={config.virtual_loss} is only implemented for policy='muzero', "
            f"not policy={config.policy!r}: use virtual_loss=1"
        )
    if 0 < config.virtual_loss_max_trees < B:
        K = 1  # a large search: one walk per wave (search.virtual_loss_max_trees)
    N = n + 1
    if config.max_nodes > 0 and N > config.max_nodes:
        raise ValueError(
            f"num_simulations={n} needs {N} nodes per tree but search.max_nodes={config.max_nodes}: "
            f"use num_simulations <= {config.max_nodes - 1} or raise max_nodes (0 = no cap)"
        )
    if generator is not None and generator.device.type != device.type:
        raise ValueError(f"generator is on {generator.device} but the search inputs are on {device}")
    triton_ok = kernels.available(device)
    if use_triton and not triton_ok:
        raise ValueError(
            f"use_triton=True needs CUDA tensors and an importable triton "
            f"(device={device}, triton={kernels.triton_importable()})"
        )
    triton = (triton_ok and config.triton) if use_triton is None else bool(use_triton)
    per_row = noise is not None and (noise.root_fraction is not None or noise.temperature is not None)
    # tree/cpu.py: the whole search compiled, CPU tensors (per-row settings of merged batches: the torch path)
    if cpu.use_numba(device, config.cpu_backend) and not per_row:
        return cpu.run_search(
            logits, value, embedding, invalid, recurrent_fn, n, K, config, noise, generator,
            _check_recurrent, _check_noise,
        )  # fmt: skip

    tree = allocate_tree(B, N, A, embedding, device=device, virtual_loss=K > 1)
    ctx = _Context(tree, config, invalid, n, K, device)
    _init_root(tree, ctx, logits, value, embedding, noise, generator)

    num_waves = -(-n // K)
    for w in range(num_waves):
        first = 1 + w * K
        k_wave = min(K, n - w * K)
        max_steps = 1 + w * K  # a tree of `first` complete nodes is at most that many steps deep
        if triton and K == 1:
            _simulate_fused(tree, ctx, recurrent_fn, sim=w)
            continue
        if triton:
            _wave_fused(tree, ctx, recurrent_fn, first, k_wave)
            continue
        if K == 1:
            path = _select(tree, ctx, sim=w, max_steps=max_steps)
            leaf = torch.full((B,), first, dtype=torch.int64, device=device)
            leaf_value = _expand(tree, ctx, recurrent_fn, [path], first, None)
            _backup(tree, ctx, path, leaf, leaf_value[0])
            continue
        # Virtual loss: K walks that see each other's pending visits, one network call, K backups.
        paths, leaves, dups = [], [], []
        for k in range(k_wave):
            path = _select(tree, ctx, sim=w, max_steps=max_steps, wave_start=first)
            leaf, dup = _claim(tree, ctx, path, first + k)
            paths.append(path)
            leaves.append(leaf)
            dups.append(dup)
        assert tree.virtual_visits is not None
        tree.virtual_visits.zero_()
        leaf_values = _expand(tree, ctx, recurrent_fn, paths, first, dups)
        for k in range(k_wave):
            _backup(tree, ctx, paths[k], leaves[k], leaf_values[k])

    return _outputs(tree, ctx, noise, generator)


# --------------------------------------------------------------------------------------------- checks


def _check_num_simulations(num_simulations: Any) -> int:
    if isinstance(num_simulations, bool) or not isinstance(num_simulations, int) or num_simulations < 1:
        raise ValueError(f"num_simulations={num_simulations!r} is invalid: must be an integer >= 1")
    return num_simulations


def _check_root(
    root: Any, invalid_actions: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, Any, torch.Tensor | None]:
    if not isinstance(root, RootOutput):
        got = type(root).__name__
        raise ValueError(f"root must be a RootOutput(prior_logits, value, embedding), got {got}")  # noqa: TRY004
    logits, value = root.prior_logits, root.value
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(
            f"root.prior_logits must be a float tensor [B, A], got "
            f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}"
        )
    B, A = logits.shape
    if B < 1 or A < 1:
        raise ValueError(f"root.prior_logits has shape {tuple(logits.shape)}: need B >= 1 and A >= 1")
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != (B,):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"root.value must have shape [B]=({B},) to match root.prior_logits, got {shape}")
    if value.device != logits.device:
        raise ValueError(f"root.value is on {value.device} but root.prior_logits is on {logits.device}")
    leaves = tree_leaves(root.embedding)
    if not leaves:
        raise ValueError("root.embedding holds no tensor")
    for leaf in leaves:
        if leaf.dim() < 1 or leaf.shape[0] != B:
            raise ValueError(f"root.embedding leaves must be [B={B}, ...], got shape {tuple(leaf.shape)}")
        if leaf.device != logits.device:
            raise ValueError(
                f"root.embedding is on {leaf.device} but root.prior_logits is on {logits.device}"
            )
    if invalid_actions is not None:
        if not isinstance(invalid_actions, torch.Tensor) or invalid_actions.dtype != torch.bool:
            kind = (
                invalid_actions.dtype if isinstance(invalid_actions, torch.Tensor) else type(invalid_actions)
            )
            raise ValueError(f"invalid_actions must be a bool tensor [B, A] (True = invalid), got {kind}")
        if tuple(invalid_actions.shape) != (B, A):
            raise ValueError(
                f"invalid_actions has shape {tuple(invalid_actions.shape)} but root.prior_logits is [B, A]=({B}, {A})"
            )
        if invalid_actions.device != logits.device:
            raise ValueError(
                f"invalid_actions is on {invalid_actions.device} but the root is on {logits.device}"
            )
        if invalid_actions.device.type == "cpu":  # free here; on CUDA it would be a host sync
            all_invalid = invalid_actions.all(dim=1)
            if bool(all_invalid.any()):
                rows = all_invalid.nonzero().flatten().tolist()[:10]
                raise ValueError(
                    f"invalid_actions marks every action invalid in row(s) {rows}: nothing to search"
                )
    return logits.float(), value.float(), root.embedding, invalid_actions


def _check_recurrent(out: Any, next_embedding: Any, rows: int, A: int, embedding_template: Any) -> None:
    if not isinstance(out, RecurrentOutput):
        raise ValueError(  # noqa: TRY004
            f"recurrent_fn must return (RecurrentOutput, next_embedding), got {type(out).__name__} first"
        )
    for name in ("reward", "discount", "value"):
        t = getattr(out, name)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (rows,):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"recurrent_fn returned {name} of shape {shape}; expected [{rows}]")
    if not isinstance(out.prior_logits, torch.Tensor) or tuple(out.prior_logits.shape) != (rows, A):
        shape = tuple(out.prior_logits.shape) if isinstance(out.prior_logits, torch.Tensor) else None
        raise ValueError(f"recurrent_fn returned prior_logits of shape {shape}; expected [{rows}, {A}]")
    try:
        new, old = tree_leaves(next_embedding), tree_leaves(embedding_template)
    except ValueError as err:
        raise ValueError(f"recurrent_fn returned a bad next_embedding: {err}") from None
    if len(new) != len(old):
        raise ValueError(
            f"recurrent_fn returned a next_embedding of {len(new)} tensors; the root's has {len(old)}"
        )
    for a, b in zip(new, old):
        if tuple(a.shape[1:]) != tuple(b.shape[2:]) or a.shape[0] != rows:
            raise ValueError(
                f"recurrent_fn returned next_embedding of shape {tuple(a.shape)}; expected "
                f"[{rows}, {', '.join(map(str, b.shape[2:]))}] like the root's embedding"
            )


# ------------------------------------------------------------------------------------------ the search


def _init_root(
    tree: Tree,
    ctx: _Context,
    logits: torch.Tensor,
    value: torch.Tensor,
    embedding: Any,
    noise: SearchNoise | None,
    generator: torch.Generator | None,
) -> None:
    """Write the root (node 0) of every tree: priors after masking (and noise), one visit, its value."""
    config, invalid = ctx.config, ctx.invalid
    B, A = ctx.B, ctx.A
    masked = logits if invalid is None else logits.masked_fill(invalid, float("-inf"))
    prior = torch.softmax(masked, dim=-1)
    if not ctx.gumbel and config.dirichlet_fraction > 0:
        log_gamma = noise.root if noise is not None and noise.root is not None else None
        if log_gamma is None:
            log_gamma = sample_log_gamma(
                config.dirichlet_alpha, (B, A), generator=generator, device=ctx.device
            )
        _check_noise("noise.root", log_gamma, B, A, ctx.device)
        f: float | torch.Tensor = config.dirichlet_fraction
        if noise is not None and noise.root_fraction is not None:
            f = _row_setting("noise.root_fraction", noise.root_fraction, B, ctx.device)
        prior = (1.0 - f) * prior + f * dirichlet_from_log_gamma(log_gamma.float(), invalid)
    if ctx.gumbel:
        ctx.root_log_prior = torch.log_softmax(masked, dim=-1)
        if config.gumbel_scale > 0:
            g = noise.root if noise is not None and noise.root is not None else None
            if g is None:
                g = sample_gumbel((B, A), generator=generator, device=ctx.device)
            _check_noise("noise.root", g, B, A, ctx.device)
            ctx.root_gumbel = config.gumbel_scale * g.float()
            if noise is not None and noise.root_fraction is not None:
                ctx.root_gumbel = ctx.root_gumbel * _row_setting("noise.root_fraction", noise.root_fraction, B,
                                                                 ctx.device)
        else:
            ctx.root_gumbel = torch.zeros((B, A), device=ctx.device)
        m = config.max_num_considered_actions
        valid = torch.full((B,), A, device=ctx.device) if invalid is None else (~invalid).sum(-1)
        num_considered = valid.clamp(max=m)
        table = considered_visits_table(m, ctx.num_simulations, ctx.device)
        ctx.considered = table.index_select(0, num_considered)
    tree.edges[:, ROOT, PRIOR] = prior
    tree.node_visits[:, ROOT] = 1.0
    tree.value_sums[:, ROOT] = value
    tree.raw_values[:, ROOT] = value
    tree_map2(lambda dst, src: dst[:, ROOT].copy_(src), tree.embeddings, embedding)


def _check_noise(name: str, t: torch.Tensor, B: int, A: int, device: torch.device) -> None:
    if tuple(t.shape) != (B, A) or t.device != device:
        raise ValueError(
            f"{name} must be a [B, A]=({B}, {A}) tensor on {device}, got {tuple(t.shape)} on {t.device}"
        )


def _root_action(tree: Tree, ctx: _Context, sim: int) -> torch.Tensor:
    """[B] the action each root takes in simulation `sim` (first step of the walk)."""
    e = tree.edges[:, ROOT]
    config = ctx.config
    if ctx.gumbel:
        assert ctx.considered is not None and ctx.root_log_prior is not None and ctx.root_gumbel is not None
        score = gumbel_root_scores(
            e,
            tree.raw_values[:, ROOT],
            ctx.root_log_prior,
            ctx.root_gumbel,
            ctx.considered[:, sim],
            ctx.invalid,
            maxvisit_init=config.maxvisit_init,
            value_scale=config.value_scale,
        )
    else:
        vv = tree.virtual_visits[:, ROOT] if tree.virtual_visits is not None else None
        visits = tree.node_visits[:, ROOT]
        score = muzero_scores(e, visits, ctx.low, ctx.spread, ctx.coef, vv, tree.value_sums[:, ROOT] / visits)
        score = mask_root(score, ctx.invalid)
    return score.argmax(dim=-1)


def _interior_action(tree: Tree, ctx: _Context, flat: torch.Tensor) -> torch.Tensor:
    """[B] the action taken at interior node `flat` [B] (indices into the [B * N] node views)."""
    e = ctx.edges_flat.index_select(0, flat)
    config = ctx.config
    if ctx.gumbel:
        score = gumbel_interior_scores(
            e,
            ctx.raw_flat.index_select(0, flat),
            maxvisit_init=config.maxvisit_init,
            value_scale=config.value_scale,
        )
    else:
        vv = ctx.vv_flat.index_select(0, flat) if ctx.vv_flat is not None else None
        visits = ctx.visits_flat.index_select(0, flat)
        value = ctx.sums_flat.index_select(0, flat) / visits
        score = muzero_scores(e, visits, ctx.low, ctx.spread, ctx.coef, vv, value)
    return score.argmax(dim=-1)


class Path:
    """One selection walk per tree: nodes/actions [B, L] (valid for positions < depth), depth [B] edges."""

    __slots__ = ("action", "actions", "depth", "nodes", "parent")

    def __init__(self, nodes: torch.Tensor, actions: torch.Tensor, depth: torch.Tensor) -> None:
        self.nodes = nodes
        self.actions = actions
        self.depth = depth
        # The new leaf hangs off edge (parent, action), the path's last edge.
        last = (depth - 1).unsqueeze(-1)
        self.parent = nodes.gather(1, last).squeeze(-1)
        self.action = actions.gather(1, last).squeeze(-1)


def _prepare_walk(tree: Tree, ctx: _Context) -> None:
    """Per-walk constants: MuZero's Q normalisation bounds (min/max change only in the backup)."""
    if not ctx.gumbel:
        ctx.low, ctx.spread = minmax_bounds(tree.value_min, tree.value_max, ctx.config.min_q_range)


def _select(tree: Tree, ctx: _Context, sim: int, max_steps: int, wave_start: int | None = None) -> Path:
    """Walk every tree from the root to an edge with no (complete) child, in at most `max_steps` steps.

    Rows that reached their leaf keep computing (their results are masked out), so the number of steps
    is the same for all rows; on the CPU the walk stops once no row is active.
    `wave_start`: with virtual loss, nodes >= wave_start are pending (claimed this wave): stop there too.
    """
    A = ctx.A
    _prepare_walk(tree, ctx)
    a = _root_action(tree, ctx, sim)
    node = torch.zeros_like(a)
    nodes, actions = [node], [a]
    child = tree.children_index[:, ROOT].gather(1, a.unsqueeze(-1)).squeeze(-1)
    active = child != UNVISITED if wave_start is None else (child != UNVISITED) & (child < wave_start)
    depth = torch.ones_like(a)
    for _ in range(1, max_steps):
        if ctx.on_cpu and not bool(active.any()):
            break
        node = torch.where(active, child, node)
        flat = ctx.rows + node
        a = _interior_action(tree, ctx, flat)
        child = ctx.children_flat.index_select(0, flat * A + a)
        nodes.append(node)
        actions.append(a)
        depth = depth + active
        moved = child != UNVISITED if wave_start is None else (child != UNVISITED) & (child < wave_start)
        active = active & moved
    return Path(torch.stack(nodes, 1), torch.stack(actions, 1), depth)


def _claim(tree: Tree, ctx: _Context, path: Path, new_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Virtual loss: claim the path's leaf edge for node `new_index` and add pending visits along it.

    Returns (leaf [B], dup [B] bool): dup rows ended on an edge already claimed in this wave; their leaf is
    that pending node.
    """
    assert ctx.vv_flat is not None
    A = ctx.A
    idx = (ctx.rows + path.parent) * A + path.action
    existing = ctx.children_flat.index_select(0, idx)
    dup = existing != UNVISITED
    leaf = torch.where(dup, existing, new_index)
    ctx.children_flat[idx] = leaf
    mask = ctx.steps[: path.nodes.shape[1]].unsqueeze(0) < path.depth.unsqueeze(-1)
    edge = (ctx.rows.unsqueeze(-1) + path.nodes) * A + path.actions
    ctx.vv_flat.view(-1).scatter_add_(0, edge.flatten(), mask.flatten().float())
    return leaf, dup


def _expand(
    tree: Tree,
    ctx: _Context,
    recurrent_fn: RecurrentFn,
    paths: list[Path],
    first: int,
    dups: list[torch.Tensor] | None,
) -> torch.Tensor:
    """Evaluate the K leaf edges of every tree in one recurrent_fn call and write nodes first..first+K-1.

    Returns the leaves' network values [K, B]. New nodes start with 0 visits; the backup adds the first.
    """
    B, A, K = ctx.B, ctx.A, len(paths)
    parent = torch.stack([p.parent for p in paths])  # [K, B]
    action = torch.stack([p.action for p in paths])
    flat = (ctx.rows + parent).flatten()  # k-major: row k * B + b
    out = _evaluate_leaves(tree, ctx, recurrent_fn, flat, action.flatten(), first, K)

    def bk(x: torch.Tensor) -> torch.Tensor:
        return _by_tree(x, K, B)

    nodes = slice(first, first + K)
    reward, discount, value = out.reward.float(), out.discount.float(), out.value.float()
    tree.raw_values[:, nodes] = bk(value)
    tree.rewards[:, nodes] = bk(reward)
    tree.discounts[:, nodes] = bk(discount)
    edge = (ctx.rows + parent) * (EDGE_CHANNELS * A) + action  # [K, B] index of channel 0 of each leaf edge
    reward, discount = reward.view(K, B), discount.view(K, B)
    if dups is None:  # K == 1: every leaf edge is new
        tree.parents[:, nodes] = bk(parent.flatten())
        tree.action_from_parent[:, nodes] = bk(action.flatten())
        ctx.children_flat.index_fill_(0, (ctx.rows + parent[0]) * A + action[0], first)
        ctx.edges_1d[edge[0] + REWARD * A] = reward[0]
        ctx.edges_1d[edge[0] + DISCOUNT * A] = discount[0]
    else:
        dup = torch.stack(dups)
        tree.parents[:, nodes] = bk(torch.where(dup, NO_PARENT, parent).flatten())
        tree.action_from_parent[:, nodes] = bk(torch.where(dup, -1, action).flatten())
        # In order, so a duplicate keeps the first walk's reward (children_index was set by _claim).
        for k in range(K):
            for ch, x in ((REWARD, reward[k]), (DISCOUNT, discount[k])):
                idx = edge[k] + ch * A
                ctx.edges_1d[idx] = torch.where(dup[k], ctx.edges_1d.index_select(0, idx), x)
    return value.view(K, B)


def _by_tree(x: torch.Tensor, K: int, B: int) -> torch.Tensor:
    """[K * B, ...] walk-major rows (row k * B + b) -> [B, K, ...]."""
    return x.reshape(K, B, *x.shape[1:]).transpose(0, 1)


def _evaluate_leaves(tree: Tree, ctx: _Context, recurrent_fn: RecurrentFn, flat: torch.Tensor,
                     action: torch.Tensor, first: int, K: int) -> RecurrentOutput:
    """One network call for K leaf edges per tree (walk-major rows: `flat` [K * B] the parents' indices in the
    [B * N] node views, `action` [K * B]); writes nodes first..first + K - 1's embeddings and priors, and returns
    the call's outputs for the rest of the expansion."""
    parent_embedding = tree_map(lambda t: t.flatten(0, 1).index_select(0, flat), tree.embeddings)
    out, next_embedding = recurrent_fn(action, parent_embedding)
    _check_recurrent(out, next_embedding, K * ctx.B, ctx.A, tree.embeddings)
    nodes = slice(first, first + K)
    tree_map2(lambda dst, src: dst[:, nodes].copy_(_by_tree(src, K, ctx.B)), tree.embeddings, next_embedding)
    tree.edges[:, nodes, PRIOR] = _by_tree(torch.softmax(out.prior_logits.float(), dim=-1), K, ctx.B)
    return out


def _simulate_fused(tree: Tree, ctx: _Context, recurrent_fn: RecurrentFn, sim: int) -> None:
    """One simulation with the Triton kernels (K == 1): select, network, softmax, expand + backup."""
    path = kernels.select(tree, ctx, sim)
    parent_embedding = tree_map(lambda t: t.flatten(0, 1).index_select(0, path.flat_parent), tree.embeddings)
    out, next_embedding = recurrent_fn(path.action, parent_embedding)
    _check_recurrent(out, next_embedding, ctx.B, ctx.A, tree.embeddings)
    node = sim + 1
    tree_map2(lambda dst, src: dst[:, node].copy_(src), tree.embeddings, next_embedding)
    tree.edges[:, node, PRIOR] = torch.softmax(out.prior_logits.float(), dim=-1)
    kernels.expand_backup(tree, ctx, path, node, out.value.float(), out.reward.float(), out.discount.float())


def _wave_fused(tree: Tree, ctx: _Context, recurrent_fn: RecurrentFn, first: int, k_wave: int) -> None:
    """One virtual-loss wave with the Triton kernels: k_wave walks, one network call, expansion, k_wave backups
    (the torch path's wave, in the same order)."""
    B = ctx.B
    wave = ctx.triton_wave
    if wave is None:
        wave = ctx.triton_wave = KernelWave(ctx)
    for k in range(k_wave):
        kernels.select_claim(tree, ctx, wave, k, first)
    assert tree.virtual_visits is not None
    tree.virtual_visits.zero_()
    out = _evaluate_leaves(tree, ctx, recurrent_fn, wave.flat_parent[:k_wave].flatten(),
                           wave.action[:k_wave].flatten(), first, k_wave)
    value = out.value.float()
    kernels.expand_wave(tree, ctx, wave, first, k_wave, value, out.reward.float(), out.discount.float())
    for k in range(k_wave):
        kernels.backup(tree, ctx, wave, k, value[k * B:(k + 1) * B])


def _backup(tree: Tree, ctx: _Context, path: Path, leaf: torch.Tensor, leaf_value: torch.Tensor) -> None:
    """Back `leaf_value` [B] up from `leaf` [B] along `path`: visits, value sums, child stats, min/max.

    Returns along the path: G_leaf = v, G_k = r_k + d_k * G_{k+1}. Masked positions (>= depth) add zero to
    a valid node, and their edge writes repeat position 0's write, so duplicates are harmless everywhere.
    """
    A = ctx.A
    L = path.nodes.shape[1]
    steps = ctx.steps[:L]
    mask = steps.unsqueeze(0) < path.depth.unsqueeze(-1)  # [B, L]
    node_flat = ctx.rows.unsqueeze(-1) + path.nodes
    edge = node_flat * (EDGE_CHANNELS * A) + path.actions  # channel 0 of edge (p_k, a_k)
    rewards = ctx.edges_1d[edge + REWARD * A]
    discounts = ctx.edges_1d[edge + DISCOUNT * A]

    leaf_flat = ctx.rows + leaf
    ctx.visits_flat.index_add_(0, leaf_flat, torch.ones_like(leaf_value))
    ctx.sums_flat.index_add_(0, leaf_flat, leaf_value)

    g = leaf_value
    returns = []
    for k in range(L - 1, -1, -1):
        g = torch.where(mask[:, k], rewards[:, k] + discounts[:, k] * g, g)
        returns.append(g)
    returns.reverse()
    ret = torch.stack(returns, 1)
    tree.node_visits.scatter_add_(1, path.nodes, mask.float())
    tree.value_sums.scatter_add_(1, path.nodes, torch.where(mask, ret, 0.0))

    # Child of edge k: the next path node, or the leaf for the last edge.
    child = torch.cat([path.nodes[:, 1:], leaf.unsqueeze(-1)], 1)
    child = torch.where(steps.unsqueeze(0) + 1 < path.depth.unsqueeze(-1), child, leaf.unsqueeze(-1))
    child_flat = ctx.rows.unsqueeze(-1) + child
    child_visits = ctx.visits_flat[child_flat]
    child_values = ctx.sums_flat[child_flat] / child_visits
    edge = torch.where(mask, edge, edge[:, :1])
    ctx.edges_1d[edge + VISITS * A] = torch.where(mask, child_visits, child_visits[:, :1])
    ctx.edges_1d[edge + VALUE * A] = torch.where(mask, child_values, child_values[:, :1])
    if not ctx.gumbel:
        q = rewards + discounts * child_values
        tree.value_min.copy_(torch.minimum(tree.value_min, torch.where(mask, q, float("inf")).amin(1)))
        tree.value_max.copy_(torch.maximum(tree.value_max, torch.where(mask, q, float("-inf")).amax(1)))


def _row_setting(name: str, x: torch.Tensor, B: int, device: torch.device) -> torch.Tensor:
    """A per-row setting [B] of a merged batch as a float32 [B, 1] column (see noise.SearchNoise)."""
    if tuple(x.shape) != (B,) or x.device.type != device.type:
        raise ValueError(f"{name} must be a [{B}] tensor on {device}, got {tuple(x.shape)} on {x.device}")
    return x.float().view(B, 1)


def _most_visited(visits: torch.Tensor, qvalues: torch.Tensor) -> torch.Tensor:
    """[B] the greedy action: the most visited, ties to the higher Q, then to the lower index. At an evaluation's
    few simulations the top visit counts tie often (docs/benchmarks.md, twenty-fifth session), and the lowest
    index, NOOP in Atari, says nothing of what the search found."""
    top = visits == visits.amax(-1, keepdim=True)
    return torch.where(top, qvalues.float(), -torch.inf).argmax(-1)


def _outputs(
    tree: Tree, ctx: _Context, noise: SearchNoise | None, generator: torch.Generator | None
) -> SearchOutput:
    """Played action, policy target, root visits / value / Q of every tree."""
    config = ctx.config
    e = tree.edges[:, ROOT]
    visits = e[:, VISITS]
    qvalues = tree.qvalues(ROOT)
    root_value = tree.value_sums[:, ROOT] / tree.node_visits[:, ROOT]
    if ctx.gumbel:
        assert ctx.root_log_prior is not None and ctx.root_gumbel is not None
        kw = {"maxvisit_init": config.maxvisit_init, "value_scale": config.value_scale}
        raw = tree.raw_values[:, ROOT]
        score = gumbel_root_scores(
            e, raw, ctx.root_log_prior, ctx.root_gumbel, visits.amax(-1), ctx.invalid, **kw
        )
        action = score.argmax(-1)
        sigma_q = completed_qvalues(
            raw, e[:, PRIOR], visits, e[:, REWARD] + e[:, DISCOUNT] * e[:, VALUE], **kw
        )
        weights = torch.softmax(ctx.root_log_prior + sigma_q, dim=-1)
    else:
        weights = visits / visits.sum(-1, keepdim=True)
        if config.temperature == 0:
            action = _most_visited(visits, qvalues)
        else:
            g = noise.action if noise is not None and noise.action is not None else None
            if g is None:
                g = sample_gumbel((ctx.B, ctx.A), generator=generator, device=ctx.device)
            _check_noise("noise.action", g, ctx.B, ctx.A, ctx.device)
            if noise is not None and noise.temperature is not None:
                t = _row_setting("noise.temperature", noise.temperature, ctx.B, ctx.device)
                sampled = (torch.log(visits) / t.clamp_min(torch.finfo(torch.float32).tiny) + g.float()).argmax(-1)
                action = torch.where(t[:, 0] > 0, sampled, _most_visited(visits, qvalues))
            else:
                action = (torch.log(visits) / config.temperature + g.float()).argmax(-1)
    return SearchOutput(
        action=action,
        action_weights=weights,
        visit_counts=visits.to(torch.int64),
        root_value=root_value,
        qvalues=qvalues,
        tree=tree,
    )
