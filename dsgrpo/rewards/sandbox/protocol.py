"""The wire between the sandbox's processes: frames, and the plain data that answers are made of.

Frames on every pipe: a 4-byte big-endian length, then that many bytes of UTF-8 JSON. Values cross as plain data
only, rebuilt on the far side from fresh objects of exact types, so nothing of the sender's behaviour travels:
None, bool, int (any size), float, complex, str, bytes, bytearray, list, tuple, set, frozenset, dict, range, slice,
dict views, and the standard library's Counter, OrderedDict, defaultdict, deque, namedtuple, SimpleNamespace,
Fraction, Decimal, date, datetime, time, timedelta and timezone; Enum members (as a member of an enum class rebuilt
here with the same name, kind, members and values), dataclass instances (rebuilt with their field values, compared
as a dataclass compares by default) and instances of subclasses of plain types (a plain copy of the base value:
`startswith` runs on the receiver's own str); Python's builtins and the C functions of a few modules (math,
operator, ...) by name, as the receiver's own. Anything else stays where it was made, as a handle the sender
describes (handle_of). Standard library only (the supervisor runs under `python -I -S`).
"""

from __future__ import annotations

import builtins
import collections
import dataclasses
import datetime
import decimal
import enum
import fractions
import importlib
import json
import keyword
import os
import re
import struct
import sys
import types


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
        view = view[os.write(fd, view) :]


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
# 8 million lists (778 MiB) before a single one is looked at. Brackets inside JSON strings are text, not structure:
# they are left out of the count (a long string of brackets is one str).
MAX_CONTAINERS = 500_000
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def containers(body: bytes) -> int:
    """The number of JSON arrays and objects `body` would build (its brackets outside strings)."""
    if b'"' in body:
        body = _JSON_STRING.sub(b"", body)
    return body.count(b"[") + body.count(b"{")


def parse_untrusted(body: bytes, what: str = "a malformed answer"):
    """JSON from an untrusted peer: bounded in containers, no NaN/Infinity constants, one-key object at the top."""
    if containers(body) > MAX_CONTAINERS:
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
MAX_FIELDS, MAX_NAME, MAX_CLASSES = 1000, 200, 256
_namedtuples: dict = {}
_enums: dict = {}
_dataclasses: dict = {}
# the exact types whose state a call may change: they travel numbered in a call's arguments (Memo)
MUTABLE = (
    list,
    dict,
    set,
    bytearray,
    collections.deque,
    collections.defaultdict,
    collections.OrderedDict,
    collections.Counter,
)
# a subclass of one of these crosses as a plain copy of its base value, made by the base type's own code
_BASE_COPY = (
    (str, str.__str__),
    (int, int.__int__),
    (float, float.__float__),
    (complex, lambda v: complex(complex.real.__get__(v), complex.imag.__get__(v))),
    (bytes, bytes.__bytes__),
    (bytearray, bytearray.copy),
    (list, list.copy),
    (tuple, lambda v: tuple(tuple.__iter__(v))),
    (frozenset, frozenset.copy),
    (set, set.copy),
    (collections.OrderedDict, collections.OrderedDict),
    (collections.Counter, collections.Counter),
    (collections.defaultdict, lambda v: collections.defaultdict(v.default_factory, v)),
    (dict, dict.copy),
    (collections.deque, lambda v: collections.deque(v, v.maxlen)),
)
_DICT_VIEWS = {
    type({}.keys()): "dict_keys",
    type({}.values()): "dict_values",
    type({}.items()): "dict_items",
    type(collections.OrderedDict().keys()): "dict_keys",
    type(collections.OrderedDict().values()): "dict_values",
    type(collections.OrderedDict().items()): "dict_items",
}
# builtins that never cross by name into the checker: code from text, files, the interpreter's own state
_REFUSED_BUILTINS = frozenset(
    {
        "eval",
        "exec",
        "compile",
        "__import__",
        "open",
        "breakpoint",
        "input",
        "exit",
        "quit",
        "help",
        "globals",
        "locals",
        "vars",
        "getattr",
        "setattr",
        "delattr",
        "copyright",
        "credits",
        "license",
        "memoryview",
        "__build_class__",
        "__loader__",
        "__spec__",
    }
)
BUILTIN_MODULES = ("math", "cmath", "operator", "itertools", "functools", "heapq", "bisect")
_DESCRIPTORS = (types.MethodDescriptorType, types.ClassMethodDescriptorType, types.WrapperDescriptorType)


