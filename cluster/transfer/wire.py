"""The handoff messages: what both wires say about one request's KV, as msgpack, then raw bytes.

A transfer is a *begin* (the header: request, prompt, sampling, dtype, shape), then any number of
*parts* (a rectangle of layers x tokens, with its raw bytes), then an *end* (the first token, made
by the prefill worker once its step is done), or a *cancel* (the sender gave up: the request was
preempted, finished on the prefill worker, or failed). A bulk handoff sends its parts after the
prefill; a streamed one sends each layer (or chunk) as soon as it is computed, so the parts may
precede the first token by most of the prefill.

The receiver checks every header field against what its own engine expects (dtype, layers, heads,
head dim, length limits), and the request itself by the same rules the router and the engine apply
(workers/request.py: validate_request), before it allocates a byte; every part against the header,
before it receives the part's bytes. Nothing is ever unpickled.
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


_FIELDS = {"request_id": str, "prompt_ids": list, "params": dict, "dtype": str, "shape": list}


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
    if raw["dtype"] != expect.dtype:
        raise WireError(f"dtype {raw['dtype']!r}; this engine holds {expect.dtype!r}", rid)
    shape = tuple(raw["shape"])
    want = (expect.num_layers, 2, len(prompt), expect.num_kv_heads, expect.head_dim)
    if shape != want:
        raise WireError(f"shape {list(shape)}; expected {list(want)} for a {len(prompt)}-token prompt", rid)
    return KVHandoff(rid, prompt, params, raw["dtype"], shape)


def handoff_for(req, cfg, dtype: torch.dtype) -> KVHandoff:
    """The header of request `req`'s KV on an engine of model `cfg` holding `dtype`."""
    return KVHandoff(req.id, list(req.prompt_ids), req.params.to_dict(), str(dtype).removeprefix("torch."),
                     (cfg.num_layers, 2, req.num_prompt_tokens, cfg.num_kv_heads, cfg.head_dim))


# -- parts, ends, cancels -------------------------------------------------------------------------
@dataclass(frozen=True)
class PartMeta:
    """Layers [first_layer, end_layer) of tokens [start, end); its bytes follow."""

    request_id: str
    first_layer: int
    end_layer: int
    start: int
    end: int

    def encode(self) -> bytes:
        return msgpack.packb([self.request_id, self.first_layer, self.end_layer, self.start, self.end])

    def nbytes(self, handoff: KVHandoff) -> int:
        per = handoff.nbytes // (handoff.shape[0] * handoff.shape[2])          # one layer of one token
        return (self.end_layer - self.first_layer) * (self.end - self.start) * per

    def check(self, handoff: KVHandoff) -> None:
        layers, tokens = handoff.shape[0], handoff.shape[2]
        if not (0 <= self.first_layer < self.end_layer <= layers and 0 <= self.start < self.end <= tokens):
            raise WireError(f"part layers [{self.first_layer}, {self.end_layer}) tokens [{self.start}, {self.end}) "
                            f"outside the {layers} layers x {tokens} tokens announced", self.request_id)


@dataclass(frozen=True)
class EndMeta:
    request_id: str
    first_token: int
    first_token_time: float    # the prefill worker's clock: when its step made the first token

    def encode(self) -> bytes:
        return msgpack.packb([self.request_id, self.first_token, self.first_token_time])


@dataclass(frozen=True)
class CancelMeta:
    request_id: str
    reason: str

    def encode(self) -> bytes:
        return msgpack.packb([self.request_id, self.reason[:1000]])


def _meta(data: bytes, what: str, kinds: tuple) -> list:
    try:
        raw = msgpack.unpackb(data, raw=False, max_bin_len=0, max_ext_len=0, max_str_len=4096)
    except Exception as e:
        raise WireError(f"{what} is not msgpack: {e}") from None
    rid = raw[0] if isinstance(raw, list) and raw and isinstance(raw[0], str) else None
    names = ", ".join("number" if isinstance(k, tuple) else k.__name__ for k in kinds)
    if not (isinstance(raw, list) and len(raw) == len(kinds)):
        raise WireError(f"{what} {str(raw)[:80]} is not [{names}]", rid)
    for value, kind in zip(raw, kinds):
        if not isinstance(value, kind) or (kind in (int, float) and isinstance(value, bool)):
            raise WireError(f"{what} fields {str(raw)[:80]} are not [{names}]", rid)
    return raw


def decode_part(data: bytes) -> PartMeta:
    return PartMeta(*_meta(data, "part header", (str, int, int, int, int)))


def decode_end(data: bytes, expect: Expect) -> EndMeta:
    rid, token, t = _meta(data, "end", (str, int, (int, float)))
    if not 0 <= token < expect.vocab_size:
        raise WireError(f"first_token={token} is not a token id in [0, {expect.vocab_size})", rid)
    return EndMeta(rid, token, float(t))


def decode_cancel(data: bytes) -> CancelMeta:
    return CancelMeta(*_meta(data, "cancel", (str, str)))
