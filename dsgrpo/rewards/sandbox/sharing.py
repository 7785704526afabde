"""What one interpreter shares between a test and the function it calls, kept in step across the sandbox's
boundary: the interpreter's state (the random generator, the decimal context, the recursion limit) and the mutable
containers that crossed (the same object on both sides for the rest of a test). The checker (checker.Link.call)
and the program (program.Server.call) both keep them with this module. Standard library only.
"""

from __future__ import annotations

import collections
import sys

from .protocol import Memo, _encode


# ---------------------------------------------------------------------------------------------- shared state
# What Python's one interpreter shares between a test and the function it calls, kept in step across the boundary:
# the random module's generator both ways (a test that seeds it, a test that draws after the program did); the
# decimal context and the recursion limit from the test to the program only: a program that lowered the precision
# would otherwise decide the test's own `Decimal(1) / 3` that it compares with, and the checker's stack is not the
# program's to set. Sent when it differs from what both sides last agreed on.
_ROUNDINGS = (
    "ROUND_DOWN",
    "ROUND_HALF_UP",
    "ROUND_HALF_EVEN",
    "ROUND_CEILING",
    "ROUND_FLOOR",
    "ROUND_UP",
    "ROUND_HALF_DOWN",
    "ROUND_05UP",
)
_SIGNALS = (
    "Clamped",
    "DivisionByZero",
    "Inexact",
    "InvalidOperation",
    "Overflow",
    "Rounded",
    "Subnormal",
    "Underflow",
    "FloatOperation",
)
MT_WORDS = 624  # the Mersenne Twister's state: 624 words and an index (random.getstate()[1])


def interpreter_state(test_side: bool = True) -> dict:
    """This process's shared state as plain data (only the modules it has imported): the test's side shares all of
    it, the program's side its random generator."""
    state = {}
    rnd = sys.modules.get("random")
    if rnd is not None:
        version, words, gauss = rnd.getstate()
        state["random"] = [list(words), gauss]
    dec = sys.modules.get("decimal")
    if dec is not None and test_side:
        c = dec.getcontext()
        traps = [name for name in _SIGNALS if c.traps.get(getattr(dec, name), False)]
        state["decimal"] = [c.prec, c.rounding, c.Emin, c.Emax, c.capitals, c.clamp, traps]
    if test_side:
        state["recursion"] = sys.getrecursionlimit()
    return state


def apply_interpreter_state(state, from_test: bool = True) -> None:
    """Take a peer's shared state (validated: ValueError for anything malformed): all of the test's, only the
    random generator of the program's."""
    if type(state) is not dict:
        raise ValueError("a malformed state")
    if "random" in state:
        body = state["random"]
        if not (type(body) is list and len(body) == 2 and type(body[0]) is list and len(body[0]) == MT_WORDS + 1):
            raise ValueError("a malformed random state")
        words, gauss = body
        if not all(type(w) is int and 0 <= w < 1 << 32 for w in words) or words[-1] > MT_WORDS:
            raise ValueError("a malformed random state")
        if gauss is not None and type(gauss) is not float:
            raise ValueError("a malformed random state")
        import random

        random.setstate((3, tuple(words), gauss))
    if "decimal" in state and from_test:
        body = state["decimal"]
        if not (type(body) is list and len(body) == 7 and type(body[6]) is list):
            raise ValueError("a malformed decimal context")
        prec, rounding, emin, emax, capitals, clamp, traps = body
        if not (
            all(type(x) is int for x in (prec, emin, emax, capitals, clamp))
            and rounding in _ROUNDINGS
            and all(t in _SIGNALS for t in traps)
        ):
            raise ValueError("a malformed decimal context")
        import decimal as dec

        try:
            context = dec.Context(
                prec=prec,
                rounding=rounding,
                Emin=emin,
                Emax=emax,
                capitals=capitals,
                clamp=clamp,
                traps=[getattr(dec, t) for t in traps],
            )
        except (ValueError, TypeError, OverflowError):
            raise ValueError("a malformed decimal context") from None
        dec.setcontext(context)
    if "recursion" in state and from_test:
        limit = state["recursion"]
        if type(limit) is not int or not 50 <= limit <= 1 << 30:
            raise ValueError("a malformed recursion limit")
        try:
            sys.setrecursionlimit(limit)
        except RecursionError:  # lower than the depth the program is at now: Python would refuse it too
            pass


# ---------------------------------------------------------------------------------------------- shared containers
# A mutable container that crossed once is the same object on both sides for the rest of the test, as it is in
# Python's one interpreter: each side numbers it in its Memo (the same number on both), a later crossing refers to
# it by number, and at each call the state of every shared container that changed since the last call travels
# (the test's changes before the call, the program's after it). A container the program no longer holds after a
# call is dropped from both Memos (program.Server.unkept): what the program keeps is what stays shared — the list it
# saved and the test later appends to, the history it returns each time.
def snapshot(obj):
    """A shallow copy of a shared container, to tell later whether it changed."""
    if type(obj) in (dict, collections.OrderedDict, collections.Counter, collections.defaultdict):
        return list(obj.items())
    if type(obj) is bytearray:
        return bytes(obj)
    return list(obj)


_SCALARS = (int, float, str, bool, bytes, type(None), complex)


def unchanged(before, obj) -> bool:
    """Whether `obj` still holds what its snapshot held: the same members (by identity, or equal scalars). No
    member's own __eq__ runs (a set's members are compared by identity: a re-added equal member reads as a
    change, which only costs a resend)."""
    now = snapshot(obj)
    if type(now) is bytes:
        return now == before
    if len(now) != len(before):
        return False
    if type(obj) is set:
        return {id(x) for x in now} == {id(x) for x in before}
    for a, b in zip(before, now):
        if type(obj) is not list and type(obj) is not collections.deque:  # pairs (key, value)
            if a[0] is not b[0] and not (type(a[0]) in _SCALARS and type(a[0]) is type(b[0]) and a[0] == b[0]):
                return False
            a, b = a[1], b[1]
        if a is not b and not (type(a) is type(b) and type(a) in _SCALARS and a == b):
            return False
    return True


def update_in_place(original, new) -> None:
    """A shared container takes the state its peer's copy has; its identity stays."""
    t = type(original)
    if type(new) is not t:
        raise ValueError("a changed container of another type")
    if t is list or t is bytearray:
        original[:] = new
    elif t is set or t is collections.deque:
        original.clear()
        original.extend(new) if t is collections.deque else original.update(new)
    else:  # dict, OrderedDict, Counter, defaultdict: exact types, so these are Python's own methods
        original.clear()
        (original.update if t is collections.OrderedDict else dict.update.__get__(original))(new)


def encode_state(memo: "Memo", k: int, handle_of=None):
    """The state of shared container k: its own body (not a reference to itself), the containers in it numbered
    or referred to as in any crossing."""
    obj = memo.objects[k]
    del memo.ids[id(obj)]
    try:
        return _encode(obj, type(obj), handle_of, None, memo)
    finally:
        memo.ids[id(obj)] = k


def children(obj):
    """The members of a shared container (a dict's keys and values)."""
    if type(obj) in (dict, collections.OrderedDict, collections.Counter, collections.defaultdict):
        for key, value in obj.items():
            yield key
            yield value
    elif type(obj) is not bytearray:
        yield from obj
