"""Token times and core assignment without Ray: the router stamps each token with its step's end on the
router's clock (fake workers whose clocks are far off), and the pool's sizing and core assignment."""
import pytest

from cluster.config import ClusterConfig
from cluster.isolation import assign_cores, bundle_cpus, threads_for
from router.clock import Sample
from router.prom import ServeMetrics
from router.router import Router
from tests.test_routing import fake_pool, greedy, submitted


def step(aid, token, end, finish=None, first_scheduled=None):
    return {"kind": "step", "end": end, "tokens": [[aid, token, finish]],
            "first_scheduled": {aid: first_scheduled} if first_scheduled is not None else {}}


def test_tokens_carry_their_step_end_on_the_routers_clock_and_their_arrival():
    """Prefill worker's clock 10 s ahead, decode worker's 5 s behind; three decode steps come back in
    one poll reply. Made-times keep the steps' gaps; arrival times share the reply's instant."""
    pool = fake_pool({"prefill:0": "A", "decode:0": "B"})
    router = Router(pool, clock=lambda: 1000.0)                      # submitted at 1000.0 on its clock
    p, d = pool.find("prefill:0"), pool.find("decode:0")
    router.clocks[p.rank].update(Sample(offset=10.0, rtt=1e-4, at=0.0), 0.0)
    router.clocks[d.rank].update(Sample(offset=-5.0, rtt=1e-4, at=0.0), 0.0)
    rec = router.submit("a", [1] * 100, greedy(4))
    aid = submitted(pool)[-1][0]
    t0 = rec.arrival_s
    assert t0 == 1000.0
    on_p, on_d = (lambda t: t0 + 10 + t), (lambda t: t0 - 5 + t)     # router time t0 + t on each clock
    with router._lock:
        router._on_event(p, step(aid, 7, on_p(0.050), "handoff", first_scheduled=on_p(0.020)), t0 + 0.060)
        router._on_event(p, {"kind": "sent", "rid": aid, "dst": d.rank, "bytes": 640, "seconds": 0.002,
                             "start": on_p(0.051)}, t0 + 0.061)
        router._on_event(d, {"kind": "imported", "rid": aid, "bytes": 640, "recv_s": 0.002,
                             "arrived": on_d(0.055), "time": on_d(0.056)}, t0 + 0.062)
        for k, end in enumerate([0.070, 0.080, 0.090]):             # one reply, three steps
            router._on_event(d, step(aid, k, on_d(end), "length" if k == 2 else None,
                                     first_scheduled=on_d(0.062) if k == 0 else None), t0 + 0.200)
    assert rec.status == "ok" and rec.output_ids == [7, 0, 1, 2]
    assert rec.token_times == pytest.approx([t0 + 0.050, t0 + 0.070, t0 + 0.080, t0 + 0.090], abs=1e-6)
    assert rec.arrival_times == [t0 + 0.060, t0 + 0.200, t0 + 0.200, t0 + 0.200]
    assert rec.itl_s == pytest.approx([0.020, 0.010, 0.010], abs=1e-6)
    assert rec.client_itl_s == pytest.approx([0.140, 0.0, 0.0], abs=1e-6)
    assert rec.ttft_s == pytest.approx(0.050, abs=1e-6) and rec.client_ttft_s == pytest.approx(0.060, abs=1e-6)
    assert rec.end_time == rec.token_times[-1]
    assert rec.token_workers == ["prefill:0"] + ["decode:0"] * 3
    # the journey, with each worker's times read on its own clock
    assert rec.queue_s == pytest.approx(0.020, abs=1e-6) and rec.prefill_s == pytest.approx(0.030, abs=1e-6)
    assert rec.handoff_s == pytest.approx(0.012, abs=1e-6) and rec.decode_s == pytest.approx(0.028, abs=1e-6)
    assert rec.kv_send_start == pytest.approx(t0 + 0.051, abs=1e-6)
    assert rec.kv_arrived == pytest.approx(t0 + 0.055, abs=1e-6)
    clocks = router.clock_report()
    assert clocks["prefill:0"]["offset_ms"] == 10_000.0 and clocks["decode:0"]["offset_ms"] == -5_000.0

    from experiments.serving.metrics import summarize
    from experiments.serving.serve import request_row
    row = request_row(rec, t0)
    assert row["itl_s"] == rec.itl_s and row["client_itl_s"] == rec.client_itl_s
    assert row["ttft_s"] == rec.ttft_s and row["client_ttft_s"] == rec.client_ttft_s
    m = summarize([row], 1000.0, 100.0, 2)
    assert m["itl_ms"]["p50"] == pytest.approx(10.0) and m["client_itl_ms"]["p50"] == pytest.approx(0.0, abs=1e-6)
    assert m["ttft_ms"]["p50"] == pytest.approx(50.0) and m["client_ttft_ms"]["p50"] == pytest.approx(60.0)


