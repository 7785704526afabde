"""The checker side (C): the tests run here, contained as the program is, one child process per test.

A test snippet is the dataset's code, but what it does with an answer is the program's to choose: a test that
`eval`s a returned string or `pickle.loads` returned bytes runs the program's code right here. So the checker is
contained like the program (checker.py's cell: containment.py) and every test runs in a fresh child forked from a
namespace no test has touched, which may not create processes: code reached through one test's answers can at
most decide that test's own verdict (which such a test hands to the program anyway) — never another test's, never
the count, never anything outside the sandbox. The checker itself runs only this file's code and the decoding of
answers (protocol.py), never a test.

Which names a test sees (the program must not answer for a name the test expects from elsewhere):
- Python's builtins, the row's setup code (run in each test's process), and names the tests bind themselves;
- the program's *entry points*: the row's `entry_point` when it has one, plus every name the tests use that is
  neither a builtin nor a standard-library module nor a helper name (a public name of HELPER_MODULES: `isclose`,
  `Counter`, `pi`, ...; or `np` and the like). When the tests use no other name, the helper names they use are
  the entry points (a task named `gcd`), and failing those, the builtin names every test uses (a task named `pow`);
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
import signal
import sys

from .limits import install_seccomp
from .program import LIBRARY_MODULES
from .protocol import ProtocolError, decode, encode, frame, read_frame, read_untrusted_frame, write_all


class RemoteError(Exception):
    """An exception of the program's whose type is not one of Python's builtin exceptions."""


class Remote:
    """A value that stayed inside the program: calls, attributes, items, len, bool, str, iteration go to the
    program; equality, hashing and ordering stay here (identity), so an object cannot claim to equal the answer."""

    __slots__ = ("_sbx_link", "_sbx_ref")

    def __init__(self, link, ref: dict):
        object.__setattr__(self, "_sbx_link", link)
        object.__setattr__(self, "_sbx_ref", ref)

    def __call__(self, *args, **kwargs):
        return self._sbx_link.ask("call", self._sbx_ref, args=list(args), kwargs=kwargs)

    def __getattr__(self, name):
        if name.startswith("_sbx_"):
            raise AttributeError(name)
        return self._sbx_link.ask("getattr", self._sbx_ref, name=name)

    def __getitem__(self, key):
        return self._sbx_link.ask("getitem", self._sbx_ref, key=key)

    def __len__(self):
        n = self._sbx_link.ask("len", self._sbx_ref)
        if type(n) is not int or n < 0:
            raise TypeError("len() of the program's object is not a non-negative int")
        return n

    def __bool__(self):
        b = self._sbx_link.ask("bool", self._sbx_ref)
        if type(b) is not bool:
            raise TypeError("bool() of the program's object is not a bool")
        return b

    def __str__(self):
        s = self._sbx_link.ask("str", self._sbx_ref)
        if type(s) is not str:
            raise TypeError("str() of the program's object is not a str")
        return s

    def __repr__(self):
        return "<an object of the program under test>"

    def __iter__(self):
        it = self._sbx_link.ask("iter", self._sbx_ref)
        return it if type(it) is Remote else iter(it)

    def __next__(self):
        return self._sbx_link.ask("next", self._sbx_ref)

    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__


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


class Link:
    """Questions to the program over two pipes, blocking (the supervisor owns the deadline). Forked into each test's
    process; every read is byte-exact, so the processes stay in step on the shared pipes."""

    def __init__(self, requests: int, replies: int, message_bytes: int):
        self.requests, self.replies, self.message_bytes = requests, replies, message_bytes
        self.broken = None

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

    def ask(self, op: str, ref, **fields):
        if self.broken:
            raise ProtocolError(self.broken)
        request = {"op": op, "target": ref}
        for key, value in fields.items():
            if key == "kwargs":
                if not all(type(k) is str for k in value):
                    raise TypeError("keyword names must be strings")
                request[key] = encode(dict(value), handle_of=_handle_of)
            elif key == "name":
                request[key] = str(value)
            else:
                request[key] = encode(value, handle_of=_handle_of)
        try:
            write_all(self.requests, frame(request))
        except OSError:
            self.fail("exiting")
        message = self.receive()
        if "ok" in message:
            try:
                return decode(message["ok"], self.ref)
            except (ValueError, TypeError, RecursionError, OverflowError, MemoryError):
                self.fail("a malformed answer")
        if "raise" in message:
            raise self._exception(op, message["raise"])
        self.fail("a malformed answer")

    def ref(self, handle: int) -> Remote:
        return Remote(self, {"handle": handle})

    def _exception(self, op: str, body) -> BaseException:
        if not (type(body) is list and len(body) == 2 and all(type(x) is str for x in body)):
            self.fail("a malformed answer")
        name, text = body
        if name in _ITERATION_ENDS:
            # only `next` ends an iteration; anywhere else it would end the test's own loop early (a map() over
            # the cases, a generator expression), so it arrives as an error, as PEP 479 does for generators
            if op == "next" and name == "StopIteration":
                return StopIteration()
            return RuntimeError(f"the program raised {name}")
        cls = getattr(builtins, name, None)
        if name not in _UNMAPPED and isinstance(cls, type) and issubclass(cls, Exception):
            try:
                return cls(text)
            except Exception:
                pass
        return RemoteError(f"{name}: {text}")


def _handle_of(obj):
    if type(obj) is Remote and "handle" in obj._sbx_ref:
        return obj._sbx_ref["handle"]
    raise TypeError(f"a {type(obj).__name__} cannot be passed to the program under test (plain data only)")


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
    builtin_names = set(dir(builtins))
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
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    builtin_names = set(dir(builtins))
    stdlib = set(getattr(sys, "stdlib_module_names", ()))
    for name in free | entries:
        entry = exported.get(name)
        if entry is not None and not (type(entry) is dict and len(entry) == 1):
            link.fail("a malformed answer")
        (kind, body), = entry.items() if entry is not None else ((None, None),)
        if kind not in (None, "module", "library", "value", "object"):
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
        elif kind == "object":
            value = Remote(link, {"name": name})
        else:
            value = Missing(name) if name in builtin_names else None
        if value is not None:
            namespace[name] = value
    return namespace


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
                outcome = _one_test(i, namespace, link, contained, fds)
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


def _one_test(i: int, namespace: dict, link: Link, contained: bool, fds: dict) -> bytes:
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
