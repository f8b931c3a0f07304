"""The driver of tests/test_multinode.py: a two-node Ray cluster on this machine, and pdlab on it.

    python tests/multinode_driver.py WORKDIR        (prints one JSON line of results, last)

Starts a head (`ray start --head`, 127.0.0.2) and a second node joined by address (127.0.0.3), each
with one fake GPU, its own temp dir under WORKDIR and its own ports, and without the project on its
PYTHONPATH (pdlab ships its packages to the nodes). Then, with two workers per GPU
(cluster.gpus_per_worker=0.5) spread over the nodes, 2P+2D:
  zmq              the tokens of a local run, and where each worker ran
  kill_serving     then node 2 lost while requests decode on it: every request ends ok, tokens unchanged
  nccl             (node 2 restarted) the tokens of a local run over torch.distributed (gloo on CPU)
  kill_startup     node 2 lost just before wiring: its workers dropped, the torch.distributed group formed
                   again without them, the point served on the head's 1P+1D with the tokens of a local run
A node is lost the way a machine is: SIGKILL to every process holding a file under its temp dir
and to its `ray start` (only processes this driver started). Whatever happens, every process it
started is stopped before it exits. A separate process because a process joins one Ray cluster, and
the test session's embedded one is already up.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HEAD_IP, NODE_IP = "127.0.0.2", "127.0.0.3"
# the GCS notices a lost node within about two seconds (the default takes tens); the cluster's own
# token, given to the head, the second node and this driver alike (no token file is read or written)
HEALTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
          "RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "500",
          "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3"}


def free_ports(host: str, n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def ray_command() -> str:
    """The `ray` command of this interpreter's Ray (beside it, else on PATH)."""
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else (shutil.which("ray") or "ray")


class Node:
    """One `ray start --block` and the processes it starts (all under its own temp dir)."""

    def __init__(self, work: Path, name: str, ip: str, head: str | None = None):
        self.ip, self.dir = ip, work / name
        self.dir.mkdir(parents=True, exist_ok=True)
        ports = free_ports(ip, 7)
        # no CPUs declared: the workers reserve none (cluster.cpus_per_worker=0), and Ray then prestarts
        # no idle worker processes to compete for this machine's cores
        cmd = [ray_command(), "start", "--block", "--node-ip-address", ip,
               "--num-gpus", "1", "--num-cpus", "0", "--temp-dir", str(self.dir), "--disable-usage-stats",
               "--node-manager-port", str(ports[0]), "--object-manager-port", str(ports[1]),
               "--dashboard-agent-listen-port", str(ports[2]), "--dashboard-agent-grpc-port", str(ports[3]),
               "--metrics-export-port", str(ports[4]), "--runtime-env-agent-port", str(ports[5])]
        if head is None:
            self.address = f"{ip}:{ports[6]}"
            cmd += ["--head", "--port", str(ports[6]), "--include-dashboard", "false"]
        else:
            self.address = head
            cmd += ["--address", head]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_AUTH_TOKEN_PATH")} | HEALTH
        self.log = open(self.dir / "ray-start.log", "w")
        self.proc = subprocess.Popen(cmd, env=env, cwd=self.dir, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 90
        while "Ray runtime started" not in (self.dir / "ray-start.log").read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start ({name}) did not come up: "
                                   + (self.dir / "ray-start.log").read_text()[-2000:])
            time.sleep(0.2)

    def kill(self) -> None:
        """The node lost: SIGKILL to its processes at once."""
        from cluster.ray_watchdog import holding
        for pid in [self.proc.pid, *holding([str(self.dir)])]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)     # ray start --block stops what it started
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


def wait_nodes(n: int, timeout_s: float = 60) -> None:
    import ray
    deadline = time.monotonic() + timeout_s
    while sum(1 for x in ray.nodes() if x["Alive"] and x["Resources"].get("GPU")) != n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{n} nodes with a GPU did not join within {timeout_s:g} s: {ray.nodes()}")
        time.sleep(0.2)


