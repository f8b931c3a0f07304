"""How close the simulator comes to a real run: `python -m experiments.validate RUN_DIR [--profile FILE]`.

Every repeat of every point under RUN_DIR (docs/run-directory.md) is replayed through the simulator: the same
config (the repeat's config.yaml), the same requests (each one's arrival_s, prompt_len and max_tokens
from requests.jsonl), with the costs of the machine that ran it (its profile: this machine's for the
run's model and worker threads, or --profile). Real and simulated metrics are computed by the same
experiments/serving/metrics.summarize; a point's value is the median over its repeats. Printed per
point and metric (TTFT, TPOT, ITL, E2EL: mean, p50, p90, p99; goodput): real, simulated, error =
(simulated - real) / real; then the conditions (the real run's machine load, the profile's fit error,
and the CPU other processes used during the calibration and during the run). On a shared machine
the calibration holds for the load it was made at: `--calibration DIR` recalibrates the profile's
serving part from another real run (one made beside the run validated, never the run itself). Where
the run's workers timed the speed probe (workers/probe.py) and the calibration's did too, its
steps are priced at the run's probe / the calibration's (--no-speed: at the calibration's).
`--against OTHER_RUN` puts a second real run of the same requests in the simulator's place: how far
this machine is from itself, the floor of any simulator's error here. Beside each real value go the
lowest and highest of its repeats (the run's own spread, in the same run: on a machine whose speed
moves that much from one repeat to the next, no error smaller than it can be told), and whether the
simulated value lies within them (for three repeats of one steady machine, the range holds the
median's true value three times in four). The last line is JSON: {"errors": {"ttft_mean": ..., ...},
"max_abs_error": ..., "real_spread": {"ttft_mean": (highest - lowest) / value, ...}}, with keys
"<metric>" for a run of one point and "<point>/<metric>" for several.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from omegaconf import OmegaConf

from experiments.analysis.calibrate import run_speed
from experiments.config import parse
from experiments.report.points import find_points
from experiments.serving.aggregate import read_jsonl
from experiments.serving.metrics import summarize
from experiments.sim.backend import outputs, profile_for, simulate
from experiments.sim.costs import from_profile
from experiments.sim.simulator import Arrival
from experiments.sim.stepmodel import LinearStepModel
from workers.config import gemm_route

SEEDS = 25
METRICS = [(f"{m}_{s}", m, s) for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "p50", "p90", "p99")]
TARGETS = {"mean": 0.05, "p50": 0.05, "p90": 0.10, "p99": 0.10, "goodput": 0.05}


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


def replay(rep_dir: Path, profile: Path | None = None, calibrated: bool = True,
           seeds: int = SEEDS, serving: dict | None = None, speed: dict | None = None) -> tuple[dict, dict, dict]:
    """(real metrics, simulated metrics, the simulation's costs detail) of one repeat; the simulated
    value of each metric is its median over `seeds` simulations with different noise draws (one run's
    draws move a tail as much as the machine does). `speed` is the run's speed probe (run_speed): where
    the calibration has one too, steps are priced at that speed / the calibration's."""
    spec = _spec(rep_dir)
    rows = read_jsonl(rep_dir / "requests.jsonl")
    arrivals = sorted((Arrival(r["id"], r["arrival_s"], r["prompt_len"], r["max_tokens"]) for r in rows),
                      key=lambda a: a.arrival_s)
    path = profile or profile_for(spec)
    costs = from_profile(path, spec.transfer.backend, calibrated, serving)
    calibration_speed = costs.detail.get("calibration_speed")
    if speed is not None and calibration_speed:     # the factors hold at the calibration's speed
        costs.speed = {k: speed[k] / calibration_speed[k] for k in calibration_speed}
    s, n = spec.slo, spec.cluster.num_workers
    real = real_values(rep_dir)
    runs = []
    for seed in range(seeds if costs.noise else 1):
        sim_rows, _ = outputs(simulate(spec, arrivals, costs, record_steps=False, noise_seed=spec.seed + seed))
        runs.append(metric_values(summarize(sim_rows, s.ttft_ms, s.tpot_ms, n, s.attainment_target)))
    simulated = {k: _median([r[k] for r in runs]) for k in TARGETS_KEYS}
    return real, simulated, {"source": costs.source, "seeds": len(runs), **costs.detail,
                             "run_other_cores": _machine(rep_dir).get("other_cores"),
                             "speed_used": costs.speed or None}


def real_values(rep_dir: Path) -> dict:
    """The metrics of one real repeat, as validate compares them."""
    spec = _spec(rep_dir)
    s, n = spec.slo, spec.cluster.num_workers
    return metric_values(summarize(read_jsonl(rep_dir / "requests.jsonl"), s.ttft_ms, s.tpot_ms, n, s.attainment_target))


def _requests(rep_dir: Path) -> list[tuple]:
    return sorted((r["id"], r["prompt_len"], r["max_tokens"]) for r in read_jsonl(rep_dir / "requests.jsonl"))


def against_real(p, other: Path) -> tuple[list[dict], dict]:
    """The values of point p's counterpart in another real run of the same requests (a repeat of the
    experiment), in the simulator's place: how close this machine comes to itself."""
    label = p.info.get("label")
    match = [q for q in find_points(other) if q.rel == p.rel and q.metrics is not None and q.info.get("label") == label]
    if not match:
        raise ValueError(f"--against {other}: no completed point {p.rel!r} ({label}) there")
    q = match[0]
    if len(q.repeats) != len(p.repeats) or any(_requests(a) != _requests(b) for a, b in zip(p.repeats, q.repeats)):
        raise ValueError(f"--against {other}: point {p.rel!r} did not serve the same requests (ids, prompt "
                         f"and output lengths) in the same number of repeats")
    return [real_values(d) for d in q.repeats], {"source": f"the real run {other}", "seeds": 0}


def raw_model(profile: Path):
    """The profile's fitted step model alone (no serving calibration): what probe_speed compares with."""
    step = json.loads(Path(profile).read_text())["step_model"]
    return LinearStepModel(step["coef"], terms=step.get("terms"))


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


def validate(run_dir: Path, profile: Path | None = None, calibrated: bool = True,
             calibration: Path | None = None, use_speed: bool = True, against: Path | None = None) -> dict:
    points = [p for p in find_points(run_dir) if p.metrics is not None]
    if not points:
        raise ValueError(f"no completed point under {run_dir}")
    serving = None
    if calibration is not None:
        if Path(calibration).resolve() == Path(run_dir).resolve():
            raise ValueError("--calibration must be another run than the one validated")
        serving = recalibrate(calibration, profile, points[0])
    groups: dict[Path, list] = {}
    for p in points:
        groups.setdefault(Path(profile or profile_for(_spec(p.repeats[0]))), []).append(p)
    speed_of, routes = {}, {}           # the run's speed, over the repeats of the points of one profile
    for path, ps in groups.items():
        routes.update({p.rel: linear_routes(p.repeats, path) for p in ps})
        speed = run_speed([d for p in ps for d in p.repeats], raw_model(path)) if use_speed and against is None else None
        speed_of.update({p.rel: speed for p in ps})
    results = []
    for p in points:
        if against is not None:
            values, detail = against_real(p, against)
            reps = [(real_values(d), v, detail | {"speed_used": None}) for d, v in zip(p.repeats, values)]
        else:
            reps = [replay(d, profile, calibrated, SEEDS, serving, speed_of[p.rel]) for d in p.repeats]
        real = {k: _median([r[k] for r, _, _ in reps]) for k in TARGETS_KEYS}
        spread = {k: _range([r[k] for r, _, _ in reps]) for k in TARGETS_KEYS}
        sim = {k: _median([s[k] for _, s, _ in reps]) for k in TARGETS_KEYS}
        err = {k: (sim[k] - real[k]) / real[k] if real[k] and sim[k] is not None else None for k in TARGETS_KEYS}
        load = [((m.get("machine") or {}).get("load_1m_end")) for m in [p.metrics]]
        results.append({"point": p.info.get("layout") or p.info.get("label") or p.rel, "label": p.info.get("label"),
                        "repeats": len(reps), "real": real, "sim": sim, "error": err, "real_range": spread,
                        "machine": p.metrics.get("machine") or {}, "costs": reps[0][2], "load": load[0],
                        "speed": reps[0][2]["speed_used"], "run_speed": speed_of[p.rel],
                        "linears": routes[p.rel]})
    return {"points": results}


TARGETS_KEYS = [name for name, _, _ in METRICS] + ["goodput"]


def recalibrate(run_dir: Path, profile: Path | None, point) -> dict:
    """The serving calibration of the profile, redone from the real run at run_dir."""
    from experiments.analysis.calibrate import calibrate
    from experiments.sim.backend import profile_for

    if profile is None:
        cfg = OmegaConf.load(point.repeats[0] / "config.yaml")
        cfg.pop("hydra", None)
        profile = profile_for(parse(cfg))
    prof = json.loads(Path(profile).read_text())
    step = prof["step_model"]
    cal = calibrate([Path(run_dir)], LinearStepModel(step["coef"], prof["gap"]["gap_coef"], terms=step.get("terms")))
    return cal | {"source": f"recalibrated from {run_dir}"}


def _range(xs) -> list | None:
    """[lowest, highest] of a metric over a point's real repeats (None where a repeat lacks it)."""
    if any(x is None for x in xs) or not xs:
        return None
    return [min(xs), max(xs)]


def within_range(p: dict, k: str) -> bool | None:
    """Whether point p's simulated value of k lies within its real repeats' range: the run's own
    spread, repeat to repeat (None with one repeat, where there is no spread to tell)."""
    r, s = p["real_range"].get(k), p["sim"].get(k)
    if r is None or s is None or p["repeats"] < 2:
        return None
    return r[0] <= s <= r[1]


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def target(key: str) -> float:
    return TARGETS["goodput" if key == "goodput" else key.rsplit("_", 1)[1]]


def summary(result: dict) -> dict:
    many = len(result["points"]) > 1
    errors, spread, inside = {}, {}, {}
    for p in result["points"]:
        for k, e in p["error"].items():
            key = f"{p['point']}/{k}" if many else k
            errors[key] = e
            r, real = p["real_range"].get(k), p["real"].get(k)
            spread[key] = (r[1] - r[0]) / real if r and real and p["repeats"] > 1 else None
            inside[key] = within_range(p, k)
    defined = [abs(e) for e in errors.values() if e is not None]
    met = {k: abs(e) <= target(k.rsplit("/", 1)[-1]) for k, e in errors.items() if e is not None}
    judged = [v for v in inside.values() if v is not None]
    return {"errors": errors, "max_abs_error": max(defined) if defined else None, "real_spread": spread,
            "_met": (sum(met.values()), len(met)), "_inside": (sum(judged), len(judged))}


def print_table(result: dict) -> None:
    for p in result["points"]:
        m = p["machine"]
        load = m.get("load_1m_end_max", m.get("load_1m_end"))
        print(f"== {p['label']} ({p['repeats']} repeat(s); real run's 1-min load up to "
              f"{'n/a' if load is None else f'{load:.1f}'} on {m.get('cores', '?')} cores) ==")
        c, sp, run = p["costs"], p["speed"], p["run_speed"]
        cal = c.get("calibration_speed")
        if sp:
            print(f"steps priced at this run's speed probe: decode {sp['decode']:.2f}x, prefill {sp['prefill']:.2f}x "
                  f"the calibration's (probe / profile: run {run['decode']:.2f}x, {run['prefill']:.2f}x; "
                  f"calibration {cal['decode']:.2f}x, {cal['prefill']:.2f}x)")
        elif c.get("seeds"):
            why = ("no speed probe in the calibration" if cal is None else "no speed probe in this run"
                   if run is None else "--no-speed")
            print(f"steps priced at the calibration's speed ({why})")
        other = "other run" if against_mode(result) else "simulated"
        print(f"{'metric':<12} {'real':>10} {'real repeats':>17} {other:>10} {'error':>8}  target")
        for k in TARGETS_KEYS:
            r, s, e, rng = p["real"][k], p["sim"][k], p["error"][k], p["real_range"][k]
            unit = "req/s" if k == "goodput" else "ms"
            text = "n/a" if e is None else f"{e:+.1%}"
            ok = "" if e is None else ("met" if abs(e) <= target(k) else "MISSED")
            span = "n/a" if rng is None else f"{_fmt(rng[0])}-{_fmt(rng[1])}"
            inside = within_range(p, k)
            where = "" if inside is None else ("; within the repeats" if inside else "; outside the repeats")
            print(f"{k:<12} {_fmt(r):>10} {span:>17} {_fmt(s):>10} {text:>8}  +-{target(k):.0%} {ok}{where}  {unit}")
    c = result["points"][0]["costs"]
    if against_mode(result):
        print(f"compared with {c['source']}, not simulated")
        return
    for p in result["points"]:
        lin = p["linears"]
        known = [r for r in lin["run"] if r != "unrecorded"]
        if lin["profile"] != "unrecorded" and known and known != [lin["profile"]]:
            print(f"{p['label']}: the run's CPU linears took {' and '.join(known)}, the profile's steps "
                  f"{lin['profile']}: it prices another engine (python -m experiments.profile on this one)")
    fe = c.get("fit_error") or {}
    print(f"costs: {c.get('source')}; step fit error median {fe.get('median_abs', float('nan')):.1%}, p90 "
          f"{fe.get('p90_abs', float('nan')):.1%}; {c.get('seeds')} noise seed(s) per repeat")
    runs = [p["costs"].get("run_other_cores") for p in result["points"]]
    runs = [x for x in runs if x is not None]
    cal = c.get("calibration_other_cores")
    print(f"other processes' CPU: {'n/a' if cal is None else f'{cal:.2f}'} cores during the calibration, "
          f"{', '.join(f'{x:.2f}' for x in runs) or 'n/a'} during the run (first repeat of each point)")


def against_mode(result: dict) -> bool:
    """Whether another real run stands in the simulator's place (--against)."""
    return result["points"][0]["costs"].get("seeds") == 0


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.validate", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="a real run: one point, a directory of points, or a sweep")
    ap.add_argument("--profile", type=Path, help="the profile to simulate with (default: this machine's)")
    ap.add_argument("--uncalibrated", action="store_true", help="leave out the profile's serving calibration")
    ap.add_argument("--calibration", type=Path, help="recalibrate serving costs from this other real run")
    ap.add_argument("--against", type=Path, metavar="OTHER_RUN",
                    help="compare with another real run of the same requests instead of the simulator: "
                         "how far the machine is from itself, the floor of any simulator's error here")
    ap.add_argument("--no-speed", action="store_true",
                    help="price steps at the calibration's speed, not at the run's speed probe")
    args = ap.parse_args(argv)
    try:
        result = validate(args.run_dir, args.profile, not args.uncalibrated, args.calibration, not args.no_speed,
                          args.against)
    except (ValueError, OSError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print_table(result)
    line = summary(result)
    met, total = line.pop("_met")
    inside, judged = line.pop("_inside")
    print(f"targets: |error| <= {TARGETS['mean']:.0%} on means and p50, {TARGETS['p90']:.0%} on p90 and p99, "
          f"{TARGETS['goodput']:.0%} on goodput: {met} of {total} met")
    if judged:
        spreads = [v for v in line["real_spread"].values() if v is not None]
        who = "other run's" if against_mode(result) else "simulated"
        print(f"the real run's own spread (highest - lowest repeat, over the value): median "
              f"{statistics.median(spreads):.1%}, largest {max(spreads):.1%}; the {who} value lies within the real "
              f"repeats' range on {inside} of {judged}")
    print(json.dumps(line))
    return 0
