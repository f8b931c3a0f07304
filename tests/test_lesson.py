"""The lesson: its measurement behaves, its text carries only measured numbers, its command runs."""
import ast
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from experiments.analysis.interference import inflation, measure, rounds
from experiments.hardware import Hardware
from tests.conftest import ROOT
from workers.weights import build_model

FIGURE = re.compile(r"(?<![\w.-])\d+(?:\.\d+)?(?![\w-])")   # not inside names like llama-3-8b


def test_interference_measures_interleaved_rounds_of_every_chunk():
    model = build_model(model="tiny", seed=0)
    hw = Hardware("test", peak_flops=1e11, mem_bw=1e10, nvlink_bw=0.0, pcie_bw=0.0, net_bw=0.0)
    pts = measure(model, hw, batches=[4], context=64, chunks=[0, 32, 256], repeats=3, max_remeasure=2)
    assert [p.chunk for p in pts] == [0, 32, 256] and pts[0].inflation == 1.0
    # every round steps once with each chunk (measure asserts each step carried the B decodes and its chunk)
    (num_rounds,) = {len(p.samples_ms) for p in pts}
    assert 3 + max(p.remeasured for p in pts) <= num_rounds <= 3 + 2
    for p in pts:
        assert p.step_ms == pytest.approx(float(np.median(p.samples_ms)))
        assert p.step_ms_min <= p.step_ms <= p.step_ms_max
    for p in pts[1:]:    # inflation: the median of each round's step over that round's decode-only step
        paired = [t / b for t, b in zip(p.samples_ms, pts[0].samples_ms)]
        assert p.inflation == pytest.approx(float(np.median(paired)))
        assert p.implausible == (p.inflation < 1.0)
        assert p.prefill_tok_s_ci is None or p.prefill_tok_s_ci[0] <= p.prefill_tok_s <= p.prefill_tok_s_ci[1]
    predicted = [p.predicted_ms for p in pts]
    assert predicted == sorted(predicted), "the roofline grows with the chunk"
    with pytest.raises(ValueError, match="must include 0"):
        measure(model, hw, batches=[4], context=64, chunks=[32], repeats=1)


def test_rounds_interleave_chunks_and_remeasure_implausible_points_up_to_a_bound():
    seen = []

    def fake(chunk):            # the 64-token chunk always measures faster than decode-only
        seen.append(chunk)
        return {0: 10.0, 64: 8.0, 512: 40.0}[chunk]
    times, extra = rounds(fake, [0, 64, 512], repeats=2, max_remeasure=3)
    assert seen[:9] == [0, 64, 512, 64, 512, 0, 512, 0, 64]    # warm-up, then the order rotates each round
    assert len(seen) == 3 * (1 + 2 + 3)                        # three extra rounds, then it stops
    assert extra == {0: 0, 64: 3, 512: 0} and len(times[64]) == 5
    assert inflation(times, 64) == pytest.approx(0.8) and inflation(times, 512) == pytest.approx(4.0)
    later = iter([8.0, 8.0, 8.0] + [14.0] * 10)               # warm-up and two rounds fast, then plausible
    times, extra = rounds(lambda c: next(later) if c else 10.0, [0, 64], repeats=2, max_remeasure=3)
    assert times[64] == [8.0, 8.0, 14.0, 14.0] and extra == {0: 0, 64: 2}   # medians 0.8, 0.8, then 1.1: stop
    assert inflation(times, 64) == pytest.approx(1.1)


def _literal_texts(tree):
    """String literals of a module, without f-string format specs (those hold widths, not figures)."""
    specs = {id(n.format_spec) for n in ast.walk(tree) if isinstance(n, ast.FormattedValue) and n.format_spec}
    spec_parts = set()
    for n in ast.walk(tree):
        if id(n) in specs:
            spec_parts |= {id(m) for m in ast.walk(n)}
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in spec_parts:
            yield n.lineno, n.value


@pytest.mark.parametrize("module", ["lesson/text.py", "lesson/when.py", "lesson/words.py", "lesson/stall.py"])
def test_no_figure_in_the_lesson_text_is_a_literal(module):
    tree = ast.parse((ROOT / "experiments" / module).read_text())
    offenders = [(line, text) for line, text in _literal_texts(tree) if FIGURE.search(text)]
    assert not offenders, offenders


