# Shared decode steps of runs 1-3 by whether their worker got work after the other (newcomer) or before it
# (incumbent), and by steps since waking; measured over the repository Xeon profile's isolated time.
import json, sys, numpy as np, math, bisect, collections
from pathlib import Path
from experiments.analysis.calibrate import _repeats, by_worker, shared_shares, busy_intervals
from experiments.sim.stepmodel import LinearStepModel, chunk_features
prof = json.loads(Path("profiles/cpu-intel-r-xeon-r-processor-2c/tiny-float32-1t.json").read_text())
st = prof["step_model"]; m = LinearStepModel(st["coef"], prof["gap"]["gap_coef"], terms=st.get("terms"), factors={})
g = collections.defaultdict(list)
for run in sys.argv[1:]:
    for ident, reqs, steps in _repeats(Path(run)):
        w = by_worker(steps); sh = shared_shares(w, ident["hosts"])
        busy = {k: busy_intervals(v) for k, v in w.items()}
        lay = ident.get("layout")
        for wn, ss in w.items():
            others = [o for o in w if o != wn]
            if len(others) != 1: continue
            ob = busy[others[0]]; ob_starts = [a for a, _ in ob]
            mine = busy[wn]; my_starts = [a for a, _ in mine]
            jj = 0
            for prev, s in zip([None] + ss[:-1], ss):
                jj = 0 if prev is None or not (prev["num_running"] or prev["num_waiting"]) or s["num_prefill_tokens"] else jj + 1
                b, p = s["num_decode_seqs"], s["num_prefill_tokens"]
                if not b or p or sh[id(s)] < 0.9: continue
                # start of my busy stretch containing s, and of the other's containing s's start
                i = bisect.bisect_right(my_starts, s["start_s"]) - 1
                k = bisect.bisect_right(ob_starts, s["start_s"]) - 1
                if i < 0 or k < 0: continue
                newcomer = mine[i][0] > ob[k][0]
                ctx = max(0, s["num_blocks_used"] * 16 - b * 8)
                r = (s["end_s"] - s["start_s"]) / m.time(chunk_features(b, ctx, []))
                g[(lay, "newcomer" if newcomer else "incumbent", "j<6" if jj < 6 else "j6-11" if jj < 12 else "j>=12")].append(r)
for k in sorted(g):
    v = np.array(g[k]); print(*k, len(v), f"median {np.median(v):.3f} p90 {np.percentile(v, 90):.3f}")
