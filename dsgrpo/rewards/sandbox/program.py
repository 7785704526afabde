"""The program side (P): the completion's code runs here, contained, and then only answers questions.

For test snippets P runs the code, sends the names it defined, and answers one request at a time ("call add(1, 2)",
"len of that object"): plain data back (protocol.py). An object of the program's own class stays here as a handle,
described by the exported names of the classes it is an instance of and, where it has one, its data view (a
dataclass's fields, a str subclass's str): the checker decides what the test gets (answers.py's answer rule). A
mutable container that crossed is shared with the test for as long as the program holds it (sharing.py's shared
containers): the state each side changes travels at each call, so both hold one object as in Python. A test's own
callable arrives as a Callback, and any other object of the test's that is not plain data as a TestObject: using it
asks the checker to do it (the test's code, on the test's own object, in the test's process) and waits for the
plain answer, serving the checker's questions meanwhile. The random generator the test shares with the program
travels with each call and back, as do the test's decimal context and recursion limit to the program. For a
stdin/stdout case P runs the code as a script, with the builtins site gives a plain `python` (`exit()`). Nothing P
says is believed: the checker compares, in a process P cannot see. Standard library only.
"""

from __future__ import annotations

import builtins
import collections
import operator
import os
import sys

from .protocol import (
    COMPARISON_OPERATORS,
    OPERATORS,
    Memo,
    data_view,
    decode,
    encode,
    frame,
    mark_interned_strings,
    read_frame,
    write_all,
)
from .sharing import (
    apply_interpreter_state,
    children,
    encode_state,
    interpreter_state,
    snapshot,
    unchanged,
    update_in_place,
)

EXPORTED_VALUE_NODES, MAX_EXPORTS = 10_000, 10_000
# Objects the program imported from these modules are reported by name, so that the checker can use its own copy
# (never the program's object) when a test uses that name (names.py's rules).
LIBRARY_MODULES = (
    "math",
    "cmath",
    "collections",
    "itertools",
    "functools",
    "operator",
    "heapq",
    "bisect",
    "string",
    "re",
    "fractions",
    "decimal",
    "statistics",
    "typing",
    "random",
    "copy",
    "json",
    "datetime",
    "array",
    "numbers",
    "dataclasses",
    "enum",
)


_NOTHING = object()


class _Quitter:
    """`exit` and `quit` as the site module gives them to a plain `python` (the sandbox runs without site)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"Use {self.name}() or Ctrl-D (i.e. EOF) to exit"

    def __call__(self, code=None):
        try:  # as site's Quitter: stdin is closed first
            sys.stdin.close()
        except BaseException:
            pass
        raise SystemExit(code)


class _Printer:
    """`copyright`, `credits` and `license`: print their text when called, as site's do."""

    def __init__(self, name: str, text: str):
        self.name, self.text = name, text

    def __repr__(self):
        return self.text

    def __call__(self):
        print(self.text)


class _Helper:
    """`help`: pydoc's, as site's is."""

    def __repr__(self):
        return "Type help() for interactive help, or help(object) for help about object."

    def __call__(self, *args, **kwargs):
        import pydoc

        return pydoc.help(*args, **kwargs)


SITE_BUILTINS = ("exit", "quit", "help", "copyright", "credits", "license")


def install_site_builtins() -> None:
    """The builtins the site module adds to a plain `python`: programs end with `exit()` as a matter of habit."""
    builtins.exit, builtins.quit = _Quitter("exit"), _Quitter("quit")
    builtins.help = _Helper()
    builtins.copyright = _Printer("copyright", sys.copyright)
    builtins.credits = _Printer(
        "credits",
        "Thanks to CWI, CNRI, BeOpen, Zope Corporation, the Python Software "
        "Foundation, and a cast of thousands for supporting Python development.",
    )
    builtins.license = _Printer("license", "See https://www.python.org/psf/license/")


def _library_module(name: str, value):
    """The library module `value` is the attribute `name` of, if the program imported it from one."""
    for module in LIBRARY_MODULES:
        loaded = sys.modules.get(module)
        if loaded is not None and getattr(loaded, name, _NOTHING) is value:  # (None is a value: `pow = None`)
            return module
    return None


