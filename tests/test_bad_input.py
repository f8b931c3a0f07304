"""Bad requests are rejected alone with a reason naming them; bad checkpoints name the file."""
import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, make_hf_checkpoint
from workers.config import CheckpointError, EngineConfig
from workers.engine import Engine
from workers.request import InvalidRequest, SamplingParams
from workers.weights import build_model, load_checkpoint

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def engine():
    return Engine(build_model(model="tiny"), EngineConfig(num_kv_blocks=64, block_size=16, max_model_len=512))


@pytest.mark.parametrize("prompt,params,message", [
    ([], {"max_tokens": 4}, "empty prompt"),
    ("hello", {"max_tokens": 4}, "empty prompt"),
    ([1] * 513, {"max_tokens": 4}, "prompt has 513 tokens, more than max_model_len=512"),
    ([1] * 500, {"max_tokens": 20}, "exceeds max_model_len=512"),
    ([1, 2], {"max_tokens": 0}, "max_tokens=0"),
    ([1, 2], {"max_tokens": -3}, "max_tokens=-3"),
    ([1, 2], {"max_tokens": 2.0}, "max_tokens=2.0"),
    ([1, 2, 2048], {"max_tokens": 4}, r"prompt_ids\[2\]=2048 is not a token id in \[0, 2048\)"),
    ([-1], {"max_tokens": 4}, r"prompt_ids\[0\]=-1"),
    ([1.5], {"max_tokens": 4}, r"prompt_ids\[0\]=1.5"),
    ([True], {"max_tokens": 4}, r"prompt_ids\[0\]=True"),
    ([1], {"max_tokens": 4, "temperature": -1.0}, "temperature=-1.0"),
    ([1], {"max_tokens": 4, "temperature": 1e-40}, r"temperature=1e-40 must be 0 \(greedy\) or a number in"),
    ([1], {"max_tokens": 4, "temperature": float("nan")}, "temperature=nan"),
    ([1], {"max_tokens": 4, "temperature": "0.5"}, "temperature='0.5'"),
    ([1], {"max_tokens": 4, "top_p": 0.0}, "top_p=0.0"),
    ([1], {"max_tokens": 4, "top_p": float("inf")}, "top_p=inf"),
    ([1], {"max_tokens": 4, "temperature": 0.5, "seed": 2**70}, r"seed=1180591620717411303424 must be null or an "
                                                                r"integer in \[0, 2\^64\)"),
    ([1], {"max_tokens": 4, "seed": -1}, "seed=-1"),
    ([1], {"max_tokens": 4, "stop_token_ids": [[1]]}, r"stop_token_ids\[0\]=\[1\] is not a token id"),
    ([1], {"max_tokens": 4, "stop_token_ids": [5, 4096]}, r"stop_token_ids\[1\]=4096 is not a token id in \[0, 2048\)"),
    ([1], {"max_tokens": 4, "stop_token_ids": 7}, "stop_token_ids must be a list"),
    ([1], {"max_tokens": 4, "ignore_eos": "yes"}, "ignore_eos='yes'"),
    ([1], {"max_tokens": 4, "best_of": 2}, r"unknown sampling field\(s\) \['best_of'\]"),
    ([1], [4], "sampling parameters must be a mapping"),
])
def test_bad_request_rejected_alone(engine, prompt, params, message):
    good = engine.add_request("good", [5, 6, 7], SamplingParams(max_tokens=3))
    with pytest.raises(InvalidRequest, match=message) as err:
        engine.add_request("bad-one", prompt, params)
    assert err.value.request_id == "bad-one" and "'bad-one'" in str(err.value)
    engine.run()
    assert good.finish_reason == "length" and len(good.output_ids) == 3
    assert engine.blocks.num_used == 0 and not engine.requests


@pytest.mark.parametrize("rid,message", [(["a"], "id must be a string or an integer, not list"),
                                         (True, "not bool"), ("", "id must have 1 to 256"), ("x" * 257, "1 to 256")])
def test_bad_ids_rejected(engine, rid, message):
    with pytest.raises(InvalidRequest, match=message):
        engine.add_request(rid, [1, 2], SamplingParams(max_tokens=2))
    assert not engine.requests


def test_sampling_params_are_checked_when_built():
    """The same rules hold when SamplingParams is built directly or from a dict; `from_dict` is strict."""
    with pytest.raises(ValueError, match="temperature=1e-40"):
        SamplingParams(temperature=1e-40)
    with pytest.raises(ValueError, match="seed="):
        SamplingParams.from_dict({"seed": 2**64})
    p = SamplingParams.from_dict({"max_tokens": 3, "temperature": 1, "stop_token_ids": [4, 5], "seed": 2**64 - 1})
    assert p.temperature == 1.0 and p.stop_token_ids == (4, 5) and SamplingParams.from_dict(p.to_dict()) == p


def test_request_larger_than_pool_rejected():
    e = Engine(build_model(model="tiny"), EngineConfig(num_kv_blocks=4, block_size=16))
    with pytest.raises(InvalidRequest, match="needs 5 KV blocks but this engine's pool has 4"):
        e.add_request("big", [1] * 60, SamplingParams(max_tokens=10))


def test_duplicate_id_rejected(engine):
    engine.add_request("dup", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequest, match="already in flight"):
        engine.add_request("dup", [3], SamplingParams(max_tokens=2))
    engine.run()


