"""Goodput-per-GPU estimates per serving mode: feasibility, link monotonicity, interference, ties."""
import math

import pytest

from experiments.analysis.decision import (MODES, ModeEstimate, best, crossover_link_bw,
                                           crossover_prompt_len, estimate, exposed_transfer, least_link_bw)
from experiments.hardware import HARDWARE, decode_cost, mixed_cost, prefill_cost
from workers.config import preset

CFG = preset("llama-3-8b")
H200 = HARDWARE["h200"]
NVLINK = H200.nvlink_bw  # 450e9 bytes/s
PREFILL_FIRST, CHUNKED, DISAGG = MODES

# Tight-TPOT case, found by reasoning: Lp=4096, Lo=256 on 4 GPUs with a TPOT SLO of 3.5 ms, about
# 8% above one bare decode step (t_dec(1, C) = 3.24 ms, almost all of it the 15 GB weight read).
# A colocated step then has room for only a small prompt chunk and a couple of decodes (the chunk
# also reads its prompt's earlier KV), and prefill-first stalls decodes for 62 ms prefills; a
# decode GPU spends the whole 0.26 ms of slack on extra sequences, as long as the KV transfer,
# spread over Lo - 1 tokens, does not eat it: x / 255 <= ~0.02 ms needs a link of tens of GB/s.
TIGHT = dict(num_gpus=4, prompt_len=4096, output_len=256, slo_ttft_s=1.0, slo_tpot_s=0.0035)


def by_mode(estimates):
    return {e.mode: e for e in estimates}


def test_chat_shapes_every_mode_positive_finite_and_within_slos():
    slo_ttft_s, slo_tpot_s = 2.0, 0.1
    est = estimate(CFG, H200, num_gpus=2, prompt_len=512, output_len=256, link_bw=NVLINK,
                   slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)
    assert [e.mode for e in est] == list(MODES)
    for e in est:
        assert 0 < e.goodput_per_gpu < math.inf, e
        assert e.ttft_s <= slo_ttft_s * (1 + 1e-9) and e.tpot_s <= slo_tpot_s * (1 + 1e-9), e
        assert "infeasible" not in e.detail and e.detail["binding"]
    m = by_mode(est)
    assert m[CHUNKED].detail["chunk"] in m[CHUNKED].detail["chunks_tried"]
    assert m[DISAGG].detail["split"] == "1:1"          # the only split of 2 GPUs


