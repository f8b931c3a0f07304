"""Roofline arithmetic checked against hand-worked numbers for Llama-3-8B and the datasheet presets."""
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.hardware import (HARDWARE, Cost, Hardware, decode_cost, kv_transfer_time,
                                  matmul_params, measured_hardware, mixed_cost, prefill_cost)
from workers.config import PRESETS, preset

CFG_8B = preset("llama-3-8b")
H200 = HARDWARE["h200"]

# ---- Llama-3-8B by hand: h=4096, i=14336, 32 layers, 32 heads, 8 KV heads, head_dim 128 -------
ATTN_PARAMS = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096        # q, k+v (8*128=1024), o
MLP_PARAMS = 3 * 4096 * 14336                                     # gate, up, down
LAYER_PARAMS = ATTN_PARAMS + MLP_PARAMS
LAYERS_PARAMS = 32 * LAYER_PARAMS
LM_HEAD_PARAMS = 128256 * 4096
WEIGHT_BYTES = (LAYERS_PARAMS + LM_HEAD_PARAMS) * 2               # bf16
KV_TOKEN_BYTES = 2 * 32 * 8 * 128 * 2                             # K+V, layers, kv heads, head_dim, bf16
ATTN_FLOPS_PER_PAIR = 2 * 2 * 32 * 128 * 32                       # QK^T+PV, 2 FLOP/MAC, heads, d, layers


def test_llama3_8b_param_counts_by_hand():
    assert ATTN_PARAMS == 41_943_040
    assert MLP_PARAMS == 176_160_768
    assert LAYERS_PARAMS == 6_979_321_856
    assert LM_HEAD_PARAMS == 525_336_576
    # Norms (65 * 4096 = 266,240 weights) are not matmul weights and are not counted.
    assert matmul_params(CFG_8B) == 7_504_658_432 == LAYERS_PARAMS + LM_HEAD_PARAMS


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_matmul_params_match_model_num_params_less_norms_and_embedding(name):
    cfg = PRESETS[name]
    norm_params = cfg.num_layers * 2 * cfg.hidden_size + cfg.hidden_size
    # Untied models hold a separate input embedding that is never a matmul weight.
    embed_params = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    assert matmul_params(cfg) == cfg.num_params() - norm_params - embed_params


def test_kv_bytes_per_token_8b():
    assert CFG_8B.kv_bytes_per_token(2) == KV_TOKEN_BYTES == 131_072


def test_hardware_presets_and_ridge():
    assert H200.ridge == pytest.approx(989e12 / 4.8e12)           # ~206 FLOP/byte
    assert HARDWARE["a100"].ridge == pytest.approx(312e12 / 2.039e12)  # ~153 FLOP/byte
    assert HARDWARE["h100"].nvlink_bw == 900e9 / 2
    assert HARDWARE["a100"].pcie_bw == 32e9
    assert all(hw.net_bw == 400e9 / 8 for hw in HARDWARE.values())
    assert H200.ridge < HARDWARE["h100"].ridge  # same FLOPs, more bandwidth


def test_cost_time_and_bound():
    hw = Hardware("toy", peak_flops=100.0, mem_bw=10.0, nvlink_bw=0.0, pcie_bw=0.0, net_bw=0.0)
    compute = Cost(flops=1000.0, bytes=50.0)   # 10 s of compute, 5 s of memory
    memory = Cost(flops=100.0, bytes=50.0)     # 1 s of compute, 5 s of memory
    assert compute.time(hw) == 10.0 and compute.bound(hw) == "compute"
    assert memory.time(hw) == 5.0 and memory.bound(hw) == "memory"
    assert compute.intensity == 20.0 > hw.ridge == 10.0 > memory.intensity == 2.0


def test_decode_cost_by_hand():
    batch, context = 32, 1024
    flops = (2 * LAYERS_PARAMS * 32          # every decode token goes through every layer
             + 2 * LM_HEAD_PARAMS * 32       # every decode row needs logits
             + ATTN_FLOPS_PER_PAIR * 32 * (1024 + 1))   # each query attends C cached + itself
    nbytes = (WEIGHT_BYTES
              + 32 * 4096 * 2                # embedding rows
              + 32 * 1024 * KV_TOKEN_BYTES   # KV read
              + 32 * KV_TOKEN_BYTES)         # KV written for the new tokens
    assert flops == 497_494_786_048 and nbytes == 19_308_740_608
    cost = decode_cost(CFG_8B, batch, context)
    assert cost.flops == flops
    assert cost.bytes == nbytes


