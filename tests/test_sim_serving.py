"""What serving adds to a step's time, in the simulator and in the calibration that measures it.

Hand-worked timelines use the step model of tests/test_sim.py: 1 ms per step, plus 0.01 ms per prompt
token, plus 0.1 ms per decode (100 prompt tokens: 2.0 ms; one decode: 1.1 ms); no host gap, dispatch
or return latency unless a case says so.
"""
import json
import math
import subprocess
import sys

import pytest

from experiments.analysis.calibrate import busy_intervals, calibrate, covered, step_factors
from experiments.sim.costs import from_profile
from experiments.sim.simulator import Arrival, Simulator
from experiments.sim.stepmodel import LinearStepModel, model_from_dict
from tests.conftest import ROOT
from tests.test_sim import MS, colocated, costs, ms

PROFILES = sorted((ROOT / "profiles").glob("*/*.json"))


@pytest.mark.parametrize("fast_forward", [True, False])
def test_serving_factors_scale_each_kind_of_step(fast_forward):
    # decode steps 2x, steps with prompt tokens 1.5x: the 100-token prompt [0, 3.0] ms (2.0 as
    # modelled), each decode 2.2 ms (1.1)
    c = costs(factors={"decode": 2.0, "prefill": 1.5})
    rec, = Simulator(colocated(policy="prefill_first", budget=4096, fast_forward=fast_forward), c).run(
        [Arrival("a", 0.0, 100, 4)])
    assert ms(rec.token_times()) == pytest.approx([3.0, 5.2, 7.4, 9.6])


@pytest.mark.parametrize("fast_forward", [True, False])
def test_a_step_runs_slower_for_the_time_another_worker_of_its_host_has_work(fast_forward):
    # A (100 tokens, 6 out) alone on worker 0 from 0; B (100, 2) reaches worker 1 at 3.5 ms, which then
    # has work until B's last token: while it does, worker 0's work goes 2x slower, and B's too
    c = costs(factors={"shared_host": 2.0})
    sim = Simulator(colocated(policy="prefill_first", budget=4096, workers=2, fast_forward=fast_forward), c)
    a, b = sim.run([Arrival("a", 0.0, 100, 6), Arrival("b", 3.5 * MS, 100, 2)])
    assert (a.decode_worker, b.decode_worker) == ("colocated:0", "colocated:1")
    # A: prefill [0, 2.0] and [2.0, 3.1] alone; [3.1, 4.9]: 0.4 ms alone, its other 0.7 ms of work at
    # half speed; [4.9, 7.1] and [7.1, 9.3] beside B; [9.3, 10.6]: 0.4 ms beside B (0.2 ms of work), the
    # other 0.9 ms alone once B is done at 9.7
    assert ms(a.token_times()) == pytest.approx([2.0, 3.1, 4.9, 7.1, 9.3, 10.6])
    # B: prefill [3.5, 7.5] and decode [7.5, 9.7], both beside A
    assert ms(b.token_times()) == pytest.approx([7.5, 9.7])


def test_without_a_shared_host_factor_workers_of_one_host_do_not_slow_each_other():
    sim = Simulator(colocated(policy="prefill_first", budget=4096, workers=2), costs())
    a, b = sim.run([Arrival("a", 0.0, 100, 6), Arrival("b", 3.5 * MS, 100, 2)])
    assert ms(a.token_times()) == pytest.approx([2.0, 3.1, 4.2, 5.3, 6.4, 7.5])
    assert ms(b.token_times()) == pytest.approx([5.5, 6.6])
    assert not sim.hosts.on


def test_a_model_refuses_a_factor_it_does_not_know_or_one_that_is_not_positive():
    with pytest.raises(ValueError, match=r"factors.after_idle: unknown serving factor"):
        LinearStepModel([1e-3] * 7, factors={"after_idle": 1.2})
    with pytest.raises(ValueError, match=r"factors.decode=0.0 must be a positive number"):
        LinearStepModel([1e-3] * 7, factors={"decode": 0.0})


def test_the_profiles_in_the_repository_are_a_few_kb_and_hold_only_the_named_serving_parts():
    assert PROFILES
    for path in PROFILES:
        assert path.stat().st_size < 16_000, path
        prof = json.loads(path.read_text())
        assert set(prof.get("serving") or {}) <= {"factors", "gap_s", "return_s", "dispatch_s", "handoff",
                                                   "other_cores", "num", "source"}, path
        assert set(prof["step_model"]["factors"]) <= {"decode", "prefill", "shared_host", "spread"}
        c = from_profile(path)
        assert c.step.time((1, 100, 0, 0, 0, 0, 1, 0)) > 0