def exception_chain(cls) -> list:
    """The names of an exception class and its bases up to the first of Python's own (which ends the list)."""
    chain = []
    for c in cls.__mro__:
        chain.append(c.__name__)
        if c.__module__ == "builtins":
            break
    return chain


def _describe_class(cls):
    """How the checker rebuilds a class of the program's that a test names: enums and namedtuples as data classes,
    exceptions as local exception classes, any other class as a class of handles (answers.program_class)."""
    import enum

    from .protocol import enum_class, namedtuple_class

    if issubclass(cls, enum.Enum) and cls.__members__:
        member = encode(next(iter(cls.__members__.values())))
        if "enum" in member:
            enum_class(member["enum"][0])
            return {"enum_class": member["enum"][0]}
    if issubclass(cls, BaseException):
        return {"exception_class": exception_chain(cls)}
    fields = getattr(cls, "_fields", None)
    if cls.__bases__ == (tuple,) and type(fields) is tuple and hasattr(cls, "_make"):
        defaults = [encode(cls._field_defaults[f]) for f in fields if f in cls._field_defaults]
        try:
            namedtuple_class(cls.__name__, list(fields), defaults)
            # methods and properties of its own (a typing.NamedTuple with a body): they run here when the test
            # calls them (checker._namedtuple_methods)
            methods = [
                [name, "property" if isinstance(value, property) else "method"]
                for name, value in vars(cls).items()
                if not name.startswith("_") and name not in fields and (callable(value) or isinstance(value, property))
            ]
            return {"namedtuple_class": [cls.__name__, list(fields), defaults] + ([methods] if methods else [])}
        except (TypeError, ValueError):
            pass
    return {"class": [cls.__name__, []]}  # its bases' names follow once every class has its name (exports)


def exports(namespace: dict, class_names: dict) -> dict:
    """What the program defined, as the checker will see it: modules by name, objects imported from a library
    module by that module's name, plain values copied, classes described, the rest as names to ask about.
    `class_names` receives id(class) -> name for the classes exported (the names handles are described by)."""
    import types

    out = {}
    for name, value in list(namespace.items()):
        if name.startswith("__"):
            continue
        library = None if isinstance(value, types.ModuleType) else _library_module(name, value)
        if isinstance(value, types.ModuleType):
            out[name] = {"module": str(getattr(value, "__name__", ""))}
        elif library is not None:
            out[name] = {"library": library}
        elif isinstance(value, type):
            try:
                out[name] = _describe_class(value)
            except Exception:
                out[name] = {"class": [name, []]}
            class_names.setdefault(id(value), (name, value))
        else:
            try:
                out[name] = {"value": encode(value, budget=[EXPORTED_VALUE_NODES])}
            except Exception:  # not plain data, or too large to copy: the checker reaches it by name
                out[name] = {"object": True}
        if len(out) >= MAX_EXPORTS:
            break
    for name, entry in out.items():  # a class's bases among the exported classes (issubclass(Square, Shape))
        if "class" in entry:
            cls = namespace[name]
            entry["class"][1] = [class_names[id(b)][0] for b in cls.__bases__ if id(b) in class_names]
    return out


class Callback:
    """A callable of the test's: calling it asks the checker to run it with plain arguments."""

    def __init__(self, server, ident):
        self._server, self._ident = server, ident

    def __call__(self, *args, **kwargs):
        return self._server.callback(self._ident, "call", list(args), kwargs)


class CallbackIterator(Callback):
    """An iterator of the test's (a generator it passed): each item is asked of the checker."""

    def __iter__(self):
        return self

    def __next__(self):
        return self._server.callback(self._ident, "next", [], {})


