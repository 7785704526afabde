"""The package's imports form no circle, counting those inside functions (a late import is still a dependency: a
newcomer reads the modules bottom-up only if no module needs one above it), the configuration imports nothing
of the trainer's, and trainer.py stays the story of a step."""

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dsgrpo")


def module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def imports_of(path: str, name: str) -> set:
    """Every dsgrpo module `path` imports, at module level or inside a function."""
    tree = ast.parse(open(path).read())
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = set()
    for sub in ast.walk(tree):
        if isinstance(sub, ast.ImportFrom):
            if sub.level:
                base = package.rsplit(".", sub.level - 1)[0] if sub.level > 1 else package
                target = f"{base}.{sub.module}" if sub.module else base
            else:
                target = sub.module or ""
            if target.startswith("dsgrpo"):
                found.add(target)
                found.update(f"{target}.{a.name}" for a in sub.names)
        elif isinstance(sub, ast.Import):
            found.update(a.name for a in sub.names if a.name.startswith("dsgrpo"))
    return found


def graph() -> dict:
    files = {}
    for folder, _, names in os.walk(ROOT):
        for n in names:
            if n.endswith(".py"):
                path = os.path.join(folder, n)
                files[module_name(path)] = path
    return {name: {t for t in imports_of(path, name) if t in files and t != name} for name, path in files.items()}


def test_imports_form_no_circle():
    edges = graph()
    state, stack, circles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                circles.append(stack[stack.index(t) :] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    # a package's __init__ importing its own modules is not a circle a reader trips on
    circles = [c for c in circles if not all(x.startswith(c[0] + ".") or x == c[0] for x in c)]
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_the_configuration_imports_nothing_above_it():
    """config.py and config_checks.py sit at the bottom of the package, above only modules that import nothing of
    dsgrpo's (compat/'s version fences): a rule they keep lives with them (config_checks imported evaluation.py
    for the 3-line eval_group rule)."""
    edges = graph()
    leaves = {m for m, targets in edges.items() if not targets}
    # and a package that only gathers its own leaves (compat/: a module per library, re-exported)
    allowed = (
        {"dsgrpo.config", "dsgrpo.config_checks"}
        | leaves
        | {m for m, targets in edges.items() if targets and all(t.startswith(m + ".") and t in leaves for t in targets)}
    )
    for name in ("dsgrpo.config", "dsgrpo.config_checks"):
        above = sorted(t for t in edges[name] if t not in allowed)
        assert not above, f"{name} imports {above}"


def test_trainer_py_stays_one_readable_story():
    lines = open(os.path.join(ROOT, "trainer.py")).read().count("\n")
    assert lines <= 600, (
        f"dsgrpo/trainer.py has {lines} lines: move start-up steps to startup.py, TRL accessors to "
        "trl_surface.py, stage work to its module"
    )


def test_what_a_rank_imports_leaves_scikit_learn_out():
    """transformers imports scikit-learn (and scipy under it) at start-up whenever it is installed: 1.6 s of every
    rank's start, every launch, every run. Nothing of dsgrpo's needs it; the Makefile keeps it out of .venv."""
    import sys

    import transformers.generation.candidate_generator  # noqa: F401  (where transformers reaches for it)

    import dsgrpo.trainer  # noqa: F401

    assert "sklearn" not in sys.modules and "scipy" not in sys.modules, (
        "scikit-learn is installed: `make setup` takes it out (pip uninstall scikit-learn scipy sentence-transformers)"
    )
