"""Estimated goodput per GPU of colocated (prefill-first, chunked) and disaggregated serving.

"Estimated" means a first-order model; nothing here is measured:
  * Step times are roofline lower bounds (`experiments.roofline`: max of FLOP time and HBM time).
    The max() lets a mixed step overlap prefill compute with decode memory traffic perfectly,
    which flatters piggybacking (both colocated modes); real kernels overlap less.
  * One request shape: prompt Lp, output Lo; every running decode sits at the mean context
    C = Lp + Lo // 2. Little's law ties rate and batch: B = lam * Lo * TPOT.
  * Queueing is M/D/1 on the prefill work only: W(u, s) = u s / (2 (1 - u)) for utilization u and
    service s. SLOs are checked on the mean request (mean TTFT, mean TPOT), not on tails.
  * Ignored: scheduling and launch overheads, preemption, variance of shapes and arrivals, batching
    several prompts in one step on prefill GPUs, queueing on the link, KV of prompts in flight.
Goodput per GPU = the largest arrival rate (requests/s) the N GPUs sustain with the mean request
inside both SLOs, over N. A mode that meets the SLOs at no rate gets 0.0 and says why in detail.

Notation: t_dec(B) = decode step of B sequences at C; t_mix(B, c) = that step plus a c-token
prompt chunk; t_pre = prefill of Lp tokens alone; x = KV transfer of Lp tokens over link_bw;
B_mem = floor((hbm_bytes - weight bytes) / ((Lp + Lo) kv_bytes_per_token)) caps every decode
batch (hbm_bytes: HBM per GPU, default 141e9 as on H200; pass a large value for CPU hardware).

colocated_prefill_first (one GPU per worker; whole prompts join the step ahead of its decodes):
  a prompt adds d(B) = t_mix(B, Lp) - t_dec(B) to the step it joins: ~t_pre for long prompts,
  much less for short ones that ride along the weight read. u = lam d;
  TPOT = t_dec / (1 - u) = t_dec + B d / Lo (the prefill work landing in a token's steps, on
  average); TTFT = t_mix(B, Lp) + W(u, d) + t_dec (at most one step in flight at arrival).
colocated_chunked (Sarathi-Serve; budget c + B per step, c in CHUNK_SIZES, best c reported):
  every step carries B decodes and c prompt tokens (conservative at light load), the chunk's
  attention counted against its prompt's earlier chunks (on average c (Lp+1)/2 query-key pairs
  and max(0, Lp - c)/2 cached tokens read). TPOT = t_step; u = lam Lp t_step / c;
  TTFT = ceil(Lp / c) t_step + W(u, Lp t_step / c) + t_step.
Colocated search: batch B = 1, 2, ... serves rates up to lam(B) = B / (Lo TPOT(B)) (Little);
inside that, the rate is capped where TTFT (M/D/1 solved for u) or TPOT reaches its SLO. The scan
stops at the first B such a cap cuts short (that SLO binds) or at B_mem ("memory" binds).

disaggregated (P prefill + D decode GPUs, P + D = N, every split tried, best reported):
  prefill: each GPU an M/D/1 server of t_pre: lam <= P u* / t_pre, t_pre + W(u*, t_pre) = SLO;
  link: each GPU sends or receives on its own link_bw: lam <= min(P, D) link_bw / (Lp kv_bytes);
  decode: the transfer delays the second token by x, so TPOT = t_dec(B) + x / (Lo - 1);
  B_d = the largest B <= B_mem within the TPOT SLO; lam <= D B_d / (Lo t_dec(B_d)).
  Rate = the smallest of the three, which names the binding constraint.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from experiments.roofline import (Hardware, decode_cost, kv_transfer_time, mixed_cost,
                                  prefill_cost)
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


@dataclass(frozen=True)
class _Case:
    cfg: ModelConfig
    hw: Hardware
    num_gpus: int
    prompt_len: int
    output_len: int
    link_bw: float
    slo_ttft_s: float
    slo_tpot_s: float
    dtype_bytes: int
    batch_mem: int  # B_mem

    @property
    def context(self) -> int:
        return self.prompt_len + self.output_len // 2

    def step_time(self, cost_at, extra_flops: float = 0.0, extra_bytes: float = 0.0):
        """Step time as a function of the decode batch B. A step's FLOPs and bytes are affine in
        B (roofline._step_cost), so its values at B = 1 and 2 give the line exactly."""
        c1, c2 = cost_at(1), cost_at(2)
        df, db = c2.flops - c1.flops, c2.bytes - c1.bytes
        f0, b0 = c1.flops - df + extra_flops, c1.bytes - db + extra_bytes
        peak, bw = self.hw.peak_flops, self.hw.mem_bw
        return lambda b: max((f0 + df * b) / peak, (b0 + db * b) / bw)

    def t_dec(self):
        return self.step_time(lambda b: decode_cost(self.cfg, b, self.context, self.dtype_bytes))


def _wait(u: float, service_s: float) -> float:
    """M/D/1 mean wait in queue."""
    return u * service_s / (2 * (1 - u)) if u < 1 else math.inf


def _ttft_cap(slo_s: float, base_s: float, service_s: float) -> float:
    """Largest rate with base + W(rate * service, service) <= slo: u* = 2S / (service + 2S)."""
    slack = slo_s - base_s
    if slack <= 0:
        return 0.0
    return math.inf if service_s <= 0 else 2 * slack / (service_s + 2 * slack) / service_s


def _first(pred, lo: int, hi: int) -> int:
    """Smallest b in [lo, hi] with pred(b) (pred monotone false -> true); hi if none."""
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if pred(mid) else (mid + 1, hi)
    return lo


def _infeasible(case: _Case, mode: str, ttft_s: float, tpot_s: float, reasons=(), **detail):
    reasons = list(reasons)
    if ttft_s > case.slo_ttft_s:
        reasons.append(f"ttft {ttft_s * 1e3:.1f} ms > SLO {case.slo_ttft_s * 1e3:.1f} ms")
    if tpot_s > case.slo_tpot_s:
        reasons.append(f"tpot {tpot_s * 1e3:.2f} ms > SLO {case.slo_tpot_s * 1e3:.2f} ms")
    if case.batch_mem < 1:
        reasons.append("memory: one request's KV does not fit beside the weights")
    reason = "; ".join(reasons or ["ttft or tpot SLO unmet at any rate"]) + " at the lightest load"
    return ModeEstimate(mode, 0.0, ttft_s, tpot_s, {**detail, "infeasible": reason})


def _scan(case: _Case, mode: str, point, **extra) -> ModeEstimate:
    """Colocated search (module docstring). point(B) -> (lam(B), {slo: rate cap}, metrics(rate))."""
    best, prev, binding = None, 0.0, "memory"
    for b in range(1, case.batch_mem + 1):
        lam_b, caps, metrics = point(b)
        name, cap = min(caps.items(), key=lambda kv: kv[1])
        rate = min(lam_b, cap)
        if rate > prev:
            best = (rate, metrics(rate))
        if cap < lam_b:
            binding = name
            break
        prev = max(prev, lam_b)
    if best is None:
        ttft, tpot, detail = point(1)[2](0.0) if case.batch_mem >= 1 else (0.0, 0.0, {})
        return _infeasible(case, mode, ttft, tpot, **extra, **detail)
    rate, (ttft, tpot, detail) = best
    return ModeEstimate(mode, rate, ttft, tpot,
                        {**extra, **detail, "binding": binding, "batch_mem": case.batch_mem})


def _prefill_first(case: _Case) -> ModeEstimate:
    cfg, lp, lo, dt = case.cfg, case.prompt_len, case.output_len, case.dtype_bytes
    t_dec = case.t_dec()
    t_mix = case.step_time(lambda b: mixed_cost(cfg, b, case.context, lp, dt))

    def point(b):
        td, tm = t_dec(b), t_mix(b)
        d = tm - td                                   # prefill work a prompt adds to its step
        tpot_cap = (max(0.0, 1 - td / case.slo_tpot_s) / d if d > 0
                    else (math.inf if td <= case.slo_tpot_s else 0.0))
        caps = {"ttft": _ttft_cap(case.slo_ttft_s, tm + td, d), "tpot": tpot_cap}

        def metrics(rate):
            u = rate * d
            return (tm + td + _wait(u, d), td / (1 - u),
                    {"batch": b, "prefill_util": u, "step_s": td, "prefill_add_s": d})
        return b / (lo * td + b * d), caps, metrics
    return _scan(case, MODES[0], point)


def _chunked(case: _Case, chunk: int) -> ModeEstimate:
    cfg, lp, lo, dt = case.cfg, case.prompt_len, case.output_len, case.dtype_bytes
    pair_flops = decode_cost(cfg, 1, 1, dt).flops - decode_cost(cfg, 1, 0, dt).flops
    extra_pairs = chunk * (lp + 1) / 2 - chunk * (chunk + 1) / 2  # mixed_cost counts c(c+1)/2
    t_step = case.step_time(lambda b: mixed_cost(cfg, b, case.context, chunk, dt),
                            extra_flops=extra_pairs * pair_flops,
                            extra_bytes=max(0, lp - chunk) / 2 * cfg.kv_bytes_per_token(dt))

    def point(b):
        ts = t_step(b)
        service = lp * ts / chunk                     # prefill time per prompt at c tokens/step
        base = math.ceil(lp / chunk) * ts + ts
        caps = {"ttft": _ttft_cap(case.slo_ttft_s, base, service),
                "tpot": math.inf if ts <= case.slo_tpot_s else 0.0}

        def metrics(rate):
            u = rate * service
            return base + _wait(u, service), ts, {"batch": b, "budget": chunk + b,
                                                  "prefill_util": u, "step_s": ts}
        return b / (lo * ts), caps, metrics
    return _scan(case, MODES[1], point, chunk=chunk)


def _disaggregated(case: _Case) -> ModeEstimate:
    cfg, lp, lo, dt, n = case.cfg, case.prompt_len, case.output_len, case.dtype_bytes, case.num_gpus
    t_pre = prefill_cost(cfg, lp, dt).time(case.hw)
    xfer = kv_transfer_time(cfg, lp, case.link_bw, dt)
    per_token = xfer / (lo - 1)
    t_dec = case.t_dec()
    if n < 2 or t_pre >= case.slo_ttft_s or t_dec(1) + per_token > case.slo_tpot_s or case.batch_mem < 1:
        reasons = ["needs at least 2 GPUs (one prefill, one decode)"] if n < 2 else []
        if t_pre >= case.slo_ttft_s:
            reasons.append(f"ttft: prefill alone takes {t_pre * 1e3:.1f} ms")
        return _infeasible(case, MODES[2], t_pre, t_dec(1) + per_token, reasons, t_xfer_s=xfer)
    mem = case.batch_mem
    b_d = _first(lambda b: b == mem or t_dec(b + 1) + per_token > case.slo_tpot_s, 1, mem)
    per_gpu = {"prefill": _ttft_cap(case.slo_ttft_s, t_pre, t_pre),
               "link": case.link_bw / (lp * cfg.kv_bytes_per_token(dt)),
               "decode": b_d / (lo * t_dec(b_d))}
    splits = {}
    for p in range(1, n):
        caps = {"prefill": p * per_gpu["prefill"], "link": min(p, n - p) * per_gpu["link"],
                "decode": (n - p) * per_gpu["decode"]}
        splits[p] = (min(caps.values()), caps)
    p = max(splits, key=lambda k: splits[k][0])
    rate, caps = splits[p]
    d = n - p
    binding = min(caps, key=caps.get)
    if binding == "decode":
        binding = "decode (memory)" if b_d == mem else "decode (tpot)"
    elif binding == "prefill":
        binding = "prefill (ttft)"
    b_op = _first(lambda b: d * b / (lo * t_dec(b)) >= rate * (1 - 1e-9), 1, b_d)
    return ModeEstimate(MODES[2], rate / n, t_pre + _wait(rate / p * t_pre, t_pre),
                        t_dec(b_op) + per_token,
                        {"split": f"{p}:{d}", "batch": b_op, "batch_limit": b_d, "batch_mem": mem,
                         "prefill_util": rate / p * t_pre, "link_util": rate / caps["link"],
                         "decode_util": rate / caps["decode"], "t_xfer_s": xfer,
                         "binding": binding, "capacities": caps,
                         "splits_tried": {f"{k}:{n - k}": v[0] / n for k, v in splits.items()}})


def estimate(cfg: ModelConfig, hw: Hardware, num_gpus: int, prompt_len: int, output_len: int,
             link_bw: float, slo_ttft_s: float, slo_tpot_s: float, dtype_bytes: int = 2,
             hbm_bytes: float = 141e9) -> list[ModeEstimate]:
    """One ModeEstimate per mode, in MODES order (see the module docstring for the model)."""
    for key, value, low in (("num_gpus", num_gpus, 1), ("prompt_len", prompt_len, 1),
                            ("output_len", output_len, 2)):
        if value < low:
            raise ValueError(f"{key}={value} must be at least {low} (TPOT needs two output tokens)"
                             if key == "output_len" else f"{key}={value} must be at least {low}")
    for key, value in (("link_bw", link_bw), ("slo_ttft_s", slo_ttft_s), ("slo_tpot_s", slo_tpot_s)):
        if not value > 0:
            raise ValueError(f"{key}={value} must be positive")
    free = hbm_bytes - cfg.num_params() * dtype_bytes
    batch_mem = max(0, int(free // ((prompt_len + output_len) * cfg.kv_bytes_per_token(dtype_bytes))))
    case = _Case(cfg, hw, num_gpus, prompt_len, output_len, link_bw, slo_ttft_s, slo_tpot_s,
                 dtype_bytes, batch_mem)
    tried = {c: _chunked(case, c) for c in CHUNK_SIZES}
    chunked = max(tried.values(), key=lambda e: e.goodput_per_gpu)
    if chunked.goodput_per_gpu == 0.0:
        chunked = tried[CHUNK_SIZES[0]]
    chunked.detail["chunks_tried"] = {c: e.goodput_per_gpu for c, e in tried.items()}
    return [_prefill_first(case), chunked, _disaggregated(case)]


def best(estimates: list[ModeEstimate]) -> ModeEstimate:
    """The highest goodput per GPU; every mode within TIE_FRACTION (5%) of it counts as a tie,
    won by the simpler mode in MODES order: colocated prefill-first (no chunk size to tune), then
    colocated chunked, then disaggregated. With all goodputs 0.0 that is the simplest mode."""
    top = max(e.goodput_per_gpu for e in estimates)
    tied = [e for e in estimates if e.goodput_per_gpu >= (1 - TIE_FRACTION) * top]
    return min(tied, key=lambda e: MODES.index(e.mode) if e.mode in MODES else len(MODES))


def _winner(estimates: list[ModeEstimate]) -> tuple[str | None, float]:
    w = best(estimates)
    return (w.mode if w.goodput_per_gpu > 0 else None), w.goodput_per_gpu


def crossover_prompt_len(cfg: ModelConfig, hw: Hardware, num_gpus: int, output_len: int,
                         link_bw: float, slo_ttft_s: float, slo_tpot_s: float,
                         prompt_lens: list[int], **kwargs) -> dict:
    """Winner (None where no mode is feasible) per prompt length, ascending, and the first length
    whose winner differs from the previous length's ("crossover_prompt_len", None if never)."""
    lens = sorted(prompt_lens)
    rows = [_winner(estimate(cfg, hw, num_gpus, lp, output_len, link_bw, slo_ttft_s, slo_tpot_s,
                             **kwargs)) for lp in lens]
    winners = [w for w, _ in rows]
    change = next((lens[i] for i in range(1, len(lens)) if winners[i] != winners[i - 1]), None)
    return {"prompt_lens": lens, "winners": winners, "goodput_per_gpu": [g for _, g in rows],
            "crossover_prompt_len": change}


