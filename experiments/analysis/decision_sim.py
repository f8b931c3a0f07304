"""The decision map simulated: which mode gives the most goodput per GPU over prompt x output length
and link bandwidth, with P90 attainment, tails, batching and preemption, by the planner's search.

Each cell is one workload of fixed prompt and output lengths (Poisson arrivals) on `gpus` GPUs of a
datasheet GPU or a profiled device (the `hardware` group; experiments/sim/costs.py says which and
with what efficiencies), every KV transfer over a link of `link_bw` (each GPU a node of its own, so
the map's link is the one crossed). experiments/analysis/plan.py finds each layout's goodput per GPU
at the attainment target: colocated prefill_first, colocated chunked at each chunk size, every P:D
split. A mode's value is its best layout's; the winner is decision.best's (within 5%, the simpler
mode; "none" where no mode meets the target at any rate). Every cell carries `source`: the costs it was simulated with.
"""
from __future__ import annotations

import math

from omegaconf import DictConfig, OmegaConf

from experiments.analysis.decision import MODES, ModeEstimate, best
from experiments.analysis.plan import plan
from experiments.config import ConfigError, apply_layout, parse
from experiments.sim.backend import costs_for
from experiments.sim.stepmodel import chunk_features
from experiments.progress import Progress

STREAMS = ("off", "layer")        # compared over links: the KV after the prefill, or layer by layer
MODE_OF = {"colocated-prefill_first": MODES[0], "colocated-chunked": MODES[1]}


def decode_step_ms(base: DictConfig, batch: int, context: int) -> float:
    """A decode-only step of `batch` sequences at `context` tokens each, with its host gap, as the
    hardware's costs price it (the step the SLO presets are set from)."""
    costs = costs_for(parse(apply_layout(base, "colocated-chunked")))
    return 1e3 * (costs.step.time(chunk_features(batch, batch * context, [])) + costs.step.gap(batch))


def resolve_slos(base: DictConfig, slos: dict, decode_ref: dict) -> dict:
    """SLOs in milliseconds: a `tpot_x_decode` is that multiple of the decode-only step of
    decode_ref's batch at its context (decode_step_ms), so a preset follows what the hardware can
    reach; `tpot_ms` is taken as given. Each resolved SLO keeps how its TPOT was set."""
    out, ref_ms = {}, None
    for name, slo in slos.items():
        slo = dict(slo)
        if ("tpot_ms" in slo) == ("tpot_x_decode" in slo):
            raise ConfigError(f"decision.simulated.slos.{name}: give one of tpot_ms or tpot_x_decode, not "
                              f"{'both' if 'tpot_ms' in slo else 'neither'}")
        if "tpot_x_decode" in slo:
            if not slo["tpot_x_decode"] >= 1:
                raise ConfigError(f"decision.simulated.slos.{name}.tpot_x_decode={slo['tpot_x_decode']}: must be "
                                  ">= 1 (a TPOT below the decode step it is set from cannot be met)")
            if ref_ms is None:
                ref_ms = decode_step_ms(base, int(decode_ref["batch"]), int(decode_ref["context"]))
            slo |= {"tpot_ms": round(slo["tpot_x_decode"] * ref_ms, 2), "decode_ref_ms": ref_ms,
                    "decode_ref": {"batch": int(decode_ref["batch"]), "context": int(decode_ref["context"])}}
        out[name] = slo
    return out


def cell_config(base: DictConfig, prompt_len: int, output_len: int, slo: dict, link_bw: float,
                stream: str = "off") -> DictConfig:
    cfg = OmegaConf.create(OmegaConf.to_container(base, resolve=True))
    cfg.workload = OmegaConf.merge(cfg.workload, {
        "name": "fixed", "arrival": "poisson", "length_scale": 1.0, "trace": None,
        "prompt_len": {"dist": "fixed", "value": prompt_len, "min": 1, "max": None},
        "output_len": {"dist": "fixed", "value": output_len, "min": 1, "max": None}})
    cfg.slo.ttft_ms, cfg.slo.tpot_ms = float(slo["ttft_ms"]), float(slo["tpot_ms"])
    cfg.hardware.link_bw, cfg.hardware.gpus_per_node = float(link_bw), 1
    cfg.transfer.stream = stream
    cfg.compare, cfg.layout = None, None
    return cfg


