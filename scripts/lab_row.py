"""One lab-notebook row from a run's metrics.jsonl (docs/benchmarks.md, "Atari learning").

    python3 scripts/lab_row.py RUN_DIR_OR_METRICS_JSONL [--at 120,300,420] [--dmon dmon.txt]

Prints: when the first update landed, updates and env steps by each time, the self-play return (and the share of
its rewards above 0 over the minute before: Pong's points won) and the greedy evaluations, the first learner rows' gradient norm and consistency loss, the learner's rate over the last 200 s
(and the share of it spent inside its calls), the diagnostics averaged over the last 5 learner rows, and the mean
GPU utilisation: the run's own (each progress row's `gpu_util`, and summary.json's phases) and from an `nvidia-smi
dmon -s u -d 5` log (the run's mean, and over its last 200 s).
"""

from __future__ import annotations

import argparse
import json
import os

DMON_INTERVAL_S = 5  # the scripts' `nvidia-smi dmon -d 5`
DIAGNOSTICS = ("policy_loss", "value_loss", "reward_loss", "consistency_loss", "value_error", "reward_error",
               "target_entropy", "policy_kl", "grad_norm", "sample_age_seconds", "sample_is_weight_ess",
               "selfplay_version_lag", "learner_steps_per_second", "env_steps_per_second")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--at", default="120,300,420")
    parser.add_argument("--dmon", default=None)
    args = parser.parse_args()
    path = os.path.join(args.path, "metrics.jsonl") if os.path.isdir(args.path) else args.path
    rows = [json.loads(line) for line in open(path) if line.strip()]
    first = next((r["wall_seconds"] for r in rows if r.get("learner_steps", 0) > 0), None)
    print(f"rows {len(rows)}  first update by {first:.0f} s" if first is not None else "no update")
    for t in (float(x) for x in args.at.split(",")):
        before = [r for r in rows if r["wall_seconds"] <= t]
        if not before:
            continue
        last = before[-1]
        train = [r["train_return_mean"] for r in before if r.get("train_return_mean") is not None]
        # self-play's rewards over the minute before t: the share of those not 0 above 0 (Pong: points won)
        shares = [r["selfplay_positive_reward_share"] for r in before
                  if r["wall_seconds"] > t - 60 and r.get("selfplay_positive_reward_share") is not None]
        print(f"  by {t:4.0f} s: updates {last.get('learner_steps', 0):7,d}  env steps {last.get('env_steps', 0):9,d}"
              f"  train return {train[-1] if train else float('nan'):6.1f}"
              + (f"  rewards > 0 (last minute) {sum(shares) / len(shares):.0%}" if shares else "")
              + (f"  through the step graph {last['graph_updates']:,d}" if last.get("graph_updates") else "")
              + (f"  reanalysed {last['reanalysed']:,d}" if last.get("reanalysed") else ""))
    def ended(r: dict) -> float:  # when an evaluation ended (rows before eval_ended_seconds: when it was logged)
        return r.get("eval_ended_seconds", r["wall_seconds"])

    for r in rows:
        if r.get("eval_return_mean") is not None:
            print(f"  eval at {ended(r):4.0f} s: {r['eval_return_mean']:6.1f} +- {r.get('eval_return_std', 0):.1f}"
                  f" ({r.get('eval_episodes')} games, {r.get('eval_seconds', 0):.0f} s, version {r.get('eval_last_version')},"
                  f" updates {r.get('learner_steps')})")
            if r.get("eval_steps") and r.get("eval_search_seconds") is not None:  # ms per step, and where it went
                per = {k: 1e3 * r.get(f"eval_{k}_seconds", 0.0) / r["eval_steps"] for k in ("search", "queue", "device", "env")}
                print(f"      {r['eval_steps']} steps, {1e3 * r['eval_seconds'] / r['eval_steps']:.1f} ms each: search "
                      f"{per['search']:.1f} (queued {per['queue']:.1f}, on the GPU {per['device']:.1f}), env {per['env']:.1f}")
            if r.get("eval_lengths"):  # each game: return / steps; the games a budget cut short
                games = ", ".join(f"{g:g}/{n}" for g, n in zip(r.get("eval_returns", []), r["eval_lengths"]))
                print(f"      games (return/steps): {games}; {r.get('eval_unfinished', 0)} cut short")
    evaluated = [r for r in rows if r.get("eval_return_mean") is not None]
    if evaluated:  # the report: the first evaluation at or above each return
        firsts = {t: next((ended(r) for r in evaluated if r["eval_return_mean"] >= t), None)
                  for t in (-10, 0, 10, 18)}
        print("  first eval at or above: " + ", ".join(f"{t:+d} {'-' if w is None else f'{w:.0f} s'}"
                                                       for t, w in firsts.items()))
    learning = [r for r in rows if "policy_loss" in r]
    if learning:  # the first learner rows: a blow-up at the start (Pong runs 2 and 10) shows here
        print("  first rows: " + ", ".join(f"{r['learner_steps']} updates: grad {r.get('grad_norm', 0):.3g} "
                                           f"consistency {r.get('consistency_loss', 0):.3f}" for r in learning[:3]))
    timed = [r for r in rows if r.get("steps_per_second") and r.get("learner_steps")]
    if len(timed) > 2:  # the share of wall time inside learner calls, and the rate inside them
        window = [r for r in timed if r["wall_seconds"] >= timed[-1]["wall_seconds"] - 200]
        inside = sum((b["learner_steps"] - a["learner_steps"]) / b["steps_per_second"]
                     for a, b in zip(window, window[1:]))
        wall = window[-1]["wall_seconds"] - window[0]["wall_seconds"]
        steps = window[-1]["learner_steps"] - window[0]["learner_steps"]
        if wall > 0 and inside > 0:
            print(f"  learner over the last {wall:.0f} s: {steps / wall:.1f} updates/s, {inside / wall:.0%} of the time "
                  f"in its calls at {steps / inside:.1f} updates/s")
    gaps = [r for r in rows if "between_calls_s" in r and r.get("call_s")]
    if gaps:  # the last call of each row: the learner's time between train calls, and its weights() in it
        window = [r for r in gaps if r["wall_seconds"] >= gaps[-1]["wall_seconds"] - 200]
        between = sum(r["between_calls_s"] for r in window) / len(window)
        weights = sum(r.get("weights_s", 0.0) for r in window) / len(window)
        call = sum(r["call_s"] for r in window) / len(window)
        print(f"  between train calls (the last of each row, {len(window)} rows): {1e3 * between:.1f} ms after a "
              f"{1e3 * call:.0f} ms call ({between / (between + call):.0%} of the learner's time), weights() "
              f"{1e3 * weights:.1f} ms of it")
    waited = [r for r in rows if "learner_wait_share" in r]
    if len(waited) > 1:  # which side of the replay ratio waited on the other (the one that waits less is the bound)
        window = [(a, b) for a, b in zip(waited, waited[1:]) if b["wall_seconds"] >= waited[-1]["wall_seconds"] - 200]
        span = sum(b["wall_seconds"] - a["wall_seconds"] for a, b in window)
        if span > 0:
            shares = {key: sum(b[key] * (b["wall_seconds"] - a["wall_seconds"]) for a, b in window) / span
                      for key in ("learner_wait_share", "selfplay_wait_share")}
            print(f"  waits over the last {span:.0f} s: the learner without a call queued "
                  f"{shares['learner_wait_share']:.0%}, self-play actors without a collect "
                  f"{shares['selfplay_wait_share']:.0%}")
    evals = [(ended(r) - r["eval_seconds"], ended(r)) for r in rows if r.get("eval_seconds")]
    stepped = [r for r in rows if "learner_steps" in r and "eval_seconds" not in r]
    if evals and len(stepped) > 2 and first is not None:
        # The learner's rate while an evaluation plays and while none does (both share the GPU with it)
        rates: dict[bool, list[float]] = {True: [0.0, 0.0], False: [0.0, 0.0]}  # during: [updates, seconds]
        for a, b in zip(stepped, stepped[1:]):
            if a["wall_seconds"] < first + 20:  # compilation and CUDA-graph recording
                continue
            during = any(start <= b["wall_seconds"] <= end + 1 for start, end in evals)
            rates[during][0] += b["learner_steps"] - a["learner_steps"]
            rates[during][1] += b["wall_seconds"] - a["wall_seconds"]
        print("  learner " + ", ".join(f"{'during' if k else 'outside'} evaluations {v[0] / v[1]:.1f} updates/s "
                                        f"({v[1]:.0f} s)" for k, v in rates.items() if v[1] > 0))
    learner = learning[-5:]
    if learner:
        means = {k: sum(r[k] for r in learner if k in r) / max(1, sum(k in r for r in learner)) for k in DIAGNOSTICS}
        print("  last rows: " + "  ".join(f"{k} {v:.3g}" for k, v in means.items()))
    gpu_rows = [r for r in rows if "gpu_util" in r]
    if gpu_rows:  # the driver's own sampling (every 0.2 s; one mean per progress row)
        end = gpu_rows[-1]["wall_seconds"]
        window = [r["gpu_util"] for r in gpu_rows if r["wall_seconds"] > end - 200]
        print(f"  GPU util (the run's rows) {sum(r['gpu_util'] for r in gpu_rows) / len(gpu_rows):.0f} % over "
              f"{len(gpu_rows)} rows to {end:.0f} s, {sum(window) / len(window):.0f} % over its last 200 s")
    summary_path = os.path.join(os.path.dirname(path), "summary.json")
    gpu = json.load(open(summary_path)).get("gpu") if os.path.exists(summary_path) else None
    if gpu:
        print("  GPU util (summary.json, from " + f"{gpu['from_seconds']:.0f} s) {gpu['util_mean']:.1f} % mean; " +
              ", ".join(f"{name} {gpu[f'util_{name}']:.1f} % over {gpu[f'seconds_{name}']:.0f} s"
                        for name in ("start", "training", "end") if gpu.get(f"util_{name}") is not None))
    if args.dmon and os.path.exists(args.dmon):
        sm = [int(line.split()[1]) for line in open(args.dmon)
              if line.strip() and not line.startswith("#") and line.split()[1].isdigit()]
        if sm:
            last = sm[-max(1, round(200 / DMON_INTERVAL_S)):]  # the window of the learner's rate above
            print(f"  GPU util mean {sum(sm) / len(sm):.0f} % over {len(sm)} samples, {sum(last) / len(last):.0f} % "
                  f"over the last {len(last)} ({len(last) * DMON_INTERVAL_S:.0f} s)")


if __name__ == "__main__":
    main()
