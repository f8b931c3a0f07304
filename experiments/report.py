"""Rebuild a run's report from its files alone: `python -m experiments.report DIR [--out DIR]`.

DIR is one point, a directory of points, or a Hydra multirun (points nested at any depth). A point is a
directory holding `metrics.json`, or `error.json` when it crashed (experiments/FORMATS.md). Writes
report.md, PNG figures (experiments/plots.py) and CSV tables into DIR (or --out), prints what it wrote
and ends with one JSON line: {"out", "files", "num_points", "num_failed"}. `build_report(DIR)` does the
same from Python (experiments.run calls it at the end of a run).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from experiments import plots
from experiments.plots import num

MAX_TIMELINES = 8
# Table columns: (header, row key, digits, scale); digits None prints the value as it is.
SUMMARY = (("point", "label", None), ("completed/submitted", "completed", None),
           ("duration s", "duration_s", 1), ("req/s", "request_throughput", 2),
           ("output tok/s", "output_throughput", 1), ("goodput req/s", "goodput", 2),
           ("goodput/GPU", "goodput_per_gpu", 2), ("SLO attainment %", "slo_attainment", 1, 100),
           ("TTFT p50 ms", "ttft_ms.p50", 1), ("TTFT p99 ms", "ttft_ms.p99", 1), ("TPOT p50 ms", "tpot_ms.p50", 1),
           ("TPOT p99 ms", "tpot_ms.p99", 1), ("ITL p50 ms", "itl_ms.p50", 1), ("ITL p99 ms", "itl_ms.p99", 1),
           ("E2EL p50 ms", "e2el_ms.p50", 1))
POOL = (("group", "group", None), ("point", "label", None), ("goodput/GPU", "goodput_per_gpu", 2),
        ("TTFT p90 ms", "ttft_p90_ms", 1), ("TPOT p90 ms", "tpot_p90_ms", 1),
        ("SLO attainment %", "slo_attainment", 1, 100))
BREAKDOWN = (("point", "label", None), ("requests", "num_requests", None), ("queue ms", "queue_ms", 1),
             ("prefill ms", "prefill_ms", 1), ("transfer ms", "transfer_ms", 1),
             ("first decode ms", "first_decode_ms", 1), ("total ms", "total_ms", 1))
STEPS = (("point", "label", None), ("worker", "worker", None), ("decode-only p50 ms", "decode_p50_ms", 1),
         ("mixed p50 ms", "mixed_p50_ms", 1), ("mixed p99 ms", "mixed_p99_ms", 1), ("ratio", "ratio", 2),
         ("prefill tok/mixed step p50", "mixed_prefill_tokens_p50", 0), ("decode-only steps", "num_decode_steps", None),
         ("mixed steps", "num_mixed_steps", None), ("prefill-only steps", "num_prefill_steps", None))
SHAPE_KEYS = ("layout", "mode", "policy", "prefill_workers", "decode_workers")  # what a pool-ratio comparison varies


def fmt(x, digits: int = 1, scale: float = 1) -> str:
    x = num(x)
    return "n/a" if x is None else f"{x * scale:.{digits}f}"


def short(x) -> str:
    return f"{x:g}" if num(x) is not None else str(x)


def read_jsonl(path: Path) -> list[dict]:
    """The file's JSON objects; [] when missing or empty. Unparsable lines (a cut-off last line) are skipped."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


@dataclass
class Point:
    path: Path
    rel: str                  # below DIR ("." when DIR is the point)
    metrics: dict | None      # metrics.json; None when the point failed
    error: list[str]          # error.json's error (or why metrics.json was unreadable), non-empty lines
    info: dict                # metrics.json["point"] (or error.json["point"])
    label: str = ""           # unique among the report's points
    config: str = ""          # the label without the rate: one line per configuration in the rate plots

    @cached_property
    def requests(self) -> list[dict]:
        return read_jsonl(self.path / "requests.jsonl")

    @cached_property
    def steps(self) -> list[dict]:
        return read_jsonl(self.path / "steps.jsonl")

    def m(self, key: str) -> float | None:
        """A number from metrics.json by dotted key ("ttft_ms.p50"); None when absent, null or NaN."""
        value = self.metrics
        for k in key.split("."):
            value = value.get(k) if isinstance(value, dict) else None
        return num(value)

    @property
    def rate(self) -> float | None:
        return num(self.info.get("rate"))