class TestObject:
    """An object of the test's that is not plain data (a ListNode its setup built, a compiled regex, an io.StringIO,
    an array): it stays in the test's process and this stand-in asks for each use of it, so the program reads and
    changes the test's own object, as in Python (checker.TEST_OPERATIONS says what may be asked). One stand-in per
    object: identity holds (`head.next is node`), and an object whose class keeps Python's default equality and
    hash is compared and hashed here, by that identity (`node in seen`), without asking.

    An object whose attributes are plain instance attributes (its class keeps Python's own attribute access: a
    ListNode, a TreeNode) is read a whole object at a time: the first read of one of its attributes asks for all of
    them, and further reads are answered here until control goes back to the test (Server.slice). Its attribute
    writes wait here, applied in their order before the test runs again (Server.flush). Each node of a linked list
    then costs one question instead of three."""

    __slots__ = ("_t_server", "_t_ident", "_t_plain", "_t_attrs", "_t_cache", "_t_slice")

    def __init__(self, server, ident, plain: bool, attrs: bool = False):
        object.__setattr__(self, "_t_server", server)
        object.__setattr__(self, "_t_ident", ident)
        object.__setattr__(self, "_t_plain", plain)  # default equality, hash and truth (no __bool__, no __len__)
        object.__setattr__(self, "_t_attrs", attrs)  # plain instance attributes: read whole, written back
        object.__setattr__(self, "_t_cache", None)
        object.__setattr__(self, "_t_slice", -1)

    def _t(self, how, *args):
        return self._t_server.callback(self._t_ident, how, list(args), {})

    def _t_vars(self) -> dict:
        """Its instance attributes as the test's process has them, read once per slice of the program's time."""
        server = self._t_server
        if self._t_slice != server.slice:
            # its attributes and those of the plain objects it leads to (a list's next nodes, a tree's children),
            # as many as one answer holds: a walk over a linked list asks once per few hundred nodes
            for standin, found in self._t("vars") or ():
                if type(standin) is TestObject and type(found) is dict:
                    found.update(server.pending.get(id(standin), ()))  # its own writes not yet applied there
                    object.__setattr__(standin, "_t_cache", found)
                    object.__setattr__(standin, "_t_slice", server.slice)
            if self._t_slice != server.slice:
                object.__setattr__(self, "_t_cache", dict(server.pending.get(id(self), ())))
                object.__setattr__(self, "_t_slice", server.slice)
        return self._t_cache

    def __getattr__(self, name):
        if name.startswith("_t_"):
            raise AttributeError(name)
        if self._t_attrs:
            found = self._t_vars()
            if name in found:
                return found[name]
        return self._t("getattr", name)

    def __setattr__(self, name, value):
        if not self._t_attrs:
            return self._t("setattr", name, value)
        server = self._t_server
        server.dirty.append((self, name, value))
        server.pending.setdefault(id(self), {})[name] = value
        if self._t_slice == server.slice:
            self._t_cache[name] = value

    def __delattr__(self, name):
        object.__setattr__(self, "_t_slice", -1)
        self._t("delattr", name)

    def __getitem__(self, key):
        return self._t("getitem", key)

    def __setitem__(self, key, value):
        self._t("setitem", key, value)

    def __delitem__(self, key):
        self._t("delitem", key)

    def __len__(self):
        return self._t("len")

    def __iter__(self):
        return self._t("iter")

    def __next__(self):
        return self._t("next")

    def __contains__(self, item):
        return self._t("contains", item)

    def __bool__(self):
        return True if self._t_plain else self._t("bool")

    def __str__(self):
        return self._t("str")

    def __repr__(self):
        return self._t("repr")

    def __call__(self, *args, **kwargs):
        return self._t_server.callback(self._t_ident, "call", list(args), kwargs)

    def __hash__(self):
        return object.__hash__(self) if self._t_plain else self._t("hash")


def _test_comparison(op):
    def compare(self, other):
        if self._t_plain and op in ("eq", "ne"):
            return (self is other) == (op == "eq")
        return self._t(op, other)

    return compare


for _op in COMPARISON_OPERATORS:
    setattr(TestObject, f"__{_op}__", _test_comparison(_op))


class TestClass(type):
    """The stand-in of a class of the test's (a ListNode its setup defines): calling it builds the object in the
    test's process, isinstance asks there, its class attributes are read there."""

    def __call__(cls, *args, **kwargs):
        return cls._t_server.callback(cls._t_ident, "call", list(args), kwargs)

    def __instancecheck__(cls, obj):
        return isinstance(obj, TestObject) and cls._t_server.callback(cls._t_ident, "isinstance", [obj], {}) is True

    def __getattr__(cls, name):
        if name.startswith("_t_") or name.startswith("__"):
            raise AttributeError(name)
        return cls._t_server.callback(cls._t_ident, "getattr", [name], {})