def crossover_link_bw(cfg: ModelConfig, hw: Hardware, num_gpus: int, prompt_len: int,
                      output_len: int, slo_ttft_s: float, slo_tpot_s: float,
                      link_bws: list[float], **kwargs) -> dict:
    """Winner per link bandwidth, ascending, and "crossover_link_bw": the highest bandwidth at
    which disaggregation does not win although it wins at some higher one (below it the KV
    transfer eats the gain), or None."""
    bws = sorted(link_bws)
    runs = [estimate(cfg, hw, num_gpus, prompt_len, output_len, bw, slo_ttft_s, slo_tpot_s, **kwargs)
            for bw in bws]
    winners = [_winner(r)[0] for r in runs]
    disagg = [i for i, w in enumerate(winners) if w == MODES[2]]
    below = [i for i, w in enumerate(winners) if w != MODES[2] and disagg and i < disagg[-1]]
    return {"link_bws": bws, "winners": winners, "goodput_per_gpu": [_winner(r)[1] for r in runs],
            "disaggregated_goodput_per_gpu": [r[2].goodput_per_gpu for r in runs],
            "crossover_link_bw": bws[below[-1]] if below else None}


__all__ = ["MODES", "CHUNK_SIZES", "TIE_FRACTION", "ModeEstimate", "estimate", "best",
           "crossover_prompt_len", "crossover_link_bw"]