def test_prefill_cost_by_hand():
    p = 2048
    flops = (2 * LAYERS_PARAMS * 2048
             + 2 * LM_HEAD_PARAMS * 1                    # only the last row's logits
             + ATTN_FLOPS_PER_PAIR * (2048 * 2049 // 2))  # causal: query t attends t+1 keys
    nbytes = WEIGHT_BYTES + 2048 * 4096 * 2 + 2048 * KV_TOKEN_BYTES  # no KV read from empty cache
    assert flops == 29_688_401_494_016 and nbytes == 15_294_529_536
    cost = prefill_cost(CFG_8B, p)
    assert cost.flops == flops
    assert cost.bytes == nbytes


def test_mixed_cost_is_sum_of_parts_with_weights_read_once():
    d, p = decode_cost(CFG_8B, 16, 512), prefill_cost(CFG_8B, 256)
    m = mixed_cost(CFG_8B, 16, 512, 256)
    assert m.flops == d.flops + p.flops
    assert m.bytes == d.bytes + p.bytes - WEIGHT_BYTES


def test_mixed_with_empty_side_equals_pure_step():
    assert mixed_cost(CFG_8B, 8, 100, 0) == decode_cost(CFG_8B, 8, 100)
    assert mixed_cost(CFG_8B, 0, 0, 300) == prefill_cost(CFG_8B, 300)


def test_prefill_2048_is_compute_bound_on_h200():
    cost = prefill_cost(CFG_8B, 2048)
    assert cost.bound(H200) == "compute"
    assert cost.intensity > H200.ridge
    assert cost.time(H200) == pytest.approx(29_688_401_494_016 / 989e12)  # ~30 ms


def test_decode_32x1024_is_memory_bound_on_h200():
    cost = decode_cost(CFG_8B, 32, 1024)
    assert cost.bound(H200) == "memory"
    assert cost.intensity < H200.ridge / 5                  # ~26 FLOP/byte vs ~206
    assert cost.time(H200) == pytest.approx(19_308_740_608 / 4.8e12)  # ~4 ms


@pytest.mark.parametrize("hw_name", sorted(HARDWARE))
def test_mixed_step_time_at_least_each_part(hw_name):
    hw = HARDWARE[hw_name]
    for batch, context, chunk in [(32, 1024, 512), (1, 10, 1), (128, 4096, 2048)]:
        t_mixed = mixed_cost(CFG_8B, batch, context, chunk).time(hw)
        assert t_mixed >= decode_cost(CFG_8B, batch, context).time(hw)
        assert t_mixed >= prefill_cost(CFG_8B, chunk).time(hw)


def test_decode_time_grows_with_context_and_batch():
    times_by_context = [decode_cost(CFG_8B, 32, c).time(H200) for c in (128, 1024, 4096, 8192)]
    assert all(a < b for a, b in zip(times_by_context, times_by_context[1:]))
    times_by_batch = [decode_cost(CFG_8B, b, 1024).time(H200) for b in (1, 8, 32, 128)]
    assert all(a < b for a, b in zip(times_by_batch, times_by_batch[1:]))


def test_prefill_time_superlinear_at_large_p():
    t_8k, t_16k = (prefill_cost(CFG_8B, p).time(H200) for p in (8192, 16384))
    assert t_16k > 2 * t_8k
    # The excess is attention: matmul FLOPs alone double exactly (the lm_head row aside).
    attn_8k = ATTN_FLOPS_PER_PAIR * (8192 * 8193 // 2)
    assert prefill_cost(CFG_8B, 8192).flops - attn_8k == 2 * LAYERS_PARAMS * 8192 + 2 * LM_HEAD_PARAMS


def test_kv_transfer_time_8b():
    assert kv_transfer_time(CFG_8B, 1000, 50e9) == pytest.approx(1000 * 131072 / 50e9)
    assert kv_transfer_time(CFG_8B, 1000, 50e9, dtype_bytes=1) == pytest.approx(1000 * 65536 / 50e9)


@pytest.mark.parametrize("call", [
    lambda: prefill_cost(CFG_8B, 0),
    lambda: decode_cost(CFG_8B, 0, 10),
    lambda: decode_cost(CFG_8B, 4, -1),
    lambda: mixed_cost(CFG_8B, 0, 0, 0),
])
def test_invalid_sizes_raise(call):
    with pytest.raises(ValueError):
        call()


def test_module_does_not_import_torch():
    code = "import sys, experiments.hardware; sys.exit('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    assert subprocess.run([sys.executable, "-c", code], cwd=root, env=env).returncode == 0


def test_measured_hardware_cpu_is_positive_finite_and_fast():
    start = time.perf_counter()
    hw = measured_hardware("cpu", net_bw=50e9)
    elapsed_s = time.perf_counter() - start
    for value in (hw.peak_flops, hw.mem_bw, hw.ridge):
        assert math.isfinite(value) and value > 0
    assert hw.nvlink_bw == 0.0 and hw.pcie_bw == 0.0 and hw.net_bw == 50e9  # not measured
    assert elapsed_s < 3.0


def test_a_dtype_name_gives_its_bytes_or_an_error_naming_the_key():
    from experiments.hardware import dtype_bytes_of

    assert dtype_bytes_of("bfloat16") == 2 and dtype_bytes_of("float32") == 4
    with pytest.raises(ValueError, match=r"roofline.dtype='int3': choose from bfloat16, float16, float32"):
        dtype_bytes_of("int3", "roofline.dtype")