# The operators a test may apply to the program's objects, by their names in the operator module: the checker
# forwards exactly these (answers.Remote, answers.ProgramObject) and the program applies exactly these
# (program.Server.operate). One list, read by both sides of the boundary.
COMPARISON_OPERATORS = ("eq", "ne", "lt", "le", "gt", "ge")
BINARY_OPERATORS = (
    "add",
    "sub",
    "mul",
    "truediv",
    "floordiv",
    "mod",
    "pow",
    "matmul",
    "lshift",
    "rshift",
    "and_",
    "or_",
    "xor",
)
UNARY_OPERATORS = ("neg", "pos", "abs", "invert")
OPERATORS = BINARY_OPERATORS + UNARY_OPERATORS + COMPARISON_OPERATORS + ("contains", "index")


class Memo:
    """The mutable containers shared during one test, numbered alike on both sides, so that a container sent twice
    arrives as one object (aliasing is kept) and its later states can be sent and matched with the peer's object.
    The sender numbers ({"m": [k, body]} the first time, {"r": k} after); the receiver rebuilds it and may then refer
    to it ({"r": k}) in what it sends back. checker.Link.call and program.Server.call keep the two in step."""

    def __init__(self, sending: bool = False, receiving: bool = False):
        self.objects: list = []
        self.ids: dict = {}
        self.sending, self.receiving = sending, receiving

    def add(self, obj) -> int:
        self.ids[id(obj)] = len(self.objects)
        self.objects.append(obj)
        return len(self.objects) - 1

    def live(self) -> list:
        """The numbers still shared (a dropped container's number stays taken, its place None): read from `ids`,
        which holds only those, so a test of many calls pays for what is shared now, not for every number taken."""
        return sorted(self.ids.values())

    def drop(self, k: int) -> None:
        obj = self.objects[k]
        if obj is not None:
            self.ids.pop(id(obj), None)
            self.objects[k] = None


def _pairs(items, handle_of, budget, memo):
    return [[encode(k, handle_of, budget, memo), encode(v, handle_of, budget, memo)] for k, v in items]


def _namedtuple_fields(value):
    """The field names when `value` is a plain namedtuple instance (a tuple subclass namedtuple() made), else None."""
    t = type(value)
    fields = getattr(t, "_fields", None)
    if t.__bases__ != (tuple,) or type(fields) is not tuple or not hasattr(t, "_make"):
        return None
    if not all(type(f) is str for f in fields) or len(fields) != len(value):
        return None
    return fields


def encode(value, handle_of=None, budget=None, memo=None):
    """Plain data for the wire. Encoding is by exact type: a subclass of a plain type (an int whose __eq__ says yes to
    everything) crosses as a copy of its base value, made by the base type's code; an object of any other class is
    `handle_of(value)`'s to describe (a handle, or its data view), else its data view (data_view), else a TypeError.
    `budget`: a one-item list counting down the nodes still allowed. `memo`: a call's Memo."""
    if budget is not None:
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueError("too large")
    t = type(value)
    if memo is not None and t in MUTABLE:
        k = memo.ids.get(id(value))
        if k is not None:
            return {"r": k}
        if memo.sending:
            k = memo.add(value)
            return {"m": [k, _encode(value, t, handle_of, budget, memo)]}
    return _encode(value, t, handle_of, budget, memo)


