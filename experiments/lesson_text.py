"""lesson.md from the lesson's results. Every figure in the text is formatted from `results`: the
templates here hold words only (tests/test_lesson.py checks that no string literal has a number)."""
from __future__ import annotations

SHORT = {"colocated_prefill_first": "colocated prefill_first", "colocated_chunked": "colocated chunked",
         "disaggregated": "disaggregated", "colocated-prefill_first": "colocated prefill_first",
         "colocated-chunked": "colocated chunked", None: "no mode (SLO infeasible)", "tie": "a tie"}


def num(x, unit: str = "") -> str:
    """A number as a reader wants it: few significant digits, thousands kept whole."""
    if x is None:
        return "n/a"
    x = float(x)
    text = f"{x:,.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"
    return f"{text}{unit}"


def name(mode) -> str:
    return SHORT.get(mode, f"disaggregated {mode}" if mode else SHORT[None])


def find(points: list[dict], step: str) -> dict:
    return next(p for p in points if p["step"] == step)


def _cpu(results: dict) -> bool:
    return results["device"].startswith("CPU")


# -- 1 ------------------------------------------------------------------------------------------
def why(r: dict, n: int) -> str:
    rf = r["roofline"]
    b, p, c = rf["mixed"]["batch"], rf["mixed"]["chunk"], rf["context"]
    dec, pre, mix = f"decode B={b} C={c}", f"prefill P={p}", f"mixed B={b} C={c} + P={p}"
    rows = []
    for hw_name, h in rf["hardware"].items():
        d, f, m = find(h["points"], dec), find(h["points"], pre), find(h["points"], mix)
        rows.append(f"| {hw_name} | {num(h['ridge'])} | {num(d['intensity'])}, {d['bound']}, {num(d['time_ms'])} | "
                    f"{num(f['intensity'])}, {f['bound']}, {num(f['time_ms'])} | {num(m['time_ms'])} | "
                    f"{num(m['time_ms'] / d['time_ms'])}x |")
    hw_name, h = list(rf["hardware"].items())[-1]
    d, f, m = find(h["points"], dec), find(h["points"], pre), find(h["points"], mix)
    here = rf["here"]
    hd = find(here["points"], dec)
    hw_here = here["hardware"]
    lines = [
        f"## {n}. Why prefill and decode interfere",
        "",
        f"The roofline of {rf['model']} ({rf['dtype']}) from datasheet peaks: estimated, not measured. "
        f"Decode: {b} sequences at context {c}; prefill: {p} tokens; mixed: both in one step.",
        "",
        "![roofline](roofline.png)",
        "",
        "| hardware | ridge FLOP/B | decode: FLOP/B, bound, ms | prefill: FLOP/B, bound, ms | mixed step ms | mixed / decode |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"**Answer.** A decode step makes one token per sequence but reads every weight and the whole KV cache "
        f"to do it: on the {hw_name} its arithmetic intensity is {num(d['intensity'])} FLOP per byte, far below "
        f"the ridge of {num(h['ridge'])}, so it is {d['bound']}-bound and takes {num(d['time_ms'])} ms however "
        f"little it computes. A {p}-token prefill does {num(f['intensity'])} FLOP per byte: {f['bound']}-bound, "
        f"{num(f['time_ms'])} ms. Continuous batching puts both in one step, which then lasts "
        f"{num(m['time_ms'])} ms, {num(m['time_ms'] / d['time_ms'])}x the decode-only step: each of the {b} "
        f"running requests waits that long for its next token. Two kinds of work with opposite bottlenecks "
        f"share one step, and the slow one sets its length.",
        "",
        f"On this device ({r['device']}) the measured ceilings are {num(hw_here['peak_flops'] / 1e9)} GFLOP/s and "
        f"{num(hw_here['mem_bw'] / 1e9)} GB/s, a ridge of {num(here['ridge'])} FLOP per byte; {here['model']}'s "
        f"decode step at the same shape has intensity {num(hd['intensity'])} ({hd['bound']}-bound by this "
        f"roofline).",
    ]
    if _cpu(r):
        lines += ["", "A CPU does not separate the two limits as a GPU does: its ridge is low, so decode is close "
                      "to compute-bound even for small batches, and prefill and decode compete for the same cores. "
                      "The interference measured below is real, but on this machine its cause is shared compute "
                      "time, not a memory-bound step absorbing compute-bound work; the GPU rows above are the "
                      "roofline's, not measurements."]
    return "\n".join(lines)


