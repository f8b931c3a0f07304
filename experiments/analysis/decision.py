"""Estimated goodput per GPU of colocated (prefill-first, chunked) and disaggregated serving.

"Estimated" means a first-order model, nothing measured. Step times are roofline lower bounds
(`experiments.roofline`: max of FLOP and HBM time, so a mixed step overlaps prompt compute with
decode memory traffic perfectly, which flatters piggybacking). One request shape (prompt Lp,
output Lo); running decodes sit at the mean context C = Lp + Lo // 2; Little's law B = lam Lo TPOT.
Queueing is M/D/1 on prefill work only, W(u, s) = u s / (2 (1 - u)). SLOs are checked on the mean
request (mean TTFT, mean TPOT), never tails. Ignored: scheduling and launch overheads, preemption,
variance of shapes and arrivals, batching prompts on prefill GPUs, link queueing, KV of prompts in
flight. Goodput per GPU = the largest arrival rate (requests/s) the N GPUs sustain with the mean
request inside both SLOs, over N; 0.0 with detail["infeasible"] saying why if no rate does.
t_dec(B): decode step of B sequences at C; t_pre: prefill of Lp tokens; x: KV transfer of Lp
tokens; B_mem = (hbm_bytes - weight bytes) // ((Lp + Lo) kv_bytes_per_token) caps every decode
batch, hbm_bytes = HBM per GPU (default 141e9, H200; pass a large value for CPU-measured hardware).

colocated_prefill_first (Orca / vLLM v0, one GPU per worker): whole prompts run in iterations of
  their own that stall the decodes. u = lam t_pre; TPOT = t_dec / (1 - u) = t_dec + B t_pre / Lo
  (a token also waits for the prefill work landing between its steps); TTFT = t_pre + W(u, t_pre)
  + t_dec (a decode step in flight). pdlab's engine lets a prompt that fits the token budget share
  a step with the decodes, so for short prompts this overstates the cost (one weight read).
colocated_chunked (Sarathi-Serve, budget c + B, c in CHUNK_SIZES, best c reported): every step
  carries B decodes and c prompt tokens (conservative at light load) whose attention counts the
  prompt's earlier chunks (on average c (Lp+1)/2 query-key pairs, max(0, Lp - c)/2 cached tokens
  read): t_step(B). TPOT = t_step; u = lam Lp t_step / c; TTFT = ceil(Lp/c) t_step + W(u, Lp t_step
  / c) + t_step. Both colocated modes search the batch: B serves rates up to lam(B) = B / (Lo
  TPOT(B)), capped where TTFT (M/D/1 solved for u) or TPOT meets its SLO. lam(B) rises and the
  caps fall with B, so bisection finds the first B a cap cuts short (that SLO binds; the best rate
  is its cap there or lam(B - 1)), else B_mem ("memory" binds).
disaggregated (P prefill + D decode GPUs, P + D = N, every split tried, best reported): the rate is
  the least of prefill: lam <= P u* / t_pre with t_pre + W(u*, t_pre) = TTFT SLO (M/D/1 per GPU);
  link: lam <= min(P, D) link_bw / (Lp kv_bytes_per_token) (each GPU its own link);
  decode: lam <= D B_d / (Lo t_dec(B_d)), B_d the largest B <= B_mem with TPOT = t_dec(B) +
  e / (Lo - 1) inside the SLO (the exposed transfer e delays the second token). stream="off": the
  KV follows the prefill, e = x. stream="layer": layer i's KV (x / L of it) leaves as soon as layer i
  of L is computed, at i t_pre / L, and the link sends layers one after another, so the last byte
  lands at max_i(i t_pre / L + (L - i + 1) x / L): e = max(x / L, x - t_pre (L - 1) / L), the last
  layer's share when the link keeps up with the compute. Overlap hides latency only: the link's
  capacity cap above is the same in both modes.
"""
from __future__ import annotations

import bisect
import math
from collections import namedtuple
from dataclasses import dataclass

