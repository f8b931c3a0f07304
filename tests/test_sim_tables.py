"""Columnar records of a large simulated run: the same metrics from pooled gaps as from every
token's time, and tables that read back as the JSONL rows they stand for."""
import numpy as np
import pytest

from experiments.serving.metrics import percentiles, summarize, weighted_percentiles
from experiments.serving.steps import step_ratio
from experiments.serving.tables import read_table, request_columns, step_columns, step_ratio_columns, summarize_sim, write_table
from experiments.sim.records import request_row, step_rows
from experiments.sim.simulator import Arrival, SimConfig, Simulator
from tests.test_sim import costs
from workers.config import EngineConfig

ARRIVALS = [Arrival(f"r{i}", 0.0007 * i, 20 + 7 * (i % 11), 3 + (i * 5) % 17) for i in range(60)]


def _sim(layout: str, keep: bool) -> Simulator:
    if layout == "colocated":
        cfg = SimConfig(["colocated"] * 2, {"colocated": EngineConfig(policy="chunked", token_budget=48, max_batch=6)},
                        {"colocated": 60}, kv_bytes_per_token=1000, num_layers=4, max_model_len=4096,
                        keep_tokens=keep, pool_gaps=not keep)
    else:
        cfg = SimConfig(["prefill", "decode", "decode"],
                        {"prefill": EngineConfig(policy="prefill_first", token_budget=4096),
                         "decode": EngineConfig(policy="chunked", token_budget=64, max_batch=8)},
                        {"prefill": 200, "decode": 80}, kv_bytes_per_token=1000, num_layers=4, max_model_len=4096,
                        keep_tokens=keep, pool_gaps=not keep)
    sim = Simulator(cfg, costs(gap=(0.05, 0.001), ret=0.2, dispatch=0.1, factors={"decode": 1.1, "shared_host": 1.3}))
    sim.run(ARRIVALS)
    return sim


def _close(a, b):
    if isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _close(a[k], b[k])
    elif isinstance(a, float) and b is not None:
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12)
    else:
        assert a == b


@pytest.mark.parametrize("layout", ["colocated", "1p2d"])
def test_pooled_gaps_give_the_metrics_every_token_s_time_gives(layout):
    """The same simulation (deterministic) kept with every token's time and without: metrics.summarize
    of the JSONL rows and summarize_sim of the columns and pooled gaps agree on every number."""
    full, pooled = _sim(layout, True), _sim(layout, False)
    rows = [request_row(r) for r in full.records.values()]
    want = summarize(rows, 50.0, 2.0, 2)
    got = summarize_sim(pooled, request_columns(list(pooled.records.values())), 50.0, 2.0, 2)
    assert want["num_completed"] == 60 and want["itl_ms"]["p99"] is not None
    _close(got, want)
    steps = [s for w in full.workers for s in step_rows(w.name, w.log)]
    _close(step_ratio_columns(step_columns(pooled.workers)), step_ratio(steps))


def test_tables_read_back_as_the_rows_they_stand_for(tmp_path):
    full, pooled = _sim("1p2d", True), _sim("1p2d", False)
    write_table(tmp_path / "requests.npz", request_columns(list(pooled.records.values())))
    write_table(tmp_path / "steps.npz", step_columns(pooled.workers))
    per_token = {"itl_s", "client_itl_s", "output_ids", "itl_ms", "retried_for"}
    rows = [request_row(r) for r in full.records.values()]
    back = read_table(tmp_path / "requests.npz")
    assert len(back) == len(rows)
    for a, b in zip(back, rows):
        assert set(a) == set(b)
        _close({k: a[k] for k in a if k not in per_token}, {k: b[k] for k in b if k not in per_token})
    steps = [s for w in full.workers for s in step_rows(w.name, w.log)]
    _close(read_table(tmp_path / "steps.npz"), steps)


def test_weighted_percentiles_are_those_of_the_expanded_sample():
    rng = np.random.default_rng(3)
    values = rng.exponential(1.0, 40)
    weights = rng.integers(1, 6, 40).astype(float)
    _close(weighted_percentiles(values, weights), percentiles(np.repeat(values, weights.astype(int))))
    assert weighted_percentiles(values[:0], weights[:0])["p50"] is None


def test_the_bench_simulates_and_writes_a_run_and_knows_its_targets(tmp_path, capsys):
    import json

    from experiments.sim.bench import TARGETS, main

    assert main(["--requests", "300", "--gpus", "4", "--layouts", "colocated-chunked,2p2d", "--write", str(tmp_path)]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["completed"] for r in line["results"]] == [300, 300]
    assert (tmp_path / "2p2d" / "rep0" / "requests.jsonl").is_file()
    assert main(["--requests", "50", "--gpus", "8"]) == 0           # the default layouts fit any --gpus
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["layout"] for r in line["results"]] == ["colocated-chunked", "2p6d"]
    assert main(["--requests", "20", "--gpus", "1"]) == 0           # one GPU: no P:D split to make
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["layout"] for r in line["results"]] == ["colocated-chunked"]
    assert main(["--requests", "20", "hardware=tpu"]) == 2          # a bad override: one line naming it
    assert "hardware can be one of: a100, h100, h200" in capsys.readouterr().err
    assert {t[0] for t in TARGETS} == {"run-100k-64", "bench-1m-1000", "plan-1000"}
    with pytest.raises(SystemExit, match="choose from"):
        main(["--targets", "nope"])
    for args, culprit in ((["--requests", "0"], "error: --requests 0"), (["--rate-per-gpu", "-1"], "error: --rate-per-gpu -1"),
                          (["--write", str(tmp_path / "2p2d" / "rep0" / "requests.jsonl")], "error: --write")):
        with pytest.raises(SystemExit):                # flags it cannot run with: one line naming the flag
            main(["--gpus", "2", *args])
        assert culprit in capsys.readouterr().err


def test_a_target_runs_in_an_emptied_directory_so_it_never_resumes_an_earlier_run(tmp_path):
    from experiments.sim.bench import run_target

    stale = tmp_path / "t" / "rep0"
    stale.mkdir(parents=True)
    (stale / "metrics.json").write_text("{}")
    r = run_target("t", ["-c", "import os; print(sorted(os.listdir('.')))"], tmp_path)
    assert r["rc"] == 0 and not (tmp_path / "t").exists()
