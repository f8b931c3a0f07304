"""The handoff messages: what both wires say about one request's KV, as msgpack, then raw bytes.

A transfer is a *begin* (the header: request, prompt, sampling, dtype, shape), then any number of
*parts* (a rectangle of layers x tokens, with its raw bytes), then an *end* (the first token, made
by the prefill worker once its step is done), or a *cancel* (the sender gave up: the request was
preempted, finished on the prefill worker, or failed). A bulk handoff sends its parts after the
prefill; a streamed one sends each layer (or chunk) as soon as it is computed, so the parts may
precede the first token by most of the prefill.

Every field of every message is decoded here, strictly (fields.py: exact integers, finite times,
bounded lengths and depths), by both wires; what the import path gets has passed it. The receiver
checks every header field against what its own engine expects (dtype, layers, heads, head dim,
length limits), and the request itself by the same rules the router and the engine apply
(workers/request.py: validate_request), before it allocates a byte; every part against the header
before its bytes count. Nothing is ever unpickled.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import msgpack
import torch

from cluster.transfer.fields import (MAX_INDEX, MAX_REASON_CHARS, WireError, exact_int, finite_number, finite_time,
                                     int_list, record, request_id_in, shown, text, unpack)
from workers.request import (MAX_ID_CHARS, MAX_STOP_IDS, SAMPLING_FIELDS, SEED_MAX, InvalidRequest, SamplingParams,
                             validate_request)

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_HEADER_BYTES = 1 << 20
MAX_META_BYTES = 4096          # a part's, end's or cancel's msgpack


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
        d = {"request_id": self.request_id, "prompt_ids": self.prompt_ids, "params": self.params,
             "dtype": self.dtype, "shape": list(self.shape)}      # (asdict would copy the prompt id by id)
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


_FIELDS = ("request_id", "prompt_ids", "params", "dtype", "shape")
_PARAM_DEPTH = 4               # header map > params map > stop_token_ids list > ints, and one more so
                               # a value one level too deep is named by its field


def _params(raw, rid: str | None) -> dict:
    """The sampling fields' types, exactly; their ranges are the request rules' (validate_request)."""
    if not isinstance(raw, dict):
        raise WireError(f"header field params={shown(raw)} is not a map", rid)
    unknown = sorted((k[:40] if isinstance(k, str) else shown(k)) for k in raw if k not in SAMPLING_FIELDS)
    if unknown:
        raise WireError(f"header: unknown sampling field(s) {unknown[:8]}; "
                        f"known: {list(SAMPLING_FIELDS)}", rid)
    missing = [k for k in SAMPLING_FIELDS if k not in raw]
    if missing:
        raise WireError(f"header: missing sampling field(s) {missing}", rid)
    exact_int(raw["max_tokens"], "max_tokens", rid, 0, MAX_INDEX)
    finite_number(raw["temperature"], "temperature", rid)
    finite_number(raw["top_p"], "top_p", rid)
    if raw["seed"] is not None:
        exact_int(raw["seed"], "seed", rid, 0, SEED_MAX)
    int_list(raw["stop_token_ids"], "stop_token_ids", rid, MAX_STOP_IDS, 0, MAX_INDEX)
    if type(raw["ignore_eos"]) is not bool:
        raise WireError(f"ignore_eos={shown(raw['ignore_eos'])} is not true or false", rid)
    return raw


def decode_header(data: bytes, expect: Expect) -> KVHandoff:
    raw, rid = unpack(data, "header", MAX_HEADER_BYTES, _PARAM_DEPTH, request_id_in)
    if not isinstance(raw, dict):
        raise WireError(f"header {shown(raw)} is not a map")
    if set(raw) != set(_FIELDS):
        raise WireError(f"header fields {sorted(shown(k) for k in raw)[:16]} differ from {sorted(_FIELDS)}", rid)
    text(raw["request_id"], "request_id", rid, MAX_ID_CHARS, 1)
    prompt = raw["prompt_ids"]
    if not isinstance(prompt, list):
        raise WireError(f"header field prompt_ids={shown(prompt)} is not a list", rid)
    if len(prompt) > expect.max_tokens:
        raise WireError(f"prompt of {len(prompt)} tokens; this engine takes 1..{expect.max_tokens}", rid)
    if set(map(type, prompt)) - {int}:            # (in C; the loop names the culprit)
        for i, tok in enumerate(prompt):
            if type(tok) is not int:
                raise WireError(f"prompt_ids[{i}]={shown(tok)} is not an integer", rid)
    _params(raw["params"], rid)
    try:   # the request rules of every edge: ids, prompt, sampling parameters (types settled above)
        params = validate_request(rid, prompt, raw["params"], expect.vocab_size, expect.max_tokens).to_dict()
    except InvalidRequest as e:
        raise WireError(f"header: {e.reason}", rid) from None
    dtype = text(raw["dtype"], "dtype", rid, 32)
    if dtype != expect.dtype:
        raise WireError(f"dtype {dtype!r}; this engine holds {expect.dtype!r}", rid)
    shape = int_list(raw["shape"], "shape", rid, 8, 0, MAX_INDEX)
    want = [expect.num_layers, 2, len(prompt), expect.num_kv_heads, expect.head_dim]
    if shape != want:
        raise WireError(f"shape {shape}; expected {want} for a {len(prompt)}-token prompt", rid)
    return KVHandoff(rid, prompt, params, dtype, tuple(shape))


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
        return msgpack.packb([self.request_id, self.reason[:MAX_REASON_CHARS]])


def _meta(data: bytes, what: str, names: tuple[str, ...]) -> tuple[list, str]:
    raw, rid = unpack(data, what, MAX_META_BYTES, 1, request_id_in)
    record(raw, what, names, rid)
    text(raw[0], f"{what} request_id", rid, MAX_ID_CHARS, 1)
    return raw, rid


def decode_part(data: bytes) -> PartMeta:
    raw, rid = _meta(data, "part header", ("request_id", "first_layer", "end_layer", "start", "end"))
    ints = [exact_int(v, f"part header {name}", rid) for v, name in zip(raw[1:], ("first_layer", "end_layer",
                                                                                  "start", "end"))]
    return PartMeta(rid, *ints)


def decode_end(data: bytes, expect: Expect) -> EndMeta:
    raw, rid = _meta(data, "end", ("request_id", "first_token", "first_token_time"))
    token = exact_int(raw[1], "end first_token", rid, 0, MAX_INDEX)
    if token >= expect.vocab_size:
        raise WireError(f"first_token={token} is not a token id in [0, {expect.vocab_size})", rid)
    return EndMeta(rid, token, finite_time(raw[2], "end first_token_time", rid))


def decode_cancel(data: bytes) -> CancelMeta:
    raw, rid = _meta(data, "cancel", ("request_id", "reason"))
    return CancelMeta(rid, text(raw[1], "cancel reason", rid, MAX_REASON_CHARS))


def peek_request_id(data) -> str | None:
    """The request a message's meta names, if it names one validly (for a message rejected for
    its framing, whose fields are never decoded)."""
    try:
        return unpack(data, "meta", MAX_HEADER_BYTES, 64, request_id_in)[1]
    except WireError as e:
        return e.request_id