def _encode(value, t, handle_of, budget, memo):
    if t is str:
        return {"istr": value} if _mark_interned and _is_interned(value) else value
    if value is None or t is bool:
        return value
    if t is int:
        return value if value.bit_length() <= BIG_INT_BITS else {"int": format(value, "x")}
    if t is float:
        return value if value == value and value not in (float("inf"), float("-inf")) else {"float": repr(value)}
    if t is list:
        return [encode(v, handle_of, budget, memo) for v in value]
    if t is tuple:
        return {"tuple": [encode(v, handle_of, budget, memo) for v in value]}
    if t is set or t is frozenset:
        items = [encode(v, handle_of, budget, memo) for v in value]
        table = _table_size(value) if t is set else 0
        return {"set_table": [table, items]} if table > 8 else {t.__name__: items}
    if t is dict or t is collections.OrderedDict or t is collections.Counter:
        return {t.__name__ if t is not dict else "dict": _pairs(value.items(), handle_of, budget, memo)}
    if t is collections.defaultdict:
        return {
            "defaultdict": [_factory(value.default_factory, handle_of), _pairs(value.items(), handle_of, budget, memo)]
        }
    if t is collections.deque:
        return {"deque": [[encode(v, handle_of, budget, memo) for v in value], value.maxlen]}
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
    if t is slice:
        return {
            "slice": [
                encode(value.start, handle_of, budget),
                encode(value.stop, handle_of, budget),
                encode(value.step, handle_of, budget),
            ]
        }
    if t in _DICT_VIEWS:
        tag = _DICT_VIEWS[t]
        if tag == "dict_items":
            return {tag: _pairs(value, handle_of, budget, memo)}
        return {tag: [encode(v, handle_of, budget, memo) for v in value]}
    if t is types.SimpleNamespace:
        return {"SimpleNamespace": _pairs(vars(value).items(), handle_of, budget, memo)}
    when = _encode_time(value, t)
    if when is not None:
        return when
    if isinstance(value, enum.Enum):
        described = _enum_member(value)
        if described is not None:
            return described
    fields = _namedtuple_fields(value)
    if fields is not None:
        return {"namedtuple": [t.__name__, list(fields), [encode(v, handle_of, budget, memo) for v in value]]}
    name = builtin_name(value)
    if name is not None:
        return {"builtin": name}
    if handle_of is not None:
        return handle_of(value)
    view = data_view(value, None, budget, memo)
    if view is None:
        raise TypeError(f"a {t.__name__} cannot cross the sandbox boundary (plain data only)")
    return view


# An interned string the program answers with is interned on arrival, so `name() is name()` and `name() is 'alice'`
# hold where Python's interning makes them hold (a computed string is not interned there, nor here). CPython 3.11 and
# 3.12 keep the interned state in the low two bits of PyASCIIObject.state (offset 32 on 64-bit builds); elsewhere no
# string is marked, and identity of strings is not kept.
_mark_interned = False
_STATE_OFFSET = 32 if sys.implementation.name == "cpython" and sys.version_info[:2] in ((3, 11), (3, 12)) else None


def mark_interned_strings() -> None:
    """The program's side marks its interned strings in what it sends (where the interpreter lets it tell)."""
    global _mark_interned, _c_uint32
    if _STATE_OFFSET is None or struct.calcsize("P") != 8:
        return
    import ctypes

    _c_uint32 = ctypes.c_uint32
    _mark_interned = True


def _is_interned(s: str) -> bool:
    return bool(_c_uint32.from_address(id(s) + _STATE_OFFSET).value & 3)


