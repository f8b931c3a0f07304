"""Strict checks of decoded wire values: the one place a field off the wire gets its type.

Everything here is exact: an integer field takes an int (never a bool, never a float that compares
equal), a time takes a finite number, a string and a list have a length bound, and a container
has a depth bound. A value that passes can never fail later on its type. Every reason is built
by `shown`, which never recurses into its input (a value nested a thousand levels deep is
described as "a list of 1", not printed), and carries the request id when the message has one.
"""
from __future__ import annotations

import math

import msgpack

from workers.request import MAX_ID_CHARS

MAX_INDEX = (1 << 31) - 1          # layers, token positions and the like
MAX_REASON_CHARS = 1000            # a cancel's reason, and any reason this side builds


class WireError(ValueError):
    """A malformed or unexpected message; the message says which field, `request_id` which
    transfer it concerns when that is known."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message[:MAX_REASON_CHARS])
        self.request_id = request_id


def shown(value, limit: int = 60) -> str:
    """A short description of any decoded value, built without looking inside containers."""
    if value is None or type(value) in (bool, int, float):
        text = repr(value)
    elif isinstance(value, str):
        text = repr(value[:limit])
    elif isinstance(value, (bytes, bytearray, memoryview)):
        text = f"<{len(value)} bytes>"
    elif isinstance(value, (list, tuple)):
        text = f"<a list of {len(value)}>"
    elif isinstance(value, dict):
        text = f"<a map of {len(value)}>"
    else:
        text = f"<{type(value).__name__}>"
    return text[:limit]


_CONTAINERS = frozenset({dict, list})      # all msgpack decodes to (use_list, no ext types)


def unpack(data, what: str, max_bytes: int, max_depth: int, rid_of=None):
    """msgpack -> plain values, no bin/ext types, at most `max_depth` containers deep (checked
    without recursion); raises WireError naming the request when `rid_of(value)` finds one."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"{what} is {shown(data)}, not bytes")
    if len(data) > max_bytes:
        raise WireError(f"{what} of {len(data)} bytes exceeds {max_bytes}", peek_id(data))
    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0)
    except Exception as e:   # msgpack raises several unrelated types; its text names no input value
        raise WireError(f"{what} is not valid msgpack: {type(e).__name__}: {str(e)[:120]}", peek_id(data)) from None
    rid = rid_of(value) if rid_of is not None else None
    stack = [(value, 0)] if type(value) in _CONTAINERS else []
    while stack:
        item, depth = stack.pop()
        if depth >= max_depth:
            raise WireError(f"{what} nests containers deeper than {max_depth}", rid)
        children = [*item.keys(), *item.values()] if type(item) is dict else item
        if _CONTAINERS & set(map(type, children)):      # (in C: a prompt's ids are looked at once, not pushed)
            stack.extend((c, depth + 1) for c in children if type(c) in _CONTAINERS)
    return value, rid


def peek_id(data, window: int = 4 * MAX_ID_CHARS + 64) -> str | None:
    """The request id at the start of a message that cannot be decoded whole (too large, too deep,
    or broken further on): a list's first item, or a map's request_id among its first entries,
    read from the first `window` bytes alone."""
    try:
        u = msgpack.Unpacker(raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0,
                             max_buffer_size=window)
        u.feed(bytes(memoryview(data)[:window]))
        try:
            return request_id_in([u.unpack()]) if u.read_array_header() else None
        except msgpack.UnpackValueError:
            pass
        u = msgpack.Unpacker(raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0,
                             max_buffer_size=window)
        u.feed(bytes(memoryview(data)[:window]))
        for _ in range(min(u.read_map_header(), 8)):
            key, value = u.unpack(), u.unpack()
            if key == "request_id":
                return request_id_in([value])
    except Exception:   # nothing readable there
        pass
    return None


def request_id_in(value) -> str | None:
    """The request id a decoded message carries (a map's request_id, a list's first item), if it
    is a valid id; else None."""
    rid = value.get("request_id") if isinstance(value, dict) else value[0] if isinstance(value, list) and value \
        else None
    return rid if isinstance(rid, str) and 0 < len(rid) <= MAX_ID_CHARS else None


def exact_int(value, name: str, rid: str | None, lo: int = 0, hi: int = MAX_INDEX) -> int:
    if type(value) is not int:
        raise WireError(f"{name}={shown(value)} is not an integer", rid)
    if not lo <= value <= hi:
        raise WireError(f"{name}={value} is outside [{lo}, {hi}]", rid)
    return value


def finite_time(value, name: str, rid: str | None) -> float:
    """A clock reading: a finite number >= 0 (int or float, never a bool)."""
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise WireError(f"{name}={shown(value)} is not a finite time >= 0", rid)
    return float(value)


def finite_number(value, name: str, rid: str | None) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise WireError(f"{name}={shown(value)} is not a finite number", rid)
    return value


def text(value, name: str, rid: str | None, max_chars: int, min_chars: int = 0) -> str:
    if not isinstance(value, str):
        raise WireError(f"{name}={shown(value)} is not a string", rid)
    if not min_chars <= len(value) <= max_chars:
        raise WireError(f"{name} has {len(value)} characters; {min_chars} to {max_chars} are allowed", rid)
    return value


def int_list(value, name: str, rid: str | None, max_len: int, lo: int, hi: int, min_len: int = 0) -> list[int]:
    if not isinstance(value, list):
        raise WireError(f"{name}={shown(value)} is not a list", rid)
    if not min_len <= len(value) <= max_len:
        raise WireError(f"{name} has {len(value)} items; {min_len} to {max_len} are allowed", rid)
    for i, item in enumerate(value):
        exact_int(item, f"{name}[{i}]", rid, lo, hi)
    return value


def record(value, what: str, names: tuple[str, ...], rid: str | None) -> list:
    """A message encoded as a fixed-length list."""
    if not isinstance(value, list) or len(value) != len(names):
        raise WireError(f"{what} {shown(value)} is not [{', '.join(names)}]", rid)
    return value
