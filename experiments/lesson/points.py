"""What the lesson serves and simulates, as run configs: each served point's overrides (the chunking
section's, with the measured rate curves' points, and the measured decision cells'), and the simulated
sections' base config and SLO. `prepare_points` composes, validates and prepares all of them once,
before the lesson measures anything, so a bad value ends it at once."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hydra import compose
from omegaconf import DictConfig, OmegaConf

from experiments.analysis import decision_sim
from experiments.analysis.decision_sim import cell_config
from experiments.config import apply_layout, even_split
from experiments.serving.serve import Prepared, prepare


def disagg(gpus: int) -> str:
    """The disaggregated layout of `gpus` GPUs the lesson serves: the default comparison's even split."""
    return even_split(gpus)


def point_config(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """A served point's run config: `python -m experiments.run`'s, with the point's overrides."""
    return compose("config", overrides=["compare=null", "report=false", f"repeats={cfg.repeats}", *overrides])


@dataclass
class LessonPoints:
    chunking: list[Prepared]       # the chunking section's served points, with the measured rate curves'
    decision: list[Prepared]       # the measured decision cells' points
    base: DictConfig               # the simulated sections' run config
    slo: dict                      # goodput_vs_rate.simulated's SLO, in ms
    emulated: list[Prepared]       # goodput_vs_rate.emulated's points: the simulated curve's, served emulated


def prepare_points(cfg: DictConfig, runs: Path) -> LessonPoints:
    """Every point the lesson serves, composed, validated and its workload built as serving it needs (under
    runs/<section>/<name>/), and the simulated sections' config and SLO resolved, before anything is
    measured: a bad value (gpus=0, a served override, an SLO name) ends the lesson at once with the error
    naming it, not after minutes of measurements."""
    def each(named: dict[str, list[str]], where: Path) -> list[Prepared]:
        return [p for name, overrides in named.items()
                for p in prepare(point_config(cfg, overrides), where / name, ",".join(overrides))]

    base, slo = simulated_slo(cfg)
    from experiments.sim.emulated import prepare_emulation          # its workers priced as the simulator prices

    emulated = [p for name, pcfg in emulated_points(cfg, base, slo).items()
                for p in prepare_emulation(prepare(pcfg, runs / "emulated" / name, f"emulated {name}"))]
    return LessonPoints(each(chunking_points(cfg)[0], runs / "chunking"),
                        each(decision_points(cfg)[0], runs / "decision"), base, slo, emulated)


def emulated_points(cfg: DictConfig, base: DictConfig, slo: dict) -> dict[str, DictConfig]:
    """goodput_vs_rate.emulated's points: each named layout of the simulated curve, on the decision map's GPUs,
    link and KV stream, at its rate, served on emulated engines (name -> run config)."""
    e, g, m = cfg.decision.simulated, cfg.goodput_vs_rate.simulated, cfg.goodput_vs_rate.emulated
    chunks = {lay.layout: lay.get("chunk") for lay in g.layouts}
    unknown = [lay for lay in m.layouts if lay not in chunks]
    if unknown:
        raise ValueError(f"goodput_vs_rate.emulated.layouts: {unknown[0]!r} is not one of "
                         f"goodput_vs_rate.simulated.layouts ({', '.join(chunks)})")
    out = {}
    for layout in m.layouts:
        c = cell_config(base, g.prompt_len, g.output_len, slo, e.link_bw, e.stream)
        c.cluster.gpus = e.gpus
        if chunks[layout]:
            c.scheduler.token_budget = chunks[layout]
        c.engine.timing, c.repeats, c.report = "emulated", 1, False
        c.workload.rate, c.workload.num_requests = float(m.rate_per_gpu) * e.gpus, int(m.num_requests)
        out[layout] = apply_layout(c, layout)
    return out


def common(cfg: DictConfig) -> list[str]:
    model = [f"model={cfg.model.name}"] + ([f"model.checkpoint={cfg.model.checkpoint}"] if cfg.model.checkpoint else [])
    slo = [f"slo.{k}={v}" for k, v in cfg.slo.items()]
    return [*model, *slo, f"seed={cfg.seed}", f"cluster.gpus={cfg.gpus}", *cfg.get("serve_overrides", [])]


def served_modes(cfg: DictConfig) -> dict[str, list[str]]:
    """The measured rate curve's modes: name -> layout overrides."""
    return {"colocated prefill_first": ["layout=colocated-prefill_first"],
            f"colocated chunked (chunk {cfg.goodput_vs_rate.measured.chunk})":
                ["layout=colocated-chunked", f"scheduler.token_budget={cfg.goodput_vs_rate.measured.chunk}"],
            f"disaggregated {disagg(cfg.gpus)}": [f"layout={disagg(cfg.gpus)}"]}


def chunking_points(cfg: DictConfig) -> tuple[dict[str, list[str]], dict[str, str], list[float]]:
    """The chunking section's served points (name -> overrides), each rate curve point's name
    ("<mode>@<rate>" -> point: the chunking workload's rate is one point of each curve, the same runs), and
    the curves' rates."""
    c, g = cfg.chunking, cfg.goodput_vs_rate.measured
    lengths = [f"workload.{k}.value={c[k]}" for k in ("prompt_len", "output_len") if c.get(k) is not None]
    lengths = ["workload.arrival=poisson"] + (lengths + ["workload.length_scale=1.0"] if lengths else [])

    def base(rate):
        return common(cfg) + [f"workload={c.workload}", f"workload.rate={rate}", f"workload.num_requests={c.num_requests}",
                              *lengths]
    named = {f"chunked_{size}": base(c.rate) + ["layout=colocated-chunked", f"scheduler.token_budget={size}"]
             for size in c.chunk_sizes}
    named |= {"prefill_first": base(c.rate) + ["layout=colocated-prefill_first"],
              "disaggregated": base(c.rate) + [f"layout={disagg(cfg.gpus)}"]}
    same = {"colocated prefill_first": "prefill_first", f"disaggregated {disagg(cfg.gpus)}": "disaggregated",
            f"colocated chunked (chunk {g.chunk})": f"chunked_{g.chunk}"}
    curve_rates = sorted({float(c.rate), *(float(r) for r in g.rates)})
    alias = {}
    for mode, over in served_modes(cfg).items():
        for r in curve_rates:
            key = f"{mode}@{r:g}"
            if r == float(c.rate) and same[mode] in named:
                alias[key] = same[mode]
            else:
                alias[key] = f"rate_{r:g}/{mode.replace(' ', '_').replace('(', '').replace(')', '')}"
                named[alias[key]] = base(r) + over
    return named, alias, curve_rates


def decision_points(cfg: DictConfig) -> tuple[dict[str, list[str]], list[str]]:
    """The measured decision cells' served points (name -> overrides) and the layouts each cell compares."""
    m = cfg.decision.measured
    layouts = ["colocated-prefill_first", "colocated-chunked", disagg(cfg.gpus)]
    named = {}
    for lp in m.prompt_lens:
        for lo in m.output_lens:
            base = common(cfg) + ["workload=fixed", "workload.arrival=poisson", f"workload.rate={m.rate}",
                                  f"workload.num_requests={m.num_requests}", "workload.length_scale=1.0",
                                  f"workload.prompt_len.value={lp}", f"workload.output_len.value={lo}"]
            named |= {f"p{lp}_o{lo}/{lay}": base + [f"layout={lay}"] for lay in layouts}
    return named, layouts


def sim_slos(e: DictConfig, base: DictConfig) -> dict:
    """decision.simulated's SLOs in ms, a tpot_x_decode priced on the map's hardware (decision_sim.resolve_slos)."""
    return decision_sim.resolve_slos(base, {k: OmegaConf.to_container(v) for k, v in e.slos.items() if v},
                                     OmegaConf.to_container(e.decode_ref))


def simulated_slo(cfg: DictConfig) -> tuple[DictConfig, dict]:
    """The simulated sections' run config and goodput_vs_rate.simulated's SLO, resolved in ms."""
    e, g = cfg.decision.simulated, cfg.goodput_vs_rate.simulated
    base = compose("config", overrides=["compare=null", "report=false", f"model={e.model}", f"hardware={e.hardware}",
                                        f"seed={cfg.seed}"])
    slos = sim_slos(e, base)
    if g.slo not in slos:
        raise ValueError(f"goodput_vs_rate.simulated.slo={g.slo!r}: choose one of decision.simulated.slos "
                         f"({', '.join(slos)})")
    return base, slos[g.slo]
