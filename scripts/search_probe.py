"""What the search sees in a trained agent: the Q gaps at the root against the tree's normalisation range, and how
much of the policy target the root noise decides. A probe for the Atari-learns issue (docs/benchmarks.md).

    python3 scripts/search_probe.py --checkpoint RUN_DIR [--envs 8] [--steps 400] [--every 10]
                                    [--device cpu|cuda] [--json probe.json] [section.field=value ...]

It plays `--steps` steps in `--envs` envs with the checkpoint's agent (its env, model and search sections, the
overrides on top), acting as self-play does (root noise, the preset's temperature), and every `--every` steps
searches the same roots twice more: once with the noise and once without. Per position it records:
- the entropies of the prior, of the target with noise and of the target without;
- the spread of the root children's Q (max - min over visited children, noise-free search) and the tree's min-max
  range that normalises Q, and their ratio: the share of [0, 1] that the root's gaps span;
- whether the noisy and the noise-free searches pick the same most-visited action, and the L1 distance between
  their targets: how much of a target the noise decides;
- the largest |reward| predicted for a root child, and the root value.
With `--against section.field=value ...` (say `search.virtual_loss=8`) it also searches every probed batch with
that variant of the search, from the same root noise (the generator replayed), and records how far the variant's
targets are from the run's, with noise and without (`against_*`: same most-visited action, L1 distance), beside
how far two of the run's own noisy targets of the same roots are apart (`resample_*`: fresh noise): a search
change that moves a target less than the noise does is unlikely to change what the learner sees.
It prints the means (and the 10th / 50th / 90th percentiles of the spreads) and writes them as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time

import numpy as np
import torch

from rayzero import config as config_lib
from rayzero.actors.network import LocalNetwork, search_observations
from rayzero.envs import make_vector_env
from rayzero.learner import checkpoint as ckpt
from rayzero.learner import load_model_weights
from rayzero.models import build_model


def entropy(p: torch.Tensor) -> torch.Tensor:
    p = p.float()
    return -(p * p.clamp_min(1e-12).log()).sum(-1)


def _compare(a, b, name: str) -> dict:
    """Same most-visited action and the L1 distance between two searches' targets, [B] each."""
    return {f"{name}_same_argmax": (a.visit_counts.argmax(-1) == b.visit_counts.argmax(-1)).float(),
            f"{name}_target_l1": (a.action_weights.float() - b.action_weights.float()).abs().sum(-1)}


