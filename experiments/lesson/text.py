"""lesson.md from the lesson's results. Every figure in the text is formatted from `results`, and every
comparison is worded by experiments/serving/compare.py from medians and intervals: the templates here hold words
only (tests/test_lesson.py checks that no string literal has a number)."""
from __future__ import annotations

from experiments.lesson.stall import controlled, on_gpu
from experiments.lesson.when import when
from experiments.lesson.words import CI, cell, find, num
from experiments.serving import compare
from experiments.serving.compare import Estimate
from experiments.serving.machine import SHARED, load_warning


def _cpu(results: dict) -> bool:
    return results["device"].startswith("CPU")


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _side(x: float, ridge: float) -> str:
    return "below" if x < ridge else "above"


# -- 1 ------------------------------------------------------------------------------------------
def why(r: dict, n: int) -> str:
    rf = r["roofline"]
    b, p, c = rf["mixed"]["batch"], rf["mixed"]["chunk"], rf["context"]
    dec, pre, mix = f"decode B={b} C={c}", f"prefill P={p}", f"mixed B={b} C={c} + P={p}"
    rows = []
    for hw_name, h in rf["hardware"].items():
        d, f, m = find(h["points"], dec), find(h["points"], pre), find(h["points"], mix)
        got = (h.get("measured") or {}).get("ms")
        timed = (f"{num(got[dec])} / {num(got[pre])} / {num(got[mix])}, {num(got[mix] / got[dec])}x" if got
                 else "not in the database")
        rows.append(f"| {hw_name} | {num(h['ridge'])} | {num(d['intensity'])}, {d['bound']}, {num(d['time_ms'])} | "
                    f"{num(f['intensity'])}, {f['bound']}, {num(f['time_ms'])} | {num(m['time_ms'])} | "
                    f"{num(m['time_ms'] / d['time_ms'])}x | {timed} |")
    hw_name, h = list(rf["hardware"].items())[-1]
    d, f, m = find(h["points"], dec), find(h["points"], pre), find(h["points"], mix)
    here = rf["here"]
    hd = find(here["points"], dec)
    hw_here = here["hardware"]
    if d["bound"] != f["bound"]:
        share = (f"Two kinds of work with opposite bottlenecks ({d['bound']}-bound decode, {f['bound']}-bound "
                 "prefill) share one step, and the slower sets its length.")
    else:
        share = (f"At these shapes both are {d['bound']}-bound on the {hw_name}, so the mixed step simply does the "
                 "work of both.")
    lines = [
        f"## {n}. Why prefill and decode interfere",
        "",
        f"The roofline of {rf['model']} ({rf['dtype']}) from datasheet peaks: estimated, not measured. "
        f"Decode: {b} sequences at context {c}; prefill: {p} tokens; mixed: both in one step.",
        "",
        "![roofline](roofline.png)",
        "",
        "| hardware | ridge FLOP/B | decode: FLOP/B, bound, ms | prefill: FLOP/B, bound, ms | mixed step ms | mixed / decode "
        "| measured decode / prefill / mixed ms, mixed / decode |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"**Answer.** A decode step makes one token per sequence but reads every weight and the whole KV cache "
        f"to do it: on the {hw_name} its arithmetic intensity is {num(d['intensity'])} FLOP per byte, "
        f"{_side(d['intensity'], h['ridge'])} the ridge of {num(h['ridge'])}, so the roofline calls it "
        f"{d['bound']}-bound at {num(d['time_ms'])} ms. A {p}-token prefill does {num(f['intensity'])} FLOP per "
        f"byte: {f['bound']}-bound, {num(f['time_ms'])} ms. Continuous batching puts both in one step, which the "
        f"roofline puts at {num(m['time_ms'])} ms, {num(m['time_ms'] / d['time_ms'])}x the decode-only step: each "
        f"of the {b} running requests waits that long for its next token. {share}",
        "",
        *([_measured_sentence(h, hw_name, dec, pre, mix, b), ""] if (h.get("measured") or {}).get("ms") else []),
        f"On this device ({r['device']}) the measured ceilings are {num(hw_here['peak_flops'] / 1e9)} GFLOP/s and "
        f"{num(hw_here['mem_bw'] / 1e9)} GB/s, a ridge of {num(here['ridge'])} FLOP per byte; {here['model']}'s "
        f"decode step at the same shape has intensity {num(hd['intensity'])}, "
        f"{_side(hd['intensity'], here['ridge'])} that ridge ({hd['bound']}-bound by this roofline).",
    ]
    if _cpu(r):
        what = ("the GPU rows above are the roofline's and NVIDIA's database's, not measurements of this run"
                if any((h.get("measured") or {}).get("ms") for h in rf["hardware"].values())
                else "the GPU rows above are the roofline's, not measurements")
        lines += ["", "On a CPU prefill and decode run on the same cores, which also serve this machine's other "
                      f"processes; {what}."]
    return "\n".join(lines)


