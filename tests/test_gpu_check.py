"""`python -m experiments.gpu_check --device cpu`: every stage of the GPU check runs on the CPU at small
shapes, so the command cannot rot before a GPU runs it; a stage that fails or times out is recorded
and the others still run."""
import json
import subprocess
import sys

import pytest

from experiments import gpu_check


def check(*args, timeout=900):
    p = subprocess.run([sys.executable, "-m", "experiments.gpu_check", "--device", "cpu", *args],
                       capture_output=True, text=True, timeout=timeout)
    last = next((line for line in reversed(p.stdout.splitlines()) if line.startswith("{")), None)
    assert last is not None, p.stdout + p.stderr
    return p.returncode, json.loads(last)


@pytest.mark.slow
def test_every_stage_passes_on_the_cpu_and_says_what_only_a_gpu_checks(tmp_path):
    rc, summary = check("--out", str(tmp_path), "--timeout-scale", "3")
    stages = summary["stages"]
    assert list(stages) == list(gpu_check.STAGES)
    assert rc == 0 and summary["ok"], {k: v.get("error") for k, v in stages.items() if not v["ok"]}
    for name in gpu_check.STAGES:                     # each stage's JSON written as it finished
        assert json.loads((tmp_path / f"{name}.json").read_text())["ok"]
    assert stages["attention"]["max_abs_err"]["mixed"] < stages["attention"]["tolerance"]
    assert stages["attention"]["compiles"] <= stages["attention"]["padded_shapes"] < stages["attention"]["step_shapes"]
    assert stages["engine"]["tokens_reference_vs_flex"] == 1.0
    assert stages["engine"]["graphs"].startswith("skipped:")
    d = stages["disaggregation"]
    assert d["zmq_stream_off"]["tokens_equal_colocated"] and d["zmq_stream_layer"]["tokens_equal_colocated"]
    assert d["nccl_two_gpus"].startswith("skipped:")
    assert stages["main_job"]["returncode"] == 0 and stages["main_job"]["result"]["points"]


def test_a_stage_that_times_out_is_recorded_and_the_next_still_runs(tmp_path):
    rc, summary = check("--out", str(tmp_path), "--only", "environment,roofline", "--timeout-scale", "0.0001",
                        timeout=120)
    assert rc == 1 and not summary["ok"] and list(summary["stages"]) == ["environment", "roofline"]
    for name, res in summary["stages"].items():
        assert not res["ok"] and "timed out" in res["error"]
        assert json.loads((tmp_path / f"{name}.json").read_text())["error"] == res["error"]


@pytest.mark.parametrize("args,culprit", [(["--timeout-scale", "-1"], "--timeout-scale -1: must be positive"),
                                          (["--timeout-scale", "0"], "--timeout-scale 0: must be positive"),
                                          (["--out", "/dev/null/x"], "--out /dev/null/x")])
def test_flags_it_cannot_run_with_end_in_one_line_naming_them(args, culprit, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:            # before any stage runs
        gpu_check.main(["--device", "cpu", "--out", str(tmp_path), *args])
    assert e.value.code == 2 and culprit in capsys.readouterr().err
