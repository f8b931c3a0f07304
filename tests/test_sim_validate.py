"""The simulator against the real engine (its step sequence, a small run's latencies) and against
real runs' files (experiments.validate, and --against another run)."""
import pytest

from experiments.sim.costs import Costs
from experiments.sim.records import step_rows
from experiments.sim.simulator import Arrival, SimConfig, Simulator
from experiments.sim.stepmodel import LinearStepModel
from experiments.sim.transfer import TransferModel
from tests.test_sim import MS, costs
from workers.config import EngineConfig


@pytest.fixture(scope="module")
def tiny():
    """The tiny model, run on one torch thread as a worker here runs (two threads spin against each
    other when the machine is loaded, and a timed step stretches many times)."""
    import torch

    from workers.weights import build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build_model(model="tiny", seed=1)
    torch.set_num_threads(threads)


def _real_steps(model, cfg: EngineConfig, arrivals: dict[int, list[tuple[str, int, int]]]):
    """The real engine's steps (and each request's tokens by step) when requests (id, prompt, max_tokens)
    are added before the step numbered by the key of `arrivals`."""
    from tests.conftest import random_prompts
    from workers.engine import Engine
    from workers.request import SamplingParams

    engine = Engine(model, cfg)
    step, made = 0, {}
    while step <= max(arrivals) or engine.has_work():
        for rid, n, mt in arrivals.get(step, []):
            ids = random_prompts(1, model.cfg.vocab_size, [n], seed=n)[0]
            engine.add_request(rid, ids, SamplingParams(max_tokens=mt, ignore_eos=True))
        for ev in engine.step():
            made.setdefault(ev.request_id, []).append(step)
        step += 1
    keys = ("num_prefill_tokens", "num_prefill_seqs", "num_decode_seqs", "num_blocks_used", "num_running",
            "num_waiting", "num_preempted")
    return [tuple(getattr(s, k) for k in keys) for s in engine.trace], made, keys


@pytest.mark.parametrize("policy,budget", [("prefill_first", 256), ("chunked", 48)])
def test_simulator_reproduces_the_real_engine_s_step_sequence(tiny, policy, budget):
    """The real engine serves requests arriving at given steps with a KV pool small enough to preempt;
    the simulator, each step 1 ms and each request arriving half a step before the step it joined,
    schedules the same steps (prefill tokens, decodes, blocks, preemptions) and makes each token in the
    same step, with decode runs advanced in one event or not."""
    arrivals = {0: [("a", 70, 40), ("b", 20, 30)], 3: [("c", 90, 25)], 5: [("d", 33, 35), ("e", 60, 20)],
                12: [("f", 100, 12)]}
    cfg = EngineConfig(policy=policy, token_budget=budget, num_kv_blocks=18, block_size=16, max_batch=4)
    real, made, keys = _real_steps(tiny, cfg, arrivals)
    assert sum(s[-1] for s in real) > 0, "the pool is small enough to preempt"
    for ff in (True, False):
        sim = Simulator(SimConfig(["colocated"], {"colocated": cfg}, {"colocated": 18}, kv_bytes_per_token=1000,
                                  num_layers=4, max_model_len=4096, fast_forward=ff),
                        costs(coef=(1.0, 0.0, 0.0, 0.0, 0.0, 0.0)))
        recs = sim.run([Arrival(rid, max(0.0, k - 0.5) * MS, n, mt) for k, reqs in arrivals.items()
                        for rid, n, mt in reqs])
        steps = [tuple(s[k] for k in keys) for s in step_rows("colocated:0", sim.workers[0].log)]
        assert steps == real
        # a token made in step k (0-based) is made at the step's end, (k + 1) ms
        assert {r.id: [round(t / MS) - 1 for t in r.token_times()] for r in recs} == made


