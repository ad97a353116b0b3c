import os

import pytest
import torch

# CI and laptops have 2 cores: intra-op threads fighting each other make small ops 10x slower.
torch.set_num_threads(1)
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
