"""The simulator against timelines worked by hand, the real engine's step sequence, and itself.

Hand-worked cases use a linear step model whose numbers make every step time exact in the test's head:
a step costs 1 ms plus 0.01 ms per prompt token plus 0.1 ms per decode (unless a case says otherwise).
"""
import pytest

from experiments.sim.costs import Costs
from experiments.sim.request import sim_request
from experiments.sim.records import request_row, step_rows
from experiments.sim.simulator import Arrival, SimConfig, Simulator
from experiments.sim.stepmodel import LinearStepModel, RooflineStepModel, chunk_features, features
from experiments.sim.transfer import Links, TransferModel, fit_transfer
from router.config import FaultConfig
from workers.config import EngineConfig

MS = 1e-3


def costs(coef=(1.0, 0.1, 0.0, 0.01, 0.0, 0.0), gap=(0.0, 0.0), dispatch=0.0, ret=0.0, link=(0.5, 1e9),
          export=(0.0, 0.0), import_=(0.0, 0.0), factors=None):
    model = LinearStepModel([c * MS for c in coef], [g * MS for g in gap], factors or {})
    return Costs(model, {"local": TransferModel(link[0] * MS, link[1])}, dispatch * MS, ret * MS,
                 (export[0] * MS, export[1]), (import_[0] * MS, import_[1]))


def colocated(policy="chunked", budget=64, blocks=200, workers=1, **kw):
    return SimConfig(["colocated"] * workers, {"colocated": EngineConfig(policy=policy, token_budget=budget)},
                     {"colocated": blocks}, kv_bytes_per_token=1000, num_layers=4, max_model_len=4096, **kw)


def ms(times):
    return [round(float(t) / MS, 6) for t in times]


@pytest.mark.parametrize("fast_forward", [True, False])
def test_one_request_chunked_by_hand(fast_forward):
    # dispatch 0.5 ms, host gap 0.1 ms, return 0.25 ms; prompt 100 in chunks of 64 and 36, 4 tokens
    sim = Simulator(colocated(fast_forward=fast_forward), costs(gap=(0.1, 0.0), dispatch=0.5, ret=0.25))
    rec, = sim.run([Arrival("a", 0.0, 100, 4)])
    # step 1 [0.6, 2.24]: 64 tokens (1.64 ms); step 2 [2.34, 3.70]: 36 tokens, first token;
    # decodes [3.80, 4.90], [5.00, 6.10], [6.20, 7.30] (1.1 ms each); tokens timed by their step's end,
    # and reaching the router 0.25 ms later
    assert ms(rec.token_times()) == pytest.approx([3.70, 4.90, 6.10, 7.30])
    assert ms(rec.client_times()) == pytest.approx([3.95, 5.15, 6.35, 7.55])
    row = request_row(rec)
    assert row["ttft_s"] == pytest.approx(3.70 * MS) and row["tpot_s"] == pytest.approx(1.2 * MS)
    assert row["client_ttft_s"] == pytest.approx(3.95 * MS) and row["exposed_transfer_s"] is None
    assert row["queue_s"] == pytest.approx(0.6 * MS) and row["prefill_s"] == pytest.approx(3.1 * MS)
    assert row["status"] == "ok" and row["finish_reason"] == "length" and row["output_len"] == 4
    steps = list(step_rows("colocated:0", sim.workers[0].log))
    assert [(s["num_prefill_tokens"], s["num_decode_seqs"]) for s in steps] == [(64, 0), (36, 0), (0, 1), (0, 1), (0, 1)]
    assert steps[-1]["num_blocks_used"] == 0 and steps[-1]["num_running"] == 0      # freed at the end
    assert steps[2]["num_blocks_used"] == 7                                          # 101 tokens of 16


