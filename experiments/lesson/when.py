"""The section of lesson.md on when to disaggregate: the measured cells (a winner only where its goodput
interval lies above every other's) and the simulated map (experiments/analysis/decision_sim.py: the
planner's search in the simulator, with the costs each cell names). Words only, as in text.py."""
from __future__ import annotations

from experiments.lesson.words import CI, cell, est, name, num
from experiments.serving import compare
from experiments.serving.compare import Estimate


def when(r: dict, n: int) -> str:
    de = r["decision"]
    est = de["simulated"]
    lines = [f"## {n}. When to disaggregate", "", *rate_lines(r), "![decision](decision.png)", ""]
    if de["measured"]:
        layouts = list(de["measured"][0]["modes"])
        head = "| prompt | output | " + " | ".join(f"{name(lay)} goodput/GPU" for lay in layouts) + " | winner |"
        rows = [f"| {c['prompt_len']} | {c['output_len']} | " +
                " | ".join(cell(c["modes"][lay], "goodput_per_gpu") for lay in layouts) + f" | {name(c['winner'])} |"
                for c in de["measured"]]
        lines += [f"**Measured here** ({r['model']}, {de['measured_gpus']} workers per layout, "
                  f"{num(de['measured_rate'])} requests/s, the lesson's SLO; goodput per GPU as median [{CI} "
                  "interval]; a winner only where its interval lies above every other's):", "",
                  head, "|" + "---|" * (len(layouts) + 3), *rows, ""]
    else:
        lines += ["**Measured here:** no cell in this run (quick mode measures none).", ""]
    lines += [
        f"**Simulated** for {est['model']} on {est['hardware']} with {est['gpus']} GPUs and a "
        f"{num(est['link_bw'] / 1e9)} GB/s KV link, every cell {est['source']} "
        "(`experiments/analysis/decision_sim.py`: the planner's search in the simulator, running pdlab's scheduler, "
        "block manager and router; a mode's goodput per GPU is the highest rate at which the share of requests within "
        f"both SLOs meets the attainment target, so tails, queueing, batching and preemption count; {est['num_sims']} "
        f"simulations in {num(est['elapsed_s'])} s). " + _steps_text(est.get("source") or "")
        + STREAM_TEXT.get(est.get("stream", "off"), ""),
        "",
    ]
    lines += ["![decision over link bandwidth](decision_link.png)", "",
              "A thick edge in either figure is a crossover. The cell at the map's link bandwidth is one simulation "
              "that both figures read, so the map and the strip agree on it.", ""]
    for slo_name, s in est["by_slo"].items():
        lines += [_map_paragraph(slo_name, s, est), ""]
    lines.append(_answer(de, r.get("goodput_vs_rate"), r.get("chunking"), r.get("stall")))
    return "\n".join(lines)


def _steps_text(source: str) -> str:
    if "aiconfigurator" in source:
        return ("The step times are NVIDIA's measured per-operation times on that GPU (aiconfigurator-core's "
                "database, composed into steps by `experiments/sim/gpu_costs.py`); the host gap between steps, "
                "the messages and the KV link are assumptions `experiments/sim/costs.py` states. ")
    return ("The step times are the roofline's at the efficiencies `experiments/sim/stepmodel.py` states, not a "
            "measurement on that GPU (aiconfigurator-core, a dependency, prices the GPUs it has measured). ")


STREAM_TEXT = {
    "off": "The KV moves after the prefill, so all of the transfer delays the second token.",
    "layer": ("The KV streams layer by layer as the prefill computes it, so only the exposed transfer delays the "
              "second token: the last layer's share while the link keeps up with the compute, more when it does "
              "not (the link's capacity is the same in both modes)."),
}


def _link_saving(prompt_len: int, least: dict | None) -> str:
    """What overlap saves in link bandwidth: the least link bandwidth tried at which disaggregation wins,
    per stream mode (experiments/analysis/decision_sim.py)."""
    if not least:
        return ""
    off, layer = least.get("off"), least.get("layer")
    at = f"at {prompt_len}-token prompts"
    if off is None and layer is None:
        return f"; {at} disaggregation wins at no link bandwidth whether the KV streams or not"
    if off is None:
        return (f"; {at} disaggregation wins only when the KV streams layer by layer, from "
                f"{num(layer / 1e9)} GB/s, and at no bandwidth when it follows the prefill")
    if layer is None:
        return f"; {at} disaggregation wins from {num(off / 1e9)} GB/s with the KV after the prefill only"
    if abs(off / layer - 1) < 0.02:
        return f"; {at} it needs {num(off / 1e9)} GB/s either way: streaming saves no link bandwidth here"
    return (f"; {at} it needs {num(off / 1e9)} GB/s with the KV sent after the prefill and {num(layer / 1e9)} GB/s "
            f"streamed layer by layer: overlap lets a link {num(off / layer)}x slower do")