# -- 2 ------------------------------------------------------------------------------------------
def measured(r: dict, n: int) -> str:
    it = r["interference"]
    pts = it["points"]
    rows = [f"| {p['batch']} | {p['chunk']} | {num(p['step_ms'])} | {num(p['predicted_ms'])} | "
            f"{num(p['step_ms'] / p['predicted_ms'])}x | {num(p['inflation'])}x | "
            f"{num(p['prefill_tok_s']) if p['chunk'] else '-'} |" for p in pts]
    b = min(p["batch"] for p in pts)
    row = [p for p in pts if p["batch"] == b]
    base, small, big = row[0], row[1] if len(row) > 2 else row[-1], row[-1]
    g = it["gap"]
    lines = [
        f"## {n}. Interference, measured on {it['device']}",
        "",
        f"{r['model']} ({r['dtype']}): B decodes at context {it['context']} plus a P-token prompt chunk in one "
        "engine step, each step timed by the engine's own trace (median of several).",
        "",
        "![interference](interference.png)",
        "",
        "| B | P | measured ms | roofline ms | measured / roofline | step / decode-only | prefill tokens/s |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"With {b} decodes the decode-only step took {num(base['step_ms'])} ms; a {big['chunk']}-token chunk "
        f"stretched it to {num(big['step_ms'])} ms ({num(big['inflation'])}x), and every running request's "
        f"next token waited for it. A {small['chunk']}-token chunk cost {num(small['inflation'])}x. The chunk "
        f"itself ran at {num(small['prefill_tok_s'])} prefill tokens/s at {small['chunk']} tokens and "
        f"{num(big['prefill_tok_s'])} at {big['chunk']}: small chunks protect decode but prefill less "
        f"efficiently.",
        "",
        f"Measured steps were {num(g['ratio_min'])}x to {num(g['ratio_max'])}x the roofline's lower bound on this "
        f"device's measured ceilings (median {num(g['ratio_median'])}x). The roofline counts FLOPs and bytes only; "
        "per-step costs it ignores (scheduling in Python, a kernel launch per operation, attention over "
        "whole blocks) dominate the smallest steps, so the gap is widest there.",
    ]
    return "\n".join(lines)


# -- 3 ------------------------------------------------------------------------------------------
def _direction(a, b) -> str:
    return "rose" if b > a else "fell" if b < a else "stayed"


