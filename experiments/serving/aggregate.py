"""A point's metrics.json from its repeats' directories (`rep0/`, `rep1/`, ...), from the files alone.

Each repeat directory is a full run of the point (config.yaml, requests.jsonl, steps.jsonl, metrics.json,
or error.json when it crashed). The point's metrics.json holds the median of every number over the
repeats that completed, each headline metric's repeat values and 95% interval (experiments/serving/confidence.py),
the machine's load over all repeats, and which repeats failed. A point none of whose repeats completed
gets error.json instead. experiments.run writes these after the last round; experiments.report calls
`aggregate` itself for a point directory that has repeats but no metrics.json (a run cut short).
"""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from experiments.serving.confidence import across_repeats, replicates
from experiments.serving.machine import combine
from experiments.serving.tables import read_table
from workers.probe import usable

REPEAT = re.compile(r"^rep(\d+)$")


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


def read_requests(rep_dir: Path) -> list[dict]:
    """A repeat's request rows: requests.jsonl, or a large simulation's requests.npz (experiments/serving/tables.py)."""
    return _rows(rep_dir, "requests")


def read_steps(rep_dir: Path, max_rows: int | None = None) -> list[dict]:
    """A repeat's step rows: steps.jsonl, or a large simulation's steps.npz (its first `max_rows`
    steps in time when given: experiments/serving/tables.read_table)."""
    return _rows(rep_dir, "steps", max_rows)


def _rows(rep_dir: Path, name: str, max_rows: int | None = None) -> list[dict]:
    if (rep_dir / f"{name}.jsonl").is_file() or not (rep_dir / f"{name}.npz").is_file():
        return read_jsonl(rep_dir / f"{name}.jsonl")
    return read_table(rep_dir / f"{name}.npz", max_rows)


def repeat_dirs(point_dir: Path, limit: int | None = None) -> list[tuple[int, Path]]:
    """(index, directory) of the point's repeats, in order; only indices below `limit` when given."""
    found = []
    for d in point_dir.iterdir() if point_dir.is_dir() else []:
        m = REPEAT.match(d.name)
        if m and d.is_dir() and (limit is None or int(m.group(1)) < limit):
            found.append((int(m.group(1)), d))
    return sorted(found)


def _read(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def aggregate(point_dir: Path, limit: int | None = None) -> dict | None:
    """The point's metrics.json (or, when no repeat completed, its error.json) as a dict; None without repeats."""
    done, failed = [], []
    for index, d in repeat_dirs(point_dir, limit):
        metrics = _read(d / "metrics.json")
        if metrics is not None and "num_submitted" in metrics:
            done.append((index, d, metrics))
        elif (d / "error.json").is_file() or (d / "metrics.json").is_file():
            err = _read(d / "error.json") or {"error": f"unreadable {d.name}/metrics.json"}
            failed.append({"dir": d.name, "error": err.get("error"), "point": err.get("point")})
    if not done and not failed:
        return None
    summary = {"num_ok": len(done), "num_failed": len(failed), "dirs": [d.name for _, d, _ in done],
               "failed": [{"dir": f["dir"], "error": f["error"]} for f in failed]}
    if not done:
        first = failed[0]
        return {"error": first["error"], "traceback": "", "point": first["point"] or {}, "repeats": summary}
    reps = [_replicates(d, m, i) for i, d, m in done]
    out = across_repeats([m for _, _, m in done], reps)
    out.pop("repeat", None)
    out["point"] = done[0][2].get("point", {})
    out["machine"] = combine([m.get("machine") or {} for _, _, m in done])
    if probes := probe_range([m.get("speed_probe") for _, _, m in done]):
        out["speed_probe"] = probes
    out["repeats"] = summary
    return out


def _replicates(d: Path, metrics: dict, index: int) -> dict:
    """A repeat's within-run replicates; all NaN where it has none (metrics.json's ci_method says why:
    a large simulation without per-token times), without reading its records."""
    if str(metrics.get("ci_method", "")).startswith("none"):
        from experiments.serving.confidence import HEADLINE, NUM_BOOT
        import numpy as np
        return {k: np.full(NUM_BOOT, np.nan) for k in HEADLINE}
    return replicates(read_requests(d), read_steps(d), metrics, index)


def probe_range(per_repeat: list[dict | None]) -> dict | None:
    """{"decode_ms": [min, max], "prefill_ms": [min, max]} over repeats of the median over each repeat's
    workers of its speed probe steps (workers/probe.py): how fast the machine was across the point's
    repeats. None where no repeat probed."""
    meds: dict[str, list[float]] = {"decode": [], "prefill": []}
    for probes in per_repeat:
        ok = usable(probes)
        for kind in meds:
            if ok:
                meds[kind].append(1e3 * statistics.median(r[f"{kind}_s"] for r in ok))
    if not meds["decode"]:
        return None
    return {f"{kind}_ms": [min(v), max(v)] for kind, v in meds.items()}


def write(point_dir: Path, limit: int | None = None) -> dict | None:
    """aggregate() written as the point's metrics.json or error.json (the other removed)."""
    result = aggregate(point_dir, limit)
    if result is None:
        return None
    name, other = ("error.json", "metrics.json") if "error" in result else ("metrics.json", "error.json")
    (point_dir / other).unlink(missing_ok=True)
    (point_dir / name).write_text(json.dumps(result, indent=2))
    return result