from experiments.hardware import Hardware, decode_cost, kv_transfer_time, mixed_cost, prefill_cost
from workers.config import ModelConfig

MODES = ("colocated_prefill_first", "colocated_chunked", "disaggregated")  # simplest first
CHUNK_SIZES = (128, 256, 512, 1024, 2048)
TIE_FRACTION = 0.05


@dataclass(frozen=True)
class ModeEstimate:
    mode: str
    goodput_per_gpu: float  # requests/s per GPU with the mean request inside both SLOs; 0.0 = none
    ttft_s: float           # at that rate; at the lightest load when infeasible
    tpot_s: float
    detail: dict            # batch, chunk or split, utilizations, "binding" or "infeasible"


# One estimate's inputs; context = C, batch_mem = B_mem.
_Case = namedtuple("_Case", "cfg hw num_gpus prompt_len output_len context link_bw slo_ttft_s "
                            "slo_tpot_s dtype_bytes batch_mem stream")
STREAMS = ("off", "layer")


def exposed_transfer(xfer_s: float, prefill_s: float, num_layers: int, stream: str) -> float:
    """The part of a KV transfer of xfer_s seconds left after a prefill of prefill_s (module docstring)."""
    if stream == "off":
        return xfer_s
    return max(xfer_s / num_layers, xfer_s - prefill_s * (num_layers - 1) / num_layers)


def _step_time(case: _Case, cost_at, extra_flops: float = 0.0, extra_bytes: float = 0.0):
    """Step time as a function of the decode batch B. A step's FLOPs and bytes are affine in B
    (roofline._step_cost), so its costs at B = 1 and 2 give the line exactly."""
    c1, c2 = cost_at(1), cost_at(2)
    df, db = c2.flops - c1.flops, c2.bytes - c1.bytes
    f0, b0 = c1.flops - df + extra_flops, c1.bytes - db + extra_bytes
    peak, bw = case.hw.peak_flops, case.hw.mem_bw
    return lambda b: max((f0 + df * b) / peak, (b0 + db * b) / bw)


def _wait(u: float, service_s: float) -> float:
    """M/D/1 mean wait in queue."""
    return u * service_s / (2 * (1 - u)) if u < 1 else math.inf


def _ttft_cap(slo_s: float, base_s: float, service_s: float) -> float:
    """Largest rate with base + W(rate * service, service) <= slo: u* = 2S / (service + 2S)."""
    slack = max(0.0, slo_s - base_s)  # service_s > 0, a roofline time
    return 2 * slack / (service_s + 2 * slack) / service_s


def _infeasible(case: _Case, mode: str, ttft_s: float, tpot_s: float, **detail):
    reasons = [r for r, bad in (
        ("needs 2 GPUs (one prefill, one decode)", mode == MODES[2] and case.num_gpus < 2),
        (f"ttft {ttft_s * 1e3:.1f} ms > SLO {case.slo_ttft_s * 1e3:.1f} ms", ttft_s > case.slo_ttft_s),
        (f"tpot {tpot_s * 1e3:.2f} ms > SLO {case.slo_tpot_s * 1e3:.2f} ms", tpot_s > case.slo_tpot_s),
        ("memory: one request's KV does not fit beside the weights", case.batch_mem < 1)) if bad]
    reason = "; ".join(reasons or ["ttft or tpot SLO unmet at any rate"]) + " at the lightest load"
    return ModeEstimate(mode, 0.0, ttft_s, tpot_s, {**detail, "infeasible": reason})