def main(work: Path) -> dict:
    import ray

    from cluster.config import ClusterConfig
    from cluster.pool import WorkerPool
    from cluster.ray_cluster import start_ray
    from cluster.transfer.base import TransferConfig
    from router.router import Router
    from tests.test_cluster import DECODE_ENGINE, ENGINE, PROMPTS, SPEC, greedy, greedy_tokens

    engines = {"prefill": ENGINE.replace(role="prefill"), "decode": DECODE_ENGINE.replace(role="decode")}
    nodes = [Node(work, "h", HEAD_IP)]
    out: dict = {}
    try:
        nodes.append(Node(work, "n2", NODE_IP, nodes[0].address))
        start_ray(ClusterConfig(address=nodes[0].address, log_to_driver=False))
        wait_nodes(2)
        out["driver_node_ip"] = ray.util.get_node_ip_address()

        def cluster(**kw):
            return ClusterConfig(address=nodes[0].address, prefill_workers=2, decode_workers=2, placement="spread",
                                 gpus_per_worker=0.5, cpus_per_worker=0, torch_threads=1, log_to_driver=False,
                                 startup_timeout_s=60, **kw)

        def serve(pool, transfer, copies=1, max_tokens=12, spacing_s=0.0, during=None):
            router = Router(pool, transfer=transfer).start()
            recs = []
            for i, p in enumerate(PROMPTS * copies):
                recs.append(router.submit(f"r{i}", p, greedy(max_tokens)))
                time.sleep(spacing_s)
            if during is not None:
                during(router)
            done = router.wait(timeout_s=120)
            router.close()
            return {"done": done, "tokens_equal": [r.output_ids for r in recs] == greedy_tokens(max_tokens) * copies,
                    "status": [r.status for r in recs], "reasons": [r.reason for r in recs if r.reason],
                    "attempts": [r.attempts for r in recs],
                    "crashes": [r.crashes for r in recs], "decode_workers": sorted({r.decode_worker for r in recs})}

        def on_node2(router) -> bool:
            """Some request is being decoded on a node-2 worker (its first token in, more to come)."""
            on2 = {w.name for w in router.pool.workers if w.info["host"] == NODE_IP}
            return any(r.decode_worker in on2 and r.output_ids and not r.done for r in router.records.values())

        def lose_node2(router):
            deadline = time.monotonic() + 30
            while not on_node2(router) and time.monotonic() < deadline:
                time.sleep(0.01)
            out["kill_serving_hit"] = on_node2(router)
            nodes[1].kill()

        # zmq: served across both nodes; then node 2 lost while requests decode on it
        transfer = TransferConfig(backend="zmq")
        pool = WorkerPool(cluster(), SPEC, engines, transfer).start()
        try:
            out["zmq"] = serve(pool, transfer) | {"places": {w.name: w.info["host"] for w in pool.workers}}
            out["kill_serving"] = serve(pool, transfer, copies=2, max_tokens=40, during=lose_node2) | {
                "alive": {w.name: w.alive for w in pool.workers}}
        finally:
            pool.shutdown()

        # node 2 back; nccl across both nodes (gloo on CPU), then node 2 lost between placement and wiring
        nodes[1] = Node(work, "n2b", NODE_IP, nodes[0].address)
        wait_nodes(2)
        transfer = TransferConfig(backend="nccl")
        pool = WorkerPool(cluster(), SPEC, engines, transfer).start()
        try:
            out["nccl"] = serve(pool, transfer) | {"places": {w.name: w.info["host"] for w in pool.workers}}
        finally:
            pool.shutdown()
        original = WorkerPool._wire

        def wire_after_losing_node(self):
            nodes[1].kill()
            return original(self)
        WorkerPool._wire = wire_after_losing_node
        try:
            start = time.monotonic()
            pool = WorkerPool(cluster(), SPEC, engines, transfer).start()
            up_s = time.monotonic() - start
        finally:
            WorkerPool._wire = original
        try:
            out["kill_startup"] = serve(pool, transfer) | {"up_s": up_s, "record": pool.record()}
        finally:
            pool.shutdown()
    except Exception:
        out["error"] = traceback.format_exc(limit=12)
    finally:
        try:
            ray.shutdown()
        finally:
            for node in nodes:
                node.stop()
    return out


if __name__ == "__main__":
    os.environ.update(HEALTH)             # before Ray is imported: it reads its auth mode then
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    result = main(Path(sys.argv[1]))
    print(json.dumps(result), flush=True)
