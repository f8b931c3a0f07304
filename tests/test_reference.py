"""The engine against Hugging Face transformers' LlamaForCausalLM, same weights via save_pretrained."""
import pytest
import torch

from tests.conftest import random_prompts
from workers.config import EngineConfig
from workers.engine import Engine
from workers.request import SamplingParams
from workers.weights import load_checkpoint

CPU = torch.device("cpu")


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, eos_token_id=None, pad_token_id=None)
    return out[0, len(prompt):].tolist()


def prompt_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """Logits at every prompt position, computed by the engine in token_budget-sized chunks."""
    engine.add_request("probe", prompt, SamplingParams(max_tokens=1))
    rows = []
    while engine.has_work():
        sched = engine.scheduler.schedule()
        ids, meta = engine.runner.prepare(sched)
        rows.append(engine.model.logits(engine.runner.forward(ids, meta)))
        done = sched.prefills[-1].completes
        for chunk in sched.chunks:
            chunk.request.num_computed_tokens += chunk.num_tokens
        if done:
            engine.abort("probe")
    return torch.cat(rows)


ATTENTION = ["cpu", "flex", "reference"]     # flex is the GPU path: on a CPU it runs unfused, but runs


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("token_budget", [512, 13])
def test_logits_match_hf_float32(hf_pair, token_budget, attention):
    hf, ckpt = hf_pair
    model = load_checkpoint(ckpt, torch.float32, CPU)
    engine = Engine(model, EngineConfig(token_budget=token_budget, block_size=8, num_kv_blocks=64,
                                        attention=attention))
    prompt = random_prompts(1, hf.config.vocab_size, [45], seed=3)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    ours = prompt_logits(engine, prompt)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)


CASES = [
    ("prefill_first", 512, 16),
    ("prefill_first", 40, 5),       # prompts longer than the budget run alone, in pieces
    ("chunked", 512, 16),
    ("chunked", 7, 16),
    ("chunked", 64, 5),
    ("chunked", 33, 3),
]


# Every case through the CPU kernel; the most varied one (chunks and blocks both tiny) also through
# flex (the GPU path: unfused on a CPU, and so slow here) and the reference.
@pytest.mark.parametrize("policy,token_budget,block_size,attention",
                         [(*c, "cpu") for c in CASES] + [(*CASES[5], a) for a in ("flex", "reference")])
def test_greedy_batch_matches_hf(hf_pair, policy, token_budget, block_size, attention):
    hf, ckpt = hf_pair
    model = load_checkpoint(ckpt, torch.float32, CPU)
    # lengths that are multiples of neither the chunk size nor the block size
    prompts = random_prompts(5, hf.config.vocab_size, [1, 19, 77, 150, 3], seed=11)
    n_new = 34
    # a pool just large enough: unfused flex scores every key of the pool
    blocks = sum(-(-(len(p) + n_new) // block_size) for p in prompts) + 2
    engine = Engine(model, EngineConfig(policy=policy, token_budget=token_budget, block_size=block_size,
                                        num_kv_blocks=blocks, attention=attention))
    reqs = [engine.add_request(f"r{i}", p, SamplingParams(max_tokens=n_new, ignore_eos=True))
            for i, p in enumerate(prompts)]
    engine.run()
    for req, prompt in zip(reqs, prompts):
        assert req.finish_reason == "length"
        assert req.output_ids == hf_greedy(hf, prompt, n_new), f"request {req.id} ({len(prompt)} tokens)"
    if token_budget < 150:      # the 150-token prompt was really split across steps
        assert max(s.num_tokens for s in engine.trace) <= token_budget


def test_bfloat16_close_to_float32(hf_pair):
    """bf16 runs the same path; its logits stay near float32 (loose tolerance for 8-bit mantissas)."""
    hf, ckpt = hf_pair
    prompt = random_prompts(1, hf.config.vocab_size, [30], seed=5)[0]
    l32 = prompt_logits(Engine(load_checkpoint(ckpt, torch.float32, CPU), EngineConfig(num_kv_blocks=32)), prompt)
    l16 = prompt_logits(Engine(load_checkpoint(ckpt, torch.bfloat16, CPU), EngineConfig(num_kv_blocks=32)), prompt)
    assert l16.dtype == torch.float32
    err = (l16 - l32).abs().max() / l32.abs().max()
    assert err < 0.05, f"bf16 logits differ from float32 by {err:.3f} of their range"
