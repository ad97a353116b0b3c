"""Where a learner update's arithmetic goes, per sample, for a preset's network (torch's FLOP counter, on the CPU):
the root's representation and prediction and K unrolled dynamics and predictions with their backward (x3), the
n-step bootstraps' K+1 representations and predictions with the target network, and the consistency targets' K
representations (both without gradient). Arithmetic, not time: the GPU's step time is measured by
`rayzero bench learner`.

    python scripts/step_flops.py [--preset atari] [section.field=value ...]
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.flop_counter import FlopCounterMode

from rayzero.config import load
from rayzero.envs import env_spec
from rayzero.models import build_model


def mflops(fn, rows: int) -> float:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops() / rows / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="atari")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    config = load(args.preset, args.overrides)
    spec = env_spec(config.env)
    model = build_model(config.model, spec.observation_shape, spec.num_actions).eval()
    obs = torch.zeros((args.rows, *spec.observation_shape), dtype=torch.uint8 if len(spec.observation_shape) == 3
                      else torch.float32)
    with torch.no_grad():
        latent = model.represent(obs)
        represent = mflops(lambda: model.represent(obs), args.rows)
        predict = mflops(lambda: model.predict(latent), args.rows)
        dynamics = mflops(lambda: model.dynamics(latent, torch.zeros(args.rows, dtype=torch.long)), args.rows)
    k = config.replay.unroll_steps
    trained = 3 * (represent + predict + k * (dynamics + predict))  # forward and backward
    bootstraps = (k + 1) * (represent + predict) if config.replay.bootstrap_obs else 0.0
    consistency = k * represent if config.learner.consistency_weight > 0 else 0.0
    total = trained + bootstraps + consistency
    print(f"{args.preset}: observation {spec.observation_shape}, latent {tuple(latent.shape[1:])}, K = {k}")
    print(f"MFLOPs a pass: represent {represent:.1f}, predict {predict:.1f}, dynamics {dynamics:.1f}")
    print("| part of an update, per sample | MFLOPs | share |\n|---|---:|---:|")
    for name, value in (("root and unroll, forward and backward", trained),
                        (f"bootstraps ({k + 1} target representations and predictions)", bootstraps),
                        (f"consistency targets ({k} representations)", consistency), ("total", total)):
        print(f"| {name} | {value:.0f} | {value / total:.0%} |")


if __name__ == "__main__":
    main()
