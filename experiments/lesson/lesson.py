"""The lesson: why prefill and decode interfere, how chunked prefill moves token latency, and when to
disaggregate, answered with numbers measured by this run.

    python -m experiments.lesson [overrides]        (quick=true: the reduced version)

Writes lesson.md, its figures, lesson.json (every number the text uses) and, under runs/, the
run directories of the end-to-end measurements (each readable by experiments.report).
"""
from __future__ import annotations

import gc
import json
import logging
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from experiments.analysis import decision_sim
from experiments.lesson import controlled, figures, plots as lesson_plots, rates, text as lesson_text
from experiments.lesson.points import (LessonPoints, chunking_points, decision_points, prepare_points, served_modes,
                                       sim_slos)
from experiments.compose import exit_on_bad_overrides
from experiments.config import CONF_DIR, ConfigError
from experiments.analysis.interference import gap_summary, measure
from experiments.analysis.roofline_cli import roofline_plot
from experiments.serving.machine import snapshot, usage
from experiments.hardware import HARDWARE, HardwareSpec, dtype_bytes_of, operating_points
from experiments.serving.compare import Estimate, best
from experiments.serving.serve import serve_all
from workers.config import preset
from workers.weights import build_model, parse_device, resolve_dtype

log = logging.getLogger("pdlab")
MODES = {"colocated-prefill_first": "colocated prefill_first", "colocated-chunked": "colocated chunked"}


# -- 1. the roofline ----------------------------------------------------------------------------
def roofline_section(cfg: DictConfig, hw_here, mcfg_here, dtype_bytes_here: int, out: Path) -> dict:
    r = cfg.roofline
    mcfg = preset(r.model)
    args = (list(r.prefill_tokens), list(r.decode_batches), r.context, r.mixed.batch, r.mixed.chunk)
    per_hw, pts, timed = {}, [], []
    nbytes = dtype_bytes_of(r.dtype, "roofline.dtype")
    for name in r.hardware:
        hw = HARDWARE[name]
        pts = operating_points(mcfg, hw, nbytes, *args)
        timed, measured = measured_points(mcfg, name, nbytes, pts, r.context)
        per_hw[name] = {"hardware": asdict(hw), "ridge": hw.ridge, "points": [asdict(p) for p in pts],
                        "measured": measured}
    here = operating_points(mcfg_here, hw_here, dtype_bytes_here, *args)
    last = list(r.hardware)[-1]
    roofline_plot(HARDWARE[last], pts, out / "roofline.png",
                               title=f"{mcfg.name} on {last} (circles" + (", measured: crosses" if timed else "")
                                     + f") and {mcfg_here.name} on this device (squares)",
                               extra=[(hw_here, here, "s")], measured=timed)
    return {"model": mcfg.name, "dtype": r.dtype, "context": r.context, "mixed": dict(r.mixed),
            "hardware": per_hw,
            "here": {"model": mcfg_here.name, "hardware": asdict(hw_here), "ridge": hw_here.ridge,
                     "points": [asdict(p) for p in here]}}


def measured_points(mcfg, gpu: str, dtype_bytes: int, pts, context: int) -> tuple[list, dict]:
    """The operating points priced by aiconfigurator's measured database (experiments/sim/gpu_costs.py):
    (points with the measured time and the FLOP/s it implies, {"source", "ms": {step: ms}}), or
    ([], {"source": None, "why": ...}) where the database lacks the GPU or is not installed."""
    from experiments.sim.gpu_costs import choose
    from experiments.sim.stepmodel import chunk_features, roofline_model

    step, why = choose(mcfg, gpu, roofline_model(mcfg, gpu, dtype_bytes), "auto", dtype_bytes=dtype_bytes)
    if why is not None:
        return [], {"source": None, "why": why}
    timed, ms = [], {}
    for p in pts:
        _, *rest = p.step.split()
        b = int(next((x[2:] for x in rest if x.startswith("B=")), 0))
        chunk = int(next((x[2:] for x in rest if x.startswith("P=")), 0))
        t = step.time(chunk_features(b, b * context, [(chunk, 0, True)] if chunk else []))
        ms[p.step] = 1e3 * t
        timed.append(replace(p, time_ms=1e3 * t, achieved_flops=p.flops / t))
    return timed, {"source": step.name, "ms": ms}


