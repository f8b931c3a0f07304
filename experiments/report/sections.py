"""The report's figure sections: latency distributions, rate sweeps, the comparison chart, the time to the
first decode step, and the engine-step timelines with the interference table. Each takes the Report
being written and the points that completed (experiments/report/report.py calls them in order)."""
from __future__ import annotations

import re

from experiments.report import plots
from experiments.serving import compare
from experiments.report.page import Report, fmt, group_name, groups, table, with_ci
from experiments.report.points import Point, short, what_varies
from experiments.serving.steps import num, step_ms, step_stats

MAX_TIMELINES = 8
BREAKDOWN = (("point", "label", None), ("requests", "num_requests", None), ("queue ms", "queue_ms", 1),
             ("prefill ms", "prefill_ms", 1), ("exposed transfer ms", "exposed_ms", 1),
             ("first decode ms", "first_decode_ms", 1), ("total ms", "total_ms", 1),
             ("bulk transfer ms", "transfer_ms", 1))
STEPS = (("point", "label", None), ("worker", "worker", None), ("decode-only p50 ms", "decode_p50_ms", 1),
         ("mixed p50 ms", "mixed_p50_ms", 1), ("mixed p99 ms", "mixed_p99_ms", 1), ("ratio", "ratio", 2),
         ("prefill tok/mixed step p50", "mixed_prefill_tokens_p50", 0), ("decode-only steps", "num_decode_steps", None),
         ("mixed steps", "num_mixed_steps", None), ("prefill-only steps", "num_prefill_steps", None))


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
    gaps = {p.label: [1000 * g for q in p.requests if q.get("status") == "ok" for g in q.get("itl_s") or ()
                      if num(g) is not None] for p in ok}
    if any(gaps.values()):
        p99 = {p.label: (p.m("itl_ms.p99"), p.ci("itl_ms.p99")) for p in ok}
        r.figure(plots.itl_cdf, "itl_cdf.png", {k: v for k, v in gaps.items() if v}, p99, caption="ITL CDF")


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
        def scaled(x):
            return None if x is None else scale * x
        return {c: ([p.rate for p in ps], [scaled(p.m(key)) for p in ps],
                    [tuple(scale * x for x in ci) if (ci := p.ci(key)) else None for p in ps])
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
                     "best": short(best.rate) if best else "none", "per_gpu": best.rate / gpus if gpus else None,
                     "attained": with_ci(best, "slo_attainment", 1, 100) if best else "n/a"})
    r.md += ["Per configuration, the highest offered rate whose median SLO attainment met its target "
             "(DistServe's per-configuration goodput), with the attainment there and its 95% interval: where the "
             "interval reaches below the target, meeting it is not significant.\n",
             table((("configuration", "config"), ("rates tested (req/s)", "rates"),
                    ("highest rate meeting target (req/s)", "best"), ("per GPU (req/s/GPU)", "per_gpu", 2),
                    ("SLO attainment there %", "attained")), rows)]


def comparison_chart(r: Report, ok: list[Point]) -> None:
    found = {k: g for k, g in groups(ok).items() if len(g) >= 2}
    if not found:
        return
    rows = []
    for key, g in found.items():
        for p in g:
            row = {"group": group_name(key), "label": p.label}
            for name, metric in (("goodput_per_gpu", "goodput_per_gpu"), ("itl_p99_ms", "itl_ms.p99"),
                                 ("ttft_p99_ms", "ttft_ms.p99"), ("slo_attainment", "slo_attainment")):
                row[name], row[f"{name}_ci"] = p.m(metric), p.ci(metric)
            rows.append(row)
    compared = what_varies([p.info for g in found.values() for p in g])
    title = f"{compared.capitalize()} compared" + (f" ({group_name(next(iter(found)))})" if len(found) == 1 else "")
    r.md += [f"## {title}\n", "Points with the same GPU count, rate and workload; bars are medians over repeats, "
             "whiskers their 95% intervals.\n"]
    r.figure(plots.comparison, "comparison.png", title, rows, caption=title)
    r.csv("comparison.csv", [{k: list(v) if isinstance(v, tuple) else v for k, v in row.items()} for row in rows])

    def cell(row, key, digits, scale=1):
        ci = row[f"{key}_ci"]
        text = fmt(row[key], digits, scale)
        return text if not ci or text == "n/a" else f"{text} [{fmt(ci[0], digits, scale)}, {fmt(ci[1], digits, scale)}]"
    r.md += ["| group | point | goodput/GPU | ITL p99 ms | TTFT p99 ms | SLO attainment % |", "|---|---|---|---|---|---|"]
    r.md += [f"| {row['group']} | {row['label']} | {cell(row, 'goodput_per_gpu', 2)} | {cell(row, 'itl_p99_ms', 1)} | "
             f"{cell(row, 'ttft_p99_ms', 1)} | {cell(row, 'slo_attainment', 1, 100)} |" for row in rows] + [""]