def _runs(bp: dict) -> list[dict]:
    """Stretches of one winner along prompt length (for results written before decision_sim kept them)."""
    runs: list[dict] = []
    for lp, w in zip(bp["prompt_lens"], bp["winners"]):
        if runs and runs[-1]["winner"] == w:
            runs[-1]["to"] = lp
        else:
            runs.append({"winner": w, "from": lp, "to": lp})
    return runs


def _wins(cells: list[dict]) -> dict:
    wins: dict = {}
    for c in cells:
        wins[c["winner"]] = wins.get(c["winner"], 0) + 1
    return wins


def _map_paragraph(slo_name: str, s: dict, est: dict) -> str:
    cells = s["grid"]
    share = ", ".join(f"{name(k)} {v} of {len(cells)} cells"
                      for k, v in sorted(_wins(cells).items(), key=lambda kv: -kv[1]))
    bp, bl = s["by_prompt"], s["by_link"]
    runs = bp.get("runs") or _runs(bp)
    at = f"at {est['crossover_output_len']}-token outputs"
    if len(runs) == 1:
        prompt = (f"{at} {name(runs[0]['winner'])} wins at every prompt length from {bp['prompt_lens'][0]} to "
                  f"{bp['prompt_lens'][-1]} (no crossover)")
    elif len(runs) == 2:
        prompt = (f"{at} {name(runs[0]['winner'])} wins below {runs[1]['from']} prompt tokens and "
                  f"{name(runs[1]['winner'])} from there")
    else:
        spans = ", ".join(f"{name(r['winner'])} at {r['from']}" + ("" if r["to"] == r["from"] else f"-{r['to']}")
                          for r in runs)
        prompt = f"{at} the winner changes {len(runs) - 1} times along prompt length: {spans} prompt tokens"
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
    return (f"- **{slo_name} SLO** (TTFT {num(slo['ttft_ms'])} ms, TPOT {num(slo['tpot_ms'])} ms{_tpot_from(slo)}): {share}; "
            f"{prompt}; {link}{_link_saving(est['crossover_prompt_len'], s.get('least_link_bw'))}.")


def _tpot_from(slo: dict) -> str:
    """How a TPOT preset was set from the hardware (decision_sim.resolve_slos), or nothing where it was given."""
    if "tpot_x_decode" not in slo:
        return ""
    ref = slo["decode_ref"]
    return (f", {num(slo['tpot_x_decode'])}x the {ref['batch']}-sequence decode step at {ref['context']} tokens "
            f"of {num(slo['decode_ref_ms'])} ms")


def _answer(de: dict, rates: dict | None = None, chunking: dict | None = None, stall: dict | None = None) -> str:
    by = de["simulated"]["by_slo"]
    counts = {k: sum(c["winner"] == "disaggregated" for c in s["grid"]) for k, s in by.items()}
    total = {k: len(s["grid"]) for k, s in by.items()}
    where = "; ".join(f"under the {k} SLO in {counts[k]} of {total[k]} cells" for k in by)
    most = max(counts, key=counts.get)
    if len(set(counts.values())) > 1:
        tpot = by[most]["slo"]["tpot_ms"]
        tighter = all(tpot <= s["slo"]["tpot_ms"] for s in by.values())
        why_text = (f" It wins most under the {most} SLO, " +
                    ("the tightest TPOT target: there a colocated step has the least room for prompt work beside "
                     "its decodes." if tighter else "which is not the tightest TPOT target."))
    else:
        why_text = " The SLOs make no difference to how often it wins."
    measured = de["measured"]
    wins = [c for c in measured if c["winner"] not in ("tie", "colocated-prefill_first", "colocated-chunked")]
    ties = [c for c in measured if c["winner"] == "tie"]
    here = (f" Measured here, disaggregation won {len(wins)} of {len(measured)} cells; {len(ties)} had no "
            "significant winner." if measured else " No decision cell was measured here in this run.")
    served = _stall_against_colocated(stall) + _against_colocated(chunking) + _at_load(rates)
    return f"**Answer.** In the simulation disaggregation wins {where}.{why_text}{here}{served}"


def _stall_against_colocated(st: dict | None) -> str:
    """The controlled experiment's measured case for disaggregating: the stall the running
    decodes see and the prompt's TTFT, disaggregated against colocated prefill_first, from their intervals."""
    refs = (st or {}).get("refs") or {}
    if "disaggregated" not in refs or "prefill_first" not in refs:
        return ""
    pair = [("disaggregated", refs["disaggregated"]), ("colocated prefill_first", refs["prefill_first"])]
    said = [compare.sentence(metric, [est(k, m[key]) for k, m in pair], " ms")
            .removesuffix(".") for metric, key in (("the running decodes' stall", "stall_ms"),
                                                    ("the prompt's TTFT", "ttft_ms"))]
    return " Measured in the controlled experiment above, " + "; ".join(said) + "."