# -- 2. interference, measured -------------------------------------------------------------------
def interference_section(cfg: DictConfig, model, hw, device: str, out: Path) -> dict:
    i = cfg.interference
    chunks, dropped = fitting_chunks(list(i.chunks), i.context, model.cfg.max_position_embeddings)
    before = snapshot()
    pts = measure(model, hw, list(i.batches), i.context, chunks, repeats=i.repeats, seed=cfg.seed,
                  max_remeasure=i.max_remeasure)
    machine = usage(before, snapshot())
    lesson_plots.interference_plot(pts, out / "interference.png", device)
    return {"device": device, "hardware": asdict(hw), "context": i.context, "repeats": i.repeats,
            "max_remeasure": i.max_remeasure, "points": [p.to_dict() for p in pts], "gap": gap_summary(pts),
            "machine": machine, "chunks_dropped": dropped}


def fitting_chunks(chunks: list[int], context: int, max_positions: int) -> tuple[list[int], list[int]]:
    """The chunk sizes a model's positions allow beside decodes at `context` (with room for the steps
    measured), and those dropped: the sizes of the config are scaled down to the model this way."""
    room = max_positions - context - 64
    if room < 1:
        raise ValueError(f"interference.context={context} leaves no room for a chunk in {max_positions} positions")
    return [c for c in chunks if c <= room], [c for c in chunks if c > room]


# -- 2b. the stall made visible, and chunked prefill as a controlled experiment ---------------------
def controlled_section(cfg: DictConfig, model, device: str, out: Path) -> tuple[list[dict], dict]:
    """(`chunking_controlled`: one row per chunk size, `stall`: the setting, the references and the
    timeline) from experiments/lesson/controlled.py."""
    c = cfg.chunking_controlled
    chunks = [ch if ch == controlled.WHOLE else int(ch) for ch in c.chunks]
    before = snapshot()
    res = controlled.run(model, chunks, c.num_decodes, c.context, c.prompt_len, c.repeats, c.lead, c.tail,
                         float(c.link_bw), cfg.seed, clock=c.get("clock", "wall"),
                         max_extra=int(c.get("max_extra", 0)))
    machine = usage(before, snapshot())
    rows = [{"chunk": r["chunk"], **{k: r[k] for k in ("stall_ms", "ttft_ms", "itl_p99_ms", "steady_ms")},
             "samples": r["samples"]} for r in res["rows"] if r["policy"] == "chunked"]
    refs = {r["setup"]: {k: r[k] for k in ("stall_ms", "ttft_ms", "itl_p99_ms", "steady_ms", "samples")}
            for r in res["rows"] if r["policy"] != "chunked"}
    shown = [name for name in ("prefill_first", f"chunk {chunks[0]}",
                               f"chunk {chunks[len(chunks) // 2]}" if len(chunks) > 2 else f"chunk {chunks[-1]}",
                               "disaggregated") if name in res["timeline"]]
    timeline = {name: res["timeline"][name] for name in dict.fromkeys(shown)}
    figures.timeline_plot(timeline, out / "stall_timeline.png",
                          f"{c.num_decodes} decodes running at context {c.context} while a {c.prompt_len}-token "
                          f"prompt arrives ({model.cfg.name} on {device}; the median round)")
    figures.tradeoff_plot(res["rows"], out / "chunking_tradeoff.png",
                          "Chunk size trades the decodes' stall against the prompt's TTFT "
                          f"({res['repeats'] + res['extra_rounds']} rounds, median and 95% interval)")
    stall = {k: res[k] for k in ("num_decodes", "context", "prompt_len", "repeats", "lead", "tail", "link_bw", "clock",
                                  "max_extra", "extra_rounds", "renewed")}
    stall |= {"device": device, "refs": refs, "timeline": timeline, "machine": machine}
    return rows, stall


