"""What a test gets of the program's answers, in the checker's process (C): the answer rule, below. Inert data
unless the program defined its class and the test names that class; the stand-ins (Remote, ProgramObject,
ProgramClass) through which a test reaches the program's objects; the program's exceptions as the checker's own
classes. checker.Link is the line these stand-ins ask on. Standard library only.
"""

from __future__ import annotations

import builtins

from .protocol import BINARY_OPERATORS, COMPARISON_OPERATORS, UNARY_OPERATORS, builtin_name


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