def _scan(case: _Case, mode: str, point, **extra) -> ModeEstimate:
    """Colocated search (module docstring). point(B) -> (lam(B), {slo: rate cap}, metrics(rate))."""
    mem = case.batch_mem
    if mem < 1:
        return _infeasible(case, mode, 0.0, 0.0, **extra)
    b = 1 + bisect.bisect_left(range(1, mem + 1), True,  # the first capped B, mem + 1 if none
                               key=lambda b: min(point(b)[1].values()) < point(b)[0])
    if b > mem:
        b, binding, rate = mem, "memory", point(mem)[0]
    else:
        binding, rate = min(point(b)[1].items(), key=lambda kv: kv[1])
        if b > 1 and point(b - 1)[0] >= rate:    # batch b - 1 at its full rate does better
            b, rate = b - 1, point(b - 1)[0]
    ttft, tpot, detail = point(b)[2](max(rate, 0.0))      # b == 1 if rate == 0: lightest load
    if rate <= 0:
        return _infeasible(case, mode, ttft, tpot, **extra, **detail)
    return ModeEstimate(mode, rate, ttft, tpot, {**extra, **detail, "binding": binding, "batch_mem": mem})


def _prefill_first(case: _Case) -> ModeEstimate:
    t_pre = prefill_cost(case.cfg, case.prompt_len, case.dtype_bytes).time(case.hw)
    t_dec = _step_time(case, lambda b: decode_cost(case.cfg, b, case.context, case.dtype_bytes))

    def point(b):
        td = t_dec(b)
        caps = {"ttft": _ttft_cap(case.slo_ttft_s, t_pre + td, t_pre),
                "tpot": max(0.0, 1 - td / case.slo_tpot_s) / t_pre}

        def metrics(rate):
            u = rate * t_pre
            return (t_pre + td + _wait(u, t_pre), td / (1 - u),
                    {"batch": b, "prefill_util": u, "step_s": td, "prefill_s": t_pre})
        return b / (case.output_len * td + b * t_pre), caps, metrics
    return _scan(case, MODES[0], point)


def _chunked(case: _Case, chunk: int) -> ModeEstimate:
    cfg, lp, dt = case.cfg, case.prompt_len, case.dtype_bytes
    pair_flops = decode_cost(cfg, 1, 1, dt).flops - decode_cost(cfg, 1, 0, dt).flops
    extra_pairs = chunk * (lp + 1) / 2 - chunk * (chunk + 1) / 2  # mixed_cost counts c(c+1)/2
    t_step = _step_time(case, lambda b: mixed_cost(cfg, b, case.context, chunk, dt),
                        extra_flops=extra_pairs * pair_flops,
                        extra_bytes=max(0, lp - chunk) / 2 * cfg.kv_bytes_per_token(dt))

    def point(b):
        ts = t_step(b)
        service = lp * ts / chunk                 # prefill time per prompt at c tokens a step
        base = math.ceil(lp / chunk) * ts + ts
        caps = {"ttft": _ttft_cap(case.slo_ttft_s, base, service),
                "tpot": math.inf if ts <= case.slo_tpot_s else 0.0}

        def metrics(rate):
            u = rate * service
            return (base + _wait(u, service), ts,
                    {"batch": b, "budget": chunk + b, "prefill_util": u, "step_s": ts})
        return b / (case.output_len * ts), caps, metrics
    return _scan(case, MODES[1], point, chunk=chunk)


