"""The points a report is built from, found and read from run directories alone (docs/run-directory.md).

A point is a directory with `metrics.json` or `error.json`, or with repeat directories `rep<i>/`; its
own sub-directories are its repeats. A point with repeats but no metrics.json (a run cut short) is
aggregated here from its repeats. Points written before repeats existed (requests.jsonl beside
metrics.json, no intervals) are read as one repeat without intervals.
"""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from experiments.serving.aggregate import aggregate, read_requests, read_steps, repeat_dirs
from experiments.serving.steps import num
from experiments.serving.tables import table_rows

STEPS_SHOWN = 100_000       # steps a report reads of a large simulation's steps.npz (experiments/serving/tables.py)


def short(x) -> str:
    return f"{x:g}" if num(x) is not None else str(x)


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
    def repeats(self) -> list[Path]:
        """The directories holding each completed repeat's records (the point itself for an old point)."""
        reps = [d for _, d in repeat_dirs(self.path) if (d / "metrics.json").is_file()]
        if self.metrics is not None and isinstance(self.metrics.get("repeats"), dict):
            used = set(self.metrics["repeats"].get("dirs") or [])
            reps = [d for d in reps if d.name in used] or reps
        return reps or [self.path]

    @cached_property
    def requests(self) -> list[dict]:
        """Every repeat's requests, pooled."""
        return [row for d in self.repeats for row in read_requests(d)]

    @cached_property
    def steps(self) -> list[dict]:
        """The first repeat's steps (a timeline is one run); of a large simulation's steps.npz, its
        first STEPS_SHOWN steps in time (`steps_note` says so)."""
        return read_steps(self.repeats[0], STEPS_SHOWN)

    @cached_property
    def all_steps(self) -> list[dict]:
        """Every repeat's steps, pooled (a worker's steps of every repeat together); of a large
        simulation's steps.npz, the first STEPS_SHOWN steps of each repeat."""
        if len(self.repeats) == 1:
            return self.steps
        return [s for d in self.repeats for s in read_steps(d, STEPS_SHOWN)]

    @cached_property
    def steps_note(self) -> str | None:
        """Why the report shows fewer steps than the run made, if it does."""
        path = self.repeats[0] / "steps.npz"
        if (self.repeats[0] / "steps.jsonl").is_file() or not path.is_file():
            return None
        n = table_rows(path)
        return None if n <= STEPS_SHOWN else (f"{self.label}: timeline and step table from the first {STEPS_SHOWN} "
                                              f"of {n} steps in time (steps.npz holds them all)")

    def m(self, key: str) -> float | None:
        """A number from metrics.json by dotted key ("ttft_ms.p50"); None when absent, null or NaN."""
        value = self.metrics
        for k in key.split("."):
            value = value.get(k) if isinstance(value, dict) else None
        return num(value)

    def ci(self, key: str) -> tuple[float, float] | None:
        """The 95% interval of a headline metric; None when metrics.json has none."""
        ci = ((self.metrics or {}).get("ci") or {}).get(key)
        return (float(ci[0]), float(ci[1])) if isinstance(ci, list) and len(ci) == 2 and None not in ci else None

    @property
    def num_repeats(self) -> int:
        reps = (self.metrics or {}).get("repeats")
        return reps.get("num_ok", 1) if isinstance(reps, dict) else 1

    @property
    def rate(self) -> float | None:
        return num(self.info.get("rate"))


def _clean(text: str) -> list[str]:
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    return [line.strip() for line in text.splitlines() if line.strip()]


def load_point(path: Path, root: Path) -> Point:
    rel = path.relative_to(root).as_posix()
    if not (path / "metrics.json").is_file() and not (path / "error.json").is_file():
        src = aggregate(path) or {"error": "no repeat finished"}
        metrics = None if "error" in src else src
        return Point(path, rel, metrics, [] if metrics else _clean(str(src["error"])), src.get("point") or {})
    name = "metrics.json" if (path / "metrics.json").is_file() else "error.json"
    try:
        src = json.loads((path / name).read_text())
        problem = None if isinstance(src, dict) else f"{name} is not a JSON object"
    except (OSError, ValueError) as e:
        src, problem = {}, f"unreadable {name}: {e}"
    src = src if isinstance(src, dict) else {}
    metrics = src if name == "metrics.json" and problem is None else None
    text = "" if metrics is not None else problem or str(src.get("error") or "?")
    info = src.get("point") if isinstance(src.get("point"), dict) else {}
    return Point(path, rel, metrics, _clean(text), info)


def natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def find_points(root: Path) -> list[Point]:
    """Every point below root, in natural order (2 before 10)."""
    points = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted((d for d in dirnames if not d.startswith(".")), key=natural)
        if "metrics.json" in filenames or "error.json" in filenames or repeat_dirs(Path(dirpath)):
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


# What a comparison varies, in words: (identity key, name); the layout-derived keys are read together.
VARIED = (("workload", "workloads"), ("transfer", "KV transfer backends"), ("token_budget", "chunk sizes"))


def what_varies(infos: list[dict]) -> str:
    """"serving modes", "prefill:decode pool ratios", "chunk sizes", ... joined: what differs among points."""
    parts = []
    modes = {(i.get("mode"), i.get("policy") if i.get("mode") == "colocated" else None) for i in infos}
    splits = {(i.get("prefill_workers"), i.get("decode_workers")) for i in infos if i.get("mode") == "disaggregated"}
    if len(modes) > 1:
        parts.append("serving modes")
    if len(splits) > 1:
        parts.append("prefill:decode pool ratios")
    chunked = [i for i in infos if i.get("mode") == "colocated" and i.get("policy") == "chunked"]
    for key, name in VARIED:
        among = chunked if key == "token_budget" else [i for i in infos if i.get("mode") == "disaggregated"] \
            if key == "transfer" else infos
        if len({str(i.get(key)) for i in among}) > 1:
            parts.append(name)
    rest = [k for k in dict.fromkeys(k for i in infos for k in swept(i)) if k != "rate"
            and k.split(".")[-1] not in ("token_budget", "layout", "transfer", "workload", "mode", "prefill_workers",
                                         "decode_workers", "workers", "policy")
            and len({swept(i).get(k) for i in infos}) > 1]
    parts += rest
    return " and ".join(parts) if parts else "points with the same settings"
