"""CUDA tests of the learner side: the reanalyse worker's captured search. Skipped without CUDA."""

import numpy as np
import pytest
import torch

from rayzero.config import ModelConfig
from rayzero.learner.reanalyse import ReanalyseWorker
from rayzero.tree import SearchConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_reanalyse_graph_replay_gives_the_eager_targets():
    model = ModelConfig(kind="mlp", latent_dim=16, hidden=32, support_size=10)
    search_cfg = SearchConfig(num_simulations=12, dirichlet_fraction=0.0)  # deterministic
    captured = ReanalyseWorker(model, search_cfg, 0.99, (4,), 3, seed=0, device="cuda")
    eager = ReanalyseWorker(model, search_cfg, 0.99, (4,), 3, seed=0, device="cuda")
    eager.capture_error = "eager on purpose"
    state = {k: v + 0.1 * torch.randn_like(v) for k, v in captured.evaluator.model.state_dict().items()}
    captured.set_weights(1, state)
    eager.set_weights(1, state)
    rng = np.random.default_rng(0)
    for _ in range(3):
        obs = rng.normal(size=(64, 4)).astype(np.float32)
        p1, v1 = captured.targets(obs)
        p2, v2 = eager.targets(obs)
        np.testing.assert_allclose(p1, p2, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(v1, v2, rtol=1e-5, atol=1e-5)
    assert captured.capture_error is None and set(captured.captured) == {64}
    # New weights (copied in place) reach the captured graph.
    captured.set_weights(2, {k: v * 0.5 for k, v in state.items()})
    eager.set_weights(2, {k: v * 0.5 for k, v in state.items()})
    obs = rng.normal(size=(64, 4)).astype(np.float32)
    np.testing.assert_allclose(captured.targets(obs)[1], eager.targets(obs)[1], rtol=1e-5, atol=1e-5)
