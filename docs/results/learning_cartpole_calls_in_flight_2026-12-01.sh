#!/bin/bash
# one round, interleaved seed by seed: learner.calls_in_flight 2 (the new default) vs 1, seeds 0 1 2
cd /work/main && source .venv/bin/activate
mkdir -p /tmp/cpq
for seed in 0 1 2; do
  for n in 2 1; do
    d=/tmp/cpq/s${seed}_c${n}; rm -rf $d
    load=$(cut -d' ' -f1 /proc/loadavg)
    timeout 700 python -m rayzero train --config cartpole --seed $seed --out $d --time-limit 300 learner.calls_in_flight=$n > $d.log 2>&1
    python3 - $d $n $seed $load <<'PY'
import json,sys
d,n,seed,load=sys.argv[1:]
t=None
for l in open(d+'/metrics.jsonl'):
    r=json.loads(l)
    if r.get('eval_return_mean') is not None and r['eval_return_mean']>=195: t=r['wall_seconds']; break
print(f"seed {seed} calls_in_flight {n}: {t} s (load {load})", flush=True)
PY
  done
done
