"""CUDA tests of the batched tree search: CPU vs CUDA, Triton kernels vs the torch path, CUDA-graph
capture and replay, and no host synchronisation inside an eager search. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from test_tree import hash_model, hash_root  # tests/ is on sys.path under pytest

from rayzero.tree import RecurrentOutput, RootOutput, SearchConfig, SearchNoise, kernels, sample_noise, search

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# The fused kernels: need CUDA and triton.
needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() and kernels.available(torch.device("cuda"))), reason="needs triton kernels"
)

CUDA = "cuda"


def _noise_to(noise: SearchNoise, device: str) -> SearchNoise:
    return SearchNoise(*(x.to(device) if x is not None else None for x in noise))


def _mlp_model(A: int, D: int, device: str, seed: int = 0):
    """A small random MLP world model: embedding [B, D] float."""
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(D + A, D, generator=g) / D**0.5).to(device)
    w2 = (torch.randn(D, A + 2, generator=g) / D**0.5).to(device)
    eye = torch.eye(A, device=device)

    def fn(action, emb):
        h = torch.tanh(torch.cat([emb, eye[action]], 1) @ w1)
        o = h @ w2
        n = action.shape[0]
        return RecurrentOutput(o[:, 0], torch.full((n,), 0.97, device=device), o[:, 2:], o[:, 1]), h

    return fn


def _id(c: SearchConfig) -> str:
    return (f"{c.policy}-{c.temperature}-{c.gumbel_scale}" + (f"-minq{c.min_q_range}" if c.min_q_range else "")
            + (f"-vl{c.virtual_loss}" if c.virtual_loss > 1 else ""))


CONFIGS = [
    SearchConfig(policy="muzero", dirichlet_fraction=0.25, temperature=1.0),
    SearchConfig(policy="muzero", dirichlet_fraction=0.0, temperature=0.0),
    # A floor above most trees' Q range (min_q_range binds): each backend must apply it the same way.
    SearchConfig(policy="muzero", dirichlet_fraction=0.25, temperature=1.0, min_q_range=5.0),
    SearchConfig(policy="gumbel", gumbel_scale=1.0, max_num_considered_actions=8),
    SearchConfig(policy="gumbel", gumbel_scale=0.0, max_num_considered_actions=16),
    # Virtual loss: K walks per wave (the last wave partial where K does not divide the simulations).
    SearchConfig(policy="muzero", dirichlet_fraction=0.25, temperature=1.0, virtual_loss=2),
    SearchConfig(policy="muzero", dirichlet_fraction=0.0, temperature=0.0, virtual_loss=3),
]


def _invalid(B: int, A: int, device: str) -> torch.Tensor:
    invalid = torch.zeros(B, A, dtype=torch.bool)
    invalid[::3, 0] = True
    invalid[1::4, -3:] = True
    return invalid.to(device)


@pytest.mark.parametrize("policy", ["muzero", "gumbel"])
def test_a_graph_with_per_row_settings_replays_each_rows_own_search(policy):
    """The inference actor's merged batches: a CapturedSearch(per_row=True) replays what the eager search gives
    with the same per-row settings, and without settings given it searches with the config's."""
    from rayzero.tree.capture import CapturedSearch

    B, A, D, n = 32, 6, 16, 12
    config = SearchConfig(policy=policy, temperature=1.0, dirichlet_fraction=0.25, max_num_considered_actions=4)
    fn = _mlp_model(A, D, CUDA)
    g = torch.Generator(device=CUDA).manual_seed(4)

    def make_root():
        return RootOutput(torch.randn(B, A, device=CUDA, generator=g), torch.randn(B, device=CUDA, generator=g),
                          torch.randn(B, D, device=CUDA, generator=g))

    captured = CapturedSearch(fn, make_root(), n, config, per_row=True)
    greedy = torch.arange(B, device=CUDA) % 2 == 0
    fraction = torch.where(greedy, 0.0, 0.25 if policy == "muzero" else 1.0)
    rows = {"root_fraction": fraction}
    if policy == "muzero":
        rows["temperature"] = torch.where(greedy, 0.0, 1.0)
    for _ in range(2):
        root = make_root()
        noise = sample_noise(config, B, A, generator=g, device=CUDA)._replace(**rows)
        out = captured(root, noise=noise)
        torch.cuda.synchronize()
        ref = search(root, fn, n, config, noise=noise, use_triton=False)
        assert torch.equal(out.visit_counts, ref.visit_counts)
        assert torch.equal(out.action, ref.action)
        torch.testing.assert_close(out.action_weights, ref.action_weights)
    root = make_root()
    noise = sample_noise(config, B, A, generator=g, device=CUDA)
    out = captured(root, noise=noise)  # no per-row settings: the config's for every row
    torch.cuda.synchronize()
    ref = search(root, fn, n, config, noise=noise, use_triton=False)
    assert torch.equal(out.visit_counts, ref.visit_counts)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: _id(c))