def test_step_times_are_the_roofline_ones():
    """The batch scan evaluates step times as lines in B; they must equal roofline's counts."""
    lp, lo = 1024, 256
    m = by_mode(estimate(CFG, H200, 2, lp, lo, NVLINK, slo_ttft_s=2.0, slo_tpot_s=0.05))
    pf = m[PREFILL_FIRST].detail
    assert pf["step_s"] == pytest.approx(decode_cost(CFG, pf["batch"], lp + lo // 2).time(H200))
    assert pf["prefill_s"] == pytest.approx(prefill_cost(CFG, lp).time(H200))
    # A chunk as long as the prompt has no earlier chunks, so its step is mixed_cost exactly;
    # a shorter chunk also attends to and reads its prompt's earlier chunks, so it costs more.
    for lp, chunk, more in ((128, 128, False), (2048, 512, True)):
        ch = by_mode(estimate(CFG, H200, 2, lp, lo, NVLINK, slo_ttft_s=2.0, slo_tpot_s=0.01))[CHUNKED]
        assert ch.detail["chunk"] == chunk
        plain = mixed_cost(CFG, ch.detail["batch"], lp + lo // 2, chunk).time(H200)
        assert ch.tpot_s > plain * 1.01 if more else ch.tpot_s == pytest.approx(plain)

def test_disaggregated_goodput_never_rises_as_the_link_slows():
    bws = [NVLINK, 50e9, 1e10, 1e9, 1e8]
    runs = [by_mode(estimate(CFG, H200, 4, 2048, 256, bw, 1.0, 0.05))[DISAGG] for bw in bws]
    goodputs = [e.goodput_per_gpu for e in runs]
    assert all(a >= b for a, b in zip(goodputs, goodputs[1:])), goodputs
    assert goodputs[bws.index(1e9)] < goodputs[0]
    assert runs[bws.index(1e9)].detail["binding"] == "link"


def test_slow_link_transfer_eats_the_gain_and_crossover_is_found():
    args = dict(TIGHT)
    slow = by_mode(estimate(CFG, H200, link_bw=1e8, **args))
    fast = by_mode(estimate(CFG, H200, link_bw=NVLINK, **args))
    assert best(list(fast.values())).mode == DISAGG                  # by more than the 5% tie band
    assert fast[DISAGG].goodput_per_gpu > 1.05 * fast[CHUNKED].goodput_per_gpu
    assert best(list(slow.values())).mode == CHUNKED
    assert slow[DISAGG].goodput_per_gpu < slow[CHUNKED].goodput_per_gpu
    bws = [1e8, 1e9, 1e10, 5e10, NVLINK]
    out = crossover_link_bw(CFG, H200, link_bws=bws, **args)
    assert out["winners"][0] == CHUNKED and out["winners"][-1] == DISAGG
    assert bws[0] <= out["crossover_link_bw"] < bws[-1]
    above = [w for bw, w in zip(bws, out["winners"]) if bw > out["crossover_link_bw"]]
    assert set(above) == {DISAGG}


def test_interference_prefill_first_tpot_exceeds_chunked():
    # 8k prompts, TPOT SLO 10 ms: every 133 ms prefill stalls the decodes, so prefill-first runs
    # into the TPOT SLO; chunked steps carry a bounded chunk and stay well under it.
    m = by_mode(estimate(CFG, H200, 2, 8192, 256, 50e9, slo_ttft_s=1.0, slo_tpot_s=0.010))
    pf, ch = m[PREFILL_FIRST], m[CHUNKED]
    assert pf.detail["binding"] == "tpot"
    assert pf.tpot_s > ch.tpot_s
    assert pf.goodput_per_gpu < ch.goodput_per_gpu


def test_disaggregated_meets_a_tpot_slo_prefill_first_cannot_at_its_rate():
    # In a mean model prefill-first meets any TPOT SLO above t_dec(1) at a vanishing rate, so
    # "cannot" is at the rate disaggregation sustains: there a worker's TPOT is at least
    # t_dec(1, C) / (1 - lam * t_pre) (one decode, prefill share lam * t_pre), above the SLO.
    m = by_mode(estimate(CFG, H200, link_bw=NVLINK, **TIGHT))
    dis, pf = m[DISAGG], m[PREFILL_FIRST]
    assert dis.goodput_per_gpu > 0 and dis.tpot_s <= TIGHT["slo_tpot_s"]
    lam = dis.goodput_per_gpu                          # per GPU = per colocated worker
    t_pre = prefill_cost(CFG, TIGHT["prompt_len"]).time(H200)
    context = TIGHT["prompt_len"] + TIGHT["output_len"] // 2
    pf_tpot_floor = decode_cost(CFG, 1, context).time(H200) / (1 - lam * t_pre)
    assert pf_tpot_floor > TIGHT["slo_tpot_s"]
    assert pf.detail["binding"] == "tpot" and pf.goodput_per_gpu < lam


def test_infeasible_slos_give_zero_with_a_reason():
    lp = 2048
    t_pre = prefill_cost(CFG, lp).time(H200)
    est = estimate(CFG, H200, 2, lp, 256, NVLINK, slo_ttft_s=0.5 * t_pre, slo_tpot_s=0.05)
    for e in est:
        assert e.goodput_per_gpu == 0.0 and "ttft" in e.detail["infeasible"], e
    out = crossover_prompt_len(CFG, H200, 2, 256, NVLINK, 0.5 * t_pre, 0.05, [lp])
    assert out["winners"] == [None] and out["goodput_per_gpu"] == [0.0]
    # KV memory: an HBM smaller than the weights leaves no room for a single request.
    for e in estimate(CFG, H200, 2, lp, 256, NVLINK, 1.0, 0.05, hbm_bytes=10e9):
        assert e.goodput_per_gpu == 0.0 and "memory" in e.detail["infeasible"], e
    with pytest.raises(ValueError, match="output_len=1"):
        estimate(CFG, H200, 2, lp, 1, NVLINK, 1.0, 0.05)


def test_one_gpu_cannot_disaggregate():
    e = by_mode(estimate(CFG, H200, 1, 512, 128, NVLINK, 1.0, 0.05))[DISAGG]
    assert e.goodput_per_gpu == 0.0 and "2 GPUs" in e.detail["infeasible"]


def test_best_prefers_the_simpler_mode_within_five_percent():
    def est(mode, g):
        return ModeEstimate(mode, g, 0.1, 0.01, {})
    assert best([est(CHUNKED, 100.0), est(DISAGG, 104.0)]).mode == CHUNKED
    assert best([est(CHUNKED, 100.0), est(DISAGG, 106.0)]).mode == DISAGG
    assert best([est(DISAGG, 100.0), est(PREFILL_FIRST, 96.0), est(CHUNKED, 99.0)]).mode == PREFILL_FIRST
    assert best([est(PREFILL_FIRST, 0.0), est(CHUNKED, 0.0), est(DISAGG, 0.0)]).mode == PREFILL_FIRST


def test_crossover_prompt_len_reports_the_first_change():
    lens = [4096, 1024, 2048]                           # unsorted on purpose
    out = crossover_prompt_len(CFG, H200, TIGHT["num_gpus"], TIGHT["output_len"], NVLINK,
                               TIGHT["slo_ttft_s"], TIGHT["slo_tpot_s"], lens)
    assert out["prompt_lens"] == [1024, 2048, 4096]
    assert out["winners"] == [CHUNKED, CHUNKED, DISAGG]
    assert out["crossover_prompt_len"] == 4096
    flat = crossover_prompt_len(CFG, H200, 2, 256, 50e9, 1.0, 0.05, [512, 2048])
    assert flat["crossover_prompt_len"] is None and len(set(flat["winners"])) == 1


def test_exposed_transfer_is_the_last_layer_while_the_link_keeps_up_and_the_tail_when_it_does_not():
    # 32 layers, prefill 64 ms: a layer computes in 2 ms.
    assert exposed_transfer(0.032, 0.064, 32, "off") == 0.032
    assert exposed_transfer(0.032, 0.064, 32, "layer") == pytest.approx(0.001)      # 1 ms a layer < 2 ms
    # 320 ms of transfer: the link falls behind; all but the first 31 layers' compute time shows.
    assert exposed_transfer(0.320, 0.064, 32, "layer") == pytest.approx(0.320 - 0.062)
    with pytest.raises(ValueError, match="stream='chunk'"):
        estimate(CFG, H200, link_bw=NVLINK, stream="chunk", **TIGHT)


def test_streaming_lowers_the_link_bandwidth_disaggregation_needs():
    off = least_link_bw(CFG, H200, **TIGHT, stream="off")
    layer = least_link_bw(CFG, H200, **TIGHT, stream="layer")
    assert off is not None and layer is not None and layer < off / 2
    for bw, stream in ((off * 1.05, "off"), (layer * 1.05, "layer")):      # it does win just above the bound
        assert best(estimate(CFG, H200, link_bw=bw, stream=stream, **TIGHT)).mode == DISAGG
    assert best(estimate(CFG, H200, link_bw=off * 0.9, stream="off", **TIGHT)).mode != DISAGG
    assert best(estimate(CFG, H200, link_bw=layer * 0.9, stream="layer", **TIGHT)).mode != DISAGG
    streamed = by_mode(estimate(CFG, H200, link_bw=layer * 1.05, stream="layer", **TIGHT))[DISAGG]
    assert streamed.detail["t_exposed_s"] < streamed.detail["t_xfer_s"]


def test_the_decision_map_and_the_planner_take_prompts_up_to_the_model_s_context():
    """An 8,192-token prompt for Llama-3-8B (context 8,192) is a valid cell: the workload schema caps
    nothing, each request is fitted to the context (the prompt gives way to the output), and the
    simulator serves it on two datasheet H200s."""
    from hydra import compose, initialize_config_dir

    from experiments.analysis.decision_sim import cell_config
    from experiments.config import apply_layout, parse
    from experiments.config import CONF_DIR
    from experiments.workload import build_workload
    from experiments.sim.backend import simulate

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        base = compose("config", overrides=["model=llama-3-8b", "hardware=h200", "cluster.gpus=2"])
    cfg = cell_config(base, 8192, 256, {"ttft_ms": 2000.0, "tpot_ms": 50.0}, 50e9)
    spec = parse(apply_layout(cfg, "1p1d"))
    assert spec.max_model_len == 8192 and spec.workload.prompt_len.value == 8192
    arrivals = build_workload(spec.workload, spec.vocab_size, spec.max_model_len, 0, token_ids=False)[:4]
    assert {(a.num_prompt_tokens, a.max_tokens) for a in arrivals} == {(8192 - 256, 256)}
    sim = simulate(spec, arrivals, record_steps=False, keep_tokens=False)
    assert all(r.status == "ok" and r.num_out == 256 for r in sim.records.values())
