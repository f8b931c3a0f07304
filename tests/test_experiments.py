"""Hydra configs: every preset composes and validates; bad configs fail in one line naming the key."""
import json
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from experiments.compose import precheck
from experiments.config import ConfigError, points
from experiments.report.report import build_report
from experiments.run import warnings
from tests.conftest import ROOT

CONF = str(ROOT / "conf")


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))


def composed(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose("config", overrides=list(overrides))


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"arrival_s": 0.0, "prompt_len": 5, "output_len": 3}\n'
                    '{"arrival_s": 0.5, "prompt_ids": [1, 2, 3], "output_len": 2}\n')
    return path


def test_default_is_the_three_way_comparison_on_two_gpus():
    pts = points(composed())
    assert [sub for sub, _, _ in pts] == ["colocated-prefill_first", "colocated-chunked", "1p1d"]
    specs = [spec for _, _, spec in pts]
    assert [s.cluster.num_workers for s in specs] == [2, 2, 2]
    assert [(s.cluster.mode, s.scheduler.policy) for s in specs[:2]] == [("colocated", "prefill_first"),
                                                                        ("colocated", "chunked")]
    assert specs[2].cluster.mode == "disaggregated" and specs[2].cluster.prefill_workers == 1
    engines = specs[0].engines()
    assert engines["colocated"].token_budget >= specs[0].max_model_len, "prefill_first never splits a prompt"
    assert specs[1].engines()["colocated"].token_budget == 64
    assert specs[2].engines()["prefill"].policy == "prefill_first"


@pytest.mark.parametrize("group", ["model", "workload", "slo", "transfer", "fault", "router", "scheduler", "cluster"])
def test_every_group_option_composes(group, trace_file):
    for option in options(group):
        extra = [f"workload.trace={trace_file}"] if option == "trace" else []
        for _, _, spec in points(composed(f"{group}={option}", *extra)):
            assert spec.gpus >= spec.cluster.num_workers


@pytest.mark.parametrize("preset", options("experiment"))
def test_experiment_presets_compose(preset):
    assert points(composed(f"+experiment={preset}"))


@pytest.mark.parametrize("preset", options("point"))
def test_point_presets_compose(preset):
    (_, cfg, spec), = points(composed(f"+point={preset}", "compare=null"))
    assert cfg.layout in ("colocated-chunked", "colocated-prefill_first", "1p1d")


