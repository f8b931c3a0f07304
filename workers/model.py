"""The Llama transformer over a paged KV cache: RMSNorm, rotary embeddings, GQA attention, SwiGLU.

One forward call computes a flat batch of new tokens from many requests (the engine's step):
decode queries (one token each) first, then prefill chunks. Each layer writes the new tokens' K and
V into the paged pool, then one attention call (workers/attention.py) reads every sequence's
context from the pool in place. The rest of a layer's math goes through `ops` (workers/ops.py):
torch's ops, or fused CPU kernels. Layers pass the residual stream along beside their output, so
the add that closes one sublayer and the norm that opens the next are one operation.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from workers.attention import AttentionMetadata
from workers.config import ModelConfig, RopeScaling
from workers.ops import TorchOps


TORCH_OPS = TorchOps()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:     # one fused kernel; the same formula as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend the band in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_band, blended, scaled)


class Rotary(nn.Module):
    """cos/sin tables for every position up to max_len, computed once in float32."""

    def __init__(self, cfg: ModelConfig, max_len: int, device: torch.device):
        super().__init__()
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
        freqs = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)                  # [max_len, head_dim]
        sin = emb.sin()
        half = cfg.head_dim // 2
        self.register_buffer("cos", emb.cos(), persistent=False)
        # rotate_half(x) * sin == roll(x, half) * signed_sin: the first half of the sines negated
        self.register_buffer("signed_sin", torch.cat((-sin[:, :half], sin[:, half:]), dim=-1), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [T, D] at `positions`: looked up once per step, shared by every layer."""
        return self.cos[positions].to(dtype), self.signed_sin[positions].to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Parameter(torch.empty(q_size + 2 * kv_size, cfg.hidden_size, dtype=dtype))
        self.o_proj = nn.Parameter(torch.empty(cfg.hidden_size, q_size, dtype=dtype))
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x, pool, layer: int, meta: AttentionMetadata, backend, ops):
        # x [T, hidden]; pool [L, 2, num_blocks, block_size, KVH, D], of which this is layer `layer`
        qkv = ops.linear(x, self.qkv_proj)                                  # [T, (H + 2 KVH) * D]
        q = ops.rope_store_kv(qkv, self.num_heads, self.num_kv_heads, meta, pool, layer)   # [T, H, D]
        out = backend.forward(q, pool, layer, meta, self.scale)            # [T, H, D]
        return ops.linear(out.reshape(x.shape[0], -1), self.o_proj)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(2 * cfg.intermediate_size, cfg.hidden_size, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(cfg.hidden_size, cfg.intermediate_size, dtype=dtype))

    def forward(self, x, ops):
        return ops.linear(ops.silu_mul(ops.linear(x, self.gate_up_proj)), self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype)

    def forward(self, h, residual, pool, layer, meta, backend, ops):
        """h: the previous layer's output, not yet added to the residual stream (layer 0: the
        embeddings, and no stream yet). -> this layer's output and the stream so far."""
        if residual is None:
            x, residual = ops.norm(h, self.input_layernorm), h
        else:
            x, residual = ops.add_norm(h, residual, self.input_layernorm)
        h = self.self_attn(x, pool, layer, meta, backend, ops)
        x, residual = ops.add_norm(h, residual, self.post_attention_layernorm)
        return self.mlp(x, ops), residual


class Llama(nn.Module):
    """Parameters are created on the meta device by default; `materialize` places them."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype)))
        self.rotary: Rotary | None = None

    def set_max_len(self, max_len: int, device: torch.device) -> None:
        """Rotary tables for positions below max_len. Engines may share one model (a prefill engine beside
        a decode engine in one process): tables that already cover max_len on `device` are kept, so an
        engine made later with a shorter max_model_len never cuts the positions of a longer one."""
        r = self.rotary
        if r is None or r.cos.shape[0] < max_len or r.cos.device != torch.device(device):
            self.rotary = Rotary(self.cfg, max_len, device)

    def forward(self, input_ids, kv_cache: torch.Tensor, meta: AttentionMetadata, backend,
                after_layer=None, ops=TORCH_OPS) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, hidden]. kv_cache [L, 2, NB, BS, KVH, D]; `meta.cos`
        and `meta.sin` hold the rotary tables at the step's positions (`Rotary.tables`). `after_layer(i)`,
        if given, is called once layer i is done (its K/V in the pool)."""
        h, residual = F.embedding(input_ids, self.embed_tokens), None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, kv_cache, i, meta, backend, ops)
            if after_layer is not None:
                after_layer(i)
        return ops.add_norm(h, residual, self.norm)[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, ops=TORCH_OPS) -> torch.Tensor:
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return ops.linear(hidden, weight).float()                 # [N, vocab]
