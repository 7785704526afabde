"""The checker side (C): the tests run here, contained as the program is, one child process per test.

A test snippet is the dataset's code, but what it does with an answer is the program's to choose: a test that
`eval`s a returned string or `pickle.loads` returned bytes runs the program's code right here. So the checker is
contained like the program (checker.py's cell: containment.py) and every test runs in a fresh child forked from a
namespace no test has touched, which may not create processes: code reached through one test's answers can at
most decide that test's own verdict (which such a test hands to the program anyway) — never another test's, never
the count, never anything outside the sandbox. The checker itself runs only this file's code and the decoding of
answers (protocol.py), never a test.

What a test gets of an answer: the answer rule (below, above Remote): inert data unless the program defined its
class and the test names that class.

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

import ast
import builtins
import importlib
import os
import functools
import operator
import signal
import sys
import types

from .limits import install_seccomp
from .program import LIBRARY_MODULES, SITE_BUILTINS, install_site_builtins
from .protocol import (
    BINARY_OPERATORS,
    COMPARISON_OPERATORS,
    UNARY_OPERATORS,
    Memo,
    ProtocolError,
    apply_interpreter_state,
    builtin_name,
    decode,
    encode,
    encode_state,
    enum_class,
    frame,
    interpreter_state,
    namedtuple_class,
    read_frame,
    read_untrusted_frame,
    snapshot,
    unchanged,
    update_in_place,
    write_all,
)


class RemoteError(Exception):
    """An exception of the program's whose type is not one of Python's exceptions nor derived from one."""


# ---------------------------------------------------------------------------------------------- answers
# The answer rule. An answer is inert data unless the program defined its class and the test names that class:
# - plain data (protocol.py) is rebuilt here from fresh objects: its methods are this process's own (`startswith`,
#   `issubset`, `isprintable` run on the checker's copy, never in the program); so are instances of subclasses of
#   plain types (a copy of the base value), dates, enum members, dataclass instances (their fields, compared as a
#   dataclass compares by default), dict views, namedtuples;
# - an object of a class the test names (an entry point: `s = Stack(); s.push(1)`) is a ProgramObject: an
#   instance of a stand-in class of that name (so `isinstance(make(), Shape)` holds), whose calls, attributes,
#   items and operators go to the program: the test delegated them by naming the class;
# - any other object of the program's is a Remote: the test may read it (attributes, items, len, bool, str,
#   repr, iteration: the values cross as data, so `x in obj` iterates here) and call it when it is itself the
#   answer (a closure make_adder returned), but a method of it is refused: nothing of the program's runs with the
#   test's values where it would decide a comparison the test makes with its own values;
# - equality and ordering between two of the program's objects are asked of the program (it decides nothing the
#   test did not take from it); between one of them and the test's own value they stay here (identity).
# Iterators and generators the program returns iterate in the program; each item crosses as data.


class Remote:
    """An object of the program's whose class the test does not name (or which has none of the program's: a
    function, a generator): readable, iterable, callable only when it is itself the answer (see the answer rule)."""

    __slots__ = ("_sbx_link", "_sbx_ref", "_sbx_callable")

    def __init__(self, link, ref: dict, callable_: bool = True):
        object.__setattr__(self, "_sbx_link", link)
        object.__setattr__(self, "_sbx_ref", ref)
        object.__setattr__(self, "_sbx_callable", callable_)

    def _sbx_ask(self, op, inert=False, **fields):
        return self._sbx_link.ask(op, self._sbx_ref, inert=inert, **fields)

    def __call__(self, *args, **kwargs):
        if not self._sbx_callable:
            raise TypeError(
                "a method or item of an object of the program's whose class the test does not name "
                "(only the test's names run the program's code)"
            )
        return self._sbx_link.call(self._sbx_ref, args, kwargs)

    def __getattr__(self, name):
        if name.startswith("_sbx_"):
            raise AttributeError(name)
        return self._sbx_ask("getattr", inert=True, name=name)

    def __getitem__(self, key):
        return self._sbx_ask("getitem", inert=True, key=key)

    def __len__(self):
        n = self._sbx_ask("len")
        if type(n) is not int or n < 0:
            raise TypeError("len() of the program's object is not a non-negative int")
        return n

    def __bool__(self):
        b = self._sbx_ask("bool")
        if type(b) is not bool:
            raise TypeError("bool() of the program's object is not a bool")
        return b

    def __str__(self):
        s = self._sbx_ask("str")
        if type(s) is not str:
            raise TypeError("str() of the program's object is not a str")
        return s

    def __repr__(self):
        s = self._sbx_ask("repr")
        if type(s) is not str:
            raise TypeError("repr() of the program's object is not a str")
        return s

    def __hash__(self):  # equality with the test's own values is identity, so the program's hash decides nothing
        h = self._sbx_ask("hash")
        if type(h) is not int:
            raise TypeError("hash() of the program's object is not an int")
        return h

    def __iter__(self):
        it = self._sbx_ask("iter")
        return it if isinstance(it, Remote) else iter(it)

    def __next__(self):
        return self._sbx_ask("next")

    def __contains__(self, item):  # by iteration, compared here (the program's __contains__ would see the item)
        for value in self:
            if value is item or value == item:
                return True
        return False


def _compare(name, op):
    def compare(self, other):
        if not isinstance(other, Remote):
            return NotImplemented  # the test's own value: not the program's to judge
        return self._sbx_link.ask("operator", None, name=op, args=[self, other])

    compare.__name__ = name
    return compare


for _op in COMPARISON_OPERATORS:
    setattr(Remote, f"__{_op}__", _compare(f"__{_op}__", _op))


class ProgramObject(Remote):
    # An object of a class of the program's that the test names, or a function of the program's: everything it does
    # is the program's (the test delegated it by naming it); only equality with the test's own plain values stays
    # here. (No docstring: __doc__ is the program's, as __module__ and __signature__ are.)

    __slots__ = ()

    @property
    def __doc__(self):
        return self._sbx_ask("getattr", name="__doc__")

    @property
    def __module__(self):
        return self._sbx_ask("getattr", name="__module__")

    @property
    def __signature__(self):  # inspect.signature(f): the program's parameters, rebuilt here from plain data
        return _signature(self._sbx_ask("signature"))

    def __call__(self, *args, **kwargs):
        return self._sbx_link.call(self._sbx_ref, args, kwargs)

    def __getattr__(self, name):
        if name.startswith("_sbx_"):
            raise AttributeError(name)
        return self._sbx_ask("getattr", name=name)

    def __setattr__(self, name, value):
        self._sbx_ask("setattr", name=name, value=value)

    def __getitem__(self, key):
        return self._sbx_ask("getitem", key=key)

    def __setitem__(self, key, value):
        self._sbx_ask("setitem", key=key, value=value)

    def __delitem__(self, key):
        self._sbx_ask("delitem", key=key)

    def __contains__(self, item):
        return bool(self._sbx_link.ask("operator", None, name="contains", args=[self, item]))

    def __enter__(self):
        return ProgramObject.__getattr__(self, "__enter__")()

    def __exit__(self, kind, value, traceback):  # the exception's class crosses by name when it is Python's own
        return ProgramObject.__getattr__(self, "__exit__")(kind if builtin_name(kind) else None, None, None)


def _binary(op, reflected):
    def apply(self, other):
        args = [other, self] if reflected else [self, other]
        return self._sbx_link.ask("operator", None, name=op, args=args)

    return apply


for _op in BINARY_OPERATORS:  # and_ is __and__ and __rand__
    setattr(ProgramObject, f"__{_op.rstrip('_')}__", _binary(_op, False))
    setattr(ProgramObject, f"__r{_op.rstrip('_')}__", _binary(_op, True))
for _op in UNARY_OPERATORS:
    setattr(
        ProgramObject, f"__{_op}__", lambda self, _op=_op: self._sbx_link.ask("operator", None, name=_op, args=[self])
    )


class ProgramClass(type):
    """The stand-in for a class of the program's that the test names: calling it builds the object in the program,
    its attributes are the program's class attributes, its instances are the program's objects of that class."""

    def __call__(cls, *args, **kwargs):
        return cls._sbx_class_link.call({"name": cls._sbx_class_name}, args, kwargs)

    def __getattr__(cls, name):
        if name.startswith("_sbx_") or name.startswith("__"):
            raise AttributeError(name)
        return cls._sbx_class_link.ask("getattr", {"name": cls._sbx_class_name}, name=name)

    def __repr__(cls):
        return f"<class {cls._sbx_class_name!r} of the program under test>"


def program_class(link, name: str, bases: tuple = ()) -> type:
    return ProgramClass(
        name,
        bases or (ProgramObject,),
        {"__slots__": (), "_sbx_class_link": link, "_sbx_class_name": name, "__module__": "solution"},
    )


class Refused:
    """A method of an object of the program's whose class the test does not name: it exists, and refuses to run."""

    __slots__ = ("_sbx_name",)

    def __init__(self, name: str):
        self._sbx_name = name

    def __call__(self, *args, **kwargs):
        raise TypeError(
            f"{self._sbx_name}: a method of an object of the program's whose class the test does not "
            "name (only the test's names run the program's code)"
        )

    def __repr__(self):
        return f"<method {self._sbx_name!r} of the program under test>"