def data_view(value, handle_of=None, budget=None, memo=None):
    """What of an object of a program's class crosses as data, or None: a dataclass instance's fields, a copy of a
    plain type's value (a str subclass's str)."""
    t = type(value)
    if dataclasses.is_dataclass(t) and not isinstance(value, type):
        params = getattr(t, "__dataclass_params__", None)
        flags = [bool(getattr(params, f, False)) for f in ("eq", "order", "frozen", "unsafe_hash")]
        fields = [[f.name, encode(getattr(value, f.name), handle_of, budget, memo)] for f in dataclasses.fields(value)]
        return {"dataclass": [t.__name__, fields, flags]}
    for base, copy in _BASE_COPY:
        if isinstance(value, base):
            return encode(copy(value), handle_of, budget, memo)
    return None


def _factory(factory, handle_of):
    if factory is None:
        return None
    if any(factory is getattr(builtins, f) for f in FACTORIES):
        return factory.__name__
    if handle_of is None:
        return None  # a program's lambda, where no handle can be made: the data crosses, missing keys raise
    return encode(factory, handle_of)


def _encode_time(value, t):
    if t is datetime.date:
        return {"date": [value.year, value.month, value.day]}
    if t is datetime.datetime:
        return {
            "datetime": [
                value.year,
                value.month,
                value.day,
                value.hour,
                value.minute,
                value.second,
                value.microsecond,
                value.fold,
                _tz(value.utcoffset(), value.tzname()),
            ]
        }
    if t is datetime.time:
        offset = value.utcoffset()
        return {
            "time": [value.hour, value.minute, value.second, value.microsecond, value.fold, _tz(offset, value.tzname())]
        }
    if t is datetime.timedelta:
        return {"timedelta": [value.days, value.seconds, value.microseconds]}
    if t is datetime.timezone:
        return {"timezone": _tz(value.utcoffset(None), value.tzname(None))}
    return None


def _tz(offset, name):
    if offset is None:
        return None
    return [[offset.days, offset.seconds, offset.microseconds], name if type(name) is str else None]


def _enum_member(value):
    """{"enum": [class description, value]} for a member of an enum class the receiver can rebuild, else None."""
    cls = type(value)
    kind = next(k for k in ("IntFlag", "IntEnum", "StrEnum", "Flag", "Enum") if issubclass(cls, getattr(enum, k)))
    mixin = None
    if kind in ("Flag", "Enum"):
        mixin = next((m.__name__ for m in (int, str, float) if issubclass(cls, m)), None)
    try:
        members = [[n, encode(m.value, budget=[10_000])] for n, m in cls.__members__.items()]
        description = [cls.__name__, kind, mixin, members]
        enum_class(description)  # the receiver rebuilds it by this same code: what fails here would fail there
        return {"enum": [description, encode(value.value)]}
    except Exception:
        return None


def builtin_name(value):
    """The name of one of Python's own callables (a builtin, a method of a builtin type, a C function of
    BUILTIN_MODULES) that the receiver resolves to its own object; None for anything else."""
    t = type(value)
    try:
        if t is types.BuiltinFunctionType:
            module, name = getattr(value, "__module__", None), value.__name__
            if module == "builtins" and getattr(builtins, name, None) is value:
                return name if name not in _REFUSED_BUILTINS else None
            if module in BUILTIN_MODULES and getattr(sys.modules.get(module), name, None) is value:
                return f"{module}.{name}"
        elif t is type:
            name = value.__name__
            if getattr(builtins, name, None) is value and name not in _REFUSED_BUILTINS:
                return name
        elif t in _DESCRIPTORS:
            owner = value.__objclass__
            if (
                getattr(builtins, owner.__name__, None) is owner
                and not value.__name__.startswith("_")
                and getattr(owner, value.__name__, None) is value
            ):
                return f"{owner.__name__}.{value.__name__}"
    except Exception:
        return None
    return None