# -- serving points through the run machinery ---------------------------------------------------
def serve(cfg: DictConfig, names: list[str], prepared: list) -> dict[str, dict]:
    """Serve the prepared points (points.prepare_points: one per name) exactly as `python -m experiments.run`
    would (same code, same files), all of them `cfg.repeats` times round-robin; returns each one's summary."""
    out = {}
    simulated = {p.spec.backend for p in prepared} == {"sim"}
    if simulated:                           # as experiments.run does: one simulated repeat, no Ray
        from experiments.sim.backend import simulate_repeat
    results = serve_all(prepared, 1, simulate_repeat) if simulated else serve_all(prepared, cfg.repeats)
    for name, result in zip(names, results):
        if "error" in result:
            raise RuntimeError(f"{result['point'].get('label', name)}: {result['error']}")
        out[name] = summary(result)
    return out


def summary(metrics: dict) -> dict:
    keep = ("goodput", "goodput_per_gpu", "slo_attainment", "num_completed", "num_submitted", "duration_s",
            "step_ratio", "ci", "machine")
    out = {k: metrics.get(k) for k in keep}
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        out[key] = metrics[key]
    out["label"] = metrics["point"]["label"]
    out["repeats"] = (metrics.get("repeats") or {}).get("num_ok", 1)
    return out


# -- 3. chunked prefill and token latency --------------------------------------------------------
def chunking_section(cfg: DictConfig, prepared: list, runs: Path, out: Path) -> tuple[dict, dict]:
    """(the end-to-end chunking comparison, the measured goodput against rate): served together, round-robin."""
    c, g = cfg.chunking, cfg.goodput_vs_rate.measured
    named, alias, curve_rates = chunking_points(cfg)
    served = serve(cfg, list(named), prepared)
    chunked = [{"chunk": size, **served[f"chunked_{size}"]} for size in c.chunk_sizes]
    refs = {k: served[k] for k in ("prefill_first", "disaggregated")}
    lesson_plots.chunking_plot(chunked, refs, out / "chunking.png")
    curves = rates.measured_curves({k: served[v] for k, v in alias.items()}, list(served_modes(cfg)), curve_rates,
                                   float(cfg.slo.attainment_target), cfg.gpus)
    curves |= {"workload": c.workload, "num_requests": c.num_requests, "repeats": cfg.repeats,
               "runs": {k: str(runs / v) for k, v in alias.items()}}
    colo = f"chunked_{g.chunk}" if f"chunked_{g.chunk}" in named else "prefill_first"
    curves["breakdown"] = rates.measured_against(rates.run_rows(runs / "disaggregated"), rates.run_rows(runs / colo),
                                                 seed=cfg.seed)
    curves["breakdown"] |= {"rate": c.rate, "colocated_point": colo}
    return ({"workload": c.workload, "rate": c.rate, "num_requests": c.num_requests, "repeats": cfg.repeats,
             "prompt_len": c.get("prompt_len"), "output_len": c.get("output_len"), "chunked": chunked, "refs": refs},
            curves)


