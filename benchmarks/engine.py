"""Offline engine benchmark: pdlab's engine against Hugging Face `generate` on the same checkpoint.

    pdlab bench engine [--case NAME ...] [--shape SHAPE] [--repeats N] [--compile] [--device D]

Each case writes (once, cached) a Llama checkpoint of its shape with seeded random weights through
`transformers`' `save_pretrained`; both engines load that same safetensors file and get the same
token-id prompts, greedy, a fixed number of output tokens each (EOS ignored). Each engine times only
its own generate call, after a warm-up call; the two run alternately, `--repeats` times, so drift
on a shared machine hits both alike. Printed per case: the median time of each, their ratio, the
spread of the per-pair ratios, whether every output token matched, pdlab's step-time breakdown
(prepare / forward / sample), and the matmul floor: the time the case's matrix multiplications
alone take on this device, measured per step shape after the timed runs, by the faster of torch's
linear and (CPU, float32) pdlab's panel kernel (HF's time over it is the most any engine doing those matmuls
could gain), then that floor with attention's FLOPs added at the
matmuls' own rate (a bound no attention kernel reaches). On a GPU it also prints the decode step against the HBM floor and the
prefill step against the measured matmul peak (experiments/hardware.py). Ends with one JSON line.
With `--against-gemm-rows N` (CPU kernels), a second pdlab engine whose linears run MKL's GEMM from N
rows (`engine.cpu_gemm_rows`; `none`: the panel kernel always) runs alternately with the other two,
and the case prints the first engine's route (measured) and its time against that one's.

Cases (the shapes of issue 10's table): `decode-heavy` (tiny, 64 prompts x 128 tokens, 128 out),
`prefill-heavy` (29m, 64 x 512, 32 out), `mixed` (29m, 16 x 256, 64 out). `--shape` replaces the
model of every case: a preset name (tiny, 29m, llama-3-8b, ...) or
hidden,layers,heads,kv_heads,ff,vocab.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.config import PRESETS, EngineConfig, ModelConfig, gemm_route
from workers.engine import Engine
from workers.request import SamplingParams
from workers.weights import build_model, parse_device, resolve_dtype

SHAPES = {"tiny": PRESETS["tiny"],
          "29m": ModelConfig(name="29m", vocab_size=4096, hidden_size=512, intermediate_size=1536, num_layers=8,
                             num_heads=8, num_kv_heads=4, head_dim=64, max_position_embeddings=4096),
          **{k: v for k, v in PRESETS.items() if k != "tiny"}}
# Weights drawn with this std (HF's default is 0.02) so greedy choices are decided by clear margins:
# a near-tie would let float rounding, not the engine, decide whether outputs match.
INIT_STD = 0.15


@dataclass(frozen=True)
class Case:
    name: str
    shape: str
    num_prompts: int
    prompt_len: int
    output_len: int


CASES = {c.name: c for c in [Case("decode-heavy", "tiny", 64, 128, 128), Case("prefill-heavy", "29m", 64, 512, 32),
                             Case("mixed", "29m", 16, 256, 64)]}


def parse_shape(text: str) -> ModelConfig:
    if text in SHAPES:
        return SHAPES[text]
    try:
        h, layers, heads, kv, ff, vocab = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--shape {text!r}: give a preset ({', '.join(SHAPES)}) or hidden,layers,heads,kv_heads,ff,vocab")
    return ModelConfig(name=f"h{h}-l{layers}", vocab_size=vocab, hidden_size=h, intermediate_size=ff, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv, head_dim=h // heads, max_position_embeddings=4096)


def checkpoint(cfg: ModelConfig, seed: int = 0) -> Path:
    """A save_pretrained directory of `cfg` with seeded weights, cached by shape and seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    key = hashlib.sha256(json.dumps([dataclasses.asdict(cfg), seed, INIT_STD], sort_keys=True).encode()).hexdigest()[:12]
    root = Path(os.environ.get("PDLAB_CACHE") or Path.home() / ".cache" / "pdlab")
    path = root / "bench" / f"{cfg.name}-{key}"
    if not (path / "config.json").exists():
        torch.manual_seed(seed)
        hf = LlamaForCausalLM(LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
            initializer_range=INIT_STD, tie_word_embeddings=cfg.tie_word_embeddings, eos_token_id=None,
            bos_token_id=None, pad_token_id=None))
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        hf.save_pretrained(tmp)
        os.replace(tmp, path)
    return path


def prompts(case: Case, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (case.num_prompts, case.prompt_len), generator=g)      # [N, P]


