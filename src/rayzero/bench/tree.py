"""Benchmark of the batched tree search (rayzero.tree): simulations/s and ms/search, eager and CUDA graph,
and the same settings in DeepMind's mctx (JAX) when `mctx` and `jax` import.

Rows: batch B x simulations n x network ("none": a cheap elementwise recurrent_fn with a 4-float embedding;
"mlp256": embedding [B, 256] -> 2-layer 256-wide ReLU MLP (action one-hot appended) -> reward / value /
logits heads) x policy (muzero, gumbel) x mode (eager; graph = one CUDA graph per search, CUDA only),
A = 18 actions. Full run: B in {1, 256, 1024, 4096}, n in {50, 200} (B=4096 with 200 simulations only
for muzero/none to bound the run); mctx on the rows that matter for comparison (50 simulations at B = 1,
1024, 4096, and muzero 200 simulations at B = 1024 with mlp256). --quick: B in {1, 16}, 10 simulations, CPU
friendly.

CPU rows (every run, CUDA or not): the compiled CPU tree (mode "numba", tree/cpu.py) against the torch CPU path
(mode "torch") on one core (torch.set_num_threads(1); numba is single-threaded), 50 simulations, B in
{1, 32, 64, 256, 1024}, both policies, three network-free recurrent_fns: "none" (above: small elementwise
torch ops), "table" (a random finite MDP: the embedding is a [B] int64 state id and each call is a few numpy
table lookups on the tensors' memory, no torch op) and "table-numpy" (the same MDP as a tree.NumpyRecurrentFn:
numpy arrays in and out, no tensor per call), so the tree's cost is not hidden behind torch's per-op
overhead of a fake network. Median of several searches after a warm-up (numba's compile or cache load is
timed separately as compile_s). Each row also reports the time spent inside recurrent_fn, and "tree-only"
simulations/s without it (what LightZero's tree-only figure measures). --quick: B in {1, 16}, 10 simulations.

Run: `python -m rayzero.bench.tree [--quick] [--cpu-only] [--json PATH]` (or `rayzero bench tree`); a subset
of the CPU rows: `--nets table --batches 1,256 --modes numba`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # keep JAX from taking the GPU's memory

import numpy as np
import torch

from rayzero.bench.common import write_json
from rayzero.tree import NumpyRecurrentFn, RecurrentOutput, RootOutput, SearchConfig, search, tree_nbytes

A = 18
EMB_NONE = 4
HIDDEN = 256
TABLE_STATES = 4096


# ------------------------------------------------------------------------------------------ models


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(i: int, o: int) -> torch.Tensor:
        return torch.randn(i, o, generator=g) / i**0.5

    return {"w1": w(HIDDEN + A, HIDDEN), "w2": w(HIDDEN, HIDDEN), "w3": w(HIDDEN, A + 2)}


def torch_model(net: str, device: torch.device, weights: dict[str, torch.Tensor]) -> Callable:
    """recurrent_fn of the benchmark's network case, in torch."""
    if net == "none":

        def none_fn(action: torch.Tensor, emb: torch.Tensor):
            a = action.to(torch.float32)
            nxt = emb + 0.01 * a.unsqueeze(-1)
            value = torch.sin(nxt[:, 0] * 3.0 + a)
            logits = torch.cos(nxt[:, 1:2] + 0.3 * torch.arange(A, device=device, dtype=torch.float32))
            return RecurrentOutput(0.1 * value, torch.full_like(value, 0.99), logits, value), nxt

        return none_fn
    w1, w2, w3 = (weights[k].to(device) for k in ("w1", "w2", "w3"))
    eye = torch.eye(A, device=device)

    @torch.no_grad()
    def mlp_fn(action: torch.Tensor, emb: torch.Tensor):
        h = torch.relu(torch.cat([emb, eye[action]], 1) @ w1)
        h = torch.relu(h @ w2)
        o = h @ w3
        return RecurrentOutput(o[:, 0], torch.full_like(o[:, 0], 0.99), o[:, 2:], torch.tanh(o[:, 1])), h

    return mlp_fn


