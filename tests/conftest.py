import os
import random
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))

# Two small Llama shapes Hugging Face builds for us: grouped-query attention with Llama-3.1 rope
# scaling, and plain multi-head attention with tied embeddings. initializer_range is raised from
# HF's 0.02 so greedy choices are decided by clear margins, not float noise.
HF_CONFIGS = {
    "gqa": dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                rope_theta=500000.0, initializer_range=0.15, tie_word_embeddings=False,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mha": dict(vocab_size=288, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                rope_theta=10000.0, initializer_range=0.15, tie_word_embeddings=True),
}


def make_hf_checkpoint(directory: Path, kind: str, seed: int = 0, **save_kwargs):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hf = LlamaForCausalLM(LlamaConfig(**HF_CONFIGS[kind])).eval()
    hf.save_pretrained(directory, **save_kwargs)
    return hf


@pytest.fixture(scope="session", params=sorted(HF_CONFIGS))
def hf_pair(request, tmp_path_factory):
    """(Hugging Face model, checkpoint directory it wrote) for each reference config."""
    directory = tmp_path_factory.mktemp(f"hf-{request.param}")
    return make_hf_checkpoint(directory, request.param), directory


def random_prompts(n: int, vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    """An embedded Ray with fake GPUs (16, so several pools can coexist); torch runs on CPU."""
    from cluster.config import ClusterConfig
    from cluster.ray_cluster import start_ray, stop_ray

    start_ray(ClusterConfig(num_gpus=16, num_cpus=2, log_to_driver=False),
              temp_dir=str(tmp_path_factory.mktemp("ray")))
    yield
    stop_ray()
