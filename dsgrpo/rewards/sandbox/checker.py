"""The checker side (C): the tests run here, contained as the program is, one child process per test.

A test snippet is the dataset's code, but what it does with an answer is the program's to choose: a test that
`eval`s a returned string or `pickle.loads` returned bytes runs the program's code right here. So the checker is
contained like the program (checker.py's cell: containment.py) and every test runs in a fresh child forked from a
namespace no test has touched, which may not create processes: code reached through one test's answers can at
most decide that test's own verdict (which such a test hands to the program anyway) — never another test's, never
the count, never anything outside the sandbox. The checker itself runs only this file's code and the decoding of
answers (protocol.py), never a test.

What a test gets of an answer: the answer rule (answers.py): inert data unless the program defined its class and
the test names that class. Which names the program answers for: names.py, by the rule below.

Which names a test sees (the program must not answer for a name the test expects from elsewhere):
- Python's builtins, the row's setup code (run in each test's process), and names the tests bind themselves;
- the program's *entry points*: the row's `entry_point` when it has one, plus every name the tests use that is
  neither a builtin nor a standard-library module nor a helper name (a public name of HELPER_MODULES: `isclose`,
  `Counter`, `pi`, ...; or `np` and the like), plus every such library name the tests call as a task and never
  import (`trace(m) == 5`, `sqrt(16) == 4`: no call of it wraps, or is compared with, another call, as
  `isclose(area(1), 3.14)` or `count('') == Counter()` do). When the tests use no other name, the helper names they
  use are the entry points (a task named `gcd`), and failing those, the builtin names every test uses (`pow`);
- any other name the program bound means Python's own object (a module it imported, `isclose` imported from math)
  or nothing, never the program's: a program that defines `abs` or `isclose` changes nothing. An entry point the
  program did not define is a NameError, even when a builtin has its name.
Standard library only.
"""

from __future__ import annotations

import builtins
import importlib
import os
import functools
import operator
import signal
import sys
import types

from .answers import (
    _ITERATION_ENDS,
    Missing,
    ProgramClass,
    ProgramObject,
    Refused,
    Remote,
    RemoteError,
    exception_class,
    program_class,
)
from .limits import install_seccomp
from .names import _names
from .program import LIBRARY_MODULES, SITE_BUILTINS, install_site_builtins
from .protocol import (
    COMPARISON_OPERATORS,
    Memo,
    ProtocolError,
    decode,
    encode,
    enum_class,
    frame,
    namedtuple_class,
    read_frame,
    read_untrusted_frame,
    write_all,
)
from .sharing import (
    apply_interpreter_state,
    encode_state,
    interpreter_state,
    snapshot,
    unchanged,
    update_in_place,
)