@pytest.mark.parametrize("fast_forward", [True, False])
def test_two_requests_prefill_first_by_hand(fast_forward):
    # a step: 1 ms + 0.02 ms per prompt token + 0.1 ms per decode; A (50 tokens) at 0, B (30) at 0.5 ms
    c = costs(coef=(1.0, 0.1, 0.0, 0.02, 0.0, 0.0))
    sim = Simulator(colocated(policy="prefill_first", budget=4096, fast_forward=fast_forward), c)
    a, b = sim.run([Arrival("a", 0.0, 50, 3), Arrival("b", 0.5 * MS, 30, 3)])
    # [0, 2.0] A's prompt; [2.0, 3.7] B's prompt whole beside A's decode; [3.7, 4.9] both decode (A done);
    # [4.9, 6.0] B alone
    assert ms(a.token_times()) == pytest.approx([2.0, 3.7, 4.9])
    assert ms(b.token_times()) == pytest.approx([3.7, 4.9, 6.0])
    assert request_row(b)["ttft_s"] == pytest.approx(3.2 * MS)
    steps = list(step_rows("colocated:0", sim.workers[0].log))
    assert [(s["num_prefill_tokens"], s["num_decode_seqs"], s["num_running"]) for s in steps] == \
        [(50, 0, 1), (30, 1, 2), (0, 2, 1), (0, 1, 0)]


def test_one_request_disaggregated_by_hand():
    # prefill 100 tokens [0, 2.0] makes the first token; export 0.2 ms, which the router then hears of;
    # KV 100 x 1000 bytes over 0.5 ms + 1 GB/s: [2.2, 2.8]; the decode worker imports (0.3 ms) and
    # decodes [3.1, 4.2], [4.2, 5.3]
    cfg = SimConfig(["prefill", "decode"], {"prefill": EngineConfig(policy="prefill_first", token_budget=4096),
                                            "decode": EngineConfig(policy="chunked", token_budget=64)},
                    {"prefill": 100, "decode": 100}, kv_bytes_per_token=1000, num_layers=4, max_model_len=4096)
    c = costs(coef=(1.0, 0.1, 0.0, 0.01, 0.0, 0.0), export=(0.2, 0.0), import_=(0.3, 0.0))
    sim = Simulator(cfg, c)
    rec, = sim.run([Arrival("a", 0.0, 100, 3)])
    assert ms(rec.token_times()) == pytest.approx([2.0, 4.2, 5.3])
    assert ms(rec.client_times()) == pytest.approx([2.2, 4.2, 5.3])
    row = request_row(rec)
    assert row["exposed_transfer_s"] == pytest.approx(0.8 * MS)     # KV in at 2.8, prefill ended at 2.0
    assert (row["prefill_worker"], row["decode_worker"]) == ("prefill:0", "decode:0")
    assert row["transfer_bytes"] == 100_000 and row["transfer_s"] == pytest.approx(0.6 * MS)
    assert row["handoff_s"] == pytest.approx(1.1 * MS)          # first token made at 2.0, decoded from 3.1
    assert sim.workers[0].engine.blocks.num_used == 0 and sim.workers[1].engine.blocks.num_used == 0