def test_sharded_checkpoint_loads(tmp_path):
    hf = make_hf_checkpoint(tmp_path, "gqa", max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    model = load_checkpoint(tmp_path, torch.float32, CPU)
    assert torch.equal(model.layers[1].mlp.down_proj, hf.model.layers[1].mlp.down_proj.weight)


def test_checkpoint_errors_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere", torch.float32, CPU)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path / "empty", torch.float32, CPU)

    ckpt = tmp_path / "ck"
    make_hf_checkpoint(ckpt, "mha")
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "model_type": "mistral"}))
    with pytest.raises(CheckpointError, match=r"config.json: model_type is 'mistral', not 'llama'"):
        load_checkpoint(ckpt, torch.float32, CPU)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: cannot read config"):
        load_checkpoint(ckpt, torch.float32, CPU)
    (ckpt / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match=r"lacks tensors \['model.layers.2"):
        load_checkpoint(ckpt, torch.float32, CPU)
    (ckpt / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 64}))
    with pytest.raises(CheckpointError, match="model.safetensors: tensor model.layers.0.mlp"):
        load_checkpoint(ckpt, torch.float32, CPU)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    (ckpt / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="model.safetensors: cannot read safetensors"):
        load_checkpoint(ckpt, torch.float32, CPU)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*.safetensors"):
        load_checkpoint(ckpt, torch.float32, CPU)


def run_generate(*args):
    return subprocess.run([sys.executable, "-m", "workers.generate", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_generate_cli_rejects_bad_lines_and_completes_the_rest(tmp_path):
    lines = [
        {"id": "a", "prompt_ids": [3, 4, 5, 6, 7], "max_tokens": 5},
        {"id": "empty", "prompt_ids": [], "max_tokens": 5},
        {"id": "vocab", "prompt_ids": [1, 99999], "max_tokens": 5},
        {"id": "zero", "prompt_ids": [1], "max_tokens": 0},
        {"id": "typo", "prompt_ids": [1], "max_token": 3},
        {"id": "cold", "prompt_ids": [1], "temperature": 1e-40},
        {"id": "seed", "prompt_ids": [1], "temperature": 0.5, "seed": 2**70},
        {"id": "stop", "prompt_ids": [1], "stop_token_ids": [[1]]},
        {"id": [1, 2], "prompt_ids": [1]},
        {"id": "b", "prompt_ids": list(range(40)), "max_tokens": 7, "temperature": 0.9, "seed": 3},
    ]
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(("\n".join(json.dumps(x) for x in lines) + "\n{broken\n").encode()
                        + b'{"id": "\xff\xfe", "prompt_ids": [1]}\n')
    out = tmp_path / "o.jsonl"
    proc = run_generate("--model", "tiny", "--prompts", str(prompts), "--out", str(out), "--policy", "prefill_first")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "empty", "vocab", "zero", "typo", "cold", "seed", "stop", "[1, 2]", "b",
                                       "line 11", "line 12"]
    by_id = {r["id"]: r for r in rows}
    assert len(by_id["a"]["output_ids"]) == 5 and len(by_id["b"]["output_ids"]) == 7
    assert 0 < by_id["a"]["ttft_s"] <= by_id["a"]["e2e_s"]
    assert "empty prompt" in by_id["empty"]["error"]
    assert "99999" in by_id["vocab"]["error"]
    assert "max_tokens=0" in by_id["zero"]["error"]
    assert "max_token" in by_id["typo"]["error"]
    assert "temperature=1e-40" in by_id["cold"]["error"] and "seed=1180591620717411303424" in by_id["seed"]["error"]
    assert "stop_token_ids[0]=[1]" in by_id["stop"]["error"]
    assert "id must be a string or an integer, not list" in by_id["[1, 2]"]["error"]
    assert "not valid JSON" in by_id["line 11"]["error"] and "not valid UTF-8" in by_id["line 12"]["error"]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["num_completed"] == 2 and summary["num_rejected"] == 10


def test_generate_cli_bad_checkpoint_exits_with_reason(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": 1, "prompt_ids": [1], "max_tokens": 1}\n')
    proc = run_generate("--checkpoint", str(tmp_path / "missing"), "--prompts", str(prompts),
                        "--out", str(tmp_path / "o.jsonl"))
    assert proc.returncode == 2
    assert "missing: checkpoint directory does not exist" in proc.stderr
    proc = run_generate("--model", "llama-9", "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"))
    assert proc.returncode == 2 and "unknown model 'llama-9'" in proc.stderr


def test_generate_cli_checkpoint_matches_preset_free_path(tmp_path, hf_pair):
    """A checkpoint through the CLI gives Hugging Face's greedy tokens."""
    hf, ckpt = hf_pair
    prompt = [7, 1, 4, 9, 11, 30, 2]
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "x", "prompt_ids": prompt, "max_tokens": 12,
                                                  "ignore_eos": True}) + "\n")
    proc = run_generate("--checkpoint", str(ckpt), "--prompts", str(tmp_path / "p.jsonl"),
                        "--out", str(tmp_path / "o.jsonl"), "--token-budget", "4")
    assert proc.returncode == 0, proc.stderr
    row = json.loads((tmp_path / "o.jsonl").read_text())
    ids = torch.tensor([prompt])
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                      do_sample=False, eos_token_id=None, pad_token_id=None)[0, len(prompt):].tolist()
    assert row["output_ids"] == ref
