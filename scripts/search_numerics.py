"""Do the inference actor's whole searches compute the same targets with the compiled recurrent step as without?

The atari preset runs self-play's and reanalyse's searches with `inference.compile_recurrent` (inductor's kernels
for the network's recurrent step, inside the captured searches) under a bf16 autocast. This takes one set of
weights (a run's checkpoint, or the preset's fresh network) into four inference runners (runner.py), identical
but for the step and the precision, and gives each the same roots, seed and noise:

- `eager fp32`: the reference; `eager bf16`: what the actor did before compile_recurrent;
- `compiled bf16`: the preset; `compiled fp32`: the compile alone.

The roots are the training env's observations, played by the reference's actions (so positions the agent
reaches). For every variant it prints, against the reference, the mean KL of its search policy (the target the
learner trains on), the mean |root value| difference, how often the played action differs, and the same for
the network's own outputs (the initial step, then `--unroll` recurrent steps on the played actions). If the
compiled bf16 runner is as far from fp32 as the eager bf16 runner is, compiling changes nothing bf16 does not.

    python3 scripts/search_numerics.py [--checkpoint RUN_DIR] [--envs 32] [--steps 200] [--every 10] \
        [--unroll 5] [--device cuda] [--json PATH] [section.field=value ...]

On a CPU the runners are eager and fp32 whatever their setting (runner.py), so only `compiled fp32` differs
there: a quick check that the script runs.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import time

import numpy as np
import torch

from rayzero import config as config_lib
from rayzero.bench.common import write_json
from rayzero.envs import make_vector_env
from rayzero.inference.runner import Runner
from rayzero.learner import checkpoint as ckpt
from rayzero.learner import load_model_weights
from rayzero.models import build_model

VARIANTS = {  # name: (compile_recurrent, bf16)
    "eager fp32": (False, False),
    "eager bf16": (False, True),
    "compiled bf16": (True, True),
    "compiled fp32": (True, False),
}
REFERENCE = "eager fp32"


def kl(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """KL(p || q) per row of two [n, A] distributions (zeros kept out of the log)."""
    p, q = np.clip(p, 1e-8, 1.0), np.clip(q, 1e-8, 1.0)
    return (p * (np.log(p) - np.log(q))).sum(-1)


def log_softmax(x: torch.Tensor) -> np.ndarray:
    return torch.log_softmax(x.float(), -1).cpu().numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="a run or checkpoint directory (default: the preset's fresh network)")
    parser.add_argument("--preset", default="atari")
    parser.add_argument("--envs", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=10, help="compare the variants every this many env steps")
    parser.add_argument("--unroll", type=int, default=5, help="recurrent steps of the network comparison")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    parser.add_argument("overrides", nargs="*", help="section.field=value over the config")
    args = parser.parse_args()
    if args.checkpoint:
        checkpoint = ckpt.latest(args.checkpoint, files=(ckpt.MODEL,))
        path = next(p / "config.yaml" for p in (checkpoint, *checkpoint.parents) if (p / "config.yaml").exists())
        cfg = config_lib.load(str(path), list(args.overrides))
    else:
        checkpoint, cfg = None, config_lib.load(args.preset, list(args.overrides))
    env = make_vector_env(cfg.env, args.envs, args.seed, training=True)
    spec = env.spec
    model = build_model(cfg.model, spec.observation_shape, spec.num_actions)
    if checkpoint is not None:
        load_model_weights(model, checkpoint)
    model = model.to(args.device).eval()
    bucket = args.envs
    runners = {}
    for name, (compiled, bf16) in VARIANTS.items():
        inf = dataclasses.replace(cfg.inference, device=args.device, max_batch=bucket, min_bucket=bucket,
                                  search_max_batch=bucket, latent_pool_size=bucket, cache_size=0,
                                  merge_searches=False, compile_recurrent=compiled, bf16=bf16)
        runners[name] = Runner(copy.deepcopy(model), inf, spec.observation_shape, spec.observation_dtype,
                               spec.num_actions, [bucket], cfg.search, cfg.replay.discount, seed=args.seed)
    search = {name: {"kl": [], "value": [], "action": []} for name in VARIANTS}
    net = {name: {"kl": [[] for _ in range(args.unroll + 1)], "value": [[] for _ in range(args.unroll + 1)]}
           for name in VARIANTS}
    start = time.time()
    obs = env.reset(seed=args.seed)
    rng = np.random.default_rng(args.seed)
    try:
        for step in range(args.steps):
            outputs = {}
            for name, runner in runners.items():
                if name != REFERENCE and step % args.every:
                    continue
                runner.generator.manual_seed(args.seed + step)  # the same noise in every variant's search
                outputs[name] = runner.wait(runner.launch_search([obs], None, cfg.search))
                outputs[name] = {k: np.array(v) for k, v in outputs[name].items()}
            ref = outputs[REFERENCE]
            if step % args.every == 0:
                for name, out in outputs.items():
                    search[name]["kl"].append(kl(ref["action_weights"], out["action_weights"]))
                    search[name]["value"].append(np.abs(ref["root_value"] - out["root_value"]))
                    search[name]["action"].append(ref["action"] != out["action"])
                actions = torch.as_tensor(rng.integers(0, spec.num_actions, (args.unroll, len(obs))),
                                          device=args.device)
                unrolled = {}
                for name, runner in runners.items():
                    with torch.no_grad(), runner.autocast():
                        o = runner.model.initial(torch.as_tensor(obs, device=args.device))
                        rows = [(log_softmax(o.policy_logits), o.value.float().cpu().numpy())]
                        latent = o.latent
                        for k in range(args.unroll):
                            o = runner._recurrent(latent, actions[k])
                            latent = o.latent
                            rows.append((log_softmax(o.policy_logits), o.value.float().cpu().numpy()))
                    unrolled[name] = rows
                for name, rows in unrolled.items():
                    for k, (logp, value) in enumerate(rows):
                        ref_logp, ref_value = unrolled[REFERENCE][k]
                        net[name]["kl"][k].append((np.exp(ref_logp) * (ref_logp - logp)).sum(-1))
                        net[name]["value"][k].append(np.abs(ref_value - value).reshape(-1))
            obs = env.step(ref["action"]).obs
    finally:
        env.close()
    rows = {}
    print(f"{args.steps} steps of {args.envs} envs ({time.time() - start:.0f} s) on {args.device}, "
          f"{cfg.search.num_simulations} simulations, weights: {checkpoint or 'fresh'}; against {REFERENCE}:")
    print(f"  {'variant':14s} {'search KL':>10s} {'|value|':>8s} {'action differs':>15s}   "
          f"network KL / |value| at unroll 0..{args.unroll}")
    for name in VARIANTS:
        s = {k: float(np.concatenate(v).mean()) for k, v in search[name].items()}
        n_kl = [float(np.concatenate(v).mean()) for v in net[name]["kl"]]
        n_value = [float(np.concatenate(v).mean()) for v in net[name]["value"]]
        rows[name] = {"search_kl": s["kl"], "search_value_abs": s["value"], "action_differs": s["action"],
                      "network_kl": n_kl, "network_value_abs": n_value}
        print(f"  {name:14s} {s['kl']:10.5f} {s['value']:8.4f} {s['action']:15.3f}   "
              + " ".join(f"{a:.4f}/{b:.3f}" for a, b in zip(n_kl, n_value)))
    if args.json:
        write_json(args.json, "search_numerics", {"checkpoint": str(checkpoint), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
