"""Runs of steps (decode runs, chunk runs) against scheduling every step: the same steps, records,
blocks and router loads (experiments/sim/runs.py)."""
import numpy as np
import pytest

from experiments.sim.engine import SimEngine
from experiments.sim.request import sim_request
from experiments.sim.records import request_row, step_rows
from experiments.sim.simulator import Arrival, SimConfig, Simulator
from experiments.sim.stepmodel import LinearStepModel
from tests.test_sim import MS, colocated, costs, ms
from workers.config import EngineConfig


def test_decode_runs_give_the_scheduler_s_steps_and_preempt_when_blocks_run_out():
    """Fast-forwarded and step-by-step simulations agree step for step, preemptions included."""
    arrivals = [Arrival(f"r{i}", 0.0004 * i, 40 + 13 * i, 30 + 7 * i) for i in range(6)]
    logs = []
    for ff in (True, False):
        sim = Simulator(colocated(budget=32, blocks=24, fast_forward=ff), costs())
        recs = sim.run(arrivals)
        assert all(r.status == "ok" for r in recs)
        logs.append(([{k: round(v, 9) if isinstance(v, float) else v for k, v in s.items()}
                      for s in step_rows("w", sim.workers[0].log)], [ms(r.token_times()) for r in recs]))
    assert logs[0] == logs[1]
    assert sum(s["num_preempted"] for s in logs[0][0]) > 0, "the pool is small enough to preempt"


def _rounded(x):
    """x with every float rounded to 1e-9 (a run's step times are summed in another order than
    step by step: they agree to far below a nanosecond)."""
    if isinstance(x, float):
        return round(x, 9)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v) for v in x]
    return x


@pytest.mark.parametrize("layout", ["colocated", "disaggregated"])
def test_chunk_runs_give_the_scheduler_s_steps_records_and_loads(layout):
    """A prompt chunked beside running decodes (or alone, on a prefill worker) is advanced as a run of
    steps: its chunks, first token, KV export and handoff, the decodes' tokens and the blocks come out
    as scheduling every step gives them, with arrivals cutting runs, two workers sharing a host, steps
    varying by the spread's draws and some requests timing out."""
    from router.config import RouterConfig

    if layout == "colocated":
        roles, engines = ["colocated"] * 2, {"colocated": EngineConfig(policy="chunked", token_budget=48)}
        blocks = {"colocated": 120}
    else:
        roles = ["prefill", "decode"]
        engines = {"prefill": EngineConfig(policy="chunked", token_budget=40),
                   "decode": EngineConfig(policy="chunked", token_budget=64)}
        blocks = {"prefill": 80, "decode": 120}
    cfg = dict(roles=roles, engines=engines, num_blocks=blocks, kv_bytes_per_token=1000, num_layers=4,
               max_model_len=4096, router=RouterConfig(request_timeout_s=0.06))
    arrivals = [Arrival(f"r{i}", 0.0015 * i, 30 + 23 * (i % 7), 1 + 9 * (i % 5)) for i in range(30)]
    seen, chunk_runs = [], []
    for ff in (True, False):
        sim = Simulator(SimConfig(**cfg, fast_forward=ff),
                        costs(gap=(0.05, 0.01), dispatch=0.2, ret=0.1, export=(0.3, 1e-9),
                              factors={"shared_host": 1.3, "spread": 0.3}))
        recs = sim.run(arrivals)
        chunk_runs.append(sum(1 for w in sim.workers for e in w.log if isinstance(e, dict) and e["prefill"] is not None))
        for w in sim.workers:
            w.engine.blocks.check()
            assert w.engine.blocks.num_used == 0
        assert all((l.prompt_tokens, l.running, l.kv_tokens) == (0, 0, 0) for l in sim.loads.values())
        rows = [_rounded(request_row(r)) for r in recs]
        steps = [_rounded(s) for w in sim.workers for s in step_rows(w.name, w.log)]
        seen.append((rows, steps))
    assert chunk_runs[0] > 0 and chunk_runs[1] == 0
    assert seen[0][0] == seen[1][0]
    assert seen[0][1] == seen[1][1]
    statuses = {r["status"] for r in seen[0][0]}
    assert statuses == {"ok", "failed"}, "some finish, some time out"


