"""Elastic self-play on a real multi-node Ray (ray.cluster_utils.Cluster) and run dirs on a storage URI."""

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def metric_rows(path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(predicate, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


def test_adding_and_removing_a_node(tmp_path):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    run_dir = tmp_path / "run"
    proc = None
    try:
        env = dict(os.environ, RAY_ADDRESS=cluster.address, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(
            [sys.executable, "-m", "rayzero", "train", "--config", "cartpole", "--out", str(run_dir),
             "--time-limit", "400", "cluster.num_selfplay_actors=1", "cluster.max_selfplay_actors=2",
             "cluster.selfplay_cpus=1", "cluster.learner_cpus=1", "run.log_interval=1", "run.stop_return=0",
             "run.eval_interval=1000", "run.eval_episodes=2", "run.eval_max_steps=100", "env.num_envs=4",
             "replay.min_size=300"],
            env=env, stdout=open(tmp_path / "out.log", "w"), stderr=subprocess.STDOUT,
        )
        metrics = run_dir / "metrics.jsonl"
        wait_for(lambda: any(r.get("selfplay_actors_active") == 1 and r.get("learner_steps", 0) > 0
                             for r in metric_rows(metrics)), 90, "one actor and learning")
        assert all(r.get("selfplay_actors_active", 0) <= 1 for r in metric_rows(metrics))
        node = cluster.add_node(num_cpus=1)
        wait_for(lambda: any(r.get("selfplay_actors_active") == 2 for r in metric_rows(metrics)), 60,
                 "a second self-play actor on the new node")
        before = metric_rows(metrics)[-1]
        cluster.remove_node(node)
        wait_for(lambda: "lost" in (tmp_path / "out.log").read_text(), 60, "the lost actor to be noticed")
        wait_for(lambda: metric_rows(metrics)[-1]["learner_steps"] > before["learner_steps"] + 50, 60,
                 "training to continue")
        after = metric_rows(metrics)[-1]
        assert after["selfplay_actors_active"] == 1
        assert after["env_steps"] > before["env_steps"]
        # Replay lives on the head node: nothing it held was lost with the worker.
        assert after["replay_size"] >= before["replay_size"]
        proc.send_signal(2)  # Ctrl-C: the run checkpoints and writes its summary
        assert proc.wait(timeout=120) == 0, (tmp_path / "out.log").read_text()[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["replay_size"] >= after["replay_size"]
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        cluster.shutdown()


def test_run_dir_on_a_storage_uri(tmp_path):
    uri = f"file://{tmp_path}/bucket/run1"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    args = [sys.executable, "-m", "rayzero", "train", "--config", "cartpole", "--out", uri,
            "run.max_env_steps=800", "replay.min_size=200", "run.eval_episodes=2", "run.eval_max_steps=50",
            "run.stop_return=0", "learner.steps_per_call=5"]
    first = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    remote = tmp_path / "bucket" / "run1"
    summary = json.loads((remote / "summary.json").read_text())
    assert (remote / "checkpoints" / "latest").exists() and (remote / "config.yaml").exists()
    step = (remote / "checkpoints" / "latest").read_text().strip()
    assert (remote / "checkpoints" / step / "model.safetensors").exists()
    resumed = subprocess.run([*args[:-5], "--resume", "run.max_env_steps=1600", *args[-4:]], env=env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    second = json.loads((remote / "summary.json").read_text())
    assert second["env_steps"] == summary["env_steps"] + second["env_steps_this_run"]
