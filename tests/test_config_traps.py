"""Config traps a new user walks into: explicit cluster settings served as given, bad values rejected in one
line naming the key, a model too big for the machine refused at once, `--help` describing every key."""
import re
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments.compose import precheck
from experiments.config import ConfigError, points, yield_to_overrides
from experiments.serving.capacity import GiB, check_memory, need
from tests.conftest import ROOT

CONF = str(ROOT / "conf")


def served(*overrides):
    """The points experiments.run would serve for these command-line overrides."""
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose("config", overrides=list(overrides))
    return points(yield_to_overrides(cfg, list(overrides)))


def test_no_override_serves_the_default_comparison():
    assert [sub for sub, _, _ in served()] == ["colocated-prefill_first", "colocated-chunked", "1p1d"]


@pytest.mark.parametrize("overrides,expect", [
    (["cluster.mode=colocated"], ("colocated", 2, "chunked")),
    (["cluster.mode=colocated", "cluster.workers=1", "scheduler.policy=prefill_first"], ("colocated", 1, "prefill_first")),
    (["cluster.mode=disaggregated"], ("disaggregated", 2, "chunked")),
    (["cluster.decode_workers=1", "cluster.prefill_workers=1"], ("disaggregated", 2, "chunked")),
])
def test_explicit_cluster_settings_are_served_as_given(overrides, expect):
    (sub, cfg, spec), = served(*overrides)
    assert sub is None and cfg.compare is None
    assert (spec.cluster.mode, spec.cluster.num_workers, spec.scheduler.policy) == expect