def test_a_lone_last_prompt_token_makes_the_first_token_in_a_step_of_its_own():
    """A 33-token prompt in a 32-token budget leaves its last token alone, which the scheduler counts
    as a decode: it still ends the prefill (TTFT, queue and prefill times), fast-forwarded or not."""
    rows = []
    for ff in (True, False):
        rec, = Simulator(colocated(budget=32, fast_forward=ff), costs()).run([Arrival("a", 0.0, 33, 6)])
        rows.append(request_row(rec))
    for key in ("ttft_s", "queue_s", "prefill_s", "e2e_s"):
        assert rows[0][key] == pytest.approx(rows[1][key], abs=1e-12), key
    assert rows[0]["itl_s"] == pytest.approx(rows[1]["itl_s"], abs=1e-12)
    assert rows[0]["prefill_s"] > 0 and len(rows[0]["itl_s"]) == 5


@pytest.mark.parametrize("keep", [True, False])
def test_a_decode_batch_keeps_the_records_and_blocks_of_step_by_step_serving(keep):
    """A decode worker's batch is advanced run by run and its records brought up to date only when read:
    requests joining it, finishing, timing out in the middle of it (dropped, then aborted) and taking
    new blocks give the records, token times, pooled gaps, blocks and router loads of scheduling every step."""
    from router.config import RouterConfig

    cfg = dict(roles=["prefill", "decode"], engines={"prefill": EngineConfig(policy="prefill_first", token_budget=4096),
                                                      "decode": EngineConfig(policy="chunked", token_budget=64)},
               num_blocks={"prefill": 200, "decode": 60}, kv_bytes_per_token=1000, num_layers=4, max_model_len=4096,
               router=RouterConfig(request_timeout_s=0.05), keep_tokens=keep, pool_gaps=not keep)
    arrivals = [Arrival(f"r{i}", 0.002 * i, 20 + 9 * i, 12 + 11 * (i % 4)) for i in range(12)]
    seen = []
    for ff in (True, False):
        sim = Simulator(SimConfig(**cfg, fast_forward=ff), costs())
        recs = sim.run(arrivals)
        runs = sum(1 for w in sim.workers for e in w.log if isinstance(e, dict))
        assert (runs > 0) == ff
        decode = sim.workers[1].engine.blocks
        decode.check()
        assert decode.num_used == 0
        assert all((l.prompt_tokens, l.running, l.kv_tokens) == (0, 0, 0) for l in sim.loads.values()), \
            "the router's loads return to zero"
        row = [tuple(round(v, 9) if isinstance(v, float) else v for v in
                     (r.status, r.reason, r.num_out, r.first_time, r.last_time, r.client_first, r.client_last,
                      r.decode_s, r.handoff_s)) for r in recs]
        if keep:
            row.append([ms(r.token_times()) + ms(r.client_times()) for r in recs])
        else:
            ok = np.array([r.status == "ok" for r in recs])
            made, got, weights = sim.gaps.pooled(ok)
            times = weights.astype(int)                          # the gaps of completed requests, each once
            row.append(sorted(zip(np.repeat(np.round(made, 9), times).tolist(), np.repeat(np.round(got, 9), times).tolist())))
        row.append([{k: round(v, 9) if isinstance(v, float) else v for k, v in s.items()}
                    for s in step_rows("decode", sim.workers[1].log)])
        seen.append(row)
    assert seen[0] == seen[1]
    statuses = [r[0] for r in seen[0][:12]]
    assert "ok" in statuses and "failed" in statuses, "some finish, some time out while decoding"


def test_engine_run_length_respects_waiting_prompts_and_blocks():
    e = SimEngine(EngineConfig(policy="chunked", token_budget=8, max_batch=2), 6, LinearStepModel([MS] + [0.0] * 5))
    e.add(sim_request("a", 16, 100, 0.0))
    e.finish(e.schedule()[0], 0.0, 0.001)
    e.finish(e.schedule()[0], 0.001, 0.002)       # the prompt in two chunks of 8: a decode at 16, 99 to go
    assert e.run_length() == 80                   # 5 free blocks cover 80 more tokens (one held covers 16)
    e.add(sim_request("b", 4, 2, 0.0))
    assert e.run_length() == 0                    # b could be admitted: schedule for real


