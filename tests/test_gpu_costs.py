"""GPU step sources: aiconfigurator's measured tables where they exist, the roofline where not, and the
`experiments.sim.costs` command that prints both."""
import json
import math
import sys

import pytest

from experiments.sim import gpu_costs
from experiments.sim.gpu_costs import Grid, MeasuredStepModel, SourceUnavailable, build_tables, choose
from experiments.sim.stepmodel import chunk_features, roofline_model
from workers.config import preset


class FakeHandle:
    """aiconfigurator's EngineHandle surface with made-up, checkable formulas (ms): decode 4 + 0.01 b
    + 1e-5 b c; shared work 3 + 0.02 t; prompt attention 1e-6 t^2; decode attention 1e-5 b c."""

    def __init__(self, refuse_batch=None):
        self.refuse_batch = refuse_batch

    def decode_step_latency(self, b, c, osl):
        if b == self.refuse_batch:
            raise ValueError("no such shape")
        return 4.0 + 0.01 * b + 1e-5 * b * (c + osl // 2)

    def mixed_step_breakdown(self, ctx, gen, isl, osl, prefix=0):
        shared, attn, dattn = 3.0 + 0.02 * (ctx + gen), 1e-6 * isl * isl, 1e-5 * gen * (isl + osl // 2)
        return shared + attn + dattn, shared, attn, dattn


def spec_of(overrides):
    from hydra import compose, initialize_config_dir

    from experiments.config import parse
    from experiments.config import CONF_DIR
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return parse(compose("config", overrides=["compare=null", "backend=sim", *overrides]))


GRID = Grid(max_batch=64, max_context=4096, max_tokens=4096)
CFG = preset("llama-3-8b")


def model(handle=None):
    return MeasuredStepModel(build_tables(handle or FakeHandle(), GRID, "fake db"), roofline_model(CFG, "h200"))


def test_steps_are_priced_from_the_tables():
    m = model()
    # decode-only: the decode table, read at the mean context, linear between grid contexts
    assert m.time(chunk_features(32, 32 * 1024, [])) == pytest.approx((4.0 + 0.32 + 1e-5 * 32 * 1024) / 1e3)
    assert m.time(chunk_features(8, 8 * 1000, [])) == pytest.approx((4.0 + 0.08 + 1e-5 * 8 * 1000) / 1e3)
    big = Grid(max_batch=512)                 # a batch between two rows of the table: linear between them
    assert 100 not in big.batches() and {96, 104, 288, 512} <= set(big.batches())
    wide = MeasuredStepModel(build_tables(FakeHandle(), big, "fake db"), roofline_model(CFG, "h200"))
    assert wide.time(chunk_features(100, 100 * 700, [])) == pytest.approx((4.0 + 1.0 + 1e-5 * 100 * 700) / 1e3)
    assert wide.decode_run(300, 300 * 700, 2) == pytest.approx([(4.0 + 3.0 + 1e-5 * (300 * 700 + 300 * i)) / 1e3
                                                               for i in range(2)])
    run = m.decode_run(8, 8 * 1000, 3)
    assert run == pytest.approx([(4.08 + 1e-5 * 8 * (1000 + i)) / 1e3 for i in range(3)])
    # with a prompt: shared(all tokens) + the prompt's attention at its pairs + the decodes' attention
    want = 3.0 + 0.02 * (512 + 16) + 1e-6 * 512 * 512 + 1e-5 * 16 * 1024
    assert m.time(chunk_features(16, 16 * 1024, [(512, 0, True)])) == pytest.approx(want / 1e3, rel=0.01)
    assert m.time(chunk_features(0, 0, [(2048, 0, True)])) == pytest.approx((3 + 0.02 * 2048 + 1e-6 * 2048**2) / 1e3,
                                                                          rel=0.01)
    assert m.fallback_steps == 0 and m.tables.fallback_points == 0 and m.name == "fake db"


def test_shapes_beyond_the_tables_and_refused_points_fall_back_to_the_roofline():
    m = model(FakeHandle(refuse_batch=3))
    assert m.tables.fallback_points == len(GRID.contexts())          # the refused decode row
    roof = roofline_model(CFG, "h200")
    for f in (chunk_features(65, 65 * 100, []), chunk_features(3, 300, []), chunk_features(1, 5000, []),
              chunk_features(0, 0, [(4096, 0, True), (64, 0, True)])):
        assert m.time(f) == roof.time(f)
    assert m.fallback_steps == 4
    assert list(m.decode_run(3, 300, 4)) == list(roof.decode_run(3, 300, 4)) and m.fallback_steps == 8
    assert m.to_dict()["fallback_steps"] == 8 and m.to_dict()["fallback_points"] == len(GRID.contexts())


def test_the_source_is_chosen_and_says_why_not():
    roof = roofline_model(CFG, "h200")
    fake = lambda *a: build_tables(FakeHandle(), GRID, "fake db")  # noqa: E731

    def missing(*a):
        raise SourceUnavailable("aiconfigurator-core is not installed")
    assert choose(CFG, "h200", roof, "auto", tables=fake)[0].name == "fake db"
    assert choose(CFG, "h200", roof, "roofline", tables=fake) == (roof, "hardware.costs=roofline")
    assert choose(CFG, "h200", roof, "auto", tables=missing) == (roof, "aiconfigurator-core is not installed")
    with pytest.raises(ValueError, match="hardware.costs=aiconfigurator: aiconfigurator-core is not installed"):
        choose(CFG, "h200", roof, "aiconfigurator", tables=missing)
    with pytest.raises(ValueError, match="hardware.costs='nope'"):
        choose(CFG, "h200", roof, "nope", tables=fake)


def test_what_the_database_cannot_price_is_named(monkeypatch):
    with pytest.raises(SourceUnavailable, match="no database for hardware=b100"):
        gpu_costs.open_engine(CFG, "b100")
    with pytest.raises(SourceUnavailable, match="4-byte weights"):
        gpu_costs.open_engine(CFG, "h200", dtype_bytes=4)
    with pytest.raises(SourceUnavailable, match="hardware.framework='tgi'"):
        gpu_costs.open_engine(CFG, "h200", "tgi")
    monkeypatch.setitem(sys.modules, "aiconfigurator_core", None)        # as if not installed
    monkeypatch.setitem(sys.modules, "aiconfigurator_core.sdk.engine", None)
    with pytest.raises(SourceUnavailable, match="not installed"):
        gpu_costs.open_engine(CFG, "h200")


def test_the_run_config_picks_the_source(monkeypatch):
    from experiments.config import ConfigError
    from experiments.sim.backend import costs_for
    c = costs_for(spec_of(["model=llama-3-8b", "hardware=h200", "hardware.costs=roofline"]))
    assert c.source == "roofline h200" and c.detail["costs_fallback"] == "hardware.costs=roofline"
    monkeypatch.setattr(gpu_costs, "measured_tables", lambda *a, **k: build_tables(FakeHandle(), GRID, "fake db"))
    c = costs_for(spec_of(["model=llama-3-8b", "hardware=h200"]))
    assert c.source == "fake db" and c.detail["step_model"]["kind"] == "aiconfigurator"
    with pytest.raises(ConfigError, match="hardware.costs='best'"):
        costs_for(spec_of(["model=llama-3-8b", "hardware=h200", "hardware.costs=best"]))


def test_the_costs_command_ends_with_one_json_line(capsys):
    from experiments.sim.cost_table import main

    assert main(["hardware.costs=roofline", "model=llama-3-8b", "hardware=h200"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    r = json.loads(out[-1])
    assert r["source"].startswith("roofline h200") and r["fallback"] == "hardware.costs=roofline"
    assert list(r["decode_ms"]) == ["1", "2", "4", "8", "16", "32", "64", "128", "256"]
    assert list(r["prefill_ms"]) == list(r["mixed_ms"]) == ["512", "1024", "2048", "4096", "8192"]
    # the datasheet bound (experiments.roofline's numbers) beside the simulator's roofline
    bound = next(v for k, v in r["by_source"].items() if k.endswith("(compute 1, memory 1)"))
    assert bound["prefill_ms"]["2048"] == pytest.approx(30.0, abs=0.1)
    assert bound["decode_ms"]["32"] == pytest.approx(4.02, abs=0.01)
    assert all(r["mixed_ms"][p] > r["prefill_ms"][p] for p in r["prefill_ms"])
    assert any(line.startswith("mixed, a P-token prefill beside 32 decodes") for line in out)


def test_an_over_long_table_and_an_unknown_gpu_are_refused_in_one_line():
    from experiments.analysis import peer
    from experiments.sim.cost_table import main

    with pytest.raises(SystemExit, match="--context=9000 exceeds its context"):
        main(["--context", "9000", "hardware.costs=roofline"])
    for command in (main, peer.main):
        with pytest.raises(SystemExit, match="Could not find 'hardware/tpu'; hardware can be one of: a100"):
            command(["hardware=tpu"])


def test_prompts_are_bounded_by_the_models_context(capsys):
    from experiments.sim.cost_table import main

    assert main(["model=tiny", "hardware=h200", "hardware.costs=roofline"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(r["prefill_ms"]) == ["512", "1024", "2048", "4096"]          # tiny's context is 4,096


def test_the_measured_h200_database():
    pytest.importorskip("aiconfigurator_core")
    m, why = choose(CFG, "h200", roofline_model(CFG, "h200"), "aiconfigurator",
                    grid=Grid(max_batch=256, max_context=8192, max_tokens=4096))
    assert why is None and m.name.startswith("aiconfigurator h200_sxm vllm")
    # NVIDIA's measured vLLM numbers for Llama-3-8B in bf16 on H200 (issue 26): 6.3 ms and 43.4 ms
    assert m.time(chunk_features(32, 32 * 1024, [])) * 1e3 == pytest.approx(6.3, abs=0.1)
    assert m.time(chunk_features(0, 0, [(2048, 0, True)])) * 1e3 == pytest.approx(43.4, abs=0.5)
    assert m.tables.fallback_points == 0 and math.isfinite(m.time(chunk_features(256, 256 * 8000, [])))


def test_the_planner_refuses_a_tpot_no_decode_step_reaches():
    from hydra import compose, initialize_config_dir

    from experiments.analysis.plan import Search
    from experiments.config import ConfigError
    from experiments.config import CONF_DIR
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=["compare=null", "backend=sim", "model=llama-3-8b", "hardware=h200",
                                           "hardware.costs=roofline", "slo.tpot_ms=4.0"])
    with pytest.raises(ConfigError, match=r"slo.tpot_ms=4 is below the fastest decode step here: 4\.6\d ms"):
        Search(cfg, 10, 1, 0)
    cfg.slo.tpot_ms = 6.0
    assert Search(cfg, 10, 1, 0).num_sims == 0


def test_the_peer_table_names_both_choices_and_why_one_is_missing(monkeypatch):
    from experiments.analysis import peer

    monkeypatch.setitem(sys.modules, "aiconfigurator.cli.api", None)
    assert "not installed" in peer.peer_choice("x", 8, "h200_sxm", "vllm", 300, 250, 500, 50)["error"]
    dis = {"seq_s_gpu": 45.3, "prefill_workers": 1, "prefill_tp": 1, "decode_workers": 1, "decode_tp": 1}
    theirs = {"chosen": "agg", "agg": {"seq_s_gpu": 64.3, "tp": 1}, "agg_tp1": {"seq_s_gpu": 64.3}, "disagg": dis,
              "disagg_tp1": None}
    mine = {"choice": "disaggregated", "layout": "2p6d", "goodput_per_gpu": 27.0,
            "best_by_mode": {"disaggregated": {"layout": "2p6d", "goodput_per_gpu": 27.0}}}
    row = {"workload": "chat", "slo": "interactive", "isl": 300, "osl": 250, "ttft_ms": 500.0, "tpot_ms": 50.0,
           "gpus": 8, "pdlab": mine}
    text = peer.table([row | {"aiconfigurator": theirs}, row | {"aiconfigurator": {"error": "no peer"}}])
    lines = text.splitlines()
    assert len(lines) == 4 and "| disaggregated, 2p6d, 27 | - / 27 (2p6d) | colocated (agg) | 8 x TP1, 64.3 |" in lines[2]
    assert "4p4d (4 x 1p1d), 45.3" in lines[2] and "not run: no peer" in lines[3]


def test_the_lessons_gpu_figures_carry_the_measured_steps(monkeypatch, tmp_path):
    from omegaconf import OmegaConf

    from experiments.hardware import Hardware
    from experiments.lesson import lesson, text
    from experiments.config import CONF_DIR

    def fake(cfg, gpu, *a):
        if gpu == "a100":
            raise SourceUnavailable("no a100 here")
        return build_tables(FakeHandle(), Grid(max_batch=256, max_context=8192, max_tokens=16384), f"fake {gpu}")
    monkeypatch.setattr(gpu_costs, "measured_tables", fake)
    cfg = OmegaConf.load(f"{CONF_DIR}/lesson.yaml")
    rf = lesson.roofline_section(cfg, Hardware("measured-cpu", 1e11, 2e10, 0, 0, 0), preset("tiny"), 4, tmp_path)
    h200 = rf["hardware"]["h200"]["measured"]
    assert h200["source"] == "fake h200" and rf["hardware"]["a100"]["measured"] == {"source": None, "why": "no a100 here"}
    assert h200["ms"]["decode B=32 C=1024"] == pytest.approx(4.0 + 0.32 + 1e-5 * 32 * 1024)
    mixed = 3.0 + 0.02 * (2048 + 32) + 1e-6 * 2048**2 + 1e-5 * 32 * 1024
    assert h200["ms"]["mixed B=32 C=1024 + P=2048"] == pytest.approx(mixed, rel=0.01)
    md = text.why({"roofline": lesson._plain(rf), "device": "CPU with 2 threads"}, 1)
    assert "| a100 |" in md and "not in the database |" in md.split("| a100 |")[1].splitlines()[0]
    assert "Measured on the h200 (NVIDIA's per-operation database, fake h200" in md
    assert "the roofline's and NVIDIA's database's, not measurements of this run" in md
    assert (tmp_path / "roofline.png").read_bytes()[:4] == b"\x89PNG"


def test_tables_are_kept_on_disk_by_what_they_depend_on(monkeypatch, tmp_path):
    opened = []

    def fake_open(cfg, gpu, framework="vllm", dtype_bytes=2):
        opened.append(gpu)
        return FakeHandle(), f"fake {gpu}"
    monkeypatch.setattr(gpu_costs, "CACHE", tmp_path)
    monkeypatch.setattr(gpu_costs, "open_engine", fake_open)
    monkeypatch.setattr(gpu_costs, "_installed", lambda: True)
    monkeypatch.setattr(gpu_costs, "_TABLES", {})
    first = gpu_costs.measured_tables(CFG, "h200", grid=GRID)
    monkeypatch.setattr(gpu_costs, "_TABLES", {})             # a new process: only the disk remembers
    again = gpu_costs.measured_tables(CFG, "h200", grid=GRID)
    assert opened == ["h200"] and again == first and again.source == "fake h200"
    gpu_costs.measured_tables(CFG, "h100", grid=GRID)          # another GPU, another file
    gpu_costs.measured_tables(preset("llama-3.2-1b"), "h200", grid=GRID)   # another shape, another directory
    assert opened == ["h200", "h100", "h200"] and len(list(tmp_path.glob("*/tables-*.json"))) == 3
    monkeypatch.setattr(gpu_costs, "_installed", lambda: False)
    monkeypatch.setattr(gpu_costs, "_TABLES", {})
    with pytest.raises(SourceUnavailable, match="not installed"):   # uninstalled: no stale tables
        gpu_costs.measured_tables(CFG, "h200", grid=GRID)


def test_the_gpu_check_puts_the_database_beside_its_measured_steps(monkeypatch):
    import torch

    from experiments import gpu_timing

    monkeypatch.setattr(gpu_costs, "measured_tables", lambda *a: build_tables(FakeHandle(), GRID, "fake h200"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "NVIDIA H200")
    decode, prefill = {"B32_C1024": {"step_ms": 8.0}}, {"P2048": {"step_ms": 50.0}}
    assert gpu_timing._beside_database("cuda:0", CFG, 2, decode, prefill) == "fake h200"
    want = 4.0 + 0.32 + 1e-5 * 32 * 1024
    assert decode["B32_C1024"]["db_ms"] == pytest.approx(want) and decode["B32_C1024"]["step_over_db"] == pytest.approx(8 / want)
    assert prefill["P2048"]["db_ms"] == pytest.approx(3 + 0.02 * 2048 + 1e-6 * 2048**2, rel=0.01)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "NVIDIA L4")
    assert gpu_timing._beside_database("cuda:0", CFG, 2, {}, {}) == "none for nvidia l4"
    assert gpu_timing._beside_database("cpu", CFG, 2, {}, {}) == "none for cpu"
