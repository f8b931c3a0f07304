"""What serving adds to a step's time, in the simulator and in the calibration that measures it.

Hand-worked timelines use the step model of tests/test_sim.py: 1 ms per step, plus 0.01 ms per prompt
token, plus 0.1 ms per decode (100 prompt tokens: 2.0 ms; one decode: 1.1 ms); no host gap, dispatch
or return latency unless a case says so.
"""
import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from experiments.analysis.calibrate import calibrate
from experiments.analysis.step_states import drift_fit
from experiments.sim.noise import Noise
from experiments.sim.records import request_row
from experiments.sim.simulator import Arrival, SimConfig, Simulator
from experiments.sim.stepmodel import curve_at, model_from_dict
from tests.conftest import ROOT
from tests.test_sim import MS, colocated, costs, ms
from workers.config import EngineConfig


def with_model(c, **factors):
    return dataclasses.replace(c, step=dataclasses.replace(c.step, **factors))


@pytest.mark.parametrize("fast_forward", [True, False])
def test_the_decode_steps_after_a_prefill_step_take_its_after_prefill_factors(fast_forward):
    # prefill [0, 2.0]; the first decode after it 2 x 1.1 = 2.2 ms, the second 1.5 x 1.1, then 1.1
    c = with_model(costs(), after_prefill=[2.0, 1.5])
    sim = Simulator(colocated(policy="prefill_first", budget=4096, fast_forward=fast_forward), c)
    rec, = sim.run([Arrival("a", 0.0, 100, 5)])
    assert ms(rec.token_times()) == pytest.approx([2.0, 4.2, 5.85, 6.95, 8.05])


@pytest.mark.parametrize("prompt, first_ms", [(60, 1.65), (100, 3.3)])
def test_after_prefill_factors_follow_the_size_of_the_prefill_step(prompt, first_ms):
    # up to 64 prompt tokens the first decode after them takes 1.5x, beyond 3x (the pooled 2x unused)
    by_size = [{"max_tokens": 64, "factors": [1.5]}, {"max_tokens": None, "factors": [3.0]}]
    c = with_model(costs(), after_prefill=[2.0], after_prefill_by_size=by_size)
    sim = Simulator(colocated(policy="prefill_first", budget=4096), c)
    rec, = sim.run([Arrival("a", 0.0, prompt, 3)])
    t0 = 1.0 + 0.01 * prompt
    assert ms(rec.token_times()) == pytest.approx([t0, t0 + first_ms, t0 + first_ms + 1.1])


@pytest.mark.parametrize("fast_forward", [True, False])
def test_a_step_runs_slower_for_the_time_another_worker_of_its_host_has_work(fast_forward):
    # A (100 tokens, 6 out) alone on worker 0 from 0; B (100, 2) reaches worker 1 at 3.5 ms, which then
    # has work until B's last token at 7.7: while it does, worker 0's decode work goes 2x slower
    c = with_model(costs(), contention={"decode": 2.0, "prefill": 1.0})
    sim = Simulator(colocated(policy="prefill_first", budget=4096, workers=2, fast_forward=fast_forward), c)
    a, b = sim.run([Arrival("a", 0.0, 100, 6), Arrival("b", 3.5 * MS, 100, 2)])
    assert (a.decode_worker, b.decode_worker) == ("colocated:0", "colocated:1")
    # A: [2.0, 3.1] alone; [3.1, 4.9]: 0.4 ms alone, its other 0.7 ms of work at half speed; [4.9, 7.1]
    # beside B; [7.1, 8.5]: 0.6 ms beside B (0.3 ms of work), the other 0.8 ms alone; [8.5, 9.6] alone
    assert ms(a.token_times()) == pytest.approx([2.0, 3.1, 4.9, 7.1, 8.5, 9.6])
    # B: prefill [3.5, 5.5] (prefill steps not slowed here), its decode [5.5, 7.7] beside A
    assert ms(b.token_times()) == pytest.approx([5.5, 7.7])


