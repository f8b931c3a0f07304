"""Transfer benchmark: each KV transport end to end, next to the raw ceiling of its wire, per size.

    pdlab bench transfer [--sizes-mib 1,16,64,256] [--repeats N] [--backends nccl,zmq]
                         [--device auto|cpu|cuda] [--chunk-mib 8]

Two spawned processes on this machine: rank 0 sends, rank 1 receives. For each size and
measurement there is one untimed warm-up transfer, then `repeats` back-to-back transfers, timed on
rank 0 from its first send until rank 1 acks the last arrival over a Pipe. GB/s = 1e9 bytes/s.

    nccl      NcclChannel begin/part/end -> NcclTransport.start_receiving deliveries (gloo when on CPU)
    raw dist  dist.send / dist.recv of one uint8 buffer over the same pair group and backend
    zmq       ZmqChannel begin/part/end -> ZmqTransport.start_receiving deliveries, loopback, CPU tensors
    raw zmq   PUSH/PULL on loopback, the same bytes in chunk-sized frames, copy=False both ends

Raw dist runs for every size before the nccl receiver starts: its receive thread owns the group.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import multiprocessing as mp
import queue
import sys
import time
import traceback

import torch
import torch.distributed as dist
import zmq

from cluster.transfer.base import BACKENDS, End, Part, TransferConfig, send
from cluster.transfer.wire import Expect, KVHandoff

HOST = "127.0.0.1"
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, "bfloat16"   # Llama-3-8B-like KV
TOKEN_BYTES = NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_DIM * 2           # 128 KiB per token
PARAMS = {"max_tokens": 1, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop_token_ids": [], "ignore_eos": True}
TARGET_RATIO, TARGET_SIZE_MIB = 0.8, 256
RAW = {"nccl": "raw_dist", "zmq": "raw_zmq"}         # each backend's raw ceiling


def default_repeats(size_mib: int) -> int:
    return max(8, min(50, 4096 // size_mib))     # 4 GiB per measurement at 256 MiB


def kv_shape(size_mib: int) -> tuple[int, ...]:
    num_tokens = max(1, round(size_mib * 2**20 / TOKEN_BYTES))
    return (NUM_LAYERS, 2, num_tokens, NUM_KV_HEADS, HEAD_DIM)     # [layers, 2, T, KVH, D]


def _timed(rank: int, pipe, move, repeats: int) -> float:
    """One warm-up transfer, then `repeats`; returns rank 0's seconds from first send to the last ack."""
    seconds = 0.0
    for n in (1, repeats):
        start = time.perf_counter()
        move(n)                                   # rank 0: send n; rank 1: wait until n arrived
        pipe.recv() if rank == 0 else pipe.send(n)
        seconds = time.perf_counter() - start
    return seconds


def _transport_move(rank, channel, arrived: queue.Queue, shape, device):
    """Rank 0 sends handoffs through `channel`; rank 1 counts deliveries (or errors) in `arrived`."""
    nbytes = TOKEN_BYTES * shape[2]
    if rank == 1:
        def wait(n: int) -> None:
            for _ in range(n):
                if (got := arrived.get(timeout=300)) != nbytes:
                    raise RuntimeError(f"receiver: {got!r} instead of {nbytes} bytes")
        return wait
    kv = torch.ones(shape, dtype=getattr(torch, DTYPE), device=device)
    handoff, ids = KVHandoff("bench", [1] * shape[2], PARAMS, DTYPE, shape), itertools.count()

    def move(n: int) -> None:
        for _ in range(n):
            send(channel, dataclasses.replace(handoff, request_id=f"bench-{next(ids)}"), kv)
    return move


def _counter(arrived: queue.Queue):
    """A receiver's deliveries: parts released at once, each end's byte count (or a problem) queued."""
    def deliver(d):
        if isinstance(d, Part):
            d.release()
        elif isinstance(d, End):
            arrived.put(d.nbytes)
    return deliver


def _raw_dist_move(rank, group, nbytes, device):
    buf = torch.ones(nbytes, dtype=torch.uint8, device=device)

    def move(n: int) -> None:
        for _ in range(n):
            if rank == 0:
                dist.send(buf, 1, group=group)
            else:
                dist.recv(buf, 0, group=group)
        if device.type == "cuda":     # this thread's stream, which waited on the transfers: never the device
            torch.cuda.current_stream(device).synchronize()
    return move


def _raw_zmq_move(rank, sock, nbytes, chunk_bytes):
    if rank == 1:
        def recv(n: int) -> None:
            left = n * nbytes
            while left > 0:
                left -= len(sock.recv(copy=False))
        return recv
    view = memoryview(torch.ones(nbytes, dtype=torch.uint8).numpy())
    chunks = [view[i:i + chunk_bytes] for i in range(0, nbytes, chunk_bytes)]

    def send(n: int) -> None:
        for _ in range(n):
            for chunk in chunks:
                sock.send(chunk, copy=False)
    return send


