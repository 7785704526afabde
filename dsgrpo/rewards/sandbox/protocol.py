"""The wire between the sandbox's processes: frames, and the plain data that answers are made of.

Frames on every pipe: a 4-byte big-endian length, then that many bytes of UTF-8 JSON. Values cross as plain data
only, rebuilt on the far side from fresh objects of exact types, so nothing of the sender's behaviour travels:
None, bool, int (any size), float, complex, str, bytes, bytearray, list, tuple, set, frozenset, dict, range and
the standard library's Counter, OrderedDict, defaultdict, deque, namedtuple, Fraction and Decimal. Anything else
stays where it was made, as an opaque handle. Standard library only (the supervisor runs under `python -I -S`).
"""

from __future__ import annotations

import builtins
import collections
import decimal
import fractions
import json
import keyword
import os
import re
import struct


class ProtocolError(BaseException):
    """A peer broke the protocol, a limit or the deadline. A BaseException, so that no test's `except Exception`
    can swallow it; the run scores 0 whatever happens after."""


# ---------------------------------------------------------------------------------------------- frames
def frame(obj) -> bytes:
    data = json.dumps(obj, allow_nan=False, separators=(",", ":")).encode()
    return struct.pack(">I", len(data)) + data


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_exact(fd: int, n: int) -> bytes:
    """Blocking read of exactly n bytes; b'' at a clean end of stream. Never reads past the n bytes, so a pipe
    read by several processes in turn (the checker's test processes) stays in step."""
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            if got:
                raise EOFError("stream ended inside a frame")
            return b""
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(fd: int):
    """One frame from a trusted peer (the judge), read byte-exactly."""
    head = read_exact(fd, 4)
    if not head:
        raise EOFError("no frame")
    return json.loads(read_exact(fd, struct.unpack(">I", head)[0]))


# An answer's containers are counted in its bytes before JSON builds them: 16 MB of `[[[]]]` would otherwise be
# 8 million lists (778 MiB) before a single one is looked at.
MAX_CONTAINERS = 500_000


def parse_untrusted(body: bytes, what: str = "a malformed answer"):
    """JSON from an untrusted peer: bounded in containers, no NaN/Infinity constants, one-key object at the top."""
    if body.count(b"[") + body.count(b"{") > MAX_CONTAINERS:
        raise ProtocolError("an answer too large (containers)")
    try:
        message = json.loads(body.decode("utf-8"), parse_constant=_refuse_constant)
    except (ValueError, RecursionError, MemoryError):
        raise ProtocolError(what) from None
    if type(message) is not dict or len(message) != 1:
        raise ProtocolError(what)
    return message


def read_untrusted_frame(fd: int, limit: int):
    """One frame from an untrusted peer (the program): at most `limit` bytes, parsed by parse_untrusted."""
    try:
        head = read_exact(fd, 4)
    except (EOFError, OSError):
        head = b""
    if not head:
        raise ProtocolError("exiting")
    size = struct.unpack(">I", head)[0]
    if size > limit:
        raise ProtocolError("the size limit of its answers")
    try:
        body = read_exact(fd, size)
    except (EOFError, OSError):
        body = b""
    if len(body) != size:
        raise ProtocolError("exiting")
    return parse_untrusted(body)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


# ---------------------------------------------------------------------------------------------- plain data
BIG_INT_BITS = 10_000  # beyond it an int travels as hex: JSON's decimal ints stop at 4,300 digits
_HEX_INT = re.compile(r"-?[0-9a-f]+\Z")
# defaultdict's factory crosses by name when it is one of these builtins (equality ignores it either way)
FACTORIES = ("int", "float", "complex", "str", "bytes", "bool", "list", "tuple", "dict", "set", "frozenset")
MAX_NAMEDTUPLE_FIELDS = 1000
_namedtuples: dict = {}


def _pairs(items, handle_of, budget):
    return [[encode(k, handle_of, budget), encode(v, handle_of, budget)] for k, v in items]


def _namedtuple_fields(value):
    """The field names when `value` is a plain namedtuple instance (a tuple subclass namedtuple() made), else None."""
    t = type(value)
    fields = getattr(t, "_fields", None)
    if t.__bases__ != (tuple,) or type(fields) is not tuple or not hasattr(t, "_make"):
        return None
    if not all(type(f) is str for f in fields) or len(fields) != len(value):
        return None
    return fields


