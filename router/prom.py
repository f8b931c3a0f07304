"""GET /metrics: the server's counters and latency histograms, and the pools' live state, in the
Prometheus text format (prometheus_client, which has no dependencies of its own).

Latencies are the router's records (its clock, as experiments.run reports them), started when the
HTTP request came in: TTFT to the first token, ITL between tokens, E2EL to the last token. Worker
gauges are read from each worker at scrape time (Worker.stats).
"""
from __future__ import annotations

from collections import Counter as Tally

import ray
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

OUTCOMES = ("completed", "failed", "aborted", "rejected", "overloaded")
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5)
E2EL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
STATS_TIMEOUT_S = 2.0


class PoolCollector:
    """Per worker at scrape time: alive, KV blocks used and held, running and waiting requests,
    preemptions; and the front end's queue."""

    def __init__(self, pool, frontend):
        self.pool, self.frontend = pool, frontend

    def _stats(self) -> dict[str, dict]:
        alive = [w for w in self.pool.workers if w.alive]
        out = {}
        for w, ref in [(w, w.actor.stats.remote()) for w in alive]:
            try:
                out[w.name] = ray.get(ref, timeout=STATS_TIMEOUT_S)
            except ray.exceptions.RayError:
                pass
        return out

    def collect(self):
        stats = self._stats()
        alive = GaugeMetricFamily("pdlab_worker_alive", "1 while the worker serves", labels=["worker"])
        for w in self.pool.workers:
            alive.add_metric([w.name], float(w.alive and w.name in stats))
        yield alive
        gauges = [("pdlab_kv_blocks_used", "KV blocks in use", "num_blocks_used"),
                  ("pdlab_kv_blocks_total", "KV blocks in the worker's pool", "num_kv_blocks"),
                  ("pdlab_worker_running_requests", "Requests holding KV on the worker", "num_running"),
                  ("pdlab_worker_waiting_requests", "Requests queued on the worker", "num_waiting")]
        for name, text, key in gauges:
            g = GaugeMetricFamily(name, text, labels=["worker"])
            for worker, s in stats.items():
                g.add_metric([worker], s[key])
            yield g
        pre = CounterMetricFamily("pdlab_preemptions", "Requests preempted (recomputed later)", labels=["worker"])
        for worker, s in stats.items():
            pre.add_metric([worker], s["num_preempted"])
        yield pre
        counts = self.frontend.counts()
        yield GaugeMetricFamily("pdlab_requests_waiting", "Admitted requests without a first token yet",
                                value=counts["waiting"])
        yield GaugeMetricFamily("pdlab_requests_running", "Admitted requests producing tokens", value=counts["running"])
        yield GaugeMetricFamily("pdlab_queue_capacity", "serve.max_queue: requests in flight at most",
                                value=self.frontend.max_queue)


class ServeMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.outcomes: Tally[str] = Tally()          # the same counts, for the command's summary
        self.requests = Counter("pdlab_requests", "Requests by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.ttft = Histogram("pdlab_time_to_first_token_seconds", "Time to first token (router clock)",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("pdlab_inter_token_latency_seconds", "Gaps between tokens (router clock)",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2el = Histogram("pdlab_e2e_request_latency_seconds", "Request in to last token (router clock)",
                              buckets=E2EL_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdlab_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("pdlab_generation_tokens", "Tokens answered", registry=r)
        self.transfers = Counter("pdlab_kv_transfers", "KV transfers of served requests", ["worker", "direction"],
                                 registry=r)
        self.transfer_bytes = Counter("pdlab_kv_transfer_bytes", "KV bytes moved", ["worker", "direction"],
                                      registry=r)

    def watch(self, pool, frontend) -> None:
        self.registry.register(PoolCollector(pool, frontend))

    def refused(self, status: int) -> None:
        outcome = "overloaded" if status in (429, 503) else "rejected"
        self.requests.labels(outcome).inc()
        self.outcomes[outcome] += 1

    def ended(self, outcome: str, rec, num_tokens: int) -> None:
        """One admitted request's end: its outcome, and its latencies when it answered."""
        self.requests.labels(outcome).inc()
        self.outcomes[outcome] += 1
        self.prompt_tokens.inc(rec.prompt_len)
        self.generation_tokens.inc(num_tokens)
        times = rec.token_times[:num_tokens]
        if outcome == "completed" and times:
            self.ttft.observe(times[0] - rec.arrival_s)
            self.e2el.observe(times[-1] - rec.arrival_s)
            for a, b in zip(times, times[1:]):
                self.itl.observe(b - a)
        if rec.transfer_bytes and rec.prefill_worker and rec.decode_worker:     # (bytes: the receiver counted them)
            for worker, direction in ((rec.prefill_worker, "sent"), (rec.decode_worker, "received")):
                self.transfers.labels(worker, direction).inc()
                self.transfer_bytes.labels(worker, direction).inc(rec.transfer_bytes)

    def render(self) -> bytes:
        """Blocks on the workers' stats: call it off the event loop."""
        return generate_latest(self.registry)
