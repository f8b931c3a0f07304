"""The benchmarks run end to end on CPU: transfer against raw ceilings, KV overlap, the engine against HF."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def test_transfer_bench_reports_both_backends_and_their_ceilings():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.transfer", "--sizes-mib", "1", "--repeats", "2",
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


def test_overlap_bench_hides_the_transfer_and_keeps_the_tokens(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.overlap", "--shapes", "tiny", "--prompts", "512",
                           "--backends", "zmq", "--repeats", "1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    lists = {k: v for k, v in out.items() if k != "identical"}
    assert {len(v) for v in lists.values()} == {1}, "the lists are aligned row by row"
    assert out["shape"] == ["tiny"] and out["num_layers"] == [4] and out["transport"] == ["zmq"]
    assert out["prompt_tokens"] == [512] and out["identical"] is True
    assert out["transfer_ms"][0] > 0 and out["exposed_ms_off"][0] > 0
    # with the KV following the prefill, the bytes land after the prefill ends; the bulk time is on the path
    assert out["exposed_ms_off"][0] >= 0.5 * out["transfer_ms"][0]


def test_engine_bench_matches_hf_token_for_token_and_reports_its_floor(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.engine", "--case", "mixed", "--shape", "64,2,4,2,128,256",
                           "--repeats", "1", "--threads", "1", "--against-gemm-rows", "256"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PDLAB_CACHE": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    (r,) = json.loads(proc.stdout.strip().splitlines()[-1])["results"]
    assert r["case"] == "mixed" and r["identical"] and r["num_identical"] == r["num_prompts"] == 16
    assert r["speedup"] == pytest.approx(r["hf_s"] / r["pdlab_s"])
    assert 0 < r["matmul_floor_s"] and r["max_speedup"] == pytest.approx(r["hf_s"] / r["matmul_floor_s"])
    assert r["compute_floor_s"] > r["matmul_floor_s"] and r["max_speedup_compute"] < r["max_speedup"]
    a = r["against"]                     # the same engine with its prompt steps' linears on MKL's GEMM
    assert a["cpu_gemm_rows"] == 256 and a["identical"] and a["ratio"] > 0
    assert "linears: " in proc.stdout and "against MKL's GEMM from 256 rows" in proc.stdout
    b = r["breakdown"]
    assert b["decode"]["steps"] == 63 and b["decode"]["tokens_per_step"] == 16     # 64 tokens: 1 from the prefill
    assert b["prefill"]["steps"] * 2048 >= 16 * 256


def test_attention_flops_count_every_causal_pair():
    from benchmarks.engine import Case, attention_flops, parse_shape
    cfg = parse_shape("64,2,4,2,128,256")                       # head_dim 16, 4 heads, 2 layers
    # each of 2 prompts: 3 prompt tokens see 1 + 2 + 3 keys; decode steps 1 and 2 see 4 and 5
    assert attention_flops(cfg, Case("x", "-", 2, 3, 3)) == 4 * 16 * 4 * 2 * 2 * (6 + 9)