@pytest.mark.parametrize("fast_forward", [True, False])
def test_contention_follows_what_the_other_worker_of_the_host_does(fast_forward):
    # As above, but a decode step goes 2x slower only beside the other worker's decode steps, not
    # beside its prefill: B's prompt [3.5, 5.5] leaves A's steps alone; B's decode [5.5, 7.7] does not
    c = with_model(costs(), contention={"decode": {"decode": 2.0, "prefill": 1.0}, "prefill": 1.0})
    sim = Simulator(colocated(policy="prefill_first", budget=4096, workers=2, fast_forward=fast_forward), c)
    a, b = sim.run([Arrival("a", 0.0, 100, 6), Arrival("b", 3.5 * MS, 100, 2)])
    # A: [3.1, 4.2] and [4.2, 5.3] beside B's prefill; [5.3, 7.3]: 0.2 ms, then its other 0.9 ms of work
    # at half speed; [7.3, 8.6]: 0.4 ms beside B's decode (0.2 ms of work), the other 0.9 ms alone
    assert ms(a.token_times()) == pytest.approx([2.0, 3.1, 4.2, 5.3, 7.3, 8.6])
    assert ms(b.token_times()) == pytest.approx([5.5, 7.7])


def test_a_worker_s_steps_take_the_factor_of_its_place_on_the_host():
    # the host's second worker (place 1) takes 2x on its decode steps: B, there because A keeps the
    # first busy, prefills [3.5, 5.5] as anywhere and decodes [5.5, 7.7]; A's steps are as modelled
    c = with_model(costs(), by_place={"decode": {"0": 1.0, "1": 2.0}})
    sim = Simulator(colocated(policy="prefill_first", budget=4096, workers=2), c)
    a, b = sim.run([Arrival("a", 0.0, 100, 6), Arrival("b", 3.5 * MS, 100, 2)])
    assert (a.decode_worker, b.decode_worker) == ("colocated:0", "colocated:1")
    assert ms(a.token_times()) == pytest.approx([2.0, 3.1, 4.2, 5.3, 6.4, 7.5])
    assert ms(b.token_times()) == pytest.approx([5.5, 7.7])


@pytest.mark.parametrize("fast_forward", [True, False])
def test_steps_take_the_machine_s_speed(fast_forward):
    # at a speed probe's 2x for decode steps and 1.5x for prompts: the 100-token prompt [0, 3.0] ms
    # (2.0 as modelled), each decode 2.2 ms (1.1)
    c = dataclasses.replace(costs(), speed={"decode": 2.0, "prefill": 1.5})
    rec, = Simulator(colocated(policy="prefill_first", budget=4096, fast_forward=fast_forward), c).run(
        [Arrival("a", 0.0, 100, 4)])
    assert ms(rec.token_times()) == pytest.approx([3.0, 5.2, 7.4, 9.6])


def test_a_prompt_s_step_takes_the_factor_of_its_size_and_a_decode_none():
    # prompts' steps 1.0x at 2 ms predicted, 0.5x at 8 ms: the 100-token prompt (2.0 ms) as modelled,
    # a 400-token one (5.0 ms, halfway in log time: 0.75x) 3.75 ms; the decodes 1.1 ms, untouched
    size = {"pred_s": [2 * MS, 8 * MS], "ratio": [1.0, 0.5]}
    for prompt, first_ms in ((100, 2.0), (400, 5.0 * (1.0 - 0.5 * math.log(5 / 2) / math.log(4)))):
        rec, = Simulator(colocated(policy="prefill_first", budget=4096),
                         with_model(costs(), prefill_size=size)).run([Arrival("a", 0.0, prompt, 3)])
        assert ms(rec.token_times()) == pytest.approx([first_ms, first_ms + 1.1, first_ms + 2.2], abs=1e-6)


def test_the_size_curve_of_prompts_is_read_from_what_the_state_factors_leave():
    """Prompt steps of 5-60 ms predicted, alone (no state), measured 1.0x up to 20 ms and falling to 0.9x
    at 60 ms, with 5% noise: the curve recovers the fall (it never rises with size) and leaves the
    residual flat."""
    from experiments.analysis.step_states import State, state_factors
    from experiments.sim.engine import NEVER

    rng = np.random.default_rng(4)
    plain = State(None, NEVER, 0.0, 0.0, False, "colocated", 0)
    true = {"pred_s": [20 * MS, 60 * MS], "ratio": [1.0, 0.9]}
    pred = np.exp(rng.uniform(math.log(5 * MS), math.log(60 * MS), 600))
    prefill = [(p, p * curve_at(true, p) * math.exp(0.05 * rng.standard_normal()), plain) for p in pred]
    decode = [(3 * MS, 3 * MS * math.exp(0.05 * rng.standard_normal()), plain) for _ in range(100)]
    from experiments.sim.stepmodel import LinearStepModel
    f = state_factors({"decode": decode, "prefill": prefill}, LinearStepModel([MS] * 7), per_bin=20)
    size = f["prefill_size"]
    assert all(a >= b for a, b in zip(size["ratio"], size["ratio"][1:])), "never rising"
    assert curve_at(size, 55 * MS) / curve_at(size, 8 * MS) == pytest.approx(curve_at(true, 55 * MS), abs=0.03)
    res, small = f["residual"]["prefill"], pred < 20 * MS
    assert np.median(np.array(res)[~small]) == pytest.approx(np.median(np.array(res)[small]), rel=0.02)


