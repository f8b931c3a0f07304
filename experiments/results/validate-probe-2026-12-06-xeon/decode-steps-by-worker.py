# Decode steps by worker (and over both workers: "all"), by alone / shared as the later (newcomer) or earlier
# (incumbent) busy worker, and by steps since waking, over the repository Xeon profile's isolated time.
# Run from the repository root: python experiments/results/validate-probe-2026-12-06-xeon/decode-steps-by-worker.py RUN_DIR...
import json, sys, numpy as np, collections, bisect
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
            ob = busy[others[0]] if others else []; obs = [a for a, _ in ob]
            mine = busy[wn]; ms = [a for a, _ in mine]
            j = 0
            for prev, s in zip([None] + ss[:-1], ss):
                j = 0 if prev is None or not (prev["num_running"] or prev["num_waiting"]) or s["num_prefill_tokens"] else j + 1
                b, p = s["num_decode_seqs"], s["num_prefill_tokens"]
                if not b or p: continue
                ctx = max(0, s["num_blocks_used"] * 16 - b * 8)
                r = (s["end_s"] - s["start_s"]) / m.time(chunk_features(b, ctx, []))
                f = sh[id(s)]
                if f <= 0.1: state = "alone"
                elif f >= 0.9:
                    i = bisect.bisect_right(ms, s["start_s"]) - 1; k = bisect.bisect_right(obs, s["start_s"]) - 1
                    state = "newcomer" if (i >= 0 and k >= 0 and mine[i][0] > ob[k][0]) else "incumbent"
                else: continue
                jb = "j<3" if j < 3 else "j3-11" if j < 12 else "j>=12"
                g[(lay, wn, state, jb)].append(r)
                g[(lay, "all", state, jb)].append(r)
for k in sorted(g):
    v = np.array(g[k])
    if len(v) >= 15: print(*k, len(v), f"median {np.median(v):.3f} p90 {np.percentile(v, 90):.3f}")
