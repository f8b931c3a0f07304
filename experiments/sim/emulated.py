"""engine.timing=emulated: the real cluster (Ray pools, router, scheduler, block manager, KV wire) at the
emulated device's time, on whatever machine runs it (docs/emulation.md).

A point served emulated is a real point whose workers build no model. What they are given comes from
the simulator's own costs of the `hardware` group, so an emulated run and its simulation are priced
alike (`emulation_costs`):

- each role's step price (experiments/sim/stepmodel.py's StepPrice over the same step model): a
  datasheet GPU's measured (aiconfigurator) or roofline costs, or this machine's profile with its
  isolated steps only (the serving factors describe this machine serving for real, which the
  emulated cluster does);
- each role's KV pool in blocks, sized as the simulator sizes it (backend.num_blocks: the GPU's
  memory less the weights and a step's activations at gpu_memory_utilization);
- the KV link (`emulation_link`): transfer.link_bandwidth and transfer.link_latency_s where given,
  else the cost source's link for the layout: within one node of hardware.gpus_per_node GPUs its
  NVLink, beyond it the network (one link for every pair: an emulated cluster runs on one machine).

`prepare_emulation` attaches these to the prepared points of a run; experiments/serving/serve.py's
serve_repeat starts the pool with them and records `emulated` in each repeat's metrics.json: the
costs, the link, the pools, and how the steps' measured durations compared with their prices.
"""
from __future__ import annotations

from dataclasses import replace

from cluster.transfer.link import Link
from cluster.worker import Emulation
from experiments.config import ConfigError, RunSpec
from experiments.serving.profiles import profile_for
from experiments.sim.backend import costs_for, dtype_bytes, num_blocks, on_gpu
from experiments.sim.costs import Costs, from_profile
from experiments.sim.stepmodel import StepPrice
from experiments.sim.transfer import TransferModel

ROLES = ("colocated", "prefill", "decode")


def is_emulated(spec: RunSpec) -> bool:
    return spec.backend == "real" and spec.engine.timing == "emulated"


def emulation_costs(spec: RunSpec) -> Costs:
    """The costs an emulated point's steps are priced by: the hardware group's, a profile's uncalibrated."""
    if on_gpu(spec):
        return costs_for(spec)
    try:
        return from_profile(profile_for(spec), spec.transfer.backend, calibrated=False)
    except (OSError, ValueError) as e:
        raise ConfigError(f"engine.timing=emulated: {str(e).splitlines()[0]}") from None


def link_kind(spec: RunSpec) -> str:
    """Which of the cost source's links an emulated cluster's KV crosses: its GPUs' node link while they
    fit one node, the network beyond (a profile: its one measured wire)."""
    if not on_gpu(spec):
        return "local"
    return "node" if spec.gpus <= spec.hardware.gpus_per_node else "network"


def emulation_link(spec: RunSpec, costs: Costs) -> Link:
    t = spec.transfer
    base: TransferModel = costs.link(link_kind(spec))
    bw = t.link_bandwidth if t.link_bandwidth is not None else base.bandwidth
    latency = t.link_latency_s if t.link_latency_s is not None else base.latency_s
    given = t.link_bandwidth is not None or t.link_latency_s is not None
    return Link(float(latency), float(bw), "transfer.link_*" if given else base.name)


def emulated_engines(spec: RunSpec, nbytes: int) -> dict:
    """Each role's EngineConfig as a real run builds it, timed emulated, its pool in counted blocks."""
    return {role: e.replace(timing="emulated", num_kv_blocks=num_blocks(spec, role, nbytes))
            for role, e in spec.engines().items()}


def check(spec: RunSpec) -> None:
    if spec.transfer.backend != "zmq":
        raise ConfigError(f"engine.timing=emulated: transfer.backend={spec.transfer.backend} sends real tensors; "
                          "emulated KV parts declare their bytes, which only the zmq wire carries (transfer=zmq)")
    if spec.model.device not in ("auto", "cpu"):
        raise ConfigError(f"engine.timing=emulated: model.device={spec.model.device}: an emulated worker runs no "
                          "model on any device (leave model.device=auto)")


def emulation_for(spec: RunSpec) -> dict:
    """What serve_repeat takes for an emulated point: engines, the workers' Emulation, and its record."""
    check(spec)
    costs = emulation_costs(spec)
    nbytes = dtype_bytes(spec, costs)
    engines = emulated_engines(spec, nbytes)
    link = emulation_link(spec, costs)
    price = StepPrice(costs.step)
    device = spec.hardware.name if on_gpu(spec) else (costs.detail.get("hardware") or "profile")
    record = {"costs": costs.source, "step_model": costs.step.name, "link": link.to_dict(),
              "link_kind": link_kind(spec), "num_kv_blocks": {r: engines[r].num_kv_blocks for r in ROLES},
              "dtype_bytes": nbytes, "device": device}
    return {"engines": engines, "emulation": Emulation({r: price for r in ROLES}, link), "record": record,
            "device": f"emulated {device}"}


def prepare_emulation(prepared: list) -> list:
    """Attach the emulation to each prepared point that is emulated (experiments/serving/serve.py's Prepared)."""
    for p in prepared:
        if is_emulated(p.spec):
            p.emulated = emulation_for(p.spec)
            p.ident["timing"] = "emulated"
            p.ident["label"] = f"{p.ident['label']} [emulated {p.emulated['record']['device']}]"
    return prepared


def sim_costs(spec: RunSpec, system: dict | None = None) -> Costs:
    """The costs that simulate an emulated run of `spec`: its steps priced as its workers priced them, its
    KV over the link it ran on (every pair), and the system's latencies (`system`: dispatch_s, return_s,
    gap_coef, export, import, from experiments/analysis/emulation_cal.py; None: the cost source's own)."""
    costs = emulation_costs(spec)
    link = emulation_link(spec, costs)
    wire = system.get("wire_s", 0.0) if system else 0.0       # the handoff's handling beside the link's time
    model = TransferModel(link.latency_s + wire, link.bandwidth, link.name + (" + handoff" if wire else ""))
    costs = replace(costs, transfer={"local": model, "node": model, "network": model})
    if system:
        costs = replace(costs, dispatch_s=system["dispatch_s"], return_s=system["return_s"],
                        export=tuple(system["export"]), import_=tuple(system["import"]),
                        step=GapModel(costs.step, tuple(system["gap_coef"])),
                        source=f"{costs.source}; system {system.get('source', 'calibrated')}")
    return costs


class GapModel:
    """A step model with another host gap between steps (an emulated cluster's, measured on its machine)."""

    def __init__(self, model, gap_coef: tuple):
        self.model, self.gap_coef = model, tuple(gap_coef)
        self.name = model.name
        self.kind = getattr(model, "kind", None)
        self.shared_host = getattr(model, "shared_host", None)
        self.spread = getattr(model, "spread", None)

    def time(self, f):
        return self.model.time(f)

    def decode_run(self, b, context, k):
        return self.model.decode_run(b, context, k)

    def gap(self, num_seqs: int) -> float:
        return self.gap_coef[0] + self.gap_coef[1] * num_seqs

    def to_dict(self) -> dict:
        return self.model.to_dict() | {"gap_coef": list(self.gap_coef)}