def _builtin(name):
    if type(name) is not str or len(name) > MAX_NAME:
        raise ValueError("a malformed builtin")
    first, _, rest = name.partition(".")
    if not rest:
        value = getattr(builtins, first, None) if first not in _REFUSED_BUILTINS and not first.startswith("_") else None
    elif first in BUILTIN_MODULES:
        value = getattr(importlib.import_module(first), rest, None) if not rest.startswith("_") else None
        value = value if type(value) is types.BuiltinFunctionType else None
    else:
        owner = getattr(builtins, first, None)
        value = getattr(owner, rest, None) if type(owner) is type and not rest.startswith("_") else None
        value = value if type(value) in _DESCRIPTORS else None
    if value is None or not callable(value) or builtin_name(value) != name:
        raise ValueError(f"not a builtin: {name!r}")
    return value


def _decode_int(body) -> int:
    if type(body) is int:
        return body
    if type(body) is dict and len(body) == 1 and type(body.get("int")) is str and _HEX_INT.match(body["int"]):
        return int(body["int"], 16)
    raise ValueError("not an int")


def _names_ok(names) -> bool:
    return all(type(n) is str and n.isidentifier() and not keyword.iskeyword(n) and len(n) <= MAX_NAME for n in names)


def _cached(cache: dict, key, build):
    cls = cache.get(key)
    if cls is None:
        if len(cache) > MAX_CLASSES:
            cache.clear()
        try:
            cls = cache[key] = build()
        except Exception:
            raise ValueError("a class that cannot be rebuilt") from None
    return cls


def namedtuple_class(name, fields, defaults=None):
    """The receiver's namedtuple class of that name and fields (one per name and fields: two answers share it)."""
    if not (
        type(fields) is list
        and len(fields) <= MAX_FIELDS
        and len(set(fields)) == len(fields)
        and _names_ok([name] + fields)
        and not any(f.startswith("_") for f in fields)
    ):
        raise ValueError("a malformed namedtuple")
    if defaults is not None and not (type(defaults) is list and len(defaults) <= len(fields)):
        raise ValueError("a malformed namedtuple")
    return _cached(
        _namedtuples,
        (name, tuple(fields)),
        lambda: collections.namedtuple(
            name, fields, defaults=None if defaults is None else [decode(d) for d in defaults]
        ),
    )


def enum_class(description):
    """The receiver's enum class for [name, kind, mixin, [[member, value], ...]]: built by Python's functional API
    from plain names and values, once per description (two members of one enum compare as Python compares them)."""
    if not (type(description) is list and len(description) == 4):
        raise ValueError("a malformed enum")
    name, kind, mixin, members = description
    if not (
        kind in ("IntFlag", "IntEnum", "StrEnum", "Flag", "Enum")
        and mixin in (None, "int", "str", "float")
        and type(members) is list
        and 0 < len(members) <= MAX_FIELDS
        and all(type(m) is list and len(m) == 2 for m in members)
        and _names_ok([name] + [m[0] for m in members])
        and not any(m[0].startswith("_") for m in members)
    ):
        raise ValueError("a malformed enum")
    key = json.dumps(description, sort_keys=True)
    extra = {"type": getattr(builtins, mixin)} if mixin else {}
    return _cached(_enums, key, lambda: getattr(enum, kind)(name, [(m, decode(v)) for m, v in members], **extra))


def dataclass_class(name, fields, flags):
    if not (
        type(fields) is list
        and len(fields) <= MAX_FIELDS
        and len(set(fields)) == len(fields)
        and _names_ok([name] + fields)
        and not any(f.startswith("__") for f in fields)
        and type(flags) is list
        and len(flags) == 4
        and all(type(f) is bool for f in flags)
    ):
        raise ValueError("a malformed dataclass")
    eq, order, frozen, unsafe_hash = flags
    return _cached(
        _dataclasses,
        (name, tuple(fields), tuple(flags)),
        lambda: dataclasses.make_dataclass(
            name, fields, eq=eq, order=order and eq, frozen=frozen, unsafe_hash=unsafe_hash
        ),
    )