def test_place_factors_price_each_place_and_leave_the_residual_alike():
    from experiments.analysis.calibrate import place_factors

    rng = np.random.default_rng(1)
    noise = list(np.exp(0.1 * rng.standard_normal(400)))
    res = {"decode": noise[:200] + [1.2 * x for x in noise[200:]], "prefill": noise[:30]}
    places = {"decode": [0] * 200 + [1] * 200, "prefill": [0] * 30}
    by_place, adjusted = place_factors(res, places, per_bin=20)
    assert by_place["decode"]["1"] / by_place["decode"]["0"] == pytest.approx(1.2, rel=0.05)
    assert "prefill" not in by_place                       # one place only: nothing to tell apart
    a0, a1 = np.median(adjusted["decode"][:200]), np.median(adjusted["decode"][200:])
    assert a1 == pytest.approx(a0, rel=0.05) and adjusted["prefill"] == res["prefill"]


def test_a_step_after_idle_takes_the_factor_of_how_long_its_worker_idled():
    # after 0.1 s idle a decode step takes 2x, after 1 ms 1x (the curve is linear in log idle time)
    curve = {"idle_s": [1e-3, 0.1], "ratio": [1.0, 2.0]}
    assert curve_at(curve, 0.01) == pytest.approx(1.5) and curve_at(curve, 10.0) == 2.0
    c = with_model(costs(), after_idle={"decode": 1.0, "prefill": curve})
    sim = Simulator(colocated(policy="prefill_first", budget=4096), c)
    a, b = sim.run([Arrival("a", 0.0, 100, 1), Arrival("b", 102 * MS, 100, 1)])
    # A: idle since the start (0 s: the curve's low end, 1x); B after 100 ms idle: 2 x 2.0 ms
    assert ms(a.token_times()) == pytest.approx([2.0])
    assert ms(b.token_times()) == pytest.approx([106.0])


@pytest.mark.parametrize("b_arrives_ms, b_first_ms", [(1.0, 6.0), (0.0, 5.0)])
def test_a_step_after_one_that_left_the_scheduler_empty_starts_from_idle(b_arrives_ms, b_first_ms):
    """As calibrate reads real steps: a prompt that reached the worker during the step before, which
    left nothing running or waiting, starts from idle (here the curve's low end, 1.5x), however soon
    it follows; one that waited in the scheduler beside the step before does not."""
    curve = {"idle_s": [1e-3, 0.1], "ratio": [1.5, 2.0]}
    c = with_model(costs(), after_idle={"decode": 1.0, "prefill": curve})
    cfg = SimConfig(["prefill", "decode"], {"prefill": EngineConfig(policy="chunked", token_budget=100),
                                            "decode": EngineConfig(policy="chunked", token_budget=64)},
                    {"prefill": 100, "decode": 100}, kv_bytes_per_token=1000, num_layers=4, max_model_len=4096)
    a, b = Simulator(cfg, c).run([Arrival("a", 0.0, 100, 1), Arrival("b", b_arrives_ms * MS, 100, 1)])
    # A's prompt from idle since the start: [0, 1.5 x 2.0]; then B's: 2.0 ms, or 1.5 x 2.0 from idle
    assert ms(a.token_times()) == pytest.approx([3.0])
    assert ms(b.token_times()) == pytest.approx([b_first_ms])


@pytest.mark.parametrize("b_arrives_ms, b_prompt, a_transfer_ms", [(1.0, 100, 1.2), (2.3, 100, 0.9), (3.0, 100, 0.6),
                                                                  (1.0, 10, 1.15)])
