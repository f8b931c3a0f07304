"""`python -m experiments.sim.costs model=llama-3-8b hardware=h200 [--context 1024] [--decodes 32]`: GPU
step times from each cost source side by side.

Prints, for the model on the datasheet GPU, the step times the simulator would use from each source
(aiconfigurator's measured database where it has them, experiments/sim/gpu_costs.py; the roofline at
the simulator's efficiency factors, experiments/sim/stepmodel.py): decode-only steps of 1..256
sequences at --context tokens each, prefill-only steps of 512..8192 prompt tokens from an empty cache,
and mixed steps (each prefill size beside --decodes decodes at --context). Ends with one JSON line:
{"source": the source hardware.costs picks, "decode_ms": {B: ms}, "prefill_ms": {P: ms},
"mixed_ms": {P: ms}, "by_source": {source: the same three tables}, "fallback": why the roofline, if it}.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

from experiments.compose import compose_config
from experiments.config import ConfigError, parse
from experiments.hardware import HARDWARE
from experiments.sim.gpu_costs import SourceUnavailable, choose
from experiments.sim.stepmodel import chunk_features, roofline_model

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILLS = (512, 1024, 2048, 4096, 8192)


def tables(step, batches, prefills, context: int, decodes: int) -> dict:
    """{decode_ms, prefill_ms, mixed_ms} of one step model, keyed by the batch or prompt size (str)."""
    ms = lambda f: round(step.time(f) * 1e3, 3)  # noqa: E731
    return {"decode_ms": {str(b): ms(chunk_features(b, b * context, [])) for b in batches},
            "prefill_ms": {str(p): ms(chunk_features(0, 0, [(p, 0, True)])) for p in prefills},
            "mixed_ms": {str(p): ms(chunk_features(decodes, decodes * context, [(p, 0, True)])) for p in prefills}}


def compare(spec, context: int = 1024, decodes: int = 32, batches=BATCHES, prefills=PREFILLS) -> dict:
    """The tables of every source for a RunSpec on a datasheet GPU, the chosen source's on top."""
    from experiments.serving.profiles import model_config
    from experiments.sim.backend import costs_for, dtype_bytes

    if spec.hardware.name not in HARDWARE:
        raise ConfigError(f"hardware={spec.hardware.name}: the cost sources are for datasheet GPUs "
                          f"({', '.join(sorted(HARDWARE))})")
    mcfg = model_config(spec)
    longest = mcfg.max_position_embeddings
    if context + 1 > longest:
        raise ConfigError(f"model={mcfg.name}: --context={context} exceeds its context ({longest} tokens)")
    prefills = [p for p in prefills if p <= longest]         # the model's context bounds a prompt
    chosen = costs_for(spec)
    roofline = costs_for(replace(spec, hardware=replace(spec.hardware, costs="roofline"))).step
    bound = roofline_model(mcfg, roofline.hw, roofline.dtype_bytes, compute_eff=1.0, mem_eff=1.0, overhead_s=0.0)
    by_source = {roofline.name: tables(roofline, batches, prefills, context, decodes),
                 bound.name: tables(bound, batches, prefills, context, decodes)}
    why = chosen.detail.get("costs_fallback")
    measured = chosen.step if chosen.step.kind == "aiconfigurator" else None
    if measured is None and spec.hardware.costs != "roofline":
        try:
            measured, _ = choose(mcfg, spec.hardware.name, roofline, "aiconfigurator", spec.hardware.framework,
                                 dtype_bytes(spec))
        except (ValueError, SourceUnavailable) as e:
            why = why or str(e)
    if measured is not None:
        by_source = {measured.name: tables(measured, batches, prefills, context, decodes)} | by_source
    top = chosen.step.name
    return {"source": top, **by_source[top], "by_source": by_source, "fallback": why,
            "model": mcfg.name, "hardware": spec.hardware.name, "context": context, "decodes": decodes}


def _label(name: str) -> str:
    if name.startswith("aiconfigurator"):
        return "measured"
    return "bound" if name.endswith("(compute 1, memory 1)") else "roofline"


def render(r: dict) -> str:
    names = list(r["by_source"])
    label = {n: _label(n) for n in names}
    lines = [f"{r['model']} on {r['hardware']}: step times (ms) from each source; the simulator uses "
             f"{label[r['source']]}"]
    lines += [f"  {label[n]:>9}: {n}" + (" + 0.5 ms per step (the simulator's roofline)" if label[n] == "roofline" else "")
              + (" (the datasheet bound, experiments.roofline)" if label[n] == "bound" else "") for n in names]
    if r["fallback"]:
        lines.append(f"  (no measured source: {r['fallback']})")
    ratio = "measured" in label.values()
    for key, what in (("decode_ms", f"decode-only, batch B at context {r['context']}"),
                      ("prefill_ms", "prefill-only, P prompt tokens from an empty cache"),
                      ("mixed_ms", f"mixed, a P-token prefill beside {r['decodes']} decodes at context {r['context']}")):
        lines += ["", what, f"{'B' if key == 'decode_ms' else 'P':>8}" + "".join(f"{label[n]:>11}" for n in names)
                  + ("  measured/roofline" if ratio else "")]
        for k in r["by_source"][names[0]][key]:
            vals = {label[n]: r["by_source"][n][key][k] for n in names}
            lines.append(f"{k:>8}" + "".join(f"{v:>11.2f}" for v in vals.values())
                         + (f"{vals['measured'] / vals['roofline']:>19.2f}" if ratio else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.sim.costs", description="GPU step times from each cost source side by side "
                                 "(aiconfigurator's measured database, the simulator's roofline, the datasheet bound)",
                                 epilog="overrides: Hydra overrides of the run config (model=, hardware=, "
                                        "hardware.costs=, hardware.framework=, hardware.compute_eff=, ...)")
    ap.add_argument("--context", type=int, default=1024, help="tokens cached per decode sequence")
    ap.add_argument("--decodes", type=int, default=32, help="decode sequences beside each prefill (mixed)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.context < 1 or args.decodes < 1:
        ap.error(f"--context={args.context} and --decodes={args.decodes} must be positive")
    overrides = ["model=llama-3-8b", "hardware=h200", *args.overrides]
    try:
        cfg = compose_config("config", ["compare=null", "backend=sim", *overrides])
        result = compare(parse(cfg), args.context, args.decodes)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    print(render(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
