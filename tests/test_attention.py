"""Every attention backend against the reference (gather + SDPA) on the same paged pool and step."""
import pytest
import torch

from workers.attention import BACKENDS, AttentionMetadata, make_backend

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")


def step_meta(lens: list[tuple[int, int]], block_size: int, num_blocks: int, num_decodes: int = 0,
              seed: int = 0) -> AttentionMetadata:
    """A step of sequences (new tokens, context after the step), their blocks scattered over the pool."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(-(-c // block_size) for _, c in lens) + 2            # padded wider than any needs
    tables = torch.randint(num_blocks, (len(lens), width), generator=gen, dtype=torch.int32)  # stale padding
    used = 0
    for s, (_, ctx) in enumerate(lens):
        n = -(-ctx // block_size)
        tables[s, :n] = perm[used:used + n].int()
        used += n
    q_lens = [n for n, _ in lens]
    q_start = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    positions = torch.cat([torch.arange(c - n, c) for n, c in lens])
    return AttentionMetadata(positions, positions, tables, q_start, torch.tensor([c for _, c in lens], dtype=torch.int32),
                             num_decodes, q_lens, [c for _, c in lens])


def run_all(meta, heads, kv_heads, head_dim, block_size, num_blocks, seed=0, q=None):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(2, 2, num_blocks, block_size, kv_heads, head_dim, generator=gen)   # two layers: read the second
    if q is None:
        q = torch.randn(meta.num_tokens, heads, head_dim, generator=gen)
    out = {}
    for name, cls in BACKENDS.items():
        backend = cls()
        backend.prepare(meta, block_size, num_blocks)
        out[name] = backend.forward(q, pool, 1, meta, head_dim ** -0.5)
    return out


MIXED = [(1, 37), (1, 1), (1, 200), (20, 20), (5, 90), (33, 33), (70, 100)]   # decodes first, then chunks


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (8, 4, 32, 16),      # tiny: GQA 2, the vectorised D=32 path
    (8, 2, 64, 16),      # GQA 4, D=64
    (32, 8, 128, 16),    # Llama-3-8B's head shape
    (6, 3, 40, 5),       # generic D and a block smaller than a vector
    (4, 4, 48, 7),       # MHA, odd block size
    (16, 1, 32, 32),     # MQA: 16 heads share one KV head, blocks of two vectors
])
def test_backends_match_reference_on_a_mixed_step(heads, kv_heads, head_dim, block_size):
    meta = step_meta(MIXED, block_size, num_blocks=160, num_decodes=3)
    out = run_all(meta, heads, kv_heads, head_dim, block_size, 160)
    for name in ("cpu", "flex"):
        torch.testing.assert_close(out[name], out["reference"], atol=2e-5, rtol=1e-4, msg=name)


def test_decode_only_step_uses_the_static_flex_layout_and_matches():
    lens = [(1, c) for c in (1, 15, 16, 17, 64, 129)]
    meta = step_meta(lens, 16, num_blocks=64, num_decodes=len(lens))
    out = run_all(meta, 8, 2, 32, 16, 64)
    for name in ("cpu", "flex"):
        torch.testing.assert_close(out[name], out["reference"], atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(8, 4, 32, 16), (32, 8, 128, 16), (6, 3, 40, 5)])
@pytest.mark.parametrize("num_decodes", [1, 6])
def test_cpu_decode_per_sequence_and_per_kv_head_match(heads, kv_heads, head_dim, block_size, num_decodes):
    """On one thread, one decode is split into an item per KV head and six run one item each over all
    their heads (paged_attention.c): both walk the pool differently and must give the same rows."""
    lens = [(1, c) for c in (1, 15, 16, 17, 64, 129)][-num_decodes:]
    meta = step_meta(lens, block_size, num_blocks=160, num_decodes=num_decodes)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = run_all(meta, heads, kv_heads, head_dim, block_size, 160)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out["cpu"], out["reference"], atol=2e-5, rtol=1e-4)


def test_cpu_kernel_reads_strided_queries():
    """The model hands q as a view into the fused q/k projection: rows are strided."""
    meta = step_meta([(1, 50), (12, 40)], 16, num_blocks=32, num_decodes=1)
    wide = torch.randn(meta.num_tokens, 8 + 4, 32)            # q heads then k heads, as the model has them
    out = run_all(meta, 8, 4, 32, 16, 32, q=wide[:, :8])
    torch.testing.assert_close(out["cpu"], out["reference"], atol=2e-5, rtol=1e-4)


def test_backend_choice_and_refusals():
    assert make_backend("auto", torch.device("cpu"), torch.float32).name == "cpu"
    assert make_backend("auto", torch.device("cpu"), torch.bfloat16).name == "reference"
    with pytest.raises(ValueError, match="attention=cpu runs float32 on a CPU"):
        make_backend("cpu", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="attention='paged'.*choose auto or one of"):
        make_backend("paged", torch.device("cpu"), torch.float32)
