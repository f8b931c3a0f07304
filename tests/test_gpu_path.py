"""The CUDA path, tested on a CPU as far as a CPU can go: device indices, the flex layout and kernel
sizes the Triton templates accept, compiles bounded by padded buckets, graphs refused where they
would be wrong, buckets within the token budget, one host copy per sampling step, the pool's share
of a GPU, and no device-wide synchronize on the serving path."""
import ast
import random
from pathlib import Path

import pytest
import torch

from tests.conftest import random_prompts
from tests.test_attention import step_meta
from workers import kv_cache, weights
from workers.attention import FlexPagedAttention, ReferenceAttention, check_gpu_block_size, size_bucket
from workers.config import EngineConfig, preset
from workers.cuda_graphs import DecodeGraphs, buckets_for
from workers.engine import Engine
from workers.request import Request, SamplingParams
from workers.sampler import SampleFailure, sample

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny():
    return weights.build_model(model="tiny", seed=3)


def test_cuda_device_is_resolved_to_its_index(monkeypatch):
    """`torch.cuda.set_device(torch.device("cuda"))` raises: a worker must hold cuda:N."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert weights.parse_device("auto") == torch.device("cuda", 1)
    assert weights.parse_device("cuda") == torch.device("cuda", 1)
    assert weights.parse_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="sees 2 CUDA device"):
        weights.parse_device("cuda:3")


def test_size_buckets():
    sizes = [size_bucket(n) for n in range(1, 1025)]
    assert all(s >= n for n, s in zip(range(1, 1025), sizes))
    assert all(s < 2 * n if n <= 16 else s <= 1.5 * n for n, s in zip(range(1, 1025), sizes))
    assert len(set(sizes)) <= 2 * 10 + 1                 # two per octave
    assert sorted(set(sizes))[:8] == [1, 2, 4, 8, 16, 24, 32, 48]


@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_layout_matches_reference_on_every_kind_of_step(block_size):
    """The GPU's layout (128-row tiles, buckets) computed by eager flex on a CPU, against the oracle."""
    gen = random.Random(block_size)
    steps = [[(1, 37), (1, 1), (1, 200), (20, 20), (5, 90), (130, 130), (70, 300)],      # mixed
             [(1, c) for c in (1, 15, 16, 17, 64, 129, 300)],                            # decode-only
             [(129, 129), (1, 40)],                                                      # prompts only
             [(1, gen.randint(1, 100)) for _ in range(19)] + [(150, 170)]]               # odd batch
    for lens in steps:
        nd = next((i for i, (n, _) in enumerate(lens) if n != 1), len(lens))
        meta = step_meta(lens, block_size, num_blocks=300, num_decodes=nd)
        pool = torch.randn(2, 2, 300, block_size, 2, 64, generator=torch.Generator().manual_seed(1))
        q = torch.randn(meta.num_tokens, 8, 64, generator=torch.Generator().manual_seed(2))
        flex = FlexPagedAttention(q_tile=128)
        flex.prepare(meta, block_size, 300)
        ref = ReferenceAttention()
        torch.testing.assert_close(flex.forward(q, pool, 1, meta, 0.125), ref.forward(q, pool, 1, meta, 0.125),
                                   atol=2e-5, rtol=1e-4)


def test_kernel_sizes_are_ones_the_triton_templates_accept():
    """Every BLOCK_M the CUDA heuristics of this torch choose divides the 128-row tile, and the
    BLOCK_N we set divides the page: the condition the template checks before it compiles."""
    from torch._inductor.template_heuristics.triton import CUDAConfigHeuristic
    h = CUDAConfigHeuristic()
    configs = list(h.flex_attn_fwd_autotune_configs)
    for name in dir(h):
        if name.endswith("default_flex_config"):
            configs += list(getattr(h, name).values())
    assert configs
    for page in (16, 32, 64, 128):
        flex = FlexPagedAttention.__new__(FlexPagedAttention)
        FlexPagedAttention.__init__(flex, torch.device("cuda", 0), page)     # builds nothing on the device
        assert flex.q_tile == 128 and page % flex.kernel_options["BLOCK_N"] == 0
        assert flex.kernel_options["BLOCK_N"] >= 16                          # tl.dot's smallest
        assert all(flex.q_tile % c.block_m == 0 for c in configs), sorted({c.block_m for c in configs})


@pytest.mark.parametrize("bad", [8, 12, 24, 48, 100])
def test_gpu_refuses_pages_its_kernels_cannot_take(bad):
    with pytest.raises(ValueError, match=f"engine.block_size={bad}: on a GPU"):
        check_gpu_block_size(bad)
    with pytest.raises(ValueError, match="power of two"):
        FlexPagedAttention(torch.device("cuda", 0), bad)
    for good in (16, 32, 64, 128):
        check_gpu_block_size(good)


def _random_step(rng, num_blocks, block_size, width):
    nd = rng.randint(0, 20)
    npf = rng.randint(0 if nd else 1, 2)
    lens = ([(1, rng.randint(1, 60)) for _ in range(nd)]
            + [(n, n + rng.randint(0, 40)) for n in (rng.randint(1, 300) for _ in range(npf))])
    meta = step_meta(lens, block_size, num_blocks, num_decodes=nd, seed=rng.randint(0, 999))
    meta.block_tables = torch.nn.functional.pad(meta.block_tables, (0, width - meta.block_tables.shape[1]))
    return meta


