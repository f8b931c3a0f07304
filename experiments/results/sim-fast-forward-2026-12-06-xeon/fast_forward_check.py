"""Fast-forwarded against step-by-step simulation on the same requests, record by record.

python fast_forward_check.py N GPUS RATE_PER_GPU LAYOUT [overrides...]   (run from a checkout's root, PYTHONPATH=.)
Prints each mode's wall time, then how many requests.jsonl rows differ (floats within 1e-9 relative) and in which fields.
"""
import dataclasses, sys, time
import numpy as np
from experiments.compose import compose_config
from experiments.config import apply_layout, parse
from experiments.sim.backend import costs_for, simulate
from experiments.sim.records import request_row
from experiments.workload import build_workload
n, g, rate, layout = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
extra = sys.argv[5:]
cfg = compose_config("config", ["compare=null", f"cluster.gpus={g}", *extra])
spec = parse(apply_layout(cfg, layout))
w = dataclasses.replace(spec.workload, num_requests=n, rate=rate * g)
arr = build_workload(w, spec.vocab_size, spec.max_model_len, spec.seed, token_ids=False)
costs = costs_for(spec)
res = {}
def rnd(x):
    if isinstance(x, float): return x
    if isinstance(x, list): return [rnd(v) for v in x]
    if isinstance(x, dict): return {k: rnd(v) for k, v in x.items()}
    return x
for ff in (True, False):
    t = time.perf_counter()
    sim = simulate(spec, arr, costs, record_steps=False, keep_tokens=True, fast_forward=ff)
    res[ff] = {r.id: rnd(request_row(r)) for r in sim.records.values()}
    print(ff, f"{time.perf_counter() - t:.1f} s", sum(r.status == "ok" for r in sim.records.values()), costs.source)
a, b = res[True], res[False]
def same(x, y):
    if isinstance(x, float) and isinstance(y, float): return abs(x - y) <= 1e-9 + 1e-9 * abs(x)
    if isinstance(x, list) and isinstance(y, list): return len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))
    if isinstance(x, dict) and isinstance(y, dict): return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    return x == y
bad = [k for k in a if not same(a[k], b[k])]
fields = {}
for k in bad:
    for f in a[k]:
        if not same(a[k][f], b[k][f]): fields[f] = fields.get(f, 0) + 1
print({"layout": layout, "extra": extra, "differ": len(bad), "fields": fields})
if bad:
    k = bad[0]; print(k, {f: (a[k][f], b[k][f]) for f in a[k] if not same(a[k][f], b[k][f])})
