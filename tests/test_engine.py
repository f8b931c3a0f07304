"""Engine behaviour with the tiny preset: handoff, preemption, sampling, and the step trace."""
import pytest
import torch

from tests.conftest import random_prompts
from workers.block_manager import BlockManager
from workers.config import EngineConfig
from workers.engine import Engine
from workers.request import SamplingParams, Status
from workers.weights import build_model


@pytest.fixture(scope="module")
def tiny():
    return build_model(model="tiny", seed=1)


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def run_colocated(model, prompts, n, **cfg):
    engine = Engine(model, EngineConfig(num_kv_blocks=256, **cfg))
    reqs = [engine.add_request(f"r{i}", p, greedy(n)) for i, p in enumerate(prompts)]
    engine.run()
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("src_block,dst_block", [(16, 16), (16, 5), (3, 32)])
def test_export_import_continues_identically(tiny, src_block, dst_block):
    prompts = random_prompts(4, tiny.cfg.vocab_size, [37, 5, 120, 64], seed=2)
    expected = run_colocated(tiny, prompts, 24)
    cfg = tiny.cfg
    prefill = Engine(tiny, EngineConfig(role="prefill", num_kv_blocks=128, block_size=src_block, token_budget=50))
    decode = Engine(tiny, EngineConfig(role="decode", num_kv_blocks=256, block_size=dst_block))
    for i, p in enumerate(prompts):
        prefill.add_request(i, p, greedy(24))
    imported = {}
    for ev in prefill.run():
        assert ev.finish_reason == "handoff"
        kv = prefill.export_kv(ev.request_id)
        prompt = prompts[ev.request_id]
        assert kv.is_contiguous()
        assert tuple(kv.shape) == (cfg.num_layers, 2, len(prompt), cfg.num_kv_heads, cfg.head_dim)
        assert kv.numel() * kv.element_size() == cfg.kv_bytes_per_token(4) * len(prompt)
        prefill.release(ev.request_id)
        imported[ev.request_id] = decode.import_request(ev.request_id, prompt, ev.token, greedy(24), kv)
    assert prefill.blocks.num_used == 0 and not prefill.requests
    decode.run()
    assert [imported[i].output_ids for i in range(4)] == expected
    assert all(s.num_prefill_tokens == 0 for s in decode.trace), "the decode role only decodes"
    assert decode.blocks.num_used == 0


def test_a_shorter_engine_on_the_same_model_leaves_a_longer_one_its_positions(tiny):
    """Engines sharing one model (a prefill engine beside a decode engine in one process): creating one
    with a short max_model_len must not cut the rotary tables of one made before it for longer requests."""
    prompts = random_prompts(2, tiny.cfg.vocab_size, [40, 9], seed=3)
    expected = run_colocated(tiny, prompts, 30, max_model_len=96)
    long = Engine(tiny, EngineConfig(num_kv_blocks=256, max_model_len=96))
    Engine(tiny, EngineConfig(role="prefill", num_kv_blocks=16, max_model_len=24))
    reqs = [long.add_request(f"r{i}", p, greedy(30)) for i, p in enumerate(prompts)]
    events = long.run()
    assert not [e for e in events if type(e).__name__ == "RequestFailed"]
    assert [r.output_ids for r in reqs] == expected


def test_import_rejects_mismatched_kv(tiny):
    prefill = Engine(tiny, EngineConfig(role="prefill", num_kv_blocks=16))
    prefill.add_request("a", [1, 2, 3, 4], greedy(4))
    (ev,) = prefill.run()
    kv = prefill.export_kv("a")
    decode = Engine(tiny, EngineConfig(role="decode", num_kv_blocks=16))
    with pytest.raises(ValueError, match=r"shape \(4, 2, 4, 4, 32\)"):
        decode.import_request("a", [1, 2, 3], ev.token, greedy(4), kv)
    with pytest.raises(ValueError, match="bfloat16 at layer 0.*does not fit.*float32"):
        decode.import_request("b", [1, 2, 3, 4], ev.token, greedy(4), kv.to(torch.bfloat16))
    assert decode.blocks.num_used == 0 and not decode.requests


