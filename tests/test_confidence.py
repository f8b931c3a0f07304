"""Within-run intervals resample requests (a request's gaps together), across-repeat aggregation from the
files alone; hand-worked cases where every bootstrap outcome can be listed."""
import json

import numpy as np
import pytest

from experiments.serving import aggregate
from experiments.serving.confidence import HEADLINE, replicates, request_replicates, step_replicates, within_run_ci
from experiments.serving.metrics import summarize
from experiments.serving.steps import step_ratio


def row(i, ttft_s, gaps, arrival_s=0.0, status="ok"):
    n = len(gaps) + 1 if status == "ok" else 0
    e2e = ttft_s + sum(gaps) if status == "ok" else None
    return {"id": f"r{i}", "prompt_len": 8, "output_len": n, "arrival_s": arrival_s,
            "end_s": arrival_s + (e2e if status == "ok" else 1.0), "status": status,
            "ttft_s": ttft_s if status == "ok" else None, "e2e_s": e2e, "itl_s": list(gaps) if status == "ok" else []}


def reps_of(rows, duration=2.0, slo=(250.0, 100.0)):
    return request_replicates(rows, *slo, num_gpus=2, duration_s=duration, rng=np.random.default_rng(0), num=400)


def test_two_requests_give_every_bootstrap_outcome_by_hand():
    # a: TTFT 100 ms, gaps [10, 10] ms, meets the SLO; b: TTFT 300 ms (misses TTFT <= 250), gap [30] ms.
    reps = reps_of([row(0, 0.1, [0.01, 0.01]), row(1, 0.3, [0.03])])
    # resamples: (a, a) p 1/4, (a, b) p 1/2, (b, b) p 1/4
    assert set(np.round(reps["ttft_ms.p50"], 6)) == {100.0, 200.0, 300.0}
    # ITL: a's two gaps travel together: (a,a) -> [10]*4, (a,b) -> [10, 10, 30], (b,b) -> [30, 30]
    assert set(np.round(reps["itl_ms.mean"], 6)) == {10.0, round(50 / 3, 6), 30.0}
    assert set(np.round(reps["itl_ms.p50"], 6)) == {10.0, 30.0}
    assert set(reps["goodput"]) == {1.0, 0.5, 0.0}                 # good requests drawn / 2 s
    assert set(reps["goodput_per_gpu"]) == {0.5, 0.25, 0.0}
    assert set(reps["slo_attainment"]) == {1.0, 0.5, 0.0}
    assert set(reps["request_throughput"]) == {1.0}                 # both completed: always 2 / 2 s


def test_failed_requests_count_as_misses_and_have_no_latency():
    reps = reps_of([row(0, 0.1, [0.01]), row(1, None, [], status="failed")])
    assert set(reps["slo_attainment"]) == {1.0, 0.5, 0.0}
    assert np.isnan(reps["ttft_ms.p50"]).any()                      # (failed, failed): no TTFT at all
    assert set(reps["ttft_ms.p50"][~np.isnan(reps["ttft_ms.p50"])]) == {100.0}


def test_identical_requests_give_a_zero_width_interval_at_the_value():
    rows = [row(i, 0.05, [0.004] * 5, arrival_s=0.1 * i) for i in range(20)]
    metrics = summarize(rows, 250.0, 100.0, 2) | {"step_ratio": {"ratio": None}}
    ci = within_run_ci(replicates(rows, [], metrics, 0), metrics)
    assert ci["ttft_ms.p50"] == pytest.approx([50.0, 50.0]) and ci["itl_ms.p99"] == pytest.approx([4.0, 4.0])
    assert ci["step_ratio.ratio"] is None                           # no steps: no value, no interval
    assert set(ci) == set(HEADLINE)


def step(worker, t, ms, prefill_tokens, decode_seqs=4):
    return {"worker": worker, "start_s": t, "end_s": t + ms / 1000, "num_prefill_tokens": prefill_tokens,
            "num_decode_seqs": decode_seqs}


def test_step_ratio_pools_workers_that_ran_both_kinds():
    steps = [step("c:0", k, 2.0, 0) for k in range(10)] + [step("c:0", 20 + k, 6.0, 64) for k in range(5)]
    steps += [step("d:0", 40 + k, 50.0, 0) for k in range(5)]       # decode-only worker: left out
    steps += [step("p:0", 60, 80.0, 512, decode_seqs=0)]            # prefill-only step: left out
    assert step_ratio(steps)["ratio"] == pytest.approx(3.0)
    assert step_replicates(steps, np.random.default_rng(0), num=50) == pytest.approx(np.full(50, 3.0))
    assert step_ratio(steps[:10])["ratio"] is None


def write_repeat(d, index, ttft_ms, *, fail=False, point=None):
    point = point or {"label": "P"}
    d.mkdir(parents=True)
    if fail:
        (d / "error.json").write_text(json.dumps({"error": "RuntimeError: boom", "point": point}))
        return
    rows = [row(i, ttft_ms / 1000 * (1 + 0.01 * i), [0.005] * 4, arrival_s=0.2 * i) for i in range(30)]
    steps = [step("c:0", k, 2.0, 0) for k in range(10)] + [step("c:0", 20 + k, 2.0 * index + 4, 64) for k in range(5)]
    metrics = summarize(rows, 250.0, 100.0, 2) | {"step_ratio": step_ratio(steps), "point": point,
                                                   "repeat": index, "machine": {"cores": 2, "load_1m_end": 1.0 + index,
                                                                                "overloaded": index == 2}}
    (d / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (d / "metrics.json").write_text(json.dumps(metrics))


def test_point_metrics_are_medians_over_repeats_with_their_values_and_intervals(tmp_path):
    point = tmp_path / "p"
    for i, ttft in enumerate((40.0, 60.0, 50.0)):
        write_repeat(point / f"rep{i}", i, ttft)
    write_repeat(point / "rep3", 3, 0.0, fail=True)
    m = aggregate.write(point)
    assert m["repeats"] == {"num_ok": 3, "num_failed": 1, "dirs": ["rep0", "rep1", "rep2"],
                            "failed": [{"dir": "rep3", "error": "RuntimeError: boom"}]}
    values = m["repeat_values"]["ttft_ms.p50"]
    assert m["ttft_ms"]["p50"] == pytest.approx(np.median(values)) and len(values) == 3
    lo, hi = m["ci"]["ttft_ms.p50"]
    assert lo <= min(values) and hi >= max(values) - 1   # the repeats spread 40..60 ms; the interval spans them
    assert m["step_ratio"]["ratio"] == pytest.approx(3.0)  # ratios 2, 3, 4 -> median 3
    assert m["machine"]["load_1m_end_max"] == 3.0 and m["machine"]["overloaded"] is True
    assert json.loads((point / "metrics.json").read_text()) == json.loads(json.dumps(m))
    # the same files give the same intervals (seeded), e.g. when the report rebuilds a cut-short run
    assert aggregate.aggregate(point)["ci"] == m["ci"]
    assert aggregate.aggregate(point, limit=2)["repeats"]["dirs"] == ["rep0", "rep1"]


def test_point_whose_repeats_all_failed_gets_error_json(tmp_path):
    point = tmp_path / "p"
    write_repeat(point / "rep0", 0, 0.0, fail=True)
    (point / "metrics.json").write_text("{}")                       # a stale aggregate goes
    result = aggregate.write(point)
    assert result["error"] == "RuntimeError: boom" and not (point / "metrics.json").exists()
    assert json.loads((point / "error.json").read_text())["point"] == {"label": "P"}
