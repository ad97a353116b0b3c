"""CPU tests of the batched tree search (rayzero.tree): known answers, a scalar reference search, masks,
the Gumbel schedule, noise, virtual loss and input checks. The search tests run on both CPU backends (the
torch path and the compiled tree, tree/cpu.py) through the `cpu_backend` fixture."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rayzero.tree import (
    NO_PARENT,
    NumpyRecurrentFn,
    ROOT,
    UNVISITED,
    RecurrentOutput,
    RootOutput,
    SearchConfig,
    SearchNoise,
    sample_noise,
    cpu,
    search,
    tree_nbytes,
)
from rayzero.tree.noise import sample_dirichlet, sample_log_gamma
from rayzero.tree.seq_halving import considered_visits

NO_NOISE = {"dirichlet_fraction": 0.0, "temperature": 0.0}


@pytest.fixture(params=["torch", "numba"])
def cpu_backend(request, monkeypatch):
    """Run the test on one CPU backend: search.cpu_backend='auto' (every config here) follows
    RAYZERO_TREE_NUMBA, and the compiled tree's entry point is spied on to prove which one ran."""
    if request.param == "numba" and not cpu.numba_importable():
        pytest.skip("numba does not import")
    monkeypatch.setenv("RAYZERO_TREE_NUMBA", "1" if request.param == "numba" else "0")
    calls = []
    real = cpu.run_search
    monkeypatch.setattr(cpu, "run_search", lambda *args: calls.append(1) or real(*args))
    yield request.param
    assert bool(calls) == (request.param == "numba")


# ------------------------------------------------------------------------------------------ models


def bandit_fn(rewards: list[float], num_actions: int):
    """One-step bandit: reward rewards[action], discount 0, uniform priors, value 0."""
    r = torch.tensor(rewards)

    def fn(action: torch.Tensor, emb: torch.Tensor):
        n = action.shape[0]
        out = RecurrentOutput(
            reward=r[action],
            discount=torch.zeros(n),
            prior_logits=torch.zeros(n, num_actions),
            value=torch.zeros(n),
        )
        return out, emb

    return fn


_MULT = 6364136223846793005
_INC = 1442695040888963407


def _mix(h: torch.Tensor) -> torch.Tensor:
    """Integer hash step (int64 arithmetic wraps): bitwise identical for any batch size."""
    h = h * _MULT + _INC
    return h ^ (h >> 29)


def _unit(h: torch.Tensor, shift: int) -> torch.Tensor:
    """Float in [0, 1) from 12 bits of h (exactly representable)."""
    return ((h >> shift) & 0xFFF).to(torch.float32) / 4096.0


def hash_model(num_actions: int, discount: float = 0.9, device: str = "cpu"):
    """A deterministic random environment model: embedding = int64 state [B, 1]; rewards, values and
    logits are functions of the state only (no float reductions, so per-row results never depend on B,
    and CPU and CUDA compute the same bits)."""
    salts = torch.arange(1, num_actions + 1, dtype=torch.int64, device=device) * 0x1E3779B97F4A7C15

    def fn(action: torch.Tensor, emb: torch.Tensor):
        h = _mix(emb[:, 0] * 31 + action + 7)
        n = action.shape[0]
        lh = _mix(h.unsqueeze(-1) ^ salts)
        out = RecurrentOutput(
            reward=_unit(h, 3) * 2 - 1,
            discount=torch.full((n,), discount, device=device),
            prior_logits=_unit(lh, 7) * 4 - 2,
            value=_unit(h, 17) * 2 - 1,
        )
        return out, h.unsqueeze(-1)

    return fn


def hash_root(batch: int, num_actions: int, seed: int = 0, device: str = "cpu") -> RootOutput:
    state = _mix(torch.arange(batch, dtype=torch.int64, device=device) + 1000 * seed)
    fn = hash_model(num_actions, device=device)
    out, _ = fn(torch.zeros(batch, dtype=torch.int64, device=device), state.unsqueeze(-1))
    return RootOutput(prior_logits=out.prior_logits, value=out.value, embedding=state.unsqueeze(-1))


# --------------------------------------------------------------------------- scalar reference search


class _Node:
    def __init__(
        self, prior: list[float], emb: torch.Tensor, raw: float, reward: float = 0.0, discount: float = 0.0
    ):
        self.prior, self.emb, self.raw, self.reward, self.discount = prior, emb, raw, reward, discount
        self.children: dict[int, _Node] = {}
        self.visits, self.value_sum = 0, 0.0

    def value(self) -> float:
        return self.value_sum / self.visits

    def q(self) -> float:
        return self.reward + self.discount * self.value()


def _softmax(x: list[float]) -> list[float]:
    m = max(x)
    e = [math.exp(v - m) if v != -math.inf else 0.0 for v in x]
    s = sum(e)
    return [v / s for v in e]