def test_preemption_recomputes_identically_and_leaks_nothing(tiny):
    prompts = random_prompts(6, tiny.cfg.vocab_size, [40, 33, 57, 21, 48, 30], seed=5)
    expected = run_colocated(tiny, prompts, 40)
    # 24 blocks of 8 tokens cannot hold six requests of ~80 tokens: preemption must happen
    engine = Engine(tiny, EngineConfig(num_kv_blocks=24, block_size=8, token_budget=64))
    reqs = [engine.add_request(f"r{i}", p, greedy(40)) for i, p in enumerate(prompts)]
    while engine.has_work():
        engine.step()
        engine.blocks.check()
        held = sum(len(r.block_ids) for r in reqs)
        assert held == engine.blocks.num_used, "every used block belongs to exactly one request"
    assert sum(s.num_preempted for s in engine.trace) > 0, "the pool was meant to be too small"
    assert [r.output_ids for r in reqs] == expected
    assert all(r.status is Status.FINISHED for r in reqs)
    assert engine.blocks.num_used == 0 and not any(engine.blocks.ref_counts)
    assert not engine.requests


def test_take_trace_drains_the_records_and_numbering_goes_on(tiny):
    prompts = random_prompts(6, tiny.cfg.vocab_size, [40, 33, 57, 21, 48, 30], seed=5)
    engine = Engine(tiny, EngineConfig(num_kv_blocks=24, block_size=8, token_budget=64))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(40))
    taken = []
    while engine.has_work():
        engine.step()
        if engine.num_steps % 7 == 0:
            taken += engine.take_trace()
            assert not engine.trace                     # a long-running worker holds no old steps
    taken += engine.take_trace()
    assert [s.step for s in taken] == list(range(engine.num_steps))
    assert engine.num_preempted == sum(s.num_preempted for s in taken) > 0


def test_the_speed_probe_leaves_the_engine_as_it_found_it(tiny):
    """The probe (workers/probe.py) times its steps on the engine a worker serves with, before its
    first request: afterwards every block is free, no step is on record, and requests come out token
    for token as from an engine never probed; a busy engine is refused."""
    from workers.probe import speed_probe

    prompts = random_prompts(3, tiny.cfg.vocab_size, [40, 33, 57], seed=7)
    want = run_colocated(tiny, prompts, 12, token_budget=64)
    engine = Engine(tiny, EngineConfig(num_kv_blocks=256, token_budget=64))
    got = speed_probe(engine, rounds=3)
    assert got["decode_s"] > 0 and got["prefill_s"] > 0 and got["rounds"] == 3
    assert (got["context"], got["prompt_tokens"]) == (256, 64)
    assert engine.blocks.num_free == 256 and not engine.trace and engine.num_steps == 0
    reqs = [engine.add_request(f"r{i}", p, greedy(12)) for i, p in enumerate(prompts)]
    engine.run()
    assert [r.output_ids for r in reqs] == want
    engine.add_request("busy", prompts[0], greedy(4))
    with pytest.raises(RuntimeError, match="idle engine"):
        speed_probe(engine)


def test_block_manager_refcounts():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = [], []
    assert bm.can_allocate(a, 9)
    bm.allocate(a, 9)                # 3 blocks
    bm.allocate(a, 12)               # still 3
    assert len(a) == 3 and bm.num_free == 3
    assert not bm.can_allocate(b, 13)
    with pytest.raises(RuntimeError):
        bm.allocate(b, 13)
    assert [bm.ref_counts[b] for b in a] == [1, 1, 1]
    bm.free(a)
    assert bm.num_free == 6 and not any(bm.ref_counts)
    bm.check()
    with pytest.raises(AssertionError):
        bm.free(a)                   # double free is caught