class HFRunner:
    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype):
        from transformers import LlamaForCausalLM
        self.model = LlamaForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        self.device = device

    @torch.inference_mode()
    def generate(self, ids: torch.Tensor, n: int) -> list[list[int]]:
        ids = ids.to(self.device)
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0)
        _sync(self.device)
        return out[:, ids.shape[1]:].tolist()


class PdlabRunner:
    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype, ecfg: EngineConfig):
        self.model = build_model(checkpoint=path, dtype=dtype, device=device)
        self.ecfg = ecfg
        self.engine: Engine | None = None

    def generate(self, ids: torch.Tensor, n: int) -> list[list[int]]:
        """One batch through the engine, built on the first call (its KV pool allocated once, as a
        server does at start; HF's generate builds its cache as it goes, inside its timed call)."""
        if self.engine is None:
            self.engine = Engine(self.model, self.ecfg)
        engine = self.engine
        engine.take_trace()                  # the breakdown is of this call's steps
        base = engine.num_steps
        reqs = [engine.add_request(f"{base}-{i}", row, SamplingParams(max_tokens=n, ignore_eos=True))
                for i, row in enumerate(ids.tolist())]
        engine.run()
        return [r.output_ids for r in reqs]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":         # the stream the timed work ran on, never the whole device
        torch.cuda.current_stream(device).synchronize()


CLOCK = time.perf_counter


def timed(fn) -> tuple[float, object]:
    start = CLOCK()
    result = fn()
    return CLOCK() - start, result


def breakdown(engine: Engine) -> dict:
    """Per-step medians (ms) of decode-only and prefill-carrying steps, and totals (s) by part."""
    out = {}
    for kind, steps in (("decode", [s for s in engine.trace if not s.num_prefill_tokens]),
                        ("prefill", [s for s in engine.trace if s.num_prefill_tokens])):
        if steps:
            out[kind] = {"steps": len(steps), "tokens_per_step": statistics.median(s.num_tokens for s in steps),
                         **{f"{part}_ms": 1e3 * statistics.median(getattr(s, f"{part}_s") for s in steps)
                            for part in ("prepare", "forward", "sample")},
                         "step_ms": 1e3 * statistics.median(s.duration for s in steps)}
    out["total_s"] = {part: sum(getattr(s, f"{part}_s") for s in engine.trace) for part in ("prepare", "forward", "sample")}
    return out


def matmul_floor(model, steps, device: torch.device, repeats: int = 3) -> tuple[float, float]:
    """Seconds the steps' matrix multiplications alone take on this device, and their FLOPs: every
    weight of the model times a step's rows (and the LM head times its sampled rows), measured
    (median of `repeats`) for each distinct step shape, by the faster route of torch's linear (MKL's
    GEMM on a CPU) and, in float32 on a CPU, pdlab's panel kernel (on some CPUs MKL takes twice its
    time: docs/benchmarks.md). No engine doing the same matmuls with these routes can be faster, so
    HF's time over this bounds the speed-up any such engine could show in this case."""
    weights = [p for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name
               and "lm_head" not in name]
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    cache: dict[tuple[int, int], float] = {}
    routes = [lambda x, w: torch.nn.functional.linear(x, w)]
    if device.type == "cpu" and head.dtype == torch.float32:
        from workers import cpu_kernels
        if cpu_kernels.available():
            packed = {id(w): cpu_kernels.pack_linear(w.detach()) for w in [*weights, head]}
            routes.append(lambda x, w: cpu_kernels.linear_small(x, packed[id(w)], w.shape[0]))

    def one(rows: int, sampled: int, linear) -> float:
        xs = {n: torch.randn(rows, n, dtype=head.dtype, device=device) for n in {w.shape[1] for w in weights}}
        h = torch.randn(sampled, head.shape[1], dtype=head.dtype, device=device)
        times = []
        with torch.inference_mode():
            for _ in range(repeats + 1):
                _sync(device)
                start = CLOCK()                      # the clock the engines were timed by
                for w in weights:
                    linear(xs[w.shape[1]], w)
                linear(h, head)
                _sync(device)
                times.append(CLOCK() - start)
        return statistics.median(times[1:])          # the first is a warm-up

    total = flops = 0.0
    for st in steps:
        key = (st.num_tokens, st.num_decode_seqs + st.num_prefill_seqs)
        if key not in cache:
            cache[key] = min(one(*key, linear) for linear in routes)
        total += cache[key]
        flops += 2 * (key[0] * sum(w.numel() for w in weights) + key[1] * head.numel())
    return total, flops


