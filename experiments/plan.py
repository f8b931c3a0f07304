"""`python -m experiments.plan [overrides] cluster.gpus=N`: the command (its printout, plan.json and
plan.png); the search is experiments/analysis/plan.py."""
from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

from experiments.analysis.plan import chunk_sizes, plan


def plot(result: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = result["gpus"]
    splits = [c for c in result["candidates"] if c.disaggregated]
    fig, ax = plt.subplots(figsize=(7, 4))
    if splits:
        ax.plot([int(c.layout.split("p")[0]) for c in splits], [c.goodput_per_gpu for c in splits], "-",
                label="disaggregated P:D (phase estimate)")
    for c in (c for c in result["candidates"] if not c.disaggregated):
        ax.axhline(c.goodput_per_gpu, ls="--", lw=1, label=c.name)
    for tag, c in (("best", result["best"]), ("runner-up", result["runner_up"])):
        if c is not None and c.disaggregated:
            ax.plot([int(c.layout.split("p")[0])], [c.goodput_per_gpu], "o", label=f"{tag}, full scale")
    ax.set_xlabel(f"prefill GPUs P of {n} (D = {n} - P)")
    ax.set_ylabel("goodput per GPU (req/s)")
    ax.set_title(f"goodput per GPU at >= {result['target']:.0%} SLO attainment ({result['costs']})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


IGNORED = {"layout": "tries every layout", "cluster.mode": "tries every layout",
           "workload.rate": "searches the rate", "compare": "compares layouts itself",
           "workload.num_requests": "sizes each simulation by plan.requests_per_worker"}   # what plan() sets itself


def summary_lines(result: dict) -> list[str]:
    best, run = result["best"], result["runner_up"]
    lines = [f"best: {best.name}: {best.goodput_per_gpu:.3g} req/s per GPU ({best.rate:.4g} req/s on "
             f"{result['gpus']} GPUs; {best.how})"]
    if run is not None:
        lines.append(f"runner-up: {run.name}: {run.goodput_per_gpu:.3g} req/s per GPU ({run.how})")
        if run.goodput_per_gpu > 0:
            x = best.goodput_per_gpu / run.goodput_per_gpu
            res = 2.0 ** -result["steps"]          # the bisection's last bracket, relative to the rate
            lines.append(f"margin: the best gives {x:.3g}x the runner-up's goodput per GPU ({x - 1:+.1%})" +
                         (f"; the rate search resolves about {res:.0%}, so this is a tie" if x - 1 < res else ""))
    return lines


def main() -> None:
    import json
    import sys
    from pathlib import Path

    import hydra
    from hydra.core.hydra_config import HydraConfig

    from experiments.compose import exit_on_bad_overrides
    from experiments.config import CONF_DIR, ConfigError

    exit_on_bad_overrides("plan")

    @hydra.main(version_base=None, config_path=CONF_DIR, config_name="plan")
    def app(cfg: DictConfig) -> None:
        out = Path(HydraConfig.get().runtime.output_dir)
        p = cfg.plan
        base = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        base.pop("plan")
        base.compare, base.layout = None, None
        for given in HydraConfig.get().overrides.task:
            key = given.lstrip("+~").split("=", 1)[0]
            if key in IGNORED:
                print(f"note: {given} is ignored: the planner {IGNORED[key]}", file=sys.stderr)
        try:
            result = plan(base, int(cfg.cluster.gpus), chunk_sizes(cfg), p.probe, p.requests_per_worker, p.steps,
                          p.verify_requests_per_gpu, cfg.seed, jobs=p.get("jobs") or len(os.sched_getaffinity(0)))
        except (ConfigError, ValueError) as e:
            print(f"config error: {str(e).splitlines()[0]}", file=sys.stderr)
            sys.exit(2)
        ph = result["phases"]
        print(f"{cfg.model.name} on {result['gpus']} GPUs ({result['costs']}), workload {cfg.workload.name}, SLO TTFT "
              f"<= {result['slo']['ttft_ms']:g} ms, TPOT <= {result['slo']['tpot_ms']:g} ms, attainment >= "
              f"{result['target']:.0%}")
        for c in sorted(result["candidates"], key=lambda c: -c.goodput_per_gpu)[:8]:
            print(f"  {c.name:<34} {c.goodput_per_gpu:8.3g} req/s/GPU  ({c.how})")
        if ph:
            print(f"phases: one prefill worker sustains {ph['prefill_per_worker']:.3g} req/s within TTFT, one decode "
                  f"worker {ph['decode_per_worker']:.3g} req/s within TPOT")
        for line in summary_lines(result):
            print(line)
        plot(result, out / "plan.png")
        print(f"plot: {out / 'plan.png'}; {result['num_sims']} simulations in {result['elapsed_s']:.1f} s")

        def c_json(c):
            return None if c is None else {"layout": c.layout, "chunk": c.chunk, "goodput_per_gpu": c.goodput_per_gpu,
                                           "rate": c.rate, "attainment": c.attainment, "how": c.how}
        (out / "plan.json").write_text(json.dumps({"best": c_json(result["best"]),
                                                   "runner_up": c_json(result["runner_up"]),
                                                   "candidates": [c_json(c) for c in result["candidates"]],
                                                   "phases": ph}, indent=1))
        print(json.dumps({"best": c_json(result["best"]), "runner_up": c_json(result["runner_up"]), "phases": ph,
                          "gpus": result["gpus"], "costs": result["costs"], "num_sims": result["num_sims"],
                          "elapsed_s": round(result["elapsed_s"], 2), "plot": str(out / "plan.png")}))

    app()


if __name__ == "__main__":
    main()
