"""Does the policy learn beside the consistency loss on real Pong frames? A learner-only check, no self-play.

    python3 scripts/consistency_check.py [--device cpu|cuda] [--batch 32] [--steps 100] [--weights 2,0]
                                         [--envs 8] [--frames 200] [--compile] [learner.field=value ...]

Random-action Pong frames (the `atari` preset's env) with policy targets that depend on the frame: 0.7 on UP
when the ball is above the agent's paddle, else on DOWN. For each consistency weight it trains a fresh learner
of the preset (its model and learner sections, the overrides on top) and prints the policy and consistency
losses every tenth of the steps. Pong runs 2 and 5 (docs/benchmarks.md) left the policy uniform with the
consistency loss on; this separates the learner on Pong data from the rest of the loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from rayzero import config as config_lib
from rayzero.envs import make_vector_env
from rayzero.learner import Learner
from rayzero.replay import ReplayBuffer, Segment


def frames(cfg, envs: int, steps: int, seed: int = 0):
    """[steps, envs, *obs] observations, actions and rewards of random play."""
    env = make_vector_env(cfg.env, envs, seed=seed, training=True)
    obs, rng = env.reset(seed=seed), np.random.default_rng(seed)
    out_obs, out_act, out_rew = [], [], []
    for _ in range(steps):
        action = rng.integers(0, env.spec.num_actions, size=envs)
        out_obs.append(np.asarray(obs))
        out_act.append(action)
        result = env.step(action)
        obs = result.obs
        out_rew.append(np.asarray(result.reward, np.float32))
    env.close()
    return np.stack(out_obs), np.stack(out_act), np.stack(out_rew), env.spec.num_actions


def up_or_down(obs: np.ndarray) -> np.ndarray:
    """[..., 12, 96, 96] RGB stacks -> 2 (UP) where the ball is above the agent's (green, right) paddle, else 3."""
    newest = obs[..., -3:, :, :].astype(np.int32)
    red, green, blue = newest[..., 0, :, :], newest[..., 1, :, :], newest[..., 2, :, :]
    paddle = ((green > 150) & (red < 130))[..., 16:90, 83:87].any(-1)
    ball = ((red > 200) & (green > 200) & (blue > 200))[..., 16:88, 5:83].any(-1)
    paddle_y = np.where(paddle.any(-1), (paddle * np.arange(74)).sum(-1) / np.maximum(paddle.sum(-1), 1), 37) + 16
    ball_y = np.where(ball.any(-1), (ball * np.arange(72)).sum(-1) / np.maximum(ball.sum(-1), 1), 36) + 16
    return np.where(ball_y < paddle_y, 2, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--weights", default="2,0")
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--frames", type=int, default=200)
    parser.add_argument("--compile", action="store_true", help="torch.compile the loss (default: eager)")
    parser.add_argument("overrides", nargs="*", help="learner.field=value")
    args = parser.parse_args()
    cfg = config_lib.load("atari", list(args.overrides))
    obs, actions, rewards, num_actions = frames(cfg, args.envs, args.frames)
    targets = up_or_down(obs)
    print(f"{obs.shape[0] * obs.shape[1]} positions, UP share {np.mean(targets == 2):.2f}", flush=True)
    replay = ReplayBuffer(dataclasses.replace(cfg.replay, capacity=obs.shape[0] * obs.shape[1] + 10, min_size=0,
                                              next_obs=True, frame_stack=1, shared_obs=False), 0)
    for e in range(obs.shape[1]):
        policy = np.full((obs.shape[0], num_actions), 0.3 / (num_actions - 1), np.float32)
        policy[np.arange(obs.shape[0]), targets[:, e]] = 0.7
        replay.add(Segment(obs=obs[:, e], actions=actions[:, e], rewards=rewards[:, e], policies=policy,
                           root_values=np.zeros(obs.shape[0], np.float32), num_sampleable=obs.shape[0],
                           terminal=False, bootstrap_value=0.0))
    for weight in (float(w) for w in args.weights.split(",")):
        learner_cfg = dataclasses.replace(cfg.learner, device=args.device, compile=args.compile,
                                          batch_size=args.batch, consistency_weight=weight)
        learner = Learner(cfg.model, learner_cfg, obs.shape[2:], num_actions, seed=0)
        start, row = time.time(), []
        for step in range(args.steps + 1):
            metrics, _ = learner.step(replay.sample(args.batch))
            if step % max(1, args.steps // 10) == 0:
                row.append(f"{step}: {metrics['policy_loss']:.3f}/{metrics['consistency_loss']:.3f}")
        print(f"weight {weight}: policy/consistency loss by step  " + "  ".join(row)
              + f"  ({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
