"""The learner's update as one CUDA graph (`learner.step_graph`).

Where the update runs without CUDA graphs of its own (eagerly: while the background compile's helper compiles,
after compiling failed or a compiled mode was caught computing wrong gradients, or with `learner.compile=false`;
or compiled in inductor's 'default' mode), it is bound by Python launching its thousands of small kernels, not by
the GPU (docs/benchmarks.md, the learner's step alone). This captures the whole update (side steps, loss,
backward, clipping, the optimizer step) once and replays it for each batch: the same kernels, so the same
arithmetic, launched by one call. It is PyTorch's documented whole-network capture (`torch.cuda.graph`); an eager
step's graph does not involve inductor, so neither its compile time nor its miscompiles.

What the graph needs, and how it is given it: fixed shapes and keys (a batch that differs is captured anew); the
optimizer's state in being (the graph is captured after eager updates have created it); the learning rate as a
device tensor (the optimizer is fused, and reads it from there); inputs at fixed addresses (each batch is copied
into the captured ones). Other threads may use CUDA meanwhile (the prefetcher, a colocated inference server):
the capture is thread-local, on a stream of its own. A capture that fails is logged and the learner goes on
without it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rayzero.logs import first_line, logger

log = logger(__name__)

Outputs = tuple[torch.Tensor, ...]
MAX_CAPTURES = 4  # a new batch layout recaptures; past this many the learner goes on without the graph


class StepGraph:
    """body(tensors) runs one whole update and returns its outputs (device tensors); `__call__` runs it through
    the graph, capturing it on the first call for a batch layout, and returns the outputs, valid until the next
    call."""

    def __init__(self, body: Callable[[dict[str, torch.Tensor]], Outputs], optimizer: torch.optim.Optimizer,
                 device: torch.device):
        self.body, self.optimizer, self.device = body, optimizer, device
        self.graph: torch.cuda.CUDAGraph | None = None
        self.layout: tuple | None = None
        self.inputs: dict[str, torch.Tensor] = {}
        self.outputs: Outputs = ()
        self.lr = torch.zeros((), dtype=torch.float32, device=device)
        self.failed = False
        self.captures = 0

    @staticmethod
    def _layout(tensors: dict[str, torch.Tensor]) -> tuple:
        return tuple((k, tuple(v.shape), v.dtype, v.stride()) for k, v in sorted(tensors.items()))

    def __call__(self, tensors: dict[str, torch.Tensor], lr: float) -> Outputs:
        """One update on `tensors` at learning rate `lr`. A new layout (or the first call) runs the update
        eagerly on a side stream, as the capture's warm-up, and captures the graph for the next one."""
        self.lr.fill_(lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr  # what the graph reads is the tensor; this keeps the optimizer's own state (checkpoints) true
        if self.graph is not None and self._layout(tensors) == self.layout:
            with torch.no_grad():
                for key, tensor in tensors.items():
                    self.inputs[key].copy_(tensor)
            self.graph.replay()
            return self.outputs
        return self._capture(tensors)

    def _capture(self, tensors: dict[str, torch.Tensor]) -> Outputs:
        if self.captures >= MAX_CAPTURES:  # batches whose layout keeps changing: each capture syncs the device
            self.drop()
            self.failed = True
            log.warning(f"the learner's batches changed layout {self.captures} times; the step graph is off")
            return self.body(tensors)
        self.drop()
        self.inputs = {key: tensor.clone() for key, tensor in tensors.items()}
        self.layout = self._layout(self.inputs)
        groups = self.optimizer.param_groups
        float_lrs = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = self.lr  # the graph reads the rate from this tensor; `__call__` fills it
        try:
            # Warm-up (PyTorch's recipe: lazy initialisation off the capture): this batch's real update.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                warm = self.body(self.inputs)
            torch.cuda.current_stream(self.device).wait_stream(side)
            warm = tuple(t.clone() for t in warm)  # the capture below must not reuse their memory
            graph = torch.cuda.CUDAGraph()
            try:
                self.optimizer.zero_grad(set_to_none=True)  # the captured backward allocates the gradients
                # A stream of its own: torch.cuda.graph's default one is shared by every capture in the process
                # (a colocated inference server captures its searches from another thread).
                with torch.cuda.graph(graph, stream=torch.cuda.Stream(self.device), capture_error_mode="thread_local"):
                    self.outputs = self.body(self.inputs)
            except Exception as error:  # noqa: BLE001 - any capture failure leaves eager updates working
                self.failed = True
                self.outputs, self.inputs, self.layout = (), {}, None
                self.optimizer.zero_grad(set_to_none=True)
                log.warning(f"capturing the learner's step as a CUDA graph failed ({type(error).__name__}: "
                            f"{first_line(error, 300)}); training without it")
                return warm
        finally:
            for group, lr in zip(groups, float_lrs):
                group["lr"] = lr
        self.graph = graph
        self.captures += 1
        return warm

    def drop(self) -> None:
        """Free the graph and its memory pool (the gradients it allocated go with it)."""
        if self.graph is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self.graph, self.layout, self.inputs, self.outputs = None, None, {}, ()
