"""`pdlab`: one command for everything pdlab does. Each subcommand runs the module behind it exactly
as `python -m MODULE ARGS` would (same Hydra overrides, same `--help`), so the two cannot drift.

    pdlab run [overrides]              the main job: serve a workload three ways, write a report
    pdlab bench engine --help          the benchmarks, one word each
"""
from __future__ import annotations

import runpy
import sys

COMMANDS = {   # name: (module, what it does)
    "run": ("experiments.run", "serve a workload on a (local or Ray) cluster and write the run's report"),
    "serve": ("experiments.server", "the OpenAI-compatible HTTP server in front of the worker pools"),
    "lesson": ("experiments.lesson", "the lesson: why the phases interfere, when to disaggregate, chunking"),
    "report": ("experiments.report", "rebuild a report from run directories"),
    "roofline": ("experiments.roofline", "roofline step times of a model on datasheet GPUs"),
    "costs": ("experiments.sim.cost_table", "GPU step times from each cost source side by side"),
    "profile": ("experiments.profile", "profile this device's step times for the simulator"),
    "validate": ("experiments.validate", "the simulator against a real run (and a real run against another)"),
    "plan": ("experiments.plan", "plan a deployment: colocated or disaggregated, and the P:D split"),
    "peer": ("experiments.analysis.peer", "the planner's choice beside aiconfigurator's agg-vs-disagg recommendation"),
    "gpu-check": ("experiments.gpu_check", "check every GPU path on the first visible GPU, in minutes"),
    "generate": ("workers.generate", "greedy or sampled generation from one in-process engine"),
}
BENCHES = {
    "engine": ("benchmarks.engine", "engine steps against Hugging Face and the matmul floor"),
    "transfer": ("benchmarks.transfer", "KV transfer bandwidth over each wire"),
    "overlap": ("benchmarks.overlap", "how much of a streamed transfer hides behind the prefill"),
    "serve": ("benchmarks.serve", "the HTTP server under an OpenAI-client load"),
    "overhead": ("benchmarks.overhead", "the router's own cost per request"),
    "sim": ("experiments.sim.bench", "simulator speed at scale"),
    "emulation": ("benchmarks.emulation", "how many emulated GPUs this machine holds before its lag shows"),
}


def usage() -> str:
    width = max(map(len, [*COMMANDS, *BENCHES])) + 6
    lines = ["usage: pdlab COMMAND [ARGS...]   (ARGS: Hydra overrides or options; COMMAND --help for each)",
             "", "commands:"]
    lines += [f"  {name:{width}}{what}" for name, (_, what) in COMMANDS.items()]
    lines += [f"  {'bench':{width}}the benchmarks:"]
    lines += [f"    {name:{width - 2}}{what}" for name, (_, what) in BENCHES.items()]
    return "\n".join(lines)


def resolve(argv: list[str]) -> tuple[str, str, list[str]]:
    """(program name, module, its arguments) for `pdlab ARGV`; SystemExit with usage on a bad name."""
    if not argv:
        raise SystemExit(usage())                    # (no command: an error, exit 1)
    if argv[0] in ("-h", "--help", "help"):          # a help request is not: usage on stdout, exit 0
        print(usage())
        raise SystemExit(0)
    name, rest = argv[0], argv[1:]
    if name == "bench":
        if not rest or rest[0] in ("-h", "--help") or rest[0] not in BENCHES:
            what = f"unknown benchmark {rest[0]!r}\n\n" if rest and rest[0] not in ("-h", "--help") else ""
            raise SystemExit(what + usage())
        return f"pdlab bench {rest[0]}", BENCHES[rest[0]][0], rest[1:]
    if name not in COMMANDS:
        raise SystemExit(f"pdlab: unknown command {name!r}\n\n{usage()}")
    return f"pdlab {name}", COMMANDS[name][0], rest


def main(argv: list[str] | None = None) -> None:
    prog, module, args = resolve(sys.argv[1:] if argv is None else argv)
    sys.argv = [prog, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
