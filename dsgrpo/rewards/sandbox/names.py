"""Which names a test takes from the program: a pure function of the row (its tests, its setup, the entry points it
declares), never of the program, so a program cannot make itself an answer. The supervisor plans a row's names with
it before any test runs (plan_names); the rule itself is stated in checker.py's docstring. Standard library only.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import sys

from .program import SITE_BUILTINS


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
