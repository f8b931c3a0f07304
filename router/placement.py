"""Where an attempt goes: which worker computes the prompt and which makes the rest, and what a
request that can never be served is told before any worker sees it.

Normal paths: `colocated` (one worker does both), `handoff` (a prefill worker, then its KV to a
decode worker), `local` (a short prompt prefilled on its decode worker). Under `pack` the decode
worker is taken from the prefill worker's node when one there has room. When a role is empty the
request still goes where it can, and says so in its record: with no decode worker able to take KV
it is prefilled on a decode worker (`local`); with no decode worker alive it is served whole on a
prefill worker (`whole`); with no prefill worker alive it is prefilled on a decode worker.
"""
from __future__ import annotations

from dataclasses import dataclass

from workers.config import blocks_for


@dataclass
class Plan:
    kind: str                  # colocated | handoff | local | whole
    prefill: object            # WorkerHandle that computes the prompt
    decode: object             # WorkerHandle that makes the remaining tokens
    note: str | None = None    # why this is not the layout's usual path


def _pick(policy, loads: dict, workers: list, prompt_len: int):
    load = policy.choose([loads[w.rank] for w in workers], prompt_len)
    return next(w for w in workers if loads[w.rank] is load)


def plan(mode: str, workers: list, loads: dict, prefill_policy, decode_policy, prompt_len: int, total: int,
         threshold: int = 0, pack: bool = False) -> Plan | str:
    """`workers`: WorkerHandles (role, alive, in_service, info["host"]); `total`: prompt + tokens still to
    make. Returns the plan, or the reason no worker can take the attempt."""
    alive = [w for w in workers if w.alive]
    if mode == "colocated":
        served = [w for w in alive if w.role == "colocated"]
        if not served:
            return "no live colocated worker left"
        w = _pick(prefill_policy, loads, served, prompt_len)
        return Plan("colocated", w, w)
    prefills = [w for w in alive if w.role == "prefill"]
    decodes = [w for w in alive if w.role == "decode"]
    receiving = [w for w in decodes if w.in_service]
    if prompt_len < threshold and decodes:
        d = _pick(decode_policy, loads, decodes, prompt_len)
        return Plan("local", d, d)
    if prefills and receiving:
        p = _pick(prefill_policy, loads, prefills, prompt_len)
        near = [w for w in receiving if w.info.get("host") == p.info.get("host")
                and loads[w.rank].kv_capacity_tokens - loads[w.rank].kv_tokens >= total]
        d = _pick(decode_policy, loads, near if pack and near else receiving, prompt_len)
        return Plan("handoff", p, d)
    if decodes:
        d = _pick(decode_policy, loads, decodes, prompt_len)
        why = "no live prefill worker" if not prefills else "no decode worker can receive KV"
        return Plan("local", d, d, f"prefilled on {d.name}: {why}")
    if prefills:
        p = _pick(prefill_policy, loads, prefills, prompt_len)
        return Plan("whole", p, p, f"served whole on {p.name}: no live decode worker")
    return "no live worker left"


def never_fits(mode: str, workers: list, prompt_len: int, max_tokens: int, threshold: int,
               max_frame_bytes: int, max_pending_bytes: int) -> str | None:
    """Why no layout path could ever serve this request (None if one can): checked at admission,
    from the pool's static sizes, so nothing is prefilled for a request that cannot finish."""
    n, total = prompt_len, prompt_len + max_tokens

    def largest(role: str, tokens: int) -> tuple[int, int, int]:
        """(blocks it needs, most blocks any worker of the role holds, that worker's block size)"""
        ws = [w for w in workers if w.role == role]
        best = max(ws, key=lambda w: w.info["num_kv_blocks"] * w.info["block_size"])
        bs = best.info["block_size"]
        return blocks_for(tokens, bs), best.info["num_kv_blocks"], bs

    serving = "colocated" if mode == "colocated" else "decode"
    need, have, bs = largest(serving, total)
    if need > have:
        return (f"prompt ({n}) + max_tokens ({max_tokens}) needs {need} KV blocks of {bs} tokens; the largest "
                f"{serving} worker's pool holds {have}")
    if mode == "colocated" or n < threshold:
        return None
    need, have, bs = largest("prefill", n + 1)
    if need > have:
        return f"prompt ({n}) needs {need} KV blocks of {bs} tokens; the largest prefill worker's pool holds {have}"
    decode = next(w for w in workers if w.role == "decode").info
    per_token = decode["kv_bytes_per_token"]
    layer = per_token // decode["num_layers"] * n
    if layer > max_frame_bytes:
        return (f"one layer of its prompt's KV is {layer} bytes, more than transfer.max_frame_bytes="
                f"{max_frame_bytes}")
    if per_token * n > max_pending_bytes:
        return (f"its prompt's KV is {per_token * n} bytes, more than a decode worker may hold in flight "
                f"(transfer.max_pending_bytes={max_pending_bytes})")
    return None