def test_a_cell_takes_a_layout_s_full_scale_value_over_its_estimate(monkeypatch):
    """The planner checks its best two layouts on the whole cluster and lowers one that misses there: the
    cell's mode values and winner come from that check, not from the estimate it replaced."""
    from experiments.analysis import decision_sim
    from experiments.analysis.plan import Candidate

    chunked = Candidate("colocated-chunked", 256, 8.0, "probe")
    estimate = Candidate("1p3d", None, 9.0, "phases")
    checked = Candidate("1p3d", None, 6.0, "full scale (the phases estimate 9/GPU missed: 80.0%)")
    result = {"candidates": [Candidate("colocated-prefill_first", None, 5.0, "probe"), chunked, estimate,
                             Candidate("2p2d", None, 4.0, "phases")],
              "best": chunked, "runner_up": checked, "num_sims": 9, "costs": "fake"}
    monkeypatch.setattr(decision_sim, "plan", lambda *a, **k: result)
    monkeypatch.setattr(decision_sim, "cell_config", lambda *a, **k: None)
    cell = decision_sim.simulate_cell(None, 4, 1024, 256, {}, 5e10, [256], 30, 3)
    assert cell["modes"]["disaggregated"] == {"goodput_per_gpu": 6.0, "layout": "1p3d", "how": checked.how}
    assert cell["winner"] == "colocated_chunked"


def test_the_prompt_and_link_sweeps_read_their_shared_cell_from_one_simulation(monkeypatch):
    """The crossover prompt at the map's link is in both sweeps: simulated once, the same winner in both,
    and a winner that changes back along prompt length is worded stretch by stretch."""
    from experiments.analysis import decision_sim
    from experiments.lesson.when import _map_paragraph

    calls = []

    def fake_cell(base, gpus, lp, lo, slo, bw, chunks, rpw, steps, stream="off", shared=None):
        calls.append((lp, lo, bw, stream))
        disagg = lp == 1024 or (lp == 4096 and bw > 1e11)      # wins at 1,024, and at 4,096 only over NVLink
        winner = "disaggregated" if disagg else "colocated_chunked"
        return {"prompt_len": lp, "output_len": lo, "winner": winner, "modes": {}, "source": "fake", "num_sims": 1}

    monkeypatch.setattr(decision_sim, "simulate_cell", fake_cell)
    link_bws = [1e9, 5e10, 4.5e11]
    out = decision_sim.simulated_map(None, 4, [512, 1024, 2048, 4096], [256], {"tight": {"ttft_ms": 1, "tpot_ms": 1}},
                                     5e10, link_bws, 256, 4096, [256], stream="layer")["tight"]
    assert len(calls) == len(set(calls))                     # no cell simulated twice
    assert calls.count((4096, 256, 5e10, "layer")) == 1
    bp, bl = out["by_prompt"], out["by_link"]
    assert bp["winners"][bp["prompt_lens"].index(4096)] == bl["winners"][bl["link_bws"].index(5e10)] \
        == "colocated_chunked"
    assert [r["winner"] for r in bp["runs"]] == ["colocated_chunked", "disaggregated", "colocated_chunked"]
    assert bp["crossover_prompt_len"] == 1024
    text = _map_paragraph("tight", out, {"crossover_output_len": 256, "crossover_prompt_len": 4096})
    assert "disaggregated from there" not in text
    assert "colocated chunked at 512, disaggregated at 1024, colocated chunked at 2048-4096 prompt tokens" in text
    assert "disaggregation wins only above 50.0 GB/s" in text