def _against_colocated(ch: dict | None) -> str:
    """What disaggregation bought and cost on the same workers and requests, measured (the chunking
    comparison's runs): its decode ITL p99 and TTFT p50 against colocated prefill_first's, from their
    intervals."""
    refs = (ch or {}).get("refs") or {}
    if "disaggregated" not in refs or "prefill_first" not in refs:
        return ""
    dis, pf = refs["disaggregated"], refs["prefill_first"]
    pair = [("disaggregated", dis), ("colocated prefill_first", pf)]
    said = [compare.sentence(metric, [compare.estimate(k, m, key) for k, m in pair], " ms").removesuffix(".")
            for metric, key in (("decode ITL p99", "itl_ms.p99"), ("TTFT p50", "ttft_ms.p50"))]
    return (f" Served here on the same workers and requests ({num(ch['rate'])} requests/s, the chunked prefill "
            "end-to-end runs), " + "; ".join(said) + ".")


def _at_load(rates: dict | None) -> str:
    """The measured rate curves, rate by rate: each mode's SLO attainment with its interval, and which
    modes differ (where the intervals separate)."""
    curves = ((rates or {}).get("measured") or {}).get("curves") or []
    if not curves:
        return ""
    parts = []
    for i, rate in sorted(enumerate(curves[0]["rates"]), key=lambda x: x[1]):
        ests = [Estimate(c["name"], None if c["attainment"][i] is None else c["attainment"][i] * 100,
                         tuple(x * 100 for x in c["attainment_ci"][i]) if c["attainment_ci"][i] else None)
                for c in curves]
        workers = round(rate / curves[0]["rates_per_gpu"][i])
        parts.append(f"at {num(rate)} requests/s on {workers} workers " +
                     compare.sentence("SLO attainment", ests, "%").removesuffix("."))
    return " Served here, " + "; ".join(parts) + "."


def _knee(c: dict, unit: str) -> str:
    if c["falls_below"] is None:
        return f"{c['name']} meets the target at every rate tried (up to {num(c['rates_per_gpu'][-1])}{unit})"
    if c["last_met"] is None:
        return f"{c['name']} misses it already at {num(c['falls_below'])}{unit}"
    return f"{c['name']} meets it up to {num(c['last_met'])}{unit} and falls below at {num(c['falls_below'])}{unit}"


def _over(b: dict) -> str:
    return f"; {CI} intervals over " + ("repeats and requests" if b.get("repeats", 1) > 1 else "requests (one repeat)")


def _breakdown(b: dict | None, where: str) -> str:
    from experiments.lesson.rates import PART_NAMES, PARTS

    if not b or b.get("extra_ms") is None:
        return f"{where}: no breakdown (no completed request on one side)."
    d, co, extra, ci = b["disaggregated"], b["colocated"], b["extra_ms"], b.get("extra_ci")

    def grew(p):
        return compare.with_ci(Estimate(p, extra[p], ci[p] if ci else None), digits=None)
    parts = ", ".join(f"{PART_NAMES[p]} {num(d['mean_ms'][p])} ({grew(p)} against colocated)" for p in PARTS)
    total, total_ci = b["total_extra_ms"], b.get("total_extra_ci")
    span = f"{CI} interval of the difference [{num(total_ci[0])}, {num(total_ci[1])}] ms" if total_ci else ""
    if not ci:                                  # one simulation: its own numbers, no interval
        slower = f"{num(abs(total))} ms {'more' if total > 0 else 'less'}"
    elif total_ci and (total_ci[0] > 0 or total_ci[1] < 0):
        slower = f"{num(abs(total))} ms {'more' if total > 0 else 'less'}, {span}"
    else:
        slower = f"no different: {num(total)} ms, {span or 'no interval'}"
    if b["grew_most"] is not None:
        most = f"the part that grew most against colocated is **{PART_NAMES[b['grew_most']]}**"
    else:
        most = ("the part that grew most against colocated cannot be told apart among "
                f"{compare.listed([PART_NAMES[p] for p in b['grew_most_among']])} ({CI} intervals of their difference "
                "include zero)")
    return (f"{where}: a disaggregated request took {num(d['total_ms'])} ms on average against {num(co['total_ms'])} ms "
            f"colocated ({slower}, means over {d['num_requests']} and "
            f"{co['num_requests']} requests{_over(b) if ci else ''}): {parts} ms. "
            f"Its largest part is {PART_NAMES[d['dominant']]}; before the decode steps, "
            f"{PART_NAMES[d['dominant_before_decode']]}; {most}.")