def _completed(node: _Node, A: int, cfg: SearchConfig) -> list[float]:
    visits = [node.children[a].visits if a in node.children else 0 for a in range(A)]
    q = [node.children[a].q() if a in node.children else 0.0 for a in range(A)]
    total = sum(visits)
    p = [max(v, 1.1754943508222875e-38) for v in node.prior]
    sp = sum(p[a] for a in range(A) if visits[a] > 0)
    wq = sum(p[a] * q[a] for a in range(A) if visits[a] > 0) / sp if sp > 0 else 0.0
    mixed = (node.raw + total * wq) / (total + 1)
    c = [q[a] if visits[a] > 0 else mixed for a in range(A)]
    lo, hi = min(c), max(c)
    c = [(v - lo) / max(hi - lo, 1e-8) for v in c]
    return [(cfg.maxvisit_init + max(visits)) * cfg.value_scale * v for v in c]


def reference_search(
    root: RootOutput, fn, n: int, cfg: SearchConfig, invalid: list[bool] | None = None, gumbel=None
):
    """Scalar float64 MuZero / Gumbel MuZero on the first root of `root` (B = 1): (visits, root value, weights)."""
    A = root.prior_logits.shape[1]
    invalid = invalid or [False] * A
    logits = [(-math.inf if invalid[a] else float(root.prior_logits[0, a])) for a in range(A)]
    top = _Node(_softmax(logits), root.embedding[:1], float(root.value[0]))
    top.visits, top.value_sum = 1, top.raw
    lo_hi = [math.inf, -math.inf]
    log_prior = [math.log(p) if p > 0 else -math.inf for p in top.prior]
    g = gumbel or [0.0] * A
    m = min(cfg.max_num_considered_actions, A - sum(invalid))
    schedule = considered_visits(m, n)

    def gumbel_root_score(considered: int) -> list[float]:
        sig = _completed(top, A, cfg)
        out = []
        for a in range(A):
            v = top.children[a].visits if a in top.children else 0
            ok = not invalid[a] and v == considered
            out.append(max(-1e9, g[a] + log_prior[a] + sig[a]) if ok else -math.inf)
        return out

    def select(node: _Node, at_root: bool, sim: int) -> int:
        if cfg.policy == "gumbel":
            if at_root:
                scores = gumbel_root_score(schedule[sim])
            else:
                sig = _completed(node, A, cfg)
                pi = _softmax([(math.log(p) if p > 0 else -math.inf) + s for p, s in zip(node.prior, sig)])
                visits = [node.children[a].visits if a in node.children else 0 for a in range(A)]
                scores = [pi[a] - visits[a] / (1 + sum(visits)) for a in range(A)]
        else:
            N = node.visits
            coef = math.sqrt(N) * (cfg.pb_c_init + math.log((N + cfg.pb_c_base + 1) / cfg.pb_c_base))
            scores = []
            spread = lo_hi[1] - lo_hi[0]
            # Unvisited children: the parent's normalised value, clipped to [0, 1].
            first_play = min(max((node.value() - lo_hi[0]) / spread, 0.0), 1.0) if spread > 0 else 0.0
            for a in range(A):
                child = node.children.get(a)
                qn = first_play
                if child is not None:
                    qn = (child.q() - lo_hi[0]) / spread if spread > 0 else 0.0
                visits = child.visits if child is not None else 0
                s = qn + node.prior[a] * coef / (1 + visits)
                scores.append(-math.inf if at_root and invalid[a] else s)
        return max(range(A), key=lambda a: (scores[a], -a))

    for sim in range(n):
        node, path = top, [top]
        while True:
            a = select(node, node is top, sim)
            if a not in node.children:
                break
            node = node.children[a]
            path.append(node)
        out, emb = fn(torch.tensor([a]), node.emb)
        child = _Node(
            _softmax(out.prior_logits[0].tolist()),
            emb,
            float(out.value[0]),
            float(out.reward[0]),
            float(out.discount[0]),
        )
        node.children[a] = child
        path.append(child)
        ret = child.raw
        child.visits, child.value_sum = 1, ret
        for parent, ch in zip(reversed(path[:-1]), reversed(path[1:])):
            lo_hi[0], lo_hi[1] = min(lo_hi[0], ch.q()), max(lo_hi[1], ch.q())
            ret = ch.reward + ch.discount * ret
            parent.visits += 1
            parent.value_sum += ret
    visits = [top.children[a].visits if a in top.children else 0 for a in range(A)]
    if cfg.policy == "gumbel":
        weights = _softmax([lp + s for lp, s in zip(log_prior, _completed(top, A, cfg))])
        scores = gumbel_root_score(max(visits))
        action = max(range(A), key=lambda a: (scores[a], -a))
    else:
        weights = [v / n for v in visits]
        action = max(range(A), key=lambda a: (visits[a], -a))
    return visits, top.value(), weights, action


# ------------------------------------------------------------------------------------------ tests