def _setup(plan: dict) -> tuple[TransferConfig, Expect]:
    max_bytes = max(TOKEN_BYTES * kv_shape(s)[2] for s, _ in plan["sizes"])
    cfg = TransferConfig(timeout_s=120.0, chunk_bytes=plan["chunk_bytes"], max_frame_bytes=max_bytes)
    expect = Expect(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, DTYPE, vocab_size=2, max_tokens=max_bytes // TOKEN_BYTES + 1,
                    max_frame_bytes=max_bytes)     # room for the prompt and the one token its params ask for
    return cfg, expect


def _bench_dist(rank: int, plan: dict, pipe, device: torch.device) -> dict[str, float]:
    from cluster.transfer.nccl_transport import NcclTransport
    cfg, expect = _setup(plan)
    nccl = NcclTransport(cfg, rank, 2, HOST, plan["store_port"], [(0, 1)], device)
    group, seconds, arrived = nccl.groups[(0, 1)], {}, queue.Queue()
    for size_mib, repeats in plan["sizes"]:   # before the receive thread owns the group
        move = _raw_dist_move(rank, group, TOKEN_BYTES * kv_shape(size_mib)[2], device)
        seconds[f"raw_dist/{size_mib}"] = _timed(rank, pipe, move, repeats)
    if rank == 1:
        nccl.start_receiving(expect, _counter(arrived), arrived.put)
    channel = nccl.channel(1) if rank == 0 else None
    for size_mib, repeats in plan["sizes"]:
        move = _transport_move(rank, channel, arrived, kv_shape(size_mib), device)
        seconds[f"nccl/{size_mib}"] = _timed(rank, pipe, move, repeats)
    if rank == 0:
        channel.close()   # end of stream: the receive thread returns, nothing is left blocked
    nccl.close()
    return seconds


def _bench_zmq(rank: int, plan: dict, pipe) -> dict[str, float]:
    from cluster.transfer.zmq_transport import ZmqTransport
    cfg, expect = _setup(plan)
    ctx, seconds, arrived = zmq.Context.instance(), {}, queue.Queue()
    raw = ctx.socket(zmq.PULL if rank == 1 else zmq.PUSH)
    raw.setsockopt(zmq.RCVHWM if rank == 1 else zmq.SNDHWM, 0)
    if rank == 1:
        raw.bind_to_random_port(f"tcp://{HOST}")
        transport, channel = ZmqTransport(cfg, HOST), None
        pipe.send((raw.getsockopt_string(zmq.LAST_ENDPOINT), transport.bind()))
        transport.start_receiving(expect, _counter(arrived), arrived.put)
    else:
        raw_address, address = pipe.recv()
        raw.connect(raw_address)
        transport = ZmqTransport(cfg, HOST, {1: address})
        channel = transport.channel(1)
    for size_mib, repeats in plan["sizes"]:
        move = _raw_zmq_move(rank, raw, TOKEN_BYTES * kv_shape(size_mib)[2], cfg.chunk_bytes)
        seconds[f"raw_zmq/{size_mib}"] = _timed(rank, pipe, move, repeats)
        move = _transport_move(rank, channel, arrived, kv_shape(size_mib), torch.device("cpu"))
        seconds[f"zmq/{size_mib}"] = _timed(rank, pipe, move, repeats)
    raw.close(linger=0)
    if channel is not None:
        channel.close()
    transport.close()
    return seconds


def _run_rank(rank: int, plan: dict, pipe, result_pipe) -> None:
    try:
        device = torch.device(f"cuda:{rank}" if plan["device"] == "cuda" else "cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        seconds = _bench_dist(rank, plan, pipe, device) if "nccl" in plan["backends"] else {}
        if "zmq" in plan["backends"]:
            seconds |= _bench_zmq(rank, plan, pipe)
        if rank == 0:
            result_pipe.send(("ok", seconds))
    except BaseException:
        message = traceback.format_exc()
        if result_pipe is not None:
            result_pipe.send(("error", message))
        print(f"rank {rank} failed:\n{message}", file=sys.stderr)
        sys.exit(1)


def _run_ranks(plan: dict, timeout_s: float) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    pipe0, pipe1 = ctx.Pipe()
    results_in, results_out = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_run_rank, args=(0, plan, pipe0, results_out), daemon=True),
             ctx.Process(target=_run_rank, args=(1, plan, pipe1, None), daemon=True)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not results_in.poll(1.0):
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                raise RuntimeError("a benchmark rank died or hung; see its message above")
        status, payload = results_in.recv()
        if status != "ok":
            raise RuntimeError("rank 0 failed; see its message above")
        return payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()           # left waiting on a peer that failed


def pick_device(name: str) -> tuple[str, str | None]:
    """'cpu' or 'cuda', and a note when a GPU run was asked for or possible but cannot happen."""
    num_gpus = torch.cuda.device_count()
    if name == "cpu" or (name == "auto" and num_gpus == 0):
        return "cpu", None
    if num_gpus >= 2:
        return "cuda", None
    return "cpu", (f"nccl on GPU needs two GPUs (rank 0 on cuda:0, rank 1 on cuda:1); found {num_gpus}: "
                   "skipping it and measuring gloo on CPU instead")


