"""What a worker reports to the router: one small frozen dataclass per kind of event.

On the wire (a worker's `poll` reply, through Ray) each event is a plain dict tagged with its `kind`
(`to_wire`), so the format stays msgpack-able and readable in a log; the router turns every dict back
into its record with `from_wire`, the one place where an event is checked: an unknown kind, a missing
or unexpected field, or a field of the wrong type raises BadEvent naming the worker's kind and field.

Times are the sending worker's clock (time.time()); the router converts them (router/clock.py).
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field


class BadEvent(ValueError):
    """A worker's event that is not one this module describes."""


@dataclass(frozen=True)
class Step:
    """One engine step's tokens. `end`: when its forward pass and sampling finished, the time of each of
    its tokens; `tokens`: (attempt id, token, finish reason or None); `first_scheduled`: for a request
    whose first token this is here, when its first step began."""
    kind: typing.ClassVar[str] = "step"
    end: float
    tokens: list[tuple[str, int, str | None]]
    first_scheduled: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Rejected:
    """The engine refused the request at admission."""
    kind: typing.ClassVar[str] = "rejected"
    rid: str
    reason: str


@dataclass(frozen=True)
class Failed:
    """It failed while being served; its blocks are freed."""
    kind: typing.ClassVar[str] = "failed"
    rid: str
    reason: str


@dataclass(frozen=True)
class Sent:
    """Its KV is on the wire, the end included: `bytes` in `seconds`, begun at `start`."""
    kind: typing.ClassVar[str] = "sent"
    rid: str
    dst: int
    bytes: int
    seconds: float
    start: float


@dataclass(frozen=True)
class SendFailed:
    """Its KV did not go (a refusal by the receiver included)."""
    kind: typing.ClassVar[str] = "send_failed"
    rid: str
    dst: int
    reason: str


@dataclass(frozen=True)
class Imported:
    """Every part of its KV is in this engine's pool. `arrived`: the last byte in; `prefill_end`: the
    prefill worker's clock when its step made the first token (None when the sender did not say)."""
    kind: typing.ClassVar[str] = "imported"
    rid: str
    bytes: int
    recv_s: float
    arrived: float
    time: float
    prefill_end: float | None = None


@dataclass(frozen=True)
class ImportFailed:
    """Its KV could not be imported here (a transfer the receiver dropped included)."""
    kind: typing.ClassVar[str] = "import_failed"
    rid: str
    reason: str


@dataclass(frozen=True)
class TransportError:
    """A wire problem tied to no request."""
    kind: typing.ClassVar[str] = "transport_error"
    message: str


@dataclass(frozen=True)
class OutOfService:
    """This worker can receive no more KV."""
    kind: typing.ClassVar[str] = "out_of_service"
    reason: str


@dataclass(frozen=True)
class Fatal:
    """The worker's loop died (`message`: its traceback); the worker is out of service."""
    kind: typing.ClassVar[str] = "fatal"
    message: str


WorkerEvent = (Step | Rejected | Failed | Sent | SendFailed | Imported | ImportFailed | TransportError | OutOfService
               | Fatal)
KINDS: dict[str, type] = {cls.kind: cls for cls in typing.get_args(WorkerEvent)}
# each kind's fields and their types, read once (get_type_hints re-parses the annotations on every call:
# it cost the router more than the rest of handling an event)
_SHAPES: dict[type, tuple[dict, dict]] = {cls: ({f.name: f for f in dataclasses.fields(cls)}, typing.get_type_hints(cls))
                                          for cls in KINDS.values()}


def to_wire(ev: WorkerEvent) -> dict:
    """The event as Ray carries it: its fields and its kind."""
    return {"kind": ev.kind, **{f.name: getattr(ev, f.name) for f in dataclasses.fields(ev)}}


def from_wire(d: dict) -> WorkerEvent:
    """The record of a wire event, every field checked; BadEvent (naming kind and field) otherwise."""
    if not isinstance(d, dict):
        raise BadEvent(f"an event is a dict with a 'kind', not {type(d).__name__}")
    kind = d.get("kind")
    cls = KINDS.get(kind)
    if cls is None:
        raise BadEvent(f"unknown event kind {kind!r}: expected one of {sorted(KINDS)}")
    fields, hints = _SHAPES[cls]
    unexpected = sorted(set(d) - set(fields) - {"kind"})
    if unexpected:
        raise BadEvent(f"{kind} event: unexpected field(s) {unexpected}")
    values = {}
    for name, f in fields.items():
        if name not in d:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise BadEvent(f"{kind} event: missing field {name!r}")
            continue
        values[name] = _check(d[name], hints[name], f"{kind}.{name}")
    return cls(**values)


def _check(value, hint, where: str):
    """`value` if it is of type `hint` (the few shapes events use), tuples made of [a, b, c] lists."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, _UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check(value, inner, where)
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint in (int, str):
        if isinstance(value, hint) and not isinstance(value, bool):
            return value
    elif origin is list and isinstance(value, (list, tuple)):
        return [_check(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    elif origin is tuple and isinstance(value, (list, tuple)) and len(value) == len(args):
        return tuple(_check(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    elif origin is dict and isinstance(value, dict):
        return {_check(k, args[0], f"{where} key"): _check(v, args[1], f"{where}[{k!r}]") for k, v in value.items()}
    raise BadEvent(f"{where}={value!r}: expected {_name(hint)}")


def _name(hint) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


_UnionType = type(int | None)