def test_bandit_exact_visits_by_hand(cpu_backend):
    """Uniform priors, rewards [0.1, 0.9, 0.5], discount 0 (PUCT worked by hand, c1 = 1.25; an unvisited
    child scores the root's normalised value): sim 1 ties -> a0; sim 2: a1 (a0's prior term is halved; no
    spread yet so every Q_norm is 0); sim 3: a1, 1 + coef(3)/3 / 2 = 1.361 > a2's (0.333 - 0.1) / 0.8 +
    coef(3)/3 = 1.013; sim 4: a2, (0.475 - 0.1) / 0.8 + coef(4)/3 = 1.302 > a1's 1 + coef(4)/3 / 3 = 1.278;
    sims 5-8: a1 (Q_norm 1 against a2's 0.5 and a0's 0)."""
    fn = bandit_fn([0.1, 0.9, 0.5], 3)
    root = RootOutput(torch.zeros(1, 3), torch.zeros(1), torch.zeros(1, 1))
    expected = {1: [1, 0, 0], 2: [1, 1, 0], 3: [1, 2, 0], 4: [1, 2, 1], 8: [1, 6, 1]}
    for n, visits in expected.items():
        out = search(root, fn, n, SearchConfig(**NO_NOISE))
        assert out.visit_counts[0].tolist() == visits, n
    out = search(root, fn, 8, SearchConfig(**NO_NOISE))
    # root value = (0 + 0.1 + 6 * 0.9 + 0.5) / 9
    assert out.root_value[0].item() == pytest.approx(6.0 / 9.0, abs=1e-6)
    assert out.qvalues[0].tolist() == pytest.approx([0.1, 0.9, 0.5])
    assert out.action.tolist() == [1]
    assert out.action_weights[0].tolist() == pytest.approx([1 / 8, 6 / 8, 1 / 8])


def test_min_q_range_floor_stops_stretching_tiny_q_gaps(cpu_backend):
    """MuZero's min-max normalisation is scale-free: the bandit of test_bandit_exact_visits_by_hand with its
    rewards scaled by 1e-3 gets the same visits. With search.min_q_range = 0.01 (EfficientZero's floor) those
    0.0008-wide gaps span only 8 % of [0, 1], so the uniform prior's exploration spreads the visits; a floor below
    the tree's range changes nothing."""
    root = RootOutput(torch.zeros(1, 3), torch.zeros(1), torch.zeros(1, 1))
    n = 30
    wide = search(root, bandit_fn([0.1, 0.9, 0.5], 3), n, SearchConfig(**NO_NOISE)).visit_counts[0].tolist()
    tiny = bandit_fn([0.0001, 0.0009, 0.0005], 3)
    assert search(root, tiny, n, SearchConfig(**NO_NOISE)).visit_counts[0].tolist() == wide
    assert search(root, tiny, n, SearchConfig(min_q_range=1e-4, **NO_NOISE)).visit_counts[0].tolist() == wide
    floored = search(root, tiny, n, SearchConfig(min_q_range=0.01, **NO_NOISE)).visit_counts[0].tolist()
    assert sum(floored) == n and floored[1] < wide[1] - 5 and min(floored) >= 5, (wide, floored)
    with pytest.raises(ValueError, match="search.min_q_range=-0.1 is invalid: must be >= 0"):
        SearchConfig(min_q_range=-0.1)


@pytest.mark.parametrize("policy", ["muzero", "gumbel"])
def test_bandit_best_arm_most_visits(policy, cpu_backend):
    fn = bandit_fn([0.2, 0.1, 0.8, 0.5, 0.3], 5)
    root = RootOutput(torch.zeros(3, 5), torch.zeros(3), torch.zeros(3, 4))
    out = search(root, fn, 60, SearchConfig(policy=policy, gumbel_scale=0.0, **NO_NOISE))
    assert out.visit_counts.sum(-1).tolist() == [60, 60, 60]
    assert out.visit_counts.argmax(-1).tolist() == [2, 2, 2]
    assert out.action.tolist() == [2, 2, 2]
    tree = out.tree
    assert tree.node_visits[:, ROOT].tolist() == [61, 61, 61]
    # root value = mean of (root value 0, every simulation's return)
    expected = (out.visit_counts.float() * torch.tensor([0.2, 0.1, 0.8, 0.5, 0.3])).sum(-1) / 61
    torch.testing.assert_close(out.root_value, expected)


def test_two_step_model_needs_depth(cpu_backend):
    """Action 0 pays 1.0 one step later; action 1 pays 0.6 at once, then nothing; the value net says 0."""

    def fn(action, emb):
        state = emb[:, 0]  # 0 root, 1 after a0, 2 after a1, 3 done
        n = action.shape[0]
        reward = torch.where(
            state == 0, torch.where(action == 1, 0.6, 0.0), torch.where(state == 1, 1.0, 0.0)
        )
        nxt = torch.where(state == 0, 1 + action, torch.full_like(state, 3))
        logits = torch.zeros(n, 2)
        return RecurrentOutput(reward, torch.full((n,), 0.9), logits, torch.zeros(n)), nxt.unsqueeze(-1)

    root = RootOutput(torch.zeros(1, 2), torch.zeros(1), torch.zeros(1, 1, dtype=torch.int64))
    for policy in ("muzero", "gumbel"):
        out = search(root, fn, 40, SearchConfig(policy=policy, gumbel_scale=0.0, **NO_NOISE))
        assert out.action.item() == 0, policy
        assert out.qvalues[0, 0].item() == pytest.approx(0.9, abs=0.05), policy
        assert out.qvalues[0, 1].item() == pytest.approx(0.6, abs=1e-6), policy
        if policy == "muzero":
            assert out.visit_counts[0, 0] > out.visit_counts[0, 1]
        else:
            assert out.action_weights[0, 0] > out.action_weights[0, 1]


