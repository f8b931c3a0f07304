"""The report being written (`Report`: its markdown, files and notes) and how its tables and groups of points
read; shared by report.py and the sections it calls (sections.py)."""
from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

from experiments.report.points import Point, short
from experiments.serving.steps import num


def fmt(x, digits: int = 1, scale: float = 1) -> str:
    x = num(x)
    return "n/a" if x is None else f"{x * scale:.{digits}f}"


def with_ci(p: Point, key: str, digits: int, scale: float = 1) -> str:
    """"45.3 [34.3, 61.1]": a point's median and 95% interval (no brackets without one)."""
    text, ci = fmt(p.m(key), digits, scale), p.ci(key)
    return text if ci is None or text == "n/a" else f"{text} [{fmt(ci[0], digits, scale)}, {fmt(ci[1], digits, scale)}]"


def table(columns: tuple, rows: list[dict]) -> str:
    """A Markdown table of dict rows; columns as in SUMMARY."""
    def cell(row, key, digits=None, scale=1):
        text = str(row.get(key)) if digits is None else fmt(row.get(key), digits, scale)
        return text.replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(c[0] for c in columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(r, *c[1:]) for c in columns) + " |" for r in rows]) + "\n"


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


def groups(ok: list[Point]) -> dict[tuple, list[Point]]:
    """Points that compare like with like: the same GPU count, rate and workload."""
    out: dict[tuple, list[Point]] = {}
    for p in ok:
        out.setdefault((num(p.info.get("num_gpus")), p.rate, p.info.get("workload")), []).append(p)
    return out


def group_name(key: tuple) -> str:
    gpus, rate, workload = key
    return ", ".join(x for x in (f"{short(gpus)} GPUs" if gpus is not None else None,
                                 f"{short(rate)} req/s" if rate is not None else None,
                                 f"workload {workload}" if workload else None) if x)
