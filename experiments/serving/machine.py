"""How busy this machine was while a point ran, and whether its layout could give workers their own cores.

`snapshot()` reads the 1-minute load average (/proc/loadavg), the CPU time of the whole machine by kind
(/proc/stat: busy, idle, steal) and the CPU time of this process and all its descendants (/proc/<pid>/stat:
the driver, the router, the embedded Ray and its workers: "ours"). `usage(a, b)` turns two snapshots into
the `machine` section of metrics.json: cores, load at start and end, and the machine's CPU capacity over
the interval split into ours, other processes' and stolen (by the hypervisor), in cores and as shares.
Where /proc is missing (not Linux) the numbers are null and nothing is warned.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from cluster.isolation import DRIVER_WARNING, SHARED_WARNING as SHARED

PROC = Path("/proc")
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass
class Snapshot:
    time: float
    load_1m: float | None = None
    cpu: dict[str, int] = field(default_factory=dict)   # machine-wide jiffies: total, busy, steal
    ours: int | None = None                             # jiffies of this process tree


def _machine_cpu() -> dict[str, int]:
    line = (PROC / "stat").read_text().splitlines()[0].split()
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in line[1:9])
    busy = user + nice + system + irq + softirq
    return {"total": busy + idle + iowait + steal, "busy": busy, "steal": steal}


def _tree_jiffies(root: int) -> int:
    """utime + stime (+ those of waited-for children) over `root` and every live descendant."""
    parent, used = {}, {}
    for d in PROC.iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue                      # the process ended while we looked
        parent[int(d.name)] = int(fields[1])
        used[int(d.name)] = sum(int(x) for x in fields[11:15])
    tree, frontier = {root}, [root]
    while frontier:
        children = [p for p, pp in parent.items() if pp in frontier and p not in tree]
        tree.update(children)
        frontier = children
    return sum(used.get(p, 0) for p in tree)


def snapshot() -> Snapshot:
    snap = Snapshot(time=time.time())
    try:
        snap.load_1m = float((PROC / "loadavg").read_text().split()[0])
        snap.cpu = _machine_cpu()
        snap.ours = _tree_jiffies(os.getpid())
    except (OSError, ValueError, IndexError):
        pass
    return snap


def usage(start: Snapshot, end: Snapshot, cores: int | None = None) -> dict:
    """The `machine` section of metrics.json for the interval between two snapshots."""
    cores = cores or available_cores()
    out = {"cores": cores, "cpu_count": os.cpu_count(), "load_1m_start": start.load_1m, "load_1m_end": end.load_1m,
           "interval_s": end.time - start.time}
    keys = ("ours_cores", "other_cores", "steal_cores", "ours_share", "other_share", "steal_share")
    out.update(dict.fromkeys(keys))
    if start.cpu and end.cpu and start.ours is not None and end.ours is not None:
        total = end.cpu["total"] - start.cpu["total"]
        busy, steal = end.cpu["busy"] - start.cpu["busy"], end.cpu["steal"] - start.cpu["steal"]
        ours = max(0, end.ours - start.ours)
        other = max(0, busy - ours)
        seconds = max(out["interval_s"], 1e-9) * TICK
        if total > 0:
            out.update(ours_cores=ours / seconds, other_cores=other / seconds, steal_cores=steal / seconds,
                       ours_share=ours / total, other_share=other / total, steal_share=steal / total)
    loads = [x for x in (start.load_1m, end.load_1m) if x is not None]
    out["overloaded"] = bool(loads) and max(loads) > cores
    return out


def combine(per_repeat: list[dict]) -> dict:
    """A point's machine section from its repeats': the worst of each, and every repeat's own."""
    def worst(key):
        values = [m.get(key) for m in per_repeat if m.get(key) is not None]
        return max(values) if values else None
    first = per_repeat[0] if per_repeat else {}
    out = {"cores": first.get("cores"), "cpu_count": first.get("cpu_count")}
    out.update({f"{k}_max": worst(k) for k in ("load_1m_start", "load_1m_end", "other_cores", "other_share",
                                                 "steal_share", "steal_cores", "ours_cores")})
    out["overloaded"] = any(m.get("overloaded") for m in per_repeat)
    out["workers_share_cores"] = any(m.get("workers_share_cores") for m in per_repeat)
    out["per_repeat"] = per_repeat
    return out


def load_warning(machine: dict) -> str | None:
    """One line when the 1-minute load exceeded the cores available, else None."""
    if not machine or not machine.get("overloaded"):
        return None
    load = max(v for v in (machine.get(k) for k in ("load_1m_start", "load_1m_end", "load_1m_start_max",
                                                     "load_1m_end_max")) if v is not None)
    other = machine.get("other_cores", machine.get("other_cores_max"))
    text = f"machine overloaded: 1-minute load average {load:.1f} on {machine['cores']} cores"
    if other is not None:
        text += f" (other processes used {other:.2f} cores)"
    return text + "; timings include waiting for a CPU"


def driver_warning(isolation: dict | None) -> str | None:
    """One line when the pool found no core for the driver beside its workers' (metrics.json's `isolation`)."""
    return DRIVER_WARNING if (isolation or {}).get("driver_shares_cores") else None


def point_warnings(metrics: dict) -> list[str]:
    """What the machine did to a point (its metrics.json): overloaded, the router on the workers' cores,
    workers sharing cores; what the console and the report both print."""
    machine = metrics.get("machine") or {}
    lines = [text for text in (load_warning(machine), driver_warning(metrics.get("isolation"))) if text is not None]
    return lines + sorted({m["shared_cores"] for m in machine.get("per_repeat", [machine]) if m.get("shared_cores")})


def shared_cores(num_workers: int, torch_threads: int, embedded: bool, ray_cpus: int | None = None,
                 cores: int | None = None) -> str | None:
    """SHARED, with the arithmetic, when an embedded Ray's workers cannot each get their own cores."""
    if not embedded:
        return None
    cores = cores or available_cores()
    threads = torch_threads or max(1, (ray_cpus or os.cpu_count() or 1) // max(num_workers, 1))
    if num_workers * threads <= cores:
        return None
    return f"{SHARED} ({num_workers} workers x {threads} torch thread(s) on {cores} cores)"