class Missing:
    """An entry point the program did not define, where a builtin of that name would otherwise answer."""

    __slots__ = ("_sbx_name",)

    def __init__(self, name: str):
        object.__setattr__(self, "_sbx_name", name)

    def _fail(self, *args, **kwargs):
        raise NameError(f"name {self._sbx_name!r} is not defined by the program")

    __call__ = __getattr__ = __getitem__ = __iter__ = __len__ = __bool__ = _fail


_UNMAPPED = {"SystemExit", "KeyboardInterrupt", "GeneratorExit"}
_ITERATION_ENDS = {"StopIteration", "StopAsyncIteration"}
_exception_classes: dict = {}


def exception_class(chain) -> type:
    """The checker's class for an exception class of the program's: [its name, its bases' names..., the first of
    Python's own exceptions among them]. Derived from that builtin (a test's `except ValueError` catches the
    program's subclass of it), one per chain (a test's `except InsufficientFunds` catches what the program raised)."""
    if not (
        type(chain) is list
        and 0 < len(chain) <= 32
        and all(type(n) is str and n.isidentifier() and len(n) <= 200 for n in chain)
    ):
        raise ValueError("a malformed exception")
    base = getattr(builtins, chain[-1], None)
    if not (isinstance(base, type) and issubclass(base, Exception)) or chain[-1] in _UNMAPPED:
        raise ValueError("not an exception")
    if len(chain) == 1:
        return base
    key = tuple(chain)
    cls = _exception_classes.get(key)
    if cls is None:
        if len(_exception_classes) > 256:
            _exception_classes.clear()
        cls = _exception_classes[key] = type(chain[0], (exception_class(chain[1:]),), {"__module__": "solution"})
    return cls


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
        """The containers shared with the program during this test (protocol.py's shared containers): each test
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
        info = (
            obj.__name__
            if kind == "class"
            else obj_type.__eq__ is object.__eq__
            and obj_type.__hash__ is object.__hash__
            and not hasattr(obj_type, "__bool__")
            and not hasattr(obj_type, "__len__")
        )
        return {"callback": [[os.getpid(), k], kind, info]}

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


def _attribute(name) -> str:
    if type(name) is not str or not name.isidentifier() or name in _HIDDEN_ATTRIBUTES or name.startswith("__"):
        raise AttributeError(f"{name!r}: not an attribute the program may reach on the test's object")
    return name


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
    **{
        op: (_OBJECT, lambda o, a, k, op=op: getattr(operator, op)(o, a[0]))
        for op in ("eq", "ne", "lt", "le", "gt", "ge")
    },
}


# ---------------------------------------------------------------------------------------------- which names
def _names(source: str):
    """(names a snippet reads, names it binds). A snippet that does not parse reads and binds nothing here (it
    fails when it runs)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return set(), set()
    reads, binds = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (reads if isinstance(node.ctx, ast.Load) else binds).add(node.id)
        elif isinstance(node, ast.arg):
            binds.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            binds.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                binds.add(alias.asname or alias.name.partition(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            binds.add(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            binds.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            binds.add(node.rest)
    return reads, binds


# Names tests use as helpers (comparisons, constants, containers) and expect from an import: the public names of
# these modules and the usual aliases of numeric libraries. The program never answers for one of them unless the
# row names it its entry point, or the tests use nothing else (a task named `gcd`).
HELPER_MODULES = ("math", "cmath", "collections", "fractions", "decimal", "typing")
HELPER_ALIASES = ("np", "numpy", "pd", "pandas", "plt", "sp", "scipy", "sympy", "torch", "tf", "nx")
_helper_names = None


def _calls(source: str, builtin_names: set) -> tuple:
    """(names a snippet calls, names among them it uses as helpers: a call of one takes another call of a
    non-builtin name, or a name bound from one, among its arguments, or is compared with such a value:
    `isclose(area(1), 3.14)`, `r = area(1); isclose(r, 3.14)`, `count('') == Counter()`)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return set(), set()

    def callee(node):
        return node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else None

    def answers(nodes, other_than):  # an answer of another name's call: the call itself, or a name bound from one
        return any(
            isinstance(n, ast.Name)
            and n.id in carrying
            or callee(n) not in (None, other_than)
            and callee(n) not in builtin_names
            for node in nodes
            for n in ast.walk(node)
        )

    carrying: set = set()
    bindings = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bindings.append((targets, node.value))
        elif isinstance(node, (ast.For, ast.comprehension)):
            bindings.append(([node.target], node.iter))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            bindings.append(([node.optional_vars], node.context_expr))
    for _ in range(len(bindings) + 1):  # until nothing new carries an answer
        before = len(carrying)
        for targets, value in bindings:
            if answers([value], None):
                carrying.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        if len(carrying) == before:
            break
    called, helping = set(), set()
    for node in ast.walk(tree):
        name = callee(node)
        if name is not None:
            called.add(name)
            if answers(node.args + [k.value for k in node.keywords], name):
                helping.add(name)
        if isinstance(node, ast.Compare):
            operands = [node.left] + node.comparators
            for i, operand in enumerate(operands):
                name = callee(operand)
                if name is not None and answers(operands[:i] + operands[i + 1 :], name):
                    helping.add(name)
    return called, helping


def helper_names() -> frozenset:
    global _helper_names
    if _helper_names is None:
        names = set(HELPER_ALIASES)
        for module in HELPER_MODULES:
            names.update(n for n in dir(importlib.import_module(module)) if not n.startswith("_"))
        _helper_names = frozenset(names)
    return _helper_names


def entry_points(tests: list, setup: str, declared: list) -> tuple:
    """(entry points, free names): which names the tests take from the program, and every name they read without
    binding it. A pure function of the row (never of the program: a program cannot make itself an answer)."""
    builtin_names = set(dir(builtins)) | set(SITE_BUILTINS)
    stdlib = set(getattr(sys, "stdlib_module_names", ()))
    setup_reads, bound = _names(setup) if setup else (set(), set())
    per_test = []
    for test in tests:
        reads, binds = _names(test)
        per_test.append(reads)
        bound |= binds
    free_per_test = [reads - bound for reads in per_test]
    free = set().union(*free_per_test, setup_reads - bound) if per_test else setup_reads - bound
    special = builtin_names | stdlib | helper_names()
    regular = {n for n in free if n not in special}
    # a library's name the tests call as a task (`trace(m) == 5`, `sqrt(16) == 4`) and never import is the
    # program's; one that wraps or is compared with another call (`isclose(area(1), 3.14)`, `count('') ==
    # Counter()`) is a helper the test expects from Python
    called, helping = set(), set()
    for test in tests:
        c, h = _calls(test, builtin_names)
        called |= c
        helping |= h
    regular |= {n for n in free & called if n in special and n not in builtin_names and n not in helping}
    if declared or regular:
        return regular | set(declared), free
    helpers = {n for n in free if n not in builtin_names and n not in stdlib}
    if helpers:
        return helpers, free
    using = [f for f in free_per_test if f]
    return (set.intersection(*using) if using else set()), free


def plan_names(tests: list, setup: str, declared: list) -> dict:
    """What the checker needs to know of a row's tests before any runs: the names only (never the tests' text)."""
    entries, free = entry_points(tests, setup, declared)
    return {"entries": sorted(entries), "free": sorted(free), "n": len(tests)}


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


def _signature(body):
    """inspect.Signature from the program's plain description (program.signature_of)."""
    import inspect

    empty = inspect.Parameter.empty
    try:
        parameters, returns = body
        return inspect.Signature(
            [
                inspect.Parameter(
                    p_name,
                    type(inspect.Parameter.POSITIONAL_ONLY)(kind),
                    default=default[0] if default else empty,
                    annotation=annotation[0] if annotation else empty,
                )
                for p_name, kind, default, annotation in parameters
            ],
            return_annotation=returns[0] if returns else empty,
        )
    except (TypeError, ValueError):
        raise ValueError("the program's object has no signature Python could give") from None


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


def _one_test(i: int, namespace: dict, link: Link, contained: bool, fds: dict, entries: set = frozenset()) -> bytes:
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