class Link:
    """Questions to the program over two pipes, blocking (the supervisor owns the deadline). Forked into each test's
    process; every read is byte-exact, so the processes stay in step on the shared pipes. `classes`: the stand-in
    classes of the program's classes the tests name."""

    def __init__(self, requests: int, replies: int, message_bytes: int):
        self.requests, self.replies, self.message_bytes = requests, replies, message_bytes
        self.broken = None
        self.classes: dict = {}
        self.callbacks: list = []  # the test's objects the program has a stand-in of (program.TestObject), by ident
        self.callback_ids: dict = {}
        self.callback_kinds: list = []
        self.exchanges = 0  # questions asked so far: a module-level value read since the last one is unchanged
        self.synced = None  # the shared interpreter state (random, decimal, recursion limit) both sides last agreed on
        self.memo, self.snapshots, self.memo_pid = Memo(), {}, None  # the containers shared with the program

    def share_state(self, message: dict) -> None:
        """Python's one interpreter shares random's generator, the decimal context and the recursion limit between
        a test and the program it calls: this process's, when changed since last agreed, travels with the call."""
        now = interpreter_state()
        if now != self.synced:
            message["state"] = now
            self.synced = now

    def take_state(self, state) -> None:
        try:
            apply_interpreter_state(state, from_test=False)
        except ValueError:
            self.fail("a malformed answer")
        self.synced = interpreter_state()

    def fail(self, what: str):
        self.broken = self.broken or what
        raise ProtocolError(self.broken)

    def receive(self):
        if self.broken:
            raise ProtocolError(self.broken)
        try:
            return read_untrusted_frame(self.replies, self.message_bytes)
        except ProtocolError as exc:
            self.fail(str(exc))

    def send(self, request: dict) -> None:
        try:
            write_all(self.requests, frame(request))
        except OSError:
            self.fail("exiting")

    def call(self, ref, args, kwargs):
        """Call the program's `ref`. The arguments' mutable containers travel numbered; those the call changed come
        back, and the test's own objects are changed in place to match (identity kept: `xs.sort()` in the
        program sorts the test's xs)."""
        if not all(type(k) is str for k in kwargs):
            raise TypeError("keyword names must be strings")
        memo = self.shared()
        memo.sending, memo.receiving = True, False
        # the shared containers the test changed since the last call, then the arguments (in this order: the
        # program numbers new containers in the order it reads them)
        sync = [
            [k, encode_state(memo, k, self.handle_of)]
            for k, before in self.snapshots.items()
            if memo.objects[k] is not None and not unchanged(before, memo.objects[k])
        ]
        request = {"op": "call", "target": ref, "epoch": os.getpid(), "sync": sync}
        request["args"] = [encode(a, self.handle_of, None, memo) for a in args]
        request["kwargs"] = {"dict": [[k, encode(v, self.handle_of, None, memo)] for k, v in kwargs.items()]}
        self.share_state(request)
        try:
            return self.exchange("call", request, memo)
        finally:  # what both sides hold now: the next call sends what the test changes from here
            self.snapshots = {k: snapshot(memo.objects[k]) for k in memo.live()}

    def shared(self) -> Memo:
        """The containers shared with the program during this test (sharing.py): each test
        runs in a process of its own, which starts with none."""
        if self.memo_pid != os.getpid():
            self.memo, self.snapshots, self.memo_pid = Memo(), {}, os.getpid()
        return self.memo

    def ask(self, op: str, ref, inert: bool = False, **fields):
        if self.broken:
            raise ProtocolError(self.broken)
        request = {"op": op, "target": ref}
        for key, value in fields.items():
            request[key] = str(value) if key == "name" else encode(value, handle_of=self.handle_of)
        return self.exchange(op, request, None, inert)

    def exchange(self, op: str, request: dict, memo, inert: bool = False):
        if self.broken:
            raise ProtocolError(self.broken)
        if op != "value":
            self.exchanges += 1
        self.send(request)
        while True:
            message = self.receive()
            if "state" in message:  # the program changed random's or decimal's state: the test's changes with it
                self.take_state(message["state"])
                continue
            if "callback" not in message:
                break
            self.run_callback(message["callback"])
        if "raise" in message:
            raise self._exception(op, message["raise"])
        resolve = self.resolve_inert if inert else self.resolve
        if memo is not None:  # the answer numbers its own containers after the call's: shared ones stay shared
            memo.receiving = True
        try:
            if "ok" in message:
                value = decode(message["ok"], resolve, memo)
            elif "okm" in message and memo is not None and type(message["okm"]) is list and len(message["okm"]) == 3:
                result, after, dropped = message["okm"]
                if type(after) is not list or type(dropped) is not list:
                    raise ValueError("a malformed answer")
                for change in after:
                    if not (
                        type(change) is list
                        and len(change) == 2
                        and type(change[0]) is int
                        and 0 <= change[0] < len(memo.objects)
                    ):
                        raise ValueError("a malformed answer")
                    if memo.objects[change[0]] is None:
                        raise ValueError("a malformed answer")
                    update_in_place(memo.objects[change[0]], decode(change[1], resolve, memo))
                value = decode(result, resolve, memo)
                for k in dropped:  # containers the program no longer holds: no longer shared
                    if type(k) is not int or not 0 <= k < len(memo.objects):
                        raise ValueError("a malformed answer")
                    memo.drop(k)
            else:
                raise ValueError("a malformed answer")
        except (ValueError, TypeError, RecursionError, OverflowError, MemoryError):
            self.fail("a malformed answer")
        if inert and callable(value) and not isinstance(value, (Remote, ProgramClass)):
            # a builtin (object() is truthy) or a class as the method of an inert object: it exists, never runs
            return Refused(str(request.get("name", "an item")))
        return value

    def resolve(self, tag, body, callable_=True):
        """A handle the program described: [n, the names of its classes, its data view or None]."""
        if tag == "test":
            return self.test_object(body)
        if not (
            tag == "handle"
            and type(body) is list
            and len(body) == 3
            and type(body[0]) is int
            and type(body[1]) is list
            and all(type(n) is str for n in body[1])
        ):
            raise ValueError("a malformed handle")
        n, classes, view = body
        named = tuple(name for name in classes if name in self.classes)
        if named:  # an instance of every class of the program's the test names (isinstance(c, Shape) holds)
            cls = self.classes.get(named)
            if cls is None:
                cls = self.classes[named] = (
                    self.classes[named[0]]
                    if len(named) == 1
                    else program_class(self, named[0], tuple(self.classes[name] for name in named))
                )
            obj = object.__new__(cls)
            Remote.__init__(obj, self, {"handle": n})
            return obj
        if view is not None:
            return decode(view, self.resolve if callable_ else self.resolve_inert)
        return Remote(self, {"handle": n}, callable_)

    def resolve_inert(self, tag, body):
        return self.resolve(tag, body, callable_=False)

    def handle_of(self, obj):
        """How the test's non-plain values reach the program: its objects back as handles, the test's own callables
        and iterators as callbacks (the test's code, run here when the program calls them), the program's entry
        points by name."""
        if isinstance(obj, Remote):
            return {"handle": obj._sbx_ref["handle"] if "handle" in obj._sbx_ref else obj._sbx_ref}
        if type(obj) is ProgramClass:
            return {"handle": {"name": obj._sbx_class_name}}
        k = self.callback_ids.get(id(obj))
        if k is None:  # one ident per object (the callbacks keep it alive): the program's stand-in keeps identity
            k = self.callback_ids[id(obj)] = len(self.callbacks)
            self.callbacks.append(obj)
            self.callback_kinds.append(_kind_of(obj))
        kind = self.callback_kinds[k]
        obj_type = type(obj)
        if kind == "class":
            info = obj.__name__
        else:
            info = [
                obj_type.__eq__ is object.__eq__
                and obj_type.__hash__ is object.__hash__
                and not hasattr(obj_type, "__bool__")
                and not hasattr(obj_type, "__len__"),
                _plain_attributes(obj),
            ]
        return {"callback": [[os.getpid(), k], kind, info]}

    def _written_back(self, args) -> bool:
        """A batch of attribute writes names only the test's objects of plain instance attributes."""
        if not (len(args) == 1 and type(args[0]) is list):
            return False
        for write in args[0]:
            if not (type(write) is list and len(write) == 3 and type(write[1]) is str):
                return False
            k = self.callback_ids.get(id(write[0]))
            if k is None or self.callbacks[k] is not write[0] or self.callback_kinds[k] != "object":
                return False
            if not _plain_attributes(write[0]):
                return False
        return True

    def test_object(self, body):
        """The test's own object, that the program hands back (its stand-in went home)."""
        if not (
            type(body) is list
            and len(body) == 2
            and body[0] == os.getpid()
            and type(body[1]) is int
            and 0 <= body[1] < len(self.callbacks)
        ):
            raise ValueError("an object of another test's")
        return self.callbacks[body[1]]

    def bind_setup(self, namespace: dict, setup: str, entries: set) -> None:
        """The classes the row's setup defines (a ListNode, a TreeNode) are globals of the program's too, as in
        Python, where the setup runs in the program's namespace: the program builds the test's own objects with
        them. Not its functions nor its values (a reference solution or an expected value stays the test's)."""
        _, bound = _names(setup)
        classes = {
            name: namespace[name]
            for name in sorted(bound - entries)
            if isinstance(namespace.get(name), type) and type(namespace[name]) is type
        }
        if classes:
            self.ask("bind", None, names=classes)

    def run_callback(self, body) -> None:
        """The program calls a callable the test passed it: the test's own code, run here with plain arguments."""
        if not (
            type(body) is list
            and len(body) == 4
            and body[1] in TEST_OPERATIONS
            and type(body[0]) is list
            and body[0][:1] == [os.getpid()]
            and len(body[0]) == 2
            and type(body[0][1]) is int
            and 0 <= body[0][1] < len(self.callbacks)
            and self.callback_kinds[body[0][1]] in TEST_OPERATIONS[body[1]][0]
        ):
            self.send({"op": "return", "raise": "RuntimeError"})  # a callback of an earlier test's, a refused use
            return
        target = self.callbacks[body[0][1]]
        try:
            args, kwargs = decode(body[2], self.resolve), decode(body[3], self.resolve)
            if type(args) is not list or type(kwargs) is not dict or not all(type(k) is str for k in kwargs):
                raise ValueError
            if body[1] == "setattrs" and not self._written_back(args):
                raise ValueError
        except (ValueError, TypeError, RecursionError, OverflowError, MemoryError):
            self.fail("a malformed answer")
        try:
            value = TEST_OPERATIONS[body[1]][1](target, args, kwargs)
            reply = {"op": "return", "value": encode(value, self.handle_of)}
        except ProtocolError:
            raise
        except BaseException as exc:  # the test's callable raised: the program sees the exception's name
            reply = {
                "op": "return",
                "raise": type(exc).__name__ if type(exc).__module__ == "builtins" else "RuntimeError",
            }
        if body[1] not in ("vars", "setattrs"):  # plain attributes read or written: the test's state did not move
            self.share_state(reply)
        self.send(reply)

    def _exception(self, op: str, body) -> BaseException:
        if not (type(body) is list and len(body) == 3 and type(body[0]) is str and type(body[1]) is str):
            self.fail("a malformed answer")
        name, text, chain = body
        if name in _ITERATION_ENDS or (type(chain) is list and any(n in _ITERATION_ENDS for n in chain)):
            # only `next` ends an iteration; anywhere else it would end the test's own loop early (a map() over
            # the cases, a generator expression), so it arrives as an error, as PEP 479 does for generators
            if op == "next" and name == "StopIteration":
                return StopIteration()
            return RuntimeError(f"the program raised {name}")
        if name == "SystemExit" and chain == ["SystemExit"]:  # exit() in a function the test calls, as in Python
            return SystemExit(int(text) if text.lstrip("-").isdigit() and len(text) < 20 else text or None)
        try:
            return exception_class(chain)(text)
        except Exception:
            return RemoteError(f"{name}: {text}")