def breakdown(r: Report, ok: list[Point]) -> None:
    parts = {p.label: plots.first_decode_breakdown(p.requests) for p in ok}
    r.notes += [f"{k}: no completed request with 2+ tokens in requests.jsonl; not in the breakdown"
                for k, v in parts.items() if v is None]
    rows = [{"label": k} | v for k, v in parts.items() if v]
    if rows:
        r.md.append("## Time to the first decode step\n")
        r.figure(plots.ttft_breakdown, "ttft_breakdown.png", rows, caption="TTFT breakdown")
        r.csv("breakdown.csv", rows)
        r.md += ["Mean over completed requests with at least 2 tokens, all repeats pooled. queue = `queue_s`, "
                 "prefill = `prefill_s`, exposed transfer = `exposed_transfer_s` (the last KV byte's landing minus "
                 "the prefill's end, floored at 0: the part of the transfer on the critical path; 0 when no KV "
                 "moved), first decode = `itl_s[0]` (the gap between the first and second token) minus the exposed "
                 "transfer; total = their sum. Bulk transfer = `transfer_s`, the sender's time from the KV's first "
                 "byte to its last, not part of the total: with `transfer.stream=layer` or `chunk` most of it "
                 "hides behind the prefill, so it can exceed the exposed part. TTFT itself excludes the transfer in "
                 "disaggregated mode because the prefill worker streams the first token as soon as it is sampled; "
                 "the KV transfer delays the second token instead.\n", table(BREAKDOWN, rows)]


def interference(r: Report, ok: list[Point]) -> None:
    with_steps = sorted((p for p in ok if p.steps), key=lambda p: p.label)
    r.notes += [f"{p.label}: steps.jsonl missing or empty; no timeline or interference row" for p in ok if not p.steps]
    if not with_steps:
        return
    r.md.append("## Interference: engine step timelines\n")
    drawn = with_steps[:MAX_TIMELINES]
    r.notes += [note for p in with_steps if (note := p.steps_note)]
    if len(with_steps) > MAX_TIMELINES:
        r.notes.append(f"timelines drawn for the first {MAX_TIMELINES} points by label, of {len(with_steps)}")
    durations = [ms for p in drawn for s in p.steps if (ms := step_ms(s)) is not None]
    ymax = 1.08 * max(durations + [1e-3])
    max_prefill = int(max([s.get("num_prefill_tokens") or 0 for p in drawn for s in p.steps] + [1]))
    r.md.append(f"Each point's first repeat; every timeline has the same y-scale (0 to {fmt(ymax)} ms) and the same "
                "colour scale of prefill tokens per step.\n")
    used: set[str] = set()
    for p in drawn:
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", p.label).strip("_") or "point"
        name = name if name not in used else f"{name}_{len(used)}"
        used.add(name)
        r.figure(plots.timeline, f"timeline_{name}.png", f"{p.label} ({p.repeats[0].name})", p.steps, ymax,
                 max_prefill, caption=f"steps of {p.label}")
    rows = [{"label": p.label} | s for p in with_steps
            for s in step_stats(p.all_steps)]
    r.csv("steps_summary.csv", rows)
    r.md += ["Per worker, all repeats pooled. Decode-only steps have no prefill tokens; mixed steps carry prefill "
             "tokens and decode sequences; prefill-only steps have no decode sequence. ratio = mixed p50 / "
             "decode-only p50.\n", table(STEPS, rows)]
    lines = [compare.ratio(f"A mixed step of {p.label}", p.m("step_ratio.ratio"), p.ci("step_ratio.ratio"))
             for p in with_steps if p.m("step_ratio.ratio") is not None]
    if lines:
        r.md += ["Per point, the workers that ran both kinds pooled (median over repeats [95% interval]):\n"]
        r.md += [f"- {line}." for line in lines] + [""]