def simulate_cell(base: DictConfig, gpus: int, prompt_len: int, output_len: int, slo: dict, link_bw: float,
                  chunks: list[int], requests_per_worker: int, steps: int, stream: str = "off",
                  shared: dict | None = None) -> dict:
    """{prompt_len, output_len, winner, modes: {mode: {goodput_per_gpu, layout}}, source, num_sims};
    `shared`: simulations of other cells to reuse (experiments/analysis/plan.py)."""
    result = plan(cell_config(base, prompt_len, output_len, slo, link_bw, stream), gpus, chunks, probe=2,
                  requests_per_worker=requests_per_worker, steps=steps, verify_requests_per_gpu=20, shared=shared)
    modes: dict[str, dict] = {}
    checked = {c.name: c for c in (result["best"], result["runner_up"]) if c is not None}
    for c in (checked.get(c.name, c) for c in result["candidates"]):   # a layout checked at full scale: that value
        mode = MODE_OF.get(c.layout, MODES[2])
        if mode not in modes or c.goodput_per_gpu > modes[mode]["goodput_per_gpu"]:
            modes[mode] = {"goodput_per_gpu": c.goodput_per_gpu, "layout": c.name, "how": c.how}
    ests = [ModeEstimate(m, v["goodput_per_gpu"], math.nan, math.nan, {}) for m, v in modes.items()]
    top = best(ests)
    return {"prompt_len": prompt_len, "output_len": output_len,
            "winner": top.mode if top.goodput_per_gpu > 0 else "none", "modes": modes,
            "source": f"simulated with {result['costs']}", "num_sims": result["num_sims"]}


def simulated_map(base: DictConfig, gpus: int, prompt_lens: list[int], output_lens: list[int], slos: dict,
                  link_bw: float, link_bws: list[float], crossover_output_len: int, crossover_prompt_len: int,
                  chunks: list[int], requests_per_worker: int = 60, steps: int = 4, stream: str = "off") -> dict:
    """Per SLO: the grid of cells (KV moved as `stream` says), the winners along prompt length at
    `crossover_output_len` (read off the grid when it has that output length; `crossover_prompt_len`
    is where the winner first changes, `runs` every stretch of one winner, as it may change more than
    once) and along link bandwidth at the crossover shape, and for each of STREAMS the least link
    bandwidth tried at which disaggregation wins there (None: at none). A cell both sweeps hold (the
    crossover prompt at `link_bw`) is simulated once and read by both, so they agree on it."""
    out = {}
    bar = Progress("simulated", unit="cells")
    shared: dict = {}                       # a simulation two cells need (other SLO; a colocated layout, other link) runs once
    for name, slo in slos.items():
        seen: dict = {}                     # a cell asked for twice (the grid's and a link sweep's) is simulated once

        def cell(lp, lo, bw=link_bw, how=stream):
            key = (lp, lo, float(bw), how)
            if key not in seen:
                seen[key] = simulate_cell(base, gpus, lp, lo, slo, bw, chunks, requests_per_worker, steps, how, shared)
                bar.update(sims=bar.notes.get("sims", 0) + seen[key]["num_sims"], slo=name)
            return seen[key]
        grid = [cell(lp, lo) for lp in prompt_lens for lo in output_lens]
        row = [c for c in grid if c["output_len"] == crossover_output_len] or \
              [cell(lp, crossover_output_len) for lp in prompt_lens]
        winners = [c["winner"] for c in row]
        change = next((row[i]["prompt_len"] for i in range(1, len(row)) if winners[i] != winners[i - 1]), None)
        runs: list[dict] = []               # the winner along prompt length, a run of equal winners each
        for c in row:
            if runs and runs[-1]["winner"] == c["winner"]:
                runs[-1]["to"] = c["prompt_len"]
            else:
                runs.append({"winner": c["winner"], "from": c["prompt_len"], "to": c["prompt_len"]})
        by_stream = {how: [cell(crossover_prompt_len, crossover_output_len, bw, how)["winner"] for bw in sorted(link_bws)]
                     for how in STREAMS}
        lw = by_stream[stream] if stream in by_stream else \
            [cell(crossover_prompt_len, crossover_output_len, bw)["winner"] for bw in sorted(link_bws)]
        last = max((i for i, w in enumerate(lw) if w == MODES[2]), default=-1)
        below = [sorted(link_bws)[i] for i in range(last) if lw[i] != MODES[2]]
        out[name] = {"slo": dict(slo), "grid": grid,
                     "by_prompt": {"prompt_lens": [c["prompt_len"] for c in row], "winners": winners,
                                   "crossover_prompt_len": change, "runs": runs},
                     "by_link": {"link_bws": sorted(link_bws), "winners": lw,
                                 "crossover_link_bw": below[-1] if below else None},
                     "least_link_bw": {how: next((bw for bw, w in zip(sorted(link_bws), ws) if w == MODES[2]), None)
                                       for how, ws in by_stream.items()}}
    bar.close()
    return out