# ---------------------------------------------------------------------------------------------- the test's objects
# What the program may do with an object of the test's that is not plain data (program.TestObject): what Python
# would let it do, run here on the test's own object, but for the attributes that reach an interpreter's insides
# (dunders: __globals__, __class__, __dict__...; frames and code: a generator's gi_frame.f_globals would be the
# test's own namespace, its expected values). A function of the test's can only be called, a generator only
# iterated, a class called, asked isinstance and read (its public class attributes).
_HIDDEN_ATTRIBUTES = frozenset(
    {
        "gi_frame",
        "gi_code",
        "gi_yieldfrom",
        "cr_frame",
        "cr_code",
        "cr_await",
        "cr_origin",
        "ag_frame",
        "ag_code",
        "ag_await",
        "f_back",
        "f_globals",
        "f_locals",
        "f_builtins",
        "f_code",
        "tb_frame",
        "tb_next",
        "func_globals",
    }
)


def _reachable(name) -> bool:
    """An attribute name the program may reach on the test's objects."""
    return type(name) is str and name.isidentifier() and name not in _HIDDEN_ATTRIBUTES and not name.startswith("__")


def _attribute(name) -> str:
    if not _reachable(name):
        raise AttributeError(f"{name!r}: not an attribute the program may reach on the test's object")
    return name