def attention_flops(cfg: ModelConfig, case: Case) -> float:
    """The multiply-adds of attention in a case, counted exactly: every query of every head scores
    the keys up to its own position and sums as many values (2 x 2 x head_dim FLOPs a pair). The
    count does not depend on how prompts are chunked."""
    pairs_prompt = case.prompt_len * (case.prompt_len + 1) // 2
    pairs_decode = sum(case.prompt_len + k for k in range(1, case.output_len))   # decode step k sees P + k keys
    return 4.0 * cfg.head_dim * cfg.num_heads * cfg.num_layers * case.num_prompts * (pairs_prompt + pairs_decode)


def gpu_floors(cfg: ModelConfig, dtype_bytes: int, engine: Engine, case: Case) -> dict:
    """Decode step against the HBM floor, prefill against the measured matmul peak (roofline module)."""
    from experiments.hardware import decode_cost, measured_hardware, prefill_cost

    hw = measured_hardware(str(engine.device))
    out = {"peak_tflops": hw.peak_flops / 1e12, "hbm_gb_s": hw.mem_bw / 1e9}
    b = breakdown(engine)
    if "decode" in b:
        batch = min(case.num_prompts, engine.cfg.max_batch)
        floor_s = decode_cost(cfg, batch, case.prompt_len + case.output_len // 2, dtype_bytes).bytes / hw.mem_bw
        out["decode_floor_ms"] = 1e3 * floor_s
        out["decode_vs_floor"] = floor_s / (b["decode"]["step_ms"] / 1e3)
    if "prefill" in b:
        tokens = int(b["prefill"]["tokens_per_step"])
        flops = prefill_cost(cfg, tokens, dtype_bytes).flops
        out["prefill_tflops"] = flops / (b["prefill"]["step_ms"] / 1e3) / 1e12
        out["prefill_vs_peak"] = out["prefill_tflops"] * 1e12 / hw.peak_flops
    return out


def run_case(case: Case, cfg: ModelConfig, args, device: torch.device, dtype: torch.dtype) -> dict:
    path = checkpoint(cfg, args.seed)
    ids = prompts(case, cfg.vocab_size, args.seed)
    ecfg = EngineConfig(policy="chunked", token_budget=args.token_budget, max_batch=256,
                        max_model_len=case.prompt_len + case.output_len, attention=args.attention,
                        compile=args.compile, **({"kv_cache_bytes": args.kv_cache_mb << 20} if device.type == "cpu" else {}))
    hf, pd = HFRunner(path, device, dtype), PdlabRunner(path, device, dtype, ecfg)
    runners = {"hf": hf, "pdlab": pd}
    if args.against_gemm_rows:
        rows = None if args.against_gemm_rows == "none" else int(args.against_gemm_rows)
        runners["against"] = PdlabRunner(path, device, dtype, ecfg.replace(cpu_gemm_rows=rows))
    warm = ids[:2, :16]
    for runner in runners.values():
        runner.generate(warm, 4)
    for runner in list(runners.values())[1:]:
        runner.generate(ids, 2)          # the shapes of the real run (and, with --compile, its graphs)
    times = {name: [] for name in runners}
    outputs = {}
    for _ in range(args.repeats):        # alternate, so drift on a shared machine hits all alike
        for name, runner in runners.items():
            seconds, outputs[name] = timed(lambda: runner.generate(ids, case.output_len))
            times[name].append(seconds)
    pairs = [h / p for h, p in zip(times["hf"], times["pdlab"])]
    floor_s, mm_flops = matmul_floor(pd.model, pd.engine.trace, device)
    attn_flops = attention_flops(cfg, case)
    # attention's arithmetic as if it ran at the matmuls' own rate: a bound no kernel reaches
    compute_s = floor_s + attn_flops / (mm_flops / floor_s)
    same = sum(a == b for a, b in zip(outputs["hf"], outputs["pdlab"]))
    result = {"case": case.name, "shape": cfg.name, "num_prompts": case.num_prompts, "prompt_len": case.prompt_len,
              "output_len": case.output_len, "hf_s": statistics.median(times["hf"]),
              "pdlab_s": statistics.median(times["pdlab"]), "speedup": statistics.median(times["hf"]) /
              statistics.median(times["pdlab"]), "speedup_min": min(pairs), "speedup_max": max(pairs),
              "identical": same == len(outputs["hf"]), "num_identical": same, "breakdown": breakdown(pd.engine),
              "matmul_floor_s": floor_s, "max_speedup": statistics.median(times["hf"]) / floor_s,
              "matmul_gflops": mm_flops / floor_s / 1e9, "attention_gflop": attn_flops / 1e9,
              "compute_floor_s": compute_s, "max_speedup_compute": statistics.median(times["hf"]) / compute_s,
              "attention": pd.engine.runner.backend.name, "compile": args.compile,
              "cpu_gemm_rows": pd.engine.memory()["cpu_gemm_rows"]}
    if "against" in runners:
        ratios = [p / a for p, a in zip(times["pdlab"], times["against"])]
        result["against"] = {"cpu_gemm_rows": runners["against"].engine.memory()["cpu_gemm_rows"],
                             "s": statistics.median(times["against"]), "ratio": statistics.median(ratios),
                             "ratio_min": min(ratios), "ratio_max": max(ratios),
                             "identical": outputs["against"] == outputs["pdlab"]}
    if device.type == "cuda":
        result["gpu"] = gpu_floors(cfg, torch.tensor([], dtype=dtype).element_size(), pd.engine, case)
    return result


def report(r: dict) -> str:
    b = r["breakdown"]
    lines = [f"{r['case']} ({r['shape']}, {r['num_prompts']} x {r['prompt_len']} prompt, {r['output_len']} out): "
             f"HF generate {r['hf_s']:.2f} s, pdlab {r['pdlab_s']:.2f} s -> {r['speedup']:.2f}x "
             f"(per pair {r['speedup_min']:.2f}-{r['speedup_max']:.2f}x); outputs identical: "
             f"{r['num_identical']}/{r['num_prompts']}",
             f"  matmuls alone {r['matmul_floor_s']:.2f} s (pdlab at {r['matmul_floor_s'] / r['pdlab_s']:.0%} of "
             f"that floor): no engine with these matmuls gets past {r['max_speedup']:.2f}x over HF here",
             f"  with attention's {r['attention_gflop']:.0f} GFLOP at the matmuls' {r['matmul_gflops']:.0f} GFLOP/s too: "
             f"{r['compute_floor_s']:.2f} s, at most {r['max_speedup_compute']:.2f}x"]
    for kind in ("prefill", "decode"):
        if kind in b:
            k = b[kind]
            lines.append(f"  {kind} steps: {k['steps']}, {k['tokens_per_step']:g} tokens each, {k['step_ms']:.2f} ms "
                         f"median = prepare {k['prepare_ms']:.2f} + forward {k['forward_ms']:.2f} + sample "
                         f"{k['sample_ms']:.2f}")
    if "against" in r:
        a = r["against"]
        lines.append(f"  linears: {gemm_route(r['cpu_gemm_rows'])} (measured); against "
                     f"{gemm_route(a['cpu_gemm_rows'])}: "
                     f"{a['s']:.2f} s, pdlab / it {a['ratio']:.2f}x (per triple {a['ratio_min']:.2f}-"
                     f"{a['ratio_max']:.2f}); outputs identical: {a['identical']}")
    if "gpu" in r:
        g = r["gpu"]
        if "decode_vs_floor" in g:
            lines.append(f"  decode step at {100 * g['decode_vs_floor']:.0f}% of the HBM floor ({g['decode_floor_ms']:.2f} ms)")
        if "prefill_vs_peak" in g:
            lines.append(f"  prefill at {g['prefill_tflops']:.0f} TFLOP/s, {100 * g['prefill_vs_peak']:.0f}% of the "
                         f"measured matmul peak ({g['peak_tflops']:.0f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdlab bench engine", description=__doc__.splitlines()[0])
    ap.add_argument("--case", nargs="+", choices=sorted(CASES), default=list(CASES))
    ap.add_argument("--shape", help="model of every case: a preset or hidden,layers,heads,kv_heads,ff,vocab")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each engine, alternating")
    ap.add_argument("--token-budget", type=int, default=2048,
                    help="pdlab's tokens per step (on a CPU, 1-2k keeps a step's activations in cache)")
    ap.add_argument("--kv-cache-mb", type=int, default=1024, help="pdlab's KV pool on CPU")
    ap.add_argument("--attention", default="auto", help="pdlab's attention backend")
    ap.add_argument("--compile", action="store_true", help="torch.compile pdlab's model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--against-gemm-rows", metavar="N|none",
                    help="also time a pdlab engine whose CPU linears run MKL's GEMM from N rows (none: never)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by this process's CPU time, not the wall clock (with --threads 1, steadier on a "
                         "shared machine)")
    args = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.process_time if args.cpu_time else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    device = parse_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"pdlab engine vs Hugging Face generate on {where}, {str(dtype).removeprefix('torch.')}, greedy")
    results = []
    for name in args.case:
        case = CASES[name]
        cfg = parse_shape(args.shape or case.shape)
        results.append(run_case(case, cfg, args, device, dtype))
        print(report(results[-1]), flush=True)
    print(json.dumps({"device": where, "dtype": str(dtype).removeprefix("torch."), "results": results}))
    return 0 if all(r["identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