def summarize(sizes, backends: list[str], seconds: dict[str, float]) -> list[dict]:
    rows = []
    for size_mib, repeats in sizes:
        nbytes = TOKEN_BYTES * kv_shape(size_mib)[2]
        row = {"size_mib": size_mib, "nbytes": nbytes, "repeats": repeats}
        for backend in backends:
            raw = RAW[backend]
            gbps = nbytes * repeats / seconds[f"{backend}/{size_mib}"] / 1e9
            raw_gbps = nbytes * repeats / seconds[f"{raw}/{size_mib}"] / 1e9
            row |= {f"{backend}_gbps": float(f"{gbps:.6g}"), f"{raw}_gbps": float(f"{raw_gbps:.6g}"),
                    f"{backend}_ratio": float(f"{gbps / raw_gbps:.6g}")}
        rows.append(row)
    return rows


def print_table(rows: list[dict], dist_backend: str) -> None:
    columns = [("size MiB", "size_mib", "d"), ("reps", "repeats", "d"), (f"{dist_backend} GB/s", "nccl_gbps", ".3f"),
               ("raw dist GB/s", "raw_dist_gbps", ".3f"), ("ratio", "nccl_ratio", ".2f"),
               ("zmq GB/s", "zmq_gbps", ".3f"), ("raw zmq GB/s", "raw_zmq_gbps", ".3f"), ("ratio", "zmq_ratio", ".2f")]
    print(" | ".join(title for title, _, _ in columns))
    for r in rows:
        print(" | ".join(format(r[key], spec).rjust(len(title)) if key in r else "-".rjust(len(title))
                         for title, key, spec in columns))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdlab bench transfer", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mib", default="1,16,64,256", help="comma-separated payload sizes, MiB (1..256)")
    ap.add_argument("--repeats", type=int, default=None, help="timed transfers per size (default: by size)")
    ap.add_argument("--backends", default="nccl,zmq", help="comma-separated subset of nccl,zmq")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--chunk-mib", type=int, default=8, help="zmq frame size, MiB (transport and raw)")
    args = ap.parse_args(argv)
    try:
        sizes_mib = [int(s) if s.strip().isdigit() else 0 for s in args.sizes_mib.split(",")]
        backends = [b for b in BACKENDS if b in args.backends.split(",")]
        if min(sizes_mib) <= 0 or max(sizes_mib) > 256:
            raise ValueError(f"--sizes-mib={args.sizes_mib!r}: give whole MiB in 1..256, comma-separated")
        if set(args.backends.split(",")) - set(BACKENDS):
            raise ValueError(f"--backends={args.backends!r}: choose from {list(BACKENDS)}")
        if (args.repeats is not None and args.repeats <= 0) or args.chunk_mib <= 0:
            raise ValueError("--repeats and --chunk-mib must be positive")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    device, note = pick_device(args.device)
    if note:
        print(f"note: {note}")
    sizes = [(s, args.repeats or default_repeats(s)) for s in sizes_mib]
    store = None
    if "nccl" in backends:   # served on a socket bound to HOST: a TCPStore alone listens on every interface
        from cluster.transfer.nccl_transport import bound_listener
        listener = bound_listener(HOST)
        store = dist.TCPStore(HOST, listener.getsockname()[1], 2, is_master=True, wait_for_workers=False,
                              master_listen_fd=listener.detach())
    plan = {"device": device, "backends": backends, "sizes": sizes, "chunk_bytes": args.chunk_mib << 20,
            "store_port": store.port if store else 0}
    try:
        seconds = _run_ranks(plan, timeout_s=900)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    dist_backend = "nccl" if device == "cuda" else "gloo"
    rows = summarize(sizes, backends, seconds)
    print(f"device {device}, dist backend {dist_backend}; zmq on loopback with CPU tensors; KV [{NUM_LAYERS}, 2, T, "
          f"{NUM_KV_HEADS}, {HEAD_DIM}] {DTYPE}; zmq chunks {args.chunk_mib} MiB; GB/s = 1e9 bytes/s")
    print_table(rows, dist_backend)
    at_target = next((r for r in rows if r["size_mib"] == TARGET_SIZE_MIB), None)
    met = {}
    for backend in backends:
        ratio = at_target[f"{backend}_ratio"] if at_target else None
        met[backend] = None if ratio is None else ratio >= TARGET_RATIO
        verdict = "not measured" if ratio is None else f"{ratio:.2f} of raw, {'met' if met[backend] else 'NOT met'}"
        print(f"target: {backend} >= {TARGET_RATIO:.0%} of its raw ceiling at {TARGET_SIZE_MIB} MiB: {verdict}")
    print(json.dumps({"device": device, "dist_backend": dist_backend, "backends": backends, "note": note,
                      "chunk_mib": args.chunk_mib, "kv_dtype": DTYPE, "target_ratio": TARGET_RATIO,
                      "target_size_mib": TARGET_SIZE_MIB, "met_target": met, "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
