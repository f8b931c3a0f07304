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


def pick(policy, loads: dict, workers: list, prompt_len: int):
    load = policy.choose([loads[w.rank] for w in workers], prompt_len)
    return next(w for w in workers if loads[w.rank] is load)


class ScanView:
    """plan()'s view of the workers from a look at every one (router/load_index.py: the same answers
    without one): whether a group has a live member, the member a policy picks, the receiving
    workers on a host with room."""

    def __init__(self, workers: list, loads: dict):
        alive = [w for w in workers if w.alive]
        self.loads = loads
        self.groups = {role: [w for w in alive if w.role == role] for role in ("colocated", "prefill", "decode")}
        self.groups["receiving"] = [w for w in self.groups["decode"] if w.in_service]

    def has(self, group: str) -> bool:
        return bool(self.groups[group])

    def pick(self, group: str, policy, prompt_len: int):
        return pick(policy, self.loads, self.groups[group], prompt_len) if self.groups[group] else None

    def near(self, host, total: int) -> list:
        loads = self.loads
        return [w for w in self.groups["receiving"] if w.info.get("host") == host
                and loads[w.rank].kv_capacity_tokens - loads[w.rank].kv_tokens >= total]


def plan(mode: str, workers: list, loads: dict, prefill_policy, decode_policy, prompt_len: int, total: int,
         threshold: int = 0, pack: bool = False, index=None) -> Plan | str:
    """`workers`: WorkerHandles (role, alive, in_service, info["host"]); `total`: prompt + tokens still to
    make; `index`: a router/load_index.LoadIndex over the same workers and loads (None: look at every
    worker). Returns the plan, or the reason no worker can take the attempt."""
    view = index if index is not None else ScanView(workers, loads)
    if mode == "colocated":
        if not view.has("colocated"):
            return "no live colocated worker left"
        w = view.pick("colocated", prefill_policy, prompt_len)
        return Plan("colocated", w, w)
    has_prefill, has_decode = view.has("prefill"), view.has("decode")
    if prompt_len < threshold and has_decode:
        d = view.pick("decode", decode_policy, prompt_len)
        return Plan("local", d, d)
    if has_prefill and view.has("receiving"):
        p = view.pick("prefill", prefill_policy, prompt_len)
        near = view.near(p.info.get("host"), total) if pack else []
        d = pick(decode_policy, loads, near, prompt_len) if near else view.pick("receiving", decode_policy, prompt_len)
        return Plan("handoff", p, d)
    if has_decode:
        d = view.pick("decode", decode_policy, prompt_len)
        why = "no live prefill worker" if not has_prefill else "no decode worker can receive KV"
        return Plan("local", d, d, f"prefilled on {d.name}: {why}")
    if has_prefill:
        p = view.pick("prefill", prefill_policy, prompt_len)
        return Plan("whole", p, p, f"served whole on {p.name}: no live decode worker")
    return "no live worker left"


def pool_sizes(workers: list) -> dict:
    """What never_fits reads of a pool, fixed for its life: per role the worker with the largest KV
    pool (the first of equals) and the first worker."""
    def tokens(w):
        return w.info["num_kv_blocks"] * w.info["block_size"]

    largest, first = {}, {}
    for w in workers:
        first.setdefault(w.role, w)
        if w.role not in largest or tokens(w) > tokens(largest[w.role]):
            largest[w.role] = w
    return {"largest": largest, "first": first}


def never_fits(mode: str, workers: list, prompt_len: int, max_tokens: int, threshold: int,
               max_frame_bytes: int, max_pending_bytes: int, sizes: dict | None = None) -> str | None:
    """Why no layout path could ever serve this request (None if one can): checked at admission,
    from the pool's static sizes (`sizes`: pool_sizes(workers), computed once), so nothing is
    prefilled for a request that cannot finish."""
    n, total = prompt_len, prompt_len + max_tokens
    sizes = sizes or pool_sizes(workers)

    def largest(role: str, tokens: int) -> tuple[int, int, int]:
        """(blocks it needs, most blocks any worker of the role holds, that worker's block size)"""
        best = sizes["largest"][role]
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
    decode = sizes["first"]["decode"].info
    per_token = decode["kv_bytes_per_token"]
    layer = per_token // decode["num_layers"] * n
    if layer > max_frame_bytes:
        return (f"one layer of its prompt's KV is {layer} bytes, more than transfer.max_frame_bytes="
                f"{max_frame_bytes}")
    if per_token * n > max_pending_bytes:
        return (f"its prompt's KV is {per_token * n} bytes, more than a decode worker may hold in flight "
                f"(transfer.max_pending_bytes={max_pending_bytes})")
    return None