@pytest.mark.parametrize("preset", options("sweep"))
def test_sweep_presets_compose_for_each_of_their_points(preset):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose("config", overrides=[f"+sweep={preset}"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert params, "a sweep preset lists what it sweeps"
    # compose the first and the last value of every swept key together
    for pick in (0, -1):
        overrides = [f"+sweep={preset}"]
        for key, values in params.items():
            overrides.append(f"{key}={str(values).split(',')[pick].strip()}")
        assert points(composed(*overrides))


def test_pool_ratio_covers_every_split_and_the_baselines():
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose("config", overrides=["+sweep=pool_ratio"], return_hydra_config=True)
    layouts = cfg.hydra.sweeper.params.layout.split(",")
    gpus = cfg.cluster.gpus
    assert {"colocated-prefill_first", "colocated-chunked"} <= set(layouts)
    assert {f"{p}p{gpus - p}d" for p in range(1, gpus)} <= set(layouts)


@pytest.mark.parametrize("overrides,message", [
    (["+cluster.foo=1"], "unknown option cluster.foo"),
    (["+bogus=1"], "unknown option bogus"),
    (["layout=0p2d"], "layout=0p2d uses 0 + 2 GPUs"),
    (["layout=1p2d"], "layout=1p2d uses 1 + 2 GPUs; it needs P, D >= 1 with P + D = cluster.gpus=2"),
    (["layout=mixed"], "layout='mixed'"),
    (["compare=null", "cluster.mode=disaggregated", "cluster.prefill_workers=0"], "cluster.prefill_workers=0"),
    (["compare=null", "cluster.mode=disaggregated", "cluster.decode_workers=0"], "cluster.decode_workers=0"),
    (["compare=null", "cluster.mode=colocated", "cluster.workers=3"],
     "cluster.workers = 3 workers is more than cluster.gpus=2"),
    (["compare=null", "cluster.prefill_workers=2"],
     "cluster.prefill_workers + cluster.decode_workers = 3 workers is more than cluster.gpus=2"),
    (["slo.ttft_ms=0"], "slo.ttft_ms=0"),
    (["slo.tpot_ms=-5"], "slo.tpot_ms=-5"),
    (["workload.rate=0"], "workload.rate=0"),
    (["workload.rate=-2"], "workload.rate=-2"),
    (["workload.num_requests=abc"], "workload.num_requests='abc'"),
    (["scheduler.policy=fifo"], "scheduler.policy='fifo'"),
    (["transfer.timeout_s=0"], "transfer.timeout_s=0"),
    (["router.decode_policy=random"], "router.decode_policy='random'"),
    (["fault.kill_worker=decode"], "fault.kill_worker='decode'"),
    (["model.checkpoint=/nonexistent"], "model.checkpoint"),
    (["model.dtype=int8"], "model.dtype='int8'"),
    (["compare=[1p1d,1p1d]"], "names a layout twice"),
])
def test_bad_configs_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("+", r"\+").replace("[", r"\[")) as err:
        points(composed(*overrides))
    assert "\n" not in str(err.value)


def test_trace_with_missing_fields_names_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0.0, "prompt_len": 5, "output_len": 3}\n{"arrival_s": 1.0, "prompt_len": 5}\n')
    proc = run_cli(tmp_path, "workload=trace", f"workload.trace={bad}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"config error: workload: {bad} line 2: missing field 'output_len'"]
    assert "workers up" not in proc.stdout + proc.stderr


def test_hydra_level_errors_are_one_line(tmp_path):
    assert "cluster.foo" in precheck(["cluster.foo=1"])
    assert "model/llama-9" in precheck(["model=llama-9"])
    assert precheck(["workload.rate=2,4", "-m", "+sweep=rate"]) is None
    proc = run_cli(tmp_path, "cluster.foo=1")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "cluster.foo" in proc.stderr
    proc = run_cli(tmp_path, "cluster.mode=disagg")          # validated after Hydra composed it: still one line
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["config error: cluster.mode='disagg': choose one of "
                                                "['colocated', 'disaggregated']"]


def run_cli(tmp_path, *args, timeout=600):
    """experiments.run in a subprocess, writing under tmp_path (never into the checkout)."""
    where = [f"hydra.sweep.dir={tmp_path / 'multirun'}"] if "-m" in args else [f"hydra.run.dir={tmp_path / 'run'}"]
    if any(a.startswith("hydra.sweep.dir=") for a in args):
        where = []
    return subprocess.run([sys.executable, "-m", "experiments.run", *args, *where], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_sweep_records_crashed_points_and_resumes(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", f"hydra.sweep.dir={sweep}", "compare=null", "layout=1p1d", "model.device=cpu,cuda", "repeats=2",
            "workload.num_requests=6", "workload.rate=30", "cluster.startup_timeout_s=60",
            "cluster.speed_probe=true"]
    first = run_cli(tmp_path, *args)
    assert first.returncode == 0, first.stderr[-3000:]
    jobs = {"cuda" if "cuda" in p.name else "cpu": p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")}
    assert sorted(jobs) == ["cpu", "cuda"]
    done, crashed = jobs["cpu"], jobs["cuda"]
    metrics = json.loads((done / "metrics.json").read_text())
    assert metrics["repeats"]["num_ok"] == 2 and metrics["num_completed"] == 6 and metrics["num_failed"] == 0
    assert metrics["point"]["layout"] == "1p1d" and len(metrics["repeat_values"]["itl_ms.p99"]) == 2
    lo, hi = metrics["ci"]["ttft_ms.p50"]
    assert lo <= hi
    assert set(metrics["machine"]) >= {"cores", "load_1m_end_max", "other_cores_max", "steal_share_max", "overloaded"}
    for rep in ("rep0", "rep1"):
        rows = [json.loads(x) for x in (done / rep / "requests.jsonl").read_text().splitlines()]
        assert len(rows) == 6 and all(r["status"] == "ok" for r in rows)
        assert (done / rep / "steps.jsonl").stat().st_size > 0
        rep_metrics = json.loads((done / rep / "metrics.json").read_text())
        assert rep_metrics["ci"]["itl_ms.p99"] is not None
        assert rep_metrics["pool"]["served"] == "1P+1D (prefill:0, decode:0)" and rep_metrics["pool"]["lost"] == []
        assert [w["worker"] for w in rep_metrics["pool"]["workers"]] == ["prefill:0", "decode:0"]
        for key in ("speed_probe", "speed_probe_end"):      # the machine's speed before and after serving
            assert sorted(rep_metrics[key]) == ["decode:0", "prefill:0"], key
            assert all(p["decode_s"] > 0 and p["prefill_s"] > 0 for p in rep_metrics[key].values()), key
    assert "CUDA" in (crashed / "error.json").read_text() and not (crashed / "rep1").exists()
    stamps = {p: p.stat().st_mtime for p in done.rglob("metrics.json")}

    second = run_cli(tmp_path, *args)
    assert second.returncode == 0
    assert second.stdout.count("skipped") == 2
    assert {p: p.stat().st_mtime for p in done.rglob("metrics.json") if p.parent != done} == \
        {p: t for p, t in stamps.items() if p.parent != done}, "finished repeats not re-run"
    assert (crashed / "rep0" / "error.json").exists(), "crashed points are tried again"

    assert build_report(sweep)["num_points"] == 2        # the command itself: tests/test_report.py
    text = (sweep / "report.md").read_text()
    assert "1P+1D" in text and "CUDA" in text


def test_requests_failed_for_their_own_reasons_are_flagged_in_the_summary():
    from experiments.serving.serve import failure_warning, unexpected_failures
    from router.records import RequestRecord

    def rec(rid, status, reason=None, injected=False):
        r = RequestRecord(rid, [1], 4, 0.0, status=status, reason=reason)
        r.injected_fault = injected
        return r
    records = [rec("a", "ok"), rec("b", "failed", "worker decode:0 died", injected=True),
               rec("c", "failed", "rejected: temperature=1e-40 must be 0"), rec("d", "failed", "rejected: temperature=1e-40 must be 0"),
               rec("e", "failed", "failed on colocated:0: sampling failed")]
    u = unexpected_failures(records)
    assert u == {"count": 3, "num_reasons": 2, "reasons": {"rejected: temperature=1e-40 must be 0": 2,
                                                           "failed on colocated:0: sampling failed": 1}}
    line = failure_warning({"num_submitted": 5, "unexpected_failures": u})
    assert line == ("WARNING: 3 of 5 requests failed for reasons other than injected faults; commonest (2): "
                    "rejected: temperature=1e-40 must be 0 (+1 other reasons). See requests.jsonl.")
    assert unexpected_failures(records[:2]) is None and failure_warning({"num_submitted": 2}) is None


def test_the_console_warns_once_per_point_whose_router_shares_the_workers_cores():
    def result(label, shares):
        return {"point": {"label": label}, "machine": {}, "isolation": {"dedicated": True, "driver_shares_cores": shares}}
    lines = warnings([result("a", True), result("b", False), result("a", True)])
    assert lines == ["a: the router has no core of its own: its threads run on the workers' cores and slow the worker "
                     "beside them, so where they land moves the modes' token latencies"]