def test_decode_runs_show_the_router_the_kv_load_scheduled_steps_show():
    """With several decode workers the router places each handoff by their KV loads while decode runs are in
    flight. A run's steps count in those loads as they end, as a scheduled step's tokens do, so advancing runs
    in one event picks the decode workers, and gives the token times, that scheduling every step gives, also
    when a step's tokens reach the router well after it ends (return_s)."""
    cfg = dict(roles=["prefill"] + ["decode"] * 3,
               engines={"prefill": EngineConfig(policy="chunked", token_budget=256),
                        "decode": EngineConfig(policy="chunked", token_budget=64)},
               num_blocks={"prefill": 400, "decode": 400}, kv_bytes_per_token=1000, num_layers=4, max_model_len=4096)
    arrivals = [Arrival(f"r{i}", 0.004 * i, 20 + 37 * (i % 5), 10 + 17 * (i % 7)) for i in range(40)]
    seen = []
    for ff in (True, False):
        sim = Simulator(SimConfig(**cfg, fast_forward=ff), costs(dispatch=0.2, ret=3.0))
        recs = sim.run(arrivals)
        assert all(r.status == "ok" for r in recs)
        seen.append([(r.decode_worker, ms(r.token_times())) for r in recs])
    assert len({w for w, _ in seen[0]}) == 3, "every decode worker serves"
    assert seen[0] == seen[1]


@pytest.mark.parametrize("layout,overrides,shows", [
    ("colocated-chunked", ["workload=code"], "served"),
    ("colocated-prefill_first", ["workload=chat", "scheduler.num_kv_blocks=600"], "served"),
    ("2p6d", ["workload=chat", "transfer.stream=layer", "fault.kill_worker=decode:1", "fault.kill_after_s=1.0"],
     "retried"),
    ("3p5d", ["workload=code", "router.request_timeout_s=1.5", "scheduler.max_batch=8"], "timed out"),
])
def test_fast_forwarding_changes_no_record_of_a_cluster_under_load(layout, overrides, shows):
    """Runs are a speed-up only: on a loaded 8-GPU cluster (several workers a role, so the router's choices
    read the loads runs leave; a small KV pool, a killed worker, timeouts), every requests.jsonl field is
    what scheduling every step gives."""
    import dataclasses

    from experiments.compose import compose_config
    from experiments.config import apply_layout, parse
    from experiments.sim.backend import costs_for, simulate
    from experiments.workload import build_workload

    cfg = compose_config("config", ["compare=null", "cluster.gpus=8", "model=llama-3-8b", "hardware=h200",
                                    "scheduler.token_budget=512", *overrides])
    spec = parse(apply_layout(cfg, layout))
    w = dataclasses.replace(spec.workload, num_requests=1500, rate=8 * 12.0)
    arrivals = build_workload(w, spec.vocab_size, spec.max_model_len, spec.seed, token_ids=False)
    costs = costs_for(spec)
    rows = []
    for ff in (True, False):
        sim = simulate(spec, arrivals, costs, record_steps=False, fast_forward=ff)
        rows.append([request_row(r) for r in sim.records.values()])
    assert len(rows[0]) == len(rows[1]) == 1500
    for a, b in zip(*rows):                 # the same fields; times alike but for float rounding
        assert a.keys() == b.keys()
        for key in a:
            assert _close(a[key], b[key]), (a["id"], key, a[key], b[key])
    assert len({r["decode_worker"] for r in rows[0]}) > 1
    failed = [r for r in rows[0] if r["status"] != "ok"]
    retried = [r for r in rows[0] if r["retried_for"]]
    assert (shows, bool(failed), bool(retried)) in {("served", False, False), ("retried", False, True),
                                                    ("timed out", True, False)}


def _close(x, y) -> bool:
    if isinstance(x, float) and isinstance(y, float):
        return abs(x - y) <= 1e-12 + 1e-9 * abs(x)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_close(u, v) for u, v in zip(x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_close(x[k], y[k]) for k in x)
    return x == y
