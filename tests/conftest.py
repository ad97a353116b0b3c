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


# -- the CUDA path's plumbing, emulated on the CPU ------------------------------------------------------------
# Streams, events and pinned memory become no-ops and a "graph" replays its Python function, so the staging
# slots, index rows, padding to buckets, scratch rows, cache copies and whole-search wiring run on the CPU.


class _FakeEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _FakeStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def synchronize(self):
        pass


class _FakeGraph:
    def __init__(self, fn, stream=None):
        self.fn, self.stream = fn, stream  # the stream it was captured on
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.fn()


class _FakeCapturedSearch:
    def __init__(self, recurrent_fn, example_root, num_simulations, config, pool=None, generator=None,
                 per_row=False, stream=None):
        from rayzero.tree import RootOutput

        self.fn, self.n, self.config, self.stream = recurrent_fn, num_simulations, config, stream
        self.root = RootOutput(*(t.clone() for t in example_root))

    def __call__(self, root, invalid_actions=None, generator=None, noise=None):
        from rayzero.tree import search

        for dst, src in zip(self.root, root):
            dst.copy_(src)
        return search(self.root, self.fn, self.n, self.config, invalid_actions, generator=generator, noise=noise)


@pytest.fixture
def emulated_cuda(monkeypatch):
    import contextlib

    import rayzero.inference.runner as runner
    import rayzero.inference.server as server_module
    import rayzero.tree.capture as capture

    monkeypatch.setattr(runner, "is_cuda", lambda device: True)
    monkeypatch.setattr(server_module, "is_cuda", lambda device: True)
    monkeypatch.setattr(runner, "pinned", lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    monkeypatch.setattr(runner, "capture_graph", lambda fn, pool, stream=None: _FakeGraph(fn, stream))
    monkeypatch.setattr(capture, "CapturedSearch", _FakeCapturedSearch)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
