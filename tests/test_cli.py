"""The CLI's handling of bad input: one line naming the problem, exit code 2, no traceback."""

import subprocess
import sys

import pytest


def rayzero(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "rayzero", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


def assert_usage_error(result, *needles):
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_unknown_env_id(tmp_path):
    assert_usage_error(rayzero("train", "--config", "cartpole", "--env", "NoSuchEnv-v9", "--out", str(tmp_path)),
                       "NoSuchEnv-v9")


def test_unknown_ale_game(tmp_path):
    assert_usage_error(rayzero("train", "--config", "atari", "--env", "ALE/NoSuchGame-v5", "--out", str(tmp_path)),
                       "ALE/NoSuchGame-v5")


def test_negative_num_simulations(tmp_path):
    assert_usage_error(rayzero("train", "--config", "cartpole", "--out", str(tmp_path), "search.num_simulations=-3"),
                       "search.num_simulations=-3", ">= 1")


def test_unknown_config_key(tmp_path):
    assert_usage_error(rayzero("train", "--config", "cartpole", "--out", str(tmp_path), "learner.lrr=0.1"), "lrr")


def test_unknown_preset(tmp_path):
    assert_usage_error(rayzero("train", "--config", "nosuchpreset", "--out", str(tmp_path)), "nosuchpreset", "cartpole")


@pytest.mark.parametrize("command", ["eval", "resume"])
def test_missing_checkpoint(tmp_path, command):
    if command == "eval":
        result = rayzero("eval", "--checkpoint", str(tmp_path / "nothing"), "--episodes", "1")
    else:
        result = rayzero("train", "--config", "cartpole", "--out", str(tmp_path), "--resume")
    assert_usage_error(result, "no checkpoint found")


@pytest.mark.parametrize("command", ["eval", "resume"])
def test_corrupt_checkpoint(tmp_path, command):
    from rayzero import config
    from rayzero.config import ModelConfig
    from rayzero.learner import checkpoint as ckpt

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(config.to_yaml(config.load("cartpole")))
    staging = ckpt.staging_dir(run_dir, 10)
    (staging / "model.safetensors").write_bytes(b"\x00\x01 not a safetensors file")
    (staging / "optimizer.pt").write_bytes(b"junk")
    ckpt.commit(run_dir, staging, 10, {"learner_steps": 10, "env_steps": 100})
    assert ModelConfig  # the config above is a real one: only the weights are corrupt
    if command == "eval":
        result = rayzero("eval", "--checkpoint", str(run_dir), "--episodes", "1")
    else:
        result = rayzero("train", "--config", "cartpole", "--out", str(run_dir), "--resume")
    assert_usage_error(result, "corrupt")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_eval_on_cuda_without_a_gpu_is_a_usage_error(tmp_path):
    result = rayzero("eval", "--checkpoint", str(tmp_path), "--episodes", "1", "--device", "cuda")
    assert_usage_error(result, "--device", "CUDA is not available")


def test_unknown_benchmark():
    assert_usage_error(rayzero("bench", "nosuchbench"), "nosuchbench", "tree")


@pytest.mark.parametrize("args, words", [
    (["selfplay", "--rows", "preset,nosuchrow"], ["nosuchrow", "envs16", "cpu"]),
    (["selfplay", "--rows", ","], ["preset", "sims200"]),
    (["tree", "--rows", "cpu"], ["--rows", "selfplay"]),
    (["selfplay", "--quick", "env.num_threads=-1"], ["env.num_threads=-1", ">= 0"]),
    (["tree", "env.num_envs=4"], ["env.num_envs=4", "selfplay"]),
])
def test_bench_rows_are_checked_before_anything_runs(args, words):
    assert_usage_error(rayzero("bench", *args), *words)


def test_selfplay_benchmark_quick_writes_its_json(tmp_path):
    import json

    path = tmp_path / "selfplay.json"
    result = rayzero("bench", "selfplay", "--quick", "--json", str(path), "env.num_envs=6")
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(path.read_text())
    assert document["benchmark"] == "selfplay" and document["versions"]["torch"]
    rows = {row["preset"]: row for row in document["worker"]}
    assert set(rows) == {"cartpole", "atari"}
    for row in rows.values():
        assert row["env_steps_per_second"] > 0 and 0 < row["network_share"] < 1
    # The served path: self-play actors and the inference actor in Ray, against the env-only ceiling.
    (served,) = document["served"]
    assert served["env_steps_per_second"] > 0 and served["ceiling_env_steps_per_second"] > 0
    assert served["inference_device"] == "cpu" and served["actors"] == 1
    assert served["envs_per_actor"] == 6 and served["overrides"][-1] == "env.num_envs=6"  # the override, last
    assert 0 < served["step_latency"]["p50_ms"] <= served["step_latency"]["p99_ms"]
    assert served["one_env_latency"]["steps"] >= 20 and served["batches"]["rows_per_batch"] > 0
    # the host's CPUs were busy while actors (and then the ceiling's envs) stepped: a share, where /proc/stat is
    assert 0 < served["host_cpu_busy"] <= 1 and 0 < served["ceiling_host_cpu_busy"] <= 1
    # and which processes kept them busy: the self-play actor stepped its envs, the ceiling's tasks theirs
    assert served["cpu_by_role"]["_RemoteSelfPlay"]["cores"] > 0
    assert served["ceiling_cpu_by_role"]["step_randomly"]["cores"] > 0


def test_host_cpu_busy_share_from_two_proc_stat_readings():
    from rayzero.bench.selfplay import _cpu_busy, _cpu_times

    # user nice system idle iowait irq softirq steal (guest, guest_nice: inside user already, not summed)
    before = _cpu_times("cpu  100 0 50 800 50 0 0 0 7 0\n")
    after = _cpu_times("cpu  400 0 150 1100 150 0 0 0 9 0\n")
    assert before == (150, 1000) and after == (550, 1800)
    assert _cpu_busy(before, after) == 0.5  # 400 busy of 800 jiffies
    assert _cpu_busy(None, after) is None and _cpu_busy(after, before) is None
    assert _cpu_times("intr 1 2 3") is None


def test_cores_by_role_from_two_readings_of_proc(tmp_path):
    """The served row's `cpu_by_role`: CPU seconds per process between two readings of /proc, grouped by the Ray
    actor class in a worker's title (whatever method it runs), else by the process's name."""
    import os

    from rayzero.bench.selfplay import _cpu_by_role, _process_cpu, _roles_line

    tick = os.sysconf("SC_CLK_TCK")

    def write(pid: int, comm: str, title: str, utime: float, stime: float) -> None:
        folder = tmp_path / str(pid)
        folder.mkdir(exist_ok=True)
        (folder / "stat").write_text(f"{pid} ({comm}) S 1 1 1 0 -1 4194560 10 0 0 0 {round(utime * tick)} "
                                     f"{round(stime * tick)} 0 0 20 0 9 0 100 0 0\n")
        (folder / "cmdline").write_bytes(title.encode() + b"\0--flag\0")

    write(11, "ray::_RemoteSel", "ray::_RemoteSelfPlay", 1, 0)
    write(12, "ray::_RemoteSel", "ray::_RemoteSelfPlay.collect", 2, 1)
    write(13, "raylet", "/site/ray/core/src/ray/raylet/raylet", 1, 0)
    write(14, "kworker/0:1", "", 0, 1)  # a kernel thread: no command line
    (tmp_path / "self").mkdir()  # not a process
    before = _process_cpu(str(tmp_path))
    assert before == {11: ("_RemoteSelfPlay", 1.0), 12: ("_RemoteSelfPlay", 3.0), 13: ("raylet", 1.0),
                      14: ("kworker/0:1", 1.0)}
    # 2 s later: the actors took 1.5 and 1 CPU seconds more (one busy in another method now), an inference
    # actor started and took 0.5, the raylet and the kernel thread took nothing.
    write(11, "ray::_RemoteSel", "ray::_RemoteSelfPlay.collect", 2.5, 0)
    write(12, "ray::_RemoteSel", "ray::_RemoteSelfPlay", 3, 1)
    write(15, "ray::Inference", "ray::InferenceServer.search", 0.25, 0.25)
    roles = _cpu_by_role(before, _process_cpu(str(tmp_path)), 2.0)
    assert roles == {"_RemoteSelfPlay": {"cores": 1.25, "processes": 2},
                     "InferenceServer": {"cores": 0.25, "processes": 1}}
    assert list(roles) == ["_RemoteSelfPlay", "InferenceServer"]  # busiest first
    assert _roles_line(roles) == "_RemoteSelfPlay 1.2 (2 processes), InferenceServer 0.2"
    # a Ray task's worker is titled "ray::IDLE" once its task is done: the caller names it
    named = _cpu_by_role(before, _process_cpu(str(tmp_path)), 2.0, {12: "step_randomly"})
    assert named["step_randomly"] == {"cores": 0.5, "processes": 1} and named["_RemoteSelfPlay"]["cores"] == 0.75
    assert _process_cpu(str(tmp_path / "no-proc")) is None and _cpu_by_role(None, before, 2.0) is None


@pytest.mark.parametrize("leftover", ["config.yaml", "metrics.jsonl", "checkpoints"])
def test_reused_run_dir_without_resume(tmp_path, leftover):
    (tmp_path / leftover).mkdir() if leftover == "checkpoints" else (tmp_path / leftover).write_text("")
    assert_usage_error(rayzero("train", "--config", "cartpole", "--out", str(tmp_path)), "already holds a run",
                       leftover, "--resume")


def test_config_prints_the_resolved_config_with_documentation():
    result = rayzero("config", "atari", "search.num_simulations=7", "env.num_envs=3")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "  num_simulations: 7" in lines and "  num_envs: 3" in lines and "  id: ALE/Pong-v5" in lines
    where = lines.index("  num_envs: 3")
    start = where
    while lines[start - 1].startswith("  # "):  # the field's docstring, one comment line per line
        start -= 1
    assert lines[start].startswith("  # Environments stepped together by each self-play actor. 0: the plan's")
    assert lines[where - 1].startswith("  # ") and start < where - 1
    assert lines[0].startswith("env:  # ")


def test_config_without_a_preset_is_cartpole_with_overrides():
    result = rayzero("config", "search.num_simulations=3")
    assert result.returncode == 0, result.stderr
    assert "  id: CartPole-v1" in result.stdout.splitlines() and "  num_simulations: 3" in result.stdout.splitlines()


def test_config_with_a_bad_override_is_a_usage_error():
    assert_usage_error(rayzero("config", "cartpole", "search.num_simulations=0"), "search.num_simulations=0")
