"""What layer-wise KV streaming buys: exposed transfer with transfer.stream=off against layer, 1P+1D.

    pdlab bench overlap [--shapes tiny,deep16] [--prompts 256,1024,4096] [--backends zmq,nccl]
                        [--repeats 3]

For each shape and transport one 1P+1D pool serves the same prompts, one request at a time, with the
prefill worker switched between `off` (the KV follows the prefill) and `layer` (each layer's KV goes
as soon as it is computed) in alternation, `--repeats` times each, so drift hits both alike. Per
request it reads the prefill's end and the last KV byte's arrival (both on the router's clock):
exposed transfer = last byte landed - prefill finished (zero or negative when fully hidden), and
the bulk transfer time (the sender's, begin to end, with `off`), and the gap between the first token
(sampled by the prefill) and the second (the decode worker's first step). Medians per cell. With L layers
the last layer's share cannot hide: the floor is about 1/L of the bulk time. Also checks that both
modes produce the same tokens. Ends with one JSON line whose lists are aligned row by row.

Shapes: `tiny` (the preset's shape, 4 layers) and `deep16` (16 layers of the tiny width), written as
seeded checkpoints with room for 8,192 positions (benchmarks/engine.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile

import ray

from cluster.config import ClusterConfig
from cluster.pool import WorkerPool
from cluster.ray_cluster import start_ray, stop_ray
from cluster.transfer.base import TransferConfig
from router.router import Router
from benchmarks.engine import checkpoint
from workers.config import PRESETS, EngineConfig
from workers.request import SamplingParams
from workers.weights import ModelSpec

SHAPES = {"tiny": dataclasses.replace(PRESETS["tiny"], name="tiny8k", max_position_embeddings=8192),
          "deep16": dataclasses.replace(PRESETS["tiny"], name="deep16", num_layers=16, max_position_embeddings=8192)}
OUTPUT_TOKENS = 4


def serve_one(router: Router, rid: str, prompt: list[int]):
    rec = router.submit(rid, prompt, SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True))
    if not router.wait(timeout_s=300):
        raise RuntimeError(f"{rid} did not finish")
    if rec.status != "ok":
        raise RuntimeError(f"{rid} failed: {rec.reason}")
    return rec


def measure(shape: str, backend: str, prompts: list[int], repeats: int) -> list[dict]:
    cfg = SHAPES[shape]
    spec = ModelSpec(model=None, checkpoint=str(checkpoint(cfg)), device="cpu")
    transfer = TransferConfig(backend=backend, stream="layer")
    engine = EngineConfig(num_kv_blocks=1200, token_budget=8192, max_model_len=8192)
    cluster = ClusterConfig(mode="disaggregated", prefill_workers=1, decode_workers=1, log_to_driver=False)
    pool = WorkerPool(cluster, spec, engine, transfer).start()
    prefill = pool.by_role("prefill")[0]
    rows = []
    try:
        router = Router(pool, transfer=transfer).start()
        for n in prompts:
            prompt = [(7 * i + n) % cfg.vocab_size for i in range(n)]
            got = {"off": [], "layer": []}
            for r in range(repeats):
                for mode in ("off", "layer"):            # alternate, so drift hits both alike
                    ray.get(prefill.actor.set_stream.remote(mode, 1))
                    got[mode].append(serve_one(router, f"{shape}-{backend}-{n}-{mode}-{r}", prompt))
            rows.append({"shape": shape, "num_layers": cfg.num_layers, "transport": backend, "prompt_tokens": n,
                         "transfer_ms": 1e3 * statistics.median(x.transfer_s for x in got["off"]),
                         "exposed_ms_off": 1e3 * statistics.median(x.kv_arrived - x.prefill_end for x in got["off"]),
                         "exposed_ms_layer": 1e3 * statistics.median(x.kv_arrived - x.prefill_end
                                                                     for x in got["layer"]),
                         "gap_ms_off": 1e3 * statistics.median(x.itl_s[0] for x in got["off"]),
                         "gap_ms_layer": 1e3 * statistics.median(x.itl_s[0] for x in got["layer"]),
                         "identical": len({tuple(x.output_ids) for m in got.values() for x in m}) == 1})
            print(row_text(rows[-1]), flush=True)
        router.close()
    finally:
        pool.shutdown()
    return rows


def row_text(r: dict) -> str:
    share = r["exposed_ms_layer"] / r["exposed_ms_off"] if r["exposed_ms_off"] > 0 else float("nan")
    return (f"{r['shape']:>7} ({r['num_layers']:2d} layers) {r['transport']:>4} {r['prompt_tokens']:5d} tokens: "
            f"transfer {r['transfer_ms']:7.1f} ms, exposed off {r['exposed_ms_off']:7.1f} ms, layer "
            f"{r['exposed_ms_layer']:7.1f} ms ({share:.2f} of off); first-to-second-token gap off "
            f"{r['gap_ms_off']:7.1f} ms, layer {r['gap_ms_layer']:7.1f} ms"
            f"{'' if r['identical'] else ', OUTPUTS DIFFER'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pdlab bench overlap", description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="tiny,deep16")
    ap.add_argument("--prompts", default="256,1024,4096", help="prompt lengths, comma-separated")
    ap.add_argument("--backends", default="zmq,nccl")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    shapes, backends = args.shapes.split(","), args.backends.split(",")
    prompts = [int(x) for x in args.prompts.split(",")]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"--shapes: {s!r} is not one of {sorted(SHAPES)}")
    start_ray(ClusterConfig(num_gpus=2, log_to_driver=False), temp_dir=tempfile.mkdtemp(prefix="pdlab-ray-"))
    rows = []
    try:
        for shape in shapes:
            for backend in backends:
                rows += measure(shape, backend, prompts, args.repeats)
    finally:
        stop_ray()
    deep = [r for r in rows if r["num_layers"] >= 16 and r["prompt_tokens"] == max(prompts)]
    for r in deep:
        ok = r["exposed_ms_layer"] <= 0.25 * r["exposed_ms_off"]
        print(f"target ({r['transport']}, {r['num_layers']} layers, {r['prompt_tokens']} tokens): exposed with layer "
              f"<= 25% of off: {'met' if ok else 'not met'}")
    keys = ("shape", "num_layers", "transport", "prompt_tokens", "transfer_ms", "exposed_ms_off", "exposed_ms_layer",
            "gap_ms_off", "gap_ms_layer")
    print(json.dumps({k: [r[k] for r in rows] for k in keys} | {"identical": all(r["identical"] for r in rows)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