# A set's iteration order is the order of its hash table's slots, and a set keeps its table when it shrinks: a set
# that held 100 ints and now holds 5 iterates them as the 128-slot table places them. The sender says how large its
# table is; the receiver grows its own to that size (with stand-in members it then drops) before it adds the
# members in the sender's order, which gives the sender's order wherever the members did not collide.
_EMPTY_SET_BYTES = sys.getsizeof(set())
MAX_SET_TABLE = 1 << 22


def _table_size(s) -> int:
    """The slots of a set's hash table beyond its inline 8 (0 while it uses those)."""
    return (sys.getsizeof(s) - _EMPTY_SET_BYTES) // 16


class _Slot:
    """A stand-in member that occupies a slot of a set being grown, then leaves (its hash is its number)."""

    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n

    def __hash__(self):
        return self.n


def _set_with_table(items: list, table: int) -> set:
    plain = set(items)
    if table & (table - 1) or not 8 < table <= MAX_SET_TABLE or _table_size(plain) >= table:
        return plain  # not a table size, or one a plain build reaches anyway
    grown, holders = set(), []
    while _table_size(grown) < table and len(holders) < table:
        holders.append(_Slot(len(holders)))
        grown.add(holders[-1])
    if _table_size(grown) != table:
        return plain
    for holder in holders:
        grown.discard(holder)
    for item in items:
        grown.add(item)
    return grown if _table_size(grown) == table and len(grown) == len(plain) else plain


def _timedelta(body) -> datetime.timedelta:
    if not (type(body) is list and len(body) == 3 and all(type(x) is int for x in body)):
        raise ValueError("a malformed timedelta")
    return datetime.timedelta(*body)


def _timezone(body):
    if body is None:
        return None
    if not (type(body) is list and len(body) == 2 and (body[1] is None or type(body[1]) is str)):
        raise ValueError("a malformed timezone")
    offset = _timedelta(body[0])
    plain = datetime.timezone(offset)
    return plain if body[1] is None or body[1] == plain.tzname(None) else datetime.timezone(offset, body[1])


def _ints(body, n) -> list:
    if not (type(body) is list and len(body) == n and all(type(x) is int for x in body)):
        raise ValueError("a malformed date or time")
    return body


