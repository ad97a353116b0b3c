"""The inference actor's host-side work for one lone whole search, on the CPU: what a GPU host's one env waits on
besides the device. It runs the actor's lone path (`_channel_search`, `_lone_job`: launch, staging, noise, the
search graph's inputs, wait, split, answer) on the CUDA path emulated as the tests emulate it (tests/conftest.py:
streams, events and pinned memory as no-ops), with the graphs' replays emptied, so that what is timed is the
host's own work: Python, small tensor copies, the noise. A tiny MLP, one root, 2 simulations, merged searches (the
atari preset's).

    python3 scripts/lone_host_cost.py [--searches 3000] [--profile]

To compare two versions of the code: PYTHONPATH=OTHER_CHECKOUT/src python3 scripts/lone_host_cost.py.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import conftest  # noqa: E402  (the tests' emulated CUDA plumbing)


def _emulate_cuda() -> None:
    """conftest's `emulated_cuda` fixture, applied for the process, with graph replays that compute nothing."""
    import rayzero.inference.runner as runner
    import rayzero.inference.server as server_module
    import rayzero.tree.capture as capture

    class HostOnlySearch(conftest._FakeCapturedSearch):
        """The captured search's host side (its inputs copied into static buffers); the search itself runs once."""
        out = None

        def __call__(self, root, invalid_actions=None, generator=None, noise=None):
            for dst, src in zip(self.root, root):
                dst.copy_(src)
            if HostOnlySearch.out is None:
                HostOnlySearch.out = super().__call__(root, invalid_actions, generator, noise)
            return HostOnlySearch.out

    class EmptyGraph(conftest._FakeGraph):
        def replay(self):
            self.replays += 1

    runner.is_cuda = server_module.is_cuda = lambda device: True
    runner.pinned = lambda shape, dtype: torch.zeros(shape, dtype=dtype)
    runner.capture_graph = lambda fn, pool, stream=None: EmptyGraph(fn, stream)
    capture.CapturedSearch = HostOnlySearch
    torch.cuda.Stream, torch.cuda.Event = conftest._FakeStream, conftest._FakeEvent
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.graph_pool_handle = lambda: None
    torch.cuda.set_device = lambda device: None
    torch.cuda.synchronize = lambda device=None: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--searches", type=int, default=3000)
    parser.add_argument("--profile", action="store_true", help="then the 25 functions with the most own time")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _emulate_cuda()
    from rayzero.config import InferenceConfig, ModelConfig
    from rayzero.inference import InferenceServer
    from rayzero.inference import channel as channels
    from rayzero.tree import SearchConfig

    model = ModelConfig(kind="mlp", latent_dim=8, hidden=16, support_size=5)
    cfg = InferenceConfig(device="cpu", max_batch=16, min_bucket=4, bf16=False, search_max_batch=16,
                          merge_searches=True)
    srv = InferenceServer(model, cfg, (4,), 3, search_cfg=SearchConfig(num_simulations=2, dirichlet_fraction=0.25),
                          discount=0.99)
    arrays = {tag: np.zeros(shape, dtype)
              for tag, (shape, dtype) in channels.specs(8, 8, (4,), np.dtype(np.float32), 3).items()}
    channel = channels.ServerChannel("one", arrays)
    arrays["obs"][:1] = np.random.default_rng(0).normal(size=(1, 4)).astype(np.float32)
    header = arrays["header"]
    header[channels.KIND], header[channels.ROWS] = channels.SEARCH, 1
    header[channels.STORE] = channels.TEMPERATURE_SCALE  # temperature 1
    seq = 0

    def searches(n: int) -> None:
        nonlocal seq
        for _ in range(n):
            seq += 1
            header[channels.REQ] = seq
            _, _, payload = channel.request()
            srv._lone_job(srv._channel_search(channel, seq, *payload, count_errors=False))
            assert header[channels.DONE] == seq and header[channels.STATUS] == 0

    searches(200)  # warm-up
    start = time.perf_counter()
    searches(args.searches)
    print(f"host work per lone search: {1e6 * (time.perf_counter() - start) / args.searches:.1f} us "
          f"(mean of {args.searches})")
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        searches(args.searches)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
