# Decode steps of runs 1-6 (given as arguments) by steps since their worker woke from idle: measured over the
# profile's isolated time (the repository's Xeon profile, uncalibrated). Run from the repository root:
#   python experiments/results/validate-probe-2026-12-06-xeon/decode-steps-after-waking.py RUN_DIR...
import json, sys, numpy as np, collections
from pathlib import Path
from experiments.analysis.calibrate import _repeats, by_worker, shared_shares
from experiments.sim.stepmodel import LinearStepModel, chunk_features
prof = json.loads(Path("profiles/cpu-intel-r-xeon-r-processor-2c/tiny-float32-1t.json").read_text())
st = prof["step_model"]; m = LinearStepModel(st["coef"], prof["gap"]["gap_coef"], terms=st.get("terms"))
g = collections.defaultdict(list)
for run in sys.argv[1:]:
    for ident, reqs, steps in _repeats(Path(run)):
        w = by_worker(steps); sh = shared_shares(w, ident["hosts"])
        lay = ident.get("layout")
        whole = ident.get("mode") == "disaggregated" or ident.get("policy") == "prefill_first"
        for wn, ss in w.items():
            k = 99; prev = None; idle_len = 0
            for s in ss:
                b, p = s["num_decode_seqs"], s["num_prefill_tokens"]
                idle = prev is None or not (prev["num_running"] or prev["num_waiting"])
                if idle: idle_len = s["start_s"] - prev["end_s"] if prev else 9
                k = 0 if idle else k + 1
                cls = "alone" if sh[id(s)] <= .1 else "shared" if sh[id(s)] >= .9 else "mid"
                meas = s["end_s"] - s["start_s"]
                if b and not p:
                    ctx = max(0, s["num_blocks_used"] * 16 - b * 8)
                    pred = m.time(chunk_features(b, ctx, []))
                    g[("dec", lay, cls, min(k, 6))].append(meas / pred)
                    if k <= 1: g[("dec-by-idle", lay, cls, k, "idle<20ms" if idle_len < .02 else "idle<100ms" if idle_len < .1 else "idle>=100ms")].append(meas / pred)
                elif p and not b and s["num_prefill_seqs"] == 1 and whole:
                    pred = m.time(chunk_features(0, 0, [(p, 0, True)]))
                    g[("pre", lay, cls, min(k, 1))].append(meas / pred)
                prev = s
for key in sorted(g):
    v = np.array(g[key])
    if len(v) < 15 or key[2] == "mid": continue
    print(*key, f"n={len(v):5d} ratio {np.median(v):.3f}")