def _table(seed: int) -> tuple[np.ndarray, ...]:
    """The "table" MDP: next state [S, A] int64, reward, discount, value [S] and logits [S, A] float32."""
    rng = np.random.default_rng(seed)
    S = TABLE_STATES
    next_state = rng.integers(S, size=(S, A))
    reward = (rng.random(S, dtype=np.float32) * 0.2 - 0.1).astype(np.float32)
    discount = np.where(rng.random(S) < 0.02, 0.0, 0.99).astype(np.float32)  # a few terminal states
    value = (rng.random(S, dtype=np.float32) * 2.0 - 1.0).astype(np.float32)
    logits = rng.standard_normal((S, A), dtype=np.float32)
    return next_state, reward, discount, value, logits


def table_model(seed: int = 0) -> Callable:
    """recurrent_fn "table": a random finite MDP of TABLE_STATES states, the embedding a [B'] int64 state id;
    a call is a next-state lookup and one lookup per output in numpy arrays (CPU tensors only)."""
    next_state, reward, discount, value, logits = _table(seed)

    def table_fn(action: torch.Tensor, emb: torch.Tensor):
        s = next_state[emb.numpy(), action.numpy()]
        out = RecurrentOutput(
            torch.from_numpy(reward[s]),
            torch.from_numpy(discount[s]),
            torch.from_numpy(logits[s]),
            torch.from_numpy(value[s]),
        )
        return out, torch.from_numpy(s)

    return table_fn


def table_model_numpy(seed: int = 0) -> NumpyRecurrentFn:
    """recurrent_fn "table-numpy": the "table" MDP with numpy in and out (tree.NumpyRecurrentFn): the same
    lookups, no tensor made or read."""
    next_state, reward, discount, value, logits = _table(seed)

    def table_fn(action: np.ndarray, emb: np.ndarray):
        s = next_state[emb, action]
        return RecurrentOutput(reward[s], discount[s], logits[s], value[s]), s

    return NumpyRecurrentFn(table_fn)


def torch_root(net: str, B: int, device: torch.device, seed: int = 0) -> RootOutput:
    g = torch.Generator().manual_seed(seed)
    if net in ("table", "table-numpy"):
        return RootOutput(
            torch.randn(B, A, generator=g).to(device),
            torch.randn(B, generator=g).to(device),
            torch.randint(TABLE_STATES, (B,), generator=g).to(device),
        )
    d = EMB_NONE if net == "none" else HIDDEN
    return RootOutput(
        torch.randn(B, A, generator=g).to(device),
        torch.randn(B, generator=g).to(device),
        torch.randn(B, d, generator=g).to(device),
    )


# ------------------------------------------------------------------------------------------ timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], Any], device: torch.device, reps: int, budget_s: float) -> float:
    """Mean seconds per call of fn (after one warm-up call), reps calls or fewer if the budget runs out."""
    fn()
    _sync(device)
    if device.type == "cuda":
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
            if sum(times) > budget_s:
                break
        return sum(times) / len(times)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if sum(times) > budget_s:
            break
    return sum(times) / len(times)


def bench_ours(
    net: str,
    policy: str,
    B: int,
    n: int,
    mode: str,
    device: torch.device,
    weights: dict,
    reps: int,
    budget_s: float,
) -> dict[str, Any]:
    config = SearchConfig(policy=policy, num_simulations=n)
    fn = torch_model(net, device, weights)
    root = torch_root(net, B, device)
    gen = torch.Generator(device=device).manual_seed(0)
    if mode == "graph":
        from rayzero.tree.capture import CapturedSearch

        t0 = time.perf_counter()
        captured = CapturedSearch(fn, root, n, config)
        capture_s = time.perf_counter() - t0

        def call() -> Any:
            return captured(root, generator=gen)

        out = call()
    else:
        capture_s = None

        def call() -> Any:
            return search(root, fn, n, config, generator=gen)

        out = call()
    sec = _time(call, device, reps, budget_s)
    _sync(device)
    row = _row("rayzero", net, policy, B, n, mode, sec)
    row["tree_bytes_per_tree"] = tree_nbytes(out.tree)
    if capture_s is not None:
        row["capture_s"] = round(capture_s, 3)
    return row


