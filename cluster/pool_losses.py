"""How a pool loses workers: one remote call per worker, waited for at most a phase's timeout; a worker
whose actor died or that stayed silent is dropped, and a layout left without a role fails.

A part of cluster/pool.py's WorkerPool (a mixin: it uses the pool's config, workers, `lost` and
`started`). During start-up a dropped worker leaves `workers`, so the router never sees it; once the
pool serves, it stays there marked dead (the router's threads handle losses then, router/threads.py).
"""
from __future__ import annotations

import logging
import time

import ray

from cluster.ray_cluster import ClusterError

log = logging.getLogger("cluster.pool")


class PoolLosses:
    def gather(self, calls: dict, phase: str, timeout_s: float | None = None, errors: dict | None = None,
               on_loss=None) -> dict:
        """{worker: result} of one remote call per worker (`calls`: {worker: object ref}), waiting at
        most `timeout_s` (cluster.startup_timeout_s) for all of them. A worker whose actor died or that
        did not answer in time is dropped (`lose`); a call that raised is an error of the layout, raised
        as ClusterError naming the worker, unless `errors` is given to collect them ({worker: message}).
        `on_loss()` is called after each loss."""
        timeout_s = self.cfg.startup_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        pending = {ref: w for w, ref in calls.items()}
        out, failed = {}, {}
        lose = self.lose if on_loss is None else lambda *a: (self.lose(*a), on_loss())
        while pending and (left := deadline - time.monotonic()) > 0:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            for ref in ready:
                w = pending.pop(ref)
                try:
                    out[w] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    if e.actor_init_failed:      # its constructor raised: the layout's error, not a loss
                        failed[w] = _last_line(e)
                    else:
                        lose(w, phase, f"its actor died: {_first_line(e)}")
                except ray.exceptions.RayTaskError as e:
                    failed[w] = _first_line(e.cause if e.cause is not None else e)
                except ray.exceptions.RayError as e:       # its node lost with the result
                    lose(w, phase, _first_line(e))
        for w in pending.values():
            lose(w, phase, f"no answer within cluster.startup_timeout_s={timeout_s:g}")
        if failed and errors is None:
            w, why = next(iter(failed.items()))
            raise ClusterError(f"{w.name} failed during {phase}: {why}")
        if errors is not None:
            errors.update(failed)
        self.check_roles(phase)
        return out

    def lose(self, w, phase: str, reason: str) -> None:
        """Drop `w` (a WorkerHandle): kill its actor, record why; during start-up it leaves `workers`."""
        if not w.alive:
            return
        w.alive = False
        self.lost.append({"worker": w.name, "host": w.info.get("host"), "node_id": w.info.get("node_id"),
                          "phase": phase, "reason": reason})
        try:
            ray.kill(w.actor, no_restart=True)
        except Exception:
            pass
        if not self.started:
            self.workers = [x for x in self.workers if x is not w]
        log.warning("worker %s lost during %s (%s); the pool goes on with %s", w.name, phase, reason, self.layout())

    def check_roles(self, phase: str) -> None:
        """During start-up, fail once a role of the layout has no worker left: the point cannot be served as asked."""
        if self.started:
            return
        for role in dict.fromkeys(self.cfg.roles):
            if not any(w.role == role and w.alive for w in self.workers):
                why = "; ".join(f"{x['worker']}: {x['reason']}" for x in self.lost if x["worker"].startswith(role))
                raise ClusterError(f"every {role} worker was lost during start-up ({phase}): the layout "
                                   f"{self.cfg.describe()} cannot be served without one ({why})")

    def layout(self) -> str:
        """The live workers, by role: '1P+2D (prefill:0, decode:0, decode:1)'."""
        live = [w for w in self.workers if w.alive]
        n = {role: sum(w.role == role for w in live) for role in ("colocated", "prefill", "decode")}
        shape = f"colocated x{n['colocated']}" if self.cfg.mode == "colocated" else f"{n['prefill']}P+{n['decode']}D"
        return f"{shape} ({', '.join(w.name for w in live) or 'no worker'})"

    def record(self) -> dict:
        """What metrics.json keeps of the pool: the layout asked and served, each worker's place, the lost."""
        return {"asked": self.cfg.describe(), "served": self.layout(),
                "workers": [{"worker": w.name, "host": w.info.get("host"), "node_id": w.info.get("node_id"),
                             "device": w.info.get("device"), "gpu": w.info.get("gpu"), "alive": w.alive}
                            for w in self.workers],
                "lost": list(self.lost)}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def _last_line(e: BaseException) -> str:
    """The exception line that ends a remote traceback."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return (lines[-1] if lines else type(e).__name__)[:500]
