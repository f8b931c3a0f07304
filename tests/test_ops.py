"""The fused CPU kernels and the packed panel linear (workers/ops.py `cpu`) against torch's
own ops (`torch`, the reference formulas), one operation at a time and through whole engines."""
import pytest
import torch

from tests.conftest import random_prompts
from workers.attention import AttentionMetadata
from workers.config import EngineConfig
from workers.engine import Engine
from workers.model import RMSNorm
from workers.ops import CpuOps, TorchOps, make_ops, pick_gemm_rows
from workers.request import SamplingParams
from workers.weights import build_model

CLOSE = {"atol": 2e-6, "rtol": 2e-6}      # float32: a few ulps of rounding, never a different formula


@pytest.fixture(scope="module")
def tiny():
    return build_model(model="tiny", seed=5)


@pytest.fixture(scope="module")
def ops(tiny):
    return make_ops("cpu", tiny, torch.device("cpu"), torch.float32, compile=False)


@pytest.mark.parametrize("rows,width", [(1, 256), (37, 40), (300, 1000)])   # widths off the 16-lane grid
def test_norm_and_add_norm_match_torch(ops, rows, width):
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(width, 1e-5, torch.float32)
    norm.weight.data = torch.rand(width, generator=gen) + 0.5
    x, residual = torch.randn(rows, width, generator=gen) * 3, torch.randn(rows, width, generator=gen)
    torch.testing.assert_close(ops.norm(x, norm), TorchOps().norm(x, norm), **CLOSE)
    want, want_residual = TorchOps().add_norm(x, residual.clone(), norm)
    got, got_residual = ops.add_norm(x, residual, norm)
    torch.testing.assert_close(got, want, **CLOSE)
    assert torch.equal(got_residual, want_residual)        # the stream itself: exactly residual + x
    assert got_residual.data_ptr() == residual.data_ptr()  # added in place, no new tensor


@pytest.mark.parametrize("rows,half", [(3, 768), (129, 19)])
def test_silu_mul_matches_torch_including_large_gates(ops, rows, half):
    gen = torch.Generator().manual_seed(half)
    gate_up = torch.randn(rows, 2 * half, generator=gen) * 8
    gate_up[0, :4] = torch.tensor([-120.0, -88.5, 90.0, 200.0])    # where exp over- and underflows
    torch.testing.assert_close(ops.silu_mul(gate_up), TorchOps().silu_mul(gate_up), **CLOSE)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 4, 32), (6, 3, 40), (4, 1, 128)])