@pytest.mark.parametrize("overrides,message", [
    (["cluster.mode=disagg"], "cluster.mode='disagg': choose one of ['colocated', 'disaggregated']"),
    (["cluster.prefill_workers=0"], "cluster.prefill_workers=0: disaggregated mode needs at least one"),
    (["cluster.mode=disaggregated", "cluster.decode_workers=0"], "cluster.decode_workers=0"),
    (["layout=1p1d", "cluster.mode=colocated"], "cluster.mode=colocated conflicts with layout=1p1d, which sets it"),
    (["compare=[1p1d]", "cluster.workers=2"], "cluster.workers=2 conflicts with compare=['1p1d']"),
    (["scheduler.policy=prefill_first"], "scheduler.policy=prefill_first conflicts with layout colocated-prefill_first"),
    (["scheduler.token_budget=0"], "scheduler.token_budget=0 must be a positive number of tokens"),
    (["scheduler.token_budget=-64", "compare=null"], "scheduler.token_budget=-64"),
    (["scheduler.prefill_token_budget=0"], "scheduler.prefill_token_budget=0"),
    (["repeats=0"], "repeats=0 must be a positive integer"),
    (["repeats=two"], "repeats='two' must be a positive integer"),
    (["engine.cpu_gemm_rows=100"], "engine.cpu_gemm_rows=100: choose auto, null (always the panel kernel) or a number"),
])
def test_bad_settings_fail_in_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        served(*overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_preset_layout_yields_only_to_compare_null():
    with pytest.raises(ConfigError, match="conflicts with layout=1p2d"):
        served("+experiment=fault_drill", "cluster.mode=colocated")


def test_a_model_larger_than_the_machine_is_refused_naming_both_sizes():
    (_, _, spec), = served("+experiment=gpu_llama3_8b", "compare=null", "model.device=cpu")
    n = need(spec)
    assert n["dtype"] == "float32" and n["weights"] == pytest.approx(8.03e9 * 4, rel=0.01)
    with pytest.raises(ConfigError) as err:
        check_memory(spec, available=16 * GiB)
    text = str(err.value)
    assert text.startswith("model=llama-3-8b on cpu needs 30.2 GiB per worker (float32 weights 29.9 GiB + KV pool")
    assert "GiB for 2 workers; this machine has 16.0 GiB available" in text and "\n" not in text
    check_memory(spec, available=80 * GiB)                           # fits: nothing raised
    (_, _, tiny), = served("compare=null")
    check_memory(tiny, available=2 * GiB)


def test_gpu_memory_is_checked_per_worker():
    (_, _, spec), = served("+experiment=gpu_llama3_8b", "compare=null", "model.device=cuda", "model.dtype=bfloat16")
    with pytest.raises(ConfigError) as err:
        check_memory(spec, gpu_memory=[16 * GiB])
    assert str(err.value) == ("model=llama-3-8b needs 16.0 GiB per worker (bfloat16 weights 15.0 GiB + KV for one "
                              "8192-token sequence 1.00 GiB); the smallest GPU here offers 13.6 GiB "
                              "(scheduler.gpu_memory_utilization=0.85)")
    check_memory(spec, gpu_memory=[80 * GiB, 80 * GiB])


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU node the preset may fit")
def test_gpu_preset_on_this_machine_fails_at_once(tmp_path):
    (_, _, spec), = served("+experiment=gpu_llama3_8b", "compare=null")
    from experiments.serving.capacity import available_memory
    if spec.cluster.num_workers * need(spec)["total"] <= (available_memory() or 0):
        pytest.skip("this machine has the memory for the preset")
    proc = subprocess.run([sys.executable, "-m", "experiments.run", "+experiment=gpu_llama3_8b",
                           f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("config error: model=llama-3-8b on cpu needs") and "this machine has" in line
    assert "workers up" not in proc.stdout + proc.stderr


def test_an_unknown_group_option_lists_the_valid_ones():
    assert precheck(["model=llama3"]) == ("In 'config': Could not find 'model/llama3'; model can be one of: "
                                          "llama-3-70b, llama-3-8b, llama-3.2-1b, smollm2-135m, tiny")


def test_every_hydra_command_refuses_a_bad_override_in_one_line():
    """plan, lesson, roofline, profile and serve check their overrides as run does, before Hydra starts."""
    assert precheck(["slo=nope"], "plan").endswith("slo can be one of: batch, default, interactive, tight")
    assert "hardware can be one of: a100" in precheck(["hardware=tpu"], "roofline")
    assert precheck(["model=tiny"], "lesson") is None and precheck(["cluster.nope=1"], "serve") is not None
    proc = subprocess.run([sys.executable, "-m", "experiments.plan", "slo=nope"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "config error: In 'config': Could not find 'slo/nope'; slo can be one of: batch, default, interactive, tight"]


def test_help_describes_every_key_in_one_line(monkeypatch, capsys):
    from experiments import run
    monkeypatch.setattr(sys, "argv", ["experiments.run", "--help"])
    with pytest.raises(SystemExit) as done:
        run.main()
    assert done.value.code == 0
    stdout = capsys.readouterr().out
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = OmegaConf.to_container(compose("config"))
    keys = [k for k, v in cfg.items() if not isinstance(v, dict)]
    keys += [f"{group}.{k}" for group, v in cfg.items() if isinstance(v, dict) for k in v]
    described = {line.split()[0]: line for line in stdout.splitlines() if line.strip()}
    missing = [k for k in keys if k not in described or len(described[k].split()) < 3]
    assert not missing, missing
    assert "model: llama-3-70b, llama-3-8b, llama-3.2-1b, smollm2-135m, tiny" in stdout


@pytest.mark.parametrize("bad,culprit", [(["gpus=0"], "cluster.gpus=0"),
                                         (["decision.measured.prompt_lens=[64]"], None),
                                         (["decision.measured.prompt_lens=[64]", "decision.measured.num_requests=0"],
                                          "workload.num_requests=0"),
                                         (["goodput_vs_rate.simulated.slo=nope"], "goodput_vs_rate.simulated.slo='nope'")])
def test_a_bad_value_for_a_later_section_stops_the_lesson_before_anything_is_measured(bad, culprit, tmp_path):
    """Sections 4-6 serve and simulate what sections 1-3 took minutes to measure before; their points are
    composed and validated first, so a bad value ends the lesson at once, naming itself, with nothing written."""
    from experiments.config import CONF_DIR
    from experiments.lesson import lesson, points as lesson_points
    from tests.test_lesson import TINY

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("lesson", overrides=[*TINY, *bad])
        if culprit is None:                         # a good value passes (a measured cell's points)
            lesson_points.prepare_points(cfg, tmp_path / "runs")
            return
        with pytest.raises((ConfigError, ValueError), match=re.escape(culprit)):
            lesson.run(cfg, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_planner_says_which_given_overrides_it_sets_itself(tmp_path):
    """`pdlab plan layout=... workload.rate=...` still plans every layout over every rate; it says so
    rather than let the user believe the layout or rate they gave was used."""
    proc = subprocess.run([sys.executable, "-m", "experiments.plan", "cluster.gpus=2", "layout=1p1d", "workload.rate=3",
                           "plan.requests_per_worker=10", "plan.steps=1", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    notes = [line for line in proc.stderr.splitlines() if line.startswith("note: ")]
    assert notes == ["note: layout=1p1d is ignored: the planner tries every layout",
                     "note: workload.rate=3 is ignored: the planner searches the rate"]
