"""The lesson: its measurement behaves, its text carries only measured numbers, its command runs."""
import ast
import json
import re
import subprocess
import sys

import pytest
import torch

from experiments.interference import measure
from experiments.roofline import Hardware
from tests.conftest import ROOT
from workers.weights import build_model

FIGURE = re.compile(r"(?<![\w.-])\d+(?:\.\d+)?(?![\w-])")   # not inside names like llama-3-8b


def test_interference_step_time_grows_with_the_chunk():
    model = build_model(model="tiny", seed=0)
    hw = Hardware("test", peak_flops=1e11, mem_bw=1e10, nvlink_bw=0.0, pcie_bw=0.0, net_bw=0.0)
    pts = measure(model, hw, batches=[4], context=128, chunks=[0, 256, 1024], repeats=3)
    times = [p.step_ms for p in pts]
    assert times == sorted(times) and times[-1] > 2 * times[0], times
    assert [p.chunk for p in pts] == [0, 256, 1024] and pts[0].inflation == 1.0
    assert pts[-1].inflation == pytest.approx(pts[-1].step_ms / pts[0].step_ms)
    predicted = [p.predicted_ms for p in pts]
    assert predicted == sorted(predicted), "the roofline also grows with the chunk"


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


def test_no_figure_in_the_lesson_text_is_a_literal():
    tree = ast.parse((ROOT / "experiments" / "lesson_text.py").read_text())
    offenders = [(line, text) for line, text in _literal_texts(tree) if FIGURE.search(text)]
    assert not offenders, offenders


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
    assert len(sections) == 5
    for section in sections:
        assert FIGURE.search(section), f"section without numbers: {section[:60]}"
    for fig in ("roofline.png", "interference.png", "chunking.png", "decision.png"):
        assert (out / fig).read_bytes()[:4] == b"\x89PNG" and f"]({fig})" in text
    # the numbers in the text are the run's
    from experiments.lesson_text import num
    base = results["interference"]["points"][0]
    assert f"decode-only step took {num(base['step_ms'])} ms" in text
    pf = results["chunking"]["refs"]["prefill_first"]
    assert f"ITL p99 {num(pf['itl_ms']['p99'])} ms" in text
    cell = results["decision"]["measured"][0]
    assert all(num(m["goodput_per_gpu"]) in text for m in cell["modes"].values())
    # the end-to-end points are ordinary run directories
    runs = sorted((out / "runs").rglob("metrics.json"))
    assert len(runs) == 2 + 2 + 3          # two chunk sizes, two references, three layouts in one cell
    h200 = results["roofline"]["hardware"]["h200"]
    assert h200["ridge"] == pytest.approx(989e12 / 4.8e12)


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