def test_a_small_real_run_is_simulated_within_a_loose_tolerance(tiny):
    """Profile the tiny model's steps and host gap here (a small grid), serve a small batch of requests
    on the real engine, and simulate the same requests with the fitted model: the step count exact,
    and mean TTFT and mean E2E latency within a factor of 2. Everything is timed in this thread's CPU
    time (one torch thread: the step's compute runs in it), which other processes' load on a shared
    machine leaves alone, as wall time measured moments apart did not always (the closer targets are
    `experiments.validate`'s, on wall time, not a test's); a wrong step composition or step model
    (chunks not counted, decodes dropped) misses by more."""
    import time

    from experiments.analysis.profile import StepBench, fit_steps, grid_cells, measure_gap, measure_steps
    from tests.conftest import random_prompts
    from workers.engine import Engine
    from workers.request import SamplingParams

    clock = time.thread_time
    bench = StepBench(tiny, 8, 256, 128, clock=clock)
    cells = grid_cells([0, 1, 4, 8], [32, 256], [0, 32, 64], [0, 64])
    fit = fit_steps(measure_steps(bench, cells, 3))
    gap = measure_gap(tiny, [1, 8], steps=12, clock=clock)

    lengths, outs = [60, 20, 120, 45, 90, 30], [16, 24, 8, 20, 12, 16]
    cfg = EngineConfig(policy="chunked", token_budget=64, num_kv_blocks=128, max_batch=8)
    engine = Engine(tiny, cfg, clock=clock)
    prompts = random_prompts(len(lengths), tiny.cfg.vocab_size, lengths, seed=5)
    t0 = clock()
    for i, (p, n) in enumerate(zip(prompts, outs)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
    times = {}
    for ev in engine.run():
        times.setdefault(ev.request_id, []).append(ev.time - t0)
    c = Costs(LinearStepModel(fit["coef"], gap["gap_coef"]), {"local": TransferModel(0.0, 1e9)})
    real_ttft = sum(t[0] for t in times.values()) / len(times)
    real_e2e = sum(t[-1] for t in times.values()) / len(times)

    sim = Simulator(SimConfig(["colocated"], {"colocated": cfg}, {"colocated": 128}, kv_bytes_per_token=1000,
                              num_layers=4, max_model_len=4096), c)
    recs = sim.run([Arrival(f"r{i}", 0.0, n, m) for i, (n, m) in enumerate(zip(lengths, outs))])
    sim_ttft = sum(r.token_times()[0] for r in recs) / len(recs)
    sim_e2e = sum(r.token_times()[-1] for r in recs) / len(recs)
    assert sim.workers[0].engine.num_steps == len(engine.trace)
    for sim_s, real_s in ((sim_ttft, real_ttft), (sim_e2e, real_e2e)):   # within 2x either way
        assert 0.5 < sim_s / real_s < 2.0, (sim_s, real_s)


def test_a_simulated_run_writes_a_run_directory_that_validate_replays(tmp_path):
    """backend=sim through experiments.run writes the files of a real run; experiments.validate replays
    that directory (here against the simulator itself, with the profile in the repository) and ends
    with the JSON line the issue gives: the same simulator on the same requests, every error zero. Its
    speed ratio reads 1 there, and 1.3 for a run priced by a profile whose steps all take 1.3x as long."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    profile = next((ROOT / "profiles").glob("*/tiny-float32-1t.json"))
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "experiments.run", "backend=sim", f"hardware.profile={profile}",
                           "workload.num_requests=30", f"hydra.run.dir={run}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for point in ("colocated-prefill_first", "colocated-chunked", "1p1d"):
        rep = run / point / "rep0"
        assert {"config.yaml", "requests.jsonl", "steps.jsonl", "metrics.json"} <= {p.name for p in rep.iterdir()}
        assert json.loads((rep / "metrics.json").read_text())["simulated"]["costs"].startswith("profile ")
    assert (run / "report.md").is_file()
    proc = subprocess.run([sys.executable, "-m", "experiments.validate", str(run), "--profile", str(profile)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(line) == {"met", "total", "inside", "judged", "errors", "max_abs_error", "real_spread", "speed_ratio"}
    # a run made at the profile's own speed: its steps read the factors the profile was calibrated at
    assert set(line["speed_ratio"]) == {"decode", "prefill"}
    assert all(r == pytest.approx(1.0, abs=0.05) for r in line["speed_ratio"].values()), line["speed_ratio"]
    assert set(line["real_spread"]) == set(line["errors"])     # per value; None for a point of one repeat
    assert all(v is None for v in line["real_spread"].values())
    assert "1p1d/ttft_mean" in line["errors"] and "colocated-chunked/itl_p99" in line["errors"]
    assert line["met"] == line["total"] == 51 and line["judged"] == line["inside"] == 0   # one repeat: no range
    assert line["max_abs_error"] == pytest.approx(0.0, abs=1e-9)
    assert "simulated: 51 of 51 met" in proc.stdout

    # the same requests on a machine whose steps all take 1.3x as long: the run reads 1.3x the speed ratio
    slow = json.loads(profile.read_text())
    slow["step_model"]["coef"] = [1.3 * c for c in slow["step_model"]["coef"]]
    (tmp_path / "slow.json").write_text(json.dumps(slow))
    proc = subprocess.run([sys.executable, "-m", "experiments.run", "backend=sim", f"hardware.profile={tmp_path / 'slow.json'}",
                           "workload.num_requests=30", "report=false", f"hydra.run.dir={tmp_path / 'slow'}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "experiments.validate", str(tmp_path / "slow"), "--profile", str(profile)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    ratios = json.loads(proc.stdout.strip().splitlines()[-1])["speed_ratio"]
    assert all(r == pytest.approx(1.3, abs=0.07) for r in ratios.values()), ratios
    assert "decode steps 1.3" in proc.stdout and "profile again" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "experiments.validate", str(tmp_path / "slow"), "--profile", str(profile),
                           "--calibration", str(run)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    ratios = json.loads(proc.stdout.strip().splitlines()[-1])["speed_ratio"]      # set against what priced it:
    assert all(r == pytest.approx(1.3, abs=0.07) for r in ratios.values()), ratios  # a calibration at the old speed
    assert f"machine speed against the calibration from {run}" in proc.stdout
    from experiments.analysis.validate import machine_speed
    (tmp_path / "empty").mkdir()
    assert machine_speed(tmp_path / "empty", profile, {}, "x") is None     # nothing to read a factor from: no line


def test_validate_against_another_run_of_the_same_requests_measures_how_far_runs_are_apart(tmp_path):
    """--against OTHER_RUN puts a second run of the same requests where the simulator goes (the floor
    of any simulator's error on a machine that varies): two runs that came out alike meet every target
    with zero error; a run in which one request was another length is refused, naming the point."""
    import json
    import shutil
    import subprocess
    import sys

    from tests.conftest import ROOT

    profile = next((ROOT / "profiles").glob("*/tiny-float32-1t.json"))
    a, b, other = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    proc = subprocess.run([sys.executable, "-m", "experiments.run", "backend=sim", f"hardware.profile={profile}",
                           "workload.num_requests=20", "report=false", f"hydra.run.dir={a}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    shutil.copytree(a, b)
    shutil.copytree(a, other)
    changed = sorted((other / "1p1d").glob("rep*"))[-1] / "requests.jsonl"
    rows = changed.read_text().splitlines()
    first = json.loads(rows[0])
    rows[0] = json.dumps(first | {"prompt_len": first["prompt_len"] + 1})
    changed.write_text("\n".join(rows) + "\n")

    def validate(*args):
        return subprocess.run([sys.executable, "-m", "experiments.validate", *map(str, args)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)

    proc = validate(a, "--against", b, "--profile", profile)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "other run: 51 of 51 met" in proc.stdout
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(line["against"]["errors"].values()) == {0.0}
    assert (line["against"]["met"], line["against"]["total"]) == (51, 51) and line["met"] == 51
    proc = validate(a, "--against", other, "--profile", profile)
    assert proc.returncode == 2 and "point '1p1d'" in proc.stderr and "same requests" in proc.stderr


def test_validate_counts_met_and_inside_per_value_on_a_small_synthetic_run():
    """The counting behind the JSON line, on hand-made points (no timing): a value is met when its
    error is within its target (5% on means, 10% on p99), inside when it lies between the lowest and
    highest real repeat; a point of one repeat has no range (not judged), a missing value is neither;
    the other run's side is counted the same way."""
    from experiments.analysis.validate import TARGETS_KEYS, counts, point_result, summary

    def reps(values):        # one repeat per value, every metric missing but ttft_mean and tpot_p99
        return [{k: None for k in TARGETS_KEYS} | {"ttft_mean": t, "tpot_p99": p} for t, p in values]

    real = reps([(10.0, 20.0), (12.0, 22.0), (14.0, 24.0)])          # medians 12 and 22, ranges [10, 14], [20, 24]
    # simulated: ttft_mean 12.5 (+4.2%: met, inside), tpot_p99 25.0 (+13.6%: missed, outside)
    a = point_result("a", "a", real, reps([(12.5, 25.0)] * 3), reps([(11.0, 21.0)] * 3))
    # one real repeat: met judged on the error alone (+20%: missed; +5%: met), no range to lie within
    one = point_result("one", "one", reps([(10.0, 20.0)]), reps([(12.0, 21.0)]), reps([(10.0, 20.0)]))
    result = {"points": [a, one], "against": "other-run"}
    sim = counts(result)
    assert (sim["met"], sim["total"], sim["inside"], sim["judged"]) == (2, 4, 1, 2)
    assert sim["errors"]["a/ttft_mean"] == pytest.approx(0.5 / 12) and sim["errors"]["a/goodput"] is None
    other = counts(result, "other")                    # 11.0 (-8.3%: missed), 21.0 (-4.5%: met), 10 and 20 exact
    assert (other["met"], other["total"], other["inside"], other["judged"]) == (3, 4, 2, 2)
    line = summary(result)
    assert (line["met"], line["total"], line["inside"]) == (2, 4, 1)
    assert (line["against"]["met"], line["against"]["total"], line["against"]["inside"]) == (3, 4, 2)
    assert line["real_spread"]["a/ttft_mean"] == pytest.approx(4.0 / 12.0) and line["real_spread"]["one/ttft_mean"] is None
    assert line["max_abs_error"] == pytest.approx(0.2)


def test_validate_reads_which_route_the_cpu_linears_took_in_the_run_and_in_the_profile(tmp_path):
    """A profile timed with the linears on MKL prices another engine than one whose workers chose the
    panel kernel (engine.cpu_gemm_rows=auto chooses per machine); runs and profiles from before the
    choice was recorded say so rather than guess."""
    import json

    from experiments.analysis.validate import linear_routes

    def rep(name, *rows):
        d = tmp_path / name
        d.mkdir()
        workers = [{"worker": f"w{i}"} | ({} if r == "-" else {"cpu_gemm_rows": r}) for i, r in enumerate(rows)]
        (d / "metrics.json").write_text(json.dumps({"isolation": {"per_worker": workers}}))
        return d

    mkl, panel, old = tmp_path / "mkl.json", tmp_path / "panel.json", tmp_path / "old.json"
    mkl.write_text(json.dumps({"cpu_gemm_rows": 256}))
    panel.write_text(json.dumps({"cpu_gemm_rows": None}))
    old.write_text("{}")
    runs = [rep("a", None, None), rep("b", None, None)]
    every = "the panel kernel at every size"
    assert linear_routes(runs, panel) == {"run": [every], "profile": every}
    assert linear_routes(runs, mkl) == {"run": [every], "profile": "MKL's GEMM from 256 rows"}
    assert linear_routes([rep("c", 512, None)], old) == {"run": ["MKL's GEMM from 512 rows", every],
                                                         "profile": "unrecorded"}
    assert linear_routes([rep("d", "-")], mkl)["run"] == ["unrecorded"]