@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=needs_triton)])
def test_cpu_and_cuda_agree(config, use_triton):
    B, A, n = 24, 6, 40
    noise = sample_noise(config, B, A, generator=torch.Generator().manual_seed(0))
    cpu = search(hash_root(B, A, 1), hash_model(A), n, config, _invalid(B, A, "cpu"), noise=noise)
    gpu = search(
        hash_root(B, A, 1, device=CUDA),
        hash_model(A, device=CUDA),
        n,
        config,
        _invalid(B, A, CUDA),
        noise=_noise_to(noise, CUDA),
        use_triton=use_triton,
    )
    assert torch.equal(cpu.visit_counts, gpu.visit_counts.cpu())
    assert torch.equal(cpu.action, gpu.action.cpu())
    torch.testing.assert_close(cpu.root_value, gpu.root_value.cpu())
    torch.testing.assert_close(cpu.action_weights, gpu.action_weights.cpu())
    assert torch.equal(cpu.tree.children_index, gpu.tree.children_index.cpu())


@needs_triton
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: _id(c))
def test_triton_matches_torch_path(config):
    B, A, D, n = 256, 18, 32, 50
    fn = _mlp_model(A, D, CUDA)
    g = torch.Generator(device=CUDA).manual_seed(1)
    root = RootOutput(
        torch.randn(B, A, device=CUDA, generator=g),
        torch.randn(B, device=CUDA, generator=g),
        torch.randn(B, D, device=CUDA, generator=g),
    )
    noise = sample_noise(config, B, A, generator=g, device=CUDA)
    invalid = _invalid(B, A, CUDA)
    fused = search(root, fn, n, config, invalid, noise=noise, use_triton=True)
    plain = search(root, fn, n, config, invalid, noise=noise, use_triton=False)
    assert torch.equal(fused.visit_counts, plain.visit_counts)
    assert torch.equal(fused.action, plain.action)
    assert torch.equal(fused.tree.children_index, plain.tree.children_index)
    if config.policy == "muzero":  # same float32 operations in the same order: bit-identical
        assert torch.equal(fused.tree.value_sums, plain.tree.value_sums)
        assert torch.equal(fused.tree.edges, plain.tree.edges)
        assert torch.equal(fused.tree.value_min, plain.tree.value_min)
        assert torch.equal(fused.tree.value_max, plain.tree.value_max)
    else:
        torch.testing.assert_close(fused.tree.value_sums, plain.tree.value_sums)
    assert fused.visit_counts.sum(-1).eq(n).all()
    assert fused.visit_counts[invalid].eq(0).all()


@pytest.mark.parametrize("config", CONFIGS[::2], ids=lambda c: c.policy)
@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=needs_triton)])
def test_cuda_graph_replay_equals_eager(config, use_triton):
    from rayzero.tree.capture import CapturedSearch

    B, A, D, n = 64, 6, 16, 12
    fn = _mlp_model(A, D, CUDA)
    g = torch.Generator(device=CUDA).manual_seed(2)

    def make_root():
        return RootOutput(
            torch.randn(B, A, device=CUDA, generator=g),
            torch.randn(B, device=CUDA, generator=g),
            torch.randn(B, D, device=CUDA, generator=g),
        )

    captured = CapturedSearch(fn, make_root(), n, config, use_triton=use_triton)
    for i in range(3):
        root = make_root()
        invalid = _invalid(B, A, CUDA) if i == 1 else None
        noise = sample_noise(config, B, A, generator=g, device=CUDA)
        out = captured(root, invalid, noise=noise)
        torch.cuda.synchronize()
        ref = search(root, fn, n, config, invalid, noise=noise, use_triton=use_triton)
        assert torch.equal(out.visit_counts, ref.visit_counts), i
        assert torch.equal(out.action, ref.action), i
        torch.testing.assert_close(out.root_value, ref.root_value)
        torch.testing.assert_close(out.action_weights, ref.action_weights)
    # noise drawn by the call itself with a seeded generator is reproducible
    root = make_root()
    a = captured(root, generator=torch.Generator(device=CUDA).manual_seed(5)).visit_counts.clone()
    b = captured(root, generator=torch.Generator(device=CUDA).manual_seed(5)).visit_counts.clone()
    assert torch.equal(a, b)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: _id(c))
@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=needs_triton)])
def test_eager_search_has_no_host_sync(config, use_triton):
    B, A, D, n = 32, 6, 16, 10
    fn = _mlp_model(A, D, CUDA)
    g = torch.Generator(device=CUDA).manual_seed(3)
    root = RootOutput(
        torch.randn(B, A, device=CUDA, generator=g),
        torch.randn(B, device=CUDA, generator=g),
        torch.randn(B, D, device=CUDA, generator=g),
    )
    invalid = _invalid(B, A, CUDA)
    search(root, fn, n, config, invalid, g, use_triton=use_triton)  # warm-up: compile, cache tables
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = search(root, fn, n, config, invalid, g, use_triton=use_triton)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.visit_counts.sum(-1).eq(n).all()