def test_class(server, ident, name: str) -> type:
    return TestClass(name, (), {"__slots__": (), "_t_server": server, "_t_ident": ident, "__module__": "__main__"})


class Server:
    """The program's side of the link: one request at a time, re-entered while a callback of the test's runs."""

    def __init__(self, namespace: dict, requests: int, replies: int, class_names: dict):
        self.namespace, self.requests, self.replies, self.class_names = namespace, requests, replies, class_names
        self.handles: list = []
        self.test_objects: dict = {}  # the stand-ins of the test's objects (TestObject, TestClass), by their ident
        self.memo, self.epoch = Memo(), None  # the containers shared with the test now running
        self.synced = None  # the shared interpreter state (sharing.interpreter_state) as the checker last saw it
        # the program's time comes in slices, from a question of the checker's (or the end of a callback) to the
        # answer (or the next callback that may run the test's code): what a stand-in read of the test's objects
        # holds within one slice, and its attribute writes wait for the slice's end (TestObject)
        self.slice = 0
        self.dirty: list = []  # (stand-in, name, value) in the order written
        self.pending: dict = {}  # id(stand-in) -> {name: value}: the same writes, by object

    def send(self, obj) -> None:
        write_all(self.replies, frame(obj))

    def reply(self, obj) -> None:
        """An answer to the checker: the test's code may run once it has it."""
        self.flush()
        self.slice += 1
        self.send(obj)

    def flush(self) -> None:
        """The attribute writes waiting on the test's objects, applied in the test's process in their order."""
        if self.dirty:
            writes, self.dirty, self.pending = self.dirty, [], {}
            first = object.__getattribute__(writes[0][0], "_t_ident")
            self.callback(first, "setattrs", [[[target, name, value] for target, name, value in writes]], {})

    def handle_of(self, obj):
        ident = self.test_ident(obj)
        if ident is not None:  # one of the test's own objects, going home: the test gets its own object back
            return {"test": ident}
        classes = [self.class_names[id(c)][0] for c in type(obj).__mro__ if id(c) in self.class_names]
        try:
            view = data_view(obj, self.handle_of)
        except (TypeError, ValueError, RecursionError):
            view = None
        if view is not None and not classes:
            return view
        self.handles.append(obj)
        return {"handle": [len(self.handles) - 1, classes, view]}

    def resolve(self, tag, body):
        if tag == "handle" and type(body) is int and 0 <= body < len(self.handles):
            return self.handles[body]
        if tag == "handle" and type(body) is dict and type(body.get("name")) is str and body["name"] in self.namespace:
            return self.namespace[body["name"]]  # one of its own names the test passes back (apply(double, 3))
        if (
            tag == "callback"
            and type(body) is list
            and len(body) == 3
            and body[1] in ("call", "iter", "object", "class")
        ):
            key = repr(body[0])
            made = self.test_objects.get(key)
            if made is None:
                kind, info = body[1], body[2]
                if kind == "class":
                    made = test_class(self, body[0], str(info) if str(info).isidentifier() else "TestClass")
                elif kind == "object":  # info: [default equality/hash/truth, plain instance attributes]
                    plain, attrs = info if type(info) is list and len(info) == 2 else (False, False)
                    made = TestObject(self, body[0], plain is True, attrs is True)
                else:
                    made = (CallbackIterator if kind == "iter" else Callback)(self, body[0])
                self.test_objects[key] = made
            return made
        raise ValueError("a malformed reference")

    def test_ident(self, obj):
        """The checker's ident of one of the test's objects (its stand-in here), else None."""
        if type(obj) is TestObject:
            return object.__getattribute__(obj, "_t_ident")
        if type(obj) in (Callback, CallbackIterator):
            return obj._ident
        if type(type(obj)) is TestClass:
            return type.__getattribute__(obj, "_t_ident")
        return None

    def serve(self) -> None:
        while True:
            try:
                request = read_frame(self.requests)
            except (EOFError, OSError, ValueError):
                os._exit(0)
            self.reply(self.answer(request))

    def take_state(self, message) -> None:
        """The test's interpreter state (random, decimal, recursion limit), before the program runs for it."""
        if type(message) is dict and "state" in message:
            try:
                apply_interpreter_state(message["state"])
            except ValueError:
                pass
            self.synced = interpreter_state(test_side=False)

    def give_state(self) -> None:
        """The program's random and decimal state back to the test when the program changed it."""
        now = interpreter_state(test_side=False)
        if now != self.synced:
            self.send({"state": now})
            self.synced = now

    def answer(self, request) -> dict:
        try:
            if type(request) is dict and request.get("op") == "call":
                return self.call(request)
            return {"ok": encode(self.operate(request), self.handle_of)}
        except BaseException as exc:  # the program's own exception, reported by name
            try:
                return {"raise": [type(exc).__name__, str(exc)[:300], exception_chain(type(exc))]}
            except BaseException:
                return {"raise": ["Exception", "", ["Exception"]]}

    def shared(self, epoch) -> Memo:
        """The containers shared with the test now running (sharing.py): a new test, a new Memo."""
        if epoch != self.epoch:
            self.memo, self.epoch = Memo(), epoch
        return self.memo

    def call(self, request) -> dict:
        """Call the program: the shared containers the test changed take their new state, the arguments arrive
        (their containers shared from now on), and the answer carries the program's result, the state of every
        shared container the call changed, and the numbers of those the program no longer holds. The test's
        interpreter state arrives with it and the program's goes back (sharing.py), whether the call returns or
        raises."""
        self.take_state(request)
        try:
            return self._call(request)
        finally:
            self.give_state()

    def _call(self, request) -> dict:
        memo = self.shared(request.get("epoch"))
        memo.receiving, memo.sending = True, False
        for k, body in request.get("sync", []):
            if type(k) is int and 0 <= k < len(memo.objects) and memo.objects[k] is not None:
                update_in_place(memo.objects[k], decode(body, self.resolve, memo))
        args = decode(request["args"], self.resolve, memo)
        kwargs = decode(request["kwargs"], self.resolve, memo)
        memo.receiving = False
        live = memo.live()
        before = {k: snapshot(memo.objects[k]) for k in live}
        result = self.target(request)(*args, **kwargs)
        del args, kwargs  # (unkept counts the references left: none of this frame's may be among them)
        memo.sending = True  # a container the answer holds twice arrives as one (`[row] * n`, aliasing kept)
        after = [[k, encode_state(memo, k, self.handle_of)] for k in live if not unchanged(before[k], memo.objects[k])]
        del before
        encoded = encode(result, self.handle_of, None, memo)
        del result
        return {"okm": [encoded, after, self.unkept(memo)]}

    def unkept(self, memo: Memo) -> list:
        """Drop the shared containers the program no longer holds (no reference left to one but the Memo's and
        those of other shared containers), unless a container it holds holds them; their numbers."""
        live = memo.live()
        inside = collections.Counter()
        for k in live:
            for child in children(memo.objects[k]):
                j = memo.ids.get(id(child))
                if j is not None:
                    inside[j] += 1
        # sys.getrefcount: the Memo's list and getrefcount's own argument, then the references of the program's
        kept = {k for k in live if sys.getrefcount(memo.objects[k]) - 2 > inside[k]}
        reach = list(kept)
        while reach:
            for child in children(memo.objects[reach.pop()]):
                j = memo.ids.get(id(child))
                if j is not None and j not in kept:
                    kept.add(j)
                    reach.append(j)
        dropped = [k for k in live if k not in kept]
        for k in dropped:
            memo.drop(k)
        return dropped

    def target(self, request):
        ref = request["target"]
        if ref is None:
            return None
        if "method" in ref:  # a method of a namedtuple class of the program's, on an instance made of these fields
            class_name, fields, method = ref["method"]
            return getattr(self.namespace[class_name](*decode(fields, self.resolve)), method)
        return self.namespace[ref["name"]] if "name" in ref else self.resolve("handle", ref["handle"])

    def operate(self, request):
        target, op = self.target(request), request["op"]
        if op == "ping":
            return True
        if op == "bind":  # the classes the row's setup defines: globals of the program's too
            for name, value in decode(request["names"], self.resolve).items():
                if type(name) is str and name.isidentifier():
                    self.namespace[name] = value
            return None
        if op == "value":  # a module-level value of the program's, as it is now
            return target
        if op == "signature":
            return signature_of(target)
        if op == "getattr":
            return getattr(target, request["name"])
        if op == "setattr":
            return setattr(target, request["name"], decode(request["value"], self.resolve))
        if op == "getitem":
            return target[decode(request["key"], self.resolve)]
        if op == "setitem":
            target[decode(request["key"], self.resolve)] = decode(request["value"], self.resolve)
            return None
        if op == "delitem":
            del target[decode(request["key"], self.resolve)]
            return None
        if op == "len":
            return len(target)
        if op == "bool":
            return bool(target)
        if op == "str":
            return str(target)
        if op == "repr":
            return repr(target)
        if op == "hash":
            return hash(target)
        if op == "iter":
            return iter(target)
        if op == "next":
            return next(target)
        if op == "operator" and request["name"] in OPERATORS:
            args = decode(request["args"], self.resolve)
            return getattr(operator, request["name"])(*args)
        raise ValueError(f"unknown operation {op!r}")

    def callback(self, ident, how: str, args: list, kwargs: dict):
        """Run a callable of the test's in the checker: ask, then serve the checker's questions until it answers.
        A use that may run the test's code ends the slice (what stand-ins read may have changed); reading or writing
        plain attributes does not."""
        pure = how in ("vars", "setattrs")  # plain attributes read or written: no code of the test's runs
        if not pure:  # reading one object's attributes needs no writes of others applied
            self.flush()
            self.give_state()
        self.send({"callback": [ident, how, encode(args, self.handle_of), encode(kwargs, self.handle_of)]})
        try:
            return self._callback_answer()
        finally:
            if not pure:
                self.slice += 1

    def _callback_answer(self):
        while True:
            try:
                message = read_frame(self.requests)
            except (EOFError, OSError, ValueError):
                os._exit(0)
            if type(message) is dict and message.get("op") == "return":
                self.take_state(message)
                if "raise" in message:
                    name = message["raise"]
                    cls = getattr(builtins, name, None) if type(name) is str else None
                    if isinstance(cls, type) and issubclass(cls, Exception):
                        raise cls("raised by the test's callable")
                    raise RuntimeError(f"the test's callable raised {name}")
                return decode(message["value"], self.resolve)
            self.reply(self.answer(message))


