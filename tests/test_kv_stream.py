"""KV streaming inside the engine: a prefill engine reports each part of a request's KV as it becomes
final (per layer during the step, or per chunk after it); a decode engine takes the parts in any
order and continues token-identically to never moving the KV."""
import random

import pytest

from tests.conftest import random_prompts
from workers.config import EngineConfig
from workers.engine import Engine
from workers.events import KVReady, KVReset
from workers.request import InvalidRequest, SamplingParams
from workers.weights import build_model

N = 10


@pytest.fixture(scope="module")
def tiny():
    return build_model(model="tiny", seed=5)


def greedy(n=N):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def colocated(model, prompts):
    engine = Engine(model, EngineConfig(num_kv_blocks=128))
    reqs = [engine.add_request(i, p, greedy()) for i, p in enumerate(prompts)]
    engine.run()
    return [r.output_ids for r in reqs]


def stream_prefill(model, prompts, mode, token_budget):
    """Run a prefill engine; export each KVReady part when told (as a sender would)."""
    engine = Engine(model, EngineConfig(role="prefill", kv_stream=mode, token_budget=token_budget, num_kv_blocks=64,
                                        policy="chunked"))
    parts, told = {i: [] for i in range(len(prompts))}, []

    def listener(ev):
        told.append(ev)
        req = engine.requests[ev.request_id]
        kv = engine.cache.export(req.block_ids, ev.end, layers=(ev.first_layer, ev.end_layer), start=ev.start)
        parts[ev.request_id].append((ev.first_layer, ev.start, kv))
    engine.kv_listener = listener
    for i, p in enumerate(prompts):
        engine.add_request(i, p, greedy())
    first = {ev.request_id: ev.token for ev in engine.run()}
    for rid in first:
        engine.release(rid)
    return parts, first, told


@pytest.mark.parametrize("mode,token_budget", [("layer", 512), ("layer", 24), ("chunk", 24)])
def test_streamed_parts_continue_identically_in_any_order(tiny, mode, token_budget):
    prompts = random_prompts(4, tiny.cfg.vocab_size, [37, 5, 70, 16], seed=6)
    parts, first, told = stream_prefill(tiny, prompts, mode, token_budget)
    layers = tiny.cfg.num_layers
    if mode == "layer":
        assert all(ev.end_layer - ev.first_layer == 1 for ev in told), "one layer at a time"
    else:
        assert all((ev.first_layer, ev.end_layer) == (0, layers) for ev in told), "whole chunks"
    if token_budget < 70:
        assert len({ev.start for ev in told if ev.request_id == 2}) > 1, "the 70-token prompt came in chunks"
    decode = Engine(tiny, EngineConfig(role="decode", num_kv_blocks=128, block_size=5))   # other block size
    rng = random.Random(7)
    everything = [(rid, part) for rid, ps in parts.items() for part in ps]
    rng.shuffle(everything)                                  # requests and layers interleaved, out of order
    reqs = {rid: decode.begin_import(rid, prompts[rid], greedy()) for rid in parts}
    for rid, (layer, start, kv) in everything:
        decode.import_kv(rid, layer, kv, start)
    for rid in parts:
        decode.finish_import(rid, first[rid])
    decode.run()
    assert [[first[i]] + reqs[i].output_ids[1:] for i in range(4)] == colocated(tiny, prompts)
    assert decode.blocks.num_used == 0


def test_import_refuses_overlaps_gaps_and_misfits_and_frees_on_abort(tiny):
    prompt = random_prompts(1, tiny.cfg.vocab_size, [20], seed=8)[0]
    parts, first, _ = stream_prefill(tiny, [prompt], "layer", 512)
    decode = Engine(tiny, EngineConfig(role="decode", num_kv_blocks=16))
    decode.begin_import("a", prompt, greedy())
    layer, start, kv = parts[0][0]
    decode.import_kv("a", layer, kv, start)
    with pytest.raises(InvalidRequest, match="overlaps one already in"):
        decode.import_kv("a", layer, kv, start)
    with pytest.raises(InvalidRequest, match="does not fit"):
        decode.import_kv("a", 3, kv, start=5)                 # tokens past the prompt
    with pytest.raises(InvalidRequest, match="KV incomplete: 60 of 80"):
        decode.finish_import("a", first[0])
    assert decode.blocks.num_used > 0
    decode.abort("a")
    assert decode.blocks.num_used == 0 and not decode.requests
    with pytest.raises(InvalidRequest, match="no import of this request is under way"):
        decode.import_kv("a", layer, kv, start)


def test_preempted_streaming_request_is_reset(tiny):
    """A prompt mid-prefill cannot grow while a handed-off one still holds its blocks (its KV not yet
    exported): it is preempted, what it streamed is declared void, and it streams again from token 0."""
    prompts = random_prompts(2, tiny.cfg.vocab_size, [80, 80], seed=9)
    engine = Engine(tiny, EngineConfig(role="prefill", kv_stream="chunk", token_budget=50, num_kv_blocks=8,
                                       policy="chunked"))
    told = []
    engine.kv_listener = told.append
    for i, p in enumerate(prompts):
        engine.add_request(i, p, greedy())
    held, handed = [], []
    while engine.has_work():
        now = [ev.request_id for ev in engine.step() if ev.finish_reason == "handoff"]
        for rid in held:                     # export lags a step behind, as over a busy wire
            engine.release(rid)
        held, handed = now, handed + now
    assert sorted(handed) == [0, 1]
    resets = [i for i, ev in enumerate(told) if isinstance(ev, KVReset)]
    assert resets, "the pool was meant to be too small for both"
    rid = told[resets[0]].request_id
    again = [ev for ev in told[resets[0]:] if isinstance(ev, KVReady) and ev.request_id == rid]
    assert again and again[0].start == 0, "after a reset the request streams again from its first token"
    assert sum(ev.end - ev.start for ev in again) == 80, "and all of it"


@pytest.mark.parametrize("mode", ["layer", "chunk"])
def test_every_prompt_token_streams_once_even_a_lone_last_one(tiny, mode):
    """A prompt of 25 tokens in a 24-token budget leaves its last token for a step of its own, where
    the scheduler counts it with the decodes; its KV must stream all the same (it once did not, and
    the decode worker refused the transfer as 4 KiB short)."""
    prompts = random_prompts(2, tiny.cfg.vocab_size, [25, 49], seed=10)
    _, first, told = stream_prefill(tiny, prompts, mode, token_budget=24)
    assert sorted(first) == [0, 1]
    for rid, prompt in enumerate(prompts):
        for layer in range(tiny.cfg.num_layers):
            spans = sorted((ev.start, ev.end) for ev in told
                           if ev.request_id == rid and ev.first_layer <= layer < ev.end_layer)
            covered = [t for s, e in spans for t in range(s, e)]
            assert covered == list(range(len(prompt))), (rid, layer, spans)