def chunking(r: dict, n: int) -> str:
    ch = r["chunking"]
    rows = []
    for c in ch["chunked"]:
        rows.append(_latency_row(f"chunked, chunk {c['chunk']}", c))
    for ref in ch["refs"].values():
        rows.append(_latency_row(ref["label"], ref))
    lo, hi = ch["chunked"][0], ch["chunked"][-1]
    pf, dis = ch["refs"]["prefill_first"], ch["refs"]["disaggregated"]
    itl = lambda x: x["itl_ms"]["p99"]  # noqa: E731
    ttft = lambda x: x["ttft_ms"]["p50"]  # noqa: E731
    trade = (itl(lo) < itl(pf) and ttft(lo) > ttft(pf))
    lines = [
        f"## {n}. How chunked prefill moves token latency",
        "",
        f"Workload `{ch['workload']}` at {num(ch['rate'])} requests/s, {ch['num_requests']} requests, served end to "
        f"end on {r['gpus']} workers for each chunk size, with prefill_first and disaggregated as references "
        "(each a run under `runs/chunking/`, readable by `python -m experiments.report`).",
        "",
        "![chunking](chunking.png)",
        "",
        "| configuration | TTFT p50 ms | TTFT p99 ms | ITL p99 ms | TPOT p50 ms | goodput per GPU | SLO attainment |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"**Answer.** From chunks of {lo['chunk']} tokens to chunks of {hi['chunk']}, decode ITL p99 "
        f"{_direction(itl(lo), itl(hi))} from {num(itl(lo))} to {num(itl(hi))} ms and TTFT p50 "
        f"{_direction(ttft(lo), ttft(hi))} from {num(ttft(lo))} to {num(ttft(hi))} ms (p99 {num(lo['ttft_ms']['p99'])} "
        f"to {num(hi['ttft_ms']['p99'])} ms). Prefilling whole prompts first gave ITL p99 {num(itl(pf))} ms with "
        f"TTFT p50 {num(ttft(pf))} ms; disaggregated gave {num(itl(dis))} ms and {num(ttft(dis))} ms.",
        "",
        ("Chunking trades first-token latency for smoother decoding: the smallest chunk kept the ITL tail below "
         "prefill_first's, and paid for it in TTFT, since a prompt now needs several steps, each shared with the "
         "decodes." if trade else
         "On this run the textbook trade did not show cleanly at the smallest chunk (the ITL tail was not lower "
         "than prefill_first's while TTFT was higher); the table is what was measured."),
    ]
    return "\n".join(lines)


def _latency_row(label: str, m: dict) -> str:
    return (f"| {label} | {num(m['ttft_ms']['p50'])} | {num(m['ttft_ms']['p99'])} | {num(m['itl_ms']['p99'])} | "
            f"{num(m['tpot_ms']['p50'])} | {num(m['goodput_per_gpu'])} | {num(100 * m['slo_attainment'])} % |")


# -- 4 ------------------------------------------------------------------------------------------
def when(r: dict, n: int) -> str:
    de = r["decision"]
    layouts = list(de["measured"][0]["modes"]) if de["measured"] else []
    head = "| prompt | output | " + " | ".join(f"{name(l)} goodput/GPU" for l in layouts) + " | winner |"
    rows = [f"| {c['prompt_len']} | {c['output_len']} | " +
            " | ".join(num(c["modes"][l]["goodput_per_gpu"]) for l in layouts) + f" | {name(c['winner'])} |"
            for c in de["measured"]]
    est = de["estimated"]
    lines = [
        f"## {n}. When to disaggregate",
        "",
        "![decision](decision.png)",
        "",
        f"**Measured here** ({r['model']}, {de['measured_gpus']} workers per layout, {num(de['measured_rate'])} "
        "requests/s, the lesson's SLO; \"a tie\" when the best two are within five percent):",
        "",
        head,
        "|" + "---|" * (len(layouts) + 3),
        *rows,
        "",
        f"**Estimated** for {est['model']} on {est['hardware']} with {est['gpus']} GPUs and a "
        f"{num(est['link_bw'] / 1e9)} GB/s KV link, by `experiments/decision.py`: roofline step times with "
        "queueing and transfer cost, a first-order model, not a measurement. Its roofline lets a chunk's "
        "compute hide entirely under a decode step's memory traffic, which flatters chunked prefill.",
        "",
    ]
    for slo_name, s in est["by_slo"].items():
        lines += [_estimate_paragraph(slo_name, s, est), ""]
    lines.append(_answer(de))
    return "\n".join(lines)


