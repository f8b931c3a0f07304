"""Rebuild a run's report from its files alone: `python -m experiments.report DIR [--out DIR]`.

DIR is one point, a directory of points, or a Hydra multirun (points nested at any depth): see
experiments/report/points.py. Writes report.md, PNG figures (experiments/report/plots.py) and CSV tables into
DIR (or --out), prints what it wrote and ends with one JSON line: {"out", "files", "num_points",
"num_failed"}. `build_report(DIR)` does the same from Python (experiments.run calls it at the end).
Every comparison in report.md is worded by experiments/serving/compare.py from medians and 95% intervals.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments.report import sections
from experiments.serving import compare
from experiments.serving.aggregate import probe_range
from experiments.serving.machine import point_warnings
from experiments.report.page import Report, fmt, group_name, groups, table, with_ci  # noqa: F401 (fmt: tests)
from experiments.report.points import Point, find_points, label_points, natural, short, swept, what_varies  # noqa: F401

# Table columns: (header, row key, digits, scale); digits None prints the value as it is.
SUMMARY = (("point", "label", None), ("repeats", "repeats", None), ("completed/submitted", "completed", None),
           ("duration s", "duration_s", 1), ("req/s", "request_throughput", 2),
           ("output tok/s", "output_throughput", 1), ("goodput req/s", "goodput", 2),
           ("goodput/GPU", "goodput_per_gpu", 2), ("SLO attainment %", "slo_attainment", 1, 100),
           ("TTFT p50 ms", "ttft_ms.p50", 1), ("TTFT p99 ms", "ttft_ms.p99", 1), ("TPOT p50 ms", "tpot_ms.p50", 1),
           ("TPOT p99 ms", "tpot_ms.p99", 1), ("ITL p50 ms", "itl_ms.p50", 1), ("ITL p99 ms", "itl_ms.p99", 1),
           ("E2EL p50 ms", "e2el_ms.p50", 1))
INTERVALS = (("ITL p99 ms", "itl_ms.p99", 1, 1), ("TTFT p50 ms", "ttft_ms.p50", 1, 1),
             ("TTFT p99 ms", "ttft_ms.p99", 1, 1), ("TPOT p50 ms", "tpot_ms.p50", 1, 1),
             ("goodput/GPU req/s", "goodput_per_gpu", 2, 1), ("SLO attainment %", "slo_attainment", 1, 100),
             ("mixed/decode step", "step_ratio.ratio", 2, 1))
MACHINE = (("point", "label", None), ("cores", "cores", None), ("load 1-min max", "load", 1),
           ("other processes, cores", "other", 2), ("steal %", "steal", 1, 100), ("ours, cores", "ours", 2),
           ("speed probe: decode / prompt step, ms", "probe", None), ("warning", "warning", None))


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}_"))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, list) else v
    return out


def warnings(points: list[Point]) -> list[str]:
    return [f"{p.label}: {w}" for p in points for w in point_warnings(p.metrics or {})]


def header(r: Report, directory: Path, points: list[Point], ok: list[Point]) -> None:
    r.md += ["# pdlab report\n", f"{len(points)} point(s) under `{directory}`, {len(points) - len(ok)} failed.\n"]
    if lines := warnings(ok):
        r.md += ["**Warnings** (what the machine did while the points ran):\n"] + [f"- ⚠ {w}" for w in lines] + [""]
    for key in ("model", "device"):
        seen = sorted({str(p.info[key]) for p in points if p.info.get(key) is not None})
        r.md.append(f"**{key.capitalize()}:** {', '.join(seen) or 'n/a'}  ")
    r.md.append("\n**Points:**\n")
    keys = ("layout", "mode", "policy", "prefill_workers", "decode_workers", "workers", "num_gpus", "rate", "transfer")
    r.md += [f"- **{p.label}** (`{p.rel}`): " + ", ".join(f"{k} {short(p.info[k])}" for k in keys if p.info.get(k)
             is not None) + (" — **failed**" if p.metrics is None else "") for p in points]
    slos = {(p.m("slo.ttft_ms"), p.m("slo.tpot_ms"), p.m("slo.attainment_target")) for p in ok}
    slo = "each point's own SLO, in metrics.json and summary.csv"
    if len(slos) == 1:
        ttft, tpot, target = slos.pop()
        slo = f"TTFT ≤ {fmt(ttft)} ms and TPOT ≤ {fmt(tpot)} ms, attainment target {fmt(target, 1, 100)} %"
    reps = sorted({p.num_repeats for p in ok})
    alone = [p for p in ok if p.num_repeats > 1 and p.info.get("round_robin") == 1]
    order = ("interleaved round-robin with the other points of their run" if not alone else
             f"interleaved round-robin within a run; {len(alone)} point(s) were alone in their run (a sweep's jobs "
             "run one after another), so their repeats ran back to back")
    r.md.append(
        "\n## How to read this\n\n**TTFT** (time to first token) runs from a request's arrival to its first token "
        "as the router saw it: queueing plus prefill. **TPOT** (time per output token) is a request's mean gap "
        "between later tokens, (E2E − TTFT) / (tokens − 1); **ITL** (inter-token latency) is each gap on its own, "
        "so its p99 shows the stalls a streaming reader notices. **Goodput** is completed requests per second that "
        f"met the SLO ({slo}); SLO attainment is the share of requests that met it, and goodput per GPU divides by "
        "the GPUs a configuration holds, so colocated and disaggregated layouts compare at equal cost. "
        "**Interference** (decode steps slowed because prefill tokens share them) shows in the step timelines and "
        "in the mixed / decode-only step ratio; in the latency figures it appears as the TPOT and ITL tails.\n\n"
        f"**Repeats and intervals.** Each point was served {' or '.join(map(str, reps)) or 'n/a'} time(s), "
        f"{order}. Every number is the median over repeats, and [brackets] "
        "hold its 95% bootstrap interval (repeats and, within each, requests resampled; with one repeat, requests "
        "only). A difference is stated only where two intervals do not overlap and the medians differ by "
        f"{compare.MIN_DIFFERENCE:.0%} or more.\n")


def summary(r: Report, points: list[Point], ok: list[Point]) -> None:
    r.md += ["## Summary\n", "Medians over repeats. All metrics of every point are in `summary.csv`.\n", table(SUMMARY, [
        {"label": p.label, "repeats": p.num_repeats,
         "completed": f"{short(p.m('num_completed'))}/{short(p.m('num_submitted'))}"}
        | {key: p.m(key) for _, key, *_ in SUMMARY[3:]} for p in ok])]
    if ok:
        head = "| point | " + " | ".join(c[0] for c in INTERVALS) + " |"
        rows = [f"| {p.label} | " + " | ".join(with_ci(p, key, d, s) for _, key, d, s in INTERVALS) + " |" for p in ok]
        r.md += ["### Headline metrics with 95% intervals\n", head, "|" + "---|" * (len(INTERVALS) + 1), *rows, ""]
    failed = [{"label": p.label, "dir": p.rel, "error": p.error[0] if p.error else "?",
               "last": p.error[-1] if len(p.error) > 1 else ""} for p in points if p.metrics is None]
    if failed:
        r.md += ["### Failed points\n", "The first line of each error, and its last line (often the root cause).\n",
                 table((("point", "label"), ("directory", "dir"), ("error", "error"), ("last line", "last")), failed)]
    r.csv("summary.csv", [{"label": p.label, "status": "failed" if p.metrics is None else "ok", "dir": p.rel,
                           "error": "\n".join(p.error)}
                          | flatten(p.metrics if p.metrics is not None else {"point": p.info}) for p in points])


def comparisons(r: Report, ok: list[Point]) -> None:
    found = [(key, g) for key, g in groups(ok).items() if len(g) >= 2]
    if not found:
        return
    r.md.append("## Comparisons\n")
    r.md.append("Worded from the medians and 95% intervals: a difference is stated only where intervals separate "
                f"and the medians differ by {compare.MIN_DIFFERENCE:.0%} or more.\n")
    for key, g in found:
        r.md.append(f"**{what_varies([p.info for p in g]).capitalize()}** ({group_name(key)}):\n")
        r.md += [f"- {line}" for line in compare.headline_sentences([(p.label, p.metrics) for p in g])] + [""]


def machine(r: Report, ok: list[Point]) -> None:
    rows = []
    for p in ok:
        m = (p.metrics or {}).get("machine") or {}
        if not m:
            continue
        loads = [m.get(k) for k in ("load_1m_start_max", "load_1m_end_max", "load_1m_start", "load_1m_end")]
        rows.append({"label": p.label, "cores": m.get("cores"), "load": max([x for x in loads if x is not None],
                                                                            default=None),
                     "other": m.get("other_cores_max", m.get("other_cores")),
                     "steal": m.get("steal_share_max", m.get("steal_share")),
                     "ours": m.get("ours_cores_max", m.get("ours_cores")),
                     "probe": probe_text((p.metrics or {}).get("speed_probe")),
                     "warning": "; ".join(w.split(": ", 1)[1] for w in warnings([p])) or "none"})
    if rows:
        r.md += ["## The machine while each point ran\n", "The worst repeat of each point: the 1-minute load "
                 "average at start and end, CPU used by other processes and stolen by the hypervisor, and ours "
                 "(the driver, Ray and the workers); and the range over its repeats of the speed probe, the same "
                 "decode step and prompt chunk timed on each worker before the repeat (workers/probe.py): points "
                 "whose probes differ ran on a machine of different speed.\n", table(MACHINE, rows)]


def probe_text(probe: dict | None) -> str:
    """A point's speed probe range (aggregate.probe_range), or a one-repeat point's probes, as text."""
    if probe and "decode_ms" not in probe:        # a single repeat's {worker: probe}
        probe = probe_range([probe])
    if not probe:
        return "n/a"
    def span(lo_hi):
        lo, hi = lo_hi
        return f"{lo:.2f}" if round(lo, 2) == round(hi, 2) else f"{lo:.2f}-{hi:.2f}"
    return f"{span(probe['decode_ms'])} / {span(probe['prefill_ms'])}"


def build_report(directory: Path | str, out: Path | str | None = None) -> dict:
    """Write the report of every point below `directory` into `out` (default: `directory`).

    Returns {"out", "files", "num_points", "num_failed"}; writes nothing when there is no point.
    """
    directory = Path(directory)
    points = find_points(directory) if directory.is_dir() else []
    result = {"out": None, "files": [], "num_points": len(points), "num_failed": sum(p.metrics is None for p in points)}
    if not points:
        return result
    out = Path(out or directory)
    out.mkdir(parents=True, exist_ok=True)
    label_points(points)
    ok = [p for p in points if p.metrics is not None]
    r = Report(out)
    header(r, directory, points, ok)
    summary(r, points, ok)
    comparisons(r, ok)
    machine(r, ok)
    for section in (sections.latency_cdfs, sections.rate_sweep, sections.comparison_chart, sections.breakdown,
                    sections.interference):
        section(r, ok)
    if r.notes:
        r.md += ["## Notes\n"] + [f"- {n}" for n in r.notes]
    (out / "report.md").write_text("\n".join(r.md) + "\n")
    return result | {"out": str(out), "files": [str(f) for f in [out / "report.md"] + r.files]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="a point, a directory of points, or a Hydra multirun directory")
    ap.add_argument("--out", type=Path, help="where to write (default: DIR)")
    args = ap.parse_args(argv)
    result = build_report(args.dir, args.out)
    if not result["num_points"]:
        print(f"error: no point (a directory with metrics.json or error.json) under {args.dir}", file=sys.stderr)
    else:
        print(f"{result['num_points']} point(s), {result['num_failed']} failed; wrote to {result['out']}:")
        print("\n".join(f"  {Path(f).name}" for f in result["files"]))
    print(json.dumps(result))
    return 0 if result["num_points"] else 1


if __name__ == "__main__":
    sys.exit(main())