def test_seeded_sampling_reproducible_and_batch_independent(tiny):
    p = random_prompts(1, tiny.cfg.vocab_size, [12], seed=6)[0]
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=123, ignore_eos=True)
    alone = Engine(tiny, EngineConfig(num_kv_blocks=64))
    r1 = alone.add_request("a", p, params)
    alone.run()
    crowd = Engine(tiny, EngineConfig(num_kv_blocks=64, token_budget=7))
    for i, q in enumerate(random_prompts(3, tiny.cfg.vocab_size, [30, 9, 50], seed=7)):
        crowd.add_request(f"x{i}", q, greedy(10))
    r2 = crowd.add_request("a", p, params)
    crowd.run()
    assert r1.output_ids == r2.output_ids
    other = Engine(tiny, EngineConfig(num_kv_blocks=64))
    r3 = other.add_request("a", p, SamplingParams(max_tokens=16, temperature=1.0, seed=124, ignore_eos=True))
    other.run()
    assert r3.output_ids != r1.output_ids, "a different seed should sample differently"


def test_tiny_top_p_is_greedy(tiny):
    p = random_prompts(1, tiny.cfg.vocab_size, [20], seed=8)[0]
    e = Engine(tiny, EngineConfig(num_kv_blocks=64))
    g = e.add_request("g", p, greedy(12))
    s = e.add_request("s", p, SamplingParams(max_tokens=12, temperature=0.7, top_p=1e-6, seed=1, ignore_eos=True))
    e.run()
    assert s.output_ids == g.output_ids


def test_stops_on_eos(tiny):
    p = random_prompts(1, tiny.cfg.vocab_size, [15], seed=9)[0]
    e = Engine(tiny, EngineConfig(num_kv_blocks=64))
    ref = e.add_request("ref", p, greedy(12))
    e.run()
    eos = ref.output_ids[4]
    first = ref.output_ids.index(eos)
    r = e.add_request("eos", p, SamplingParams(max_tokens=12, stop_token_ids=(eos,)))
    e.run()
    assert r.finish_reason == "stop"
    assert r.output_ids == ref.output_ids[:first + 1]


def test_step_trace_shows_prefill_stretching_decodes(tiny):
    """prefill_first co-schedules a whole long prompt with the running decodes; chunked caps it."""
    prompts = random_prompts(4, tiny.cfg.vocab_size, [8], seed=10)
    long_prompt = random_prompts(1, tiny.cfg.vocab_size, [600], seed=11)[0]
    traces = {}
    for policy in ("prefill_first", "chunked"):
        e = Engine(tiny, EngineConfig(policy=policy, token_budget=1024 if policy == "prefill_first" else 64,
                                      num_kv_blocks=256))
        for i, p in enumerate(prompts):
            e.add_request(f"d{i}", p, greedy(30))
        for _ in range(5):
            e.step()                                   # the short requests are now decoding
        e.add_request("long", long_prompt, greedy(2))
        e.run()
        traces[policy] = e.trace
    mixed = [s for s in traces["prefill_first"] if s.num_prefill_tokens and s.num_decode_seqs]
    assert len(mixed) == 1 and mixed[0].num_prefill_tokens == 600 and mixed[0].num_decode_seqs == 4
    chunked_mixed = [s for s in traces["chunked"] if s.num_prefill_tokens and s.num_decode_seqs]
    assert len(chunked_mixed) >= 600 // 64
    assert all(s.num_tokens <= 64 and s.num_decode_seqs == 4 for s in chunked_mixed)
    for trace in traces.values():
        assert all(s.end >= s.start for s in trace)
        assert [s.step for s in trace] == list(range(len(trace)))


@pytest.mark.parametrize("name", ["tiny", "llama-3.2-1b", "llama-3-8b", "llama-3-70b"])
def test_presets_are_built_in_their_dtype_without_float32_copies(name):
    """Parameters are created directly in the target dtype (checked on the meta device, no memory)."""
    from workers.config import preset
    from workers.model import Llama

    cfg = preset(name)
    with torch.device("meta"):
        model = Llama(cfg, torch.bfloat16)
    params = list(model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert sum(p.numel() for p in params) == cfg.num_params()


def test_known_preset_sizes():
    from workers.config import preset

    assert round(preset("llama-3-8b").num_params() / 1e9, 2) == 8.03
    assert round(preset("llama-3.2-1b").num_params() / 1e9, 2) == 1.24
    assert round(preset("llama-3-70b").num_params() / 1e9, 1) == 70.6
    assert preset("llama-3-8b").kv_bytes_per_token(2) == 128 * 1024