def _estimate_paragraph(slo_name: str, s: dict, est: dict) -> str:
    cells = s["grid"]
    wins = {}
    for c in cells:
        wins[c["winner"]] = wins.get(c["winner"], 0) + 1
    share = ", ".join(f"{name(k)} {v} of {len(cells)} cells" for k, v in sorted(wins.items(), key=lambda kv: -kv[1]))
    bp, bl = s["by_prompt"], s["by_link"]
    if bp["crossover_prompt_len"] is None:
        prompt = (f"at {est['crossover_output_len']}-token outputs {name(bp['winners'][0])} wins at every prompt "
                  f"length from {bp['prompt_lens'][0]} to {bp['prompt_lens'][-1]} (no crossover)")
    else:
        k = bp["prompt_lens"].index(bp["crossover_prompt_len"])
        prompt = (f"at {est['crossover_output_len']}-token outputs {name(bp['winners'][k - 1])} wins below "
                  f"{bp['crossover_prompt_len']} prompt tokens and {name(bp['winners'][k])} from there")
    if bl["crossover_link_bw"] is not None:
        link = (f"at {est['crossover_prompt_len']}-token prompts disaggregation wins only above "
                f"{num(bl['crossover_link_bw'] / 1e9)} GB/s: at or below it the KV transfer eats the gain")
    elif "disaggregated" in bl["winners"]:
        link = (f"at {est['crossover_prompt_len']}-token prompts disaggregation wins at every link bandwidth tried "
                f"({num(bl['link_bws'][0] / 1e9)} to {num(bl['link_bws'][-1] / 1e9)} GB/s)")
    else:
        link = (f"at {est['crossover_prompt_len']}-token prompts disaggregation wins at no link bandwidth from "
                f"{num(bl['link_bws'][0] / 1e9)} to {num(bl['link_bws'][-1] / 1e9)} GB/s")
    slo = s["slo"]
    return (f"- **{slo_name} SLO** (TTFT {num(slo['ttft_ms'])} ms, TPOT {num(slo['tpot_ms'])} ms): {share}; "
            f"{prompt}; {link}.")


def _answer(de: dict) -> str:
    by = de["estimated"]["by_slo"]
    counts = {k: sum(c["winner"] == "disaggregated" for c in s["grid"]) for k, s in by.items()}
    total = {k: len(s["grid"]) for k, s in by.items()}
    where = "; ".join(f"under the {k} SLO in {counts[k]} of {total[k]} cells" for k in by)
    measured_wins = [c for c in de["measured"] if c["winner"] not in ("tie", "colocated-prefill_first",
                                                                      "colocated-chunked")]
    return (f"**Answer.** In the estimate disaggregation wins {where}. It pays where the TPOT target leaves "
            "colocated steps no room for prompt work (a tight TPOT, long prompts, enough GPUs to split) and the "
            "link is fast enough that moving the KV costs less than the interference it removes; wherever a "
            "decode step has slack, chunked prefill fills it with prompt tokens on the same GPU and wins. "
            f"Measured here, disaggregation won {len(measured_wins)} of {len(de['measured'])} cells.")


def caveats(r: dict, n: int) -> str:
    lines = [f"## {n}. What this run can and cannot show", ""]
    if _cpu(r):
        lines.append("The measured parts ran the small model on a CPU with fake GPUs declared to Ray: all workers "
                     "share this machine's cores, so a disaggregated layout does not get compute of its own as it "
                     "would on separate GPUs, and KV moves over loopback, not NVLink or a network. The GPU numbers "
                     "are roofline estimates from datasheet peaks. Run the lesson on a GPU node (model=llama-3-8b) "
                     "to measure them.")
    else:
        lines.append(f"The measured parts ran on {r['device']}. The estimated map still rests on datasheet peaks "
                     "and a first-order queueing model.")
    lines.append("")
    lines.append(f"This lesson took {num(r['elapsed_s'])} s" + (" in quick mode (reduced grids)." if r["quick"] else "."))
    return "\n".join(lines)


def render(results: dict) -> str:
    title = ["# The lesson: prefill/decode interference, chunked prefill, and when to disaggregate", "",
             f"Model measured: {results['model']} ({results['dtype']}) on {results['device']}. Every number "
             "below comes from this run (`lesson.json`); estimates are marked as such.", ""]
    sections = [why, measured, chunking, when, caveats]
    return "\n".join(title) + "\n" + "\n\n".join(f(results, i) for i, f in enumerate(sections, 1)) + "\n"
