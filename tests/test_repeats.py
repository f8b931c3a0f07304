"""Repeats: served round-robin across the compared points, each into its own directory, resumed from disk,
a crashed point stopped while the others go on. The cluster is replaced by a stand-in that writes the
files a repeat writes, so these tests are about the bookkeeping, not timings."""
import json

import pytest
from hydra import compose, initialize_config_dir

from experiments.serving import serve
from experiments.serving.metrics import summarize
from tests.conftest import ROOT


def prepared(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["workload.num_requests=4", *overrides])
    return serve.prepare(cfg, tmp_path, "")


@pytest.fixture
def served(monkeypatch):
    """Stand-in for serving one repeat: records (point, repeat) and writes that repeat's files."""
    calls, crash = [], set()

    def fake(p, repeat, out):
        calls.append((p.out.name, repeat))
        if p.out.name in crash:
            raise RuntimeError("KV transfer timed out")
        rows = [{"id": f"r{i}", "prompt_len": 8, "output_len": 3, "arrival_s": 0.1 * i, "end_s": 0.1 * i + 0.05,
                 "status": "ok", "ttft_s": 0.01 * (1 + repeat), "e2e_s": 0.05, "itl_s": [0.02, 0.02]} for i in range(4)]
        metrics = summarize(rows, 250.0, 12.0, 2) | {"point": p.ident, "repeat": repeat,
                                                     "step_ratio": {"ratio": None}, "machine": {"cores": 2}}
        (out / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / "metrics.json").write_text(json.dumps(metrics))
        return metrics
    monkeypatch.setattr(serve, "serve_repeat", fake)
    return calls, crash


def test_repeats_go_round_robin_and_aggregate_per_point(tmp_path, served, capsys):
    calls, _ = served
    results = serve.serve_all(prepared(tmp_path), 3)
    names = ["colocated-prefill_first", "colocated-chunked", "1p1d"]
    assert calls == [(n, r) for r in range(3) for n in names]          # A B C A B C A B C
    for name, result in zip(names, results):
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["config.yaml", "metrics.json", "rep0", "rep1",
                                                                       "rep2"]
        assert result["repeats"]["num_ok"] == 3
        assert result["repeat_values"]["ttft_ms.p50"] == pytest.approx([10.0, 20.0, 30.0])
        assert result["ttft_ms"]["p50"] == pytest.approx(20.0)
        assert "repeats: 3" in (tmp_path / name / "config.yaml").read_text()
        assert "repeats" not in (tmp_path / name / "rep0" / "config.yaml").read_text()
    assert "colocated prefill_first x2 rep 3/3: 4/4 ok" in capsys.readouterr().out


def test_resume_skips_repeats_on_disk_and_serves_only_new_ones(tmp_path, served, capsys):
    calls, _ = served
    serve.serve_all(prepared(tmp_path, "compare=[1p1d,colocated-chunked]"), 2)
    calls.clear()
    serve.serve_all(prepared(tmp_path, "compare=[1p1d,colocated-chunked]"), 3)    # more repeats: only rep2 served
    assert calls == [("1p1d", 2), ("colocated-chunked", 2)]
    assert capsys.readouterr().out.count("skipped") == 4
    calls.clear()
    serve.serve_all(prepared(tmp_path, "compare=[1p1d,colocated-chunked]", "seed=1"), 1)   # another config
    assert calls == [("1p1d", 0), ("colocated-chunked", 0)]


def test_a_crashed_point_stops_and_the_others_go_on(tmp_path, served):
    calls, crash = served
    crash.add("colocated-chunked")
    results = serve.serve_all(prepared(tmp_path), 2)
    assert ("colocated-chunked", 1) not in calls and ("1p1d", 1) in calls
    assert results[1]["error"] == "RuntimeError: KV transfer timed out"
    point = tmp_path / "colocated-chunked"
    assert (point / "error.json").exists() and not (point / "metrics.json").exists()
    assert "Traceback" in json.loads((point / "rep0" / "error.json").read_text())["traceback"]
    crash.clear()
    calls.clear()
    serve.serve_all(prepared(tmp_path), 2)                              # a crashed repeat is tried again
    assert calls == [("colocated-chunked", 0), ("colocated-chunked", 1)]
    assert (point / "metrics.json").exists() and not (point / "error.json").exists()
