"""Serving metrics against hand-computed examples: throughputs, goodput, SLO attainment, percentiles."""
import pytest

from experiments.serving.metrics import format_summary, percentiles, summarize


def row(id, arrival_s, prompt_len, output_len, ttft_s=None, e2e_s=None, itl_s=(), end_s=None, status="ok"):
    """A requests.jsonl row with the fields metrics read."""
    if status == "ok":
        end_s = arrival_s + e2e_s
    tpot_s = (e2e_s - ttft_s) / (output_len - 1) if status == "ok" and output_len >= 2 else None
    return {"id": id, "prompt_len": prompt_len, "output_len": output_len, "arrival_s": arrival_s,
            "end_s": end_s, "status": status, "reason": None if status == "ok" else "worker died",
            "ttft_s": ttft_s, "e2e_s": e2e_s, "tpot_s": tpot_s, "itl_s": list(itl_s)}


# a: TTFT 100 ms, E2EL 500 ms, 5 tokens -> TPOT (500-100)/4 = 100 ms; ends at 0.5 s
# b: TTFT 300 ms, E2EL 1500 ms, 4 tokens -> TPOT 1200/3 = 400 ms; ends at 2.0 s
# c: TTFT 200 ms, E2EL 200 ms, 1 token -> no TPOT; ends at 1.2 s
# d: failed at 3.0 s, after arrival at 1.5 s
ROWS = [
    row("a", 0.0, 10, 5, ttft_s=0.1, e2e_s=0.5, itl_s=[0.1, 0.1, 0.1, 0.1]),
    row("b", 0.5, 20, 4, ttft_s=0.3, e2e_s=1.5, itl_s=[0.2, 0.4, 0.6]),
    row("c", 1.0, 30, 1, ttft_s=0.2, e2e_s=0.2),
    row("d", 1.5, 40, 0, end_s=3.0, status="failed"),
]
SLO = dict(slo_ttft_ms=250.0, slo_tpot_ms=200.0)


def test_counts_duration_and_throughputs():
    m = summarize(ROWS, **SLO, num_gpus=2)
    assert (m["num_submitted"], m["num_completed"], m["num_failed"]) == (4, 3, 1)
    assert m["duration_s"] == pytest.approx(3.0)               # last end (d's failure, 3.0) - first arrival (0.0)
    assert m["total_input_tokens"] == 60 and m["total_output_tokens"] == 10   # completed requests only
    assert m["request_throughput"] == pytest.approx(3 / 3.0)
    assert m["output_throughput"] == pytest.approx(10 / 3.0)
    assert m["total_token_throughput"] == pytest.approx(70 / 3.0)


def test_goodput_and_attainment_count_failed_as_misses():
    # a meets both SLOs; b misses TTFT (300 > 250); c meets TTFT and has no TPOT; d failed.
    m = summarize(ROWS, **SLO, num_gpus=2, attainment_target=0.95)
    assert m["goodput"] == pytest.approx(2 / 3.0)
    assert m["goodput_per_gpu"] == pytest.approx(1 / 3.0)
    assert m["slo_attainment"] == pytest.approx(2 / 4)
    assert m["num_gpus"] == 2
    assert m["slo"] == {"ttft_ms": 250.0, "tpot_ms": 200.0, "attainment_target": 0.95}
    # a TPOT SLO of 90 ms drops a (TPOT 100 ms) but not c (one token, no TPOT)
    assert summarize(ROWS, 250.0, 90.0, num_gpus=1)["slo_attainment"] == pytest.approx(1 / 4)