def decode(value, resolve=None, memo=None):
    """Plain data from the wire, rebuilt from fresh objects of exact types; ValueError for anything else.
    `resolve(tag, body)` turns a handle or a callback into the receiver's object; `memo`: a call's Memo."""
    t = type(value)
    if value is None or t is bool or t is int or t is str or t is float:
        return value
    if t is list:
        return [decode(v, resolve, memo) for v in value]
    if t is not dict or len(value) != 1:
        raise ValueError(f"not plain data: {t.__name__}")
    ((tag, body),) = value.items()
    tb = type(body)

    def sub(v):
        return decode(v, resolve, memo)

    if tag == "tuple" and tb is list:
        return tuple(sub(v) for v in body)
    if tag in ("set", "frozenset") and tb is list:
        return (set if tag == "set" else frozenset)(sub(v) for v in body)
    if tag == "set_table" and tb is list and len(body) == 2 and type(body[0]) is int and type(body[1]) is list:
        return _set_with_table([sub(v) for v in body[1]], body[0])
    if tag in ("dict", "OrderedDict", "Counter") and tb is list and all(type(p) is list and len(p) == 2 for p in body):
        pairs = ((sub(k), sub(v)) for k, v in body)
        return dict(pairs) if tag == "dict" else getattr(collections, tag)(dict(pairs))
    if (
        tag == "defaultdict"
        and tb is list
        and len(body) == 2
        and type(body[1]) is list
        and all(type(p) is list and len(p) == 2 for p in body[1])
    ):
        factory = body[0]
        if factory is None or factory in FACTORIES:
            factory = None if factory is None else getattr(builtins, factory)
        elif type(factory) is dict:
            factory = sub(factory)
            if not callable(factory):
                raise ValueError("a malformed defaultdict")
        else:
            raise ValueError("a malformed defaultdict")
        return collections.defaultdict(factory, {sub(k): sub(v) for k, v in body[1]})
    if (
        tag == "deque"
        and tb is list
        and len(body) == 2
        and type(body[0]) is list
        and (body[1] is None or (type(body[1]) is int and body[1] >= 0))
    ):
        return collections.deque((sub(v) for v in body[0]), body[1])
    if tag in ("bytes", "bytearray") and tb is str:
        return (bytes if tag == "bytes" else bytearray).fromhex(body)
    if tag == "int":
        return _decode_int(value)
    if tag == "istr" and tb is str:
        return sys.intern(body)
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
    if tag == "slice" and tb is list and len(body) == 3:
        return slice(*(sub(x) for x in body))
    if tag == "dict_keys" and tb is list:
        return dict.fromkeys(sub(v) for v in body).keys()
    if tag == "dict_values" and tb is list:
        return dict(enumerate(sub(v) for v in body)).values()
    if tag == "dict_items" and tb is list and all(type(p) is list and len(p) == 2 for p in body):
        return dict((sub(k), sub(v)) for k, v in body).items()
    if tag == "SimpleNamespace" and tb is list and all(type(p) is list and len(p) == 2 for p in body):
        fields = {decode(k): sub(v) for k, v in body}
        if not all(type(k) is str for k in fields):
            raise ValueError("a malformed SimpleNamespace")
        return types.SimpleNamespace(**fields)
    if (
        tag == "namedtuple"
        and tb is list
        and len(body) == 3
        and type(body[1]) is list
        and type(body[2]) is list
        and len(body[1]) == len(body[2])
    ):
        return namedtuple_class(body[0], body[1])(*(sub(v) for v in body[2]))
    if tag == "enum" and tb is list and len(body) == 2:
        try:
            return enum_class(body[0])(decode(body[1]))
        except (TypeError, ValueError):
            raise ValueError("a malformed enum member") from None
    if (
        tag == "dataclass"
        and tb is list
        and len(body) == 3
        and type(body[1]) is list
        and all(type(f) is list and len(f) == 2 for f in body[1])
    ):
        cls = dataclass_class(body[0], [f[0] for f in body[1]], body[2])
        obj = object.__new__(cls)
        for name, v in body[1]:
            object.__setattr__(obj, name, sub(v))
        return obj
    if tag == "builtin":
        return _builtin(body)
    if tag == "date":
        return datetime.date(*_ints(body, 3))
    if tag == "datetime" and tb is list and len(body) == 9:
        return datetime.datetime(*_ints(body[:7], 7), tzinfo=_timezone(body[8]), fold=_ints(body[7:8], 1)[0])
    if tag == "time" and tb is list and len(body) == 6:
        return datetime.time(*_ints(body[:4], 4), tzinfo=_timezone(body[5]), fold=_ints(body[4:5], 1)[0])
    if tag == "timedelta":
        return _timedelta(body)
    if tag == "timezone" and body is not None:
        return _timezone(body)
    if (
        memo is not None
        and tag == "r"
        and tb is int
        and 0 <= body < len(memo.objects)
        and memo.objects[body] is not None
    ):
        return memo.objects[body]
    if (
        memo is not None
        and memo.receiving
        and tag == "m"
        and tb is list
        and len(body) == 2
        and body[0] == len(memo.objects)
        and type(body[1]) in (list, dict)
    ):
        memo.objects.append(None)  # numbered in the sender's order: an outer container before those inside it
        obj = sub(body[1])
        if type(obj) not in MUTABLE:
            raise ValueError("a malformed argument")
        memo.objects[body[0]] = obj
        memo.ids[id(obj)] = body[0]
        return obj
    if tag in ("handle", "callback", "test") and resolve is not None:
        return resolve(tag, body)
    raise ValueError(f"not plain data: tag {tag!r}")
