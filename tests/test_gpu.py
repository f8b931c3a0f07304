"""The reference comparison on CUDA in bfloat16 (skipped where torch sees no GPU)."""
import pytest
import torch

from tests.conftest import random_prompts
from workers.config import EngineConfig
from workers.engine import Engine
from workers.request import SamplingParams
from workers.weights import load_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_bf16_cuda_logits_and_greedy_near_hf(hf_pair):
    hf, ckpt = hf_pair
    model = load_checkpoint(ckpt, torch.bfloat16, torch.device("cuda"))
    engine = Engine(model, EngineConfig(num_kv_blocks=256, token_budget=64))
    prompts = random_prompts(4, hf.config.vocab_size, [100, 17, 64, 3], seed=12)
    reqs = [engine.add_request(i, p, SamplingParams(max_tokens=16, ignore_eos=True)) for i, p in enumerate(prompts)]
    engine.run()
    agree = 0
    for req, p in zip(reqs, prompts):
        ids = torch.tensor([p])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                          do_sample=False, eos_token_id=None, pad_token_id=None)[0, len(p):].tolist()
        # bf16 rounding may flip a near-tie; demand the first tokens agree and most of the rest
        assert req.output_ids[0] == ref[0]
        agree += sum(a == b for a, b in zip(req.output_ids, ref))
    assert agree >= 0.75 * 16 * len(prompts)