def load_point(path: Path, root: Path) -> Point:
    name = "metrics.json" if (path / "metrics.json").is_file() else "error.json"
    try:
        src = json.loads((path / name).read_text())
        problem = None if isinstance(src, dict) else f"{name} is not a JSON object"
    except (OSError, ValueError) as e:
        src, problem = {}, f"unreadable {name}: {e}"
    src = src if isinstance(src, dict) else {}
    metrics = src if name == "metrics.json" and problem is None else None
    text = "" if metrics is not None else re.sub(r"\x1b\[[0-9;]*m", "", problem or str(src.get("error") or "?"))
    info = src.get("point") if isinstance(src.get("point"), dict) else {}
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return Point(path, path.relative_to(root).as_posix(), metrics, lines, info)


def natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def find_points(root: Path) -> list[Point]:
    """Every directory below root with metrics.json or error.json, in natural order (2 before 10)."""
    points = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted((d for d in dirnames if not d.startswith(".")), key=natural)
        if "metrics.json" in filenames or "error.json" in filenames:
            points.append(load_point(Path(dirpath), root))
            dirnames[:] = []  # a point's sub-directories are its own
    return points


def swept(info: dict) -> dict[str, str]:
    """What a sweep may vary: the rate, then each override but the rate's. Overrides come as Hydra's
    override_dirname ("a=1,b=[2,3]"), a list of "k=v" strings, or a mapping."""
    ov = info.get("overrides")
    if isinstance(ov, str):
        ov = re.split(r",(?![^\[]*\])", ov)  # commas outside [...]
    if isinstance(ov, list):
        ov = dict(str(s).lstrip("+~").split("=", 1) for s in ov if "=" in str(s))
    vals = {"rate": short(info.get("rate"))}
    vals.update({k: str(v) for k, v in (ov if isinstance(ov, dict) else {}).items() if k.split(".")[-1] != "rate"})
    return vals


def label_points(points: list[Point]) -> None:
    """label = point.label plus the swept values that differ among points sharing it; config leaves out the rate."""
    groups: dict[str, list[Point]] = {}
    for p in points:
        groups.setdefault(str(p.info.get("label") or p.rel), []).append(p)
    for base, group in groups.items():
        vals = [swept(p.info) for p in group]
        keys = [k for k in dict.fromkeys(k for v in vals for k in v) if len({v.get(k) for v in vals}) > 1]
        for p, v in zip(group, vals):
            p.label = ", ".join([base] + [f"{k}={v[k]}" for k in keys])
            p.config = ", ".join([base] + [f"{k}={v[k]}" for k in keys if k != "rate"])
    counts = Counter(p.label for p in points)
    for p in points:
        if counts[p.label] > 1:  # nothing swept tells them apart: say where they live
            p.label += f" [{p.rel}]"


def table(columns: tuple, rows: list[dict]) -> str:
    """A Markdown table of dict rows; columns as in SUMMARY."""
    def cell(row, key, digits=None, scale=1):
        text = str(row.get(key)) if digits is None else fmt(row.get(key), digits, scale)
        return text.replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(c[0] for c in columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(r, *c[1:]) for c in columns) + " |" for r in rows]) + "\n"


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}_"))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, list) else v
    return out


@dataclass
class Report:
    """What is being written: the markdown, the files so far, and notes on what had to be skipped."""
    out: Path
    md: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def csv(self, name: str, rows: list[dict]) -> None:
        with (self.out / name).open("w", newline="") as f:
            writer = csv.DictWriter(f, list(dict.fromkeys(k for r in rows for k in r)))
            writer.writeheader()
            writer.writerows(rows)
        self.files.append(self.out / name)

    def figure(self, draw, name: str, *args, caption: str) -> None:
        self.files.append(draw(self.out / name, *args))
        self.md.append(f"![{caption}]({name})\n")


