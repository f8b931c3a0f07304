"""How close the simulator comes to a real run: `python -m experiments.validate RUN_DIR [--against OTHER_RUN]`.

Every repeat of every point under RUN_DIR (docs/run-directory.md) is replayed through the simulator: the same
config (the repeat's config.yaml), the same requests (each one's arrival_s, prompt_len and max_tokens
from requests.jsonl), with the costs of the machine that ran it (its profile: this machine's for the
run's model and worker threads, or --profile). Real and simulated metrics are computed by the same
experiments/serving/metrics.summarize; a point's value is the median over its repeats. Printed per
point and value (TTFT, TPOT, ITL, E2EL: mean, p50, p90, p99; goodput): the real value and the lowest
and highest of its repeats (the run's own spread), the simulated value, its error (simulated - real)
/ real, whether that meets the target (TARGETS: 5% on means, p50 and goodput, 10% on p90 and p99),
and whether the simulated value lies within the real repeats' range. `--against OTHER_RUN` adds the
same for a second real run of the same requests, beside the simulator: how far this machine is from
itself, the floor of any simulator's error here (docs/simulator.md states the target as the simulator
meeting at least as many values as that second run). `--without NAME` leaves a part of the profile's
calibration out (a step factor: decode, prefill, shared_host, spread; or gap_s, dispatch_s, return_s,
handoff): how a factor is shown to earn its place. `--calibration DIR` recalibrates the profile's
serving part from another real run (one made beside the run validated, never the run itself).

Below the table, `machine speed` sets the run's decode and prefill steps against what the simulation
priced them at (`machine_speed`): a machine that runs slower or faster than when its calibration ran
moves every simulated time with it.

The last line is JSON: {"met": n, "total": n, "inside": n, "judged": n, "errors": {...},
"max_abs_error": x, "real_spread": {...}, "speed_ratio": {"decode": x, "prefill": x}} (judged: values
with a spread to lie within, i.e. points of two repeats or more), and with --against {"against": {the
same counts and errors}}; keys "<metric>" for a run of one point, "<point>/<metric>" for several.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from omegaconf import OmegaConf

from experiments.config import parse
from experiments.report.points import find_points
from experiments.serving.aggregate import read_jsonl
from experiments.serving.metrics import summarize
from experiments.serving.profiles import profile_for
from experiments.sim.backend import outputs, simulate
from experiments.sim.costs import from_profile
from experiments.sim.emulated import sim_costs
from experiments.sim.simulator import Arrival
from experiments.sim.stepmodel import LinearStepModel, describe_factors
from workers.config import gemm_route

METRICS = [(f"{m}_{s}", m, s) for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "p50", "p90", "p99")]
TARGETS = {"mean": 0.05, "p50": 0.05, "p90": 0.10, "p99": 0.10, "goodput": 0.05}
# An emulated run (engine.timing=emulated): the simulator and the cluster price every step alike, so what
# is left to differ is the system (docs/emulation.md), and the targets are tight.
EMULATED_TARGETS = {"mean": 0.02, "p50": 0.02, "p90": 0.05, "p99": 0.05, "goodput": 0.02}
STEAL_CORES = 0.1        # an emulated run the hypervisor took more CPU from than this is said to be disturbed
TARGETS_KEYS = [name for name, _, _ in METRICS] + ["goodput"]


def metric_values(m: dict) -> dict:
    out = {name: (m.get(f"{section}_ms") or {}).get(stat) for name, section, stat in METRICS}
    out["goodput"] = m.get("goodput")
    return out


def _metrics(rep_dir: Path) -> dict:
    try:
        return json.loads((rep_dir / "metrics.json").read_text())
    except (OSError, ValueError):
        return {}


def _spec(rep_dir: Path):
    """The RunSpec a repeat was served with (its config.yaml)."""
    cfg = OmegaConf.load(rep_dir / "config.yaml")
    cfg.pop("hydra", None)
    return parse(cfg)


def _machine(rep_dir: Path) -> dict:
    return _metrics(rep_dir).get("machine") or {}


def replay(rep_dir: Path, costs) -> dict:
    """The simulated values of one repeat: its requests through the simulator at `costs`, and its injected
    kill when the run recorded it (metrics.json's fault_times: a fact of the run, like its arrivals)."""
    spec = _spec(rep_dir)
    kill = (_metrics(rep_dir).get("fault_times") or {}).get("kill_s")
    if kill is not None and spec.fault.kill_worker:
        spec = dataclasses.replace(spec, fault=dataclasses.replace(spec.fault, kill_after_s=max(0.0, kill)))
    rows = read_jsonl(rep_dir / "requests.jsonl")
    arrivals = sorted((Arrival(r["id"], r["arrival_s"], r["prompt_len"], r["max_tokens"]) for r in rows),
                      key=lambda a: a.arrival_s)
    s, n = spec.slo, spec.cluster.num_workers
    sim_rows, _ = outputs(simulate(spec, arrivals, costs, record_steps=False))
    return metric_values(summarize(sim_rows, s.ttft_ms, s.tpot_ms, n, s.attainment_target))


def real_values(rep_dir: Path) -> dict:
    """The metrics of one real repeat, as validate compares them."""
    spec = _spec(rep_dir)
    s, n = spec.slo, spec.cluster.num_workers
    return metric_values(summarize(read_jsonl(rep_dir / "requests.jsonl"), s.ttft_ms, s.tpot_ms, n, s.attainment_target))


def _requests(rep_dir: Path) -> list[tuple]:
    return sorted((r["id"], r["prompt_len"], r["max_tokens"]) for r in read_jsonl(rep_dir / "requests.jsonl"))


def against_real(p, other: Path) -> list[dict]:
    """The values of point p's counterpart in another real run of the same requests (a repeat of the
    experiment), repeat by repeat: how close this machine comes to itself."""
    label = p.info.get("label")
    match = [q for q in find_points(other) if q.rel == p.rel and q.metrics is not None and q.info.get("label") == label]
    if not match:
        raise ValueError(f"--against {other}: no completed point {p.rel!r} ({label}) there")
    q = match[0]
    if len(q.repeats) != len(p.repeats) or any(_requests(a) != _requests(b) for a, b in zip(p.repeats, q.repeats)):
        raise ValueError(f"--against {other}: point {p.rel!r} did not serve the same requests (ids, prompt "
                         f"and output lengths) in the same number of repeats")
    return [real_values(d) for d in q.repeats]


def _route(rows) -> str:
    return "unrecorded" if rows == "unrecorded" else gemm_route(rows)


def linear_routes(rep_dirs: list[Path], profile: Path) -> dict:
    """The CPU linears' route (engine.cpu_gemm_rows as its workers chose it) of a run's workers and of
    the profile's steps: a profile timed on the other route prices another engine."""
    run = set()
    for d in rep_dirs:
        for w in (_metrics(d).get("isolation") or {}).get("per_worker") or [{}]:
            run.add(_route(w.get("cpu_gemm_rows", "unrecorded")))
    profiled = json.loads(Path(profile).read_text()).get("cpu_gemm_rows", "unrecorded")
    return {"run": sorted(run), "profile": _route(profiled)}


def judge(real: dict, real_range: dict, repeats: int, values: dict, targets: dict | None = None) -> dict:
    """Per value of TARGETS_KEYS: {"value", "error", "met", "inside"} of `values` (simulated, or another
    run's) against a point's real median and range; error and met None where either side lacks the
    value, inside None also with one real repeat (no spread to lie within)."""
    out = {}
    for k in TARGETS_KEYS:
        r, v, rng = real.get(k), values.get(k), real_range.get(k)
        err = (v - r) / r if r and v is not None else None
        inside = None if rng is None or v is None or repeats < 2 else rng[0] <= v <= rng[1]
        out[k] = {"value": v, "error": err, "met": None if err is None else abs(err) <= target(k, targets),
                  "inside": inside}
    return out


def point_result(name: str, label, real_reps: list[dict], sim_reps: list[dict], other_reps: list[dict] | None,
                 targets: dict | None = None) -> dict:
    """One point: the real median and range over its repeats, the simulated (and other run's) median
    over the same repeats, each judged against `targets` (default TARGETS). With the other run, a
    simulated value is also judged against the larger of its target and the other run's |error|
    (`within_rerun`): where a second run of the same requests differs by more than the target, the
    simulator is held to that difference instead."""
    targets = targets or TARGETS
    real = {k: _median([r[k] for r in real_reps]) for k in TARGETS_KEYS}
    spread = {k: _range([r[k] for r in real_reps]) for k in TARGETS_KEYS}
    out = {"point": name, "label": label, "repeats": len(real_reps), "real": real, "real_range": spread,
           "targets": targets}
    for key, reps in (("sim", sim_reps), ("other", other_reps)):
        if reps is not None:
            out[key] = judge(real, spread, len(real_reps), {k: _median([r[k] for r in reps]) for k in TARGETS_KEYS},
                             targets)
    if other_reps is not None:
        for k, j in out["sim"].items():
            o = out["other"][k]["error"]
            floor = max(target(k, targets), abs(o)) if o is not None else target(k, targets)
            j["within_rerun"] = None if j["error"] is None else abs(j["error"]) <= floor
    return out


def validate(run_dir: Path, profile: Path | None = None, calibrated: bool = True,
             calibration: Path | None = None, against: Path | None = None, without: tuple = ()) -> dict:
    points = [p for p in find_points(run_dir) if p.metrics is not None]
    if not points:
        raise ValueError(f"no completed point under {run_dir}")
    serving = None
    if calibration is not None and Path(calibration).resolve() == Path(run_dir).resolve():
        raise ValueError("--calibration must be another run than the one validated")
    if calibration is not None and not any(_spec(p.repeats[0]).engine.timing == "emulated" for p in points):
        serving = recalibrate(calibration, profile, points[0])
    if against is not None and Path(against).resolve() == Path(run_dir).resolve():
        raise ValueError("--against must be another run than the one validated")
    results, costs_of, system = [], {}, None
    for p in points:
        spec = _spec(p.repeats[0])
        other = against_real(p, against) if against is not None else None
        name = p.info.get("layout") or p.info.get("label") or p.rel
        if spec.engine.timing == "emulated":
            system = system or emulation_system(calibration, run_dir)
            costs = sim_costs(spec, system)
            r = point_result(name, p.info.get("label"), [real_values(d) for d in p.repeats],
                             [replay(d, costs) for d in p.repeats], other, EMULATED_TARGETS)
            steal = [_machine(d).get("steal_cores") for d in p.repeats]
            r |= {"machine": p.metrics.get("machine") or {}, "emulated": emulator_error(p.repeats),
                  "steal_cores": max((x for x in steal if x is not None), default=None),
                  "costs": {"source": costs.source, "system": system}}
            results.append(r)
            continue
        path = Path(profile or profile_for(spec))
        key = (path, spec.transfer.backend)
        if key not in costs_of:
            costs_of[key] = from_profile(path, spec.transfer.backend, calibrated, serving, tuple(without))
        costs = costs_of[key]
        r = point_result(name, p.info.get("label"),
                         [real_values(d) for d in p.repeats], [replay(d, costs) for d in p.repeats], other)
        r |= {"machine": p.metrics.get("machine") or {}, "linears": linear_routes(p.repeats, path),
              "costs": {"source": costs.source, **costs.detail,
                        "run_other_cores": _machine(p.repeats[0]).get("other_cores")}}
        results.append(r)
    if all("emulated" in r for r in results):
        return {"points": results, "against": str(against) if against is not None else None, "speed": None}
    path = Path(next(r for r in results if "emulated" not in r)["costs"]["path"])   # the profile of the first real point
    prof = json.loads(path.read_text())
    by = (f"the calibration from {calibration}" if calibration is not None else
          f"the profile's calibration ({prof.get('refitted') or prof.get('created')})" if calibrated else
          "the profile's isolated steps (uncalibrated)") + (f", without {', '.join(without)}" if without else "")
    speed = machine_speed(run_dir, path, results[0]["costs"].get("factors") or {}, by)
    return {"points": results, "against": str(against) if against is not None else None, "speed": speed}


def machine_speed(run_dir: Path, profile: Path, factors: dict, priced_by: str) -> dict | None:
    """How fast the run's steps went against what the simulation priced them at, per kind (decode,
    prefill): the run's own factor (its steps of that kind with no other worker of their host busy,
    measured over the profile's isolated prediction, as calibrate reads it) over the factor in use
    (`factors`, from `priced_by`; a kind it lacks at 1). A ratio away from 1 says the machine ran at
    another speed than the calibration's, and the simulated times are off with it (queueing ones by
    more). A
    diagnostic only: nothing of it reaches the simulation."""
    try:
        now = recalibrate(run_dir, profile, None)["factors"]
    except ValueError:                          # too little of the run to read a factor from
        return None
    kinds = [k for k in ("decode", "prefill") if now.get(k)]
    if not kinds:
        return None
    return {"ratio": {k: now[k] / factors.get(k, 1.0) for k in kinds}, "run": {k: now[k] for k in kinds},
            "priced": {k: factors.get(k, 1.0) for k in kinds}, "by": priced_by}


def recalibrate(run_dir: Path, profile: Path | None, point) -> dict:
    """The serving calibration of the profile (this machine's for `point` when None), redone from the
    real run at run_dir."""
    from experiments.analysis.calibrate import calibrate

    if profile is None:
        profile = profile_for(_spec(point.repeats[0]))
    prof = json.loads(Path(profile).read_text())
    step = prof["step_model"]
    cal = calibrate([Path(run_dir)], LinearStepModel(step["coef"], prof["gap"]["gap_coef"], terms=step.get("terms")))
    return cal | {"source": f"recalibrated from {run_dir}"}


def emulation_system(calibration: Path | None, run_dir: Path) -> dict:
    """The system latencies that simulate an emulated run: recalibrated from another emulated run
    (`--calibration`), else this machine's calibration file (experiments/analysis/emulation_cal.py)."""
    from experiments.analysis.emulation_cal import calibrate_system, default_path, load

    if calibration is not None:
        return calibrate_system([Path(calibration)]) | {"source": f"calibrated from {calibration}"}
    path = default_path()
    if not path.is_file():
        raise ValueError(f"{run_dir} is emulated, and this machine has no calibration of its emulated cluster at "
                         f"{path}: give --calibration OTHER_EMULATED_RUN (the same command with another seed), or "
                         f"write one with python -m experiments.analysis.emulation_cal OTHER_RUN --write")
    return load(path) | {"source": str(path)}


def emulator_error(rep_dirs: list[Path]) -> dict:
    """The emulated steps' measured durations against their prices (metrics.json's emulated.steps), the
    worst repeat's of each statistic."""
    out: dict = {}
    for d in rep_dirs:
        st = (_metrics(d).get("emulated") or {}).get("steps") or {}
        for k, v in st.items():
            if isinstance(v, (int, float)) and k != "num":
                out[k] = max(out.get(k, v), v)
            elif k == "num":
                out[k] = out.get(k, 0) + v
    return out


def _range(xs) -> list | None:
    """[lowest, highest] of a metric over a point's real repeats (None where a repeat lacks it)."""
    if any(x is None for x in xs) or not xs:
        return None
    return [min(xs), max(xs)]


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def target(key: str, targets: dict | None = None) -> float:
    return (targets or TARGETS)["goodput" if key == "goodput" else key.rsplit("_", 1)[1]]


def counts(result: dict, side: str = "sim") -> dict:
    """{"met", "total", "inside", "judged", "errors"} of one side ("sim" or "other") over every point and
    value: met of total values with an error, inside of judged values with a real spread."""
    many = len(result["points"]) > 1
    errors, met, total, inside, judged, rerun = {}, 0, 0, 0, 0, 0
    for p in result["points"]:
        for k, j in p[side].items():
            errors[f"{p['point']}/{k}" if many else k] = j["error"]
            if j["met"] is not None:
                total += 1
                met += j["met"]
                rerun += bool(j.get("within_rerun"))
            if j["inside"] is not None:
                judged += 1
                inside += j["inside"]
    out = {"met": met, "total": total, "inside": inside, "judged": judged, "errors": errors}
    if side == "sim" and result.get("against"):
        out["met_within_rerun"] = rerun       # |error| within max(target, the second run's |error|)
    return out


def summary(result: dict) -> dict:
    """The JSON line: the simulator's counts and errors, the real spread, and the other run's counts."""
    many = len(result["points"]) > 1
    line = counts(result)
    defined = [abs(e) for e in line["errors"].values() if e is not None]
    spread = {}
    for p in result["points"]:
        for k in TARGETS_KEYS:
            r, real = p["real_range"].get(k), p["real"].get(k)
            spread[f"{p['point']}/{k}" if many else k] = (r[1] - r[0]) / real if r and real and p["repeats"] > 1 else None
    line |= {"max_abs_error": max(defined) if defined else None, "real_spread": spread}
    line["speed_ratio"] = (result.get("speed") or {}).get("ratio")          # {kind: x}, None: not read
    if any("emulated" in p for p in result["points"]):     # emulated points the hypervisor took CPU from
        line["disturbed"] = [p["point"] for p in result["points"] if (p.get("steal_cores") or 0) > STEAL_CORES]
    if result.get("against"):
        line["against"] = counts(result, "other") | {"run": result["against"]}
    return line


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _cell(j: dict) -> str:
    if j["error"] is None:
        return f"{_fmt(j['value']):>9} {'n/a':>7} {'':>6} {'':>7}"
    inside = "" if j["inside"] is None else ("inside" if j["inside"] else "outside")
    return f"{_fmt(j['value']):>9} {j['error']:>+7.1%} {'met' if j['met'] else 'MISSED':>6} {inside:>7}"


def print_table(result: dict) -> None:
    other = result.get("against")
    for p in result["points"]:
        m = p["machine"]
        load = m.get("load_1m_end_max", m.get("load_1m_end"))
        print(f"== {p['label']} ({p['repeats']} repeat(s); real run's 1-min load up to "
              f"{'n/a' if load is None else f'{load:.1f}'} on {m.get('cores', '?')} cores) ==")
        head = f"{'value':<12} {'real':>9} {'real repeats':>15}  {'simulated':>9} {'error':>7} {'target':>6} {'range':>7}"
        print(head + (f"  {'other run':>9} {'error':>7} {'target':>6} {'range':>7}" if other else ""))
        for k in TARGETS_KEYS:
            rng = p["real_range"][k]
            span = "n/a" if rng is None else f"{_fmt(rng[0])}-{_fmt(rng[1])}"
            row = f"{k:<12} {_fmt(p['real'][k]):>9} {span:>15}  {_cell(p['sim'][k])}"
            print(row + (f"  {_cell(p['other'][k])}" if other else ""))
    real = [p for p in result["points"] if "emulated" not in p]
    for p in real:
        lin = p["linears"]
        known = [r for r in lin["run"] if r != "unrecorded"]
        if lin["profile"] != "unrecorded" and known and known != [lin["profile"]]:
            print(f"{p['label']}: the run's CPU linears took {' and '.join(known)}, the profile's steps "
                  f"{lin['profile']}: it prices another engine (python -m experiments.profile on this one)")
    for p in result["points"]:
        if "emulated" not in p:
            continue
        e, sys_ = p["emulated"], p["costs"]["system"]
        err = (f"p50 {e['ms_p50']:.3f} ms ({e['rel_p50']:+.2%}), p90 {e['ms_p90']:.3f} ms ({e['rel_p90']:+.2%}), "
               f"p99 {e['ms_p99']:.3f} ms ({e['rel_p99']:+.2%})" if e.get("num") else "not recorded")
        print(f"{p['label']}: costs {p['costs']['source']}; the emulated steps took their price plus {err} over "
              f"{e.get('num', 0)} steps (worst repeat's)")
        steal = p.get("steal_cores")
        if steal is not None and steal > STEAL_CORES:
            print(f"  the hypervisor took {steal:.2f} cores from this point's run (machine.steal_cores, worst repeat): "
                  "its workers woke late for want of a CPU, which no model of the system holds; serve it again")
        print(f"  system ({sys_.get('source')}): dispatch {sys_['dispatch_s'] * 1e3:.3f} ms, gap "
              f"{sys_['gap_coef'][0] * 1e3:.3f} ms + {sys_['gap_coef'][1] * 1e6:.1f} us per sequence, handoff "
              f"{sys_['wire_s'] * 1e3:.3f} ms beside the link")
    if not real:
        return
    c = real[0]["costs"]
    fe = c.get("fit_error") or {}
    factors = describe_factors(c.get("factors") or {}) or "none"
    print(f"costs: {c.get('source')}; step fit error median {fe.get('median_abs', float('nan')):.1%}, p90 "
          f"{fe.get('p90_abs', float('nan')):.1%}; serving factors {factors}")
    runs = [x for x in (p["costs"].get("run_other_cores") for p in real) if x is not None]
    cal = c.get("calibration_other_cores")
    print(f"other processes' CPU: {'n/a' if cal is None else f'{cal:.2f}'} cores during the calibration, "
          f"{', '.join(f'{x:.2f}' for x in runs) or 'n/a'} during the run (first repeat of each point)")
    sp = result.get("speed")
    if sp:
        kinds = ", ".join(f"{k} steps {r:.2f}x as long (x{sp['run'][k]:.2f} the profile's isolated steps, "
                          f"priced at x{sp['priced'][k]:.2f})" for k, r in sp["ratio"].items())
        far = any(abs(r - 1) > TARGETS["p90"] for r in sp["ratio"].values())
        print(f"machine speed against {sp['by']}: {kinds}" + (
            "; the simulated times are off with it (queueing ones by more): validate --calibration with a run made "
            "beside this one, or profile again" if far else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.validate", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="a real or emulated run: one point, a directory of points, or a sweep")
    ap.add_argument("--profile", type=Path, help="the profile to simulate with (default: this machine's)")
    ap.add_argument("--uncalibrated", action="store_true", help="leave out the profile's serving calibration")
    ap.add_argument("--without", action="append", default=[], metavar="NAME",
                    help="leave out one part of the calibration (decode, prefill, shared_host, spread, gap_s, dispatch_s, "
                         "return_s, handoff); repeat for more")
    ap.add_argument("--calibration", type=Path, help="recalibrate serving costs from this other real run (emulated: "
                                                     "the system's latencies, from another emulated run)")
    ap.add_argument("--against", type=Path, metavar="OTHER_RUN",
                    help="also compare another real run of the same requests: how far the machine is from "
                         "itself, the floor of any simulator's error here")
    args = ap.parse_args(argv)
    try:
        result = validate(args.run_dir, args.profile, not args.uncalibrated, args.calibration, args.against,
                          tuple(args.without))
    except (ValueError, OSError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print_table(result)
    line = summary(result)
    for t in {json.dumps(p["targets"], sort_keys=True): p["targets"] for p in result["points"]}.values():
        print(f"targets: |error| <= {t['mean']:.0%} on means and p50, {t['p90']:.0%} on p90 and p99, "
              f"{t['goodput']:.0%} on goodput" + (" (emulated points)" if t == EMULATED_TARGETS else ""))
    sides = [("simulated", line)] + ([("other run", line["against"])] if "against" in line else [])
    for who, c in sides:
        within = f"; within the real repeats' range on {c['inside']} of {c['judged']}" if c["judged"] else ""
        rerun = (f"; {c['met_within_rerun']} within max(target, the other run's error)"
                 if "met_within_rerun" in c else "")
        print(f"{who}: {c['met']} of {c['total']} met{rerun}{within}")
    spreads = [v for v in line["real_spread"].values() if v is not None]
    if spreads:
        print(f"the real run's own spread (highest - lowest repeat, over the value): median "
              f"{statistics.median(spreads):.1%}, largest {max(spreads):.1%}")
    print(json.dumps(line))
    return 0