def _disaggregated(case: _Case) -> ModeEstimate:
    cfg, lp, lo, dt, n = case.cfg, case.prompt_len, case.output_len, case.dtype_bytes, case.num_gpus
    t_pre, xfer = prefill_cost(cfg, lp, dt).time(case.hw), kv_transfer_time(cfg, lp, case.link_bw, dt)
    t_dec = _step_time(case, lambda b: decode_cost(cfg, b, case.context, dt))
    exposed = exposed_transfer(xfer, t_pre, cfg.num_layers, case.stream)
    per_token, mem = exposed / (lo - 1), case.batch_mem
    if n < 2 or t_pre >= case.slo_ttft_s or t_dec(1) + per_token > case.slo_tpot_s or mem < 1:
        return _infeasible(case, MODES[2], t_pre, t_dec(1) + per_token, t_xfer_s=xfer, t_exposed_s=exposed)
    b_d = bisect.bisect_right(range(1, mem + 1), case.slo_tpot_s, key=lambda b: t_dec(b) + per_token)
    per_gpu = {"prefill": _ttft_cap(case.slo_ttft_s, t_pre, t_pre),
               "link": case.link_bw / (lp * cfg.kv_bytes_per_token(dt)),
               "decode": b_d / (lo * t_dec(b_d))}
    splits = {p: {"prefill": p * per_gpu["prefill"], "link": min(p, n - p) * per_gpu["link"],
                  "decode": (n - p) * per_gpu["decode"]} for p in range(1, n)}
    p = max(splits, key=lambda k: min(splits[k].values()))
    caps, d = splits[p], n - p
    rate, u = min(caps.values()), min(caps.values()) / p * t_pre
    binding = {"prefill": "prefill (ttft)", "link": "link",
               "decode": "decode (memory)" if b_d == mem else "decode (tpot)"}[min(caps, key=caps.get)]
    b_op = 1 + bisect.bisect_left(range(1, b_d), rate * (1 - 1e-9),  # smallest B serving rate
                                  key=lambda b: d * b / (lo * t_dec(b)))
    detail = {"split": f"{p}:{d}", "batch": b_op, "batch_limit": b_d, "batch_mem": mem,
              "prefill_util": u, "link_util": rate / caps["link"], "decode_util": rate / caps["decode"],
              "t_xfer_s": xfer, "t_exposed_s": exposed, "stream": case.stream, "binding": binding, "capacities": caps,
              "splits_tried": {f"{k}:{n - k}": min(v.values()) / n for k, v in splits.items()}}
    return ModeEstimate(MODES[2], rate / n, t_pre + _wait(u, t_pre), t_dec(b_op) + per_token, detail)