def header(r: Report, directory: Path, points: list[Point], ok: list[Point]) -> None:
    r.md += ["# pdlab report\n", f"{len(points)} point(s) under `{directory}`, {len(points) - len(ok)} failed.\n"]
    for key in ("model", "device"):
        seen = sorted({str(p.info[key]) for p in points if p.info.get(key) is not None})
        r.md.append(f"**{key.capitalize()}:** {', '.join(seen) or 'n/a'}  ")
    r.md.append("\n**Points:**\n")
    keys = SHAPE_KEYS + ("workers", "num_gpus", "rate", "transfer")
    r.md += [f"- **{p.label}** (`{p.rel}`): " + ", ".join(f"{k} {short(p.info[k])}" for k in keys if p.info.get(k)
             is not None) + (" — **failed**" if p.metrics is None else "") for p in points]
    slos = {(p.m("slo.ttft_ms"), p.m("slo.tpot_ms"), p.m("slo.attainment_target")) for p in ok}
    slo = "each point's own SLO, in metrics.json and summary.csv"
    if len(slos) == 1:
        ttft, tpot, target = slos.pop()
        slo = f"TTFT ≤ {fmt(ttft)} ms and TPOT ≤ {fmt(tpot)} ms, attainment target {fmt(target, 1, 100)} %"
    r.md.append(
        "\n## How to read this\n\n**TTFT** (time to first token) runs from a request's arrival to its first token "
        "as the router saw it: queueing plus prefill. **TPOT** (time per output token) is a request's mean gap "
        "between later tokens, (E2E − TTFT) / (tokens − 1); **ITL** (inter-token latency) is each gap on its own, "
        "so its p99 shows the stalls a streaming reader notices. **Goodput** is completed requests per second that "
        f"met the SLO ({slo}); SLO attainment is the share of requests that met it, and goodput per GPU divides by "
        "the GPUs a configuration holds, so colocated and disaggregated layouts compare at equal cost. "
        "**Interference** (decode steps slowed because prefill tokens share them) shows in the step timelines, "
        "where red mixed steps sit above blue decode-only ones, and in the Interference table's mixed / "
        "decode-only ratio; in the latency figures it appears as the TPOT and ITL tails.\n")


def summary(r: Report, points: list[Point], ok: list[Point]) -> None:
    r.md += ["## Summary\n", "All metrics of every point are in `summary.csv`.\n", table(SUMMARY, [
        {"label": p.label, "completed": f"{short(p.m('num_completed'))}/{short(p.m('num_submitted'))}"}
        | {key: p.m(key) for _, key, *_ in SUMMARY[2:]} for p in ok])]
    failed = [{"label": p.label, "dir": p.rel, "error": p.error[0], "last": p.error[-1] if len(p.error) > 1 else ""}
              for p in points if p.metrics is None]
    if failed:
        r.md += ["### Failed points\n", "The first line of each error, and its last line (often the root cause).\n",
                 table((("point", "label"), ("directory", "dir"), ("error", "error"), ("last line", "last")), failed)]
    r.csv("summary.csv", [{"label": p.label, "status": "failed" if p.metrics is None else "ok", "dir": p.rel,
                           "error": "\n".join(p.error)}
                          | flatten(p.metrics if p.metrics is not None else {"point": p.info}) for p in points])


def latency_cdfs(r: Report, ok: list[Point]) -> None:
    r.md.append("## Latency distributions\n")
    for what, key in (("TTFT", "ttft"), ("TPOT", "tpot")):
        series = {p.label: [1000 * v for q in p.requests if q.get("status") == "ok"
                            and (v := num(q.get(f"{key}_s"))) is not None] for p in ok}
        r.notes += [f"{p.label}: no completed requests with {what} in requests.jsonl; not in the {what} CDF"
                    for p in ok if not series[p.label]]
        slos = [v for p in ok if series[p.label] and (v := p.m(f"slo.{key}_ms")) is not None]
        if any(series.values()):
            r.figure(plots.cdf, f"{key}_cdf.png", what, {k: v for k, v in series.items() if v}, slos,
                     caption=f"{what} CDF")
        else:
            r.md.append(f"No completed request with a {what} in any requests.jsonl.\n")


def meets_target(p: Point) -> bool:
    attainment, target = p.m("slo_attainment"), p.m("slo.attainment_target")
    return attainment is not None and target is not None and attainment >= target


def rate_sweep(r: Report, ok: list[Point]) -> None:
    configs: dict[str, list[Point]] = {}
    for p in sorted((p for p in ok if p.rate is not None), key=lambda p: p.rate):
        configs.setdefault(p.config, []).append(p)
    if len({p.rate for ps in configs.values() for p in ps}) < 2:
        return

    def lines(key: str, scale: float = 1) -> dict:
        return {c: ([p.rate for p in ps], [None if p.m(key) is None else scale * p.m(key) for p in ps])
                for c, ps in configs.items()}
    targets = [100 * t for p in ok if (t := p.m("slo.attainment_target")) is not None]
    r.md.append("## Goodput against rate\n")
    r.figure(plots.vs_rate, "goodput_vs_rate.png", "Goodput against offered rate", "goodput (req/s meeting the SLO)",
             lines("goodput"), caption="goodput vs rate")
    r.figure(plots.vs_rate, "attainment_vs_rate.png", "SLO attainment against offered rate", "SLO attainment (%)",
             lines("slo_attainment", 100), targets, caption="attainment vs rate")
    rows = []
    for c, ps in configs.items():
        best = max((p for p in ps if meets_target(p)), key=lambda p: p.rate, default=None)
        gpus = num(best.info.get("num_gpus")) if best else None
        rows.append({"config": c, "rates": ", ".join(short(p.rate) for p in ps),
                     "best": short(best.rate) if best else "none", "per_gpu": best.rate / gpus if gpus else None})
    r.md += ["Per configuration, the highest offered rate whose SLO attainment met its target "
             "(DistServe's per-configuration goodput):\n",
             table((("configuration", "config"), ("rates tested (req/s)", "rates"),
                    ("highest rate meeting target (req/s)", "best"),
                    ("per GPU (req/s/GPU)", "per_gpu", 2)), rows)]