def _measured_sentence(h: dict, hw_name: str, dec: str, pre: str, mix: str, b: int) -> str:
    got, src = h["measured"]["ms"], h["measured"]["source"]
    return (f"Measured on the {hw_name} (NVIDIA's per-operation database, {src}; the crosses in the figure, "
            f"`experiments/sim/gpu_costs.py`), the same steps take {num(got[dec])} ms (decode), {num(got[pre])} ms "
            f"(prefill) and {num(got[mix])} ms (mixed): the mixed step is {num(got[mix] / got[dec])}x the decode-only "
            f"one, {num(got[dec] / find(h['points'], dec)['time_ms'])}x and {num(got[pre] / find(h['points'], pre)['time_ms'])}x "
            f"the roofline's decode and prefill bounds.")


# -- 2 ------------------------------------------------------------------------------------------
def _chunk_ratio(p: dict) -> str:
    ci = tuple(p["inflation_ci"]) if p.get("inflation_ci") else None
    again = p["remeasured"] if p.get("implausible") else None
    return compare.ratio(f"a {p['chunk']}-token chunk", p["inflation"], ci, remeasured=again)


def measured(r: dict, n: int) -> str:
    it = r["interference"]
    pts = it["points"]

    def interval(p, key, unit=""):
        ci = p.get(f"{key}_ci")
        return f"{num(p[key])}{unit} [{num(ci[0])}, {num(ci[1])}]" if ci else num(p[key], unit)
    rows = [f"| {p['batch']} | {p['chunk']} | {num(p['step_ms'])} ({num(p['step_ms_min'])} to "
            f"{num(p['step_ms_max'])}) | {num(p['predicted_ms'])} | {num(p['step_ms'] / p['predicted_ms'])}x | "
            f"{interval(p, 'inflation', 'x') if p['chunk'] else '-'} | "
            f"{interval(p, 'prefill_tok_s') if p['chunk'] else '-'} |" for p in pts]
    b = min(p["batch"] for p in pts)
    row = [p for p in pts if p["batch"] == b]
    base, small, big = row[0], row[1] if len(row) > 2 else row[-1], row[-1]
    rounds = len(base["samples_ms"])
    tok = [Estimate(f"the {q['chunk']}-token chunk", q["prefill_tok_s"],
                    tuple(q["prefill_tok_s_ci"]) if q.get("prefill_tok_s_ci") else None) for q in (small, big)]
    lines = [
        f"## {n}. Interference, measured on {it['device']}",
        "",
        f"{r['model']} ({r['dtype']}): B decodes at context {it['context']} plus a P-token prompt chunk in one "
        f"engine step, each step timed by the engine's own trace. The chunk sizes are measured in rounds (one step "
        f"of each size per round, the order rotated, after a warm-up round), {it['repeats']} rounds and up to "
        f"{it['max_remeasure']} more while a mixed step measures faster than decode-only; the table gives the "
        f"median step with its range, and each step's ratio to the decode-only step of its round as a median with "
        f"its {CI} interval.",
        "",
        "![interference](interference.png)",
        "",
        "| B | P | measured ms (range) | roofline ms | measured / roofline | step / decode-only | prefill tokens/s |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"With B={b} decodes the decode-only step took {num(base['step_ms'])} ms (median of {rounds} rounds). "
        f"{_cap(_chunk_ratio(big))}; {_chunk_ratio(small)}. While a step runs, every running request's next "
        "token waits for it.",
        "",
        compare.sentence("Prefill throughput of the chunk", tok, " tokens/s"),
    ]
    if (busy := load_warning(it.get("machine") or {})) is not None:
        lines += ["", f"While these steps were measured: {busy}."]
    stuck = [p for p in pts if p.get("implausible")]
    if stuck:
        lines += ["", "Still implausible after re-measuring: " + "; ".join(
            f"B={p['batch']}, P={p['chunk']}: {_chunk_ratio(p)}" for p in stuck) + "."]
    g = it["gap"]
    w, nw = g["widest"], g["narrowest"]
    lines += [
        "",
        f"Measured steps were {num(g['ratio_min'])}x to {num(g['ratio_max'])}x the roofline's lower bound on this "
        f"device's measured ceilings (median {num(g['ratio_median'])}x): widest at B={w['batch']}, P={w['chunk']} "
        f"({num(w['step_ms'])} ms), narrowest at B={nw['batch']}, P={nw['chunk']} ({num(nw['step_ms'])} ms). The "
        "roofline counts FLOPs and bytes only, not per-step costs such as scheduling in Python, a kernel launch "
        "per operation or attention over whole blocks.",
    ]
    return "\n".join(lines)


# -- 3 ------------------------------------------------------------------------------------------
def _est(label: str, m: dict, key: str) -> Estimate:
    return compare.estimate(label, m, key)


