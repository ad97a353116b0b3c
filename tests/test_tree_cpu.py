"""The compiled CPU tree (rayzero.tree.cpu, numba) against the torch path: whole trees equal on random
deterministic models for both policies, with masks, noise, virtual loss and odd embeddings; the backend
switch and its fallback. The known-answer search tests in test_tree.py run on both backends too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayzero.bench.tree import table_model, table_model_numpy, torch_root
from rayzero.tree import NumpyRecurrentFn, RecurrentOutput, RootOutput, SearchConfig, cpu, sample_noise, search

pytestmark = pytest.mark.skipif(not cpu.numba_importable(), reason="numba does not import")

TREE_FIELDS = (
    "node_visits",
    "value_sums",
    "raw_values",
    "rewards",
    "discounts",
    "parents",
    "action_from_parent",
    "children_index",
    "edges",
    "value_min",
    "value_max",
)

_MULT = 6364136223846793005
_INC = 1442695040888963407


def _mix(h: torch.Tensor) -> torch.Tensor:
    h = h * _MULT + _INC
    return h ^ (h >> 29)


def _unit(h: torch.Tensor, shift: int) -> torch.Tensor:
    """Float in [0, 1) from 23 bits of h: continuous-looking values, so ties are as rare as in real use."""
    return ((h >> shift) & 0x7FFFFF).to(torch.float32) / float(1 << 23)


def random_model(num_actions: int, terminal_rate: float = 0.1):
    """A deterministic random environment model on int64 states [B', 1]: every output is a function of
    (state, action) alone, computed row by row, so both backends see the same bits at any batch size."""
    salts = torch.arange(1, num_actions + 1, dtype=torch.int64) * 0x1E3779B97F4A7C15

    def fn(action: torch.Tensor, emb: torch.Tensor):
        h = _mix(emb[:, 0] * 31 + action + 7)
        lh = _mix(h.unsqueeze(-1) ^ salts)
        terminal = _unit(h, 5) < terminal_rate
        out = RecurrentOutput(
            reward=_unit(h, 3) * 2 - 1,
            discount=torch.where(terminal, 0.0, 0.97),
            prior_logits=_unit(lh, 11) * 6 - 3,
            value=_unit(h, 17) * 2 - 1,
        )
        return out, h.unsqueeze(-1)

    return fn


def random_root(batch: int, num_actions: int, seed: int) -> RootOutput:
    state = _mix(torch.arange(batch, dtype=torch.int64) + 7919 * seed + 1)
    out, _ = random_model(num_actions)(torch.zeros(batch, dtype=torch.int64), state.unsqueeze(-1))
    return RootOutput(out.prior_logits, out.value, state.unsqueeze(-1))


def random_invalid(batch: int, num_actions: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    invalid = torch.rand(batch, num_actions, generator=g) < 0.35
    keep = torch.randint(num_actions, (batch,), generator=g)
    invalid[torch.arange(batch), keep] = False  # every row keeps a legal action
    return invalid


def both(root, fn, n, invalid=None, seed=0, **cfg):
    """(torch path, compiled tree) outputs of the same search, with the same generator seed."""
    outs = []
    for backend in ("torch", "numba"):
        config = SearchConfig(cpu_backend=backend, **cfg)
        outs.append(search(root, fn, n, config, invalid, torch.Generator().manual_seed(seed)))
    return outs


def assert_same_search(a, b, exact_floats: bool = True) -> None:
    assert torch.equal(a.visit_counts, b.visit_counts)
    assert torch.equal(a.action, b.action)
    if exact_floats:
        for name in TREE_FIELDS:
            assert torch.equal(getattr(a.tree, name), getattr(b.tree, name)), name
        assert torch.equal(a.action_weights, b.action_weights)
        assert torch.equal(a.root_value, b.root_value)
        assert torch.equal(a.qvalues, b.qvalues)
    else:
        for name in ("node_visits", "parents", "action_from_parent", "children_index"):
            assert torch.equal(getattr(a.tree, name), getattr(b.tree, name)), name
        torch.testing.assert_close(a.tree.edges, b.tree.edges)
        torch.testing.assert_close(a.action_weights, b.action_weights)
        torch.testing.assert_close(a.root_value, b.root_value)
        torch.testing.assert_close(a.qvalues, b.qvalues)
    assert torch.equal(a.tree.embeddings, b.tree.embeddings)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("masked", [False, True])
def test_muzero_random_trees_bit_identical(seed, masked):
    """MuZero PUCT with Dirichlet noise and temperature sampling: the whole tree, bit for bit."""
    B, A, n = 24, 9, 48
    invalid = random_invalid(B, A, seed) if masked else None
    a, b = both(random_root(B, A, seed), random_model(A), n, invalid, seed, temperature=1.0)
    assert_same_search(a, b)


@pytest.mark.parametrize("seed", range(2))
def test_min_q_range_floor_bit_identical(seed):
    """search.min_q_range (EfficientZero's floor on the min-max range) binds in most of these trees: the compiled
    walk applies it as the torch path does, bit for bit."""
    B, A, n = 16, 6, 40
    a, b = both(random_root(B, A, seed), random_model(A), n, None, seed, temperature=1.0, min_q_range=1.5)
    assert_same_search(a, b)
    plain, _ = both(random_root(B, A, seed), random_model(A), n, None, seed, temperature=1.0)
    assert not torch.equal(plain.visit_counts, a.visit_counts)  # the floor changed some searches


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("masked", [False, True])
def test_gumbel_random_trees_match(seed, masked):
    """Gumbel MuZero with Gumbel noise: same visit counts and tree, floats within fp tolerance (its sums
    over actions and its interior softmax may round differently from torch's vectorised kernels)."""
    B, A, n = 24, 9, 48
    invalid = random_invalid(B, A, seed) if masked else None
    cfg = {"policy": "gumbel", "max_num_considered_actions": 6}
    a, b = both(random_root(B, A, seed), random_model(A), n, invalid, seed, **cfg)
    assert_same_search(a, b, exact_floats=False)


@pytest.mark.parametrize("K,n", [(2, 30), (4, 31), (8, 16)])
def test_virtual_loss_bit_identical(K, n):
    B, A = 12, 5
    a, b = both(random_root(B, A, 3), random_model(A), n, random_invalid(B, A, 3), 3, virtual_loss=K)
    assert_same_search(a, b)
    assert (a.tree.node_visits == 0).any()  # some walks of a wave met: the duplicate-leaf path ran


def test_deep_trees_and_odd_sizes():
    """One action (a chain as deep as the search), two actions, and B = 1."""
    for A, B in ((1, 3), (2, 5), (18, 1)):
        for policy in ("muzero", "gumbel"):
            a, b = both(random_root(B, A, A), random_model(A, 0.0), 40, None, 1, policy=policy)
            assert_same_search(a, b, exact_floats=policy == "muzero")


def test_precomputed_noise_and_inference_mode():
    B, A, n = 8, 6, 20
    root, fn = random_root(B, A, 5), random_model(A)
    for policy in ("muzero", "gumbel"):
        cfg = {"policy": policy, "temperature": 0.5}
        noise = sample_noise(SearchConfig(**cfg), B, A, generator=torch.Generator().manual_seed(2))
        with torch.inference_mode():
            a = search(root, fn, n, SearchConfig(cpu_backend="torch", **cfg), noise=noise)
            b = search(root, fn, n, SearchConfig(cpu_backend="numba", **cfg), noise=noise)
        assert_same_search(a, b, exact_floats=policy == "muzero")


def test_embeddings_of_any_layout():
    """Pytree and bfloat16 embeddings take the torch gather/copy; results still match."""
    A = 4
    base = random_model(A)

    def pytree_fn(action, emb):
        state, extra = emb
        out, nxt = base(action, state)
        return out, (nxt, extra.to(torch.bfloat16) + 1)

    root = random_root(3, A, 1)
    root = root._replace(embedding=(root.embedding, torch.zeros(3, 2, 2, dtype=torch.bfloat16)))
    a, b = both(root, pytree_fn, 12)
    assert torch.equal(a.visit_counts, b.visit_counts)
    for x, y in zip(a.tree.embeddings, b.tree.embeddings):
        assert torch.equal(x, y)

    def handle_fn(action, emb):  # [B'] int64 embeddings, like the inference actor's latent handles
        out, nxt = base(action, emb.unsqueeze(-1))
        return out, nxt[:, 0]

    root = random_root(5, A, 3)
    a, b = both(root._replace(embedding=root.embedding[:, 0]), handle_fn, 12, virtual_loss=3)
    assert_same_search(a, b)


def test_backend_switch_and_fallback(monkeypatch):
    calls = []
    real = cpu.run_search
    monkeypatch.setattr(cpu, "run_search", lambda *args: calls.append(1) or real(*args))
    root, fn = random_root(2, 3, 0), random_model(3)
    search(root, fn, 4, SearchConfig())
    assert calls == [1]  # auto: compiled when numba imports
    search(root, fn, 4, SearchConfig(cpu_backend="torch"))
    assert calls == [1]
    monkeypatch.setenv("RAYZERO_TREE_NUMBA", "0")
    search(root, fn, 4, SearchConfig())
    assert calls == [1]
    with pytest.raises(ValueError, match="cpu_backend='numba'"):
        search(root, fn, 4, SearchConfig(cpu_backend="numba"))
    monkeypatch.delenv("RAYZERO_TREE_NUMBA")
    monkeypatch.setattr(cpu, "_NUMBA", False)  # as where numba is not installed
    search(root, fn, 4, SearchConfig())
    assert calls == [1]
    with pytest.raises(ValueError, match="numba does not import"):
        search(root, fn, 4, SearchConfig(cpu_backend="numba"))
    with pytest.raises(ValueError, match="search.cpu_backend"):
        SearchConfig(cpu_backend="c++")


def test_bad_recurrent_output_on_a_later_wave():
    """Shapes are re-checked on every wave (the compiled code has no bounds checks)."""
    A = 3
    base = random_model(A)
    calls = [0]

    def flaky(action, emb):
        calls[0] += 1
        out, nxt = base(action, emb)
        if calls[0] == 3:
            out = out._replace(prior_logits=out.prior_logits[:, :2])
        return out, nxt

    with pytest.raises(ValueError, match="prior_logits of shape"):
        search(random_root(2, A, 0), flaky, 6, SearchConfig(cpu_backend="numba"))


@pytest.mark.parametrize("alpha", [0.3, 1.0, 2.5])
def test_compiled_noise_is_torch_noise(alpha):
    """cpu.sample_log_gamma / cpu.sample_gumbel: noise.py's draws and bits from the same generator (many
    rejected Marsaglia-Tsang proposals at this size), and the generator left in the same state."""
    from rayzero.tree import noise

    for shape in ((1, 18), (64, 64)):
        g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        expected = noise.sample_log_gamma(alpha, shape, generator=g1)
        assert torch.equal(cpu.sample_log_gamma(alpha, shape, g2), expected)
        assert torch.equal(cpu.sample_gumbel(shape, g2), noise.sample_gumbel(shape, generator=g1))
        assert torch.equal(torch.rand(4, generator=g2), torch.rand(4, generator=g1))


@pytest.mark.parametrize("policy", ["muzero", "gumbel"])
def test_searches_draw_the_same_numbers(policy):
    """Both backends consume the generator alike (root noise, then action noise): same state after."""
    B, A = 5, 7
    after = []
    for backend in ("torch", "numba"):
        g = torch.Generator().manual_seed(11)
        search(random_root(B, A, 2), random_model(A), 10, SearchConfig(policy=policy, cpu_backend=backend),
               generator=g)  # fmt: skip
        after.append(torch.rand(6, generator=g))
    assert torch.equal(after[0], after[1])


@pytest.mark.parametrize("policy", ["muzero", "gumbel"])
def test_outputs_survive_later_searches_and_threads(policy):
    """Scratch buffers are reused by searches of one shape (per thread): earlier outputs and trees stay as
    they were, and searches in two threads at once equal the same searches one after the other."""
    from concurrent.futures import ThreadPoolExecutor

    B, A, n = 6, 5, 24
    fn, cfg = random_model(A), SearchConfig(policy=policy, cpu_backend="numba")
    roots = [random_root(B, A, s) for s in range(4)]

    def run(i):
        return search(roots[i % 4], fn, n, cfg, random_invalid(B, A, i % 4), torch.Generator().manual_seed(i % 4))

    first = [run(i) for i in range(4)]
    kept = [(o.visit_counts.clone(), o.action_weights.clone(), o.tree.edges.clone()) for o in first]
    with ThreadPoolExecutor(2) as pool:
        later = list(pool.map(run, range(40)))
    for i, out in enumerate(later):
        assert_same_search(first[i % 4], out)
    for o, (visits, weights, edges) in zip(first, kept):
        assert torch.equal(o.visit_counts, visits)
        assert torch.equal(o.action_weights, weights)
        assert torch.equal(o.tree.edges, edges)


def test_recurrent_inputs_stay_as_given_and_large_embeddings():
    """recurrent_fn may keep its inputs: each wave's action and embedding tensors are its own. The
    embedding here is large enough for the one-wave-at-a-time buffers (int64 [B, 4096])."""
    B, A, n, D = 4, 5, 40, 4096
    base = random_model(A)
    kept = []

    def fn(action, emb):
        kept.append((action, action.clone(), emb, emb.clone()))
        out, h = base(action, emb[:, :1])
        return out, torch.cat([h, emb[:, 1:] + 1], 1)

    root = random_root(B, A, 4)
    root = root._replace(embedding=torch.cat([root.embedding, torch.zeros(B, D - 1, dtype=torch.int64)], 1))
    a, b = both(root, fn, n, virtual_loss=3)
    assert_same_search(a, b)
    assert len(kept) == 2 * 14
    for action, action0, emb, emb0 in kept:
        assert torch.equal(action, action0) and torch.equal(emb, emb0)


def test_recurrent_outputs_of_other_dtypes_and_layouts():
    """float64, bfloat16 and strided recurrent outputs are converted like the torch path converts them;
    a tensor off the CPU is refused (the compiled code reads CPU memory by address)."""
    A = 6
    base = random_model(A)

    def odd(action, emb):
        out, nxt = base(action, emb)
        wide = torch.cat([out.prior_logits, out.prior_logits], 1)[:, ::2]  # strided, same values
        pair = torch.stack([out.value, out.reward], 1)
        return RecurrentOutput(pair[:, 1].double(), out.discount.bfloat16(), wide, pair[:, 0]), nxt

    for policy in ("muzero", "gumbel"):
        a, b = both(random_root(7, A, 6), odd, 30, policy=policy)
        assert_same_search(a, b, exact_floats=policy == "muzero")

    def off_cpu(action, emb):
        out, nxt = base(action, emb)
        return out._replace(value=torch.empty(out.value.shape, device="meta")), nxt

    with pytest.raises(ValueError, match="on meta"):
        search(random_root(2, A, 0), off_cpu, 4, SearchConfig(cpu_backend="numba"))


def test_roots_that_require_grad():
    """Root logits, values and embeddings straight from a network outside no_grad: the compiled tree
    searches their values (the torch path needs them detached: it writes them into leaf tensors)."""
    B, A = 4, 6
    root = random_root(B, A, 8)
    root = root._replace(embedding=root.embedding.float())
    grad_root = RootOutput(*(t.clone().requires_grad_() for t in root))
    base = random_model(A)

    def fn(action, emb):
        out, h = base(action, emb.detach().long())
        return out, h.float()

    for policy in ("muzero", "gumbel"):
        cfg = {"policy": policy}
        a = search(root, fn, 12, SearchConfig(cpu_backend="torch", **cfg), generator=torch.Generator().manual_seed(1))
        b = search(grad_root, fn, 12, SearchConfig(cpu_backend="numba", **cfg),
                   generator=torch.Generator().manual_seed(1))  # fmt: skip
        assert_same_search(a, b, exact_floats=policy == "muzero")


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("B", [1, 4])
@pytest.mark.parametrize("policy", ["muzero", "gumbel"])
def test_small_batches_compiled_softmax(policy, B, seed, monkeypatch):
    """B * K <= cpu.SMALL_ROWS: each wave's prior softmax runs compiled and the tree's priors are rewritten
    from torch's softmax of every wave's logits at the end. With masks, root noise and temperature
    sampling: the torch path's visit counts, actions and action weights; MuZero's whole tree bit for bit,
    Gumbel's within fp tolerance. With the rewrite switched off, the compiled priors themselves are within
    fp tolerance of torch's and lead to the same visit counts."""
    A, n = 18, 50
    calls = []
    real = cpu._rewrite_priors
    monkeypatch.setattr(cpu, "_rewrite_priors", lambda *args: calls.append(1) or real(*args))
    cfg = {"policy": policy, "temperature": 1.0}
    if policy == "gumbel":
        cfg["max_num_considered_actions"] = 8
    root, fn, invalid = random_root(B, A, 10 + seed), random_model(A), random_invalid(B, A, seed)
    a, b = both(root, fn, n, invalid, seed, **cfg)
    assert calls == [1]  # the small-batch path ran (once, for the numba search)
    assert torch.equal(a.visit_counts, b.visit_counts)
    assert torch.equal(a.action, b.action)
    torch.testing.assert_close(a.action_weights, b.action_weights)
    assert_same_search(a, b, exact_floats=policy == "muzero")

    monkeypatch.setattr(cpu, "_rewrite_priors", lambda *args: None)  # keep the compiled priors
    c = search(root, fn, n, SearchConfig(cpu_backend="numba", **cfg), invalid, torch.Generator().manual_seed(seed))
    assert torch.equal(a.visit_counts, c.visit_counts)
    torch.testing.assert_close(a.action_weights, c.action_weights)
    expanded = a.tree.node_visits > 0
    torch.testing.assert_close(c.tree.edges[expanded], a.tree.edges[expanded], rtol=1e-6, atol=1e-7)


def test_small_batch_threshold(monkeypatch):
    """Only searches of at most cpu.SMALL_ROWS rows per wave (B * virtual_loss) take the compiled softmax."""
    calls = []
    real = cpu._rewrite_priors
    monkeypatch.setattr(cpu, "_rewrite_priors", lambda *args: calls.append(1) or real(*args))
    A = 5
    for B, K, small in ((cpu.SMALL_ROWS, 1, True), (cpu.SMALL_ROWS + 1, 1, False), (4, 4, True), (4, 5, False)):
        calls.clear()
        a, b = both(random_root(B, A, 1), random_model(A), 12, random_invalid(B, A, 1), 1, virtual_loss=K)
        assert calls == ([1] if small else [])
        assert_same_search(a, b)


# ------------------------------------------------------------------- NumpyRecurrentFn (numpy in and out)


def _unit_np(h: np.ndarray, shift: int) -> np.ndarray:
    return ((h >> shift) & 0x7FFFFF).astype(np.float32) / np.float32(1 << 23)


def numpy_random_model(num_actions: int, terminal_rate: float = 0.1, seen: list | None = None):
    """`random_model` written on numpy arrays (int64 arithmetic wraps in both): the same bits. `seen`
    collects the types of each call's inputs."""
    salts = np.arange(1, num_actions + 1, dtype=np.int64) * 0x1E3779B97F4A7C15

    def mix(h):
        h = h * np.int64(_MULT) + np.int64(_INC)
        return h ^ (h >> 29)

    def fn(action: np.ndarray, emb: np.ndarray):
        if seen is not None:
            seen.append((type(action), action.dtype, type(emb)))
        h = mix(emb[:, 0] * 31 + action + 7)
        lh = mix(h[:, None] ^ salts)
        terminal = _unit_np(h, 5) < terminal_rate
        out = RecurrentOutput(
            reward=_unit_np(h, 3) * 2 - 1,
            discount=np.where(terminal, np.float32(0.0), np.float32(0.97)),
            prior_logits=_unit_np(lh, 11) * 6 - 3,
            value=_unit_np(h, 17) * 2 - 1,
        )
        return out, h[:, None]

    return fn


def numpy_fast_path_calls(monkeypatch) -> list:
    calls: list = []
    real = cpu._numpy_waves
    monkeypatch.setattr(cpu, "_numpy_waves", lambda *args: calls.append(1) or real(*args))
    return calls


def test_numpy_model_is_the_torch_model():
    A = 7
    action = torch.randint(A, (50,), generator=torch.Generator().manual_seed(0))
    emb = random_root(50, A, 3).embedding
    a, ea = random_model(A)(action, emb)
    b, eb = numpy_random_model(A)(action.numpy(), emb.numpy())
    for x, y in zip(a, b):
        assert y.dtype == np.float32 and torch.equal(x, torch.from_numpy(y))
    assert torch.equal(ea, torch.from_numpy(eb))


@pytest.mark.parametrize(
    "policy,B,K,masked",
    [(p, B, 1, m) for p in ("muzero", "gumbel") for B, m in ((1, False), (4, True), (24, True))]
    + [("muzero", 6, 3, True), ("muzero", 5, 4, False)],  # virtual loss is MuZero only
)
def test_numpy_protocol_same_trees_as_torch_protocol(policy, B, K, masked, monkeypatch):
    """The same model written on tensors and on numpy arrays: the compiled tree gives the same trees,
    outputs and embeddings bit for bit (small and large batches, masks, noise, temperature sampling,
    virtual loss with a partial last wave), and the numpy model gets numpy arrays. The torch path runs the
    wrapper through its tensor adapter: MuZero bit for bit, Gumbel within fp tolerance, as for a torch fn."""
    A, n = 9, 31
    seen: list = []
    root, invalid = random_root(B, A, B + K), random_invalid(B, A, B) if masked else None
    cfg = {"policy": policy, "temperature": 1.0, "virtual_loss": K}
    calls = numpy_fast_path_calls(monkeypatch)
    ref = search(root, random_model(A), n, SearchConfig(cpu_backend="numba", **cfg), invalid,
                 torch.Generator().manual_seed(5))  # fmt: skip
    assert calls == []
    wrapped = NumpyRecurrentFn(numpy_random_model(A, seen=seen))
    got = search(root, wrapped, n, SearchConfig(cpu_backend="numba", **cfg), invalid, torch.Generator().manual_seed(5))
    assert calls == [1]  # the numpy loop ran
    assert_same_search(ref, got)
    assert len(seen) == -(-n // K) and all(s == (np.ndarray, np.int64, np.ndarray) for s in seen)
    slow = search(root, wrapped, n, SearchConfig(cpu_backend="torch", **cfg), invalid, torch.Generator().manual_seed(5))
    assert_same_search(slow, got, exact_floats=policy == "muzero")


@pytest.mark.parametrize("policy", ["muzero", "gumbel"])
def test_bench_table_model_both_ways(policy):
    """The bench's "table" recurrent_fn (torch tensors) and "table-numpy" (NumpyRecurrentFn): same trees."""
    for B in (1, 32):
        root = torch_root("table", B, torch.device("cpu"))
        cfg = SearchConfig(policy=policy, cpu_backend="numba")
        a = search(root, table_model(), 50, cfg, generator=torch.Generator().manual_seed(B))
        b = search(root, table_model_numpy(), 50, cfg, generator=torch.Generator().manual_seed(B))
        assert_same_search(a, b)


def test_numpy_inputs_kept_and_output_buffers_reused():
    """A numpy fn may keep its inputs (each wave's rows are its own) and may return the same output buffers
    on every call, overwritten in place (each wave's outputs are read before the next call); strided and
    float64 outputs are converted to float32 as the torch protocol converts them."""
    B, A, n = 3, 6, 20
    base = numpy_random_model(A)
    kept = []
    bufs = {}

    def fn(action, emb):
        kept.append((action, action.copy(), emb, emb.copy()))
        out, nxt = base(action, emb)
        rows = action.shape[0]
        if rows not in bufs:
            bufs[rows] = (np.empty(rows, np.float32), np.empty((rows, 2 * A), np.float32), np.empty((rows, 1), np.int64))
        value, wide, state = bufs[rows]
        value[:] = out.value
        wide[:, ::2] = out.prior_logits  # a strided view of the same values
        state[:] = nxt
        return RecurrentOutput(out.reward.astype(np.float64), out.discount, wide[:, ::2], value), state

    root = random_root(B, A, 2)
    for policy in ("muzero", "gumbel"):
        cfg = SearchConfig(policy=policy, cpu_backend="numba")
        a = search(root, random_model(A), n, cfg, generator=torch.Generator().manual_seed(0))
        b = search(root, NumpyRecurrentFn(fn), n, cfg, generator=torch.Generator().manual_seed(0))
        assert_same_search(a, b)
    for action, action0, emb, emb0 in kept:
        assert np.array_equal(action, action0) and np.array_equal(emb, emb0)


def test_numpy_protocol_pytree_and_one_dim_embeddings(monkeypatch):
    """A pytree embedding takes the tensor adapter (numpy pytrees in and out); a [B] embedding the numpy
    loop. Both give the torch path's trees."""
    A, n = 4, 15
    base = numpy_random_model(A)

    def gen():
        return torch.Generator().manual_seed(7)

    def pytree_fn(action, emb):
        state, extra = emb
        out, nxt = base(action, state)
        return out, (nxt, extra * 2 + 1)

    root = random_root(3, A, 1)
    root = root._replace(embedding=(root.embedding, torch.zeros(3, 2, 2, dtype=torch.float16)))
    calls = numpy_fast_path_calls(monkeypatch)
    a = search(root, NumpyRecurrentFn(pytree_fn), n, SearchConfig(cpu_backend="torch"), generator=gen())
    b = search(root, NumpyRecurrentFn(pytree_fn), n, SearchConfig(cpu_backend="numba"), generator=gen())
    assert calls == []
    assert torch.equal(a.visit_counts, b.visit_counts)
    for x, y in zip(a.tree.embeddings, b.tree.embeddings):
        assert torch.equal(x, y)
    assert b.tree.embeddings[1][:, 1].eq(1).all()

    def handle_fn(action, emb):  # [B'] int64 embeddings
        out, nxt = base(action, emb[:, None])
        return out, nxt[:, 0]

    root = random_root(5, A, 3)
    root = root._replace(embedding=root.embedding[:, 0])
    a = search(root, NumpyRecurrentFn(handle_fn), n, SearchConfig(cpu_backend="torch"), generator=gen())
    b = search(root, NumpyRecurrentFn(handle_fn), n, SearchConfig(cpu_backend="numba"), generator=gen())
    assert calls == [1]
    assert torch.equal(a.visit_counts, b.visit_counts) and torch.equal(a.tree.embeddings, b.tree.embeddings)


def _bad_outputs(A: int):
    """(name, change of a good output, the error it must raise)."""
    return [
        ("value shape", lambda o, e: (o._replace(value=o.value[:, None]), e), r"value of shape \[3, 1\]; expected \[3\]"),
        ("reward rows", lambda o, e: (o._replace(reward=o.reward[:2]), e), r"reward of shape \[2\]; expected \[3\]"),
        ("logits width", lambda o, e: (o._replace(prior_logits=o.prior_logits[:, :2]), e),
         rf"prior_logits of shape [\[(]3, 2[\])]; expected \[3, {A}\]"),  # torch path: search()'s check
        ("int reward", lambda o, e: (o._replace(reward=o.reward.astype(np.int64)), e),
         r"reward of dtype int64; expected float32 \(or float64"),
        ("float16 discount", lambda o, e: (o._replace(discount=o.discount.astype(np.float16)), e),
         r"discount of dtype float16; expected float32"),
        ("list value", lambda o, e: (o._replace(value=o.value.tolist()), e), r"value of type list; expected a float32 ndarray \[3\]"),
        ("tensor logits", lambda o, e: (o._replace(prior_logits=torch.from_numpy(o.prior_logits)), e),
         r"prior_logits of type Tensor"),
        ("tuple output", lambda o, e: (tuple(o), e), r"must return \(RecurrentOutput, next_embedding\) of numpy arrays, got tuple"),
        ("embedding dtype", lambda o, e: (o, e.astype(np.float32)),
         r"next_embedding \[3, 1\] of dtype float32; expected an ndarray \[3, 1\] of dtype int64"),
        ("embedding shape", lambda o, e: (o, e[:, 0]), r"next_embedding \[3\] of dtype int64; expected an ndarray \[3, 1\]"),
        ("embedding tensor", lambda o, e: (o, torch.from_numpy(e)), r"next_embedding Tensor; expected an ndarray"),
    ]


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_numpy_fn_bad_outputs_named(backend):
    """A numpy fn returning a wrong shape, dtype or type on a later wave: a ValueError that names the bad
    value and what is valid, on the compiled tree and through the tensor adapter of the torch path."""
    B, A = 3, 5
    base = numpy_random_model(A)
    for name, change, message in _bad_outputs(A):
        calls = []

        def fn(action, emb, change=change, calls=calls):
            calls.append(1)
            out, nxt = base(action, emb)
            return change(out, nxt) if len(calls) == 3 else (out, nxt)

        with pytest.raises(ValueError, match=message):
            search(random_root(B, A, 0), NumpyRecurrentFn(fn), 6, SearchConfig(cpu_backend=backend))
        assert len(calls) == 3, name


def test_numpy_fn_refusals():
    with pytest.raises(ValueError, match="needs a callable"):
        NumpyRecurrentFn(3)
    root = RootOutput(torch.zeros(2, 3), torch.zeros(2), torch.zeros(2, 4, dtype=torch.bfloat16))

    def fn(action, emb):
        raise AssertionError("not called")

    for backend in ("numba", "torch"):
        with pytest.raises(ValueError, match="bfloat16 embedding has no numpy dtype"):
            search(root, NumpyRecurrentFn(fn), 4, SearchConfig(cpu_backend=backend))