@pytest.mark.parametrize("policy", ["muzero", "gumbel"])
def test_matches_scalar_reference(policy, cpu_backend):
    A, n = 4, 30
    fn = hash_model(A)
    cfg = SearchConfig(policy=policy, max_num_considered_actions=4, **NO_NOISE)
    root = hash_root(6, A, seed=3)
    g = sample_noise(cfg, 6, A, generator=torch.Generator().manual_seed(0))
    out = search(root, fn, n, cfg, noise=g)
    for b in range(6):
        one = RootOutput(root.prior_logits[b : b + 1], root.value[b : b + 1], root.embedding[b : b + 1])
        gumbel = g.root[b].tolist() if g.root is not None else None
        visits, value, weights, action = reference_search(one, fn, n, cfg, gumbel=gumbel)
        assert out.visit_counts[b].tolist() == visits, b
        assert out.root_value[b].item() == pytest.approx(value, abs=1e-5)
        assert out.action_weights[b].tolist() == pytest.approx(weights, abs=1e-5)
        assert out.action[b].item() == action


def test_tree_structure_invariants(cpu_backend):
    A, n = 5, 40
    out = search(hash_root(8, A), hash_model(A), n, SearchConfig(**NO_NOISE))
    t = out.tree
    B, N = t.batch_size, t.num_nodes
    assert N == n + 1 and t.parents[:, ROOT].eq(NO_PARENT).all()
    # every non-root node hangs off its parent's edge, created after its parent
    for i in range(1, N):
        p, a = t.parents[:, i], t.action_from_parent[:, i]
        assert (p < i).all() and (p >= 0).all()
        assert t.children_index[torch.arange(B), p, a].eq(i).all()
    # visits: a node's own visit plus its children's; edge stats mirror child nodes
    torch.testing.assert_close(t.node_visits, 1 + t.children_visits.sum(-1))
    visited = t.children_index != UNVISITED
    child = t.children_index.clamp_min(0)
    torch.testing.assert_close(
        t.children_visits[visited], t.node_visits.gather(1, child.flatten(1)).view_as(child)[visited]
    )
    torch.testing.assert_close(
        t.children_values[visited], t.node_values.gather(1, child.flatten(1)).view_as(child)[visited]
    )
    torch.testing.assert_close(t.priors.sum(-1), torch.ones(B, N))
    # embeddings written in place: node i holds the model's state after its action
    assert out.tree.embeddings.shape == (8, N, 1)


@pytest.mark.parametrize("policy", ["muzero", "gumbel"])
def test_invalid_actions_per_row_and_row_independence(policy, cpu_backend):
    A, B, n = 6, 5, 25
    invalid = torch.zeros(B, A, dtype=torch.bool)
    invalid[0, [0, 1]] = True
    invalid[1, 5] = True
    invalid[2, [1, 2, 3, 4, 5]] = True  # one legal action
    invalid[4, ::2] = True
    cfg = SearchConfig(policy=policy, temperature=1.0, max_num_considered_actions=4)
    root = hash_root(B, A, seed=1)
    noise = sample_noise(cfg, B, A, generator=torch.Generator().manual_seed(5))
    out = search(root, hash_model(A), n, cfg, invalid, noise=noise)
    assert out.visit_counts[invalid].eq(0).all()
    assert out.action_weights[invalid].eq(0).all()
    assert not invalid[torch.arange(B), out.action].any()
    assert out.visit_counts[2].tolist() == [n, 0, 0, 0, 0, 0]
    assert out.visit_counts.sum(-1).eq(n).all()
    torch.testing.assert_close(out.action_weights.sum(-1), torch.ones(B))
    for b in range(B):
        one = RootOutput(root.prior_logits[b : b + 1], root.value[b : b + 1], root.embedding[b : b + 1])
        noise_b = SearchNoise(*(x[b : b + 1] if x is not None else None for x in noise))
        alone = search(one, hash_model(A), n, cfg, invalid[b : b + 1], noise=noise_b)
        assert alone.visit_counts[0].tolist() == out.visit_counts[b].tolist()
        assert alone.action.item() == out.action[b].item()
        torch.testing.assert_close(alone.root_value[0], out.root_value[b])
        torch.testing.assert_close(alone.action_weights[0], out.action_weights[b])


