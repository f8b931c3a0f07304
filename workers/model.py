"""The Llama transformer over a paged KV cache: RMSNorm, rotary embeddings, GQA attention, SwiGLU.

One forward call computes a flat batch of new tokens from many requests (the engine's step):
decode queries (one token each) first, then prefill chunks. Attention reads the past from the
paged cache; the new tokens' K and V are written into it before attention reads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.config import ModelConfig, RopeScaling


@dataclass
class PrefillSpan:
    """One request's prompt chunk inside the flat batch."""

    start: int                 # first row in the flat batch
    num_new: int               # tokens computed this step
    num_cached: int            # tokens of this request already in the cache
    block_table: torch.Tensor  # [num_blocks] long, covers num_cached + num_new tokens
    mask: torch.Tensor | None  # [num_new, num_cached + num_new] bool, None when num_cached == 0


@dataclass
class AttentionMetadata:
    positions: torch.Tensor        # [T] long
    slot_mapping: torch.Tensor     # [T] long: where each new token's K/V goes in the flat pool
    num_decodes: int               # rows [0, num_decodes) are decode queries
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks] long
    decode_mask: torch.Tensor | None          # [Bd, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillSpan]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary(nn.Module):
    """cos/sin tables for every position up to max_len, computed once in float32."""

    def __init__(self, cfg: ModelConfig, max_len: int, device: torch.device):
        super().__init__()
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
        freqs = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)                  # [max_len, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, q, k, positions):                          # q [T, H, D], k [T, KVH, D]
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)       # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Parameter(torch.empty(q_size + 2 * kv_size, cfg.hidden_size, dtype=dtype))
        self.o_proj = nn.Parameter(torch.empty(cfg.hidden_size, q_size, dtype=dtype))
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x, rotary: Rotary, k_cache, v_cache, meta: AttentionMetadata):
        # x [T, hidden]; k_cache, v_cache [num_blocks, block_size, KVH, D]
        T = x.shape[0]
        q, k, v = F.linear(x, self.qkv_proj).split(self.split, dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = rotary(q, k, meta.positions)
        flat_k = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, meta.slot_mapping, k)
        flat_v.index_copy_(0, meta.slot_mapping, v)

        out = torch.empty_like(q)                                # [T, H, D]
        bd = meta.num_decodes
        if bd:
            # Decode: one query per request against its whole context, padded to the longest.
            kk = k_cache[meta.decode_block_tables].flatten(1, 2).transpose(1, 2)  # [Bd, KVH, L, D]
            vv = v_cache[meta.decode_block_tables].flatten(1, 2).transpose(1, 2)
            o = F.scaled_dot_product_attention(q[:bd].unsqueeze(2), kk, vv, attn_mask=meta.decode_mask,
                                               scale=self.scale, enable_gqa=True)  # [Bd, H, 1, D]
            out[:bd] = o.squeeze(2)
        for span in meta.prefills:
            rows = slice(span.start, span.start + span.num_new)
            qq = q[rows].transpose(0, 1).unsqueeze(0)               # [1, H, n, D]
            if span.num_cached == 0:
                kk = k[rows].transpose(0, 1).unsqueeze(0)           # [1, KVH, n, D]
                vv = v[rows].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=self.scale,
                                                   enable_gqa=True)
            else:
                ctx = span.num_cached + span.num_new
                kk = k_cache[span.block_table].flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0)
                vv = v_cache[span.block_table].flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=span.mask, scale=self.scale,
                                                   enable_gqa=True)
            out[rows] = o[0].transpose(0, 1)
        return F.linear(out.view(T, -1), self.o_proj)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(2 * cfg.intermediate_size, cfg.hidden_size, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(cfg.hidden_size, cfg.intermediate_size, dtype=dtype))

    def forward(self, x):
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype)

    def forward(self, x, rotary, k_cache, v_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rotary, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        self.rotary = Rotary(self.cfg, max_len, device)

    @torch.inference_mode()
    def forward(self, input_ids, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, hidden]. kv_cache [L, 2, NB, BS, KVH, D]."""
        x = F.embedding(input_ids, self.embed_tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, self.rotary, kv_cache[i, 0], kv_cache[i, 1], meta)
        return self.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, weight).float()                   # [N, vocab]
