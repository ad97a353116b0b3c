"""The inference actor's host work per recurrent batch of N channel requests (issue 15): the poller's
`_wave_requests`, the GPU thread's `_launch` and `_finish`, medians, in one process (no Ray, no threads), with
cpu_search_profile's fake network (no device work), so only the per-request and per-batch bookkeeping is timed.

    python scripts/wave_host_cost.py [ROWS]     # 1, 2, 10, 24 requests of ROWS rows (default 8)
"""
import os
import sys
import time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
from rayzero.config import InferenceConfig, ModelConfig  # noqa: E402
from rayzero.inference.server import InferenceServer  # noqa: E402
from rayzero.inference import channel as channels  # noqa: E402
import cpu_search_profile as prof  # noqa: E402

def main(nreq, rows, iters=400):
    model = ModelConfig(kind="mlp", latent_dim=8, hidden=16, support_size=5)
    srv = InferenceServer(model, InferenceConfig(device="cpu", max_batch=4096), (4,), 2, 0)
    prof._fake_network(srv.runner, 0.0)
    chans = [channels.create(f"c{i}", 4 * rows, rows, (4,), np.float32, 2)[0] for i in range(nreq)]
    def fresh():
        for c in chans:
            srv.pool.release(c.client)
            c.arrays["handles"][:rows] = srv.pool.allocate(c.client, rows)
            c.arrays["actions"][:rows] = 1
    fresh()
    ts = []
    for it in range(iters):
        seqs = []
        for c in chans:
            h = c.header
            h[channels.KIND], h[channels.ROWS], h[channels.STORE] = channels.RECURRENT, rows, 1
            h[channels.REQ] += 1
            seqs.append((c, int(h[channels.REQ])))
        t0 = time.perf_counter()
        reqs = srv._wave_requests([(c, s, rows, True) for c, s in seqs])
        t1 = time.perf_counter()
        batch = srv._launch("recurrent", reqs)
        t2 = time.perf_counter()
        srv._finish(batch)
        t3 = time.perf_counter()
        assert all(r is not None and not isinstance(r, Exception) for r in batch.results), batch.results
        ts.append((t1 - t0, t2 - t1, t3 - t2))
        if it % 50 == 49:
            fresh()
    a = 1e6 * np.median(np.array(ts[20:]), axis=0)
    print(f"{nreq:3d} req x {rows:2d} rows: wave_requests {a[0]:6.1f}  launch {a[1]:6.1f}  finish {a[2]:6.1f}  "
          f"per request {a.sum()/nreq:5.1f} us", flush=True)

if __name__ == "__main__":
    for nreq in (1, 2, 10, 24):
        main(nreq, int(sys.argv[1]) if len(sys.argv) > 1 else 8)