def pool_ratio(r: Report, ok: list[Point]) -> None:
    groups: dict[tuple, list[Point]] = {}
    for p in ok:
        groups.setdefault((num(p.info.get("num_gpus")), p.rate), []).append(p)
    rows = [{"group": f"{short(n)} GPUs" + (f" @ {short(rate)} req/s" if rate is not None else ""), "label": p.label,
             "goodput_per_gpu": p.m("goodput_per_gpu"), "ttft_p90_ms": p.m("ttft_ms.p90"),
             "tpot_p90_ms": p.m("tpot_ms.p90"), "slo_attainment": p.m("slo_attainment")}
            for (n, rate), g in groups.items() if n is not None
            and len({tuple(str(p.info.get(k)) for k in SHAPE_KEYS) for p in g}) >= 2 for p in g]
    if rows:
        r.md += ["## Pool ratio at equal GPU count\n", "Points with the same number of GPUs and rate but a "
                 "different layout, mode, policy or prefill/decode split.\n"]
        r.figure(plots.pool_ratio, "pool_ratio.png", rows, caption="pool ratio")
        r.csv("pool_ratio.csv", rows)
        r.md.append(table(POOL, rows))


def breakdown(r: Report, ok: list[Point]) -> None:
    parts = {p.label: plots.first_decode_breakdown(p.requests) for p in ok}
    r.notes += [f"{k}: no completed request with 2+ tokens in requests.jsonl; not in the breakdown"
                for k, v in parts.items() if v is None]
    rows = [{"label": k} | v for k, v in parts.items() if v]
    if rows:
        r.md.append("## Time to the first decode step\n")
        r.figure(plots.ttft_breakdown, "ttft_breakdown.png", rows, caption="TTFT breakdown")
        r.csv("breakdown.csv", rows)
        r.md += ["Mean over completed requests with at least 2 tokens. queue = `queue_s`, prefill = `prefill_s`, "
                 "KV transfer = `transfer_s` (0 when null), first decode = `itl_s[0]` (the gap between the first and "
                 "second token as the client saw it) minus `transfer_s` for requests whose KV moved "
                 "(`transfer_bytes` > 0; floored at 0), else `itl_s[0]`. TTFT itself excludes the transfer in "
                 "disaggregated mode because the prefill worker streams the first token as soon as it is sampled; "
                 "the KV transfer delays the second token instead.\n", table(BREAKDOWN, rows)]


def interference(r: Report, ok: list[Point]) -> None:
    with_steps = sorted((p for p in ok if p.steps), key=lambda p: p.label)
    r.notes += [f"{p.label}: steps.jsonl missing or empty; no timeline or interference row" for p in ok if not p.steps]
    if not with_steps:
        return
    r.md.append("## Interference: engine step timelines\n")
    if len(with_steps) > MAX_TIMELINES:
        r.notes.append(f"timelines drawn for the first {MAX_TIMELINES} points by label, of {len(with_steps)}")
    used: set[str] = set()
    for p in with_steps[:MAX_TIMELINES]:
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", p.label).strip("_") or "point"
        name = name if name not in used else f"{name}_{len(used)}"
        used.add(name)
        r.figure(plots.timeline, f"timeline_{name}.png", p.label, p.steps, caption=f"steps of {p.label}")
    rows = [{"label": p.label} | s for p in with_steps for s in plots.step_stats(p.steps)]
    r.csv("steps_summary.csv", rows)
    r.md += ["Decode-only steps have no prefill tokens; mixed steps carry prefill tokens and decode sequences; "
             "prefill-only steps have no decode sequence. ratio = mixed p50 / decode-only p50.\n", table(STEPS, rows)]


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
    for section in (latency_cdfs, rate_sweep, pool_ratio, breakdown, interference):
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
