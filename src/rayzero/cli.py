"""The `rayzero` command: train, eval, bench and config.

Bad input (an unknown config key or env id, an out-of-range value, a missing or corrupt checkpoint) ends
with one line on stderr naming the problem, and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any
from pathlib import Path

EXIT_USAGE = 2


class UsageError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rayzero", description="MuZero-family training by self-play on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train an agent", description=(
        "Train on a local Ray (default), the cluster in RAY_ADDRESS, or the cluster of `ray job submit`. "
        "Overrides are section.field=value, e.g. search.num_simulations=25 env.num_envs=32."))
    train.add_argument("--config", default=None, help="preset name (cartpole, atari) or a YAML file")
    train.add_argument("--env", default=None, help="Gymnasium env id, e.g. ALE/Breakout-v5 (overrides env.id)")
    train.add_argument("--seed", type=int, default=None, help="run.seed")
    train.add_argument("--out", required=True, help="run directory")
    train.add_argument("--time-limit", type=float, default=None, help="wall-clock seconds of the run from its start, final evaluation included (run.time_limit)")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    train.add_argument("overrides", nargs="*", help="section.field=value")

    evaluate = sub.add_parser("eval", help="play greedy episodes with a checkpoint")
    evaluate.add_argument("--checkpoint", required=True, help="run directory or checkpoint directory")
    evaluate.add_argument("--episodes", type=int, default=10)
    evaluate.add_argument("--gif", default=None, help="write the first episode as a GIF here")
    evaluate.add_argument("--seed", type=int, default=12345)
    evaluate.add_argument("--max-steps", type=int, default=None, help="step cap per episode")
    evaluate.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                          help="where the network and the search run (auto: a GPU when there is one)")
    evaluate.add_argument("overrides", nargs="*", help="section.field=value (e.g. run.eval_simulations=50: it "
                          "searches as the run's evaluations did, with run.eval_simulations, or "
                          "search.num_simulations where that is 0)")

    show = sub.add_parser("config", help="print the resolved config with each field's documentation", description=(
        "Print the config that `rayzero train` would run with: the defaults, then the preset, then the overrides "
        "(section.field=value), each field with its documentation."))
    show.add_argument("preset", nargs="?", default="cartpole", help="preset name (cartpole, atari) or a YAML file")
    show.add_argument("overrides", nargs="*", help="section.field=value")

    bench = sub.add_parser("bench", help="run a benchmark (tree, inference, selfplay, learner, learning, load, faults)")
    bench.add_argument("name")
    bench.add_argument("--quick", action="store_true", help="smoke size that runs on a 2-core CPU")
    bench.add_argument("--json", default=None, help="write the results here")
    bench.add_argument("--trace", default=None, help="inference: write a Chrome trace of the batcher here")
    bench.add_argument("--seconds", type=float, default=None,
                       help="selfplay: timed seconds per row (default 30, --quick 3)")
    bench.add_argument("--rows", default=None,
                       help="selfplay on a GPU host: comma-separated rows to run (preset, envs16, envs128, sims200, cpu, cpu128, cpu256, "
                            "cut, lanes2, lanes3, threads3, threads4, ...; default: preset, envs16, sims200, cpu)")
    bench.add_argument("overrides", nargs="*",
                       help="selfplay: section.field=value applied to every row (e.g. env.num_threads=2)")
    bench.add_argument("--kill-every", type=float, default=None,
                       help="faults: seconds between self-play actor kills (default 10)")
    bench.add_argument("--seeds", type=int, default=None,
                       help="faults: runs a side, seeds 0..N-1, compared by the spread between runs (default 1)")
    return parser


def _train(args: argparse.Namespace) -> int:
    from rayzero import config as config_lib
    from rayzero.storage import is_uri
    from rayzero.train import check_fresh, check_resumable, train

    run_dir = Path(args.out)
    overrides = list(args.overrides)
    if args.env:
        overrides.append(f"env.id={args.env}")
    if args.seed is not None:
        overrides.append(f"run.seed={args.seed}")
    if args.time_limit is not None:
        overrides.append(f"run.time_limit={args.time_limit}")
    preset = args.config
    if preset is None:
        if args.resume and not is_uri(args.out) and (run_dir / "config.yaml").exists():
            preset = str(run_dir / "config.yaml")
        else:
            preset = "cartpole"
    config = config_lib.load(preset, overrides)
    _check_env(config.env)  # an unknown env id fails here, before Ray starts
    if args.resume and not is_uri(args.out):
        check_resumable(run_dir)  # a URI is checked after it is fetched
    elif not args.resume and not is_uri(args.out):
        check_fresh(run_dir)  # never append to another run's metrics and checkpoints
    summary = train(config, args.out, resume=args.resume, started=args.started)
    print(json.dumps({k: summary[k] for k in ("env_id", "env_steps", "learner_steps", "eval_return_mean")}))
    return 0


def _eval(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from rayzero import config as config_lib
    from rayzero.actors.evaluate import play_episodes, record_gif
    from rayzero.actors.network import LocalNetwork
    from rayzero.devices import resolve_device
    from rayzero.learner import checkpoint as ckpt
    from rayzero.learner import load_model_weights
    from rayzero.models import build_model

    if args.episodes < 1:
        raise UsageError(f"--episodes={args.episodes} must be >= 1")
    try:
        device = resolve_device(args.device)
    except ValueError as error:
        raise UsageError(f"--device: {error}") from None
    checkpoint = ckpt.latest(args.checkpoint, files=(ckpt.MODEL,))  # the weights are all it plays with
    config_path = next((p / "config.yaml" for p in (checkpoint, *checkpoint.parents) if (p / "config.yaml").exists()),
                       None)
    if config_path is None:
        raise ckpt.CheckpointError(f"no config.yaml found next to checkpoint {str(checkpoint)!r}")
    config = config_lib.load(str(config_path), list(args.overrides))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    spec = _check_env(config.env)
    model = build_model(config.model, spec.observation_shape, spec.num_actions)
    load_model_weights(model, checkpoint)
    network = LocalNetwork(model.to(device), config.replay.discount)
    max_steps = args.max_steps or config.run.eval_max_steps
    returns: list[float] = []
    lengths: list[int] = []
    finished: list[bool] = []
    if args.gif:  # the GIF's game is the first of the episodes (an Atari game on a CPU takes minutes)
        total, length, ended = record_gif(config.env, network, config.eval_search, args.gif, max_steps, args.seed)
        returns.append(total), lengths.append(length), finished.append(ended)
        print(f"wrote {args.gif} (episode return {total:.1f})")
    if args.episodes > len(returns):
        returns += play_episodes(config.env, network, config.eval_search, args.episodes - len(returns), max_steps,
                                 args.seed + len(returns), finished=finished, lengths=lengths)
    for i, (total, length, ended) in enumerate(zip(returns, lengths, finished)):
        print(f"episode {i}: return {total:g} in {length:,} steps" + ("" if ended else " (cut at --max-steps)"))
    cut = finished.count(False)
    print(f"{config.env.id}: {np.mean(returns):.2f} ± {np.std(returns):.2f} over {len(returns)} episodes"
          + (f", {cut} cut at {max_steps:,} steps" if cut else "") + f" (checkpoint {checkpoint})")
    return 0


def _config(args: argparse.Namespace) -> int:
    from rayzero import config as config_lib

    preset, overrides = args.preset, list(args.overrides)
    if "=" in preset:  # `rayzero config a.b=1`: no preset given, only overrides
        preset, overrides = "cartpole", [preset, *overrides]
    print(config_lib.describe(config_lib.load(preset, overrides)))
    return 0


def _bench(args: argparse.Namespace) -> int:
    import importlib

    from rayzero.config import ConfigError

    names = ("tree", "inference", "selfplay", "learner", "learning", "load", "faults")
    if args.name not in names:
        raise UsageError(f"unknown benchmark {args.name!r}: valid are {', '.join(names)}")
    try:
        module = importlib.import_module(f"rayzero.bench.{args.name}")
    except ModuleNotFoundError:
        raise UsageError(f"benchmark {args.name!r} is not built yet") from None
    if args.seconds is not None:
        if args.name != "selfplay":
            raise UsageError("--seconds is only for `rayzero bench selfplay`")
        if not args.seconds > 0:
            raise UsageError(f"--seconds must be > 0, got {args.seconds}")
    if args.rows is not None and args.name != "selfplay":
        raise UsageError("--rows is only for `rayzero bench selfplay`")
    if args.overrides and args.name != "selfplay":
        raise UsageError(f"config overrides ({' '.join(args.overrides)}) are only for `rayzero bench selfplay`")
    if args.kill_every is not None or args.seeds is not None:
        if args.name != "faults":
            raise UsageError("--kill-every and --seeds are only for `rayzero bench faults`")
        if args.kill_every is not None and not args.kill_every > 0:
            raise UsageError(f"--kill-every must be > 0, got {args.kill_every}")
        if args.seeds is not None and args.seeds < 1:
            raise UsageError(f"--seeds must be >= 1, got {args.seeds}")
        module.main(quick=args.quick, json_path=args.json, selfplay_every=args.kill_every or 10.0,
                    seeds=args.seeds or 1)
        return 0
    if args.trace:
        if args.name != "inference":
            raise UsageError("--trace is only for `rayzero bench inference`")
        module.main(quick=args.quick, json_path=args.json, trace_path=args.trace)
    elif args.name == "selfplay":
        rows = None if args.rows is None else [r.strip() for r in args.rows.split(",") if r.strip()]
        try:
            module.check_rows(rows)  # before Ray starts
        except ValueError as error:
            raise UsageError(str(error)) from None
        try:  # a bad override fails before Ray starts, naming what is valid
            module.main(quick=args.quick, json_path=args.json, seconds=args.seconds, only=rows,
                        overrides=list(args.overrides))
        except ConfigError as error:
            raise UsageError(str(error)) from None
    else:
        module.main(quick=args.quick, json_path=args.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()  # `--time-limit` counts from here: start-up (imports, Ray) included
    from rayzero.config import ConfigError
    from rayzero.learner.checkpoint import CheckpointError

    parser = _parser()
    # Overrides may come before or after flags (`--out D a.b=1 --resume c.d=2`): argparse leaves the later
    # ones unparsed, so collect them here.
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if "=" not in x or x.startswith("-")]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    args.started = started
    handlers = {"train": _train, "eval": _eval, "bench": _bench, "config": _config}
    try:
        return handlers[args.command](args)
    except (ConfigError, CheckpointError, UsageError) as error:
        print(f"rayzero: error: {error}", file=sys.stderr)
        return EXIT_USAGE


def _check_env(env_cfg: Any) -> Any:
    """The env's spec; a ValueError here (an unknown id, an unsupported space) is bad input: a ConfigError."""
    from rayzero.config import ConfigError
    from rayzero.envs import env_spec

    try:
        return env_spec(env_cfg)
    except ConfigError:
        raise
    except ValueError as error:
        raise ConfigError(str(error).splitlines()[0]) from None


if __name__ == "__main__":
    sys.exit(main())
