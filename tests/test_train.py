"""End to end through the CLI on a real local Ray: learning, resume, Atari smoke."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from rayzero import config as config_lib

pytestmark = pytest.mark.slow


def rayzero(*args, timeout=900):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result = subprocess.run([sys.executable, "-m", "rayzero", *args], capture_output=True, text=True,
                            timeout=timeout, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def test_cartpole_learns(tmp_path):
    """The bar: a greedy 10-episode mean >= 195 within 10 minutes on 2 CPU cores."""
    seed = int(os.environ.get("RAYZERO_LEARNING_SEED", "1"))
    rayzero("train", "--config", "cartpole", "--seed", str(seed), "--out", str(tmp_path), "--time-limit", "600")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["eval_episodes"] == 10
    assert summary["eval_return_mean"] >= 195, summary
    assert summary["wall_seconds"] <= 660, summary
    for name in ("config.yaml", "metrics.jsonl", "learning_curve.png"):
        assert (tmp_path / name).exists(), name
    assert list((tmp_path / "tensorboard").iterdir())
    assert (tmp_path / "checkpoints" / "latest").exists()


SMALL = ["run.eval_episodes=2", "run.eval_max_steps=200", "run.stop_return=0", "replay.min_size=200",
         "learner.steps_per_call=10", "run.log_interval=2"]


def test_resume_continues_counters_and_replay(tmp_path):
    rayzero("train", "--config", "cartpole", "--out", str(tmp_path), "run.max_env_steps=1500", *SMALL)
    first = json.loads((tmp_path / "summary.json").read_text())
    assert first["learner_steps"] > 0 and first["replay_size"] > 0
    # The final evaluation plays while the final checkpoint is written; the checkpoint's state still counts it.
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()  # names the newest checkpoint
    state = json.loads((tmp_path / "checkpoints" / latest / "state.json").read_text())
    assert state["best_eval_return"] == first["best_eval_return"]
    assert state["learner_steps"] == first["learner_steps"]
    rayzero("train", "--config", "cartpole", "--out", str(tmp_path), "--resume", "run.max_env_steps=3000", *SMALL)
    second = json.loads((tmp_path / "summary.json").read_text())
    assert second["env_steps"] == first["env_steps"] + second["env_steps_this_run"]
    assert second["learner_steps"] == first["learner_steps"] + second["learner_steps_this_run"]
    assert second["env_steps_this_run"] > 0 and second["learner_steps_this_run"] > 0
    assert second["replay_size_at_start"] == first["replay_size"]
    assert second["replay_total_added_at_start"] == first["replay_total_added"]
    assert second["replay_total_added"] > first["replay_total_added"]


def test_two_learner_ranks_with_replay_shards_and_reanalyse_resume(tmp_path):
    """cluster.num_learners=2 on the CPU (gloo DDP): one replay shard per rank, both checkpointed and restored;
    a reanalyse worker refreshes targets in both shards; the model predicts value prefixes."""
    two = ["cluster.num_learners=2", "cluster.learner_cpus=0", "reanalyse.fraction=0.25", "cluster.reanalyse_cpus=0",
           "model.value_prefix=true", *SMALL]
    # Limits in learner steps: with a limit in env steps, fast self-play can end the run before the learner's
    # second call, and so before any reanalyse call.
    rayzero("train", "--config", "cartpole", "--out", str(tmp_path), "run.max_learner_steps=40", *two)
    first = json.loads((tmp_path / "summary.json").read_text())
    assert first["learner_steps"] > 0 and first["replay_size"] > 0 and first["reanalysed_this_run"] > 0
    newest = sorted((tmp_path / "checkpoints").glob("step_*"))[-1]
    assert (newest / "replay-0.npz").exists() and (newest / "replay-1.npz").exists()
    rayzero("train", "--config", "cartpole", "--out", str(tmp_path), "--resume", "run.max_learner_steps=80", *two)
    second = json.loads((tmp_path / "summary.json").read_text())
    assert second["replay_size_at_start"] == first["replay_size"]
    assert second["learner_steps"] == first["learner_steps"] + second["learner_steps_this_run"]


def test_atari_smoke_train_then_eval(tmp_path):
    run_dir = tmp_path / "pong"
    rayzero(  # ends after 4 updates (or at the time limit on a machine too loaded to get there: then it fails)
        "train", "--config", "atari", "--out", str(run_dir), "--time-limit", "240", "run.max_learner_steps=4",
        "env.num_envs=2", "search.num_simulations=4", "model.channels=16", "model.support_size=10",
        "replay.capacity=3000", "replay.min_size=100", "replay.segment_length=50", "learner.batch_size=8",
        "learner.steps_per_call=2", "learner.checkpoint_interval=4", "run.eval_episodes=1",
        "run.eval_max_steps=30", "run.final_eval_max_steps=30", "run.selfplay_steps_per_call=5",
        "run.eval_interval=1000",
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env_id"] == "ALE/Pong-v5" and summary["env_steps"] > 0 and summary["learner_steps"] > 0
    assert summary["eval_unfinished"] == 1  # no Pong game ends in 30 steps: cut by the step cap, and said so
    assert summary["eval_lengths"] == [30]
    gif = tmp_path / "pong.gif"
    result = rayzero("eval", "--checkpoint", str(run_dir), "--episodes", "1", "--max-steps", "30", "--gif", str(gif))
    assert "ALE/Pong-v5" in result.stdout
    assert gif.stat().st_size > 1000
    # The GIF's game is the evaluation's one episode: the mean printed is its return.
    gif_return = float(re.search(r"episode return (-?[\d.]+)", result.stdout).group(1))
    mean = float(re.search(r"ALE/Pong-v5: (-?[\d.]+) ± 0.00 over 1 episodes, 1 cut at 30 steps", result.stdout).group(1))
    assert mean == gif_return
    assert f"episode 0: return {gif_return:g} in 30 steps (cut at --max-steps)" in result.stdout
    # scripts/search_probe.py on the same checkpoint: without root noise its two searches of a root are the same.
    probe = tmp_path / "probe.json"
    subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "..", "scripts", "search_probe.py"),
                    "--checkpoint", str(run_dir), "--envs", "2", "--steps", "4", "--every", "2", "--json", str(probe),
                    "search.dirichlet_fraction=0"], check=True, capture_output=True, text=True, timeout=300)
    report = json.loads(probe.read_text())
    assert report["positions"] == 4
    assert report["summary"]["same_argmax"] == 1.0 and report["summary"]["target_l1"] == 0.0
    assert 0.0 <= report["summary"]["spread_share"] <= 1.0
    # With root noise and --against the run's own search, the variant replays the same noise: the same targets.
    subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "..", "scripts", "search_probe.py"),
                    "--checkpoint", str(run_dir), "--envs", "2", "--steps", "4", "--every", "2", "--json", str(probe),
                    "--against", "search.virtual_loss=1"], check=True, capture_output=True, text=True, timeout=300)
    summary = json.loads(probe.read_text())["summary"]
    assert summary["against_noise_same_argmax"] == 1.0 and summary["against_noise_target_l1"] == 0.0
    assert summary["against_clean_target_l1"] == 0.0 and 0.0 <= summary["resample_noise_target_l1"] <= 2.0


def test_a_time_limited_run_ends_by_its_limit_with_its_final_evaluation(tmp_path):
    """--time-limit counts the final evaluation in: training stops early enough for it (its length estimated
    from an evaluation step timed alone at the start, at most run.final_eval_seconds), and it plays the final
    weights, with nothing else running, until the limit: games still playing then count with their score so far."""
    limit, budget = 35, 10
    result = rayzero("train", "--config", "cartpole", "--out", str(tmp_path), "--time-limit", str(limit),
                     f"run.final_eval_seconds={budget}", "run.eval_interval=5", "run.stop_return=0")
    log = result.stdout + result.stderr
    assert "an evaluation step alone:" in log and "training stops" in log, log[-3000:]
    # The step time is the fastest of the probe's blocks (the learner's helpers slow some on a GPU host).
    probe = re.search(r"an evaluation step alone: ([\d.]+) ms \(.*the fastest of ([\d., ]+) ms over (\d+) steps",
                      log)
    blocks = [float(ms) for ms in probe.group(2).split(", ")]
    assert len(blocks) == 3 and float(probe.group(1)) == min(blocks) and int(probe.group(3)) > 0, probe.group(0)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stop_reason"] == "time_limit"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    final = [row for row in rows if "eval_return_mean" in row][-1]
    assert final["learner_steps"] == summary["learner_steps"]  # no update after training stopped
    assert final["version"] == summary["weights_version"]  # it played the final weights
    # It ends by the limit (Ray's calls add a little); before, it could end half its budget (5 s) after it.
    assert final["eval_ended_seconds"] <= limit + 2, (final, re.findall(r"training stops.*", log))
    assert final["eval_ended_seconds"] - final["eval_seconds"] >= limit - budget - 1, final  # it started at the reserve
    # Self-play's rewards per progress row: CartPole pays 1 a step, so 1,000 per 1,000 steps, none below 0.
    played = [row for row in rows if "selfplay_reward_per_1k_steps" in row]
    assert played and all(row["selfplay_reward_per_1k_steps"] == 1000.0 for row in played), played[:3]
    assert all(row["selfplay_positive_reward_share"] == 1.0 for row in played)
    # Which side of the replay ratio waited, per progress row: shares of the row's time.
    waits = [(row["learner_wait_share"], row["selfplay_wait_share"]) for row in played]
    assert waits and all(0.0 <= a <= 1.0 + 1e-6 and 0.0 <= b <= 1.0 + 1e-6 for a, b in waits), waits
    assert re.search(r"rewards \+[1-9][0-9]*/-0 \(", log), log[-3000:]
    # The GPUs of the driver's machine, sampled through the run: each progress row's utilisation, and the run's
    # phases in summary.json (none on a machine without a GPU).
    from rayzero.gpu_monitor import GpuMonitor

    gpu = summary["gpu"]
    if GpuMonitor(index=None).available:
        assert gpu["util_mean"] is not None and gpu["seconds_training"] > 0 and gpu["seconds_end"] > 0, gpu
        assert 0 <= gpu["from_seconds"] < 30 and all(0 <= row["gpu_util"] <= 100 for row in played), gpu
        assert "% mean" in log
    else:
        assert gpu is None and not any("gpu_util" in row for row in rows), gpu


def test_sigterm_ends_the_run_cleanly(tmp_path):
    """`ray job stop` and Kubernetes send SIGTERM: in-flight work finishes, then a checkpoint and summary.json."""
    import signal
    import time

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "rayzero", "train", "--config", "cartpole", "--out", str(tmp_path),
                             *SMALL, "run.log_interval=1"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
                    if line.strip()] if (tmp_path / "metrics.jsonl").exists() else []
            if any(row.get("learner_steps", 0) >= 20 for row in rows):
                break
            time.sleep(0.5)
        assert proc.poll() is None, "the run ended before it was signalled"
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted" and summary["learner_steps"] >= 20
    step = (tmp_path / "checkpoints" / "latest").read_text().strip()
    assert (tmp_path / "checkpoints" / step / "model.safetensors").exists()


def test_the_early_compile_starts_with_a_plan_that_puts_the_learner_on_a_local_gpu(tmp_path, monkeypatch):
    """learner.early_compile: on a local Ray whose plan puts the learner on a GPU (an H200 host's resources here),
    the driver hands the helpers the learner's settings as the colocated learner will have them ('default' mode)
    and a batch of the preset's size, and builds the roles with a config that names where they report; on a CPU
    plan, or a cluster it joined, it starts nothing and builds from its config as it is. The `atari` preset asks
    for it as it is."""
    from rayzero import cluster
    from rayzero.learner import background
    from rayzero.train import Driver

    started = []

    def recording_prewarm(model_cfg, cfg, obs_shape, num_actions, device, tensors, directory):
        started.append((cfg, obs_shape, num_actions, device, tensors, directory))
        return []

    monkeypatch.setattr(background, "prewarm", recording_prewarm)
    config = config_lib.load("atari")
    driver = Driver(config, str(tmp_path / "run"), resume=False)
    gpu_host = cluster.plan(config, {"CPU": 16.0, "GPU": 1.0, "memory": 9e10})
    assert driver._early_compile("existing", gpu_host) is config and not started  # a cluster it joined
    cpu_host = cluster.plan(config, {"CPU": 2.0, "memory": 2e10})
    assert driver._early_compile("local", cpu_host) is config and not started
    built = driver._early_compile("local", gpu_host)
    (cfg, obs_shape, num_actions, device, tensors, directory), = started
    assert built.learner.prewarm_dir == str(directory) and directory.is_dir()
    assert dataclasses.replace(built, learner=config.learner) == config  # nothing else changed
    assert cfg.device == "cuda" and cfg.compile_mode == "default" and device.type == "cuda"
    assert obs_shape == driver.spec.observation_shape and num_actions == driver.spec.num_actions
    assert tensors["obs"].shape == (config.learner.batch_size, *obs_shape) and tensors["obs"].dtype == torch.uint8
    driver._end_early_compile()
    assert not directory.exists()
