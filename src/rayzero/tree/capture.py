"""A whole search, network included, captured into one CUDA graph for a fixed batch, and replayed.

Shapes: B roots, A actions, fixed at capture. This module owns the capture: static input buffers (root
logits/value/embedding, the invalid-action mask, the random inputs), the warm-up, the capture itself and
the replay that copies new inputs into the static buffers.

Randomness: the captured search draws nothing itself; each call draws a fresh `SearchNoise` with the
given generator outside the graph (noise.sample_noise) and copies it into the graph's static noise
buffers, so any generator works on any torch version (no graph-safe generator registration needed).
The invalid-action mask is always a static buffer (all False when a call passes None).

`recurrent_fn` must itself be capturable: fixed shapes, no host syncs (.item(), data-dependent shapes),
tensors it closes over (weights) kept alive and updated in place if they change.
"""

from __future__ import annotations

import torch

from rayzero.tree.base import RecurrentFn, RootOutput, SearchConfig, SearchOutput
from rayzero.tree.noise import SearchNoise, row_defaults, sample_noise
from rayzero.tree.search import search
from rayzero.tree.tree import tree_leaves, tree_map, tree_map2


class CapturedSearch:
    """`search` for B roots on CUDA, recorded once into a torch.cuda.CUDAGraph and replayed per call.

    Build it with an example root (its shapes, dtypes and device fix the graph); call it like `search`:
    `captured(root, invalid_actions=None, generator=None, noise=None) -> SearchOutput`.
    The returned tensors are the graph's static outputs: the next call overwrites them (clone to keep).
    """

    def __init__(
        self,
        recurrent_fn: RecurrentFn,
        example_root: RootOutput,
        num_simulations: int,
        config: SearchConfig = SearchConfig(),  # noqa: B008 - frozen dataclass, never mutated
        *,
        use_triton: bool | None = None,
        warmup: int = 2,
        pool: tuple[int, int] | None = None,
        generator: torch.Generator | None = None,
        per_row: bool = False,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """per_row: the graph also reads per-row settings (noise.SearchNoise.root_fraction and temperature), so
        that one batch can mix requests of different acting settings; a call that gives none gets the config's.
        stream: where the graph is captured (None: torch's default capture stream, which every graph captured
        without one shares). Its captured GEMMs keep that stream's cuBLAS workspace, so graphs that may run at
        once on different streams need capture streams of their own."""
        device = example_root.prior_logits.device
        if device.type != "cuda":
            raise ValueError(f"CapturedSearch needs CUDA tensors; the example root is on {device}")
        if warmup < 1:
            raise ValueError(f"warmup={warmup} is invalid: at least one eager run must precede the capture")
        self.config = config
        self.num_simulations = num_simulations
        self.recurrent_fn = recurrent_fn
        B, A = example_root.prior_logits.shape
        self.batch_size, self.num_actions = B, A
        self.device = device
        self.root = RootOutput(
            prior_logits=example_root.prior_logits.detach().clone(),
            value=example_root.value.detach().clone(),
            embedding=tree_map(lambda t: t.detach().clone(), example_root.embedding),
        )
        self.invalid = torch.zeros((B, A), dtype=torch.bool, device=device)
        self.noise = sample_noise(config, B, A, generator=generator, device=device)
        self.row_defaults = row_defaults(config) if per_row else {}
        if per_row:
            self.noise = self.noise._replace(**{name: torch.full((B,), value, device=device)
                                                for name, value in self.row_defaults.items()})

        def run() -> SearchOutput:
            return search(
                self.root,
                recurrent_fn,
                num_simulations,
                config,
                self.invalid,
                noise=self.noise,
                use_triton=use_triton,
            )

        # Warm up on a side stream (Triton compilation, cuBLAS handles, the search's cached tables).
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                run()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the process (the inference actor's weight stager, say) may keep making
        # CUDA calls such as an event synchronize while this thread captures; in the default global mode any of
        # them invalidates the capture and fails both.
        with torch.cuda.graph(self.graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            self.output = run()

    def __call__(
        self,
        root: RootOutput,
        invalid_actions: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        noise: SearchNoise | None = None,
    ) -> SearchOutput:
        """Copy `root` (same shapes as at capture), the mask and fresh noise in; replay; return the outputs."""
        B, A = self.batch_size, self.num_actions
        if tuple(root.prior_logits.shape) != (B, A) or tuple(root.value.shape) != (B,):
            raise ValueError(
                f"captured for prior_logits [{B}, {A}] and value [{B}], got {tuple(root.prior_logits.shape)} "
                f"and {tuple(root.value.shape)}"
            )
        new, old = tree_leaves(root.embedding), tree_leaves(self.root.embedding)
        if len(new) != len(old) or any(a.shape != b.shape for a, b in zip(new, old)):
            raise ValueError(
                f"captured for embedding shapes {[tuple(t.shape) for t in old]}, got {[tuple(t.shape) for t in new]}"
            )
        self.root.prior_logits.copy_(root.prior_logits)
        self.root.value.copy_(root.value)
        tree_map2(lambda dst, src: dst.copy_(src), self.root.embedding, root.embedding)
        if invalid_actions is None:
            self.invalid.zero_()
        else:
            if tuple(invalid_actions.shape) != (B, A) or invalid_actions.dtype != torch.bool:
                raise ValueError(
                    f"invalid_actions must be bool [{B}, {A}], got {invalid_actions.dtype} {tuple(invalid_actions.shape)}"
                )
            self.invalid.copy_(invalid_actions)
        if noise is None:
            noise = sample_noise(self.config, B, A, generator=generator, device=self.device)
        for dst, src, name in zip(self.noise, noise, SearchNoise._fields):
            if dst is None:
                continue
            if src is None and name in self.row_defaults:
                dst.fill_(self.row_defaults[name])
                continue
            if src is None:
                raise ValueError(f"noise.{name} is needed by this search (config {self.config}) but is None")
            dst.copy_(src)
        self.graph.replay()
        return self.output