def test_gumbel_sequential_halving_schedule(cpu_backend):
    """m = 16 considered of 16 actions, n = 50: phases of 16 x 1, 8 x 1, 4 x 3, 2 x 6 visits, then one more
    round for the last 2: ranked visits 12, 12, 5, 5, 2, 2, 2, 2, 1 x 8 (worked by hand from the algorithm)."""
    assert considered_visits(16, 50) == tuple(
        [0] * 16 + [1] * 8 + [2] * 4 + [3] * 4 + [4] * 4 + [5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10] + [11, 11]
    )
    assert considered_visits(1, 5) == (0, 1, 2, 3, 4)
    assert considered_visits(2, 6) == (0, 0, 1, 1, 2, 2)
    A = 16
    logits = -torch.arange(A, dtype=torch.float32).unsqueeze(0) / 4  # ranked by index
    perm = torch.tensor([3, 7, 0, 15, 1, 9, 2, 11, 4, 13, 5, 6, 8, 10, 12, 14])  # scramble the ranking
    logits = torch.cat([logits, logits[:, perm]])

    def fn(action, emb):  # every Q is 0, so the ranking is the prior's alone
        n = action.shape[0]
        return RecurrentOutput(torch.zeros(n), torch.ones(n), torch.zeros(n, A), torch.zeros(n)), emb

    cfg = SearchConfig(policy="gumbel", gumbel_scale=0.0, max_num_considered_actions=16)
    out = search(RootOutput(logits, torch.zeros(2), torch.zeros(2, 1)), fn, 50, cfg)
    expected = torch.tensor([12, 12, 5, 5, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1])
    assert out.visit_counts[0].tolist() == expected.tolist()
    # row 1: action j has rank perm[j]
    assert out.visit_counts[1].tolist() == expected[perm].tolist()
    assert out.action.tolist() == [0, perm.tolist().index(0)]
    # 8 considered of 16, 20 simulations, 3 phases: 8 x 1 (20 // 24 -> 1), 4 x 1 (20 // 12), 2 x 3 (20 // 6),
    # then the last 2 again until the budget ends (one round) -> 6, 6, 2, 2, 1 x 4
    cfg8 = SearchConfig(policy="gumbel", gumbel_scale=0.0, max_num_considered_actions=8)
    out = search(RootOutput(logits[:1], torch.zeros(1), torch.zeros(1, 1)), fn, 20, cfg8)
    assert out.visit_counts[0].tolist() == [6, 6, 2, 2, 1, 1, 1, 1] + [0] * 8


def test_gumbel_improved_policy_and_determinism(cpu_backend):
    A, B, n = 7, 6, 20
    invalid = torch.zeros(B, A, dtype=torch.bool)
    invalid[:, 3] = True
    invalid[1, :5] = True
    root = hash_root(B, A, seed=2)
    cfg = SearchConfig(policy="gumbel", gumbel_scale=0.0, max_num_considered_actions=4)
    a = search(root, hash_model(A), n, cfg, invalid, torch.Generator().manual_seed(1))
    b = search(root, hash_model(A), n, cfg, invalid, torch.Generator().manual_seed(2))
    torch.testing.assert_close(a.action_weights.sum(-1), torch.ones(B))
    assert a.action_weights[invalid].eq(0).all()
    assert (a.action_weights >= 0).all()
    assert torch.equal(a.visit_counts, b.visit_counts) and torch.equal(a.action, b.action)
    torch.testing.assert_close(a.action_weights, b.action_weights, rtol=0, atol=0)
    # with Gumbel noise, the seed matters and is reproducible
    cfg1 = SearchConfig(policy="gumbel", gumbel_scale=1.0, max_num_considered_actions=4)
    c1 = search(root, hash_model(A), n, cfg1, invalid, torch.Generator().manual_seed(7))
    c2 = search(root, hash_model(A), n, cfg1, invalid, torch.Generator().manual_seed(7))
    assert torch.equal(c1.visit_counts, c2.visit_counts) and torch.equal(c1.action, c2.action)
    assert c1.visit_counts[invalid].eq(0).all()
    # the improved policy does not depend on the Gumbel noise
    assert not invalid[torch.arange(B), c1.action].any()


def test_temperature_zero_argmax_and_seeded_sampling(cpu_backend):
    A, B, n = 5, 4, 30
    root = hash_root(B, A, seed=4)
    cfg0 = SearchConfig(temperature=0.0, dirichlet_fraction=0.25)
    out = search(root, hash_model(A), n, cfg0, generator=torch.Generator().manual_seed(3))
    v = out.visit_counts
    first_max = (v == v.amax(-1, keepdim=True)).int().argmax(-1)
    assert out.action.tolist() == first_max.tolist()
    cfg = SearchConfig(temperature=1.0, dirichlet_fraction=0.25)
    runs = [
        search(root, hash_model(A), n, cfg, generator=torch.Generator().manual_seed(s)) for s in (11, 11, 12)
    ]
    assert torch.equal(runs[0].visit_counts, runs[1].visit_counts) and torch.equal(
        runs[0].action, runs[1].action
    )
    assert not torch.equal(runs[0].tree.priors[:, ROOT], runs[2].tree.priors[:, ROOT])
    # ties in visit counts go to the higher Q, and where the Q tie too, to the lowest action
    fn = bandit_fn([0.5, 0.5, 0.5, 0.5], 4)
    out = search(
        RootOutput(torch.zeros(1, 4), torch.zeros(1), torch.zeros(1, 1)), fn, 8, SearchConfig(**NO_NOISE)
    )
    assert out.visit_counts[0].tolist() == [2, 2, 2, 2] and out.action.item() == 0
    # Losing arms: each unvisited child looks as good as the parent's mean, so 4 simulations visit each once.
    fn = bandit_fn([-0.2, -0.3, -0.1, -0.4], 4)
    out = search(RootOutput(torch.zeros(1, 4), torch.zeros(1), torch.zeros(1, 1)), fn, 4, SearchConfig(**NO_NOISE))
    assert out.visit_counts[0].tolist() == [1, 1, 1, 1] and out.action.item() == 2