def probe(network: LocalNetwork, obs: np.ndarray, noisy_cfg, clean_cfg, generator: torch.Generator,
          against: tuple | None = None) -> dict:
    """[B] measurements of one batch of roots (see the module docstring); `against`: the variant's (noisy, clean)
    search configs."""
    state = generator.get_state()
    noisy = search_observations(network, obs, noisy_cfg, generator)
    extra = {}
    if against is not None:
        after = generator.get_state()
        generator.set_state(state)  # the variant draws the same root noise
        variant_noisy = search_observations(network, obs, against[0], generator)
        generator.set_state(after)
        variant_clean = search_observations(network, obs, against[1], generator)
        resample = search_observations(network, obs, noisy_cfg, generator)
        extra = {**_compare(noisy, variant_noisy, "against_noise"), **_compare(noisy, resample, "resample_noise")}
    clean = search_observations(network, obs, clean_cfg, generator)
    if against is not None:
        extra.update(_compare(clean, variant_clean, "against_clean"))
    root = network.root(obs)
    network.release()
    visited = clean.visit_counts > 0
    q = clean.qvalues.float()
    q_hi = torch.where(visited, q, -torch.inf).amax(-1)
    q_lo = torch.where(visited, q, torch.inf).amin(-1)
    spread = torch.where(visited.sum(-1) > 1, q_hi - q_lo, 0.0)
    tree_range = (clean.tree.value_max - clean.tree.value_min).float()
    out = {
        "prior_entropy": entropy(root.prior_logits.float().softmax(-1)),
        "target_entropy_noise": entropy(noisy.action_weights),
        "target_entropy_clean": entropy(clean.action_weights),
        "root_q_spread": spread,
        "tree_q_range": tree_range,
        "spread_share": spread / tree_range.clamp_min(1e-8),
        "same_argmax": (noisy.visit_counts.argmax(-1) == clean.visit_counts.argmax(-1)).float(),
        "target_l1": (noisy.action_weights.float() - clean.action_weights.float()).abs().sum(-1),
        "root_value": clean.root_value.float(),
    }
    child_reward = clean.tree.children_rewards[:, 0].float()  # [B, A] rewards into the root's children
    out["max_child_abs_reward"] = torch.where(visited, child_reward.abs(), 0.0).amax(-1)
    out.update(extra)
    return {k: v.cpu().numpy() for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="run directory or checkpoint directory")
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--against", nargs="+", default=None, metavar="SECTION.FIELD=VALUE",
                        help="a variant of the search to compare every probed batch with (e.g. search.virtual_loss=8)")
    parser.add_argument("overrides", nargs="*", help="section.field=value over the run's config")
    args = parser.parse_args()
    checkpoint = ckpt.latest(args.checkpoint, files=(ckpt.MODEL,))  # the weights are all it searches with
    config_path = next(p / "config.yaml" for p in (checkpoint, *checkpoint.parents) if (p / "config.yaml").exists())
    cfg = config_lib.load(str(config_path), list(args.overrides))
    variant = config_lib.load(str(config_path), [*args.overrides, *args.against]).search if args.against else None
    env = make_vector_env(cfg.env, args.envs, args.seed, training=True)
    spec = env.spec
    model = build_model(cfg.model, spec.observation_shape, spec.num_actions).to(args.device)
    load_model_weights(model, checkpoint)
    network = LocalNetwork(model, cfg.replay.discount)
    temperature = cfg.run.temperature_schedule[-1][1] if cfg.run.temperature_schedule else cfg.search.temperature
    noisy_cfg = dataclasses.replace(cfg.search, temperature=temperature)
    clean_cfg = dataclasses.replace(cfg.search, temperature=0.0, dirichlet_fraction=0.0, gumbel_scale=0.0)
    against = None if variant is None else (
        dataclasses.replace(variant, temperature=temperature),
        dataclasses.replace(variant, temperature=0.0, dirichlet_fraction=0.0, gumbel_scale=0.0))
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    rows: dict[str, list[np.ndarray]] = {}
    start = time.time()
    obs = env.reset(seed=args.seed)
    try:
        for step in range(args.steps):
            if step % args.every == 0:
                for key, value in probe(network, obs, noisy_cfg, clean_cfg, generator, against).items():
                    rows.setdefault(key, []).append(value)
            action = search_observations(network, obs, noisy_cfg, generator).action.cpu().numpy()
            obs = env.step(action).obs
    finally:
        env.close()
    summary = {key: float(np.concatenate(values).mean()) for key, values in rows.items()}
    for key in ("root_q_spread", "tree_q_range", "spread_share"):
        summary[key + "_p10_p50_p90"] = [float(x) for x in np.percentile(np.concatenate(rows[key]), [10, 50, 90])]
    positions = int(sum(len(v) for v in rows["root_value"]))
    print(f"{positions} positions from {checkpoint} ({time.time() - start:.0f} s); uniform prior entropy "
          f"{np.log(spec.num_actions):.3f}")
    for key, value in summary.items():
        print(f"  {key:32s} {value if isinstance(value, list) else round(value, 4)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"checkpoint": str(checkpoint), "positions": positions, "summary": summary,
                       "overrides": list(args.overrides), "against": args.against,
                       "machine": platform.node(), "torch": torch.__version__,
                       "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}, f, indent=1)


if __name__ == "__main__":
    main()
