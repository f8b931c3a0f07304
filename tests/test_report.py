"""experiments.report rebuilds report.md, figures and CSVs from docs/run-directory.md run directories alone.

The fixtures are synthesized here with known numbers (step durations, goodputs, attainments), so the
tests can assert the exact figures the report must print.
"""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments.report import report
from experiments.report.report import fmt

ROOT = Path(__file__).resolve().parent.parent
SLO = {"ttft_ms": 200.0, "tpot_ms": 50.0, "attainment_target": 0.9}


def _pcts(xs):
    xs = [1000 * x for x in xs]
    return {"mean": float(np.mean(xs)), **{f"p{q}": float(np.percentile(xs, q)) for q in (50, 90, 99)}}


def write_point(d: Path, label: str, *, mode=None, policy="chunked", workers=("colocated:0", "colocated:1"),
                rate=4.0, overrides=(), goodput=3.0, attainment=0.95, num_requests=20, ttft_ms=50.0,
                tpot_ms=20.0, transfer_ms=None, decode_ms=10.0, mixed_ms=80.0, steps=True, requests=True,
                extra=None):
    """One docs/run-directory.md point. Requests: 8 tokens each (the last one 1 token), TTFT from ttft_ms up to
    twice that, every gap tpot_ms plus transfer_ms on the first gap when the KV moved. Steps per worker:
    decode-only steps of decode_ms, every 5th step mixed (mixed_ms, 128 prefill tokens) on colocated
    workers, prefill-only steps on prefill workers."""
    d.mkdir(parents=True)
    num_gpus, mode = len(workers), mode or ("disaggregated" if transfer_ms else "colocated")
    info = {"label": label, "layout": "disaggregated" if transfer_ms else "colocated", "mode": mode, "policy": policy,
            "token_budget": 512, "prefill_workers": sum(w.startswith("prefill") for w in workers),
            "decode_workers": sum(w.startswith("decode") for w in workers), "workers": num_gpus,
            "num_gpus": num_gpus, "transfer": "zmq" if transfer_ms else None, "rate": rate, "workload": "synthetic",
            "model": "tiny-llama", "device": "cpu", "overrides": overrides}
    reqs = []
    for i in range(num_requests):
        n_out = 1 if i == num_requests - 1 else 8
        ttft = ttft_ms * (1 + i / num_requests) / 1000
        itl = [tpot_ms / 1000] * (n_out - 1)
        if transfer_ms and itl:
            itl[0] += transfer_ms / 1000
        e2e = ttft + sum(itl)
        reqs.append({"id": f"r{i}", "prompt_len": 64, "output_len": n_out, "output_ids": list(range(n_out)),
                     "max_tokens": n_out, "arrival_s": 0.25 * i, "end_s": 0.25 * i + e2e, "status": "ok",
                     "reason": None, "finish_reason": "length", "ttft_s": ttft, "e2e_s": e2e,
                     "tpot_s": (e2e - ttft) / (n_out - 1) if n_out > 1 else None, "itl_s": itl, "itl_ms": None,
                     "prefill_worker": workers[0], "decode_worker": workers[-1],
                     "transfer_bytes": 1 << 20 if transfer_ms else 0,
                     "transfer_s": transfer_ms / 1000 if transfer_ms else None, "queue_s": 0.01,
                     "prefill_s": ttft - 0.01, "handoff_s": None, "decode_s": None, "attempts": 1})
    reqs.append({"id": "lost", "status": "failed", "reason": "worker died", "output_len": 0, "itl_s": [],
                 "ttft_s": None, "tpot_s": None, "transfer_bytes": 0, "future_key": 1})
    ok = [r for r in reqs if r["status"] == "ok"]
    metrics = {"num_submitted": len(reqs), "num_completed": len(ok), "num_failed": 1, "duration_s": 6.0,
               "request_throughput": len(ok) / 6.0, "output_throughput": sum(r["output_len"] for r in ok) / 6.0,
               "total_token_throughput": 100.0, "goodput": goodput, "goodput_per_gpu": goodput / num_gpus,
               "slo_attainment": attainment, "num_gpus": num_gpus,
               "ttft_ms": _pcts([r["ttft_s"] for r in ok]),
               "tpot_ms": _pcts([r["tpot_s"] for r in ok if r["tpot_s"] is not None]),
               "itl_ms": _pcts([g for r in ok for g in r["itl_s"]]), "e2el_ms": _pcts([r["e2e_s"] for r in ok]),
               "slo": SLO, "point": info, "an_unknown_key": {"ignored": True}} | (extra or {})
    (d / "metrics.json").write_text(json.dumps(metrics))
    (d / "config.yaml").write_text(f"label: {label}\n")
    if requests:
        (d / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reqs))
    if steps:
        rows = []
        for w in workers:
            t = 0.0
            for k in range(30):
                prefill_only = w.startswith("prefill")
                mixed = not prefill_only and not w.startswith("decode") and k % 5 == 0
                dur = (mixed_ms if mixed or prefill_only else decode_ms) / 1000
                rows.append({"worker": w, "step": k, "start_s": t, "end_s": t + dur,
                             "num_prefill_tokens": 128 if mixed or prefill_only else 0, "num_prefill_seqs": 1,
                             "num_decode_seqs": 0 if prefill_only else 4, "num_tokens": 132, "num_blocks_used": 8,
                             "num_running": 4, "num_waiting": 0, "num_preempted": 0})
                t += dur + 0.005
        (d / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def write_failed(d: Path, label: str):
    d.mkdir(parents=True)
    (d / "error.json").write_text(json.dumps({
        "error": "RuntimeError: KV transfer \x1b[36mtimed out\x1b[39m\n  middle line not shown\nValueError: root cause",
        "traceback": "Traceback ...",
        "point": {"label": label, "mode": "disaggregated", "num_gpus": 4, "rate": 4.0}}))


def comparison_run(root: Path) -> Path:
    run = root / "comparison"
    write_point(run / "colocated_prefill_first", "colocated prefill_first x2", policy="prefill_first",
                goodput=3.25, attainment=0.8125)
    write_point(run / "colocated_chunked", "colocated chunked x2", goodput=2.75, mixed_ms=30.0)
    write_point(run / "disagg_zmq", "1P1D zmq", mode="disaggregated", workers=("prefill:0", "decode:0"),
                goodput=3.75, attainment=0.96875, transfer_ms=5.0)
    write_point(run / "no_steps", "1P1D nccl", mode="disaggregated", workers=("prefill:0", "decode:0"),
                transfer_ms=2.0, steps=False, goodput=1.5)
    (write_point(run / "empty", "2P2D zmq", mode="disaggregated", requests=False, goodput=float("nan"),
                 workers=("prefill:0", "prefill:1", "decode:0", "decode:1")) / "requests.jsonl").write_text("")
    write_failed(run / "crashed", "3P1D nccl")
    return run


def sweep_run(root: Path) -> Path:
    """A nested Hydra multirun: two configs x rates 1, 2, 4. Colocated meets the 90 % target up to 2 req/s;
    1P1D meets it at every rate."""
    run = root / "multirun" / "2024-05-01" / "10-00-00"
    attain = {"colocated chunked x2": [0.99, 0.93, 0.5], "1P1D zmq": [1.0, 0.97, 0.91]}
    job = 0
    for label, values in attain.items():
        for rate, a in zip((1.0, 2.0, 4.0), values):
            d = write_point(run / str(job), label, rate=rate, attainment=a, goodput=a * rate,
                            workers=("prefill:0", "decode:0") if "P" in label else ("colocated:0", "colocated:1"),
                            transfer_ms=3.0 if "P" in label else None,
                            overrides=f"cluster.gpus=2,workload.rate={rate:g},{label.split()[0]}")
            (d / ".hydra").mkdir()
            (d / ".hydra" / "overrides.yaml").write_text("- workload.rate=1\n")
            job += 1
    return root / "multirun"


def assert_png(path: Path):
    assert path.is_file(), path
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_comparison_report(tmp_path, capsys):
    run = comparison_run(tmp_path)
    assert report.main([str(run)]) == 0
    result = last_json(capsys.readouterr().out)
    assert result["num_points"] == 6 and result["num_failed"] == 1
    files = [Path(f) for f in result["files"]]
    assert all(f.is_file() for f in files)
    for png in (f for f in files if f.suffix == ".png"):
        assert_png(png)
    names = {f.name for f in files}
    assert {"report.md", "summary.csv", "ttft_cdf.png", "tpot_cdf.png", "itl_cdf.png", "comparison.png", "ttft_breakdown.png",
            "breakdown.csv", "steps_summary.csv", "timeline_colocated_prefill_first_x2.png",
            "timeline_1P1D_zmq.png"} <= names
    assert not any(n.endswith("rate.png") for n in names)  # one rate only: no rate sweep figures

    md = (run / "report.md").read_text()
    for label in ("colocated prefill_first x2", "colocated chunked x2", "1P1D zmq", "1P1D nccl", "2P2D zmq"):
        assert f"**{label}**" in md
    assert "| 3.25 | 1.62 | 81.2 |" in md     # goodput, goodput/GPU, SLO attainment % of the first point
    assert "| 3.75 | 1.88 | 96.9 |" in md
    assert "| n/a |" in md                     # the NaN goodput
    assert "**Model:** tiny-llama" in md and "**Device:** cpu" in md
    assert "| 3P1D nccl | crashed | RuntimeError: KV transfer timed out | ValueError: root cause |" in md
    assert "middle line not shown" not in md
    # Interference: decode-only steps 10 ms, mixed 80 ms -> 8.00; the chunked point's mixed steps are 30 ms.
    assert "| colocated prefill_first x2 | colocated:0 | 10.0 | 80.0 | 80.0 | 8.00 | 128 | 24 | 6 | 0 |" in md
    assert "| colocated chunked x2 | colocated:1 | 10.0 | 30.0 | 30.0 | 3.00 |" in md
    assert "| 1P1D zmq | prefill:0 | n/a | n/a | n/a | n/a | n/a | 0 | 0 | 30 |" in md
    assert "1P1D nccl: steps.jsonl missing or empty" in md
    assert "2P2D zmq: no completed requests with TTFT" in md

    with (run / "summary.csv").open() as f:
        rows = {r["label"]: r for r in csv.DictReader(f)}
    assert len(rows) == 6
    assert float(rows["colocated prefill_first x2"]["goodput"]) == 3.25
    assert float(rows["1P1D zmq"]["slo_attainment"]) == 0.96875
    assert float(rows["1P1D zmq"]["ttft_ms_p50"]) > 0 and rows["1P1D zmq"]["point_mode"] == "disaggregated"
    assert rows["3P1D nccl"]["status"] == "failed" and "KV transfer timed out" in rows["3P1D nccl"]["error"]

    with (run / "breakdown.csv").open() as f:
        parts = {r["label"]: r for r in csv.DictReader(f)}
    zmq = parts["1P1D zmq"]
    assert int(zmq["num_requests"]) == 19      # the 1-token request and the failed one are skipped
    assert abs(float(zmq["queue_ms"]) - 10.0) < 1e-9 and abs(float(zmq["exposed_ms"]) - 5.0) < 1e-9
    assert abs(float(zmq["first_decode_ms"]) - 20.0) < 1e-9   # itl[0] (25 ms) minus the 5 ms transfer
    assert abs(float(parts["colocated chunked x2"]["first_decode_ms"]) - 20.0) < 1e-9


def test_breakdown_puts_only_the_exposed_transfer_on_the_critical_path():
    from experiments.report.plots import first_decode_breakdown
    bulk = {"status": "ok", "itl_s": [0.030, 0.010], "queue_s": 0.0, "prefill_s": 0.1,
            "transfer_bytes": 1 << 20, "transfer_s": 0.020}                    # no exposed field: all of it
    streamed = bulk | {"exposed_transfer_s": 0.002}                              # 18 ms hid behind the prefill
    early = bulk | {"exposed_transfer_s": -0.001}                                # landed before the prefill ended
    local = bulk | {"transfer_bytes": 0, "transfer_s": None}
    rows = {k: first_decode_breakdown([r]) for k, r in
            (("bulk", bulk), ("streamed", streamed), ("early", early), ("local", local))}
    assert rows["bulk"]["exposed_ms"] == pytest.approx(20.0) and rows["bulk"]["first_decode_ms"] == pytest.approx(10.0)
    assert rows["streamed"]["exposed_ms"] == pytest.approx(2.0)
    assert rows["streamed"]["first_decode_ms"] == pytest.approx(28.0)
    assert rows["streamed"]["transfer_ms"] == pytest.approx(20.0)                # the bulk time stays beside it
    assert rows["early"]["exposed_ms"] == 0.0 and rows["early"]["first_decode_ms"] == pytest.approx(30.0)
    assert rows["local"]["exposed_ms"] == 0.0 and rows["local"]["transfer_ms"] == 0.0
    for r in rows.values():
        assert r["total_ms"] == pytest.approx(r["queue_ms"] + r["prefill_ms"] + r["exposed_ms"] + r["first_decode_ms"])


def test_rate_sweep_multirun_subprocess(tmp_path):
    run, out = sweep_run(tmp_path), tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "experiments.report", str(run), "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    result = last_json(proc.stdout)
    assert result["num_points"] == 6 and result["num_failed"] == 0 and result["out"] == str(out)
    for name in ("goodput_vs_rate.png", "attainment_vs_rate.png", "ttft_cdf.png", "comparison.png"):
        assert_png(out / name)
    assert str(out / "goodput_vs_rate.png") in result["files"]
    md = (out / "report.md").read_text()
    assert "**colocated chunked x2, rate=2**" in md and "**1P1D zmq, rate=4**" in md
    assert "| colocated chunked x2 | 1, 2, 4 | 2 | 1.00 |" in md
    assert "| 1P1D zmq | 1, 2, 4 | 4 | 2.00 |" in md
    timelines = sorted(p.name for p in out.glob("timeline_*.png"))
    assert len(timelines) == 6 and "timeline_colocated_chunked_x2_rate_1.png" in timelines
    assert not (run / "report.md").exists()   # --out was honoured


def test_highest_rate_none_and_over_eight_timelines(tmp_path, capsys):
    run = tmp_path / "sweep"
    for i, rate in enumerate((1, 2, 3, 4, 5, 6, 7, 8, 9)):
        write_point(run / f"r{rate}", "colocated chunked x2", rate=float(rate), attainment=0.5, num_requests=4)
    assert report.main([str(run)]) == 0
    md = (run / "report.md").read_text()
    assert "| colocated chunked x2 | 1, 2, 3, 4, 5, 6, 7, 8, 9 | none | n/a |" in md
    assert len(list(run.glob("timeline_*.png"))) == 8
    assert "timelines drawn for the first 8 points by label, of 9" in md
    assert "r10" not in md and "`r9`" in md     # natural directory order


def test_single_point_without_records(tmp_path, capsys):
    point = write_point(tmp_path / "p", "lonely", requests=False, steps=False,
                        extra={"ttft_ms": {"mean": None, "p50": float("nan"), "p90": None, "p99": None}})
    assert report.main([str(point)]) == 0
    result = last_json(capsys.readouterr().out)
    assert result["num_points"] == 1 and [Path(f).name for f in result["files"]] == ["report.md", "summary.csv"]
    md = (point / "report.md").read_text()
    assert "**lonely** (`.`)" in md and "| n/a | n/a |" in md
    assert "lonely: steps.jsonl missing or empty" in md


def test_labels_unique_and_no_points(tmp_path, capsys):
    run = tmp_path / "run"
    write_point(run / "a", "colocated chunked x2", overrides=["worker.token_budget=256"], num_requests=3)
    write_point(run / "b", "colocated chunked x2", overrides=["worker.token_budget=512"], num_requests=3)
    write_point(run / "c", "twin", num_requests=3)
    write_point(run / "d", "twin", num_requests=3)
    points = report.find_points(run)
    report.label_points(points)
    assert [p.label for p in points] == ["colocated chunked x2, worker.token_budget=256",
                                         "colocated chunked x2, worker.token_budget=512", "twin [c]", "twin [d]"]
    assert report.swept({"rate": 2.0, "overrides": "a.b=[1,2],workload.rate=2,colocated-chunked"}) == \
        {"rate": "2", "a.b": "[1,2]"}
    assert report.main([str(tmp_path / "empty_dir_that_is_missing")]) == 1
    assert last_json(capsys.readouterr().out)["num_points"] == 0


def test_only_failed_points(tmp_path, capsys):
    write_failed(tmp_path / "run" / "a", "3P1D nccl")
    (tmp_path / "run" / "b").mkdir()
    (tmp_path / "run" / "b" / "metrics.json").write_text("{not json")
    assert report.main([str(tmp_path / "run")]) == 0
    assert last_json(capsys.readouterr().out) | {"out": None, "files": []} == \
        {"out": None, "files": [], "num_points": 2, "num_failed": 2}
    md = (tmp_path / "run" / "report.md").read_text()
    assert "| 3P1D nccl | a | RuntimeError: KV transfer timed out | ValueError: root cause |" in md
    assert "| b | b | unreadable metrics.json:" in md


def test_report_of_repeats_shows_intervals_comparisons_and_the_machine(tmp_path, capsys):
    from experiments.serving import aggregate
    from tests.test_confidence import write_repeat
    run = tmp_path / "run"
    for name, mode, ttft in (("fast", "colocated", 40.0), ("slow", "disaggregated", 400.0)):
        info = {"label": name, "mode": mode, "num_gpus": 2, "rate": 4.0, "workload": "code", "round_robin": 2}
        for i in range(3):
            write_repeat(run / name / f"rep{i}", i, ttft + 5 * i, point=info)
    for i in range(3):                       # fast's repeats ran on a machine slowing down: its probes say so
        m = run / "fast" / f"rep{i}" / "metrics.json"
        probe = {"decode_s": 2e-3 + 5e-4 * i, "prefill_s": 5e-3, "context": 256, "prompt_tokens": 64, "rounds": 8}
        m.write_text(json.dumps(json.loads(m.read_text()) | {"speed_probe": {"w0": probe, "w1": probe},
                                                             "isolation": {"dedicated": True, "driver_shares_cores": True}}))
    aggregate.write(run / "fast")            # "slow" was cut short before its aggregate: the report makes it
    assert report.main([str(run)]) == 0
    assert not (run / "slow" / "metrics.json").exists(), "the report reads the run, it does not rewrite it"
    md = (run / "report.md").read_text()
    assert "Each point was served 3 time(s), interleaved round-robin with the other points of their run" in md
    fast = aggregate.aggregate(run / "fast")
    lo, hi = fast["ci"]["ttft_ms.p50"]
    assert f"| fast | {fmt(fast['itl_ms']['p99'])} [" in md and f"{fmt(fast['ttft_ms']['p50'])} [{fmt(lo)}, {fmt(hi)}]" in md
    assert "**Serving modes** (2 GPUs, 4 req/s, workload code):" in md
    assert "TTFT p50 (median [95% CI]): fast " in md and ": fast is lower than slow (95% intervals separate)." in md
    assert "ITL p99 (median [95% CI]):" in md and "no significant difference between" in md   # equal gaps
    assert "⚠ fast: machine overloaded: 1-minute load average 3.0 on 2 cores" in md
    assert "⚠ fast: the router has no core of its own" in md and "⚠ slow: the router" not in md
    assert "## Serving modes compared (2 GPUs, 4 req/s, workload code)" in md
    assert_png(run / "comparison.png") and assert_png(run / "itl_cdf.png")
    assert "every timeline has the same y-scale" in md
    assert "A mixed step of fast took 3.00x [" in md       # the repeats' step ratios: 2, 3 and 4
    assert "| 2.00-3.00 / 5.00 |" in md and "| n/a |" in md     # the speed probe's range; slow had none


def test_a_large_clusters_timeline_keeps_rows_of_every_role():
    from experiments.report.plots import MAX_TIMELINE_ROWS, timeline_rows

    small = ["decode:0", "prefill:0"]
    assert timeline_rows(small) == small
    names = sorted([f"prefill:{i}" for i in range(32)] + [f"decode:{i}" for i in range(32)])
    rows = timeline_rows(names)
    assert len(rows) == MAX_TIMELINE_ROWS == len(set(rows))
    assert rows[0] == names[0] and rows[-1] == names[-1]
    assert {r.split(":")[0] for r in rows} == {"decode", "prefill"}