def chunking(r: dict, n: int) -> str:
    ch = r["chunking"]
    rows = [_latency_row(f"chunked, chunk {c['chunk']}", c) for c in ch["chunked"]]
    rows += [_latency_row(ref["label"], ref) for ref in ch["refs"].values()]
    lo, hi = ch["chunked"][0], ch["chunked"][-1]
    pf, dis = ch["refs"]["prefill_first"], ch["refs"]["disaggregated"]
    small = f"chunk {lo['chunk']}"
    trio = [(small, lo), ("prefill_first", pf), ("disaggregated", dis)]
    lines = [
        f"## {n}. Chunked prefill end to end",
        "",
        f"Workload `{ch['workload']}`{_lengths(ch)} at {num(ch['rate'])} requests/s (Poisson), {ch['num_requests']} requests, served end to "
        f"end on {r['gpus']} workers for each chunk size, with prefill_first and disaggregated as references, each "
        f"{ch['repeats']} time(s) round-robin (runs under `runs/chunking/`, readable by `python -m "
        f"experiments.report`). Medians with {CI} intervals"
        + (f"; {compare.ONE_REPEAT}." if ch["repeats"] < 2 else "."),
        "",
        "![chunking](chunking.png)",
        "",
        "| configuration | TTFT p50 ms | TTFT p99 ms | ITL p99 ms | TPOT p50 ms | goodput per GPU | SLO attainment % |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"**Answer.** From chunks of {lo['chunk']} tokens to chunks of {hi['chunk']}: "
        + compare.change("decode ITL p99", _est(f"chunk {lo['chunk']}", lo, "itl_ms.p99"),
                         _est(f"chunk {hi['chunk']}", hi, "itl_ms.p99"), " ms") + "; "
        + compare.change("TTFT p50", _est(f"chunk {lo['chunk']}", lo, "ttft_ms.p50"),
                         _est(f"chunk {hi['chunk']}", hi, "ttft_ms.p50"), " ms") + ".",
        "",
        "Against the references, " + compare.sentence("decode ITL p99", [_est(k, m, "itl_ms.p99") for k, m in trio],
                                                        " ms"),
        "",
        compare.sentence("TTFT p50", [_est(k, m, "ttft_ms.p50") for k, m in trio], " ms"),
    ]
    return "\n".join(lines)


def _lengths(ch: dict) -> str:
    if ch.get("prompt_len") is None:
        return ""
    return f" ({ch['prompt_len']}-token prompts, {ch['output_len']}-token outputs)"


def _latency_row(label: str, m: dict) -> str:
    return (f"| {label} | {cell(m, 'ttft_ms.p50')} | {cell(m, 'ttft_ms.p99')} | {cell(m, 'itl_ms.p99')} | "
            f"{cell(m, 'tpot_ms.p50')} | {cell(m, 'goodput_per_gpu')} | {cell(m, 'slo_attainment', 100)} |")


def caveats(r: dict, n: int) -> str:
    lines = [f"## {n}. What this run can and cannot show", ""]
    runs = [m for sec in ("chunking",) for m in r[sec]["chunked"] + list(r[sec]["refs"].values())]
    runs += [m for c in r["decision"]["measured"] for m in c["modes"].values()]
    machines = [m.get("machine") or {} for m in runs]
    shared = [m for m in machines if m.get("workers_share_cores")]
    loaded = [w for m in machines if (w := load_warning(m))]
    source = r["decision"]["simulated"].get("source") or "simulated"
    if _cpu(r):
        lines.append("The measured parts ran the small model on a CPU with fake GPUs declared to Ray, and KV moved "
                     f"over loopback, not NVLink or a network. The GPU numbers are {source}, not measured by pdlab's "
                     "engine; run the lesson on a GPU node (model=llama-3-8b) to measure them.")
    else:
        lines.append(f"The measured parts ran on {r['device']}. The simulated map is {source}.")
    if shared:
        lines += ["", f"In {len(shared)} of {len(runs)} served points {SHARED}."]
    if loaded:
        lines += ["", f"Load: in {len(loaded)} of {len(runs)} served points, {loaded[0]} (each run's report.md "
                      "lists every point)."]
    lines.append("")
    took = r.get("section_s") or {}
    by = f" (by section: {', '.join(f'{k} {num(v)} s' for k, v in took.items())})" if took else ""
    lines.append(f"This lesson took {num(r['elapsed_s'])} s" + (" in quick mode (reduced grids)" if r["quick"] else "")
                 + by + ".")
    return "\n".join(lines)


def render(results: dict) -> str:
    title = ["# The lesson: prefill/decode interference, chunked prefill, and when to disaggregate", "",
             f"Model measured: {results['model']} ({results['dtype']}) on {results['device']}. Every number "
             "below comes from this run (`lesson.json`); estimates are marked as such, and a difference between "
             f"measurements is stated only where their {CI} intervals separate and their medians differ by "
             f"{compare.MIN_DIFFERENCE:.0%} or more.", ""]
    sections = [why, measured, controlled, chunking, when, on_gpu, caveats]
    return "\n".join(title) + "\n" + "\n\n".join(f(results, i) for i, f in enumerate(sections, 1)) + "\n"