def test_temperature_sampling_follows_visits(cpu_backend):
    """Many identical rows with independent action noise: frequencies ~ visits^(1/T) / sum."""
    B, A = 4000, 3
    fn = bandit_fn([0.1, 0.9, 0.5], A)
    root = RootOutput(torch.zeros(B, A), torch.zeros(B), torch.zeros(B, 1))
    for temp in (1.0, 0.5):
        out = search(
            root,
            fn,
            8,
            SearchConfig(dirichlet_fraction=0.0, temperature=temp),
            generator=torch.Generator().manual_seed(0),
        )
        assert out.visit_counts[0].tolist() == [1, 6, 1]
        w = torch.tensor([1.0, 6.0, 1.0]) ** (1 / temp)
        freq = torch.bincount(out.action, minlength=A).float() / B
        torch.testing.assert_close(freq, w / w.sum(), atol=0.03, rtol=0)


def test_dirichlet_and_gamma_samplers():
    g = torch.Generator().manual_seed(0)
    for alpha in (0.3, 1.0, 2.5):
        x = sample_log_gamma(alpha, (40000,), generator=g).exp()
        assert x.mean().item() == pytest.approx(alpha, rel=0.03)
        assert x.var().item() == pytest.approx(alpha, rel=0.08)
    invalid = torch.zeros(20000, 4, dtype=torch.bool)
    invalid[:, 3] = True
    d = sample_dirichlet(0.5, (20000, 4), invalid=invalid, generator=g)
    torch.testing.assert_close(d.sum(-1), torch.ones(20000))
    assert d[:, 3].eq(0).all()
    # Dirichlet(0.5, 0.5, 0.5): mean 1/3, variance a_i (a0 - a_i) / (a0^2 (a0 + 1)) = 0.5 * 1 / (2.25 * 2.5)
    assert d[:, :3].mean(0).tolist() == pytest.approx([1 / 3] * 3, abs=0.01)
    assert d[:, :3].var(0).tolist() == pytest.approx([0.5 / 5.625] * 3, rel=0.05)
    a = sample_log_gamma(0.3, (5,), generator=torch.Generator().manual_seed(9))
    b = sample_log_gamma(0.3, (5,), generator=torch.Generator().manual_seed(9))
    assert torch.equal(a, b)


def test_root_noise_changes_priors_only_on_valid_actions(cpu_backend):
    A, B = 5, 3
    invalid = torch.tensor([[True, False, False, False, False]] * B)
    cfg = SearchConfig(dirichlet_fraction=0.5, dirichlet_alpha=0.3, temperature=0.0)
    out = search(hash_root(B, A), hash_model(A), 4, cfg, invalid, torch.Generator().manual_seed(0))
    p = out.tree.priors[:, ROOT]
    assert p[:, 0].eq(0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(B))
    clean = torch.softmax(hash_root(B, A).prior_logits.masked_fill(invalid, -math.inf), -1)
    assert not torch.allclose(p, clean)


