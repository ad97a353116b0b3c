"""Channel requests per second that one InferenceServer serves on the CPU, as CPU-search waves send them.

A real InferenceServer runs as a Ray actor on the CPU with a tiny MLP (the network costs next to nothing, so what
is measured is the actor's per-request host work). N channel clients (`channel.InferenceClient`, as self-play's
RemoteNetwork opens them) live in a few client actor processes, several client threads per process (self-play
runs two per actor: one per half of its envs). Each client does rounds as a CPU search does: one `initial` of
R rows, then W `recurrent` requests of R rows (store=True, from handles of the round), then a `release`.

Prints a table (clients, rows per request, recurrent requests/s served, round trip p50/p99) and writes JSON
(machine, versions, date: rayzero.bench.common.write_json).

    nice python scripts/channel_bench.py --clients 2,8,24 --rows 8 --seconds 4 --json runs/channel_bench.json
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from typing import Any

import numpy as np

TICK = os.sysconf("SC_CLK_TCK")


def _thread_names(self: Any) -> tuple[int, dict[int, str]]:
    """Inside the actor (through __ray_call__): its pid and the Python name of each native thread id."""
    import threading

    return os.getpid(), {t.native_id: t.name for t in threading.enumerate()}


def thread_cpu(pid: int, names: dict[int, str]) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of process `pid`, summed by Python thread name (`names`;
    threads Python does not know, Ray's own, are 'other')."""
    out: dict[str, float] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                text = f.read()
        except OSError:
            continue
        name = names.get(int(task), "other")
        fields = text.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return out


