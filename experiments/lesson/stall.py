"""The sections of lesson.md on the stall made visible and chunked prefill as a controlled experiment,
and on what changes on a GPU. Words only, as in text.py: every figure comes from `results`, every
comparison from experiments/serving/compare.py."""
from __future__ import annotations

from experiments.lesson.words import CI, est, find, num
from experiments.serving import compare
from experiments.serving.machine import load_warning


def _label(chunk) -> str:
    return f"chunk {chunk}"


def _row(label: str, r: dict) -> str:
    """A setup's table row; a value that fewer rounds than all gave (an episode with no gap while the
    prompt was in has no stall) says how many it rests on."""
    rounds = r.get("samples") or []

    def c(key):
        n = sum(m.get(key) is not None for m in rounds)
        return compare.with_ci(est("", r[key])) + (f" ({n} of {len(rounds)} rounds)" if n < len(rounds) else "")
    return f"| {label} | {c('stall_ms')} | {c('itl_p99_ms')} | {c('ttft_ms')} | {c('steady_ms')} |"


def controlled(r: dict, n: int) -> str:
    rows, st = r["chunking_controlled"], r["stall"]
    refs = st["refs"]
    small, whole = rows[0], rows[-1]
    link = (f"plus {num(st['link_bw'] / 1e9)} GB/s of link time" if st["link_bw"]
            else "the measured copies only, no link time")
    lines = [
        f"## {n}. The stall, and chunked prefill as a controlled experiment",
        "",
        f"{st['num_decodes']} decode requests run at a steady pace (context {st['context']} at the start) on "
        f"{st['device']}; after {st['lead']} steady steps a {st['prompt_len']}-token prompt arrives at a step "
        f"boundary, and the setups serve it: prefill_first (the prompt alone in one step), chunked at each chunk size "
        "(the decodes and a chunk of the prompt in every step), and disaggregated (the prompt prefilled on a "
        f"separate engine as if on its own device, its KV exported and imported, {link}; the decodes' worker only "
        f"imports it). Each setup runs {st['repeats']} rounds, one episode per round in a rotated order, after a "
        f"warm-up round, and up to {st.get('max_extra', 0)} more while the smallest and the largest chunk's "
        f"intervals overlapped ({st.get('extra_rounds', 0)} run); each setup's time is its own engine's measured "
        "steps, so the setups share one time axis"
        + ("" if st.get("clock", "wall") == "wall" else
           ", timed by this process's CPU time (work, not waiting for a CPU other processes held)") + ". "
        f"The stall is the largest gap between a running decode's tokens while the prompt is in; medians with {CI} "
        "intervals over the rounds (`experiments/lesson/controlled.py`).",
        "",
        "![stall timeline](stall_timeline.png)",
        "",
        "In the timeline each tick is a decode token: under prefill_first the ticks stop for the whole prefill; "
        "small chunks stretch every gap a little for many steps; disaggregated, the ticks run on while the prompt "
        "is prefilled elsewhere.",
        "",
        "![chunking trade-off](chunking_tradeoff.png)",
        "",
        "| setup | stall ms | decode ITL p99 ms (prompt in) | prompt TTFT ms | steady gap ms |",
        "|---|---|---|---|---|",
        *[_row(_label(x["chunk"]), x) for x in rows],
        *[_row(k, v) for k, v in refs.items()],
        "",
        "**Answer.** Both sides of the trade-off, from chunks of "
        f"{small['chunk']} tokens to {whole['chunk']}: "
        + compare.change("the stall", est(_label(small["chunk"]), small["stall_ms"]),
                         est(_label(whole["chunk"]), whole["stall_ms"]), " ms") + "; "
        + compare.change("the prompt's TTFT", est(_label(small["chunk"]), small["ttft_ms"]),
                         est(_label(whole["chunk"]), whole["ttft_ms"]), " ms") + ".",
        "",
    ]
    if "prefill_first" in refs:
        pf = refs["prefill_first"]
        lines.append("Against prefill_first, " + compare.sentence(
            "the stall", [est(_label(small["chunk"]), small["stall_ms"]), est("prefill_first", pf["stall_ms"])],
            " ms"))
    if "disaggregated" in refs:
        d = refs["disaggregated"]
        lines += ["", "Disaggregated, " + compare.sentence(
            "the stall", [est("disaggregated", d["stall_ms"]), est(_label(small["chunk"]), small["stall_ms"])], " ms")
            + " " + compare.sentence("The prompt's TTFT", [est("disaggregated", d["ttft_ms"]),
                                                          est(_label(whole["chunk"]), whole["ttft_ms"])], " ms")]
    if (busy := load_warning(st.get("machine") or {})) is not None:
        lines += ["", f"While these episodes ran: {busy}."]
    return "\n".join(lines)


def _ratio(p: dict) -> str:
    ci = p.get("inflation_ci")
    return f"{num(p['inflation'])}x" + (f" [{num(ci[0])}, {num(ci[1])}]" if ci else "")


def on_gpu(r: dict, n: int) -> str:
    """What changes on a GPU, from the roofline, the interference measured here and the costs the simulation used."""
    rf = r["roofline"]
    b, p, c = rf["mixed"]["batch"], rf["mixed"]["chunk"], rf["context"]
    hw_name, h = list(rf["hardware"].items())[-1]
    d = find(h["points"], f"decode B={b} C={c}")
    m = find(h["points"], f"mixed B={b} C={c} + P={p}")
    pts = r["interference"]["points"]
    big = max((q for q in pts if q["chunk"]), key=lambda q: (q["batch"], q["chunk"]))
    sim = r["decision"]["simulated"]
    here = rf["here"]
    lines = [
        f"## {n}. What changes on a GPU",
        "",
        f"On the {hw_name} the roofline puts a decode step of {b} sequences at {num(d['time_ms'])} ms, "
        f"{d['bound']}-bound (intensity {num(d['intensity'])} FLOP per byte against a ridge of {num(h['ridge'])}), "
        f"and the same step with a {p}-token chunk at {num(m['time_ms'])} ms, {num(m['time_ms'] / d['time_ms'])}x. "
        f"Here ({r['device']}, ridge {num(here['ridge'])} FLOP per byte) the largest measured step, B={big['batch']} "
        f"with P={big['chunk']}, was {_ratio(big)} the decode-only step. What carries over is the shape, not the "
        + ("milliseconds: a memory-bound decode step is paced by reading the weights and the KV cache, so prompt "
           "tokens beside it cost little until the chunk's compute passes that read time, and past that each extra "
           "token stretches every running request's next token. Where that happens follows the ridge: "
           if d["bound"] == "memory" else
           "milliseconds, and at this shape the roofline finds the decode step compute-bound already, so every prompt "
           "token beside it stretches the step. The ridge sets how soon: ")
        + ("here it is lower than the GPU's, so on the GPU a step takes more prompt tokens before it stretches."
           if here["ridge"] < h["ridge"] else
           "here it is no lower than the GPU's, so on the GPU a step stretches at no more prompt tokens than here.")
        + " The transfer also changes: KV moves over NVLink or the network instead of loopback copies, which the "
        f"simulated map prices at {num(sim['link_bw'] / 1e9)} GB/s per link and sweeps over link bandwidth.",
        "",
        f"The GPU numbers in this lesson are {sim['source']}. To measure them instead, run the same command on a GPU "
        "node with the model there (`python -m experiments.lesson model=llama-3-8b`): the measured sections then "
        "run on the GPU and `hardware=measured` profiles its ceilings.",
    ]
    return "\n".join(lines)