def test_compiles_are_bounded_by_the_buckets_not_the_step_shapes():
    """20 random step shapes through compiled flex (dynamo with the eager backend: the same guards
    as inductor, no code generation): one compile per padded bucket, none on a second pass."""
    rng = random.Random(0)
    flex = FlexPagedAttention(q_tile=128, compile="eager")
    NB, BS, width = 200, 16, 24
    pool = torch.randn(2, 2, NB, BS, 2, 32)
    metas = [_random_step(rng, NB, BS, width) for _ in range(20)]
    shapes = set()
    for meta in metas:
        flex.prepare(meta, BS, NB)
        flex.forward(torch.randn(meta.num_tokens, 4, 32), pool, 1, meta, 0.2)
        st = meta.state["flex"]
        shapes |= {("d", st["decode"][1])} if "decode" in st else set()
        shapes |= {("p", st["prefill"][2])} if "prefill" in st else set()
    assert flex.num_compiles == len(shapes) <= 12
    first = flex.num_compiles
    for meta in metas:
        flex.prepare(meta, BS, NB)
        flex.forward(torch.randn(meta.num_tokens, 4, 32), pool, 1, meta, 0.2)
    assert flex.num_compiles == first


def test_warm_up_compiles_every_shape_so_serving_compiles_none(tiny):
    cfg = EngineConfig(num_kv_blocks=24, token_budget=32, max_batch=4, attention="flex")
    engine = Engine(tiny, cfg)
    engine.runner.backend = FlexPagedAttention(q_tile=32, compile="eager")
    engine.runner.warm_up()
    warmed = engine.runner.backend.num_compiles
    assert warmed >= 2
    prompts = random_prompts(6, tiny.cfg.vocab_size, [30, 3, 17, 60, 1, 9], seed=5)
    reqs = [engine.add_request(f"r{i}", p, SamplingParams(max_tokens=8, ignore_eos=True))
            for i, p in enumerate(prompts)]
    engine.run()
    assert all(r.num_output_tokens == 8 for r in reqs)
    assert engine.runner.backend.num_compiles == warmed


def test_graphs_refuse_a_backend_that_reads_host_lengths(tiny):
    engine = Engine(tiny, EngineConfig(num_kv_blocks=16, token_budget=32, max_batch=4, attention="reference"))
    with pytest.raises(ValueError, match="attention=reference cannot run in CUDA graphs"):
        DecodeGraphs(engine.runner, 4, 32, capture=True)


def test_decode_buckets_stay_within_the_token_budget(tiny):
    """Budget 20 below max_batch 32: padded decode steps never exceed 20 rows, and all requests finish."""
    assert buckets_for(32, 20) == [1, 2, 4, 8, 16, 20]
    cfg = EngineConfig(num_kv_blocks=200, token_budget=20, max_batch=32)
    engine = Engine(tiny, cfg)
    engine.runner.graphs = DecodeGraphs(engine.runner, cfg.max_batch, cfg.token_budget, capture=False)
    prompts = random_prompts(20, tiny.cfg.vocab_size, [3, 5, 8], seed=6)
    reqs = [engine.add_request(f"r{i}", p, SamplingParams(max_tokens=4, ignore_eos=True))
            for i, p in enumerate(prompts)]
    events = engine.run()
    assert not [e for e in events if type(e).__name__ == "RequestFailed"]
    assert all(r.num_output_tokens == 4 for r in reqs)


class Counted(torch.Tensor):
    """A tensor that counts the calls that copy device data to the host."""
    copies = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("tolist", "cpu", "item"):
            Counted.copies += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_sampling_copies_to_the_host_at_most_twice_per_step():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 50, generator=gen)
    logits[3, 7] = float("nan")
    reqs = []
    for i in range(12):
        params = SamplingParams(max_tokens=4) if i % 2 else SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=i)
        r = Request(id=f"r{i}", prompt_ids=[1], params=params)
        r.generator = torch.Generator().manual_seed(i)
        reqs.append(r)
    expected = sample(logits.clone(), reqs)
    for i, r in enumerate(reqs):
        r.generator = torch.Generator().manual_seed(i)
    Counted.copies = 0
    got = sample(logits.clone().as_subclass(Counted), reqs)
    assert Counted.copies <= 2
    assert isinstance(got[3], SampleFailure)
    assert [g if isinstance(g, int) else "x" for g in got] == [g if isinstance(g, int) else "x" for g in expected]
    assert got[1] == int(logits[1].argmax())


def test_pool_takes_this_workers_share_of_a_gpu(monkeypatch):
    """Two workers on one GPU at utilization 0.4 each: both get a pool (the second sees the first's
    memory as used), sized from the share less what the worker itself holds."""
    cfg = preset("llama-3-8b")
    gib = 2 ** 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (60 * gib, 140 * gib))   # the first took 80
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 16 * gib)             # this one's weights
    ecfg = EngineConfig(gpu_memory_utilization=0.4, token_budget=2048)
    n = kv_cache.num_blocks_for(cfg, ecfg, torch.bfloat16, torch.device("cuda", 0))
    block = cfg.kv_bytes_per_token(2) * 16
    share = 0.4 * 140 * gib - 16 * gib - kv_cache.activation_bytes(cfg, 2048, 2)
    assert n == int(share // block) - 1
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (10 * gib, 140 * gib))
    assert kv_cache.num_blocks_for(cfg, ecfg, torch.bfloat16, torch.device("cuda", 0)) < 10 * gib // block


SERVING = ["workers/engine.py", "workers/model_runner.py", "workers/cuda_graphs.py", "workers/attention.py",
           "workers/sampler.py", "workers/kv_cache.py", "workers/model.py", "workers/ops.py"]


def test_no_device_wide_synchronize_on_the_serving_path():
    """torch.cuda.synchronize() waits for every stream, a transfer thread's posted receive included."""
    for rel in SERVING:
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "synchronize":
                owner = ast.unparse(node.func.value)
                assert owner not in ("torch.cuda", "cuda"), f"{rel}:{node.lineno}: {ast.unparse(node)}"