@pytest.mark.parametrize("K,n", [(4, 32), (4, 30), (3, 7)])
def test_virtual_loss(K, n, cpu_backend):
    fn = bandit_fn([0.2, 0.1, 0.8, 0.5, 0.3], 5)
    B = 3
    calls = []

    def counting(action, emb):
        calls.append(action.shape[0])
        return fn(action, emb)

    root = RootOutput(torch.zeros(B, 5), torch.zeros(B), torch.zeros(B, 2))
    out = search(root, counting, n, SearchConfig(virtual_loss=K, **NO_NOISE))
    assert out.visit_counts.sum(-1).tolist() == [n] * B
    assert out.tree.node_visits[:, ROOT].tolist() == [n + 1] * B
    assert len(calls) == -(-n // K) and calls[0] == B * K
    if n >= 30:
        assert out.action.tolist() == [2] * B
    # deeper model: the tree stays consistent. A walk that ends on an edge claimed earlier in its wave
    # backs up through that node (one more visit than its children account for) and leaves its own
    # slot unused (0 visits, no parent).
    A = 3
    out = search(hash_root(4, A), hash_model(A), 24, SearchConfig(virtual_loss=K, **NO_NOISE))
    t = out.tree
    assert out.visit_counts.sum(-1).tolist() == [24] * 4
    used = t.node_visits > 0
    extra = t.node_visits - 1 - t.children_visits.sum(-1)
    assert extra[used].ge(0).all() and extra[:, ROOT].eq(0).all()
    assert t.parents[~used].eq(NO_PARENT).all() and t.parents[:, 1:][used[:, 1:]].ge(0).all()
    assert (extra * used).sum(-1).tolist() == (~used).sum(-1).tolist()  # one extra visit per unused slot
    assert used.sum(-1).ge(12).all()  # the K walks of a wave mostly differ


@pytest.mark.parametrize("B, max_trees, same_as_K", [(3, 2, 1), (2, 2, 4), (3, 0, 4)])
def test_virtual_loss_only_in_searches_of_at_most_max_trees(B, max_trees, same_as_K, cpu_backend):
    """search.virtual_loss_max_trees: a search of more trees than that walks one path per wave (the same visits
    and network calls as K = 1); one of at most that many, or any with 0, takes K walks per wave."""
    A, n = 4, 13
    sizes = []

    def counting(action, emb):
        sizes.append(action.shape[0])
        return hash_model(A)(action, emb)

    out = search(hash_root(B, A), counting, n, SearchConfig(virtual_loss=4, virtual_loss_max_trees=max_trees,
                                                            **NO_NOISE))
    expected = search(hash_root(B, A), hash_model(A), n, SearchConfig(virtual_loss=same_as_K, **NO_NOISE))
    other = search(hash_root(B, A), hash_model(A), n, SearchConfig(virtual_loss=5 - same_as_K, **NO_NOISE))
    assert torch.equal(out.visit_counts, expected.visit_counts)
    assert not torch.equal(out.visit_counts, other.visit_counts)  # K tells here, so the match above means something
    assert len(sizes) == -(-n // same_as_K) and sizes[0] == B * same_as_K


def test_virtual_loss_max_trees_rejects_negative():
    with pytest.raises(ValueError, match=r"search.virtual_loss_max_trees=-1 is invalid: must be >= 0"):
        SearchConfig(virtual_loss=8, virtual_loss_max_trees=-1)


def test_virtual_loss_gumbel_rejected():
    with pytest.raises(ValueError, match="virtual_loss"):
        search(hash_root(2, 3), hash_model(3), 8, SearchConfig(policy="gumbel", virtual_loss=2))


def test_pytree_embedding_and_dtypes(cpu_backend):
    A = 3

    def fn(action, emb):
        h, c = emb
        n = action.shape[0]
        out = RecurrentOutput(
            torch.ones(n, dtype=torch.float64),
            torch.zeros(n),
            torch.zeros(n, A, dtype=torch.bfloat16),
            torch.zeros(n),
        )
        return out, (h + 1, c * 2)

    root = RootOutput(torch.zeros(2, A), torch.zeros(2), (torch.zeros(2, 4), torch.ones(2, 2, 2)))
    out = search(root, fn, 5, SearchConfig(**NO_NOISE))
    h, c = out.tree.embeddings
    assert h.shape == (2, 6, 4) and c.shape == (2, 6, 2, 2)
    assert out.tree.parents[:, 1].tolist() == [0, 0] and h[:, 1].eq(1).all() and c[:, 1].eq(2).all()
    assert tree_nbytes(out.tree) > 0 and tree_nbytes(out.tree, per_tree=False) == 2 * tree_nbytes(out.tree)


def numpy_hash_model(num_actions: int, discount: float = 0.9):
    """`hash_model` on numpy arrays (the same int64 arithmetic and 12-bit units, so the same bits)."""
    salts = np.arange(1, num_actions + 1, dtype=np.int64) * 0x1E3779B97F4A7C15

    def mix(h):
        h = h * np.int64(_MULT) + np.int64(_INC)
        return h ^ (h >> 29)

    def unit(h, shift):
        return ((h >> shift) & 0xFFF).astype(np.float32) / np.float32(4096.0)

    def fn(action: np.ndarray, emb: np.ndarray):
        assert isinstance(action, np.ndarray) and isinstance(emb, np.ndarray)
        h = mix(emb[:, 0] * 31 + action + 7)
        lh = mix(h[:, None] ^ salts)
        out = RecurrentOutput(
            reward=unit(h, 3) * 2 - 1,
            discount=np.full(action.shape[0], discount, np.float32),
            prior_logits=unit(lh, 7) * 4 - 2,
            value=unit(h, 17) * 2 - 1,
        )
        return out, h[:, None]

    return fn


@pytest.mark.parametrize("policy", ["muzero", "gumbel"])
def test_numpy_recurrent_fn_same_search(policy, cpu_backend):
    """A NumpyRecurrentFn gives the search of the same model on tensors, on either backend."""
    root, A = hash_root(6, 7, seed=2), 7
    cfg = SearchConfig(policy=policy, temperature=1.0)
    a = search(root, hash_model(A), 20, cfg, generator=torch.Generator().manual_seed(3))
    b = search(root, NumpyRecurrentFn(numpy_hash_model(A)), 20, cfg, generator=torch.Generator().manual_seed(3))
    for name in ("visit_counts", "action", "action_weights", "qvalues", "root_value"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(a.tree.edges, b.tree.edges) and torch.equal(a.tree.embeddings, b.tree.embeddings)


def test_max_nodes_and_bad_inputs(cpu_backend):
    A = 3
    fn = hash_model(A)
    root = hash_root(2, A)
    with pytest.raises(ValueError, match="max_nodes=10"):
        search(root, fn, 10, SearchConfig(max_nodes=10))
    search(root, fn, 9, SearchConfig(max_nodes=10))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="num_simulations"):
            search(root, fn, bad)
    with pytest.raises(ValueError, match="root.value"):
        search(RootOutput(root.prior_logits, torch.zeros(3), root.embedding), fn, 4)
    with pytest.raises(ValueError, match="prior_logits"):
        search(RootOutput(torch.zeros(2), root.value, root.embedding), fn, 4)
    with pytest.raises(ValueError, match="embedding"):
        search(RootOutput(root.prior_logits, root.value, torch.zeros(3, 1)), fn, 4)
    with pytest.raises(ValueError, match="invalid_actions has shape"):
        search(root, fn, 4, invalid_actions=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool"):
        search(root, fn, 4, invalid_actions=torch.zeros(2, A))
    with pytest.raises(ValueError, match=r"row\(s\) \[1\]"):
        search(root, fn, 4, invalid_actions=torch.tensor([[False, True, True], [True, True, True]]))
    with pytest.raises(ValueError, match="search.pb_c_init"):
        SearchConfig(pb_c_init=0)

    def bad_fn(action, emb):
        out, e = fn(action, emb)
        return out._replace(value=out.value[:1]), e

    with pytest.raises(ValueError, match="value of shape"):
        search(root, bad_fn, 4)

    def bad_logits(action, emb):
        out, e = fn(action, emb)
        return out._replace(prior_logits=out.prior_logits[:, :2]), e

    with pytest.raises(ValueError, match="prior_logits of shape"):
        search(root, bad_logits, 4)
    with pytest.raises(ValueError, match="noise.root"):
        search(root, fn, 4, noise=SearchNoise(root=torch.zeros(3, A)))


@pytest.mark.parametrize("policy", ["muzero", "gumbel"])
def test_per_row_settings_give_each_row_the_search_of_its_own_config(policy):
    """A merged batch (the inference actor's `merge_searches`): rows with a noise fraction and a temperature of
    their own get exactly the search that a config with those settings gives them alone."""
    import dataclasses

    A, B, n = 6, 4, 25
    base = SearchConfig(policy=policy, temperature=1.0, dirichlet_fraction=0.25, gumbel_scale=1.0,
                        max_num_considered_actions=4, cpu_backend="torch")
    greedy = dataclasses.replace(base, temperature=0.0, dirichlet_fraction=0.0, gumbel_scale=0.0)
    root = hash_root(B, A, seed=2)
    noise = sample_noise(base, B, A, generator=torch.Generator().manual_seed(3))
    row_noise = noise._replace(root_fraction=torch.tensor([1.0, 1.0, 0.0, 0.0]) * (1.0 if policy == "gumbel" else 0.25),
                               temperature=torch.tensor([1.0, 1.0, 0.0, 0.0]))
    merged = search(root, hash_model(A), n, base, noise=row_noise)
    differs = False
    for b, cfg in ((0, base), (1, base), (2, greedy), (3, greedy)):
        one = RootOutput(root.prior_logits[b : b + 1], root.value[b : b + 1], root.embedding[b : b + 1])
        own = SearchNoise(*(x[b : b + 1] if x is not None else None for x in noise)) if cfg is base else None
        alone = search(one, hash_model(A), n, cfg, noise=own)
        assert alone.visit_counts[0].tolist() == merged.visit_counts[b].tolist(), b
        assert alone.action.item() == merged.action[b].item(), b
        torch.testing.assert_close(alone.action_weights[0], merged.action_weights[b], rtol=0, atol=0)
        torch.testing.assert_close(alone.root_value[0], merged.root_value[b], rtol=0, atol=0)
        if cfg is greedy:  # the noise the row was spared would have changed its search
            noisy = search(one, hash_model(A), n, base, noise=SearchNoise(*(x[b : b + 1] if x is not None else None
                                                                           for x in noise)))
            differs |= noisy.visit_counts[0].tolist() != alone.visit_counts[0].tolist()
    assert differs


def test_per_row_settings_of_the_wrong_shape_are_refused():
    A, B = 4, 3
    cfg = SearchConfig(temperature=1.0, cpu_backend="torch")
    noise = sample_noise(cfg, B, A, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"noise.root_fraction must be a \[3\] tensor"):
        search(hash_root(B, A), hash_model(A), 4, cfg, noise=noise._replace(root_fraction=torch.zeros(2)))