def _plain_attributes(obj) -> bool:
    """Its attributes are plain instance attributes: Python's own attribute access, a __dict__, no property or other
    data descriptor in its class (a ListNode): reading one runs no code of the test's, nor does writing one."""
    t = type(obj)
    if not (
        not isinstance(obj, type)
        and t.__getattribute__ is object.__getattribute__
        and t.__setattr__ is object.__setattr__
        and t.__delattr__ is object.__delattr__
        and type(getattr(obj, "__dict__", None)) is dict
    ):
        return False
    plain = _PLAIN_CLASSES.get(t)
    if plain is None:
        plain = _PLAIN_CLASSES[t] = not any(
            hasattr(type(value), "__set__") or hasattr(type(value), "__delete__")
            for cls in t.__mro__[:-1]
            for name, value in vars(cls).items()
            if name not in ("__dict__", "__weakref__")
        )
    return plain


_PLAIN_CLASSES: dict = {}  # class -> no data descriptor in it (a test's process asks of few classes)


def _plain_vars(obj) -> dict:
    """The instance attributes a stand-in may answer from (program.TestObject), those the program may reach
    (_reachable); {} for an object whose attributes are not plain (its class has a property: it would win)."""
    if not _plain_attributes(obj):
        return {}
    return {name: value for name, value in vars(obj).items() if _reachable(name)}