def signature_of(target) -> list:
    """inspect.signature(target) as plain data: [[name, kind, [default] or [], [annotation] or []], ...] and
    [return annotation] or [] (answers._signature rebuilds it)."""
    import inspect

    signature = inspect.signature(target)
    empty = inspect.Parameter.empty
    return [
        [
            [
                p.name,
                int(p.kind),
                [] if p.default is empty else [p.default],
                [] if p.annotation is empty else [p.annotation],
            ]
            for p in signature.parameters.values()
        ],
        [] if signature.return_annotation is empty else [signature.return_annotation],
    ]


def serve(code: str, requests: int, replies: int) -> None:
    """After containment: the completion's code, then one answer per request until the checker hangs up."""
    install_site_builtins()
    mark_interned_strings()
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    class_names: dict = {}
    try:
        exec(compile(code, "solution.py", "exec"), namespace)
        ready = {"ready": exports(namespace, class_names)}
    except BaseException:  # the program failed: nothing it defined counts
        ready = {"ready": None}
    server = Server(namespace, requests, replies, class_names)
    server.reply(ready)
    if ready["ready"] is None:
        os._exit(0)
    server.serve()


def run_script(code: str) -> None:
    """For a stdin/stdout case: the completion as a script."""
    install_site_builtins()
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(code, "solution.py", "exec"), namespace)
    except SystemExit as exc:
        status = exc.code
        _flush()
        os._exit(0 if status is None or status == 0 else 1)
    except BaseException:
        _flush()
        os._exit(1)
    _flush()
    os._exit(0)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