def test_validate_can_leave_one_part_of_the_calibration_out(tmp_path):
    prof = json.loads(PROFILES[0].read_text())
    prof["serving"] = {"factors": {"decode": 1.5, "prefill": 1.2}, "gap_s": 1e-4, "return_s": 1e-3,
                       "dispatch_s": 2e-3, "handoff": {}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    f = (1, 100, 0, 0, 0, 0, 1, 0)
    full, less = from_profile(path), from_profile(path, without=("decode", "return_s"))
    assert full.step.time(f) == pytest.approx(1.5 * less.step.time(f))
    assert (full.return_s, less.return_s, less.dispatch_s) == (1e-3, 0.0, 2e-3)
    assert "without decode, return_s" in less.source
    with pytest.raises(ValueError, match=r"without='drift': choose from"):
        from_profile(path, without=("drift",))


def test_a_worker_is_busy_through_the_gap_after_a_step_that_left_it_work():
    steps = [{"start_s": 0.0, "end_s": 1.0, "num_running": 1, "num_waiting": 0},
             {"start_s": 1.2, "end_s": 2.0, "num_running": 0, "num_waiting": 0},
             {"start_s": 5.0, "end_s": 6.0, "num_running": 0, "num_waiting": 0}]
    ivs = busy_intervals(steps)
    assert ivs == [(0.0, 2.0), (5.0, 6.0)]
    assert covered(ivs, 1.5, 5.5) == pytest.approx(1.0)


def test_step_factors_read_alone_and_shared_steps_apart_and_need_enough_of_them():
    seen = {"decode": [(1.2, 0.0)] * 30 + [(1.8, 1.0)] * 30 + [(9.0, 0.5)] * 5,
            "prefill": [(1.1, 0.05)] * 5}
    factors, num = step_factors(seen)
    assert factors == {"decode": pytest.approx(1.2), "shared_host": pytest.approx(1.5)}   # prefill: 5 steps
    assert num == {"decode_alone": 30, "prefill_alone": 5, "shared": 30}


def test_the_spread_is_read_off_the_steps_log_ratios_over_their_factors():
    """Steps that vary around their factors' prediction by a lognormal of sigma 0.25, alone and shared
    alike, give a spread of 0.25; steps that do not vary give none."""
    from statistics import NormalDist

    z = [NormalDist().inv_cdf((i + 0.5) / 400) for i in range(400)]
    seen = {"decode": [(1.2 * math.exp(0.25 * x), 0.0) for x in z] + [(1.2 * 1.5 * math.exp(0.25 * x), 1.0) for x in z],
            "prefill": [(0.9 * math.exp(0.25 * x), 0.05) for x in z]}
    factors, _ = step_factors(seen)
    assert factors["spread"] == pytest.approx(0.25, rel=0.02)
    assert factors["decode"] == pytest.approx(1.2, rel=0.01) and factors["shared_host"] == pytest.approx(1.5, rel=0.01)
    assert "spread" not in step_factors({"decode": [(1.2, 0.0)] * 30})[0]


def test_calibration_recovers_the_serving_costs_a_simulated_run_was_given(tmp_path):
    """A run simulated with known costs (decode steps 1.3x, prompt steps 1.2x, 1.25x more while the
    other worker of the host has work, each step varying by a lognormal of sigma 0.2, 130 us host gap,
    1 ms messages) written as a real run's files;
    calibrating the profile's isolated model on them gives those costs back. At 4 requests/s prompts
    seldom finish in one step or behind another's export, which the handoff fit would read as link."""
    prof = json.loads(PROFILES[0].read_text())
    given = {"decode": 1.3, "prefill": 1.2, "shared_host": 1.25, "spread": 0.2}
    prof["serving"] = {"factors": given, "return_s": 1e-3, "dispatch_s": 1e-3, "gap_s": 130e-6, "handoff": {}}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "experiments.run", "backend=sim", f"hardware.profile={path}",
                           "workload.num_requests=60", "workload.rate=4", "report=false", f"hydra.run.dir={run}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cal = calibrate([run], model_from_dict(prof["step_model"] | {"factors": {}}))
    spread = cal["factors"].pop("spread")
    assert cal["factors"] == pytest.approx({k: v for k, v in given.items() if k != "spread"}, rel=0.05)
    assert spread == pytest.approx(given["spread"], rel=0.1)       # (the steps' contexts are estimated)
    assert cal["gap_s"] == pytest.approx(130e-6, rel=0.1)
    assert cal["return_s"] == pytest.approx(1e-3, rel=0.05) and cal["dispatch_s"] == pytest.approx(1e-3, rel=0.1)
    assert min(cal["num"].values()) >= 20
    # its handoffs: the profile's export, then its zmq link (the bench's, as this profile has no serving handoff)
    (e0, e1), t = prof["handoff"]["export"], prof["transfer"]["zmq"]
    handoff = cal["handoff"]["zmq"]
    assert handoff["latency_s"] == pytest.approx(e0 + t["latency_s"], rel=0.05)
    assert 1 / handoff["bandwidth"] == pytest.approx(e1 + 1 / t["bandwidth"], rel=0.05)