PREFETCH_OBJECTS = 256


def _plain_vars_from(obj) -> list:
    """[object, its plain attributes] for `obj` and the plain objects its attributes lead to (directly, or as items
    of a list or tuple attribute), breadth first, at most PREFETCH_OBJECTS: what the program could read one
    attribute at a time, in one answer."""
    out, seen, queue = [], {id(obj)}, [obj]
    while queue and len(out) < PREFETCH_OBJECTS:
        current = queue.pop(0)
        found = _plain_vars(current)
        out.append([current, found])
        for value in found.values():
            for item in value if type(value) in (list, tuple) else (value,):
                if id(item) not in seen and _plain_attributes(item) and type(item).__module__ != "builtins":
                    seen.add(id(item))
                    queue.append(item)
    return out


def _kind_of(obj) -> str:
    if isinstance(obj, type):
        return "class"
    if isinstance(obj, (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)):
        return "iter"
    plain_callables = (
        types.FunctionType,
        types.MethodType,
        types.BuiltinFunctionType,
        types.MethodWrapperType,
        types.WrapperDescriptorType,
        types.MethodDescriptorType,
        functools.partial,
    )
    if isinstance(obj, plain_callables):
        return "call"
    return "object"


_OBJECT, _ANY = ("object",), ("object", "class")
TEST_OPERATIONS = {  # how: (the kinds of object it applies to, what it does)
    "call": (("call", "object", "class"), lambda o, a, k: o(*a, **k)),
    "next": (("iter", "object"), lambda o, a, k: next(o)),
    "getattr": (_ANY, lambda o, a, k: getattr(o, _attribute(a[0]))),
    "setattr": (_OBJECT, lambda o, a, k: setattr(o, _attribute(a[0]), a[1])),
    "vars": (_OBJECT, lambda o, a, k: _plain_vars_from(o)),
    "setattrs": (_OBJECT, lambda o, a, k: [setattr(t, _attribute(n), v) for t, n, v in a[0]] and None),
    "delattr": (_OBJECT, lambda o, a, k: delattr(o, _attribute(a[0]))),
    "getitem": (_OBJECT, lambda o, a, k: o[a[0]]),
    "setitem": (_OBJECT, lambda o, a, k: o.__setitem__(a[0], a[1])),
    "delitem": (_OBJECT, lambda o, a, k: o.__delitem__(a[0])),
    "len": (_OBJECT, lambda o, a, k: len(o)),
    "iter": (_OBJECT, lambda o, a, k: iter(o)),
    "contains": (_OBJECT, lambda o, a, k: a[0] in o),
    "bool": (_OBJECT, lambda o, a, k: bool(o)),
    "str": (_OBJECT, lambda o, a, k: str(o)),
    "repr": (_OBJECT, lambda o, a, k: repr(o)),
    "hash": (_OBJECT, lambda o, a, k: hash(o)),
    "isinstance": (("class",), lambda o, a, k: isinstance(a[0], o)),
    **{op: (_OBJECT, lambda o, a, k, op=op: getattr(operator, op)(o, a[0])) for op in COMPARISON_OPERATORS},
}


