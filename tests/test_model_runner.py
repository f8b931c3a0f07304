"""The engine's fast paths on a CPU: padded decode steps (everything a CUDA graph runs, short of the
capture), the compiled model, and memory that does not grow with the number of steps."""
import resource

import pytest
import torch

from tests.conftest import random_prompts
from workers.config import EngineConfig
from workers.cuda_graphs import DecodeGraphs, buckets_for
from workers.engine import Engine
from workers.request import SamplingParams
from workers.weights import build_model, load_checkpoint


@pytest.fixture(scope="module")
def tiny():
    return build_model(model="tiny", seed=3)


def generate(engine: Engine, prompts, n=12) -> list[list[int]]:
    reqs = [engine.add_request(f"r{i}", p, SamplingParams(max_tokens=n, ignore_eos=True)) for i, p in enumerate(prompts)]
    engine.run()
    return [r.output_ids for r in reqs]


def test_buckets_cover_every_batch_up_to_max():
    assert buckets_for(256)[-1] == 256 and buckets_for(20) == [1, 2, 4, 8, 16, 20]
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.buckets = buckets_for(20)
    assert [graphs.bucket(b) for b in (1, 3, 9, 17, 20, 21)] == [1, 4, 16, 20, 20, None]


@pytest.mark.parametrize("attention", ["cpu", "flex"])
def test_padded_decode_steps_give_the_same_tokens(tiny, attention):
    """Decode steps padded to their bucket, as a CUDA graph would run them: the padding writes only
    the scratch block, so every request's tokens are those of the unpadded engine."""
    prompts = random_prompts(7, tiny.cfg.vocab_size, [30, 3, 17, 64, 1, 45, 9], seed=4)
    cfg = EngineConfig(num_kv_blocks=24, token_budget=64, max_batch=12, attention=attention)  # small: flex scores it all
    expected = generate(Engine(tiny, cfg), prompts)
    engine = Engine(tiny, cfg)
    graphs = engine.runner.graphs = DecodeGraphs(engine.runner, cfg.max_batch, capture=False)
    padded = []
    real_prepare = graphs.prepare
    graphs.prepare = lambda sched: (padded.append((len(sched.decodes), graphs.bucket(len(sched.decodes)))),
                                    real_prepare(sched))[1]
    assert generate(engine, prompts) == expected
    assert any(b > n for n, b in padded), "some decode steps ran padded to a larger bucket"
    assert engine.blocks.num_used == 0
    engine.blocks.check()


def test_compiled_model_gives_the_same_tokens(hf_pair):
    """torch.compile (inductor on the CPU) around the model, with the attention kernel as one op."""
    hf, ckpt = hf_pair
    if hf.config.num_hidden_layers != 2:
        pytest.skip("one shape is enough: compiling costs seconds")
    model = load_checkpoint(ckpt, torch.float32, torch.device("cpu"))
    prompts = random_prompts(4, hf.config.vocab_size, [19, 1, 40, 7], seed=8)
    eager = generate(Engine(model, EngineConfig(num_kv_blocks=64, token_budget=32)), prompts)
    compiled = generate(Engine(model, EngineConfig(num_kv_blocks=64, token_budget=32, compile=True)), prompts)
    assert compiled == eager


def test_memory_does_not_grow_with_steps(tiny):
    """Requests keep arriving and finishing; after a warm-up the process's peak memory stays put.
    The warm-up serves the same prompts once: the CPU kernels' reused layer buffers grow to the
    largest step, and torch's own caches fill, in a bounded set of step sizes the warm-up visits."""
    engine = Engine(tiny, EngineConfig(num_kv_blocks=128, token_budget=128, max_batch=16))
    prompts = random_prompts(96, tiny.cfg.vocab_size, [5, 60, 23, 100, 41], seed=9)

    def serve(batch, tag):
        for i, p in batch:
            engine.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=6, ignore_eos=True))
        engine.run()

    serve(list(enumerate(prompts)), "warm")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss           # KiB
    steps = len(engine.trace)
    for round in range(3):
        serve(list(enumerate(prompts)), f"m{round}-")
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    assert len(engine.trace) > 3 * steps
    assert grown_mib < 8, f"peak memory grew {grown_mib:.1f} MiB over {len(engine.trace) - steps} more steps"
    assert engine.blocks.num_used == 0