# -- 4. when to disaggregate ---------------------------------------------------------------------
def decision_section(cfg: DictConfig, points: LessonPoints, out: Path) -> dict:
    m, e = cfg.decision.measured, cfg.decision.simulated
    named, layouts = decision_points(cfg)
    served = serve(cfg, list(named), points.decision) if named else {}
    measured = []
    for lp in m.prompt_lens:
        for lo in m.output_lens:
            modes = {lay: served[f"p{lp}_o{lo}/{lay}"] for lay in layouts}
            measured.append({"prompt_len": lp, "output_len": lo, "modes": modes, "winner": _winner(modes)})
    mcfg, hw, base = preset(e.model), HARDWARE[e.hardware], points.base
    started = time.time()
    simulated = decision_sim.simulated_map(
        base, e.gpus, list(e.prompt_lens), list(e.output_lens), sim_slos(e, base), e.link_bw,
        list(e.link_bws), e.crossover_output_len, e.crossover_prompt_len, list(e.chunks), e.requests_per_worker,
        e.steps, e.stream)
    cells = [c for s in simulated.values() for c in s["grid"]]
    simulated_elapsed = time.time() - started
    lesson_plots.decision_plot(simulated, measured, out / "decision.png",
                               title=f"{mcfg.name} on {hw.name}, {e.gpus} GPUs, KV link {e.link_bw / 1e9:g} GB/s")
    figures.link_plot(simulated, out / "decision_link.png",
                      f"Winner over link bandwidth at {e.crossover_prompt_len}-token prompts and "
                      f"{e.crossover_output_len}-token outputs ({mcfg.name} on {e.gpus} {hw.name}, KV {e.stream})")
    return {"measured": measured, "measured_gpus": cfg.gpus, "measured_rate": m.rate,
            "simulated": {"model": mcfg.name, "hardware": hw.name, "gpus": e.gpus, "link_bw": e.link_bw,
                          "stream": e.stream, "source": cells[0]["source"] if cells else None,
                          "elapsed_s": simulated_elapsed, "num_sims": sum(c["num_sims"] for c in cells),
                          "crossover_output_len": e.crossover_output_len,
                          "crossover_prompt_len": e.crossover_prompt_len, "by_slo": simulated}}


def rate_curves_simulated(cfg: DictConfig, points: LessonPoints, out: Path, measured: dict | None) -> dict:
    """Goodput against rate at GPU scale (experiments/lesson/rates.py), on the decision map's GPUs and link."""
    e, g = cfg.decision.simulated, cfg.goodput_vs_rate.simulated
    base, slo = points.base, points.slo
    layouts = [{"layout": lay.layout, "chunk": lay.get("chunk")} for lay in g.layouts]
    started = time.time()
    sim = rates.simulated_curves(base, e.gpus, g.prompt_len, g.output_len, slo, e.link_bw, e.stream, layouts,
                                 list(g.rates_per_gpu), g.requests_per_worker, g.breakdown_rate_per_gpu, cfg.seed)
    sim |= {"slo_name": g.slo, "model": e.model, "hardware": e.hardware, "elapsed_s": time.time() - started}
    colo = next((c for c in sim["curves"] if c["layout"] == "colocated-chunked"), sim["curves"][0])
    splits = [c for c in sim["curves"] if not c["layout"].startswith("colocated")]
    if splits:
        top = max(splits, key=lambda c: (c["last_met"] or 0.0))
        sim["breakdown"] = rates.against(top["breakdown"], colo["breakdown"]) | {
            "disaggregated_layout": top["name"], "colocated_layout": colo["name"], "rate_per_gpu": g.breakdown_rate_per_gpu}
    if points.emulated:                     # the curve's rate served on emulated engines beside the simulator
        names = list(cfg.goodput_vs_rate.emulated.layouts)
        served = serve(cfg, names, points.emulated)
        sim["emulated"] = rates.emulated_rows({n: p.out for n, p in zip(names, points.emulated)}, served)
    figures.goodput_rate_plot(
        sim, measured, out / "goodput_vs_rate.png",
        (f"simulated: {e.model} on {e.gpus} {e.hardware}, prompt {g.prompt_len}, output {g.output_len}, {g.slo} SLO",
         f"measured here: {cfg.model.name} on {cfg.gpus} workers, workload {cfg.chunking.workload}"))
    bars = []
    for tag, b in (("simulated", sim.get("breakdown")), ("measured", (measured or {}).get("breakdown"))):
        if b:
            bars += [(f"{tag}: {b.get('disaggregated_layout', 'disaggregated')}", b["disaggregated"]),
                     (f"{tag}: {b.get('colocated_layout', b.get('colocated_point', 'colocated'))}", b["colocated"])]
    figures.breakdown_plot(bars, out / "breakdown.png", "Where a request's time goes: disaggregated against colocated")
    return sim