def test_a_calibrated_handoff_is_the_serving_fit_with_the_export_before_the_wire():
    # the calibration measured handoffs (prefill step end to last KV byte in) of 0.7 ms + bytes / 1 GB/s; the
    # profile's export is 0.2 ms, so the link gets 0.5 ms + bytes / 1 GB/s. Prefill [0, 2.0]; export to 2.2;
    # KV 100 x 1000 bytes [2.2, 2.8]: in 0.8 ms after the prefill, the fit's 0.7 + 0.1; import 0.3 ms,
    # decodes [3.1, 4.2], [4.2, 5.3]
    from experiments.sim.costs import serving_link

    link = serving_link({"latency_s": 0.7 * MS, "bandwidth": 1e9}, (0.2 * MS, 0.0), "zmq")
    assert (link.latency_s, link.bandwidth) == (pytest.approx(0.5 * MS), pytest.approx(1e9))
    assert serving_link({"latency_s": 0.1 * MS, "bandwidth": 2e9}, (0.2 * MS, 1e-9), "zmq").latency_s == 0.0
    cfg = SimConfig(["prefill", "decode"], {"prefill": EngineConfig(policy="prefill_first", token_budget=4096),
                                            "decode": EngineConfig(policy="chunked", token_budget=64)},
                    {"prefill": 100, "decode": 100}, kv_bytes_per_token=1000, num_layers=4, max_model_len=4096)
    c = costs(export=(0.2, 0.0), import_=(0.3, 0.0))
    c.transfer = {"local": link}
    rec, = Simulator(cfg, c).run([Arrival("a", 0.0, 100, 3)])
    assert request_row(rec)["exposed_transfer_s"] == pytest.approx(0.8 * MS)
    assert ms(rec.token_times()) == pytest.approx([2.0, 4.2, 5.3])


@pytest.mark.parametrize("stream,policy,budget,exposed_ms", [
    ("off", "prefill_first", 4096, 0.8),     # export 0.2 ms, then the whole transfer, 0.5 ms + 0.1 ms
    ("layer", "prefill_first", 4096, 0.525),  # only the last of 4 layers after the prefill: 0.5 + 0.025
    ("chunk", "prefill_first", 4096, 0.6),   # one chunk, the whole prompt: nothing overlaps
    ("chunk", "chunked", 64, 0.536),         # chunks of 64 and 36 tokens: the last 36% after the prefill
    ("chunk", "chunked", 99, 0.501),         # 99 and a lone last token (scheduled as a "decode"): 1%
])
def test_streamed_kv_exposes_only_what_the_prefill_does_not_hide(stream, policy, budget, exposed_ms):
    cfg = SimConfig(["prefill", "decode"], {"prefill": EngineConfig(policy=policy, token_budget=budget),
                                            "decode": EngineConfig(policy="chunked", token_budget=64)},
                    {"prefill": 100, "decode": 100}, kv_bytes_per_token=1000, num_layers=4, max_model_len=4096,
                    stream=stream)
    sim = Simulator(cfg, costs(export=(0.2, 0.0)))
    rec, = sim.run([Arrival("a", 0.0, 100, 3)])
    assert request_row(rec)["exposed_transfer_s"] == pytest.approx(exposed_ms * MS)


def test_link_contention_queues_transfers_first_come_first_served():
    links, model = Links(), TransferModel(0.0, 1e6)
    assert links.send(0, 2, 1e6, model, ready=0.0) == (0.0, 1.0)
    assert links.send(0, 3, 1e6, model, ready=0.5) == (1.0, 2.0)      # the sender's egress is busy until 1.0
    assert links.send(1, 2, 1e6, model, ready=0.5) == (1.0, 2.0)      # the receiver's ingress, likewise
    assert links.send(1, 4, 1e6, model, ready=2.5) == (2.5, 3.5)
    # streaming: may start at the prefill's start; ends no earlier than the last part after the prefill
    assert Links().send(0, 1, 1e6, model, ready=0.8, stream_start=0.0, last_part=0.25) == (0.0, pytest.approx(1.05))
    assert Links().send(0, 1, 1e6, model, ready=0.1, stream_start=0.0, last_part=0.25) == (0.0, pytest.approx(1.0))
    with pytest.raises(ValueError, match="last_part=0"):
        Links().send(0, 1, 1e6, model, ready=0.1, stream_start=0.0, last_part=0)


def test_transfer_fit_recovers_latency_and_bandwidth():
    sizes = [1e6, 4e6, 16e6]
    model, err = fit_transfer(sizes, [0.002 + b / 2e9 for b in sizes], "zmq")
    assert model.latency_s == pytest.approx(0.002) and model.bandwidth == pytest.approx(2e9)
    assert err["max_abs"] < 1e-9


