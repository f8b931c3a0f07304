"""Wiring a disaggregated pool's KV transfers, tolerating the loss of workers meanwhile.

ZeroMQ: each decode worker binds, then each prefill worker connects to every decode worker that
bound; a worker lost on the way is dropped (pool.gather) and the others go on, since a socket
connected to a lost peer is never used (the router sends nothing to a dead worker).

torch.distributed (NCCL, gloo on CPU): the workers join one group whose members are fixed when it
forms, so a worker lost while it forms leaves the others waiting for it. The workers first meet in a
rendezvous of their own on the store (nccl_transport.rendezvous); on a loss the pool marks it
abandoned, so every worker waiting there fails at once (or, when all had passed it, closes the
store, failing their waits inside the backend), instead of after the store's timeout. The survivors
then leave whatever they joined, and the group forms again with the survivors alone (a fresh store;
group ranks renumbered, the workers' pool ranks kept), up to MAX_FORMS times. A survivor that does not come back within cluster.startup_timeout_s (on NCCL, one
stuck in a collective with the lost peer) is dropped too.
"""
from __future__ import annotations

import logging

import ray

from cluster.ray_cluster import ClusterError

log = logging.getLogger(__name__)

MAX_FORMS = 3


def wire(pool) -> None:
    t = pool.transfer
    if t.backend == "zmq":
        _wire_zmq(pool)
    else:
        _wire_torch(pool)
    decode = pool.by_role("decode")
    pool.gather({w: w.actor.start_receiving.remote(t.max_frame_bytes) for w in decode}, "wiring (start receiving)")
    prefill = pool.by_role("prefill")
    pool.gather({w: w.actor.start_streaming.remote(t.stream_layers) for w in prefill}, "wiring (start streaming)")


def _local(pool) -> bool:
    return pool.cfg.address is None


def _wire_zmq(pool) -> None:
    t = pool.transfer
    decode = pool.by_role("decode")
    hosts = {w: t.bind_host if t.bind_host != "auto" else "127.0.0.1" if _local(pool) else w.info["host"]
             for w in decode}
    addrs = pool.gather({w: w.actor.zmq_bind.remote(t, hosts[w]) for w in decode}, "wiring (zmq bind)")
    peers = {w.rank: a for w, a in addrs.items() if w.alive}
    pool.gather({w: w.actor.zmq_connect.remote(t, peers) for w in pool.by_role("prefill")}, "wiring (zmq connect)")


def _wire_torch(pool) -> None:
    import torch.distributed as dist
    from cluster.transfer.nccl_transport import abandon, bound_listener

    t = pool.transfer
    host = "127.0.0.1" if _local(pool) else ray.util.get_node_ip_address()
    for form in range(1, MAX_FORMS + 1):
        members = [w for w in pool.workers if w.alive]
        ranks = [w.rank for w in members]
        pairs = [(p.rank, d.rank) for p in pool.by_role("prefill") if p.alive for d in pool.by_role("decode") if d.alive]
        # the store serves on a socket bound to this node's address (it would listen on all interfaces)
        listener = bound_listener(host)
        port = listener.getsockname()[1]
        pool._store = dist.TCPStore(host, port, len(members), is_master=True, wait_for_workers=False,
                                    master_listen_fd=listener.detach())
        calls = {w: w.actor.nccl_init.remote(t, len(members), host, port, pairs,
                                             "127.0.0.1" if _local(pool) else w.info["host"], ranks)
                 for w in members}
        lost_before = len(pool.lost)
        errors: dict = {}

        def on_loss():
            """The others stop waiting for the lost one: their calls fail, collected in `errors`."""
            if pool._store is not None and abandon(pool._store, len(members), "a member was lost"):
                pool._store = None      # its server stops with its last reference, failing their waits
        pool.gather(calls, "wiring (torch.distributed group)", errors=errors, on_loss=on_loss)
        if len(pool.lost) == lost_before:
            if errors:
                w, why = next(iter(errors.items()))
                raise ClusterError(f"{w.name} failed to join the torch.distributed group: {why}")
            return
        # someone was lost while the group formed: the others leave what they joined, and it forms again
        pool._store = None
        left = [w for w in members if w.alive]
        log.warning("re-forming the torch.distributed group without the lost workers (%d of %d tries): %s",
                    form, MAX_FORMS, pool.layout())
        pool.gather({w: w.actor.nccl_leave.remote() for w in left}, "wiring (leave the torch.distributed group)")
    raise ClusterError(f"the torch.distributed group could not form in {MAX_FORMS} tries: workers kept being lost "
                       f"({'; '.join(x['worker'] + ': ' + x['reason'] for x in pool.lost)})")