def _winner(modes: dict) -> str:
    """The layout whose goodput per GPU interval lies above every other's; "tie" when none does."""
    ests = [Estimate(lay, m["goodput_per_gpu"], tuple(ci) if (ci := (m.get("ci") or {}).get("goodput_per_gpu"))
                     else None) for lay, m in modes.items()]
    return best(ests) or "tie"


def _plain(x):
    return json.loads(json.dumps(x, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)))


# -- the command ---------------------------------------------------------------------------------
def run(cfg: DictConfig, out: Path) -> dict:
    if cfg.quick:
        cfg = OmegaConf.merge(cfg, cfg.quick_overrides)
    runs = out / "runs"
    points = prepare_points(cfg, runs)
    started = time.time()
    device = parse_device(cfg.model.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    hw = HardwareSpec(**OmegaConf.to_container(cfg.hardware, resolve=True)).resolve()
    model = build_model(model=None if cfg.model.checkpoint else cfg.model.name, checkpoint=cfg.model.checkpoint,
                        dtype=dtype, device=device, seed=cfg.seed)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU with {torch.get_num_threads()} threads"
    results = {"device": where, "model": model.cfg.name, "dtype": str(dtype).removeprefix("torch."),
               "quick": bool(cfg.quick), "gpus": cfg.gpus}
    took = results["section_s"] = {}          # each section's seconds: where a lesson's time goes

    @contextmanager
    def section(n: int, key: str, title: str):
        print(f"{n}/6 {title}")
        t = time.time()
        yield
        took[key] = round(time.time() - t, 1)

    with section(1, "roofline", f"roofline of {cfg.roofline.model} and of {model.cfg.name} on {hw.name}"):
        results["roofline"] = roofline_section(cfg, hw, model.cfg, model.embed_tokens.element_size(), out)
    with section(2, "interference", f"interference measured on {where}"):
        results["interference"] = interference_section(cfg, model, hw, where, out)
    with section(3, "chunking_controlled", f"the stall and chunked prefill, controlled, on {where}"):
        results["chunking_controlled"], results["stall"] = controlled_section(cfg, model, where, out)
    del model                               # the served workers load their own: free this one's device memory
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with section(4, "chunking", "chunked prefill end to end, and goodput against rate, served here"):
        results["chunking"], measured = chunking_section(cfg, points.chunking, runs / "chunking", out)
    with section(5, "goodput_vs_rate", "goodput against rate at GPU scale, simulated"):
        results["goodput_vs_rate"] = {"measured": measured,
                                      "simulated": rate_curves_simulated(cfg, points, out, measured)}
    with section(6, "decision", "the decision map, simulated"):
        results["decision"] = decision_section(cfg, points, out)
    print("seconds by section: " + ", ".join(f"{k} {v:g}" for k, v in took.items()))
    results["elapsed_s"] = time.time() - started
    (out / "lesson.json").write_text(json.dumps(_plain(results), indent=2))
    (out / "lesson.md").write_text(lesson_text.render(_plain(results)))
    return results


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="lesson")
def main(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    logging.getLogger("pdlab").setLevel(logging.INFO)
    try:
        results = run(cfg, out)
    except (ConfigError, ValueError) as e:
        print(f"config error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    print(f"lesson: {out / 'lesson.md'} ({results['elapsed_s']:.0f} s)")
    print(json.dumps({"lesson": str(out / "lesson.md"), "elapsed_s": round(results["elapsed_s"], 1),
                      "quick": results["quick"], "device": results["device"]}))


if __name__ == "__main__":
    exit_on_bad_overrides("lesson")
    main()
