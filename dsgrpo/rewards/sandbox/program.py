"""The program side (P): the completion's code runs here, contained, and then only answers questions.

For test snippets P runs the code, sends the names it defined, and answers one request at a time ("call add(1, 2)",
"len of that object"): plain data back (protocol.py), anything else kept here as an opaque handle. For a
stdin/stdout case P runs the code as a script. Nothing P says is believed: the checker compares, in a process P
cannot see. Standard library only.
"""

from __future__ import annotations

import builtins
import os
import sys

from .protocol import decode, encode, frame, read_frame, write_all

EXPORTED_VALUE_NODES, MAX_EXPORTS = 10_000, 10_000
# Objects the program imported from these modules are reported by name, so that the checker can use its own copy
# (never the program's object) when a test uses that name (checker.py's name rules).
LIBRARY_MODULES = ("math", "cmath", "collections", "itertools", "functools", "operator", "heapq", "bisect",
                   "string", "re", "fractions", "decimal", "statistics", "typing", "random", "copy", "json",
                   "datetime", "array", "numbers", "dataclasses", "enum")


def _library_module(name: str, value):
    """The library module `value` is the attribute `name` of, if the program imported it from one."""
    for module in LIBRARY_MODULES:
        loaded = sys.modules.get(module)
        if loaded is not None and getattr(loaded, name, None) is value:
            return module
    return None


def exports(namespace: dict) -> dict:
    """What the program defined, as the checker will see it: modules by name, objects imported from a library
    module by that module's name, plain values copied, the rest as names to ask about."""
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
        else:
            try:
                out[name] = {"value": encode(value, budget=[EXPORTED_VALUE_NODES])}
            except Exception:  # not plain data, or too large to copy: the checker reaches it by name
                out[name] = {"object": True}
        if len(out) >= MAX_EXPORTS:
            break
    return out


def serve(code: str, requests: int, replies: int) -> None:
    """After containment: the completion's code, then one answer per request until the checker hangs up."""
    handles: list = []
    namespace = {"__name__": "__main__", "__builtins__": builtins}

    def handle_of(obj) -> int:
        handles.append(obj)
        return len(handles) - 1

    def reply(obj) -> None:
        write_all(replies, frame(obj))

    try:
        exec(compile(code, "solution.py", "exec"), namespace)
        ready = {"ready": exports(namespace)}
    except BaseException:  # the program failed: nothing it defined counts
        ready = {"ready": None}
    reply(ready)
    if ready["ready"] is None:
        os._exit(0)
    resolve = handles.__getitem__
    while True:
        try:
            request = read_frame(requests)
        except (EOFError, OSError, ValueError):
            os._exit(0)
        try:
            answer = {"ok": encode(_answer(request, namespace, resolve), handle_of)}
        except BaseException as exc:  # the program's own exception, reported by name
            try:
                answer = {"raise": [type(exc).__name__, str(exc)[:300]]}
            except BaseException:
                answer = {"raise": ["Exception", ""]}
        try:
            reply(answer)
        except (TypeError, ValueError, RecursionError):
            reply({"raise": ["ValueError", "an answer that cannot be encoded"]})


def _answer(request: dict, namespace: dict, resolve):
    ref = request["target"]
    target = None if ref is None else namespace[ref["name"]] if "name" in ref else resolve(ref["handle"])
    op = request["op"]
    if op == "ping":
        return True
    if op == "call":
        return target(*decode(request["args"], resolve), **decode(request["kwargs"], resolve))
    if op == "getattr":
        return getattr(target, request["name"])
    if op == "getitem":
        return target[decode(request["key"], resolve)]
    if op == "len":
        return len(target)
    if op == "bool":
        return bool(target)
    if op == "str":
        return str(target)
    if op == "iter":
        return iter(target)
    if op == "next":
        return next(target)
    raise ValueError(f"unknown operation {op!r}")


def run_script(code: str) -> None:
    """For a stdin/stdout case: the completion as a script."""
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