def encode(value, handle_of=None, budget=None):
    """Plain data for the wire. Encoding is by exact type: a subclass (an int whose __eq__ says yes to everything)
    is not plain data and becomes a handle (or a TypeError without `handle_of`). `budget`: a one-item list
    counting down the nodes still allowed."""
    if budget is not None:
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueError("too large")
    t = type(value)
    if value is None or t is bool or t is str:
        return value
    if t is int:
        return value if value.bit_length() <= BIG_INT_BITS else {"int": format(value, "x")}
    if t is float:
        return value if value == value and value not in (float("inf"), float("-inf")) else {"float": repr(value)}
    if t is list:
        return [encode(v, handle_of, budget) for v in value]
    if t is tuple:
        return {"tuple": [encode(v, handle_of, budget) for v in value]}
    if t is set or t is frozenset:
        return {t.__name__: [encode(v, handle_of, budget) for v in value]}
    if t is dict or t is collections.OrderedDict or t is collections.Counter:
        return {t.__name__ if t is not dict else "dict": _pairs(value.items(), handle_of, budget)}
    if t is collections.defaultdict:
        factory = value.default_factory
        name = factory.__name__ if any(factory is getattr(builtins, f) for f in FACTORIES) else None
        return {"defaultdict": [name, _pairs(value.items(), handle_of, budget)]}
    if t is collections.deque:
        return {"deque": [[encode(v, handle_of, budget) for v in value], value.maxlen]}
    if t is bytes or t is bytearray:
        return {t.__name__: value.hex()}
    if t is complex:
        return {"complex": [encode(value.real), encode(value.imag)]}
    if t is fractions.Fraction:
        return {"Fraction": [encode(value.numerator), encode(value.denominator)]}
    if t is decimal.Decimal:
        return {"Decimal": str(value)}
    if t is range:
        return {"range": [encode(value.start), encode(value.stop), encode(value.step)]}
    fields = _namedtuple_fields(value)
    if fields is not None:
        return {"namedtuple": [t.__name__, list(fields), [encode(v, handle_of, budget) for v in value]]}
    if handle_of is None:
        raise TypeError(f"a {t.__name__} cannot cross the sandbox boundary (plain data only)")
    return {"handle": handle_of(value)}


def _decode_int(body) -> int:
    if type(body) is int:
        return body
    if type(body) is dict and len(body) == 1 and type(body.get("int")) is str and _HEX_INT.match(body["int"]):
        return int(body["int"], 16)
    raise ValueError("not an int")


def _namedtuple_class(name, fields):
    key = (name, tuple(fields))
    cls = _namedtuples.get(key)
    if cls is None:
        names = [name] + list(fields)
        if not (type(name) is str and len(fields) <= MAX_NAMEDTUPLE_FIELDS and len(set(fields)) == len(fields)
                and all(type(n) is str and n.isidentifier() and not keyword.iskeyword(n) and len(n) <= 200
                        for n in names) and not any(f.startswith("_") for f in fields)):
            raise ValueError("a malformed namedtuple")
        if len(_namedtuples) > 256:
            _namedtuples.clear()
        cls = _namedtuples[key] = collections.namedtuple(name, fields)
    return cls


def decode(value, resolve=None):
    """Plain data from the wire, rebuilt from fresh objects of exact types; ValueError for anything else."""
    t = type(value)
    if value is None or t is bool or t is int or t is str or t is float:
        return value
    if t is list:
        return [decode(v, resolve) for v in value]
    if t is not dict or len(value) != 1:
        raise ValueError(f"not plain data: {t.__name__}")
    (tag, body), = value.items()
    tb = type(body)
    if tag == "tuple" and tb is list:
        return tuple(decode(v, resolve) for v in body)
    if tag in ("set", "frozenset") and tb is list:
        return (set if tag == "set" else frozenset)(decode(v, resolve) for v in body)
    if tag in ("dict", "OrderedDict", "Counter") and tb is list and all(type(p) is list and len(p) == 2 for p in body):
        pairs = ((decode(k, resolve), decode(v, resolve)) for k, v in body)
        return dict(pairs) if tag == "dict" else getattr(collections, tag)(dict(pairs))
    if (tag == "defaultdict" and tb is list and len(body) == 2 and (body[0] is None or body[0] in FACTORIES)
            and type(body[1]) is list and all(type(p) is list and len(p) == 2 for p in body[1])):
        factory = None if body[0] is None else getattr(builtins, body[0])
        return collections.defaultdict(factory, {decode(k, resolve): decode(v, resolve) for k, v in body[1]})
    if (tag == "deque" and tb is list and len(body) == 2 and type(body[0]) is list
            and (body[1] is None or (type(body[1]) is int and body[1] >= 0))):
        return collections.deque((decode(v, resolve) for v in body[0]), body[1])
    if tag in ("bytes", "bytearray") and tb is str:
        return (bytes if tag == "bytes" else bytearray).fromhex(body)
    if tag == "int":
        return _decode_int(value)
    if tag == "float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "complex" and tb is list and len(body) == 2:
        return complex(decode(body[0]), decode(body[1]))
    if tag == "Fraction" and tb is list and len(body) == 2:
        numerator, denominator = _decode_int(body[0]), _decode_int(body[1])
        if denominator <= 0:
            raise ValueError("a malformed Fraction")
        return fractions.Fraction(numerator, denominator)
    if tag == "Decimal" and tb is str and len(body) <= 100_000:
        try:
            return decimal.Decimal(body)
        except decimal.InvalidOperation:
            raise ValueError("a malformed Decimal") from None
    if tag == "range" and tb is list and len(body) == 3:
        start, stop, step = (_decode_int(x) for x in body)
        return range(start, stop, step)
    if (tag == "namedtuple" and tb is list and len(body) == 3 and type(body[1]) is list and type(body[2]) is list
            and len(body[1]) == len(body[2])):
        return _namedtuple_class(body[0], body[1])(*(decode(v, resolve) for v in body[2]))
    if tag == "handle" and tb is int and resolve is not None:
        return resolve(body)
    raise ValueError(f"not plain data: tag {tag!r}")
