"""The cluster's shape: which mode, how many workers of each role, where they go."""
from __future__ import annotations

from dataclasses import dataclass

MODES = ("colocated", "disaggregated")
PLACEMENTS = {"pack": "PACK", "spread": "SPREAD", "strict_pack": "STRICT_PACK", "strict_spread": "STRICT_SPREAD"}


@dataclass(frozen=True)
class ClusterConfig:
    mode: str = "disaggregated"
    workers: int = 2                  # colocated: workers doing both phases
    prefill_workers: int = 1          # disaggregated: P
    decode_workers: int = 1           # disaggregated: D
    placement: str = "pack"           # pack prefill/decode pairs on a node, or spread over nodes
    address: str | None = None        # an existing Ray cluster ("auto" or host:port); None = embedded local
    num_gpus: int | None = None       # embedded Ray: GPUs to declare; None = the GPUs torch sees, or with
                                      # none, one per worker (torch then runs on CPU)
    num_cpus: int | None = None       # embedded Ray: CPUs to declare; None = this machine's
    cpus_per_worker: float | str = "auto"   # Ray CPUs reserved per worker besides its GPU, and as many cores
                                      # pinned to it; auto = a node's cores over its workers (one kept for
                                      # the driver when cores > workers); 0 = none: workers share cores
    torch_threads: int = 0            # per worker; 0 = one per core of its own (an equal share if shared)
    gpus_per_worker: float = 1        # GPUs per worker's bundle and actor: a fraction (0.5) lets workers share
                                      # a GPU (a prefill and a decode worker on one), an integer >= 1 gives more
    startup_timeout_s: float = 60.0   # each start-up phase (placement, actor start, wiring, probe): past it,
                                      # the workers that have not answered are dropped (or the point fails)
    speed_probe: bool = False         # opt-in: each worker times the same two steps before (and after)
                                      # serving (workers/probe.py); the results go to metrics.json
    log_to_driver: bool = True

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"cluster.mode={self.mode!r}: choose one of {list(MODES)}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"cluster.placement={self.placement!r}: choose one of {sorted(PLACEMENTS)}")
        if self.mode == "disaggregated":
            for key in ("prefill_workers", "decode_workers"):
                if getattr(self, key) < 1:
                    raise ValueError(f"cluster.{key}={getattr(self, key)}: disaggregated mode needs at least one")
        elif self.workers < 1:
            raise ValueError(f"cluster.workers={self.workers}: colocated mode needs at least one worker")
        if self.cpus_per_worker != "auto" and (isinstance(self.cpus_per_worker, (str, bool))
                                               or not self.cpus_per_worker >= 0):
            raise ValueError(f"cluster.cpus_per_worker={self.cpus_per_worker!r} must be auto or a number >= 0")
        if self.torch_threads < 0:
            raise ValueError(f"cluster.torch_threads={self.torch_threads} must be >= 0 (0: one per core)")
        g = self.gpus_per_worker
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not (0 < g <= 1 or (g >= 1 and g == int(g))):
            raise ValueError(f"cluster.gpus_per_worker={g!r} must be a fraction in (0, 1] (workers sharing a GPU) "
                             "or a whole number of GPUs")
        if self.startup_timeout_s <= 0:
            raise ValueError(f"cluster.startup_timeout_s={self.startup_timeout_s} must be positive")

    @property
    def roles(self) -> list[str]:
        """Role of each worker rank: prefill ranks first, then decode ranks."""
        if self.mode == "colocated":
            return ["colocated"] * self.workers
        return ["prefill"] * self.prefill_workers + ["decode"] * self.decode_workers

    @property
    def num_workers(self) -> int:
        return len(self.roles)

    @property
    def num_gpus_needed(self) -> float:
        """GPUs the layout takes: its workers times cluster.gpus_per_worker."""
        return self.num_workers * self.gpus_per_worker

    def describe(self) -> str:
        if self.mode == "colocated":
            return f"colocated x{self.workers}"
        return f"disaggregated {self.prefill_workers}P+{self.decode_workers}D"
