"""What things cost on the simulated machine: steps, KV transfers, exports and imports, messages.

`Costs` gathers a step-time model (experiments/sim/stepmodel.py), the transfer model of each kind of
link, the host time a prefill worker spends exporting a request's KV and a decode worker importing it,
and the latency of the router's messages: `dispatch_s` from the router's submit to the worker's inbox,
`return_s` from a worker's step end to the router stamping its tokens. `source` says where the numbers
come from ("profile <file>", "aiconfigurator <system> <framework> <version> ..." or "roofline <hardware>"),
and every simulated run records it.

`from_profile` reads a profile of the device at hand (experiments/analysis/profile.py writes it);
`from_gpu` prices a datasheet GPU's steps from NVIDIA's measured database (aiconfigurator-core, the
aiconfigurator-core, a dependency; experiments/sim/gpu_costs.py) where it has the GPU and model, the roofline elsewhere;
`from_roofline` builds datasheet costs for a GPU: step times from the roofline model, transfers over
NVLink within a node and the NIC between nodes, export and import as device copies at the memory
efficiency, and messages at an assumed 0.5 ms each way (Ray calls on the host; not measured on a GPU).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from experiments.sim.stepmodel import FACTORS, check_finite, model_from_dict, roofline_model
from experiments.sim.transfer import TransferModel
from workers.config import ModelConfig

MESSAGE_S = 0.5e-3        # router <-> worker message latency on a GPU cluster: an assumption (see above)
GPU_LINK_LATENCY_S = 20e-6  # NVLink / RDMA per-transfer latency: an assumption


@dataclass
class Costs:
    step: object                                   # LinearStepModel | RooflineStepModel
    transfer: dict[str, TransferModel]             # by link kind: "local" (one host), "node", "network"
    dispatch_s: float = 0.0
    return_s: float = 0.0
    export: tuple = (0.0, 0.0)                     # host seconds: fixed + per byte
    import_: tuple = (0.0, 0.0)
    source: str = "hand-made"
    detail: dict = field(default_factory=dict)     # the profile's conditions (machine load, fit errors)
    role_step: dict = field(default_factory=dict)  # a step model for one role instead of `step` (the planner's probes)

    def step_for(self, role: str):
        return self.role_step.get(role, self.step)

    def export_s(self, nbytes: int) -> float:
        return self.export[0] + self.export[1] * nbytes

    def import_s(self, nbytes: int) -> float:
        return self.import_[0] + self.import_[1] * nbytes

    def link(self, kind: str) -> TransferModel:
        return self.transfer.get(kind) or self.transfer["local"]


SERVING_KEYS = ("factors", "gap_s", "dispatch_s", "return_s", "handoff")   # what a calibration may set


def from_profile(path: str | Path, backend: str = "zmq", calibrated: bool = True,
                 serving: dict | None = None, without: tuple = ()) -> Costs:
    """Costs of the machine a profile was measured on, with the transfer model of `backend` (the
    calibration's handoff fit for it where it has one: serving_link); `calibrated=False` leaves out the
    serving calibration (steps as measured in isolation, the bench's transfer, no message latency);
    `serving` replaces the profile's calibration (experiments/analysis/calibrate.py of another run);
    `without` names parts of the calibration to leave out (SERVING_KEYS, or one of the step factors
    "decode", "prefill", "shared_host", "spread"): how validate weighs what each one earns (docs/simulator.md)."""
    path = Path(path)
    prof = json.loads(path.read_text())
    if prof.get("kind") != "pdlab-profile":
        raise ValueError(f"{path}: not a pdlab profile (no kind: pdlab-profile)")
    for name in without:
        if name not in SERVING_KEYS + FACTORS:
            raise ValueError(f"without={name!r}: choose from {list(SERVING_KEYS + FACTORS)}")
    step = dict(prof["step_model"])
    serving = dict((serving or prof.get("serving") or {}) if calibrated else {})
    for name in without:
        serving.pop(name, None)
    factors = {k: v for k, v in (serving.get("factors") or {}).items() if k not in without}
    step["factors"] = factors
    if serving.get("gap_s") is not None:
        step["gap_coef"] = [serving["gap_s"], step["gap_coef"][1]]
    model = model_from_dict(step)
    check_finite(model)
    transfers = prof.get("transfer", {})
    t = transfers.get(backend) or next(iter(transfers.values()), None)
    if t is None:
        raise ValueError(f"{path}: the profile has no transfer model")
    handoff = prof.get("handoff", {})
    export = tuple(handoff.get("export", (0.0, 0.0)))
    served = (serving.get("handoff") or {}).get(backend)
    link = (serving_link(served, export, backend) if served else
            TransferModel(t["latency_s"], t["bandwidth"], f"{backend} (profile)"))
    left_out = f" without {', '.join(without)}" if without else ""
    return Costs(model, {"local": link}, serving.get("dispatch_s", 0.0), serving.get("return_s", 0.0),
                 export, tuple(handoff.get("import", (0.0, 0.0))),
                 f"profile {path.parent.name}/{path.name}" + ("" if serving else " (uncalibrated)") + left_out,
                 {"hardware": prof.get("hardware"), "dtype": prof.get("dtype"), "threads": prof.get("threads"),
                  "machine": prof.get("machine"), "fit_error": prof.get("fit_error"), "path": str(path),
                  "calibrated": bool(serving), "factors": factors, "without": list(without),
                  "calibration_other_cores": serving.get("other_cores")})


def serving_link(served: dict, export: tuple, backend: str) -> TransferModel:
    """The link of a calibrated profile: the serving calibration's handoff fit (prefill step end to the
    last KV byte in, experiments/analysis/calibrate.py) less the profile's export, which the simulator
    charges before the transfer (the bench's transfer alone was 3.3-4x faster than the sender's while serving)."""
    per_byte = 1.0 / served["bandwidth"] - export[1]
    return TransferModel(max(0.0, served["latency_s"] - export[0]),
                         1.0 / per_byte if per_byte > 0 else served["bandwidth"], f"{backend} (serving)")


def from_roofline(cfg: ModelConfig, hardware, dtype_bytes: int = 2, link_bw: float | None = None,
                  **efficiency) -> Costs:
    """Datasheet costs of a GPU (a name in experiments.hardware.HARDWARE or a Hardware)."""
    step = roofline_model(cfg, hardware, dtype_bytes, **efficiency)
    hw = step.hw
    copy = 2.0 / (hw.mem_bw * step.mem_eff)       # read and write once per byte
    node = TransferModel(GPU_LINK_LATENCY_S, hw.nvlink_bw or hw.pcie_bw, f"NVLink {hw.name}")
    net = TransferModel(GPU_LINK_LATENCY_S, link_bw or hw.net_bw, f"network {hw.name}")
    return Costs(step, {"local": node, "node": node, "network": net}, MESSAGE_S, MESSAGE_S, (10e-6, copy),
                 (10e-6, copy), f"roofline {hw.name}", {"step_model": step.to_dict()})


def from_gpu(cfg: ModelConfig, hardware, dtype_bytes: int = 2, link_bw: float | None = None,
             source: str = "auto", framework: str = "vllm", **efficiency) -> Costs:
    """Costs of a datasheet GPU with its steps priced by the source `source` picks (experiments/sim/
    gpu_costs.py: aiconfigurator's measured database where it has the GPU and model, else the roofline);
    transfers, exports and messages as from_roofline's. `source` names the step source; `detail` says
    why the roofline priced them where it did (`costs_fallback`)."""
    from experiments.sim.gpu_costs import choose

    costs = from_roofline(cfg, hardware, dtype_bytes, link_bw, **efficiency)
    step, why = choose(cfg, costs.step.hw.name, costs.step, source, framework, dtype_bytes)
    if step is costs.step:
        costs.detail["costs_fallback"] = why
        return costs
    costs.step, costs.source = step, step.name
    costs.detail = {"step_model": step.to_dict(), "costs_fallback": None}
    return costs


if __name__ == "__main__":
    # python -m experiments.sim.costs model=llama-3-8b hardware=h200 is the command of cost_table.py (pdlab
    # costs), run as a script: that command composes the simulator above this module, which no import here
    # may reach
    import runpy
    runpy.run_module("experiments.sim.cost_table", run_name="__main__", alter_sys=True)
