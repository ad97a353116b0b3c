#!/bin/bash
# interleaved rounds: interval 20 (preset) vs 12, seeds 0 1 2
cd /work/main && source .venv/bin/activate
for round in 1 2; do
 for seed in 0 1 2; do
  for iv in 20 12; do
    d=/tmp/cp/r${round}_s${seed}_i${iv}; rm -rf $d
    ov=""; [ $iv != 20 ] && ov="run.eval_interval=$iv"
    load=$(cut -d' ' -f1 /proc/loadavg)
    timeout 700 python -m rayzero train --config cartpole --seed $seed --out $d --time-limit 300 $ov > $d.log 2>&1
    python3 - $d $iv $seed $round $load <<'PY'
import json,sys
d,iv,seed,rnd,load=sys.argv[1:]
t=None
for l in open(d+'/metrics.jsonl'):
    r=json.loads(l)
    if r.get('eval_return_mean') is not None and r['eval_return_mean']>=195: t=r['wall_seconds']; break
print(f"round {rnd} seed {seed} interval {iv}: {t} s (load {load})", flush=True)
PY
  done
 done
done