def build_namespace(link: Link, exported, entries: set, free: set) -> dict:
    """The globals every test starts from (before the setup code runs in the test's own process)."""
    if type(exported) is not dict or not all(type(k) is str for k in exported):
        link.fail("a malformed answer")
    current: set = set()
    namespace = {"__name__": "__main__", "__builtins__": ProgramValues(builtins.__dict__, link, current)}
    builtin_names = set(dir(builtins)) | set(SITE_BUILTINS)
    stdlib = set(getattr(sys, "stdlib_module_names", ()))
    for name in free | entries:
        entry = exported.get(name)
        if entry is not None and not (type(entry) is dict and len(entry) == 1):
            link.fail("a malformed answer")
        ((kind, body),) = entry.items() if entry is not None else ((None, None),)
        if kind not in (
            None,
            "module",
            "library",
            "value",
            "object",
            "class",
            "enum_class",
            "namedtuple_class",
            "exception_class",
        ):
            link.fail("a malformed answer")
        if name not in entries and name in builtin_names:
            continue  # not the program's to answer: Python's builtin
        if kind == "module":
            value = _real_module(body)
        elif kind == "library":  # imported from a library module: our own copy of it, never the program's object
            value = _real_library_object(body, name)
        elif name not in entries:
            # not the program's to answer: a standard-library module name it bound means Python's module
            value = _real_module(name) if kind is not None and name in stdlib else None
        elif kind == "value":
            try:
                value = decode(body)
            except (ValueError, TypeError, RecursionError, OverflowError, MemoryError):
                link.fail("a malformed answer")
            if name in builtin_names:  # its value here (even None): Python's builtin would answer through builtins
                namespace[name] = value
                continue
            current.add(name)  # read from the program when the test reads it: as the calls left it
            value = None
        elif kind == "object":  # a function or an object the test names: the test delegates to it
            value = ProgramObject(link, {"name": name})
        elif kind in ("class", "enum_class", "namedtuple_class", "exception_class"):
            value = _program_class(link, name, kind, body, exported, entries)
        else:
            value = Missing(name) if name in builtin_names else None
        if value is not None:
            namespace[name] = value
    return namespace


class ProgramValues(dict):
    """The tests' builtins, through which a module-level value of the program's (`history = []`, `count = 0`) is read
    from the program each time a test reads it, as plain data: a test that calls `log('a')` then reads `history`
    sees what the call left, as in Python (a name the test binds itself is a global and shadows it)."""

    def __init__(self, base: dict, link: Link, names: set):
        super().__init__(base)
        self._link, self._names, self._read = link, names, {}

    def __missing__(self, name):
        if name not in self._names:
            raise KeyError(name)
        read = self._read.get(name)
        if read is None or read[0] != self._link.exchanges:  # the program may have changed it since
            read = self._read[name] = (self._link.exchanges, self._link.ask("value", {"name": name}))
        return read[1]