def test_rope_store_kv_rotates_and_writes_the_same_slots(ops, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    T, layers, blocks, bs = 11, 2, 6, 4
    positions = torch.randint(0, 200, (T,), generator=gen)
    slots = torch.randperm(blocks * bs, generator=gen)[:T]
    angle = positions[:, None] * torch.rand(head_dim // 2, generator=gen)[None]
    cos = torch.cat([angle.cos()] * 2, dim=1)
    sin = torch.cat([-angle.sin(), angle.sin()], dim=1)
    meta = AttentionMetadata(positions, slots, torch.zeros(1, 1, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                             torch.zeros(1, dtype=torch.int32), 0, [T], [T], cos=cos, sin=sin)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=gen)
    results = []
    for impl in (TorchOps(), ops):
        pool = torch.zeros(layers, 2, blocks, bs, kv_heads, head_dim)
        q = impl.rope_store_kv(qkv.clone(), heads, kv_heads, meta, pool, 1)
        results.append((q, pool))
    (q_ref, pool_ref), (q, pool) = results
    torch.testing.assert_close(q, q_ref, **CLOSE)
    torch.testing.assert_close(pool, pool_ref, **CLOSE)
    assert pool[0].abs().sum() == 0                            # only layer 1 written
    assert (pool[1, 0].view(-1, kv_heads, head_dim).abs().sum((1, 2)) > 0).sum() == T   # exactly the T slots


def test_packed_linear_matches_and_unknown_weights_fall_back(tiny, ops):
    x = torch.randn(5, tiny.cfg.hidden_size)
    w = tiny.layers[0].self_attn.qkv_proj
    with torch.no_grad():                                      # as the engine runs the model
        torch.testing.assert_close(ops.linear(x, w), TorchOps().linear(x, w), atol=1e-5, rtol=1e-5)
        other = torch.randn(7, tiny.cfg.hidden_size)           # never packed: torch's linear
        torch.testing.assert_close(ops.linear(x, other), x @ other.T)
    assert ops.packed_bytes >= sum(p.numel() * 4 for n, p in tiny.named_parameters() if p.dim() == 2
                                   and "embed" not in n)


# rows: one, a partial tile of rows, whole tiles and a tail; columns: a partial last panel, one
# panel short of a column, exactly whole panels; depths off the 16-lane grid
@pytest.mark.parametrize("rows,cols,depth", [(1, 7, 3), (5, 63, 40), (6, 128, 256), (17, 65, 33), (255, 1000, 129)])
def test_panel_linear_matches_torch_at_any_shape(rows, cols, depth):
    from workers import cpu_kernels
    gen = torch.Generator().manual_seed(rows * cols)
    x, w = torch.randn(rows, depth, generator=gen), torch.randn(cols, depth, generator=gen)
    packed = cpu_kernels.pack_linear(w)
    torch.testing.assert_close(cpu_kernels.linear_small(x, packed, cols), x @ w.T, atol=1e-4, rtol=1e-5)
    out = torch.full((rows, cols), float("nan"))
    assert cpu_kernels.linear_small(x, packed, cols, out=out) is out
    torch.testing.assert_close(out, x @ w.T, atol=1e-4, rtol=1e-5)      # every element written
    with pytest.raises(ValueError, match="x has 2 columns"):
        cpu_kernels.linear_small(x[:, :2].contiguous(), packed, cols)


# 48 tokens a step: every linear on the panel kernel; 640: prompt steps on MKL's GEMM from 256 rows,
# or on the panel kernel at every size (None), into the reused buffers; decode steps on the panel kernel
@pytest.mark.parametrize("budget,gemm_rows", [(48, "auto"), (640, 256), (640, None)])
def test_engines_on_both_kernels_give_the_same_tokens(tiny, budget, gemm_rows):
    prompts = random_prompts(7, tiny.cfg.vocab_size, [1, 33, 70, 5, 129, 16, 400], seed=2)
    outputs = {}
    for kernels in ("torch", "cpu"):
        engine = Engine(tiny, EngineConfig(token_budget=budget, num_kv_blocks=96, kernels=kernels,
                                           cpu_gemm_rows=gemm_rows))
        assert engine.memory()["kernels"] == kernels
        reqs = [engine.add_request(f"r{i}", p, SamplingParams(max_tokens=20, ignore_eos=True))
                for i, p in enumerate(prompts)]
        engine.run()
        outputs[kernels] = [r.output_ids for r in reqs]
        if kernels == "cpu":      # the buffers are reported, and sized by the largest step
            assert engine.memory()["activation_buffer_bytes"] >= max(s.num_tokens for s in engine.trace) * (
                tiny.cfg.intermediate_size) * 4
    assert outputs["cpu"] == outputs["torch"]


@torch.no_grad()                     # as the engine runs the model
def test_what_leaves_a_layer_buffer_is_a_tensor_of_its_own(tiny, ops):
    """Layer outputs share reused buffers; the model's final norm and the LM head must not, or the
    next step would overwrite hidden states and logits still being read."""
    x = torch.randn(300, tiny.cfg.hidden_size)
    layer = tiny.layers[0]
    first = ops.linear(x, layer.mlp.gate_up_proj)
    again = ops.linear(x * 2, layer.mlp.gate_up_proj)
    assert again.data_ptr() == first.data_ptr()                      # the buffer, reused
    torch.testing.assert_close(again, 2 * (x @ layer.mlp.gate_up_proj.T), atol=1e-4, rtol=1e-5)
    hidden = [ops.add_norm(x.clone(), torch.randn_like(x), tiny.norm)[0] for _ in range(2)]
    logits = [ops.linear(h, tiny.lm_head) for h in hidden]
    assert hidden[0].data_ptr() != hidden[1].data_ptr() and logits[0].data_ptr() != logits[1].data_ptr()
    inner = [ops.add_norm(x.clone(), torch.randn_like(x), layer.input_layernorm)[0] for _ in range(2)]
    assert inner[0].data_ptr() == inner[1].data_ptr()                # a layer's norm: the buffer


def test_kernel_choice_is_checked():
    model = build_model(model="tiny", seed=1)
    cpu = torch.device("cpu")
    assert isinstance(make_ops("auto", model, cpu, torch.float32, compile=False), CpuOps)
    assert type(make_ops("auto", model, cpu, torch.float32, compile=True)) is TorchOps    # inductor fuses
    assert type(make_ops("auto", model, cpu, torch.bfloat16, compile=False)) is TorchOps
    with pytest.raises(ValueError, match="kernels=cpu runs an eager float32"):
        make_ops("cpu", model, cpu, torch.bfloat16, compile=False)
    with pytest.raises(ValueError, match="kernels='fast'"):
        make_ops("fast", model, cpu, torch.float32, compile=False)
    for rows in (100, "fast", 2.5):
        with pytest.raises(ValueError, match=f"cpu_gemm_rows={rows!r}: choose auto, null"):
            EngineConfig(cpu_gemm_rows=rows)


def test_a_linear_takes_the_route_its_rows_call_for(tiny, monkeypatch):
    """Under gemm_rows rows the panel kernel, from it MKL's GEMM (torch.mm); None: the panel kernel at
    any size. Either way the product is the same."""
    from workers import cpu_kernels
    calls, panel, mm = [], cpu_kernels.linear_small, torch.mm
    monkeypatch.setattr(cpu_kernels, "linear_small", lambda *a, **k: calls.append("panel") or panel(*a, **k))
    monkeypatch.setattr(torch, "mm", lambda *a, **k: calls.append("gemm") or mm(*a, **k))
    weight = tiny.layers[0].mlp.gate_up_proj
    with torch.no_grad():
        for gemm_rows, rows, route in [(300, 299, "panel"), (300, 300, "gemm"), (None, 1024, "panel")]:
            ops = CpuOps(tiny, gemm_rows=gemm_rows)
            x = torch.randn(rows, tiny.cfg.hidden_size)
            calls.clear()
            got = ops.linear(x, weight)
            assert calls == [route], (gemm_rows, rows)
            torch.testing.assert_close(got, x @ weight.T, atol=1e-4, rtol=1e-5)


def test_gemm_rows_are_where_the_panel_kernel_stops_winning_clearly():
    # (rows, panel kernel's time, MKL's time)
    assert pick_gemm_rows([(256, 1.0, 0.5)]) == 256                          # MKL faster: from the start
    assert pick_gemm_rows([(256, 1.0, 1.05)]) == 256                         # a near tie: MKL, as before
    assert pick_gemm_rows([(256, 1.0, 2.3), (512, 2.0, 2.1)]) == 512         # the panel wins clearly at 256 only
    assert pick_gemm_rows([(256, 1.0, 2.3), (512, 2.0, 4.6), (1024, 4.0, 9.2)]) is None   # an AMD EPYC here


def test_the_measured_choice_is_reported_and_made_once(tiny):
    engine = Engine(tiny, EngineConfig(num_kv_blocks=32))
    ops = engine.runner.ops
    assert ops.gemm_timings and all(p > 0 and g > 0 for _, p, g in ops.gemm_timings)
    assert engine.memory()["cpu_gemm_rows"] == ops.gemm_rows == pick_gemm_rows(ops.gemm_timings)
    assert Engine(tiny, EngineConfig(num_kv_blocks=32)).runner.ops.gemm_timings is ops.gemm_timings
    pinned = Engine(tiny, EngineConfig(num_kv_blocks=32, cpu_gemm_rows=512))
    assert pinned.memory()["cpu_gemm_rows"] == 512 and pinned.runner.ops.gemm_timings == []