@pytest.mark.slow
def test_quick_lesson_writes_every_section_with_its_numbers(tmp_path):
    out = tmp_path / "lesson"
    proc = subprocess.run([sys.executable, "-m", "experiments.lesson", "quick=true", f"hydra.run.dir={out}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["quick"] is True
    text = (out / "lesson.md").read_text()
    results = json.loads((out / "lesson.json").read_text())
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert len(sections) == 7
    for section in sections:
        assert FIGURE.search(section), f"section without numbers: {section[:60]}"
    for fig in ("roofline.png", "interference.png", "stall_timeline.png", "chunking_tradeoff.png", "chunking.png",
                "goodput_vs_rate.png", "breakdown.png", "decision.png", "decision_link.png"):
        assert (out / fig).read_bytes()[:4] == b"\x89PNG" and f"]({fig})" in text
    # the numbers in the text are the run's, comparisons worded from their intervals
    from experiments.lesson import lesson, text as lesson_text
    from experiments.serving import compare
    base = results["interference"]["points"][0]
    assert f"decode-only step took {lesson_text.num(base['step_ms'])} ms" in text
    pf = results["chunking"]["refs"]["prefill_first"]
    assert f"prefill_first {compare.with_ci(compare.estimate('', pf, 'itl_ms.p99'), ' ms')}" in text
    assert "intervals separate" in text or "no significant" in text
    # the end-to-end points are ordinary run directories, one repeat each in quick mode
    points = sorted(p.parent.name for p in (out / "runs" / "chunking").glob("*/metrics.json"))
    assert points == ["chunked_32", "chunked_512", "disaggregated", "prefill_first"]
    assert all((out / "runs" / "chunking" / p / "rep0" / "requests.jsonl").is_file() for p in points)
    assert len(list((out / "runs" / "chunking").glob("rate_*/*/metrics.json"))) == 3    # one more rate per mode
    assert [row["chunk"] for row in results["chunking_controlled"]] == [32, 128, 512, "whole"]
    assert "no cell in this run" in text                   # quick mode measures no decision cell
    sim = results["decision"]["simulated"]                 # the map is simulated, every cell saying with what
    assert re.fullmatch(r"simulated with (roofline h200|aiconfigurator h200_sxm vllm .*)", sim["source"])
    assert f"every cell {sim['source']}" in text
    assert all(c["source"] == sim["source"] and c["winner"] for s in sim["by_slo"].values() for c in s["grid"])
    # the cells count the exposed transfer, and the text says what streaming saves in link bandwidth
    assert sim["stream"] == "layer" and "only the exposed transfer delays the second token" in text
    for s in sim["by_slo"].values():
        off, layer = s["least_link_bw"]["off"], s["least_link_bw"]["layer"]
        if off is not None and layer is not None and off > 1.02 * layer:
            assert f"overlap lets a link {lesson_text.num(off / layer)}x slower do" in text
    h200 = results["roofline"]["hardware"]["h200"]
    assert h200["ridge"] == pytest.approx(989e12 / 4.8e12)
    # the GPU steps measured where the database has them, and the map priced from the same source
    if h200["measured"]["source"]:
        assert sim["source"] == f"simulated with {h200['measured']['source']}" and "Measured on the h200" in text
        assert h200["measured"]["ms"]["decode B=32 C=1024"] == pytest.approx(6.3, abs=0.1)
    else:
        assert "not in the database" in text and "roofline h200" in sim["source"]

    # the same results with a measured cell and an implausible chunk: the text follows the numbers
    modes = {"colocated-prefill_first": pf, "colocated-chunked": results["chunking"]["chunked"][0],
             "1p1d": results["chunking"]["refs"]["disaggregated"]}
    results["decision"]["measured"] = [{"prompt_len": 512, "output_len": 16, "modes": modes,
                                        "winner": lesson._winner(modes)}]
    results["interference"]["points"][1] |= {"inflation": 0.8, "inflation_ci": [0.7, 0.9], "implausible": True,
                                             "remeasured": 3}
    again = lesson_text.render(results)
    assert all(compare.with_ci(compare.estimate("", m, "goodput_per_gpu")) in again for m in modes.values())
    assert "implausible (mixed step faster than decode-only): noise dominates; re-measured 3 times" in again
    assert f"Measured here, disaggregation won {int(lesson._winner(modes) == '1p1d')} of 1 cells" in again


def test_roofline_command(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "experiments.roofline", "model=llama-3-8b", "hardware=h200",
                           f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    steps = {p["step"]: p for p in result["points"]}
    assert steps["decode B=32 C=1024"]["bound"] == "memory"
    assert steps["prefill P=2048"]["bound"] == "compute"
    ratio = steps["mixed B=32 C=1024 + P=2048"]["time_ms"] / steps["decode B=32 C=1024"]["time_ms"]
    assert 5 < ratio < 10, "a 2048-token prefill stretches a 32-sequence decode step several times over"
    assert "decode B=32 C=1024" in proc.stdout and (tmp_path / "roofline.png").read_bytes()[:4] == b"\x89PNG"
    bad = subprocess.run([sys.executable, "-m", "experiments.roofline", "hardware.name=tpu",
                          f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "hardware.name='tpu'" in bad.stderr


# -- the rate curves and the breakdown -----------------------------------------------------------
def test_simulated_rate_curves_share_the_gpus_and_mark_where_each_falls_below():
    from hydra import compose, initialize_config_dir

    from experiments.lesson import rates
    from experiments.config import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        base = compose("config", overrides=["compare=null", "report=false", "model=llama-3-8b", "hardware=h200",
                                               "hardware.costs=roofline"])   # with or without aiconfigurator
    out = rates.simulated_curves(base, 2, 2048, 64, {"ttft_ms": 1000.0, "tpot_ms": 50.0}, 5e10, "layer",
                                 [{"layout": "colocated-chunked", "chunk": 512}, {"layout": "1p1d"}],
                                 [1, 100], 10, breakdown_rate_per_gpu=1)
    assert out["gpus"] == 2 and out["costs"] == "roofline h200"
    for c in out["curves"]:
        assert len(c["attainment"]) == 2 and all(0 <= a <= 1 for a in c["attainment"])
        assert c["met"] == [True, False], c            # a trickle is served, a hundred a second per GPU is not
        assert c["last_met"] == 1 and c["falls_below"] == 100
        assert c["breakdown"]["num_requests"] > 0
    disagg = out["curves"][1]["breakdown"]["mean_ms"]
    assert disagg["handoff"] + disagg["exposed_transfer"] > 0 == out["curves"][0]["breakdown"]["mean_ms"]["handoff"]


TINY = ["serve_overrides=['backend=sim','hardware=h200']", "repeats=1",
        "interference.batches=[2]", "interference.context=32", "interference.chunks=[0,16,64]",
        "interference.repeats=2", "interference.max_remeasure=0",
        "chunking_controlled.num_decodes=2", "chunking_controlled.context=16", "chunking_controlled.prompt_len=64",
        "chunking_controlled.chunks=[16,whole]", "chunking_controlled.repeats=2",
        "chunking.num_requests=6", "chunking.chunk_sizes=[32,128]",
        "goodput_vs_rate.measured.chunk=128", "goodput_vs_rate.measured.rates=[24.0]",
        "goodput_vs_rate.simulated.rates_per_gpu=[1,100]", "goodput_vs_rate.simulated.requests_per_worker=5",
        "decision.measured.prompt_lens=[]", "decision.simulated.prompt_lens=[512,4096]",
        "decision.simulated.output_lens=[256]", "decision.simulated.link_bws=[5e9,5e10]",
        "decision.simulated.chunks=[512]", "decision.simulated.steps=1", "decision.simulated.requests_per_worker=5"]


def test_lesson_on_a_tiny_config_writes_every_section_figure_and_key(tmp_path, monkeypatch):
    """The whole lesson on a tiny config, in process: the served points simulated, the decision map's cells
    faked (tests/test_decision.py and the tests above check them), everything else real. Structure, keys and
    shapes; no timing."""
    from hydra import compose, initialize_config_dir

    from experiments.analysis import decision_sim
    from experiments.lesson import lesson
    from experiments.config import CONF_DIR

    calls = []

    def fake_cell(base, gpus, lp, lo, slo, bw, chunks, rpw, steps, stream="off", shared=None):
        calls.append((slo["tpot_ms"], lp, lo, bw, stream))
        winner = "disaggregated" if slo["tpot_ms"] < 10 and bw > 1e10 else "colocated_chunked"
        return {"prompt_len": lp, "output_len": lo, "winner": winner, "source": "simulated with fake", "num_sims": 1,
                "modes": {winner: {"goodput_per_gpu": 1.0, "layout": winner, "how": "fake"}}}
    monkeypatch.setattr(decision_sim, "simulate_cell", fake_cell)
    out = tmp_path / "lesson"
    out.mkdir()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        lesson.run(compose("lesson", overrides=TINY), out)
    assert len(calls) == len(set(calls))                   # no cell simulated twice
    text = (out / "lesson.md").read_text()
    r = json.loads((out / "lesson.json").read_text())
    sections = re.findall(r"^## \d+\. (.+)$", text, flags=re.M)
    assert len(sections) == 7 and "What changes on a GPU" in sections
    for fig in ("roofline.png", "interference.png", "stall_timeline.png", "chunking_tradeoff.png", "chunking.png",
                "goodput_vs_rate.png", "breakdown.png", "decision.png", "decision_link.png"):
        assert (out / fig).read_bytes()[:4] == b"\x89PNG" and f"]({fig})" in text, fig
    # chunking_controlled: one row per chunk size, [median, low, high] each; the references beside it
    rows = r["chunking_controlled"]
    assert [row["chunk"] for row in rows] == [16, "whole"]
    for row in rows + list(r["stall"]["refs"].values()):
        for key in ("stall_ms", "ttft_ms"):
            assert len(row[key]) == 3 and row[key][1] <= row[key][0] <= row[key][2]
    assert set(r["stall"]["refs"]) == {"prefill_first", "disaggregated"}
    assert set(r["stall"]["timeline"]) >= {"prefill_first", "chunk 16", "disaggregated"}
    # goodput against rate, both scales, the knee of every curve
    g = r["goodput_vs_rate"]
    for sec in (g["simulated"], g["measured"]):
        for c in sec["curves"]:
            assert len(c["attainment"]) == len(c["rates_per_gpu"]) == len(c["met"])
            assert c["falls_below"] is None or c["falls_below"] in c["rates_per_gpu"]
    assert [c["falls_below"] for c in g["simulated"]["curves"]] == [100.0] * 4
    assert len(g["measured"]["curves"]) == 3 and g["measured"]["curves"][0]["rates"] == [6.0, 24.0]
    sb, mb = g["simulated"]["breakdown"], g["measured"]["breakdown"]
    assert sb["grew_most"] in ("queue", "prefill", "exposed_transfer", "handoff", "decode")
    assert "the part that grew most against colocated is" in text
    assert set(mb["extra_ci"]) == set(mb["extra_ms"])            # the measured one carries its intervals
    assert (mb["grew_most"] is None) == (len(mb["grew_most_among"]) > 1)
    # the decision map: both SLOs, the shared cell the same in both sweeps
    for s in r["decision"]["simulated"]["by_slo"].values():
        bp, bl = s["by_prompt"], s["by_link"]
        assert bp["winners"][bp["prompt_lens"].index(4096)] == bl["winners"][bl["link_bws"].index(5e10)]
    assert set(r["decision"]["simulated"]["by_slo"]) == {"loose", "tight"}
    tight = r["decision"]["simulated"]["by_slo"]["tight"]["slo"]      # set from the map's own decode step
    assert tight["tpot_ms"] == pytest.approx(tight["tpot_x_decode"] * tight["decode_ref_ms"], abs=0.01)
    assert f"x the {tight['decode_ref']['batch']}-sequence decode step" in text
    assert [p["batch"] for p in r["interference"]["points"]] == [2, 2, 2]
    took = r["section_s"]                                  # where the lesson's time went, section by section
    assert list(took) == ["roofline", "interference", "chunking_controlled", "chunking", "goodput_vs_rate", "decision"]
    assert all(v >= 0 for v in took.values()) and sum(took.values()) <= r["elapsed_s"] + 1
    assert f"decision {__import__('experiments.lesson.text', fromlist=['num']).num(took['decision'])} s" in text
    base = r["interference"]["points"][0]
    assert f"decode-only step took {__import__('experiments.lesson.text', fromlist=['num']).num(base['step_ms'])} ms" in text


def test_slo_presets_set_from_the_hardware_follow_its_decode_step():
    """A tpot_x_decode is that multiple of the decode-only step the costs price; a faster GPU gets a tighter TPOT."""
    from hydra import compose, initialize_config_dir

    from experiments.analysis.decision_sim import decode_step_ms, resolve_slos
    from experiments.config import ConfigError
    from experiments.config import CONF_DIR

    ref = {"batch": 32, "context": 1024}
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        bases = {hw: compose("config", overrides=["compare=null", "model=llama-3-8b", f"hardware={hw}",
                                                  "hardware.costs=roofline"]) for hw in ("a100", "h200")}
    steps = {hw: decode_step_ms(b, 32, 1024) for hw, b in bases.items()}
    assert steps["h200"] < steps["a100"]                  # more memory bandwidth, a faster decode step
    assert decode_step_ms(bases["h200"], 32, 4096) > steps["h200"] > decode_step_ms(bases["h200"], 1, 1024)
    for hw, base in bases.items():
        out = resolve_slos(base, {"loose": {"ttft_ms": 1000.0, "tpot_ms": 50.0},
                                  "tight": {"ttft_ms": 1000.0, "tpot_x_decode": 1.25}}, ref)
        assert out["loose"] == {"ttft_ms": 1000.0, "tpot_ms": 50.0}
        assert out["tight"]["tpot_ms"] == pytest.approx(1.25 * steps[hw], abs=0.01)
        assert out["tight"]["decode_ref"] == ref and out["tight"]["decode_ref_ms"] == steps[hw]
    for bad, why in (({"ttft_ms": 1.0}, "neither"), ({"ttft_ms": 1.0, "tpot_ms": 9.0, "tpot_x_decode": 2}, "both"),
                     ({"ttft_ms": 1.0, "tpot_x_decode": 0.5}, "must be >= 1")):
        with pytest.raises(ConfigError, match=f"slos.odd.*{why}"):
            resolve_slos(bases["h200"], {"odd": bad}, ref)


def test_the_answer_on_when_states_the_served_attainment_at_load_from_its_intervals():
    from experiments.lesson.when import _at_load

    def curves(ci_b):
        return {"measured": {"curves": [
            {"name": "colocated", "rates": [6.0, 40.0], "rates_per_gpu": [3.0, 20.0], "attainment": [1.0, 0.9],
             "attainment_ci": [(1.0, 1.0), (0.8, 1.0)]},
            {"name": "disaggregated", "rates": [6.0, 40.0], "rates_per_gpu": [3.0, 20.0], "attainment": [1.0, 0.4],
             "attainment_ci": [(1.0, 1.0), ci_b]}]}}
    text = _at_load(curves((0.2, 0.6)))
    low, high = text.split("; at ")
    assert "at 6.00 requests/s on 2 workers" in low and "no significant difference" in low
    assert high.startswith("40.0 requests/s on 2 workers")
    assert "disaggregated 40.0% [20.0, 60.0]" in high and "disaggregated is lower than colocated" in high
    assert "lower" not in _at_load(curves((0.2, 0.85)))
    assert _at_load(None) == _at_load({"measured": None}) == ""


def test_the_answer_on_when_weighs_disaggregation_against_colocation_on_the_same_requests():
    from experiments.lesson.when import _against_colocated

    def ref(itl, itl_ci, ttft, ttft_ci):
        return {"itl_ms": {"p99": itl}, "ttft_ms": {"p50": ttft},
                "ci": {"itl_ms.p99": itl_ci, "ttft_ms.p50": ttft_ci}}
    ch = {"rate": 6.0, "refs": {"disaggregated": ref(30.0, [25.0, 40.0], 400.0, [300.0, 500.0]),
                                "prefill_first": ref(180.0, [150.0, 200.0], 160.0, [150.0, 190.0])}}
    text = _against_colocated(ch)
    assert "(6.00 requests/s, the chunked prefill end-to-end runs)" in text
    itl, ttft = text.split("; TTFT p50")
    assert "disaggregated is lower than colocated prefill_first" in itl
    assert "colocated prefill_first is lower than disaggregated" in ttft
    ch["refs"]["disaggregated"] = ref(30.0, [25.0, 40.0], 170.0, [140.0, 300.0])
    assert "no significant difference" in _against_colocated(ch).split("; TTFT p50")[1]
    assert _against_colocated(None) == _against_colocated({"refs": {}}) == ""


def test_the_answer_on_when_cites_the_controlled_stall_disaggregation_removes():
    from experiments.lesson.when import _stall_against_colocated

    st = {"refs": {"disaggregated": {"stall_ms": [5.0, 4.5, 6.0], "ttft_ms": [80.0, 70.0, 90.0]},
                   "prefill_first": {"stall_ms": [80.0, 77.0, 84.0], "ttft_ms": [75.0, 72.0, 81.0]}}}
    stall, ttft = _stall_against_colocated(st).split("; the prompt's TTFT")
    assert "disaggregated 5.00 ms [4.50, 6.00]" in stall and "disaggregated is lower than colocated prefill_first" in stall
    assert "no significant difference" in ttft
    st["refs"]["disaggregated"]["stall_ms"] = [70.0, 60.0, 78.0]           # the intervals touch: no difference
    assert "no significant difference" in _stall_against_colocated(st).split("; the prompt's TTFT")[0]
    assert _stall_against_colocated(None) == _stall_against_colocated({"refs": {}}) == ""
