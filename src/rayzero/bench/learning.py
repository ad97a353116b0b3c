"""Learning benchmark: the `cartpole` preset on several seeds, through the real CLI and a local Ray.

Reports, per seed, the wall-clock seconds until the first greedy 10-episode evaluation reached the
threshold (195), the env and learner steps at that point, and whether it got there inside the time limit.
Writes the curves of all seeds into one plot.

    rayzero bench learning [--quick] [--json PATH]       # seeds 0, 1, 2; --quick: one seed, 120 s
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rayzero.bench.common import write_json

THRESHOLD = 195.0


def run_seed(seed: int, out: Path, time_limit: float) -> dict[str, Any]:
    command = [sys.executable, "-m", "rayzero", "train", "--config", "cartpole", "--seed", str(seed),
               "--out", str(out), "--time-limit", str(time_limit)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in open(out / "metrics.jsonl") if line.strip()]
    evals = [r for r in rows if "eval_return_mean" in r]
    first = next((r for r in evals if r["eval_return_mean"] >= THRESHOLD and r["eval_episodes"] == 10), None)
    return {
        "seed": seed,
        "reached": first is not None,
        "seconds_to_threshold": first["wall_seconds"] if first else None,
        "env_steps_to_threshold": first["env_steps"] if first else None,
        "learner_steps_to_threshold": first["learner_steps"] if first else None,
        "final_eval_mean": summary["eval_return_mean"],
        "final_eval_std": summary["eval_return_std"],
        "evals": [(r["wall_seconds"], r["env_steps"], r["eval_return_mean"]) for r in evals],
    }


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot([e[0] for e in r["evals"]], [e[2] for e in r["evals"]], marker="o", label=f"seed {r['seed']}")
    ax.axhline(THRESHOLD, color="gray", linestyle="--", label="195")
    ax.set_xlabel("wall seconds (2 CPU cores)")
    ax.set_ylabel("greedy eval return (10 episodes)")
    ax.set_title("rayzero cartpole preset")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(quick: bool = False, json_path: str | None = None, seeds: tuple[int, ...] = (0, 1, 2),
         plot_path: str | None = None) -> dict[str, Any]:
    time_limit = 120.0 if quick else 600.0
    seeds = seeds[:1] if quick else seeds
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            result = run_seed(seed, Path(tmp) / f"seed{seed}", time_limit)
            results.append(result)
            reached = f"{result['seconds_to_threshold']:.0f} s" if result["reached"] else "not reached"
            print(f"seed {seed}: 195 {reached}; final eval {result['final_eval_mean']:.1f} ± "
                  f"{result['final_eval_std']:.1f}", flush=True)
    print(f"{sum(r['reached'] for r in results)}/{len(results)} seeds reached {THRESHOLD} within {time_limit:.0f} s")
    if plot_path:
        plot(results, Path(plot_path))
    return write_json(json_path, "learning", {"time_limit": time_limit, "threshold": THRESHOLD, "seeds": results})


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    args = parser.parse_args()
    main(args.quick, args.json, tuple(args.seeds), args.plot)
