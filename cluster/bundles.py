"""Which placement-group bundle each rank takes, once Ray has put the bundles on nodes.

Pure logic, no Ray: cluster/pool.py gives its workers their bundles with it, and the simulator
(experiments/sim/worker.py) places its workers on hosts the same way without starting Ray.
"""
from __future__ import annotations


def assign_bundles(roles: list[str], bundle_nodes: list[str], placement: str) -> list[int]:
    """Bundle index for each rank, given the node Ray put each bundle on.

    pack: walk the bundles node by node, giving them to ranks in pair order (p0, d0, p1, d1, ...).
    spread: each worker of a role goes to the node with the fewest workers of that role so far
    (then the most free bundles), so a role spans as many nodes as it has workers, up to the nodes."""
    order = bundle_order(roles)
    by_node: dict[str, list[int]] = {}
    for b, node in enumerate(bundle_nodes):
        by_node.setdefault(node, []).append(b)
    if len(by_node) == 1 or placement not in ("spread", "strict_spread"):
        grouped = [b for bundles in by_node.values() for b in bundles]
        out = [0] * len(roles)
        for rank, b in zip(order, grouped):
            out[rank] = b
        return out
    out = [0] * len(roles)
    counts: dict[tuple[str, str], int] = {}
    for role in ("prefill", "decode", "colocated"):
        for rank in (r for r in order if roles[r] == role):
            node = min((n for n in by_node if by_node[n]),
                       key=lambda n: (counts.get((role, n), 0), -len(by_node[n])))
            out[rank] = by_node[node].pop(0)
            counts[(role, node)] = counts.get((role, node), 0) + 1
    return out


def bundle_order(roles: list[str]) -> list[int]:
    """Ranks in bundle order: prefill and decode ranks interleaved (p0, d0, p1, d1, ...)."""
    prefill = [r for r, role in enumerate(roles) if role == "prefill"]
    decode = [r for r, role in enumerate(roles) if role == "decode"]
    other = [r for r, role in enumerate(roles) if role == "colocated"]
    order = []
    for i in range(max(len(prefill), len(decode))):
        order += prefill[i:i + 1] + decode[i:i + 1]
    return order + other