def test_a_kv_send_goes_the_busy_factor_slower_while_its_sender_steps(b_arrives_ms, b_prompt, a_transfer_ms):
    # A's prompt [0, 2.0], then its KV (100 x 1000 bytes over 0.5 ms + 1 GB/s: 0.6 ms) from 2.0. B
    # reached the prefill worker at 1 ms: it prefills B from 2.0 and A's KV takes 2x, 1.2 ms; at 2.3
    # ms: its last 0.3 ms take 0.6, 0.9 ms in all; at 3 ms: A's KV was in at 2.6. A 10-token B ends at
    # 3.1, when A's KV has 0.05 ms to go at full speed: 1.15 ms. B's KV, with nothing behind it, at
    # full speed
    cfg = SimConfig(["prefill", "decode"], {"prefill": EngineConfig(policy="prefill_first", token_budget=4096),
                                            "decode": EngineConfig(policy="chunked", token_budget=64)},
                    {"prefill": 100, "decode": 100}, kv_bytes_per_token=1000, num_layers=4, max_model_len=4096)
    c = dataclasses.replace(costs(), handoff_busy=2.0)
    a, b = Simulator(cfg, c).run([Arrival("a", 0.0, 100, 2), Arrival("b", b_arrives_ms * MS, b_prompt, 2)])
    assert request_row(a)["transfer_s"] == pytest.approx(a_transfer_ms * MS)
    assert request_row(b)["transfer_s"] == pytest.approx((0.5 + 0.001 * b_prompt) * MS)
    # A's second token: the decode step (1.1 ms) after its KV is in
    assert ms(a.token_times()) == pytest.approx([2.0, 2.0 + a_transfer_ms + 1.1])


def test_drift_keeps_each_draw_s_distribution_and_correlates_draws_close_in_time():
    table = list(np.linspace(0.8, 1.6, 201) ** 2)
    n = 40_000
    plain = Noise({"decode": table}, seed=2).factors("decode", n)
    drifting = Noise({"decode": table}, seed=2, drift={"weight": 0.5, "tau_s": 0.01})
    starts = np.arange(n) * 1e-3
    x = np.concatenate([drifting.step_factors("decode", "w", starts[i:i + 500]) for i in range(0, n, 500)])
    assert abs(x.mean() / plain.mean() - 1) < 0.02 and abs(np.median(x) / np.median(plain) - 1) < 0.02

    def lag_corr(v, k):
        r = np.argsort(np.argsort(v))
        return np.corrcoef(r[:-k], r[k:])[0, 1]
    # z = sqrt(w) s + sqrt(1 - w) e: draws 1 ms apart share w exp(-0.1) of their variation
    assert lag_corr(x, 1) == pytest.approx(0.5 * math.exp(-0.1), abs=0.03)
    assert abs(lag_corr(x, 200)) < 0.03 and abs(lag_corr(plain, 1)) < 0.03
    # another worker's draws are its own
    y = drifting.step_factors("decode", "other", starts[:2000] + starts[-1])
    assert abs(np.corrcoef(x[-2000:], y)[0, 1]) < 0.06


def test_drift_fit_recovers_the_weight_and_time_constant_of_a_drifting_series():
    rng = np.random.default_rng(5)
    n, rho, w = 20_000, 0.85, 0.4
    s = np.empty(n)
    s[0] = rng.standard_normal()
    for i in range(1, n):
        s[i] = rho * s[i - 1] + math.sqrt(1 - rho * rho) * rng.standard_normal()
    z = math.sqrt(w) * s + math.sqrt(1 - w) * rng.standard_normal(n)
    fit = drift_fit(list(np.exp(0.1 * z)), [(0, "colocated:0", 0.004 * i) for i in range(n)])
    assert fit["rho"] == pytest.approx(rho, abs=0.05) and fit["weight"] == pytest.approx(w, abs=0.06)
    assert fit["tau_s"] == pytest.approx(-0.004 / math.log(rho), rel=0.25)


