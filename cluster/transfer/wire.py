"""The handoff message: a msgpack header that describes one request's KV, then raw tensor bytes.

Both transports send the same header. The receiver checks every field against what its own
engine expects (dtype, layers, heads, head dim, length limits), and the request itself by the same
rules the router and the engine apply (workers/request.py: validate_request), before it allocates a
byte; it checks each payload frame against the size the header announced. Nothing is ever unpickled.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import msgpack
import torch

from workers.request import InvalidRequest, SamplingParams, validate_request

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_HEADER_BYTES = 1 << 20


class WireError(ValueError):
    """A malformed or unexpected message; the message says which field, `request_id` which
    transfer it concerns when that is known."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


@dataclass(frozen=True)
class KVHandoff:
    request_id: str            # the attempt's id on the workers
    prompt_ids: list[int]
    first_token: int
    first_token_time: float    # prefill worker's clock
    params: dict               # SamplingParams fields
    dtype: str
    shape: tuple[int, ...]     # [layers, 2, tokens, kv_heads, head_dim]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.tensor([], dtype=WIRE_DTYPES[self.dtype]).element_size()

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams.from_dict(self.params)

    def encode(self) -> bytes:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return msgpack.packb(d, use_bin_type=True)


@dataclass(frozen=True)
class Expect:
    """What a receiving engine accepts."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    vocab_size: int
    max_tokens: int            # longest prompt it can take
    max_frame_bytes: int = 256 << 20

    @classmethod
    def for_engine(cls, engine, max_frame_bytes: int = 256 << 20) -> "Expect":
        cfg = engine.mcfg
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, str(engine.dtype).removeprefix("torch."),
                   cfg.vocab_size, engine.max_model_len, max_frame_bytes)


_FIELDS = {"request_id": str, "prompt_ids": list, "first_token": int, "first_token_time": float,
           "params": dict, "dtype": str, "shape": list}


def _typed(value, kind, name, rid=None):
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise WireError(f"header field {name!r} has type {type(value).__name__}", rid)


def decode_header(data: bytes, expect: Expect) -> KVHandoff:
    if len(data) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types
        raise WireError(f"header is not valid msgpack: {e}") from None
    if not isinstance(raw, dict):
        raise WireError("header is not a map")
    rid = raw.get("request_id") if isinstance(raw.get("request_id"), str) else None
    if set(raw) != set(_FIELDS):
        raise WireError(f"header fields {sorted(map(str, raw))} differ from {sorted(_FIELDS)}", rid)
    for name, kind in _FIELDS.items():
        _typed(raw[name], kind, name, rid)
    prompt = raw["prompt_ids"]
    if len(prompt) > expect.max_tokens:
        raise WireError(f"prompt of {len(prompt)} tokens; this engine takes 1..{expect.max_tokens}", rid)
    try:   # the request rules of every edge: ids, prompt, sampling parameters
        params = validate_request(rid, prompt, raw["params"], expect.vocab_size, expect.max_tokens).to_dict()
    except InvalidRequest as e:
        raise WireError(f"header: {e.reason}", rid) from None
    if not 0 <= raw["first_token"] < expect.vocab_size:
        raise WireError(f"first_token={raw['first_token']} is not a token id in [0, {expect.vocab_size})", rid)
    if raw["dtype"] != expect.dtype:
        raise WireError(f"dtype {raw['dtype']!r}; this engine holds {expect.dtype!r}", rid)
    shape = tuple(raw["shape"])
    want = (expect.num_layers, 2, len(prompt), expect.num_kv_heads, expect.head_dim)
    if shape != want:
        raise WireError(f"shape {list(shape)}; expected {list(want)} for a {len(prompt)}-token prompt", rid)
    return KVHandoff(rid, prompt, raw["first_token"], float(raw["first_token_time"]), params, raw["dtype"], shape)


def handoff_for(req, kv: torch.Tensor, first_token_time: float) -> KVHandoff:
    return KVHandoff(req.id, list(req.prompt_ids), req.output_ids[0], first_token_time, req.params.to_dict(),
                     str(kv.dtype).removeprefix("torch."), tuple(kv.shape))