CPU_BATCHES = (1, 32, 64, 256, 1024)
# The compiled tree's entry points that run_search calls from Python (timed as "compiled calls").
COMPILED_CALLS = (
    "_init_search", "_wave", "_wave_arrays", "_outputs", "_rewrite_priors", "_clamp_tiny", "_negate", "_gamma_proposals",
    "_gamma_accept",
)  # fmt: skip
CPU_MODES = ("numba", "torch")
CPU_NETS = ("none", "table", "table-numpy")


def bench_cpu(
    policy: str, B: int, n: int, mode: str, reps: int, budget_s: float, net_name: str = "none"
) -> dict[str, Any]:
    """One CPU row: whole searches of the compiled tree ("numba") or the torch path ("torch"), one core."""
    from rayzero.tree import cpu

    device = torch.device("cpu")
    config = SearchConfig(policy=policy, num_simulations=n, cpu_backend=mode)
    nets = {"table": table_model, "table-numpy": table_model_numpy}
    net = nets[net_name]() if net_name in nets else torch_model("none", device, {})
    inner = net.fn if isinstance(net, NumpyRecurrentFn) else net
    in_fn = [0.0]

    def fn(action: Any, emb: Any):
        t0 = time.perf_counter()
        out = inner(action, emb)
        in_fn[0] += time.perf_counter() - t0
        return out

    if isinstance(net, NumpyRecurrentFn):
        fn = NumpyRecurrentFn(fn)

    in_compiled = [0.0]

    def compiled_timer(kernel: Callable) -> Callable:
        def timed(*args: Any) -> None:
            t0 = time.perf_counter()
            kernel(*args)
            in_compiled[0] += time.perf_counter() - t0

        return timed

    root = torch_root(net_name, B, device)
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    if mode == "numba":
        warm_up_compiled_tree()
    out = search(root, fn, n, config, generator=gen)
    compile_s = time.perf_counter() - t0
    times, fn_times, compiled_times = [], [], []
    kernel_names = [name for name in COMPILED_CALLS if hasattr(cpu, name)]
    kernels = [getattr(cpu, name) for name in kernel_names]
    for _ in range(reps):
        in_fn[0] = in_compiled[0] = 0.0
        t0 = time.perf_counter()
        search(root, fn, n, config, generator=gen)
        times.append(time.perf_counter() - t0)
        fn_times.append(in_fn[0])
        if sum(times) > budget_s and len(times) >= 3:
            break
    if mode == "numba":  # a few more searches with the compiled calls timed (not in the figures above)
        for name, kernel in zip(kernel_names, kernels):
            setattr(cpu, name, compiled_timer(kernel))
        try:
            for _ in range(3):
                in_compiled[0] = 0.0
                search(root, fn, n, config, generator=gen)
                compiled_times.append(in_compiled[0])
        finally:
            for name, kernel in zip(kernel_names, kernels):
                setattr(cpu, name, kernel)
    order = sorted(range(len(times)), key=times.__getitem__)
    mid = order[len(order) // 2]
    sec, fn_sec = times[mid], fn_times[mid]
    row = _row("rayzero", net_name, policy, B, n, f"cpu-{mode}", sec)
    row.update(
        ms_min=round(min(times) * 1000.0, 4),
        searches_timed=len(times),
        recurrent_fn_ms=round(fn_sec * 1000.0, 4),
        tree_only_ms=round((sec - fn_sec) * 1000.0, 4),
        tree_only_simulations_per_s=round(B * n / (sec - fn_sec), 1),
        compile_s=round(compile_s, 3),
        tree_bytes_per_tree=tree_nbytes(out.tree),
    )
    if compiled_times:  # selection + expansion/backup calls alone, the rest being Python and torch glue
        row["compiled_calls_ms"] = round(min(compiled_times) * 1000.0, 4)
        row["compiled_calls_simulations_per_s"] = round(B * n / min(compiled_times), 1)
    return row


def cpu_rows(
    quick: bool, nets: tuple[str, ...] = CPU_NETS, batches: tuple[int, ...] | None = None,
    modes: tuple[str, ...] = CPU_MODES,
) -> tuple[list[dict[str, Any]], list[str]]:
    """The CPU rows (numba and torch, one core); restores torch's thread count afterwards. `batches`,
    `modes`: a subset of the rows (default: all)."""
    from rayzero.tree import cpu

    all_batches, n = ((1, 16), 10) if quick else (CPU_BATCHES, 50)
    batches = batches or all_batches
    reps, budget = (3, 2.0) if quick else (15, 3.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    try:
        for net in nets:
            for policy in ("muzero", "gumbel"):
                for B in batches:
                    for mode in modes:
                        if mode == "numba" and not cpu.numba_importable():
                            errors.append("numba not importable: no cpu-numba rows")
                            continue
                        try:
                            rows.append(bench_cpu(policy, B, n, mode, reps, budget, net))
                            _print_row(rows[-1])
                        except Exception as err:  # noqa: BLE001 - keep going: report what failed
                            errors.append(
                                f"rayzero cpu-{mode} {net} {policy} B={B} n={n}: {type(err).__name__}: {err}"
                            )
    finally:
        torch.set_num_threads(threads)
    return rows, errors


def cpu_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """numba vs torch per (policy, B): speed-up, and the issue's bars (>= 250 K simulations/s at B = 32 and
    64, one root's search <= 0.5 ms, B = 256 / 1024 no slower than torch)."""
    out = []
    for r in rows:
        if r["mode"] != "cpu-numba":
            continue
        peer = next(
            (
                t
                for t in rows
                if t["mode"] == "cpu-torch"
                and all(t[k] == r[k] for k in ("net", "policy", "batch", "num_simulations"))
            ),
            None,
        )
        entry = {
            "net": r["net"],
            "policy": r["policy"],
            "batch": r["batch"],
            "num_simulations": r["num_simulations"],
            "numba_ms": r["ms_per_search"],
            "torch_ms": peer["ms_per_search"] if peer else None,
            "speedup": round(peer["ms_per_search"] / r["ms_per_search"], 2) if peer else None,
            "numba_simulations_per_s": r["simulations_per_s"],
            "numba_tree_only_simulations_per_s": r["tree_only_simulations_per_s"],
            "numba_tree_only_ms": r["tree_only_ms"],
            "numba_compiled_calls_ms": r.get("compiled_calls_ms"),
        }
        B = r["batch"]
        if r["num_simulations"] == 50 and B in (32, 64):
            entry["bar"] = ">= 250,000 simulations/s"
            entry["bar_met"] = r["simulations_per_s"] >= 250_000
        elif r["num_simulations"] == 50 and B == 1:
            entry["bar"] = "<= 0.5 ms per search"
            entry["bar_met"] = r["ms_per_search"] <= 0.5
            entry["bar_met_tree_only"] = r["tree_only_ms"] <= 0.5
            entry["bar_met_compiled_calls"] = r.get("compiled_calls_ms", float("inf")) <= 0.5
        elif r["num_simulations"] == 50 and B in (256, 1024) and peer:
            entry["bar"] = "no slower than torch"
            entry["bar_met"] = r["ms_per_search"] <= peer["ms_per_search"]
        out.append(entry)
    return out


def _row(impl: str, net: str, policy: str, B: int, n: int, mode: str, sec: float) -> dict[str, Any]:
    return {
        "impl": impl,
        "net": net,
        "policy": policy,
        "batch": B,
        "num_simulations": n,
        "num_actions": A,
        "mode": mode,
        "ms_per_search": round(sec * 1000.0, 4),
        "simulations_per_s": round(B * n / sec, 1),
    }


# -------------------------------------------------------------------------------------------- mctx


def _mctx_modules() -> tuple[Any, Any, Any] | None:
    try:
        import jax
        import jax.numpy as jnp
        import mctx
    except Exception:  # noqa: BLE001 - not installed, or broken
        return None
    return jax, jnp, mctx


def bench_mctx(
    net: str, policy: str, B: int, n: int, weights: dict, reps: int, budget_s: float
) -> dict[str, Any]:
    jax, jnp, mctx = _mctx_modules()  # type: ignore[misc]
    params = {k: jnp.asarray(v.numpy()) for k, v in weights.items()}

    def recurrent_fn(params, rng_key, action, emb):
        if net == "none":
            a = action.astype(jnp.float32)
            nxt = emb + 0.01 * a[:, None]
            value = jnp.sin(nxt[:, 0] * 3.0 + a)
            logits = jnp.cos(nxt[:, 1:2] + 0.3 * jnp.arange(A, dtype=jnp.float32))
            out = mctx.RecurrentFnOutput(
                reward=0.1 * value, discount=jnp.full_like(value, 0.99), prior_logits=logits, value=value
            )
            return out, nxt
        h = jax.nn.relu(jnp.concatenate([emb, jax.nn.one_hot(action, A)], 1) @ params["w1"])
        h = jax.nn.relu(h @ params["w2"])
        o = h @ params["w3"]
        out = mctx.RecurrentFnOutput(
            reward=o[:, 0],
            discount=jnp.full_like(o[:, 0], 0.99),
            prior_logits=o[:, 2:],
            value=jnp.tanh(o[:, 1]),
        )
        return out, h

    r = torch_root(net, B, torch.device("cpu"))
    root = mctx.RootFnOutput(
        prior_logits=jnp.asarray(r.prior_logits.numpy()),
        value=jnp.asarray(r.value.numpy()),
        embedding=jnp.asarray(r.embedding.numpy()),
    )
    if policy == "muzero":

        def run(params, key, root):
            return mctx.muzero_policy(
                params,
                key,
                root,
                recurrent_fn,
                num_simulations=n,
                dirichlet_fraction=0.25,
                dirichlet_alpha=0.3,
                pb_c_init=1.25,
                pb_c_base=19652.0,
                temperature=1.0,
            )
    else:

        def run(params, key, root):
            return mctx.gumbel_muzero_policy(
                params,
                key,
                root,
                recurrent_fn,
                num_simulations=n,
                max_num_considered_actions=16,
                gumbel_scale=1.0,
            )

    jitted = jax.jit(run)
    key = jax.random.PRNGKey(0)
    t0 = time.perf_counter()
    jax.block_until_ready(jitted(params, key, root))
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(jitted(params, key, root))
    times = []
    for i in range(reps):
        k = jax.random.fold_in(key, i)
        t0 = time.perf_counter()
        jax.block_until_ready(jitted(params, k, root))
        times.append(time.perf_counter() - t0)
        if sum(times) > budget_s:
            break
    row = _row("mctx", net, policy, B, n, "jit", sum(times) / len(times))
    row["compile_s"] = round(compile_s, 2)
    return row


def warm_up_compiled_tree() -> float:
    """Compile (first process on a machine) or load from numba's cache the compiled kernels, with a tiny
    search of each policy, virtual loss included, and one with a NumpyRecurrentFn; returns the seconds it
    took. Searches call the kernels
    lazily anyway: this only moves the one-off cost out of a timed region."""
    from rayzero.tree.base import RecurrentOutput, RootOutput, SearchConfig
    from rayzero.tree.search import search

    start = time.perf_counter()

    def fn(action: torch.Tensor, embedding: torch.Tensor):
        n = action.shape[0]
        out = RecurrentOutput(torch.zeros(n), torch.ones(n), torch.zeros(n, 2), torch.zeros(n))
        return out, embedding

    def numpy_fn(action: np.ndarray, embedding: np.ndarray):
        n = action.shape[0]
        zeros = np.zeros(n, np.float32)
        return RecurrentOutput(zeros, zeros + 1, np.zeros((n, 2), np.float32), zeros), embedding

    root = RootOutput(torch.zeros(1, 2), torch.zeros(1), torch.zeros(1, 1))
    for config in (
        SearchConfig(cpu_backend="numba"),
        SearchConfig(cpu_backend="numba", virtual_loss=2),
        SearchConfig(cpu_backend="numba", policy="gumbel"),
    ):
        search(root, fn, 2, config, invalid_actions=torch.tensor([[False, True]]))
    # _wave_arrays (NumpyRecurrentFn) for the bench's "table-numpy" embeddings, [B] int64
    search(root._replace(embedding=torch.zeros(1, dtype=torch.int64)), NumpyRecurrentFn(numpy_fn), 2)
    return time.perf_counter() - start


# -------------------------------------------------------------------------------------------- main


def _plan(quick: bool, cuda: bool) -> tuple[list[tuple], list[tuple]]:
    """(ours, mctx) row keys: (net, policy, B, n, mode) and (net, policy, B, n); on the device of the run
    (CPU rows of the compiled tree and the torch path come from `cpu_rows`)."""
    nets, policies = ("none", "mlp256"), ("muzero", "gumbel")
    modes = ("eager", "graph") if cuda else ("eager",)
    if quick:
        ours = [(net, p, B, 10, m) for net in nets for p in policies for B in (1, 16) for m in modes]
        theirs = [(net, p, B, 10) for net in nets for p in policies for B in (1, 16)]
        if not cuda:
            ours = [o for o in ours if o[0] != "none"]
        return ours, theirs
    ours = []
    for net in nets:
        for p in policies:
            for B in (1, 256, 1024, 4096):
                for n in (50, 200):
                    if B == 4096 and n == 200 and not (net == "none" and p == "muzero"):
                        continue
                    if not cuda and B * n > 256 * 50:  # the CPU full run keeps to moderate sizes
                        continue
                    for m in modes:
                        ours.append((net, p, B, n, m))
    theirs = [(net, p, B, 50) for net in nets for p in policies for B in (1, 1024, 4096)]
    theirs.append(("mlp256", "muzero", 1024, 200))
    if not cuda:
        theirs = [t for t in theirs if t[2] * t[3] <= 256 * 50]
        ours = [o for o in ours if o[0] != "none"]  # the CPU rows time net "none" on one core, both backends
    return ours, theirs


def main(
    quick: bool = False, json_path: str | None = None, cpu_only: bool = False,
    nets: tuple[str, ...] = CPU_NETS, batches: tuple[int, ...] | None = None, modes: tuple[str, ...] = CPU_MODES,
) -> dict[str, Any]:
    """Run the benchmark, print a table, write JSON to json_path (if given); returns the report.
    cpu_only: only the CPU rows (compiled tree against the torch path, one core); nets, batches, modes: a
    subset of the CPU rows."""
    load_before = os.getloadavg()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    weights = _weights()
    reps, budget = (3, 2.0) if quick else (10, 4.0)
    ours_plan, mctx_plan = _plan(quick, cuda) if not cpu_only else ([], [])
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    for net, p, B, n, m in ours_plan:
        try:
            rows.append(bench_ours(net, p, B, n, m, device, weights, reps, budget))
            _print_row(rows[-1])
        except Exception as err:  # noqa: BLE001 - keep going: report what failed
            errors.append(f"rayzero {net} {p} B={B} n={n} {m}: {type(err).__name__}: {err}")
    cpu, cpu_errors = cpu_rows(quick, nets, batches, modes)
    rows.extend(cpu)
    errors.extend(cpu_errors)
    if cpu_only:
        pass
    elif _mctx_modules() is not None:
        for net, p, B, n in mctx_plan:
            try:
                rows.append(bench_mctx(net, p, B, n, weights, reps, budget))
                _print_row(rows[-1])
            except Exception as err:  # noqa: BLE001
                errors.append(f"mctx {net} {p} B={B} n={n}: {type(err).__name__}: {err}")
    else:
        errors.append("mctx/jax not importable: no mctx rows")
    ratios = _ratios(rows)
    summary = cpu_summary(rows)
    _print_table(rows, ratios, errors)
    _print_cpu_summary(summary)
    return write_json(json_path, "tree", {
        "quick": quick, "cpu_only": cpu_only, "device": str(device), "torch_threads": torch.get_num_threads(),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "rows": rows, "ratios": ratios, "cpu_summary": summary, "errors": errors,
    })


def _ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ours / mctx ms-per-search ratio (< 1 = we are faster) for every mctx row, eager and graph."""
    out = []
    for r in rows:
        if r["impl"] != "mctx":
            continue
        for ours in rows:
            if ours["impl"] == "rayzero" and all(
                ours[k] == r[k] for k in ("net", "policy", "batch", "num_simulations")
            ):
                out.append(
                    {
                        "net": r["net"],
                        "policy": r["policy"],
                        "batch": r["batch"],
                        "num_simulations": r["num_simulations"],
                        "mode": ours["mode"],
                        "ours_ms": ours["ms_per_search"],
                        "mctx_ms": r["ms_per_search"],
                        "ours_over_mctx": round(ours["ms_per_search"] / r["ms_per_search"], 3),
                    }
                )
    return out


_HEADER = (
    f"{'impl':8} {'net':11} {'policy':7} {'B':>5} {'sims':>5} {'mode':9} {'ms/search':>10} {'sims/s':>12}"
    f" {'fn ms':>8} {'tree-only sims/s':>17}"
)


def _print_row(r: dict[str, Any]) -> None:
    extra = ""
    if "tree_only_simulations_per_s" in r:
        extra = f" {r['recurrent_fn_ms']:8.3f} {r['tree_only_simulations_per_s']:17.0f}"
    print(
        f"{r['impl']:8} {r['net']:11} {r['policy']:7} {r['batch']:5d} {r['num_simulations']:5d} {r['mode']:9} "
        f"{r['ms_per_search']:10.3f} {r['simulations_per_s']:12.0f}{extra}",
        flush=True,
    )


def _print_cpu_summary(summary: list[dict[str, Any]]) -> None:
    if not summary:
        return
    print("\ncompiled CPU tree (numba) vs torch CPU path, one core (ms per search, median)")
    for e in summary:
        torch_ms = f"{e['torch_ms']:9.3f}" if e["torch_ms"] is not None else "        -"
        speed = f"{e['speedup']:6.1f}x" if e["speedup"] is not None else "      -"
        bar = ""
        if "bar" in e:
            bar = f"  bar {e['bar']}: {'met' if e['bar_met'] else 'NOT met'}"
            if "bar_met_tree_only" in e:
                bar += f" (tree only: {'met' if e['bar_met_tree_only'] else 'NOT met'}"
                bar += f"; compiled calls {e['numba_compiled_calls_ms']:.3f} ms)"
        print(
            f"  {e['net']:11} {e['policy']:7} B={e['batch']:5d} numba {e['numba_ms']:9.3f} torch {torch_ms} {speed} "
            f"{e['numba_simulations_per_s']:11.0f} sims/s{bar}"
        )


def _print_table(rows: list[dict[str, Any]], ratios: list[dict[str, Any]], errors: list[str]) -> None:
    print()
    print(_HEADER)
    for r in rows:
        _print_row(r)
    if ratios:
        print("\nours / mctx (ms per search; < 1 = faster)")
        for q in ratios:
            print(
                f"  {q['net']:7} {q['policy']:7} B={q['batch']:5d} n={q['num_simulations']:4d} {q['mode']:6} "
                f"{q['ours_ms']:9.3f} / {q['mctx_ms']:9.3f} = {q['ours_over_mctx']:.3f}"
            )
    for e in errors:
        print("error:", e, file=sys.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--cpu-only", action="store_true", help="only the CPU rows (compiled tree vs torch path)")
    parser.add_argument("--nets", default=",".join(CPU_NETS), help="CPU rows: recurrent_fns (none,table,table-numpy)")
    parser.add_argument("--batches", default="", help="CPU rows: batch sizes, e.g. 1,256 (default: all)")
    parser.add_argument("--modes", default=",".join(CPU_MODES), help="CPU rows: numba,torch")
    args = parser.parse_args()
    main(
        quick=args.quick, json_path=args.json, cpu_only=args.cpu_only, nets=tuple(args.nets.split(",")),
        batches=tuple(int(b) for b in args.batches.split(",") if b), modes=tuple(args.modes.split(",")),
    )
