"""The tree's fused Triton kernels against the torch path, run by Triton's interpreter on CPU tensors.

CI has no GPU, so this is where the kernels' logic (selection with the first-play rule, expansion and backup,
MuZero and Gumbel, the virtual-loss walks) is checked on every change; tests/test_tree_gpu.py runs the compiled
kernels on CUDA.
The interpreter must be switched on before the kernels are defined, hence a fresh interpreter process.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    import torch
    from rayzero.tree import RootOutput, kernels, sample_noise, search
    from test_tree_gpu import CONFIGS, _invalid, _mlp_model

    assert kernels.triton_importable()
    kernels.available = lambda device: True  # the interpreter runs the kernels on CPU tensors
    calls = {{"select": 0, "select_claim": 0}}
    for name in calls:  # count the launches, so a path that skips the kernels cannot pass unseen
        def counted(*args, _name=name, _fn=getattr(kernels, name)):
            calls[_name] += 1
            return _fn(*args)
        setattr(kernels, name, counted)
    B, A, D, n = 12, 6, 8, 16
    for config in CONFIGS:
        g = torch.Generator().manual_seed(1)
        root = RootOutput(torch.randn(B, A, generator=g), torch.randn(B, generator=g),
                          torch.randn(B, D, generator=g))
        noise = sample_noise(config, B, A, generator=g)
        fn, invalid = _mlp_model(A, D, "cpu"), _invalid(B, A, "cpu")
        fused = search(root, fn, n, config, invalid, noise=noise, use_triton=True)
        plain = search(root, fn, n, config, invalid, noise=noise, use_triton=False)
        assert torch.equal(fused.visit_counts, plain.visit_counts), config
        assert torch.equal(fused.action, plain.action), config
        assert torch.equal(fused.tree.children_index, plain.tree.children_index), config
        if config.policy == "muzero":  # same float32 operations in the same order: bit-identical
            assert torch.equal(fused.tree.value_sums, plain.tree.value_sums), config
            assert torch.equal(fused.tree.edges, plain.tree.edges), config
        else:
            torch.testing.assert_close(fused.tree.value_sums, plain.tree.value_sums)
        assert fused.visit_counts[invalid].eq(0).all()
    assert calls["select"] > 0 and calls["select_claim"] > 0, calls
    print("ok", len(CONFIGS))
""")


def test_triton_kernels_match_the_torch_path_under_the_interpreter():
    # RAYZERO_TREE_NUMBA=0: CPU tensors would otherwise take the compiled CPU tree, on both sides of the comparison.
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore", RAYZERO_TREE_NUMBA="0")
    tests = str(Path(__file__).parent)
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=tests)], capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.strip().endswith("ok 7")  # every config of test_tree_gpu.CONFIGS ran
