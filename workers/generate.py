"""Offline generation with one engine: JSONL prompts in, JSONL results out.

    python -m workers.generate --model tiny --prompts prompts.jsonl --out results.jsonl

Input lines: {"id": ..., "prompt_ids": [...], "max_tokens": N} and optionally temperature, top_p,
seed, stop_token_ids, ignore_eos. Greedy unless a line asks otherwise. A bad line (not UTF-8, not
JSON, or failing the request rules of workers/request.py) gets an output line with its `error`, as
does a request that fails while being served; the others complete, and the output file is always
written. Ends with one JSON summary line on stdout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from workers.config import CheckpointError, EngineConfig
from workers.engine import Engine
from workers.request import SAMPLING_FIELDS, InvalidRequest, SamplingParams, Status, check_request_id
from workers.weights import build_model, parse_device, resolve_dtype

FIELDS = {"id", "prompt_ids", "max_tokens", "temperature", "top_p", "seed", "stop_token_ids", "ignore_eos"}


def parse_line(line: bytes | str, lineno: int, default_seed: int) -> tuple[object, list, SamplingParams]:
    """-> (id, prompt_ids, params); raises InvalidRequest naming the line's id (or the line).
    The sampling fields go through SamplingParams.from_dict: the same rules as the router's."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidRequest(f"line {lineno}", f"not valid UTF-8: {e}") from None
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as e:
        raise InvalidRequest(f"line {lineno}", f"not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise InvalidRequest(f"line {lineno}", "not a JSON object")
    rid = obj.get("id", f"line {lineno}")
    check_request_id(rid)
    unknown = sorted(set(obj) - FIELDS)
    if unknown:
        raise InvalidRequest(rid, f"unknown field(s) {unknown}; known: {sorted(FIELDS)}")
    if "prompt_ids" not in obj:
        raise InvalidRequest(rid, "missing field 'prompt_ids'")
    fields = {k: obj[k] for k in SAMPLING_FIELDS if k in obj}
    if isinstance(fields.get("stop_token_ids"), int):
        fields["stop_token_ids"] = [fields["stop_token_ids"]]
    fields.setdefault("seed", default_seed + lineno)
    try:
        params = SamplingParams.from_dict(fields)
    except (TypeError, ValueError) as e:
        raise InvalidRequest(rid, str(e)) from None
    return rid, obj["prompt_ids"], params


def result_line(req) -> dict:
    times = req.token_times
    itl = [b - a for a, b in zip(times, times[1:])]
    return {
        "id": req.id,
        "prompt_len": req.num_prompt_tokens,
        "output_ids": req.output_ids,
        "finish_reason": req.finish_reason,
        "ttft_s": times[0] - req.arrival_time,
        "e2e_s": times[-1] - req.arrival_time,
        "itl_mean_s": statistics.fmean(itl) if itl else None,
        "num_preemptions": req.num_preemptions,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workers.generate", description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="local Hugging Face Llama directory (config.json + *.safetensors)")
    src.add_argument("--model", help="preset with seeded random weights: tiny, llama-3.2-1b, llama-3-8b, llama-3-70b")
    ap.add_argument("--prompts", required=True, help="input JSONL")
    ap.add_argument("--out", required=True, help="output JSONL")
    ap.add_argument("--policy", default="chunked", choices=["prefill_first", "chunked"])
    ap.add_argument("--token-budget", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--kv-cache-mb", type=int, default=256, help="KV pool size on CPU")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bfloat16 on GPU, float32 on CPU)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--seed", type=int, default=0, help="random weights and default sampling seeds")
    args = ap.parse_args(argv)

    try:
        device = parse_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        ecfg = EngineConfig(policy=args.policy, token_budget=args.token_budget, block_size=args.block_size,
                            max_batch=args.max_batch, max_model_len=args.max_model_len,
                            kv_cache_bytes=args.kv_cache_mb << 20)
        t0 = time.perf_counter()
        model = build_model(model=args.model, checkpoint=args.checkpoint, dtype=dtype, device=device, seed=args.seed)
        engine = Engine(model, ecfg)
        load_s = time.perf_counter() - t0
        with open(args.prompts, "rb") as f:
            lines = f.read().splitlines()
    except (CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    results: list[dict | None] = []
    accepted = {}
    start = engine.clock()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rid, prompt_ids, params = parse_line(line, lineno, args.seed)
            req = engine.add_request(rid, prompt_ids, params, arrival_time=start)
            accepted[len(results)] = req
            results.append(None)
        except InvalidRequest as e:
            print(f"rejected: {e}", file=sys.stderr)
            results.append({"id": e.request_id, "error": e.reason})
    try:
        engine.run()
    except Exception as e:   # an engine bug: the requests still running fail, the finished ones are kept
        print(f"error: engine stopped: {type(e).__name__}: {e}", file=sys.stderr)
        for req in list(engine.requests.values()):
            engine.abort(req.id, f"engine stopped: {type(e).__name__}: {e}")
    for i, req in accepted.items():
        results[i] = result_line(req) if req.status is Status.FINISHED else {"id": req.id, "error": req.finish_reason}
    with open(args.out, "w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")

    ok = [r for r in results if "error" not in r]
    wall = engine.clock() - start
    summary = {
        "model": args.model or args.checkpoint, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "policy": args.policy, "num_requests": len(results), "num_completed": len(ok),
        "num_rejected": len(results) - len(ok), "output_tokens": sum(len(r["output_ids"]) for r in ok),
        "steps": len(engine.trace), "load_s": round(load_s, 3), "generate_s": round(wall, 3),
        "kv_blocks": engine.blocks.num_blocks, "memory": engine.memory(),
    }
    print(f"{summary['num_completed']}/{summary['num_requests']} requests, {summary['output_tokens']} tokens "
          f"in {wall:.2f} s ({summary['steps']} steps) -> {args.out}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