def test_latency_percentiles_over_completed_requests_only():
    m = summarize(ROWS, **SLO, num_gpus=1)
    # TTFT [100, 200, 300]: p90 at index 1.8 -> 200 + 0.8*100; p99 at 1.98
    assert m["ttft_ms"] == pytest.approx({"mean": 200.0, "p50": 200.0, "p90": 280.0, "p99": 298.0})
    # TPOT [100, 400] (c has one token): p90 at index 0.9 -> 100 + 0.9*300
    assert m["tpot_ms"] == pytest.approx({"mean": 250.0, "p50": 250.0, "p90": 370.0, "p99": 397.0})
    # ITL pooled [100, 100, 100, 100, 200, 400, 600]: p50 index 3; p90 index 5.4 -> 400 + 0.4*200
    assert m["itl_ms"] == pytest.approx({"mean": 1600 / 7, "p50": 100.0, "p90": 480.0, "p99": 588.0})
    # E2EL [200, 500, 1500]: p90 index 1.8 -> 500 + 0.8*1000
    assert m["e2el_ms"] == pytest.approx({"mean": 2200 / 3, "p50": 500.0, "p90": 1300.0, "p99": 1480.0})


def test_one_token_output_has_no_tpot_and_meets_tpot_slo():
    rows = [row("x", 0.0, 8, 1, ttft_s=0.05, e2e_s=0.05)]
    m = summarize(rows, slo_ttft_ms=100.0, slo_tpot_ms=0.001, num_gpus=1)
    assert m["tpot_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert m["slo_attainment"] == 1.0 and m["goodput"] == pytest.approx(1 / 0.05)


def test_no_completed_requests_gives_none_and_zero_not_exceptions():
    for rows in ([], [row("d", 0.0, 4, 0, end_s=None, status="failed")],
                 [row("d", 1.0, 4, 0, end_s=2.0, status="failed")]):
        m = summarize(rows, **SLO, num_gpus=4)
        assert m["num_completed"] == 0 and m["num_failed"] == len(rows)
        for key in ("request_throughput", "output_throughput", "total_token_throughput",
                    "goodput", "goodput_per_gpu", "slo_attainment"):
            assert m[key] == 0.0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert m[key] == {"mean": None, "p50": None, "p90": None, "p99": None}
        assert "n/a" in format_summary(m)
    assert summarize([], **SLO, num_gpus=1)["duration_s"] == 0.0


def test_percentiles_match_numpy_linear_interpolation():
    assert percentiles([4.0]) == {"mean": 4.0, "p50": 4.0, "p90": 4.0, "p99": 4.0}
    # [1, 2, 3, 4, 10]: p90 at index 3.6 -> 4 + 0.6*6; p99 at index 3.96 -> 4 + 0.96*6
    assert percentiles([10, 1, 3, 2, 4]) == pytest.approx({"mean": 4.0, "p50": 3.0, "p90": 7.6, "p99": 9.76})
    assert percentiles(iter([])) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_format_summary_reads_like_vllm_bench_serve():
    text = format_summary(summarize(ROWS, **SLO, num_gpus=2))
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    for label, value in [("Successful requests:", "3"), ("Failed requests:", "1"),
                         ("Benchmark duration (s):", "3.00"), ("Total input tokens:", "60"),
                         ("Total generated tokens:", "10"), ("Request throughput (req/s):", "1.00"),
                         ("Output token throughput (tok/s):", "3.33"),
                         ("Total Token throughput (tok/s):", "23.33"),
                         ("Request goodput (req/s):", "0.67"), ("Goodput per GPU (req/s):", "0.33"),
                         ("Mean TTFT (ms):", "200.00"), ("Median TTFT (ms):", "200.00"),
                         ("P90 TTFT (ms):", "280.00"), ("P99 TTFT (ms):", "298.00"),
                         ("Mean TPOT (ms):", "250.00"), ("P99 ITL (ms):", "588.00"),
                         ("Median E2EL (ms):", "500.00")]:
        assert f"{label:<40} {value}" in lines
    assert any(ln.startswith(f"{'SLO attainment:':<40} 50.00%") for ln in lines)
    for section in ("Time to First Token", "Time per Output Token (excl. 1st token)",
                    "Inter-token Latency", "End-to-end Latency"):
        assert f"{section:-^50}" in lines
    titled = format_summary(summarize(ROWS, **SLO, num_gpus=2), title="colocated")
    assert titled.splitlines()[0] == "=" * 19 + " colocated " + "=" * 20
