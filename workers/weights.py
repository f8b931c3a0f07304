"""Put a Llama's weights on its device: random from a seed, or from a local Hugging Face checkpoint
(a packaged model, such as smollm2-135m, is imported to one first: workers/gguf_import.py).

Parameters are built on the meta device and allocated directly on the target device and dtype,
so an 8B preset on a GPU never exists in float32 on the CPU. Checkpoint tensors are read one at a
time (safetensors maps them from disk) and copied into the fused projections.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.config import CheckpointError, ModelConfig, from_hf_config, preset
from workers.gguf_import import PACKAGED, ensure_checkpoint
from workers.model import Llama


@dataclass(frozen=True)
class ModelSpec:
    """Which model a worker builds, where, in which dtype: what crosses to a remote worker."""

    model: str | None = "tiny"           # preset with random weights, or a packaged model (PACKAGED) ...
    checkpoint: str | None = None        # ... or a local Hugging Face directory
    dtype: str = "auto"                  # auto: bfloat16 on GPU, float32 on CPU
    device: str = "auto"
    seed: int = 0


def with_checkpoint(spec: ModelSpec) -> ModelSpec:
    """A packaged model (model=smollm2-135m) as the local checkpoint it is imported to (once, on first use);
    any other spec as it is."""
    if spec.checkpoint is None and spec.model in PACKAGED:
        return dataclasses.replace(spec, checkpoint=str(ensure_checkpoint(spec.model)))
    return spec


def model_config(spec: ModelSpec) -> ModelConfig:
    """The shape of a spec's model, without its weights: its checkpoint's config.json, or a preset's."""
    if spec.checkpoint is not None:
        return from_hf_config(Path(spec.checkpoint) / "config.json")
    return preset(spec.model)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype={name!r}: choose one of {sorted(DTYPES)}") from None


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """`auto` (or None): bfloat16 on a GPU, float32 on a CPU; otherwise the named dtype."""
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return parse_dtype(name)


def parse_device(name: str) -> torch.device:
    """`auto`, `cpu`, `cuda` or `cuda:N` -> a device; a GPU always with its index (`cuda` is the
    current device, cuda:0 in a worker that Ray gave one GPU), so that set_device, streams and
    memory queries all name the same one."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={name!r} but torch sees no CUDA device")
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"device={name!r} but torch sees {torch.cuda.device_count()} CUDA device(s)")
        device = torch.device("cuda", index)
    return device


def _empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> Llama:
    with torch.device("meta"):
        model = Llama(cfg, dtype)
    return model.to_empty(device=device).eval()


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Llama:
    model = _empty_model(cfg, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model


def _hf_targets(model: Llama) -> dict[str, tuple[torch.Tensor, int, int]]:
    """Hugging Face tensor name -> (our parameter, first row, number of rows of its slice)."""
    cfg = model.cfg
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size

    def whole(p):
        return (p, 0, p.shape[0])

    t = {"model.embed_tokens.weight": whole(model.embed_tokens), "model.norm.weight": whole(model.norm.weight)}
    if model.lm_head is not None:
        t["lm_head.weight"] = whole(model.lm_head)
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        t[pre + "self_attn.q_proj.weight"] = (attn.qkv_proj, 0, q)
        t[pre + "self_attn.k_proj.weight"] = (attn.qkv_proj, q, kv)
        t[pre + "self_attn.v_proj.weight"] = (attn.qkv_proj, q + kv, kv)
        t[pre + "self_attn.o_proj.weight"] = whole(attn.o_proj)
        t[pre + "mlp.gate_proj.weight"] = (mlp.gate_up_proj, 0, inter)
        t[pre + "mlp.up_proj.weight"] = (mlp.gate_up_proj, inter, inter)
        t[pre + "mlp.down_proj.weight"] = whole(mlp.down_proj)
        t[pre + "input_layernorm.weight"] = whole(layer.input_layernorm.weight)
        t[pre + "post_attention_layernorm.weight"] = whole(layer.post_attention_layernorm.weight)
    return t


def _shard_files(ckpt: Path) -> list[Path]:
    index = ckpt / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: unreadable shard index: {e}") from None
        files = [ckpt / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{ckpt}: no *.safetensors weights in the checkpoint directory")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{f}: listed in the shard index but missing")
    return files


def load_checkpoint(ckpt: str | Path, dtype: torch.dtype, device: torch.device) -> Llama:
    from safetensors import safe_open
    from safetensors import SafetensorError

    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt}: checkpoint directory does not exist")
    cfg = from_hf_config(ckpt / "config.json")
    model = _empty_model(cfg, dtype, device)
    targets = _hf_targets(model)
    loaded: set[str] = set()
    for f in _shard_files(ckpt):
        try:
            with safe_open(str(f), framework="pt", device=str(device)) as sf:
                for name in sf.keys():
                    if name not in targets:
                        continue  # e.g. rotary inv_freq buffers some exports carry
                    param, row, rows = targets[name]
                    tensor = sf.get_tensor(name)
                    if tensor.shape != (rows, *param.shape[1:]):
                        raise CheckpointError(f"{f}: tensor {name} has shape {tuple(tensor.shape)}, "
                                              f"which does not fit the config in {ckpt / 'config.json'}")
                    with torch.no_grad():
                        param[row:row + rows].copy_(tensor)
                    loaded.add(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f}: cannot read safetensors file: {e}") from None
    missing = sorted(set(targets) - loaded)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"{ckpt}: checkpoint lacks tensors {missing[:3]}{more}")
    return model


def build_model(*, model: str | None = None, checkpoint: str | Path | None = None,
                dtype: torch.dtype = torch.float32, device: torch.device = torch.device("cpu"),
                seed: int = 0) -> Llama:
    """A preset with seeded random weights, or a local checkpoint (exactly one of the two); a packaged
    model's name stands for its imported checkpoint."""
    if (model is None) == (checkpoint is None):
        raise ValueError("give exactly one of a model preset or a checkpoint directory")
    if model in PACKAGED:
        checkpoint = ensure_checkpoint(model)
    if checkpoint is not None:
        return load_checkpoint(checkpoint, dtype, device)
    return random_model(preset(model), dtype, device, seed)