def test_a_simulation_is_deterministic_and_a_worker_s_steps_reach_the_router_in_order():
    arrivals = [Arrival(f"r{i}", 0.003 * i, 50 + i, 20) for i in range(20)]

    def rows():
        sim = Simulator(colocated(workers=2), costs(ret=0.3, factors={"decode": 1.2, "shared_host": 1.5}))
        return [request_row(r) for r in sim.run(arrivals)]
    assert rows() == rows()
    assert all(min(r["itl_s"]) >= 0 for r in rows())


@pytest.mark.parametrize("layout", ["colocated", "disaggregated"])
def test_finished_requests_leave_nothing_for_the_cycle_collector(layout):
    """A million requests' attempts in cycles made the collector scan and free them in batches."""
    import gc

    from experiments.sim.records import Attempt
    from experiments.sim.request import SimRequest

    if layout == "colocated":
        cfg = colocated(workers=2)
    else:
        cfg = SimConfig(["prefill", "decode"], {"prefill": EngineConfig(policy="prefill_first", token_budget=512),
                                                "decode": EngineConfig(policy="chunked", token_budget=64)},
                        {"prefill": 200, "decode": 200}, kv_bytes_per_token=1000, num_layers=4, max_model_len=4096)
    arrivals = [Arrival(f"r{i}", 0.002 * i, 40 + i, 10) for i in range(30)]
    gc.collect()
    gc.disable()
    try:
        recs = Simulator(cfg, costs()).run(arrivals)
        assert all(r.status == "ok" for r in recs)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = [o for o in gc.garbage if isinstance(o, (Attempt, SimRequest))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []


def test_killed_worker_requests_are_retried_with_their_streamed_tokens():
    cfg = colocated(workers=2, fault=FaultConfig(kill_worker="colocated:0", kill_after_s=0.01))
    sim = Simulator(cfg, costs())
    recs = sim.run([Arrival(f"r{i}", 0.0, 30, 40) for i in range(4)])
    assert all(r.status == "ok" and r.num_out == 40 for r in recs)
    moved = [r for r in recs if r.attempts == 2]
    assert moved and all(r.decode_worker == "colocated:1" and r.injected_fault for r in moved)


def test_lost_transfer_is_retried_after_the_timeout():
    cfg = SimConfig(["prefill", "decode"], {"prefill": EngineConfig(policy="prefill_first", token_budget=4096),
                                            "decode": EngineConfig(policy="chunked", token_budget=64)},
                    {"prefill": 100, "decode": 100}, kv_bytes_per_token=1000, num_layers=4, max_model_len=4096,
                    fault=FaultConfig(timeout_transfer_of=1))
    sim = Simulator(cfg, costs())
    first, second = sim.run([Arrival("a", 0.0, 20, 5), Arrival("b", 0.0, 20, 5)])
    assert first.status == "ok" and first.attempts == 2 and first.injected_fault
    assert request_row(first)["ttft_s"] < 0.01 < request_row(first)["e2e_s"]    # stream resumed after the 10 s timeout
    assert second.attempts == 1 and not second.injected_fault


def test_roofline_step_model_counts_as_the_roofline_module():
    from experiments.hardware import HARDWARE, decode_cost, prefill_cost
    from workers.config import preset

    cfg, hw = preset("llama-3-8b"), HARDWARE["h200"]
    m = RooflineStepModel(cfg, hw, 2, compute_eff=1.0, mem_eff=1.0, overhead_s=0.0)
    assert m.time(chunk_features(32, 32 * 1024, [])) == pytest.approx(decode_cost(cfg, 32, 1024).time(hw))
    assert m.time(chunk_features(0, 0, [(2048, 0, True)])) == pytest.approx(prefill_cost(cfg, 2048).time(hw))
    run = m.decode_run(8, 8 * 500, 3)
    assert list(run) == pytest.approx([m.time(chunk_features(8, 8 * (500 + i), [])) for i in range(3)])


def test_features_read_the_scheduler_output():
    from workers.block_manager import BlockManager
    from workers.scheduler import Scheduler

    s = Scheduler(EngineConfig(policy="chunked", token_budget=40), BlockManager(50, 16))
    a, b = sim_request("a", 30, 5, 0.0), sim_request("b", 100, 5, 0.0)
    s.add(a)
    s.add(b)
    s.schedule()                                  # a: 30 tokens; b: its first 10
    a.num_computed_tokens, a.num_out = 30, 1
    b.num_computed_tokens = 10
    out = s.schedule()                            # a decodes at context 30; b's next 39 tokens from 10
    assert features(out) == (1, 30, 39, 1, 10, 39 * 10 + 39 * 40 // 2, 1, 39 * 10)


# -- against the real engine ------------------------------------------------------------------------
# -- the planner ------------------------------------------------------------------------------------
def _plan(prompt_len, output_len, coef, slo, max_batch=64, gpus=4, link=(0.0, 1e12), steps=4, shared=None, jobs=1):
    from hydra import compose, initialize_config_dir

    from experiments.analysis.plan import plan
    from tests.conftest import ROOT

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[
            "compare=null", "model=tiny", "workload=fixed", "workload.arrival=poisson", "workload.length_scale=1.0",
            f"workload.prompt_len.value={prompt_len}", f"workload.output_len.value={output_len}",
            f"slo.ttft_ms={slo[0]}", f"slo.tpot_ms={slo[1]}", f"scheduler.max_batch={max_batch}"])
    return plan(cfg, gpus, [64], probe=2, requests_per_worker=40, steps=steps, verify_requests_per_gpu=20,
                costs=costs(coef=coef, link=link), shared=shared, jobs=jobs)


def test_a_plan_in_processes_is_the_plan_in_one():
    """The independent searches and checks run in forked processes give the serial plan, its count of
    simulations included."""
    import os

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores to fork onto")
    args = (300, 30, (1.0, 0.05, 0.0, 0.01, 0.0, 0.0), (400, 20.0))
    one, two = _plan(*args, jobs=1), _plan(*args, jobs=2)
    for key in ("candidates", "best", "runner_up", "phases", "num_sims"):
        assert one[key] == two[key], key


def test_planner_disaggregates_with_most_gpus_prefilling_when_prompts_dominate_and_tpot_is_tight():
    # a 1,000-token prompt costs 101 ms, a decode step 1 ms whatever its batch; TPOT <= 3 ms: a prompt
    # (or a 64-token chunk, 1.64 ms) between decodes breaks it, so colocated serves only a trickle;
    # a decode GPU keeps up with far more requests than a prefill GPU, so 3 of 4 GPUs prefill
    result = _plan(1000, 20, (1.0, 0.0, 0.0, 0.1, 0.0, 0.0), (2000, 3.0))
    assert result["best"].layout == "3p1d"
    assert result["runner_up"].goodput_per_gpu < result["best"].goodput_per_gpu


def test_planner_keeps_colocated_when_decodes_dominate():
    # 8-token prompts cost next to nothing; each decode step 5 ms + 1 ms per sequence, at most 8 a
    # batch: every GPU decoding is worth more than any GPU kept for prompts; the best split, 1p3d,
    # serves 3/4 of what the colocated GPUs do (its decode GPUs are the colocated ones)
    result = _plan(8, 16, (5.0, 1.0, 0.0, 0.001, 0.0, 0.0), (100, 20.0), max_batch=8)
    best, runner = result["best"], result["runner_up"]
    assert best.layout.startswith("colocated") and runner.layout == "1p3d"
    assert runner.goodput_per_gpu == pytest.approx(0.75 * best.goodput_per_gpu, rel=0.1)


def test_plans_sharing_simulations_choose_as_plans_on_their_own_and_run_fewer():
    # the second SLO's plan reuses what does not depend on the SLO (the prefill probe: TTFT only); the
    # slow link's reuses the colocated searches but not the disaggregated ones, whose KV crosses it
    def view(result):
        return [(c.name, c.goodput_per_gpu, c.how) for c in result["candidates"]] + \
            [(c.name, c.goodput_per_gpu, c.attainment) for c in (result["best"], result["runner_up"])]
    coef = (1.0, 0.0, 0.0, 0.1, 0.0, 0.0)
    asked = [((2000, 3.0), (0.0, 1e12)), ((2000, 6.0), (0.0, 1e12)), ((2000, 3.0), (5.0, 1e6))]
    alone = [_plan(1000, 20, coef, slo, link=link, steps=2) for slo, link in asked]
    shared: dict = {}
    together = [_plan(1000, 20, coef, slo, link=link, steps=2, shared=shared) for slo, link in asked]
    assert [view(r) for r in together] == [view(r) for r in alone]
    assert view(alone[2]) != view(alone[0])                  # the slow link changes the disaggregated layouts
    assert together[0]["num_sims"] == alone[0]["num_sims"]
    assert 0 < together[1]["num_sims"] < alone[1]["num_sims"]
    assert 0 < together[2]["num_sims"] < alone[2]["num_sims"]


def test_the_counting_block_manager_decides_as_the_real_one():
    import random

    from experiments.sim.blocks import CountingBlockManager
    from workers.block_manager import BlockManager

    rnd = random.Random(3)
    real, counting = BlockManager(40, 4), CountingBlockManager(40, 4)
    tables_r, tables_c = [], []
    for _ in range(400):
        if tables_r and rnd.random() < 0.4:
            i = rnd.randrange(len(tables_r))
            real.free(tables_r.pop(i))
            counting.free(tables_c.pop(i))
        else:
            n = rnd.randint(1, 30)
            grow = tables_r and rnd.random() < 0.5          # a table that grows, or a new one
            i = rnd.randrange(len(tables_r)) if grow else None
            tr, tc = (tables_r[i], tables_c[i]) if grow else ([], [])
            n += len(tr) * 4
            assert real.can_allocate(tr, n) == counting.can_allocate(tc, n)
            if real.can_allocate(tr, n):
                real.allocate(tr, n)
                counting.allocate(tc, n)
                if not grow:
                    tables_r.append(tr)
                    tables_c.append(tc)
            else:
                with pytest.raises(RuntimeError, match="KV blocks with"):
                    counting.allocate(tc, n)
        assert [len(t) for t in tables_r] == [len(t) for t in tables_c]
        assert (real.num_free, real.num_used) == (counting.num_free, counting.num_used)
        counting.check()
    for t in tables_c:
        counting.free(t)
    assert counting.num_free == 40
    table = []
    counting.allocate(table, 8)
    counting.free(table)
    with pytest.raises(RuntimeError, match="freed twice"):
        counting.free(table)


# -- the commands -----------------------------------------------------------------------------------
def test_chunk_and_context_pairs_are_priced_apart():
    """A chunk's attention pairs within itself and against the cache have coefficients of their own (a
    profile before the split, six coefficients, prices both alike)."""
    c = [1e-3, 0.0, 0.0, 1e-5, 0.0, 2e-8, 1e-8]
    split, one = LinearStepModel(c), LinearStepModel(c[:6])
    f = chunk_features(0, 0, [(64, 768, False)])
    assert f[7] == 64 * 768 and f[5] == 64 * 768 + 64 * 65 // 2
    assert split.time(f) == pytest.approx(1e-3 + 64 * 1e-5 + 64 * 65 // 2 * 2e-8 + 64 * 768 * 1e-8)
    assert one.time(f) == pytest.approx(1e-3 + 64 * 1e-5 + f[5] * 2e-8)
    assert split.terms[-2:] == ("chunk_pairs", "context_pairs") and one.terms[-1] == "prefill_pairs"