def test_calibration_recovers_the_serving_costs_a_simulated_run_was_given(tmp_path):
    """A run simulated with known costs (a step from idle 1.5x or 1.3x slower, the two decode steps after
    a prefill 1.4x and 1.2x, a decode step beside another busy worker's decode 1.3x, beside its prefill
    1.1x, a prefill beside either 1.15x, a prompt step right after another 0.8x, a 40 us gap after a step
    that makes no token, 130 us after others, no noise) written as a real run's files; calibrating the
    profile's isolated model on them gives those costs back."""
    prof = json.loads(next((ROOT / "profiles").glob("*/tiny-float32-1t.json")).read_text())
    given = {"after_idle": {"decode": 1.5, "prefill": 1.3}, "after_prefill": [1.4, 1.2],
             "contention": {"decode": {"decode": 1.3, "prefill": 1.1}, "prefill": 1.15}, "after_prompt": 0.8}
    prof["serving"] = {"return_s": 1e-3, "dispatch_s": 1e-3, "gap_s": 130e-6, "gap_quiet_s": 40e-6,
                       "slowdown": None, "noise": None, "handoff": {}} | given
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "experiments.run", "backend=sim", f"hardware.profile={path}",
                           "workload.num_requests=60", "report=false", f"hydra.run.dir={run}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cal = calibrate([run], model_from_dict(prof["step_model"] | {"gap_coef": prof["gap"]["gap_coef"]}))
    for kind, x in given["after_idle"].items():
        assert curve_at(cal["after_idle"][kind], 0.1) == pytest.approx(x, rel=0.05), kind
    assert cal["after_prefill"][:2] == pytest.approx([1.4, 1.2], rel=0.05)
    assert cal["after_prompt"] == pytest.approx(0.8, rel=0.05)
    assert cal["after_prefill"][2:] == pytest.approx([1.0] * len(cal["after_prefill"][2:]), rel=0.05)
    assert cal["contention"]["decode"] == pytest.approx({"decode": 1.3, "prefill": 1.1}, rel=0.05)
    assert cal["contention"]["prefill"]["decode"] == pytest.approx(1.15, rel=0.05)
    assert cal["gap_quiet_s"] == pytest.approx(40e-6, rel=0.05) and cal["gap_s"] == pytest.approx(130e-6, rel=0.1)
    assert cal["num"]["quiet_gaps"] > 50 and min(cal["num"]["after_idle_steps"].values()) >= 20
    assert min(cal["num"]["contended_steps"].values()) >= 20 and cal["num"]["after_prefill_steps"] >= 20
    # its handoffs: the profile's export, then its zmq link (the bench's, as this profile has no serving handoff)
    (e0, e1), t = prof["handoff"]["export"], prof["transfer"]["zmq"]
    handoff = cal["handoff"]["zmq"]
    assert handoff["latency_s"] == pytest.approx(e0 + t["latency_s"], rel=0.05)
    assert 1 / handoff["bandwidth"] == pytest.approx(e1 + 1 / t["bandwidth"], rel=0.05)