def _program_class(link: Link, name: str, kind: str, body, exported: dict, entries: set, depth: int = 0):
    """A class of the program's that the test names: enums and namedtuples rebuilt here as data classes (the same
    class their members and instances decode to), exceptions as exception classes here, any other class a
    stand-in whose instances are the program's objects, derived from the stand-ins of its bases the test names."""
    try:
        if kind == "enum_class":
            return enum_class(body)
        if kind == "namedtuple_class" and type(body) is list and len(body) in (3, 4):
            cls = namedtuple_class(*body[:3])
            if len(body) == 4:
                _namedtuple_methods(link, name, cls, body[3])
            return cls
        if kind == "exception_class":
            return exception_class(body)
    except (ValueError, TypeError):
        pass
    if name in link.classes:
        return link.classes[name]
    bases = []
    if kind == "class" and type(body) is list and len(body) == 2 and type(body[1]) is list and depth < 32:
        for base in body[1]:
            entry = exported.get(base) if type(base) is str and base in entries else None
            if type(entry) is dict and "class" in entry:
                bases.append(_program_class(link, base, "class", entry["class"], exported, entries, depth + 1))
    try:
        cls = program_class(link, name, tuple(bases))
    except TypeError:  # no consistent order of the bases
        cls = program_class(link, name)
    link.classes[name] = cls
    return cls


def _namedtuple_methods(link: Link, name: str, cls: type, methods) -> None:
    """A namedtuple class of the program's with methods of its own (`class V(NamedTuple): ... def norm1(self)`),
    named by the test: its instances stay data here, and each of its methods and properties runs in the program on
    an instance rebuilt there from the fields (the test delegated it by naming the class)."""
    if not (type(methods) is list and len(methods) <= 256):
        raise ValueError("a malformed namedtuple")
    for entry in methods:
        if not (
            type(entry) is list
            and len(entry) == 2
            and type(entry[0]) is str
            and entry[0].isidentifier()
            and not entry[0].startswith("_")
            and entry[0] not in cls._fields
            and entry[1] in ("method", "property")
        ):
            raise ValueError("a malformed namedtuple")
        method, how = entry

        def ref(self, method=method):
            return {"method": [name, encode(list(self), link.handle_of), method]}

        if how == "property":
            setattr(cls, method, property(lambda self, ref=ref: link.ask("value", ref(self))))
        else:
            setattr(cls, method, lambda self, *args, ref=ref, **kwargs: link.call(ref(self), args, kwargs))


def _real_module(name):
    """Python's own module of that name (standard library only: nothing else is installed in the sandbox)."""
    stdlib = getattr(sys, "stdlib_module_names", ())
    if type(name) is not str or name.partition(".")[0] not in stdlib:
        return None
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def _real_library_object(module, name: str):
    if module not in LIBRARY_MODULES or name.startswith("_"):
        return None
    return getattr(importlib.import_module(module), name, None)