def most_load(curves: list[dict]) -> str:
    """Which modes carry the most load within the target: every mode tied at the highest rate met is
    named (on a grid of rates, modes that meet the same rate are not told apart)."""
    top = max((c["last_met"] or 0.0) for c in curves)
    if not top:
        return "No mode meets the target at any rate tried."
    tied = [c["name"] for c in curves if (c["last_met"] or 0.0) == top]
    if len(tied) == len(curves):
        return (f"Every mode meets the target up to {num(top)} requests/s per GPU: on these rates no mode "
                "carries more load than another.")
    return f"The most load within the target on these GPUs: {' and '.join(tied)}, up to {num(top)} requests/s per GPU."


def rate_lines(r: dict) -> list[str]:
    """Goodput against rate (measured here and simulated at GPU scale) and the breakdown of a request's time."""
    g = r.get("goodput_vs_rate")
    if not g:
        return []
    sim, meas = g["simulated"], g["measured"]
    lines = ["![goodput against rate](goodput_vs_rate.png)", ""]
    lines.append(
        f"**Goodput against rate, simulated** for {sim['model']} on {sim['gpus']} {sim['hardware']} GPUs ({sim['costs']}), "
        f"prompts of {sim['prompt_len']} and outputs of {sim['output_len']} tokens, the {sim['slo_name']} SLO (TTFT "
        f"{num(sim['slo']['ttft_ms'])} ms, TPOT {num(sim['slo']['tpot_ms'])} ms), target {sim['target']:.0%} of requests "
        f"within both, a rate met only if the cluster also kept up ({sim['num_sims']} simulations): "
        + "; ".join(_knee(c, " requests/s per GPU") for c in sim["curves"]) + ".")
    lines += ["", most_load(sim["curves"])]
    if sim.get("emulated"):
        lines += ["", emulated_lines(sim["emulated"])]
    if meas and meas["curves"]:
        def at(c):
            return ", ".join(
                f"at {num(rate)}/s {compare.with_ci(Estimate('', a * 100, tuple(x * 100 for x in ci) if ci else None))}%"
                for rate, a, ci in zip(c["rates_per_gpu"], c["attainment"], c["attainment_ci"]) if a is not None)
        lines += ["", f"**Measured here** ({r['model']}, {meas['gpus']} workers per mode, workload {meas['workload']}, "
                      f"{meas['num_requests']} requests a point, {meas['repeats']} repeat(s); rates per worker, SLO attainment "
                      f"as median [{CI} interval]): " + "; ".join(f"{c['name']}: {at(c)}" for c in meas["curves"]) + ". "
                  + "; ".join(_knee(c, " requests/s per worker") for c in meas["curves"]) + "."]
    lines += ["", "![breakdown](breakdown.png)", "",
              "**Why was disaggregation slower (or faster) here?** " +
              _breakdown(sim.get("breakdown"), f"Simulated at {num(sim['breakdown_rate_per_gpu'])} requests/s per "
                         f"GPU, {(sim.get('breakdown') or {}).get('disaggregated_layout')} against "
                         f"{(sim.get('breakdown') or {}).get('colocated_layout')}")]
    if meas and meas.get("breakdown"):
        mb = meas["breakdown"]
        lines += ["", _breakdown(mb, f"Measured here at {num(mb['rate'])} requests/s against {mb['colocated_point']}")]
    return lines + [""]


def emulated_lines(rows: list[dict]) -> str:
    """The simulated curve's rate served on emulated engines (docs/emulation.md) beside the simulator on the
    same requests: the real router, scheduler and KV wire at GPU time, against their model."""
    head = ("**Served in emulation** at " + f"{num(rows[0]['rate_per_gpu'])} requests/s per GPU "
            f"({rows[0]['num_requests']} requests, {rows[0]['gpus']} emulated GPUs: pdlab's router, scheduler and KV "
            "wire, each step waiting for its price under the same costs), beside the simulator on the same requests:")
    table = ["| layout | SLO attainment, simulated | emulated | TTFT p50 ms, simulated | emulated | "
             "TPOT p50 ms, simulated | emulated |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        s, e = r["simulated"], r["emulated"]
        table.append(f"| {r['layout']} | {s['slo_attainment']:.0%} | {e['slo_attainment']:.0%} | "
                     f"{num(s['ttft_p50_ms'])} | {num(e['ttft_p50_ms'])} | {num(s['tpot_p50_ms'])} | "
                     f"{num(e['tpot_p50_ms'])} |")
    return "\n".join([head, "", *table])