def test_calibration_reads_every_run_at_the_median_speed_of_its_probes(tmp_path):
    """Two runs of a calibration, one made while the machine ran 1.5x slower (every step: the profile's
    coefficients x 1.5), read as one: without speed probes their steps are two populations, 1.5x
    apart, left as noise. With speed probes in every repeat's metrics.json, each repeat's probe before
    its requests off its run's speed by -20%, 0 or +20% (one repeat's probe is a noisy thermometer),
    each run is read at the median of those, every step at the runs' median speed (1.25x), and the
    noise is gone; the probes after the requests (here 2x off) are not read."""
    from experiments.analysis.calibrate import probe_speed
    from experiments.sim.stepmodel import chunk_features

    prof = json.loads(next((ROOT / "profiles").glob("*/tiny-float32-1t.json")).read_text())
    prof["serving"] = {"return_s": 1e-3, "dispatch_s": 1e-3, "gap_s": 130e-6, "slowdown": None, "noise": None,
                       "handoff": {}}
    model = model_from_dict(prof["step_model"] | {"gap_coef": prof["gap"]["gap_coef"]})
    probe = {"decode_s": model.time(chunk_features(1, 256, [])),
             "prefill_s": model.time(chunk_features(0, 0, [(64, 0, True)])), "context": 256, "prompt_tokens": 64,
             "rounds": 8}
    runs = []
    for slower in (1.0, 1.5):
        path = tmp_path / f"profile-{slower}.json"
        step = prof["step_model"] | {"coef": [c * slower for c in prof["step_model"]["coef"]]}
        path.write_text(json.dumps(prof | {"step_model": step}))
        run = tmp_path / f"run-{slower}"
        proc = subprocess.run([sys.executable, "-m", "experiments.run", "backend=sim", f"hardware.profile={path}",
                               "workload.num_requests=30", "report=false", f"hydra.run.dir={run}"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs.append((run, {k: v * slower if k.endswith("_s") else v for k, v in probe.items()}))

    def spread(cal):
        q = cal["noise"]["decode"]
        return q[int(0.9 * len(q))] / q[int(0.1 * len(q))]

    assert spread(calibrate([r for r, _ in runs], model)) > 1.3
    for run, mine in runs:
        for i, m in enumerate(sorted(run.glob("**/rep*/metrics.json"))):
            before, after = [{k: v * off if k.endswith("_s") else v for k, v in mine.items()}
                             for off in ((1.0, 0.8, 1.2)[i % 3], 2.0)]
            m.write_text(json.dumps(json.loads(m.read_text()) | {"speed_probe": {"a worker": before},
                                                                 "speed_probe_end": {"a worker": after}}))
    assert probe_speed([runs[1][1]], model) == pytest.approx({"decode": 1.5, "prefill": 1.5})
    cal = calibrate([r for r, _ in runs], model)
    assert cal["speed"] == pytest.approx({"decode": 1.25, "prefill": 1.25})
    assert cal["slowdown"]["ratio"] == pytest.approx([1.25] * len(cal["slowdown"]["ratio"]), rel=0.02)
    assert spread(cal) < 1.05
    assert cal["num"]["probed_runs"] == 2
    # probe_check reads the same: each repeat's probe as injected, its quiet decode steps at 1.5x
    from experiments.analysis.probe_check import check
    (slow,) = check([runs[1][0]], model)
    assert sorted({round(x["probe"], 6) for x in slow["repeats"]}) == [1.2, 1.5, 1.8]
    assert all(x["serving"] == pytest.approx(1.5, rel=0.02) for x in slow["repeats"])


def test_the_handoff_fit_prices_the_time_its_sender_steps_beside_it():
    """Handoffs of 1 ms + bytes / 1 GB/s that go 1.6x slower while their sender steps, at full speed
    otherwise: a quarter beside a step from 0.1 ms on that outlasts them, a quarter beside one of
    0.4 W from 0.2 W on, half beside none. The fit recovers the link from the last and the 1.6x."""
    from experiments.analysis.calibrate import busy_finish, handoff_fits

    rng = np.random.default_rng(3)
    pairs = []
    for i in range(200):
        b = float(rng.integers(1, 16)) * 1e6
        w = 1e-3 + b / 1e9
        if i % 4 == 0:
            steps, s = [(0.1e-3, 1.0)], 0.1e-3 + (w - 0.1e-3) * 1.6
        elif i % 4 == 1:      # 0.2 W at full speed, 0.4 W of time for 0.25 W of work, 0.55 W at full speed
            steps, s = [(0.2 * w, 0.6 * w)], 0.2 * w + 0.4 * w + (w - 0.2 * w - 0.4 * w / 1.6)
        else:
            steps, s = [], w
        assert busy_finish(w, steps, 1.6) == pytest.approx(s)
        pairs.append((b, s, steps))
    fit = handoff_fits({"zmq": pairs}, per_bin=20)["zmq"]
    assert fit["latency_s"] == pytest.approx(1e-3, rel=0.01) and fit["bandwidth"] == pytest.approx(1e9, rel=0.01)
    assert fit["busy"] == pytest.approx(1.6, rel=0.01) and fit["num_busy"] == 100
    assert min(fit["noise"]) == pytest.approx(1.0) and max(fit["noise"]) == pytest.approx(1.0)


def test_the_profile_s_calibration_serves_its_layouts_round_robin_as_often_as_asked(tmp_path, monkeypatch):
    """calibration.repeats: the calibration run serves the three layouts that many times, num_requests
    each (one repeat of a calibration run read a moment of the machine that later runs were not at);
    a failed run names its last line."""
    from omegaconf import OmegaConf

    from experiments.analysis import profile

    seen = []

    class Done:
        returncode, stdout, stderr = 0, "", ""

    monkeypatch.setattr(profile.subprocess, "run", lambda cmd, **kw: seen.append(cmd) or Done())
    cfg = OmegaConf.create({"model": {"name": "tiny"},
                            "calibration": {"seed": 7, "num_requests": 80, "repeats": 3, "rate": 8.0}})
    assert profile.calibration_run(tmp_path / "cal", cfg) == tmp_path / "cal"
    (cmd,) = seen
    assert {"repeats=3", "workload.num_requests=80", "seed=7", "workload.rate=8.0",
            f"hydra.run.dir={tmp_path / 'cal'}"} <= set(cmd)
    Done.returncode, Done.stderr = 1, "boom\nValueError: the last line"
    with pytest.raises(RuntimeError, match="the last line"):
        profile.calibration_run(tmp_path / "cal2", cfg)