# ---------------------------------------------------------------------------------------------- the run
def run(limits: dict, contained: bool, fds: dict) -> None:
    """C's whole life. It holds no test: the supervisor sends the names plan first (plan_names), then each test to
    the one process that runs it, only once C asks for it (after the previous test's process has exited). C reads
    the program's names, builds the namespace, and reports on the control pipe (never stdout, /dev/null here):
    {"next": i} before test i, {"verdict": i, "passed": bool} after it, {"done": why or None} at the end."""
    prctl_dumpable_off()  # no process of the same uid (a test's) may open this one's memory
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
        signal.signal(sig, signal.SIG_DFL)  # PID 1 with no handler: its children's signals do not reach it
    install_site_builtins()  # the tests see the builtins a plain `python` has, as the program does
    plan = read_frame(fds["tests"])
    link = Link(fds["requests"], fds["replies"], limits["message_bytes"])

    def tell(message: dict) -> None:
        write_all(fds["control"], frame(message))

    ended = None
    try:
        ready = link.receive()
        if "ready" not in ready:
            link.fail("a malformed answer")
        if ready["ready"] is None:
            ended = "the program raised or exited before the tests"
        else:
            namespace = build_namespace(link, ready["ready"], set(plan["entries"]), set(plan["free"]))
            for i in range(plan["n"]):
                tell({"next": i})
                outcome = _one_test(i, namespace, link, contained, fds, set(plan["entries"]))
                if outcome == b"B":
                    link.fail("a malformed answer")
                if outcome == b"L":
                    raise ProtocolError("a test's process that ended before reading its test")
                tell({"verdict": i, "passed": outcome == b"P"})
            # the program must still be answering after the last test: one that dies on the way scores nothing
            link.ask("ping", None)
    except ProtocolError as exc:
        ended = f"the program broke {link.broken}" if link.broken else f"the checker lost {exc}"
    tell({"done": ended})
    os._exit(0)


def prctl_dumpable_off() -> None:
    import ctypes

    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0: /proc/<pid>/mem and ptrace need CAP_SYS_PTRACE


def _one_test(i: int, namespace: dict, link: Link, contained: bool, fds: dict, entries: set) -> bytes:
    """Run test i in a fresh child: b'P' passed, b'F' failed, b'B' the program broke the protocol, b'L' the child
    ended before it had read its test. The child holds no descriptor of the tests' pipe or the control pipe (one it
    held could be reopened through /proc/self/fd for writing, where the pipe's owner is this uid, and forge the next
    tests): this process moves test i's frame from the tests' pipe into a pipe of the child's own, in the kernel
    (splice: the test's text is never in this process's memory, which later tests' processes would inherit)."""
    r, w = os.pipe()
    frame_r, frame_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        outcome = b"F"
        try:
            for fd in (r, frame_w, fds["control"], fds["tests"]):
                os.close(fd)
            if contained:
                install_seccomp(new_processes=False)
            material = read_frame(frame_r)
            os.close(frame_r)
            os.write(w, b"R")
            if material.get("index") != i:
                raise ProtocolError("tests out of order")
            if material["setup"]:
                exec(compile(material["setup"], "<setup>", "exec"), namespace)
                link.bind_setup(namespace, material["setup"], entries)
            exec(compile(material["test"], f"<test {i}>", "exec"), namespace)
            outcome = b"P"
        except BaseException:
            outcome = b"F"
        if link.broken:
            outcome = b"B"  # a test that swallowed the ProtocolError still fails the run
        try:
            os.write(w, outcome)
        finally:
            os._exit(0)
    os.close(w)
    os.close(frame_r)
    try:
        _relay_frame(fds["tests"], frame_w)
    except OSError:  # the child is gone (EPIPE): the frame cannot reach it
        pass
    finally:
        os.close(frame_w)  # the child sees the frame end here, whatever it got
    os.waitpid(pid, 0)
    got = b""
    while True:
        chunk = os.read(r, 2)
        if not chunk:
            break
        got += chunk
    os.close(r)
    if not got.startswith(b"R"):
        return b"L"
    return got[1:2] if got[1:2] in (b"P", b"B") else b"F"


def _relay_frame(source: int, target: int) -> None:
    """One frame from `source` to `target`: its 4-byte length read here, its body spliced pipe to pipe."""
    head = b""
    while len(head) < 4:  # byte-exact: the next frame stays in the pipe
        chunk = os.read(source, 4 - len(head))
        if not chunk:
            raise ProtocolError("the tests' pipe ended")
        head += chunk
    write_all(target, head)
    left = int.from_bytes(head, "big")
    while left:
        moved = os.splice(source, target, min(left, 1 << 16))
        if not moved:
            raise ProtocolError("the tests' pipe ended inside a frame")
        left -= moved
