"""The timed stages of experiments/gpu_check.py (shapes: experiments/gpu_stages.py's `shapes`): the
roofline stage times decode-only and prefill-only steps against the device's measured peaks and, on a
GPU the database knows, beside NVIDIA's measured steps; the interference stage times a mixed step
against decode-only at each chunk size. Device time from CUDA events on a GPU, the host clock on a CPU."""
from __future__ import annotations

import math
import random
import statistics
import time

from experiments.gpu_stages import device_of, model_for


class _Timer:
    """Device time of a callable: CUDA events around it on a GPU, the host clock on a CPU."""

    def __init__(self, device: str):
        import torch
        self.cuda = device == "cuda"
        self.torch = torch

    def ms(self, fn, reps: int = 1) -> float:
        torch = self.torch
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / reps
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) * 1e3 / reps


def _peaks(device: str, dtype) -> tuple[float, float]:
    """(matmul FLOP/s, memory bytes/s): a large GEMM and a large copy, each looped on the device."""
    import torch
    dev, timer = device_of(device), _Timer(device)
    n = 8192 if device == "cuda" else 1024
    a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
    torch.mm(a, b)
    mm_ms = min(timer.ms(lambda: torch.mm(a, b), reps=20 if device == "cuda" else 3) for _ in range(3))
    size = (2 << 30) if device == "cuda" else (256 << 20)
    src = torch.ones(size, device=dev, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_ms = min(timer.ms(lambda: dst.copy_(src), reps=10 if device == "cuda" else 2) for _ in range(3))
    return 2 * n ** 3 / (mm_ms / 1e3), 2 * size / (copy_ms / 1e3)


def _serving_engine(model, budget: int, max_batch: int, tokens: int):
    from workers.config import EngineConfig
    from workers.engine import Engine
    blocks = -(-tokens // 16) + 64
    return Engine(model, EngineConfig(policy="chunked", token_budget=budget, max_batch=max_batch,
                                      num_kv_blocks=blocks, max_model_len=min(model.cfg.max_position_embeddings,
                                                                              max(8192, budget) + 64)))


def _decodes(e, model, batch: int, context: int, gen, steps: int) -> list[str]:
    from workers.request import SamplingParams
    ids = []
    for i in range(batch):
        rid = f"d{len(e.requests)}.{i}"
        e.add_request(rid, [gen.randrange(model.cfg.vocab_size) for _ in range(context)],
                      SamplingParams(max_tokens=steps, ignore_eos=True))
        ids.append(rid)
    while any(r.is_prefill for r in e.requests.values()):
        e.step()
    return ids


def roofline(device: str, sh: dict) -> dict:
    model = model_for(device, sh)
    cfg = model.cfg
    dtype_bytes = model.embed_tokens.element_size()
    flops, bw = _peaks(device, model.embed_tokens.dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gen = random.Random(2)
    most = max(sh["batches"]) * (max(sh["contexts"]) + 16) + max(sh["prefills"])
    e = _serving_engine(model, budget=max(sh["prefills"] + [max(sh["batches"])]), max_batch=max(sh["batches"]) + 1,
                        tokens=most)
    decode = {}
    for context in sh["contexts"]:
        for batch in sh["batches"]:
            ids = _decodes(e, model, batch, context, gen, steps=12)
            times = []
            for _ in range(8):
                e.step()
                times.append(e.trace[-1].duration * 1e3)
            for rid in ids:
                e.abort(rid)
            floor_ms = (weight_bytes + batch * context * cfg.kv_bytes_per_token(dtype_bytes)) / bw * 1e3
            med = statistics.median(times[2:])
            decode[f"B{batch}_C{context}"] = {"step_ms": med, "hbm_floor_ms": floor_ms, "floor_over_step": floor_ms / med}
    prefill = {}
    from workers.request import SamplingParams
    for n in sh["prefills"]:
        times = []
        for k in range(3):
            rid = f"p{n}.{k}"
            e.add_request(rid, [gen.randrange(cfg.vocab_size) for _ in range(n)], SamplingParams(max_tokens=1))
            e.step()
            times.append(e.trace[-1].duration * 1e3)
            e.abort(rid)
        med = statistics.median(times)
        achieved = 2 * cfg.num_params() * n / (med / 1e3)
        prefill[f"P{n}"] = {"step_ms": med, "tflops": achieved / 1e12, "of_matmul_peak": achieved / flops}
    measured = all(math.isfinite(d["step_ms"]) and d["step_ms"] > 0 for d in (*decode.values(), *prefill.values()))
    within = all(0 < d["floor_over_step"] <= 1.05 for d in decode.values()) and all(
        0 < p["of_matmul_peak"] <= 1.05 for p in prefill.values())
    db = _beside_database(device, cfg, dtype_bytes, decode, prefill)     # informational: not part of ok
    # on a GPU no step may beat its floor; a shared CPU's timings can (the peak is measured at another
    # moment), so there the bounds are reported, not judged
    ok = measured and (within or device != "cuda")
    return {"matmul_peak_tflops": flops / 1e12, "copy_bandwidth_gbs": bw / 1e9, "decode": decode,
            "prefill": prefill, "database": db, "within_bounds": bool(within),
            **({} if device == "cuda" else {"bounds": "reported, not judged on a CPU"}), "ok": bool(ok)}


def _beside_database(device: str, cfg, dtype_bytes: int, decode: dict, prefill: dict) -> str:
    """Adds `db_ms` (the same step in NVIDIA's measured vLLM database for this GPU, experiments/sim/
    gpu_costs.py) and `step_over_db` to each measured step; returns the database's name or why none."""
    try:
        import torch

        from experiments.sim.gpu_costs import choose
        from experiments.sim.stepmodel import chunk_features, roofline_model
        name = torch.cuda.get_device_name(torch.device(device)).lower() if device.startswith("cuda") else ""
        gpu = next((g for g in ("h200", "h100", "a100") if g in name), None)
        if gpu is None:
            return f"none for {name or device}"
        step, why = choose(cfg, gpu, roofline_model(cfg, gpu, dtype_bytes), "auto", dtype_bytes=dtype_bytes)
        if why is not None:
            return f"none: {why}"
        for key, d in decode.items():
            batch, context = (int(x) for x in key[1:].split("_C"))
            d["db_ms"] = 1e3 * step.time(chunk_features(batch, batch * context, []))
            d["step_over_db"] = d["step_ms"] / d["db_ms"]
        for key, p in prefill.items():
            p["db_ms"] = 1e3 * step.time(chunk_features(0, 0, [(int(key[1:]), 0, True)]))
            p["step_over_db"] = p["step_ms"] / p["db_ms"]
        return step.name
    except Exception as e:                       # noqa: BLE001 - a comparison, never a reason to fail the stage
        return f"none: {type(e).__name__}: {e}"


def interference(device: str, sh: dict) -> dict:
    from experiments.analysis.interference import ratios, rounds
    from workers.request import SamplingParams
    model = model_for(device, sh)
    gen = random.Random(3)
    chunks = [0] + sh["chunks"]
    steps = len(chunks) * (sh["rounds"] + 4) + 8
    e = _serving_engine(model, budget=sh["decodes"] + max(chunks), max_batch=sh["decodes"] + 1,
                        tokens=sh["decodes"] * (sh["context"] + steps + 16) + max(chunks))
    _decodes(e, model, sh["decodes"], sh["context"], gen, steps=steps)
    count = iter(range(1 << 30))

    def step(chunk: int) -> float:
        rid = f"p{chunk}.{next(count)}"
        if chunk:
            e.add_request(rid, [gen.randrange(model.cfg.vocab_size) for _ in range(chunk)], SamplingParams(max_tokens=1))
        e.step()
        rec = e.trace[-1]
        if rec.num_decode_seqs != sh["decodes"] or rec.num_prefill_tokens != chunk:
            raise RuntimeError(f"step ran {rec.num_decode_seqs} decodes + {rec.num_prefill_tokens} prefill tokens, "
                               f"not {sh['decodes']} + {chunk}")
        e.abort(rid)
        return rec.duration * 1e3

    times, _ = rounds(step, chunks, sh["rounds"], max_remeasure=0)
    curve = {}
    for c in chunks:
        r = ratios(times, c) if c else [1.0]
        curve[str(c)] = {"step_ms": statistics.median(times[c]), "over_decode_only": statistics.median(r),
                         "ratio_range": [min(r), max(r)]}
    biggest = curve[str(max(chunks))]["over_decode_only"]
    slower = biggest > 1.0              # the largest prefill stretches the step: judged on a GPU only
    return {"decodes": sh["decodes"], "context": sh["context"], "rounds": sh["rounds"], "curve": curve,
            "prefill_stretches_the_step": bool(slower), "ok": bool(slower or device != "cuda")}