def estimate(cfg: ModelConfig, hw: Hardware, num_gpus: int, prompt_len: int, output_len: int,
             link_bw: float, slo_ttft_s: float, slo_tpot_s: float, dtype_bytes: int = 2,
             hbm_bytes: float = 141e9, stream: str = "off") -> list[ModeEstimate]:
    """One ModeEstimate per mode, in MODES order (the model is in the module docstring). stream: how
    the KV moves, "off" (after the prefill) or "layer" (each layer as it is computed)."""
    if stream not in STREAMS:
        raise ValueError(f"stream={stream!r}: expected one of {', '.join(STREAMS)}")
    bad = [f"{k}={v}" for k, v, low in (
        ("num_gpus", num_gpus, 1), ("prompt_len", prompt_len, 1), ("output_len", output_len, 2),
        ("link_bw", link_bw, 0), ("slo_ttft_s", slo_ttft_s, 0), ("slo_tpot_s", slo_tpot_s, 0))
        if not (v >= low and v > 0)]
    if bad:  # TPOT needs a second output token
        raise ValueError(f"out of range: {', '.join(bad)} (counts >= 1, output_len >= 2, rates > 0)")
    free = hbm_bytes - cfg.num_params() * dtype_bytes
    batch_mem = max(0, int(free // ((prompt_len + output_len) * cfg.kv_bytes_per_token(dtype_bytes))))
    case = _Case(cfg, hw, num_gpus, prompt_len, output_len, prompt_len + output_len // 2, link_bw,
                 slo_ttft_s, slo_tpot_s, dtype_bytes, batch_mem, stream)
    tried = {c: _chunked(case, c) for c in CHUNK_SIZES}
    chunked = max(tried.values(), key=lambda e: e.goodput_per_gpu)
    if chunked.goodput_per_gpu == 0.0:  # report the chunk that comes closest to the SLOs
        chunked = min(tried.values(), key=lambda e: max(e.ttft_s / slo_ttft_s, e.tpot_s / slo_tpot_s))
    chunked.detail["chunks_tried"] = {c: e.goodput_per_gpu for c, e in tried.items()}
    return [_prefill_first(case), chunked, _disaggregated(case)]


def best(estimates: list[ModeEstimate]) -> ModeEstimate:
    """The highest goodput per GPU. Every mode within TIE_FRACTION (5%) of it ties, and a tie goes
    to the simpler mode in MODES order: colocated prefill-first (no chunk size to tune), then
    colocated chunked, then disaggregated. With all goodputs 0.0 that is the simplest mode."""
    top = max(e.goodput_per_gpu for e in estimates)
    tied = [e for e in estimates if e.goodput_per_gpu >= (1 - TIE_FRACTION) * top]
    return min(tied, key=lambda e: MODES.index(e.mode) if e.mode in MODES else len(MODES))


def _winners(runs: list[list[ModeEstimate]]) -> tuple[list[str | None], list[float]]:
    tops = [best(r) for r in runs]
    return [t.mode if t.goodput_per_gpu > 0 else None for t in tops], [t.goodput_per_gpu for t in tops]


def crossover_prompt_len(cfg: ModelConfig, hw: Hardware, num_gpus: int, output_len: int,
                         link_bw: float, slo_ttft_s: float, slo_tpot_s: float,
                         prompt_lens: list[int], **kwargs) -> dict:
    """Winner (None: no mode feasible) per prompt length, ascending, and "crossover_prompt_len":
    the first length whose winner differs from the previous length's, or None. kwargs: `estimate`."""
    lens = sorted(prompt_lens)
    winners, goodputs = _winners([estimate(cfg, hw, num_gpus, lp, output_len, link_bw, slo_ttft_s,
                                           slo_tpot_s, **kwargs) for lp in lens])
    change = next((lens[i] for i in range(1, len(lens)) if winners[i] != winners[i - 1]), None)
    return {"prompt_lens": lens, "winners": winners, "goodput_per_gpu": goodputs,
            "crossover_prompt_len": change}


def crossover_link_bw(cfg: ModelConfig, hw: Hardware, num_gpus: int, prompt_len: int,
                      output_len: int, slo_ttft_s: float, slo_tpot_s: float,
                      link_bws: list[float], **kwargs) -> dict:
    """Winner per link bandwidth, ascending, and "crossover_link_bw": the highest bandwidth at which
    disaggregation does not win although it wins at a higher one (below it the KV transfer eats
    the gain), or None. kwargs go to `estimate`."""
    bws = sorted(link_bws)
    runs = [estimate(cfg, hw, num_gpus, prompt_len, output_len, bw, slo_ttft_s, slo_tpot_s, **kwargs)
            for bw in bws]
    winners, goodputs = _winners(runs)
    last = max((i for i, w in enumerate(winners) if w == MODES[2]), default=-1)
    below = [bws[i] for i in range(last) if winners[i] != MODES[2]]
    return {"link_bws": bws, "winners": winners, "goodput_per_gpu": goodputs,
            "disaggregated_goodput_per_gpu": [r[2].goodput_per_gpu for r in runs],
            "crossover_link_bw": below[-1] if below else None}


def least_link_bw(cfg: ModelConfig, hw: Hardware, num_gpus: int, prompt_len: int, output_len: int,
                  slo_ttft_s: float, slo_tpot_s: float, low: float = 1e6, high: float = 1e13,
                  **kwargs) -> float | None:
    """The least link bandwidth (bytes/s, to 1%) at which disaggregation wins, or None when it wins at
    no bandwidth up to `high`; `low` when it wins even there. Disaggregation's goodput only grows with
    the bandwidth and colocated serving does not use the link, so one bisection (log scale) finds it.
    kwargs go to `estimate` (e.g. stream="layer")."""
    def wins(bw):
        return best(estimate(cfg, hw, num_gpus, prompt_len, output_len, bw, slo_ttft_s, slo_tpot_s,
                             **kwargs)).mode == MODES[2]
    if not wins(high):
        return None
    if wins(low):
        return low
    while high / low > 1.01:
        mid = math.sqrt(low * high)
        low, high = (low, mid) if wins(mid) else (mid, high)
    return high


__all__ = ["MODES", "CHUNK_SIZES", "TIE_FRACTION", "STREAMS", "ModeEstimate", "estimate", "best", "exposed_transfer",
           "crossover_prompt_len", "crossover_link_bw", "least_link_bw"]