class ClientProcess:
    """One client actor: `threads` channel clients, each in its own thread, doing rounds until a deadline."""

    def __init__(self, server: Any, names: list[str], rows: int, obs_dim: int, num_actions: int, waves: int):
        from rayzero.inference.channel import InferenceClient

        self.server, self.names, self.rows, self.waves = server, names, rows, waves
        self.obs_dim, self.num_actions = obs_dim, num_actions
        self.clients = [InferenceClient(server, name, max_rows=rows, obs_rows=rows) for name in names]

    def transports(self) -> list[str]:
        return [c.transport for c in self.clients]

    def _loop(self, i: int, start: float, until: float, out: list) -> None:
        import ray

        client, rng = self.clients[i], np.random.default_rng(i)
        obs = rng.normal(size=(self.rows, self.obs_dim)).astype(np.float32)
        lat, rounds = [], 0
        while time.monotonic() < until:
            root = client.initial(obs)
            frontier = root["handles"]
            for _ in range(self.waves):
                actions = rng.integers(0, self.num_actions, self.rows)
                sent = time.perf_counter_ns()
                step = client.recurrent(frontier, actions, True)
                done = time.perf_counter_ns()
                if start <= time.monotonic() <= until:
                    lat.append(done - sent)
                frontier = step["handles"]
            ray.get(self.server.release.remote(client.client_id))
            rounds += 1
        out[i] = (lat, rounds)

    def run(self, start: float, until: float) -> list[tuple[list[int], int]]:
        out: list[Any] = [None] * len(self.clients)
        threads = [threading.Thread(target=self._loop, args=(i, start, until, out)) for i in range(len(self.clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def close(self) -> None:
        for c in self.clients:
            c.close()


def phase(ray, server, clients: int, procs: int, rows: int, obs_dim: int, num_actions: int, waves: int,
          seconds: float, warmup: float, tag: str, py_spy: str | None = None) -> dict[str, Any]:
    procs = max(1, min(procs, clients))
    names = [f"{tag}-c{i}" for i in range(clients)]
    groups = [names[p::procs] for p in range(procs)]
    actors = [ray.remote(num_cpus=0)(ClientProcess).remote(server, g, rows, obs_dim, num_actions, waves)
              for g in groups]
    transports = sorted({t for ts in ray.get([a.transports.remote() for a in actors]) for t in ts})
    pid, names = ray.get(server.__ray_call__.remote(_thread_names))
    start = time.monotonic() + 0.5 + warmup
    until = start + seconds
    refs = [a.run.remote(start, until) for a in actors]
    time.sleep(max(0.0, start - time.monotonic()))
    before, cpu0 = ray.get(server.stats.remote()), thread_cpu(pid, names)
    if py_spy:  # sample the actor's threads during the window (py-spy must be installed)
        import subprocess

        idle = ["--idle"] if os.environ.get("PYSPY_IDLE") else []  # PYSPY_IDLE=1: waiting threads too
        subprocess.run(["py-spy", "record", "-p", str(pid), "-d", str(max(1, int(seconds) - 1)), "-r", "500",
                        "-f", "raw", "-o", py_spy, "--threads", "--nonblocking", *idle], check=False)
    time.sleep(max(0.0, until - time.monotonic()))
    after, cpu1 = ray.get(server.stats.remote()), thread_cpu(pid, names)
    results = ray.get(refs)
    ray.get([a.close.remote() for a in actors])
    for a in actors:
        ray.kill(a)
    lat = np.array([x for r in results for (lats, _) in r for x in lats], dtype=np.float64) / 1e3  # us
    batches = sum(m["count"] for k, m in after["buckets"].items() if k.startswith("recurrent")) - \
        sum(m["count"] for k, m in before["buckets"].items() if k.startswith("recurrent"))
    requests = sum(m["requests"] for k, m in after["buckets"].items() if k.startswith("recurrent")) - \
        sum(m["requests"] for k, m in before["buckets"].items() if k.startswith("recurrent"))
    served = after["requests"] - before["requests"]
    cpu = {name: round(cpu1[name] - cpu0.get(name, 0.0), 3) for name in cpu1 if cpu1[name] - cpu0.get(name, 0.0) > 0}
    return {"clients": clients, "procs": procs, "rows": rows, "transport": transports,
            "recurrent_per_s": round(len(lat) / seconds, 1), "rows_per_s": round(len(lat) * rows / seconds, 1),
            "rtt_us_p50": round(float(np.percentile(lat, 50)), 1) if len(lat) else None,
            "rtt_us_p99": round(float(np.percentile(lat, 99)), 1) if len(lat) else None,
            "requests_per_batch": round(requests / batches, 2) if batches else None,
            "server_errors": after["errors"] - before["errors"], "loadavg": os.getloadavg(),
            "server_requests": served, "server_cpu_s": cpu,
            "server_cpu_us_per_request": round(1e6 * sum(cpu.values()) / served, 1) if served else None,
            "thread_cpu_us_per_request": {n: round(1e6 * c / served, 1) for n, c in cpu.items()} if served else {}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", default="2,8,24")
    parser.add_argument("--procs", type=int, default=4, help="client actor processes (clients spread over them)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--waves", type=int, default=50, help="recurrent requests per round (simulations)")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--max-wait-us", type=int, default=500, help="inference.max_wait_us (the default config's)")
    parser.add_argument("--switch-us", type=int, default=0,
                        help="experiment: set the actor's sys.setswitchinterval (us; 0 = leave it)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--py-spy", default=None, help="write a py-spy raw profile of the actor (last phase)")
    args = parser.parse_args()

    import ray

    from rayzero.bench.common import write_json
    from rayzero.config import InferenceConfig, ModelConfig
    from rayzero.inference import InferenceServer

    obs_dim, num_actions = 4, 2  # cartpole's shapes
    model = ModelConfig(kind="mlp", latent_dim=32, hidden=64, support_size=10)
    cfg = InferenceConfig(device="cpu", max_batch=512, min_bucket=8, max_wait_us=args.max_wait_us)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows_out = []
    try:
        server = ray.remote(InferenceServer).options(num_cpus=0, max_concurrency=1000).remote(
            model, cfg, (obs_dim,), num_actions, 0)
        ray.get(server.get_version.remote())
        if args.switch_us:
            interval = args.switch_us / 1e6
            ray.get(server.__ray_call__.remote(lambda self: __import__("sys").setswitchinterval(interval)))
        where = ray.get(server.__ray_call__.remote(lambda self: __import__("rayzero").__file__))
        print(f"server's rayzero: {where}")
        print(f"{'clients':>7} {'procs':>5} {'rows':>4} {'req/s':>9} {'p50 us':>8} {'p99 us':>8} {'req/batch':>9} "
              f"{'load':>5} {'cpu us/req':>10}", flush=True)
        for i, clients in enumerate(int(c) for c in args.clients.split(",")):
            r = phase(ray, server, clients, args.procs, args.rows, obs_dim, num_actions, args.waves, args.seconds,
                      args.warmup, f"p{i}", args.py_spy)
            rows_out.append(r)
            print(f"{r['clients']:>7} {r['procs']:>5} {r['rows']:>4} {r['recurrent_per_s']:>9.0f} "
                  f"{r['rtt_us_p50']:>8.0f} {r['rtt_us_p99']:>8.0f} {r['requests_per_batch']!s:>9} "
                  f"{r['loadavg'][0]:>5.2f} {r['server_cpu_us_per_request']!s:>10}  {'/'.join(r['transport'])} "
                  f"errors={r['server_errors']} us/request by thread={r['thread_cpu_us_per_request']}", flush=True)
    finally:
        ray.shutdown()
    write_json(args.json, "channel", {"config": {**vars(args), "model": "mlp latent 32 hidden 64", "device": "cpu",
                                                 "max_batch": cfg.max_batch, "server_rayzero": where},
                                      "phases": rows_out})


if __name__ == "__main__":
    main()
