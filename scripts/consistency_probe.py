"""Does the consistency loss train on Pong frames? The `atari` preset's learner with the consistency loss on,
on frames of random Pong play, for a few hundred updates: the consistency cosine, the gradient norm and the
reward and value losses every few steps.

Why: in Pong runs 2 and 10 (RGB 96x96, target network, on the H200, compiled, bf16) the cosine stayed at
-0.01 and the gradient norm started at 80-90; in run 5 (grayscale 64x64, no target network) it reached -0.88
with a starting norm of 3.8. On the CPU (eager, fp32 or bf16 autocast) the RGB preset trains it (-0.77 after
200 updates at batch 32, norm 4.5). This script repeats that on a GPU, eager and compiled.

    python3 scripts/consistency_probe.py [--device cuda] [--compile] [--batch 256] [--steps 150] [--consistency W]
                                         [overrides ...]

Also a quick stability check of other learner settings on real frames (e.g. `--consistency 0
learner.optimizer=sgd learner.lr=0.2`).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from rayzero import config as config_mod
from rayzero.envs import make_vector_env
from rayzero.learner.learner import METRIC_NAMES, Learner
from rayzero.replay.buffer import ReplayBuffer, Segment


def set_torch_config(setting: str) -> None:
    """'inductor.a.b=VALUE' sets torch._inductor.config.a.b (functorch.x: torch._functorch.config, dynamo.x:
    torch._dynamo.config); VALUE is a Python literal. A name the config does not have is an error."""
    import ast
    import importlib

    path, _, text = setting.partition("=")
    root, *names = path.split(".")
    modules = {"inductor": "torch._inductor.config", "functorch": "torch._functorch.config",
               "dynamo": "torch._dynamo.config"}
    if root not in modules or not names or not text:
        raise SystemExit(f"--torch-config {setting!r}: expected MODULE.NAME=VALUE with MODULE one of {sorted(modules)}")
    target = importlib.import_module(modules[root])
    for name in names[:-1]:
        target = getattr(target, name)
    if not hasattr(target, names[-1]):
        raise SystemExit(f"--torch-config {setting!r}: {modules[root]} has no setting {'.'.join(names)!r}")
    setattr(target, names[-1], ast.literal_eval(text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--consistency", type=float, default=2.0, help="learner.consistency_weight (0: off)")
    parser.add_argument("--path", choices=("direct", "cache"), default="direct",
                        help="direct: batches with observations attached (stacked, no shared memory); cache: a run's "
                             "path, frames in shared memory (replay.frame_stack=4) gathered by the learner's Staging "
                             "through its device observation cache")
    parser.add_argument("--frames", choices=("pong", "noise"), default="pong",
                        help="pong: frames of random Pong play; noise: uniform random frames of the same shape "
                             "(what test_compiled_consistency_step_follows_the_eager_one_at_the_atari_size feeds)")
    parser.add_argument("--torch-config", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="a compiler setting before the first step, e.g. inductor.split_reductions=False, "
                             "inductor.triton.persistent_reductions=False, functorch.donated_buffer=False "
                             "(repeatable; scripts/device_bisect4.sh)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = config_mod.load("atari", [
        *args.overrides, f"learner.consistency_weight={args.consistency}", f"replay.next_obs={str(args.consistency > 0).lower()}",
        f"learner.device={args.device}",
        f"learner.batch_size={args.batch}", f"learner.compile={str(args.compile).lower()}",
        *(["replay.frame_stack=4", "replay.shared_obs=true"] if args.path == "cache" else
          ["replay.frame_stack=0", "replay.shared_obs=false"]),
        "replay.capacity=5000", "replay.min_size=100"])
    env = make_vector_env(cfg.env, 4, seed=0, training=True)
    obs = env.reset(seed=0)
    rng = np.random.default_rng(0)
    frames, actions, rewards = [], [], []
    for _ in range(600):
        action = rng.integers(0, env.spec.num_actions, size=4)
        frames.append(obs)
        actions.append(action)
        result = env.step(action)
        obs = result.obs
        rewards.append(result.reward)
    env.close()
    frames, actions, rewards = np.stack(frames, 1), np.stack(actions, 1), np.stack(rewards, 1).astype(np.float32)
    if args.frames == "noise":
        frames = rng.integers(0, 256, size=frames.shape, dtype=frames.dtype)
    num_actions = env.spec.num_actions
    replay = ReplayBuffer(cfg.replay, seed=0)
    for e in range(4):
        for s in range(0, 600, 100):
            replay.add(Segment(obs=frames[e, s:s + 100], actions=actions[e, s:s + 100], rewards=rewards[e, s:s + 100],
                               policies=np.full((100, num_actions), 1 / num_actions, np.float32),
                               root_values=np.zeros(100, np.float32), num_sampleable=100, terminal=False,
                               bootstrap_value=0.0))
    learner = Learner(cfg.model, cfg.learner, tuple(frames.shape[2:]), num_actions, seed=0)
    for setting in args.torch_config:  # after the learner's own (learner.avoid_miscompiles), before it compiles
        set_torch_config(setting)
    label = (f"{args.device} {'compiled' if args.compile else 'eager'} {args.path} batch {args.batch} {args.frames} "
             f"{' '.join(args.overrides + args.torch_config)}")
    if args.path == "cache":
        from rayzero.learner.prefetch import ObsStore, Staging

        store = ObsStore.open(replay.obs_store(), threads=2)
        assert store is not None, "the replay's shared observations could not be opened"
        learner._staging = Staging(learner.device, store, obs_cache=True)
    start = time.perf_counter()
    for step in range(args.steps):
        batch = replay.sample(args.batch, with_obs=args.path == "direct")
        item = learner._upload(batch)
        if args.path == "cache" and step < 2:  # the cache serves the replay's own stacked observations
            for name, index in (("obs", batch.indices), ("next_obs", batch.next_index),
                                ("bootstrap_obs", batch.bootstrap_index)):
                if index is not None:
                    same = np.array_equal(item.ready()[name].cpu().numpy(), replay.obs_at(index))
                    print(f"    {name}: {'equal to' if same else 'DIFFERENT from'} the replay's", flush=True)
        _, metrics = learner._update(item.ready(), item.stale)
        if step % args.every == 0 or step == args.steps - 1:
            m = dict(zip(METRIC_NAMES, metrics.tolist()))
            print(f"{label}: step {step:4d}  grad {m['grad_norm']:8.2f}  consistency {m['consistency_loss']:7.3f}  "
                  f"reward {m['reward_loss']:6.3f}  value {m['value_loss']:6.3f}  {time.perf_counter() - start:5.0f} s",
                  flush=True)
            if step < 3 * args.every:  # where a large gradient sits (after clipping, which scales all alike)
                norms = sorted(((p.grad.norm().item(), name) for name, p in learner.loss_module.named_parameters()
                                if p.grad is not None), reverse=True)[:4]
                print("    largest gradients: " + ", ".join(f"{name} {norm:.3g}" for norm, name in norms), flush=True)


if __name__ == "__main__":
    main()