@pytest.mark.parametrize("sender", ["reports", "dies"])
def test_a_handoff_that_ends_before_its_senders_report_keeps_its_transfer(sender):
    """The decode worker imports the KV and makes the last token before the prefill worker's stream
    says the KV was sent (two poll threads, no order between them). The record still counts the
    bytes, and wait() returns once the sender's report is in, or the sender is gone."""
    pool = fake_pool({"prefill:0": "A", "decode:0": "B"})
    router = Router(pool, clock=lambda: 1000.0)
    p, d = pool.find("prefill:0"), pool.find("decode:0")
    rec = router.submit("a", [1] * 100, greedy(2))
    aid = submitted(pool)[-1][0]
    with router._lock:
        router._on_event(p, step(aid, 7, 1000.05, "handoff"), 1000.06)
        router._on_event(d, {"kind": "imported", "rid": aid, "bytes": 640, "recv_s": 0.002,
                             "arrived": 1000.055, "time": 1000.056}, 1000.06)
        router._on_event(d, step(aid, 8, 1000.07, "length"), 1000.08)
    assert rec.status == "ok" and rec.transfer_bytes == 640 and rec.transfer_s is None
    assert not router.wait(timeout_s=0.05)                  # the sender has not reported
    served = ServeMetrics()                                 # the server counts the request as it ends
    served.ended("completed", rec, 2)
    for worker, direction in (("prefill:0", "sent"), ("decode:0", "received")):
        labels = {"worker": worker, "direction": direction}
        assert served.registry.get_sample_value("pdlab_kv_transfers_total", labels) == 1
        assert served.registry.get_sample_value("pdlab_kv_transfer_bytes_total", labels) == 640
    with router._lock:
        router._on_event(d, {"kind": "sent", "rid": aid, "dst": d.rank, "bytes": 640, "seconds": 0.002,
                             "start": 1000.051}, 1000.09)   # not from its sender: ignored
    assert not router.wait(timeout_s=0.05)
    with router._lock:
        if sender == "reports":
            router._on_event(p, {"kind": "sent", "rid": aid, "dst": d.rank, "bytes": 640, "seconds": 0.003,
                                 "start": 1000.051}, 1000.09)
        else:
            router._on_dead(p, "worker prefill:0 died")
    assert router.wait(timeout_s=1.0)
    assert rec.transfer_bytes == 640
    if sender == "reports":
        assert rec.transfer_s == 0.003 and rec.kv_send_start == pytest.approx(1000.051)
    else:
        assert rec.transfer_s is None and rec.status == "ok"


def test_auto_bundles_share_each_node_out_and_keep_a_core_for_the_driver():
    one = lambda cpus, gpus: [{"id": "A", "cpus": cpus, "gpus": gpus}]      # noqa: E731
    assert bundle_cpus("auto", one(2, 2), 2, "A") == 1          # this machine, the default layouts
    assert bundle_cpus("auto", one(2, 16), 2, "A") == 1         # more (fake) GPUs than workers
    assert bundle_cpus("auto", one(16, 2), 2, "A") == 7         # one core left for the driver
    assert bundle_cpus("auto", one(16, 2), 2, "elsewhere") == 8
    assert bundle_cpus("auto", one(2, 4), 3, "A") == 0          # more workers than cores: reserve nothing
    assert bundle_cpus(2.5, one(2, 2), 2, "A") == 2.5           # as set
    # a cluster: the driver on a CPU-only head, GPU nodes of 4 and 2 GPUs; a bundle may land on either
    nodes = [{"id": "head", "cpus": 4, "gpus": 0}, {"id": "B", "cpus": 8, "gpus": 4}, {"id": "C", "cpus": 8, "gpus": 2}]
    assert bundle_cpus("auto", nodes, 4, "head") == 2
    assert bundle_cpus("auto", nodes, 1, "head") == 8


def test_cores_are_assigned_per_node_disjoint_or_shared_with_a_reason():
    got = assign_cores([0, 1], 2, 1, driver_here=True)                     # no spare core for the driver
    assert got.per_worker == [[0], [1]] and got.dedicated and got.reason is None
    got = assign_cores(list(range(16)), 2, 7, driver_here=True)
    assert got.per_worker == [list(range(0, 7)), list(range(7, 14))] and got.dedicated
    got = assign_cores([0, 1, 2], 2, 8, driver_here=True)                  # Ray counts more CPUs than there are
    assert got.per_worker == [[0], [1]] and got.dedicated                  # core 2 left for the driver
    got = assign_cores([4, 5, 6, 7], 2, 2, driver_here=False)
    assert got.per_worker == [[4, 5], [6, 7]]
    got = assign_cores([0, 1], 3, 1, driver_here=True)
    assert got.per_worker == [[0, 1]] * 3 and not got.dedicated and got.reason == "3 workers on 2 cores"
    got = assign_cores([0, 1, 2, 3], 2, 0, driver_here=False)
    assert not got.dedicated and got.reason.startswith("0 CPUs reserved per worker (cluster.cpus_per_worker)")
    assert threads_for([0, 1, 2], 1, 0) == 3 and threads_for([0, 1], 3, 0) == 1 and threads_for([0], 1, 4) == 4


@pytest.mark.parametrize("value", ["many", -1, True])
def test_bad_cpus_per_worker_names_the_key(value):
    with pytest.raises(ValueError, match="cluster.cpus_per_worker="):
        ClusterConfig(cpus_per_worker=value)
