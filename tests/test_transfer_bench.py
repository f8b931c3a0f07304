"""The transfer benchmark runs end to end on CPU and reports each backend next to its raw ceiling."""
import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def test_transfer_bench_reports_both_backends_and_their_ceilings():
    proc = subprocess.run([sys.executable, "-m", "cluster.transfer_bench", "--sizes-mib", "1", "--repeats", "2",
                           "--device", "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["device"] == "cpu" and summary["dist_backend"] == "gloo"
    assert summary["backends"] == ["nccl", "zmq"]
    (row,) = summary["results"]
    assert row["size_mib"] == 1 and row["nbytes"] == 1 << 20 and row["repeats"] == 2
    for backend, raw in (("nccl", "raw_dist"), ("zmq", "raw_zmq")):
        assert row[f"{backend}_gbps"] > 0 and row[f"{raw}_gbps"] > 0
        assert row[f"{backend}_ratio"] == pytest.approx(row[f"{backend}_gbps"] / row[f"{raw}_gbps"], rel=1e-4)
    assert summary["met_target"] == {"nccl": None, "zmq": None}, "the target is judged at 256 MiB only"
