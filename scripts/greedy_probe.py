"""What a trained agent's greedy evaluation plays: which actions, where it waits, and how often its top visit counts
tie. A probe for the Atari-learns issue (docs/benchmarks.md, twenty-fifth session: Breakout's games that never
served, the greedy tie-break).

    python3 scripts/greedy_probe.py --checkpoint RUN_DIR [--envs 6] [--steps 800] [--wait 200]
                                    [--device cpu|cuda] [--json probe.json] [section.field=value ...]

It plays `--steps` greedy steps (the evaluation's search: run.eval_simulations, no noise) in `--envs` evaluation
envs with the checkpoint's agent (its config, the overrides on top), and counts, over the decisions of envs still
playing:
- the actions played, apart for positions more than `--wait` steps after the env's last reward ("waiting": a
  Breakout agent that does not serve), with the mean prior and visits of each action there;
- how often the most visited actions tie, and how often the highest Q among them is not the lowest index (the
  two tie-break rules).
It prints a short table and writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import torch

from rayzero import config as config_lib
from rayzero.actors.evaluate import greedy
from rayzero.actors.network import LocalNetwork, search_observations
from rayzero.envs import make_vector_env
from rayzero.learner import checkpoint as ckpt
from rayzero.learner import load_model_weights
from rayzero.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="run directory or checkpoint directory")
    parser.add_argument("--envs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--wait", type=int, default=200, help="steps without a reward that count as waiting")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("overrides", nargs="*", help="section.field=value over the run's config")
    args = parser.parse_args()
    checkpoint = ckpt.latest(args.checkpoint, files=(ckpt.MODEL,))
    config_path = next(p / "config.yaml" for p in (checkpoint, *checkpoint.parents) if (p / "config.yaml").exists())
    cfg = config_lib.load(str(config_path), list(args.overrides))
    env = make_vector_env(cfg.env, args.envs, args.seed, training=False)
    spec = env.spec
    A = spec.num_actions
    model = build_model(cfg.model, spec.observation_shape, A).to(args.device)
    load_model_weights(model, checkpoint)
    network = LocalNetwork(model, cfg.replay.discount)
    search_cfg = greedy(cfg.eval_search)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    names = list(spec.action_meanings or [str(a) for a in range(A)])
    counts = {kind: np.zeros(A, dtype=np.int64) for kind in ("waiting", "playing")}
    prior_sum, visit_sum = np.zeros(A), np.zeros(A)
    decisions = ties = differ = 0
    since = np.zeros(args.envs, dtype=np.int64)
    done = np.zeros(args.envs, dtype=bool)
    start = time.time()
    obs = env.reset(seed=args.seed)
    try:
        for _ in range(args.steps):
            out = search_observations(network, obs, search_cfg, generator)
            prior = network.root(obs).prior_logits.float().softmax(-1).cpu().numpy()
            network.release()
            visits = out.visit_counts.cpu().numpy()
            q = out.qvalues.float().cpu().numpy()
            result = env.step(out.action.cpu().numpy())
            top = visits == visits.max(-1, keepdims=True)
            lowest, best_q = top.argmax(-1), np.where(top, q, -np.inf).argmax(-1)
            for b in np.flatnonzero(~done):
                waiting = since[b] > args.wait
                counts["waiting" if waiting else "playing"][result.actions[b]] += 1
                if waiting:
                    prior_sum += prior[b]
                    visit_sum += visits[b]
                decisions += 1
                ties += int(top[b].sum() > 1)
                differ += int(lowest[b] != best_q[b])
            since = np.where(result.reward != 0, 0, since + 1)
            done |= result.terminated | result.truncated
            obs = result.obs
            if done.all():
                break
    finally:
        env.close()
    waited = int(counts["waiting"].sum())
    summary = {
        "decisions": decisions, "waiting_decisions": waited,
        "actions_waiting": dict(zip(names, counts["waiting"].tolist())),
        "actions_playing": dict(zip(names, counts["playing"].tolist())),
        "prior_waiting": dict(zip(names, (prior_sum / max(waited, 1)).round(3).tolist())),
        "visits_waiting": dict(zip(names, (visit_sum / max(waited, 1)).round(2).tolist())),
        "top_visits_tied": ties / max(decisions, 1),
        "q_tiebreak_differs": differ / max(decisions, 1),
    }
    print(f"{decisions} greedy decisions from {checkpoint} ({time.time() - start:.0f} s), "
          f"{search_cfg.num_simulations} simulations; {waited} more than {args.wait} steps after a reward")
    print(f"  {'action':12s} {'played':>8s} {'waiting':>8s} {'prior w.':>9s} {'visits w.':>10s}")
    for a, name in enumerate(names):
        print(f"  {name:12s} {counts['playing'][a]:8d} {counts['waiting'][a]:8d} "
              f"{prior_sum[a] / max(waited, 1):9.3f} {visit_sum[a] / max(waited, 1):10.2f}")
    print(f"  top visit counts tied: {summary['top_visits_tied']:.3f}; the higher Q among them is not the lowest "
          f"index: {summary['q_tiebreak_differs']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"checkpoint": str(checkpoint), "overrides": args.overrides, "summary": summary,
                       "machine": platform.node(), "torch": torch.__version__,
                       "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}, f, indent=1)


if __name__ == "__main__":
    main()
