"""code_reward's sandbox scores honest programs as plain Python does, and no forger above an honest wrong answer
(issue 53). Two failures matter equally under RL: a forger above an honest wrong answer teaches the policy to forge;
an honest program below what Python gives it teaches the policy to avoid correct code.

Fidelity: each row is an honest program, its tests and a wrong twin (a plausible mistake). Python's score of a
program is what HumanEval-style scoring gives it: the program and one test snippet exec'd in one fresh namespace
per snippet (the row's setup code between them); a stdin/stdout case runs the program as a script. The sandbox must
give every program, honest or wrong, exactly Python's score; every honest program scores 1.0 in Python and every
wrong twin less. Integrity: tests/sandbox_answer_attacks.py, each forger at most its honest wrong answer.
"""

import contextlib
import io
import itertools
import os
import subprocess
import sys

import pytest

from dsgrpo.rewards import sandbox

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import sandbox_answer_attacks as answer_attacks  # noqa: E402

LIMITS = sandbox.SandboxLimits(timeout_s=4.0, cpu_s=4)


def R(program, tests, wrong, setup="", entry=None):
    """A row. `wrong`: the wrong twin, or (old, new) to make it from the program by one replacement."""
    if isinstance(wrong, tuple):
        assert wrong[0] in program, wrong
        wrong = program.replace(*wrong)
    return {"program": program, "tests": tests, "wrong": wrong, "setup": setup, "entry": entry}


# ------------------------------------------------------------------------------------------------ mutation
def _mutation_rows():
    """A function that changes the test's argument in place; the test checks its own object."""
    cases = [  # (function body on `xs`, the test's value, what the test's object is after, wrong body)
        ("xs.sort()", "[3, 1, 2]", "[1, 2, 3]", "sorted(xs)"),
        ("xs.sort(reverse=True)", "[3, 1, 2]", "[3, 2, 1]", "xs.sort()"),
        ("xs.reverse()", "[1, 2, 3]", "[3, 2, 1]", "xs[::-1]"),
        ("xs.append(0)", "[5]", "[5, 0]", "xs + [0]"),
        ("xs.extend([7, 8])", "[1]", "[1, 7, 8]", "xs.extend([8, 7])"),
        ("xs.insert(0, 9)", "[1, 2]", "[9, 1, 2]", "xs.insert(1, 9)"),
        ("xs.pop()", "[1, 2, 3]", "[1, 2]", "xs.pop(0)"),
        ("xs.clear()", "[1, 2]", "[]", "xs[:0]"),
        ("xs.remove(2)", "[1, 2, 3, 2]", "[1, 3, 2]", "xs.remove(3)"),
        ("xs[0] = 'first'", "['a', 'b']", "['first', 'b']", "xs[1] = 'first'"),
        ("del xs[1:]", "[1, 2, 3]", "[1]", "del xs[2:]"),
        ("xs[:] = [x * x for x in xs]", "[1, 2, 3]", "[1, 4, 9]", "[x * x for x in xs]"),
        ("xs += [4]", "[3]", "[3, 4]", "xs + [4]"),
        ("xs *= 2", "[1, 2]", "[1, 2, 1, 2]", "xs * 2"),
        ("[row.append(0) for row in xs]", "[[1], [2, 3]]", "[[1, 0], [2, 3, 0]]", "[row + [0] for row in xs]"),
        ("xs[0][0] = 5", "[[1, 2], [3]]", "[[5, 2], [3]]", "xs[0][1] = 5"),
        ("xs['k'] = 1", "{}", "{'k': 1}", "{'k': 1}"),
        ("xs.update(a=2)", "{'a': 1, 'b': 2}", "{'a': 2, 'b': 2}", "xs.update(b=1)"),
        ("xs.pop('a')", "{'a': 1, 'b': 2}", "{'b': 2}", "xs.pop('b')"),
        ("xs.setdefault('z', []).append(1)", "{'z': [0]}", "{'z': [0, 1]}", "xs.setdefault('y', []).append(1)"),
        ("xs.clear()", "{1: 2}", "{}", "dict()"),
        ("xs.add(4)", "{1, 2}", "{1, 2, 4}", "xs | {4}"),
        ("xs.discard(1)", "{1, 2}", "{2}", "xs.discard(2)"),
        ("xs.update({5, 6})", "{5}", "{5, 6}", "xs.update({6, 7})"),
        ("xs &= {1}", "{1, 2}", "{1}", "xs & {1}"),
        ("xs.extend(b'!')", "bytearray(b'hi')", "bytearray(b'hi!')", "xs.extend(b'?')"),
        ("xs[0] = 72", "bytearray(b'hi')", "bytearray(b'Hi')", "xs[1] = 72"),
        ("xs.appendleft(0)", "collections.deque([1, 2])", "collections.deque([0, 1, 2])", "xs.append(0)"),
        ("xs.rotate(1)", "collections.deque([1, 2, 3])", "collections.deque([3, 1, 2])", "xs.rotate(-1)"),
        ("xs['a'] += 1", "collections.Counter('ab')", "collections.Counter({'a': 2, 'b': 1})", "xs['b'] += 1"),
        (
            "xs.move_to_end('a')",
            "collections.OrderedDict(a=1, b=2)",
            "collections.OrderedDict(b=2, a=1)",
            "xs.move_to_end('b')",
        ),
        ("xs['new'].append(1)", "collections.defaultdict(list)", "{'new': [1]}", "xs['old'].append(1)"),
        ("heapq.heappush(xs, 0)", "[1, 3, 5]", "[0, 1, 5, 3]", "heapq.heappush(xs, 9)"),
        ("heapq.heapify(xs)", "[5, 1, 3]", "[1, 5, 3]", "xs.sort()"),
        ("random.Random(0).shuffle(xs)", "[1, 2, 3, 4, 5]", "None", "xs.reverse()"),
        ("bisect.insort(xs, 4)", "[1, 3, 5]", "[1, 3, 4, 5]", "bisect.insort(xs, 6)"),
    ]
    rows = []
    for body, given, after, wrong in cases:
        program = f"import bisect, collections, heapq, random\ndef change(xs):\n    {body}\n"
        if after == "None":  # a seeded shuffle: the order Python's own shuffle gives
            import random

            shuffled = eval(given)
            random.Random(0).shuffle(shuffled)
            after = repr(shuffled)
        tests = [
            f"import collections\nxs = {given}\nchange(xs)\nassert xs == {after}",
            f"import collections\nxs = {given}\nalias = xs\nchange(xs)\nassert alias is xs and alias == {after}",
        ]
        rows.append(R(program, tests + ["assert change is not None"], program.replace(body, wrong)))
    # aliasing inside one call's arguments, a container inside another, the returned argument itself
    rows += [
        R(
            "def twice(a, b):\n    a.append(1)\n    b.append(2)\n",
            ["xs = []\ntwice(xs, xs)\nassert xs == [1, 2]", "a, b = [], []\ntwice(a, b)\nassert (a, b) == ([1], [2])"],
            ("b.append(2)", "b.append(3)"),
        ),
        R(
            "def add_row(grid, row):\n    grid.append(row)\n    row.append('!')\n",
            [
                "g, r = [], ['x']\nadd_row(g, r)\nassert g == [['x', '!']] and g[0] is r",
                "g = [[0]]\nadd_row(g, [1])\nassert g == [[0], [1, '!']]",
            ],
            ("row.append('!')", "row.append('?')"),
        ),
        R(
            "def fill(xs, n):\n    xs.extend(range(n))\n    return xs\n",
            [
                "xs = []\nassert fill(xs, 3) is xs and xs == [0, 1, 2]",
                "ys = fill([9], 1)\nys.append(5)\nassert ys == [9, 0, 5]",
            ],
            ("return xs", "return list(xs)"),
        ),
        R(
            "def bump(counts, key):\n    counts[key] = counts.get(key, 0) + 1\n",
            [
                "c = {}\nfor w in 'abca':\n    bump(c, w)\nassert c == {'a': 2, 'b': 1, 'c': 1}",
                "c = {'z': 5}\nbump(c, 'z')\nassert c['z'] == 6",
            ],
            ("+ 1", "+ 2"),
        ),
        R(
            "def swap(pair):\n    pair[0], pair[1] = pair[1], pair[0]\n",
            ["p = [1, 2]\nswap(p)\nassert p == [2, 1]", "p = ['a', 'b']\nswap(p)\nswap(p)\nassert p == ['a', 'b']"],
            ("pair[0], pair[1] = pair[1], pair[0]", "pair[0] = pair[1]"),
        ),
        R(
            "def sort_rows(rows):\n    rows.sort(key=lambda r: r[1])\n",
            [
                "a, b = ['x', 2], ['y', 1]\nrows = [a, b]\nsort_rows(rows)\nassert rows == [b, a] and rows[0] is b",
                "rows = []\nsort_rows(rows)\nassert rows == []",
            ],
            ("r[1]", "r[0]"),
        ),
        R(
            "def tag(d):\n    d['seen'] = True\n    d['items'].append(len(d['items']))\n",
            [
                "d = {'items': []}\ntag(d)\ntag(d)\nassert d == {'items': [0, 1], 'seen': True}",
                "inner = [7]\nd = {'items': inner}\ntag(d)\nassert inner == [7, 1]",
            ],
            ("len(d['items'])", "0"),
        ),
        R(
            "def push_all(stack, *values):\n    for v in values:\n        stack.append(v)\n    return len(stack)\n",
            ["s = [0]\nassert push_all(s, 1, 2) == 3 and s == [0, 1, 2]", "s = []\npush_all(s)\nassert s == []"],
            ("stack.append(v)", "stack.insert(0, v)"),
        ),
        R(
            "def drain(q):\n    out = []\n    while q:\n        out.append(q.pop())\n    return out\n",
            ["q = [1, 2, 3]\nassert drain(q) == [3, 2, 1] and q == []", "q = []\nassert drain(q) == []"],
            ("q.pop()", "q[-1]\n        q.pop(0)"),
        ),
        R(
            "def normalise(m):\n    for row in m:\n        total = sum(row)\n"
            "        row[:] = [x / total for x in row]\n",
            ["m = [[1, 1], [1, 3]]\nnormalise(m)\nassert m == [[0.5, 0.5], [0.25, 0.75]]"],
            ("x / total", "x / 2"),
        ),
        R(
            "def kw(xs, *, key=None):\n    xs.append(key)\n",
            ["xs = []\nkw(xs, key=3)\nassert xs == [3]", "xs = [1]\nkw(xs=xs, key='k')\nassert xs == [1, 'k']"],
            ("xs.append(key)", "xs.append(None)"),
        ),
    ]
    return rows


# ------------------------------------------------------------------------------------------------ data model
HAND = [
    # functions, recursion, closures, generators
    R(
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
        ["assert fib(10) == 55", "assert [fib(i) for i in range(6)] == [0, 1, 1, 2, 3, 5]"],
        ("n < 2", "n < 1"),
    ),
    R(
        "import functools\n@functools.lru_cache(None)\ndef ways(n):\n    return 1 if n <= 1 else ways(n - 1) + ways(n -"
        " 2)\n",
        ["assert ways(30) == 1346269", "assert ways(0) == 1"],
        ("n <= 1", "n < 1"),
    ),
    R(
        "def make_adder(k):\n    def add(x):\n        return x + k\n    return add\n",
        [
            "assert make_adder(3)(4) == 7",
            "add5 = make_adder(5)\nassert list(map(add5, [1, 2])) == [6, 7]",
            "assert callable(make_adder(1))",
        ],
        ("x + k", "x + k + 1"),
    ),
    R(
        "def counter():\n    n = 0\n    def inc():\n        nonlocal n\n        n += 1\n        return n\n    return in"
        "c\n",
        ["c = counter()\nc()\nassert c() == 2", "a, b = counter(), counter()\na()\nassert b() == 1"],
        ("n += 1", "n += 2"),
    ),
    R(
        "def compose(f, g):\n    return lambda x: f(g(x))\n",
        ["assert compose(lambda x: x + 1, lambda x: x * 2)(5) == 11", "assert compose(str, abs)(-3) == '3'"],
        ("f(g(x))", "g(f(x))"),
    ),
    R(
        "def squares(n):\n    for i in range(n):\n        yield i * i\n",
        [
            "assert list(squares(4)) == [0, 1, 4, 9]",
            "g = squares(3)\nassert next(g) == 0 and next(g) == 1",
            "assert 9 in squares(5) and 10 not in squares(5)",
            "assert sum(squares(3)) == 5",
        ],
        ("i * i", "i + i"),
    ),
    R(
        "def chunks(xs, n):\n    return (xs[i:i + n] for i in range(0, len(xs), n))\n",
        ["assert list(chunks([1, 2, 3, 4, 5], 2)) == [[1, 2], [3, 4], [5]]", "assert list(chunks([], 3)) == []"],
        ("xs[i:i + n]", "xs[i:i + n - 1]"),
    ),
    R(
        "import itertools\ndef pairs(xs):\n    return itertools.combinations(xs, 2)\n",
        ["assert list(pairs([1, 2, 3])) == [(1, 2), (1, 3), (2, 3)]", "assert len(list(pairs(range(5)))) == 10"],
        ("combinations", "permutations"),
    ),
    R(
        "def evens(xs):\n    return filter(lambda x: x % 2 == 0, xs)\n",
        ["assert list(evens(range(7))) == [0, 2, 4, 6]", "assert sorted(evens([5, 4, 2])) == [2, 4]"],
        ("== 0", "== 1"),
    ),
    R(
        "def doubled(xs):\n    return map(lambda x: 2 * x, xs)\n",
        ["assert list(doubled([1, 2])) == [2, 4]", "assert tuple(doubled(())) == ()"],
        ("2 * x", "x"),
    ),
    R(
        "def enum(xs):\n    return enumerate(xs, 1)\n",
        ["assert list(enum('ab')) == [(1, 'a'), (2, 'b')]", "assert dict(enum('x')) == {1: 'x'}"],
        ("xs, 1", "xs"),
    ),
    R(
        "def both(a, b):\n    return zip(a, b)\n",
        [
            "assert list(both([1, 2], 'ab')) == [(1, 'a'), (2, 'b')]",
            "assert dict(both('xy', [1, 2])) == {'x': 1, 'y': 2}",
        ],
        ("zip(a, b)", "zip(b, a)"),
    ),
    R(
        "def backwards(xs):\n    return reversed(xs)\n",
        ["assert list(backwards([1, 2, 3])) == [3, 2, 1]", "assert ''.join(backwards('ab')) == 'ba'"],
        ("reversed(xs)", "iter(xs)"),
    ),
    R(
        "def ident(n):\n    return [[int(i == j) for j in range(n)] for i in range(n)]\n",
        ["assert ident(2) == [[1, 0], [0, 1]]", "assert ident(0) == []"],
        ("i == j", "i != j"),
    ),
    R(
        "def flatten(xs):\n    out = []\n    for x in xs:\n        if isinstance(x, list):\n            out.extend(flat"
        "ten(x))\n"
        "        else:\n            out.append(x)\n    return out\n",
        ["assert flatten([1, [2, [3, [4]]]]) == [1, 2, 3, 4]", "assert flatten([]) == []"],
        ("out.extend(flatten(x))", "out.extend(x)"),
    ),
    R(
        "def hanoi(n, a='A', b='B', c='C'):\n    if n == 0:\n        return []\n"
        "    return hanoi(n - 1, a, c, b) + [(a, c)] + hanoi(n - 1, b, a, c)\n",
        ["assert len(hanoi(5)) == 31", "assert hanoi(1) == [('A', 'C')]"],
        ("[(a, c)]", "[(a, b)]"),
    ),
    R(
        "def deep(n):\n    return 0 if n == 0 else 1 + deep(n - 1)\n",
        ["assert deep(500) == 500"],
        ("1 + deep", "2 + deep"),
    ),
    # exceptions the tests expect
    R(
        "def safe_div(a, b):\n    if b == 0:\n        raise ZeroDivisionError('b is zero')\n    return a / b\n",
        [
            "try:\n    safe_div(1, 0)\n    assert False\nexcept ZeroDivisionError as e:\n    assert 'zero' in str(e)",
            "assert safe_div(6, 3) == 2",
        ],
        ("raise ZeroDivisionError('b is zero')", "return 0"),
    ),
    R(
        "def parse(s):\n    return int(s)\n",
        [
            "try:\n    parse('x')\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError('no error')",
            "assert parse('12') == 12",
        ],
        ("int(s)", "int(s or 0) if s.isdigit() else 0"),
    ),
    R(
        "def get(d, k):\n    return d[k]\n",
        ["try:\n    get({}, 'a')\n    assert False\nexcept KeyError:\n    pass", "assert get({'a': 1}, 'a') == 1"],
        ("d[k]", "d.get(k)"),
    ),
    R(
        "class InsufficientFunds(Exception):\n    pass\nclass Account:\n    def __init__(self, balance=0):\n"
        "        self.balance = balance\n    def withdraw(self, amount):\n        if amount > self.balance:\n"
        "            raise InsufficientFunds(f'only {self.balance}')\n        self.balance -= amount\n        return se"
        "lf.balance\n",
        [
            "a = Account(10)\nassert a.withdraw(3) == 7 and a.balance == 7",
            "assert Account(5).withdraw(5) == 0",
            "a = Account(1)\ntry:\n    a.withdraw(5)\n    assert False\nexcept InsufficientFunds as e:\n"
            "    assert str(e) "
            "== 'only 1'",
            "try:\n    Account().withdraw(1)\nexcept Exception as e:\n"
            "    assert type(e).__name__ == 'InsufficientFunds'",
        ],
        ("amount > self.balance", "amount >= self.balance"),
    ),
    R(
        "class ParseError(ValueError):\n    pass\ndef parse_pair(s):\n    if ',' not in s:\n"
        "        raise ParseError(s)\n"
        "    a, b = s.split(',')\n    return int(a), int(b)\n",
        [
            "try:\n    parse_pair('12')\nexcept ValueError:\n    ok = True\nelse:\n    ok = False\nassert ok",
            "assert parse_pair('1,2') == (1, 2)",
            "try:\n    parse_pair('x')\nexcept ParseError:\n    pass",
        ],
        ("raise ParseError(s)", "return (0, 0)"),
    ),
    R(
        "def first(xs):\n    if not xs:\n        raise IndexError('empty')\n    return xs[0]\n",
        [
            "try:\n    first([])\nexcept IndexError as e:\n    assert e.args == ('empty',)",
            "assert first([3, 4]) == 3",
            "try:\n    first(())\nexcept LookupError:\n    pass\nelse:\n    assert False",
        ],
        ("xs[0]", "xs[-1]"),
    ),
    R(
        "def check_age(n):\n    if not isinstance(n, int):\n        raise TypeError('int')\n    if n < 0:\n"
        "        raise ValueError('negative')\n    return True\n",
        [
            "try:\n    check_age('x')\nexcept TypeError:\n    pass\nelse:\n    assert False",
            "try:\n    check_age(-1)\nexcept ValueError as e:\n    assert str(e) == 'negative'\nelse:\n"
            "    assert False",
            "assert check_age(3)",
        ],
        ("n < 0", "n < -1"),
    ),
    R(
        "def nxt(it, default=None):\n    return next(it, default)\n",
        ["assert nxt(iter([])) is None", "assert nxt(iter([5])) == 5"],
        ("next(it, default)", "next(it, 0)"),
    ),
    # numbers
    R(
        "from fractions import Fraction\ndef harmonic(n):\n    return sum(Fraction(1, k) for k in range(1, n + 1))\n",
        [
            "from fractions import Fraction\nassert harmonic(3) == Fraction(11, 6)",
            "assert harmonic(1) == 1",
            "assert harmonic(2).denominator == 2",
        ],
        ("range(1, n + 1)", "range(1, n)"),
    ),
    R(
        "from decimal import Decimal, ROUND_HALF_UP\ndef money(x):\n    return Decimal(x).quantize(Decimal('0.01'), ROU"
        "ND_HALF_UP)\n",
        ["from decimal import Decimal\nassert money('2.675') == Decimal('2.68')", "assert str(money('1')) == '1.00'"],
        ("ROUND_HALF_UP)", "'ROUND_DOWN')"),
    ),
    R(
        "def cplx(a, b):\n    return complex(a, b) ** 2\n",
        ["assert cplx(1, 1) == 2j", "assert cplx(0, 2).real == -4"],
        ("** 2", "* 2"),
    ),
    R(
        "import math\ndef hyp(a, b):\n    return math.hypot(a, b)\n",
        ["import math\nassert math.isclose(hyp(3, 4), 5.0)", "assert hyp(0, 0) == 0.0"],
        ("hypot(a, b)", "hypot(a, a)"),
    ),
    R(
        "def big(n):\n    r = 1\n    for i in range(2, n + 1):\n        r *= i\n    return r\n",
        ["import math\nassert big(1000) == math.factorial(1000)", "assert big(0) == 1"],
        ("n + 1", "n"),
    ),
    R(
        "def mean(xs):\n    return sum(xs) / len(xs)\n",
        ["assert mean([1, 2, 3, 4]) == 2.5", "assert mean([7]) == 7.0"],
        ("len(xs)", "(len(xs) + 1)"),
    ),
    R(
        "def nan():\n    return float('nan')\n",
        ["import math\nassert math.isnan(nan())", "assert nan() != nan()"],
        ("float('nan')", "0.0"),
    ),
    R(
        "def inf():\n    return float('-inf')\n",
        ["assert inf() < -1e308", "assert inf() == float('-inf')"],
        ("'-inf'", "'inf'"),
    ),
    R(
        "def divmods(a, b):\n    return divmod(a, b)\n",
        ["assert divmods(7, 2) == (3, 1)", "assert divmods(-7, 2) == (-4, 1)"],
        ("divmod(a, b)", "(a // b, a % b + 0 * b) if a > 0 else (0, 0)"),
    ),
    R(
        "def to_bin(n):\n    return bin(n)[2:]\n",
        ["assert to_bin(5) == '101'", "assert to_bin(0) == '0'"],
        ("[2:]", "[1:]"),
    ),
    R("def rnd(x):\n    return round(x, 2)\n", ["assert rnd(2.675) == 2.67", "assert rnd(1) == 1"], ("x, 2", "x, 1")),
    # strings and bytes
    R(
        "def is_pal(s):\n    t = ''.join(c.lower() for c in s if c.isalnum())\n    return t == t[::-1]\n",
        ["assert is_pal('A man, a plan, a canal: Panama')", "assert not is_pal('abc')", "assert is_pal('')"],
        ("t == t[::-1]", "t == t[::-1] and len(t) > 1"),
    ),
    R(
        "def caesar(s, k):\n    return ''.join(chr((ord(c) - 97 + k) % 26 + 97) if c.islower() else c for c in s)\n",
        ["assert caesar('abc', 1) == 'bcd'", "assert caesar('xyz', 3) == 'abc'", "assert caesar('A b', 1) == 'A c'"],
        ("% 26", "% 25"),
    ),
    R(
        "def words(s):\n    return s.split()\n",
        ["assert words('a  b\\tc') == ['a', 'b', 'c']", "assert words('') == []"],
        ("s.split()", "s.split(' ')"),
    ),
    R(
        "def title(s):\n    return s.title()\n",
        [
            "assert title('hello world').startswith('Hello W')",
            "assert title('ab').istitle()",
            "assert title('x').endswith('X')",
        ],
        ("s.title()", "s.capitalize()"),
    ),
    R(
        "def encode(s):\n    return s.encode('utf-8')\n",
        ["assert encode('é') == b'\\xc3\\xa9'", "assert encode('ab').decode() == 'ab'"],
        ("'utf-8'", "'latin-1'"),
    ),
    R(
        "def xor(a, b):\n    return bytes(x ^ y for x, y in zip(a, b))\n",
        ["assert xor(b'\\x01\\x02', b'\\x03\\x03') == b'\\x02\\x01'", "assert xor(b'', b'') == b''"],
        ("x ^ y", "x | y"),
    ),
    R(
        "def brackets(n):\n    return '[' * n + '{' * n + '}' * n + ']' * n\n",
        [
            "assert brackets(300000) == '[' * 300000 + '{' * 300000 + '}' * 300000 + ']' * 300000",
            "assert brackets(0) == ''",
        ],
        ("']' * n", "']' * (n - 1)"),
    ),
    R(
        "def nested(n):\n    out = []\n    for _ in range(n):\n        out = [out]\n    return out\n",
        ["x = nested(50)\nfor _ in range(50):\n    x = x[0]\nassert x == []"],
        ("range(n)", "range(n + 1)"),
    ),
    R(
        "def fmt(x):\n    return f'{x:>6.2f}|'\n",
        ["assert fmt(3.14159) == '  3.14|'", "assert fmt(-1) == ' -1.00|'"],
        (">6.2f", ">6.1f"),
    ),
    R(
        "import re\ndef digits(s):\n    return re.findall(r'\\d+', s)\n",
        ["assert digits('a1b22c333') == ['1', '22', '333']", "assert digits('none') == []"],
        ("\\d+", "\\d"),
    ),
    R(
        "import re\ndef match(s):\n    m = re.match(r'(\\w+)@(\\w+)', s)\n    return m.groups() if m else None\n",
        ["assert match('joe@site')[0] == 'joe'", "assert match('@') is None"],
        ("(\\w+)@", "(\\w)@"),
    ),
    R(
        "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s.lower())\n",
        ["assert count_vowels('HELLO') == 2", "assert count_vowels('xyz') == 0"],
        ("s.lower()", "s"),
    ),
    R(
        "class Shout(str):\n    def shout(self):\n        return self.upper() + '!'\ndef make(s):\n"
        "    return Shout(s)\n",
        [
            "assert make('hi') == 'hi' and make('hi').startswith('h')",
            "assert make('a').upper() == 'A'",
            "assert isinstance(make('x'), str) and len(make('abc')) == 3",
        ],
        ("Shout(s)", "Shout(s + ' ')"),
    ),
    R(
        "class Meters(float):\n    pass\ndef meters(x):\n    return Meters(x * 1000)\n",
        ["assert meters(1.5) == 1500.0", "assert meters(2) > 1999 and meters(2).is_integer()"],
        ("x * 1000", "x * 100"),
    ),
    R(
        "class Ids(list):\n    pass\ndef ids(n):\n    return Ids(range(n))\n",
        ["assert ids(3) == [0, 1, 2] and ids(3).index(2) == 2", "assert ids(2).count(1) == 1 and 1 in ids(2)"],
        ("range(n)", "range(1, n)"),
    ),
    R(
        "class Bag(dict):\n    pass\ndef bag(s):\n    b = Bag()\n    for c in s:\n        b[c] = b.get(c, 0) + 1"
        "\n    return b\n",
        [
            "assert bag('aab') == {'a': 2, 'b': 1}",
            "assert bag('x').get('x') == 1 and 'x' in bag('x')",
            "assert bag('ab').keys() == {'a', 'b'}",
        ],
        ("+ 1", "+ 2"),
    ),
    R(
        "class Code(int):\n    pass\ndef code(s):\n    return Code(len(s))\n",
        ["assert code('abc') == 3 and code('') == 0", "assert code('ab') + 1 == 3 and code('a') < 2"],
        ("len(s)", "len(s) + 1"),
    ),
    R(
        "class Tags(set):\n    pass\ndef tags(s):\n    return Tags(s.split(','))\n",
        ["assert tags('a,b').issubset({'a', 'b', 'c'})", "assert tags('x,x') == {'x'}", "assert 'b' in tags('a,b')"],
        ("s.split(',')", "s.split(',')[:1]"),
    ),
    # collections and views
    R(
        "from collections import Counter\ndef top(s, n):\n    return Counter(s).most_common(n)\n",
        ["assert top('aabbbc', 2) == [('b', 3), ('a', 2)]", "assert top('', 1) == []"],
        ("most_common(n)", "most_common(n + 1)"),
    ),
    R(
        "from collections import Counter\ndef counts(s):\n    return Counter(s)\n",
        [
            "c = counts('abca')\nassert c['a'] == 2 and c['z'] == 0",
            "assert counts('ab') + counts('b') == counts('abb')",
        ],
        ("Counter(s)", "Counter(set(s))"),
    ),
    R(
        "from collections import defaultdict\ndef index(words):\n    d = defaultdict(lambda: [])\n    for w in words:\n"
        "        d[w[0]].append(w)\n    return d\n",
        [
            "assert index(['ab', 'ac', 'b'])['a'] == ['ab', 'ac']",
            "d = index([])\nassert d['q'] == [] and 'q' in d",
            "assert dict(index(['x'])) == {'x': ['x']}",
        ],
        ("w[0]", "w[-1]"),
    ),
    R(
        "from collections import defaultdict\ndef tree():\n    return defaultdict(tree)\ndef build(paths):\n    t = tre"
        "e()\n"
        "    for p in paths:\n        node = t\n        for part in p.split('/'):\n            node = node[part]"
        "\n    return t\n",
        ["t = build(['a/b', 'a/c'])\nassert sorted(t['a']) == ['b', 'c']", "assert len(build([])) == 0"],
        ("p.split('/')", "p.split('/')[:1]"),
    ),
    R(
        "from collections import OrderedDict\ndef lru(keys, n):\n    d = OrderedDict()\n    for k in keys:\n"
        "        d[k] = True\n        d.move_to_end(k)\n        if len(d) > n:\n            d.popitem(last=False)"
        "\n    return list(d)\n",
        ["assert lru([1, 2, 3, 1, 4], 3) == [3, 1, 4]", "assert lru([], 2) == []"],
        ("last=False", "last=True"),
    ),
    R(
        "from collections import deque\ndef window(xs, n):\n    return deque(xs, maxlen=n)\n",
        [
            "from collections import deque\nassert window(range(5), 2) == deque([3, 4])",
            "assert window([], 3).maxlen == 3",
        ],
        ("maxlen=n", "maxlen=n + 1"),
    ),
    R(
        "def keys_of(d):\n    return d.keys()\n",
        [
            "assert keys_of({'a': 1, 'b': 2}) == {'a', 'b'}",
            "assert list(keys_of({2: 0, 1: 0})) == [2, 1]",
            "assert keys_of({'x': 1}) & {'x', 'y'} == {'x'}",
            "assert 'a' in keys_of({'a': 1})",
        ],
        ("d.keys()", "d.values()"),
    ),
    R(
        "def items_of(d):\n    return d.items()\n",
        ["assert items_of({'a': 1}) == {('a', 1)}", "assert list(items_of({1: 2, 3: 4})) == [(1, 2), (3, 4)]"],
        ("d.items()", "d.items() if len(d) > 1 else {}.items()"),
    ),
    R(
        "def values_of(d):\n    return d.values()\n",
        [
            "assert sorted(values_of({'a': 2, 'b': 1})) == [1, 2]",
            "assert 2 in values_of({'a': 2})",
            "assert len(values_of({})) == 0",
        ],
        ("d.values()", "list(d.values())[:1]"),
    ),
    R(
        "def inverse(d):\n    return {v: k for k, v in d.items()}\n",
        ["assert inverse({'a': 1, 'b': 2}) == {1: 'a', 2: 'b'}", "assert inverse({}) == {}"],
        ("{v: k", "{k: v"),
    ),
    R(
        "def uniq(xs):\n    return frozenset(xs)\n",
        [
            "assert uniq([1, 1, 2]) == {1, 2} and uniq([]) == frozenset()",
            "assert {uniq([1]): 'ok'}[frozenset({1})] == 'ok'",
        ],
        ("frozenset(xs)", "frozenset(xs[1:])"),
    ),
    R(
        "import heapq\ndef smallest(xs, k):\n    return heapq.nsmallest(k, xs)\n",
        ["assert smallest([5, 1, 4, 2], 2) == [1, 2]", "assert smallest([], 3) == []"],
        ("nsmallest", "nlargest"),
    ),
    R(
        "import bisect\ndef rank(xs, x):\n    return bisect.bisect_left(sorted(xs), x)\n",
        ["assert rank([3, 1, 2], 2) == 1", "assert rank([], 5) == 0"],
        ("bisect_left", "bisect_right"),
    ),
    R(
        "def evens_range(n):\n    return range(0, n, 2)\n",
        ["assert evens_range(7) == range(0, 7, 2)", "assert list(evens_range(5)) == [0, 2, 4] and 4 in evens_range(5)"],
        ("range(0, n, 2)", "range(0, n - 1, 2)"),
    ),
    R(
        "def middle(xs):\n    return slice(1, len(xs) - 1)\n",
        ["assert [1, 2, 3, 4][middle([1, 2, 3, 4])] == [2, 3]", "assert middle('abc') == slice(1, 2)"],
        ("slice(1, len(xs) - 1)", "slice(0, len(xs) - 1)"),
    ),
    R(
        "import types\ndef cfg(**kw):\n    return types.SimpleNamespace(**kw)\n",
        ["c = cfg(a=1, b='x')\nassert c.a == 1 and c.b == 'x'", "assert vars(cfg(z=2)) == {'z': 2}"],
        ("**kw)", "**{k: 0 for k in kw})"),
    ),
    R(
        "from collections import namedtuple\nPoint = namedtuple('Point', 'x y')\ndef mid(p, q):\n"
        "    return Point((p.x + q.x) / 2, (p.y + q.y) / 2)\n",
        [
            "assert mid(Point(0, 0), Point(2, 4)) == Point(1, 2)",
            "m = mid(Point(0, 0), Point(2, 2))\nassert m._asdict() == {'x': 1, 'y': 1}",
            "assert mid(Point(1, 1), Point(1, 1))._replace(x=5) == (5, 1)",
        ],
        ("(p.y + q.y) / 2", "(p.y + q.y)"),
    ),
    R(
        "from typing import NamedTuple\nclass Item(NamedTuple):\n    name: str\n    price: float = 0.0\n"
        "def cheapest(items):\n    return min(items, key=lambda i: i.price)\n",
        [
            "assert cheapest([Item('a', 2), Item('b', 1)]) == Item('b', 1)",
            "assert cheapest([Item('z')]).price == 0.0",
            "assert cheapest([Item('a', 3)])._fields == ('name', 'price')",
            "assert isinstance(cheapest([Item('q', 1)]), Item)",
        ],
        ("min(items", "max(items"),
    ),
    R(
        "from typing import NamedTuple\nclass Span(NamedTuple):\n    start: int\n    end: int\ndef span(a, b):\n"
        "    return Span(min(a, b), max(a, b))\n",
        [
            "assert span(5, 2) == (2, 5) and span(5, 2).end == 5",
            "assert span(1, 1)._asdict() == {'start': 1, 'end': 1}",
            "s = span(3, 4)\nassert s._replace(end=9) == (3, 9)",
        ],
        ("max(a, b)", "min(a, b)"),
    ),
    # dates
    R(
        "import datetime\ndef next_day(d):\n    return d + datetime.timedelta(days=1)\n",
        [
            "import datetime\nassert next_day(datetime.date(2020, 2, 28)) == datetime.date(2020, 2, 29)",
            "import datetime\nassert next_day(datetime.date(2020, 12, 31)).year == 2021",
        ],
        ("days=1", "days=2"),
    ),
    R(
        "import datetime\ndef parse(s):\n    return datetime.datetime.strptime(s, '%Y-%m-%d %H:%M')\n",
        [
            "import datetime\nassert parse('2021-03-04 05:06') == datetime.datetime(2021, 3, 4, 5, 6)",
            "assert parse('2000-01-01 00:00').weekday() == 5",
            "assert parse('2000-01-01 10:30').strftime('%H') == '10'",
        ],
        ("%H:%M", "%M:%H"),
    ),
    R(
        "import datetime\ndef span(a, b):\n    return b - a\n",
        [
            "import datetime\nassert span(datetime.date(2020, 1, 1), datetime.date(2020, 3, 1)).days == 60",
            "import datetime as dt\n"
            "assert span(dt.datetime(2020, 1, 1), dt.datetime(2020, 1, 1, 1)) == dt.timedelta(hours"
            "=1)",
        ],
        ("b - a", "a - b"),
    ),
    R(
        "import datetime\ndef at(h, m):\n    return datetime.time(h, m)\n",
        [
            "import datetime\nassert at(9, 30) == datetime.time(9, 30) and at(9, 30) < datetime.time(10)",
            "assert at(23, 59).isoformat() == '23:59:00'",
        ],
        ("time(h, m)", "time(m, h)"),
    ),
    R(
        "import datetime\ndef utc(y):\n    return datetime.datetime(y, 1, 1, tzinfo=datetime.timezone.utc)\n",
        [
            "import datetime\nassert utc(2020).tzinfo == datetime.timezone.utc and utc(2020).year == 2020",
            "import datetime\nassert utc(2020) == datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)",
        ],
        ("y, 1, 1", "y, 1, 2"),
    ),
    # enums
    R(
        "import enum\nclass Color(enum.Enum):\n    RED = 1\n    GREEN = 2\ndef warm():\n    return Color.RED\n",
        [
            "assert warm() == Color.RED and warm() is Color.RED",
            "assert warm().name == 'RED' and warm().value == 1",
            "assert isinstance(warm(), Color)",
            "assert warm() != Color.GREEN and warm() != 1",
        ],
        ("return Color.RED", "return Color.GREEN"),
    ),
    R(
        "import enum\nclass Level(enum.IntEnum):\n    LOW = 1\n    HIGH = 3\ndef level(x):\n    return Level.HIGH if x "
        "> 10 else Level.LOW\n",
        ["assert level(20) == 3 and level(1) == 1", "assert level(11) > level(0)", "assert level(5) + 1 == 2"],
        ("x > 10", "x > 100"),
    ),
    R(
        "import enum\nclass Perm(enum.Flag):\n    R = 4\n    W = 2\n    X = 1\ndef perms(s):\n    p = Perm(0)\n"
        "    for c, f in (('r', Perm.R), ('w', Perm.W), ('x', Perm.X)):\n        if c in s:\n            p |= f"
        "\n    return p\n",
        ["assert perms('rw') == Perm.R | Perm.W", "assert Perm.X in perms('x')", "assert not perms('')"],
        ("('w', Perm.W)", "('w', Perm.X)"),
    ),
    R(
        "import enum\nclass Suit(str, enum.Enum):\n    HEARTS = 'h'\n    SPADES = 's'\ndef suit(c):\n    return Suit(c)"
        "\n",
        ["assert suit('h') == 'h' and suit('h') is Suit.HEARTS", "assert suit('s').value == 's'"],
        ("Suit(c)", "Suit('h')"),
    ),
    R(
        "import enum\nclass Dir(enum.Enum):\n    N = (0, 1)\n    E = (1, 0)\ndef step(d, p):\n    return (p[0] + d.valu"
        "e[0], p[1] + d.value[1])\n"
        "def dirs():\n    return list(Dir)\n",
        ["assert step(Dir.N, (0, 0)) == (0, 1)", "assert dirs() == [Dir.N, Dir.E]", "assert len(dirs()) == 2"],
        ("p[1] + d.value[1]", "p[1] - d.value[1]"),
    ),
    # dataclasses and classes
    R(
        "from dataclasses import dataclass\n@dataclass\nclass Point:\n    x: int\n    y: int\ndef origin():\n    return"
        " Point(0, 0)\n"
        "def shift(p, dx):\n    return Point(p.x + dx, p.y)\n",
        [
            "assert origin() == Point(0, 0)",
            "assert shift(origin(), 2).x == 2",
            "assert shift(Point(1, 1), 1) == Point(2, 1)",
            "assert isinstance(origin(), Point)",
            "assert repr(origin()) == 'Point(x=0, y=0)'",
        ],
        ("p.x + dx", "p.x - dx"),
    ),
    R(
        "from dataclasses import dataclass, field\n@dataclass(order=True)\nclass Task:\n    priority: int\n    name: st"
        "r = field(compare=False)\n"
        "def plan(pairs):\n    return sorted(Task(p, n) for p, n in pairs)\n",
        ["assert [t.name for t in plan([(2, 'b'), (1, 'a')])] == ['a', 'b']", "assert plan([]) == []"],
        ("sorted(Task", "list(Task"),
    ),
    R(
        "from dataclasses import dataclass\n@dataclass(frozen=True)\nclass Key:\n    a: int\n    b: str\ndef keys(n):\n"
        "    return {Key(i, str(i)) for i in range(n)}\n",
        ["assert len(keys(3)) == 3", "assert all(k.a == int(k.b) for k in keys(4))"],
        ("str(i)", "str(i + 1)"),
    ),
    R(
        "from dataclasses import dataclass, asdict\n@dataclass\nclass User:\n    name: str\n    age: int\ndef user(n, a"
        "):\n"
        "    return User(n, a)\n",
        [
            "import dataclasses\nassert dataclasses.asdict(user('a', 3)) == {'name': 'a', 'age': 3}",
            "assert user('b', 2) == user('b', 2) and user('b', 2) != user('b', 3)",
            "assert user('c', 1).age == 1",
        ],
        ("User(n, a)", "User(n, a + 1)"),
    ),
    R(
        "from dataclasses import dataclass\n@dataclass\nclass Rect:\n    w: float\n    h: float\n    def area(self):\n"
        "        return self.w * self.h\n",
        [
            "assert Rect(2, 3).area() == 6",
            "r = Rect(1, 1)\nr.w = 4\nassert r.area() == 4",
            "assert Rect(1, 2) == Rect(1, 2)",
        ],
        ("self.w * self.h", "self.w + self.h"),
    ),
    R(
        "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n        self.items.app"
        "end(x)\n"
        "    def pop(self):\n        return self.items.pop()\n    def __len__(self):\n        return len(self.items)\n"
        "    def __bool__(self):\n        return bool(self.items)\n",
        [
            "s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2 and len(s) == 1",
            "assert not Stack()",
            "s = Stack()\ns.push('x')\nassert s.items == ['x'] and s",
        ],
        ("self.items.pop()", "self.items.pop(0)"),
    ),
    R(
        "class Vector:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n    def __add__(self, o):\n"
        "        return Vector(self.x + o.x, self.y + o.y)\n    def __mul__(self, k):\n        return Vector(self.x * k"
        ", self.y * k)\n"
        "    __rmul__ = __mul__\n    def __eq__(self, o):\n        return isinstance(o, Vector) and (self.x, self.y) =="
        " (o.x, o.y)\n"
        "    def __abs__(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n    def __repr__(self):\n"
        "        return f'Vector({self.x}, {self.y})'\n",
        [
            "assert Vector(1, 2) + Vector(3, 4) == Vector(4, 6)",
            "assert 2 * Vector(1, 1) == Vector(2, 2)",
            "assert abs(Vector(3, 4)) == 5.0",
            "assert repr(Vector(1, 0)) == 'Vector(1, 0)'",
            "assert Vector(0, 0) != Vector(0, 1)",
        ],
        ("self.y + o.y", "self.y - o.y"),
    ),
    R(
        "class Card:\n    ORDER = '23456789TJQKA'\n    def __init__(self, r):\n        self.r = r\n    def __lt__(self,"
        " o):\n"
        "        return self.ORDER.index(self.r) < self.ORDER.index(o.r)\n    def __eq__(self, o):\n        return self"
        ".r == o.r\n"
        "    def __hash__(self):\n        return hash(self.r)\n",
        [
            "assert Card('2') < Card('A')",
            "assert sorted([Card('K'), Card('3')])[0].r == '3'",
            "assert len({Card('5'), Card('5')}) == 1",
            "assert max([Card('T'), Card('9')]).r == 'T'",
        ],
        ("self.ORDER.index(self.r) < self.ORDER", "self.ORDER.index(self.r) > self.ORDER"),
    ),
    R(
        "class Shape:\n    def area(self):\n        raise NotImplementedError\nclass Square(Shape):\n    def __init__(s"
        "elf, s):\n"
        "        self.s = s\n    def area(self):\n        return self.s ** 2\ndef make(s):\n    return Square(s)\n",
        [
            "assert isinstance(make(2), Shape)",
            "assert make(3).area() == 9",
            "assert isinstance(make(1), Square)",
            "assert issubclass(Square, Shape)",
        ],
        ("self.s ** 2", "self.s * 2"),
    ),
    R(
        "class Node:\n    def __init__(self, val, nxt=None):\n        self.val, self.next = val, nxt\ndef build(xs):"
        "\n    head = None\n"
        "    for x in reversed(xs):\n        head = Node(x, head)\n    return head\ndef to_list(head):\n    out = []"
        "\n    while head:\n"
        "        out.append(head.val)\n        head = head.next\n    return out\n",
        [
            "assert to_list(build([1, 2, 3])) == [1, 2, 3]",
            "h = build([4, 5])\nassert h.val == 4 and h.next.val == 5 and h.next.next is None",
            "assert build([]) is None",
        ],
        ("reversed(xs)", "xs"),
    ),
    R(
        "class TreeNode:\n    def __init__(self, v, l=None, r=None):\n"
        "        self.val, self.left, self.right = v, l, r\n"
        "def depth(t):\n    return 0 if t is None else 1 + max(depth(t.left), depth(t.right))\n",
        [
            "assert depth(TreeNode(1, TreeNode(2, TreeNode(3)))) == 3",
            "assert depth(None) == 0",
            "t = TreeNode(1, None, TreeNode(2))\nassert depth(t) == 2 and t.right.val == 2",
        ],
        ("1 + max", "max"),
    ),
    R(
        "class Tree:\n    def __init__(self, v, kids=()):\n        self.v, self.kids = v, list(kids)\ndef leaves(n):\n"
        "    t = Tree(0, [Tree(i) for i in range(n)])\n    return t\n",
        [
            "t = leaves(3)\nassert [k.v for k in t.kids] == [0, 1, 2]",
            "assert leaves(0).kids == []",
            "assert leaves(2).v == 0",
        ],
        ("range(n)", "range(1, n)"),
    ),
    R(
        "class Temperature:\n    def __init__(self, c):\n        self._c = c\n    @property\n"
        "    def fahrenheit(self):\n"
        "        return self._c * 9 / 5 + 32\n    @classmethod\n    def from_f(cls, f):\n        return cls((f - 32) * "
        "5 / 9)\n"
        "    @staticmethod\n    def boiling():\n        return 100\n",
        [
            "assert Temperature(100).fahrenheit == 212",
            "assert Temperature.from_f(32)._c == 0",
            "assert Temperature.boiling() == 100",
        ],
        ("* 9 / 5 + 32", "* 9 / 5"),
    ),
    R(
        "class Matrix:\n    def __init__(self, rows):\n        self.rows = rows\n    def __getitem__(self, ij):"
        "\n        i, j = ij\n"
        "        return self.rows[i][j]\n    def __setitem__(self, ij, v):\n        i, j = ij\n        self.rows[i][j] "
        "= v\n"
        "    def __iter__(self):\n        return iter(self.rows)\n    def __contains__(self, v):\n        return any(v "
        "in r for r in self.rows)\n",
        [
            "m = Matrix([[1, 2], [3, 4]])\nassert m[1, 0] == 3",
            "m = Matrix([[0]])\nm[0, 0] = 5\nassert m.rows == [[5]]",
            "assert list(Matrix([[1], [2]])) == [[1], [2]]",
            "assert 4 in Matrix([[1], [4]]) and 9 not in Matrix([[1]])",
        ],
        ("self.rows[i][j]\n", "self.rows[j][i]\n"),
    ),
    R(
        "class Counter2:\n    count = 0\n    def __init__(self):\n        Counter2.count += 1\n",
        ["Counter2()\nCounter2()\nassert Counter2.count >= 2"],
        ("+= 1", "+= 0"),
    ),
    R(
        "class Money:\n    def __init__(self, cents):\n        self.cents = cents\n    def __str__(self):\n"
        "        return f'${self.cents // 100}.{self.cents % 100:02d}'\n    def __format__(self, spec):\n        return"
        " str(self)\n",
        ["assert str(Money(1234)) == '$12.34'", "assert f'{Money(5)}' == '$0.05'"],
        (":02d", ":d"),
    ),
    R(
        "class Queue:\n    def __init__(self):\n        self._in, self._out = [], []\n    def put(self, x):\n        se"
        "lf._in.append(x)\n"
        "    def get(self):\n        if not self._out:\n            while self._in:\n                self._out.append(s"
        "elf._in.pop())\n"
        "        return self._out.pop()\n",
        [
            "q = Queue()\nfor i in range(3):\n    q.put(i)\nassert [q.get() for _ in range(3)] == [0, 1, 2]",
            "q = Queue()\ntry:\n    q.get()\n    assert False\nexcept IndexError:\n    pass",
        ],
        ("self._out.pop()\n", "self._out.pop(0)\n"),
    ),
    R(
        "class Graph:\n    def __init__(self):\n        self.adj = {}\n    def add(self, a, b):\n        self.adj.setde"
        "fault(a, set()).add(b)\n"
        "        self.adj.setdefault(b, set()).add(a)\n    def neighbours(self, a):\n        return sorted(self.adj.get"
        "(a, ()))\n",
        [
            "g = Graph()\ng.add(1, 2)\ng.add(1, 3)\nassert g.neighbours(1) == [2, 3] and g.neighbours(2) == [1]",
            "assert Graph().neighbours(9) == []",
            "g = Graph()\ng.add('a', 'b')\nassert g.adj == {'a': {'b'}, 'b': {'a'}}",
        ],
        ("self.adj.setdefault(b, set()).add(a)", "pass"),
    ),
    R(
        "class Cache:\n    def __init__(self):\n        self.data = {}\n    def __setitem__(self, k, v):\n        self."
        "data[k] = v\n"
        "    def __getitem__(self, k):\n        return self.data[k]\n    def __delitem__(self, k):\n        del self.da"
        "ta[k]\n"
        "    def __len__(self):\n        return len(self.data)\n",
        [
            "c = Cache()\nc['a'] = 1\nassert c['a'] == 1 and len(c) == 1",
            "c = Cache()\nc[1] = 2\ndel c[1]\nassert len(c) == 0",
        ],
        ("return self.data[k]", "return self.data.get(k, 0) + 1"),
    ),
    R(
        "class Pipeline:\n    def __init__(self):\n        self.steps = []\n    def add(self, f):\n        self.steps.a"
        "ppend(f)\n"
        "        return self\n    def run(self, x):\n        for f in self.steps:\n            x = f(x)\n        return"
        " x\n",
        [
            "assert Pipeline().add(lambda x: x + 1).add(lambda x: x * 3).run(1) == 6",
            "assert Pipeline().add(str).run(5) == '5'",
        ],
        ("for f in self.steps", "for f in reversed(self.steps)"),
    ),
    # callables passed to the program
    R(
        "def apply(f, x):\n    return f(x)\n",
        [
            "assert apply(len, 'abc') == 3",
            "assert apply(lambda v: v * 2, 4) == 8",
            "assert apply(str.upper, 'q') == 'Q'",
            "import math\nassert apply(math.sqrt, 9) == 3",
        ],
        ("f(x)", "f(x[:1]) if isinstance(x, str) else f(x)"),
    ),
    R(
        "def apply_all(fs, x):\n    return [f(x) for f in fs]\n",
        ["assert apply_all([abs, str], -2) == [2, '-2']", "assert apply_all([], 1) == []"],
        ("[f(x) for f in fs]", "[f(x) for f in fs[:1]]"),
    ),
    R(
        "def sort_by(xs, key):\n    return sorted(xs, key=key)\n",
        [
            "assert sort_by(['bb', 'a', 'ccc'], len) == ['a', 'bb', 'ccc']",
            "assert sort_by([(1, 'b'), (2, 'a')], lambda t: t[1]) == [(2, 'a'), (1, 'b')]",
            "def neg(x):\n    return -x\nassert sort_by([1, 3, 2], neg) == [3, 2, 1]",
        ],
        ("key=key", "key=None"),
    ),
    R(
        "def reduce_with(f, xs, start):\n    acc = start\n    for x in xs:\n        acc = f(acc, x)\n    return acc\n",
        [
            "assert reduce_with(lambda a, b: a + b, [1, 2, 3], 0) == 6",
            "assert reduce_with(max, [3, 9, 2], 0) == 9",
            "import operator\nassert reduce_with(operator.mul, [2, 3], 1) == 6",
        ],
        ("acc = f(acc, x)", "acc = f(x, x)"),
    ),
    R(
        "def count_if(pred, xs):\n    return sum(1 for x in xs if pred(x))\n",
        [
            "assert count_if(str.isdigit, ['1', 'a', '22']) == 2",
            "assert count_if(lambda x: x > 1, [1, 2, 3]) == 2",
            "assert count_if(bool, [0, 1, '']) == 1",
        ],
        ("if pred(x)", "if not pred(x)"),
    ),
    R(
        "def retry(f, n):\n    for i in range(n):\n        try:\n            return f()\n        except ValueError:"
        "\n            pass\n"
        "    return None\n",
        [
            "calls = []\ndef flaky():\n    calls.append(1)\n    if len(calls) < 3:\n        raise ValueError\n"
            "    return '"
            "ok'\n"
            "assert retry(flaky, 5) == 'ok' and len(calls) == 3",
            "def never():\n    raise ValueError\nassert retry(never, 2) is None",
        ],
        ("except ValueError", "except KeyError"),
    ),
    R(
        "def total(it):\n    return sum(it)\n",
        [
            "assert total(x * x for x in range(4)) == 14",
            "assert total(iter([1, 2])) == 3",
            "assert total(map(int, '123')) == 6",
        ],
        ("sum(it)", "sum(list(it)[1:])"),
    ),
    R(
        "def take(it, n):\n    return [next(it) for _ in range(n)]\n",
        [
            "def nat():\n    i = 0\n    while True:\n        yield i\n        i += 1\n"
            "assert take(nat(), 3) == [0, 1, 2]",
            "assert take(iter('abc'), 2) == ['a', 'b']",
        ],
        ("range(n)", "range(n - 1)"),
    ),
    R(
        "def memo_call(f, x, cache):\n    if x not in cache:\n        cache[x] = f(x)\n    return cache[x]\n",
        [
            "c = {}\nassert memo_call(lambda v: v + 1, 1, c) == 2 and c == {1: 2}",
            "c = {5: 'hit'}\nassert memo_call(None, 5, c) == 'hit'",
        ],
        ("cache[x] = f(x)", "return f(x)"),
    ),
    R(
        "def make_class():\n    class Local:\n        def hello(self):\n            return 'hi'\n    return Local()\n",
        ["assert make_class() is not None", "assert str(make_class()).startswith('<')"],
        ("return Local()", "return None"),
    ),
    # builtins and the program's own names that shadow library names
    R(
        "def trace(m):\n    return sum(m[i][i] for i in range(len(m)))\ndef transpose(m):\n    return [list(r) for r in"
        " zip(*m)]\n",
        ["assert trace([[1, 2], [3, 4]]) == 5", "assert transpose([[1, 2], [3, 4]]) == [[1, 3], [2, 4]]"],
        ("m[i][i]", "m[i][0]"),
    ),
    R(
        "def sqrt(x):\n    r = x\n    while r * r > x:\n        r = (r + x // r) // 2\n    return r\n"
        "def is_square(n):\n"
        "    return sqrt(n) ** 2 == n\n",
        ["assert sqrt(16) == 4 and sqrt(17) == 4", "assert is_square(49) and not is_square(50)"],
        ("while r * r > x", "while r * r > x + 100"),
    ),
    R(
        "def statistics(xs):\n    return {'min': min(xs), 'max': max(xs)}\ndef spread(xs):\n    s = statistics(xs)\n"
        "    return s['max'] - s['min']\n",
        ["assert statistics([3, 1, 2]) == {'min': 1, 'max': 3}", "assert spread([5, 9]) == 4"],
        ("'max': max(xs)", "'max': sum(xs)"),
    ),
    R(
        "def random(seed):\n    return (seed * 1103515245 + 12345) % 2 ** 31\ndef rolls(seed, n):\n    out = []\n"
        "    for _ in range(n):\n        seed = random(seed)\n        out.append(seed % 6 + 1)\n    return out\n",
        ["assert random(0) == 12345", "assert len(rolls(1, 5)) == 5 and all(1 <= r <= 6 for r in rolls(7, 9))"],
        ("+ 12345", "+ 1"),
    ),
    R(
        "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\ndef lcm(a, b):\n    return a * b // gcd(a"
        ", b)\n",
        ["assert gcd(12, 18) == 6", "assert lcm(4, 6) == 12"],
        ("a * b // gcd(a, b)", "a * b"),
    ),
    R(
        "def pow(a, b):\n    r = 1\n    for _ in range(b):\n        r *= a\n    return r\n",
        ["assert pow(2, 10) == 1024", "assert pow(5, 0) == 1"],
        ("range(b)", "range(b - 1)"),
    ),
    R(
        "from math import isclose\ndef area(r):\n    return 3.14159 * r * r\n",
        ["assert isclose(area(1), 3.14159)", "assert isclose(area(2), 12.56636)"],
        ("r * r", "r * 2"),
    ),
    R(
        "def mx(xs):\n    return max(xs)\ndef total(xs):\n    return sum(xs)\n",
        ["assert mx([1, 5, 2]) == 5", "assert total([1, 2]) == 3 and abs(total([-1])) == 1"],
        ("max(xs)", "min(xs)"),
    ),
    # module-level state and values
    R(
        "TABLE = {'a': (1, 2), 'b': [3]}\ndef look(k):\n    return TABLE[k]\n",
        ["assert TABLE == {'a': (1, 2), 'b': [3]} and type(TABLE['a']) is tuple", "assert look('b') == [3]"],
        ("TABLE[k]", "TABLE.get(k, [3])[:0]"),
    ),
    R(
        "PRIMES = [2, 3, 5, 7]\nLIMIT = 10\n",
        ["assert PRIMES[-1] == 7 and LIMIT == 10", "assert sum(PRIMES) == 17"],
        ("7]", "9]"),
    ),
    R(
        "import math\nTAU = 2 * math.pi\ndef circ(r):\n    return TAU * r\n",
        ["import math\nassert math.isclose(circ(1), 2 * math.pi)", "assert TAU > 6"],
        ("TAU * r", "TAU * r / 2"),
    ),
    R(
        "history = []\ndef log(x):\n    history.append(x)\n    return len(history)\n",
        ["assert log('a') >= 1 and 'a' in history", "n = log('b')\nassert history[n - 1] == 'b'"],
        ("history.append(x)", "history.append(str(x) * 2)"),
    ),
]


MORE = [
    R(
        "count = 0\ndef inc():\n    global count\n    count += 1\n    return count\n",
        ["inc()\ninc()\nassert count >= 2", "before = count\ninc()\nassert count == before + 1"],
        ("count += 1", "count += 0"),
    ),
    R(
        "class Timer:\n    def __init__(self):\n        self.entered = self.exited = False\n    def __enter__(self):\n"
        "        self.entered = True\n        return self\n    def __exit__(self, *exc):\n        self.exited = True"
        "\n        return False\n",
        ["with Timer() as t:\n    assert t.entered\nassert t.exited", "t = Timer()\nassert not t.entered"],
        ("self.exited = True", "pass"),
    ),
    R(
        "class Countdown:\n    def __init__(self, n):\n        self.n = n\n    def __iter__(self):\n        return iter"
        "(range(self.n, 0, -1))\n",
        ["assert list(Countdown(3)) == [3, 2, 1]", "assert sum(Countdown(4)) == 10", "assert 2 in Countdown(2)"],
        ("range(self.n, 0, -1)", "range(self.n, 1, -1)"),
    ),
    R(
        "class Pt:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n    def __eq__(self, o):\n"
        "        return (self.x, self.y) == (o.x, o.y)\n    def __hash__(self):\n"
        "        return hash((self.x, self.y))\n",
        [
            "assert Pt(1, 2) == Pt(1, 2) and Pt(1, 2) != Pt(2, 1)",
            "assert len({Pt(0, 0), Pt(0, 0), Pt(1, 0)}) == 2",
            "d = {Pt(1, 1): 'a'}\nassert d[Pt(1, 1)] == 'a'",
        ],
        ("return hash((self.x, self.y))", "return id(self)"),
    ),
    R(
        "class Celsius:\n    def __init__(self):\n        self._c = 0\n    @property\n    def c(self):\n        return "
        "self._c\n"
        "    @c.setter\n    def c(self, v):\n        if v < -273.15:\n            raise ValueError('too cold')"
        "\n        self._c = v\n",
        [
            "t = Celsius()\nt.c = 25\nassert t.c == 25",
            "t = Celsius()\ntry:\n    t.c = -300\n    assert False\nexcept ValueError:\n    pass",
        ],
        ("v < -273.15", "v < -373.15"),
    ),
    R(
        "class Date:\n    def __init__(self, y, m, d):\n        self.y, self.m, self.d = y, m, d\n    @classmethod\n"
        "    def parse(cls, s):\n        return cls(*map(int, s.split('-')))\n    def tuple(self):\n        return (sel"
        "f.y, self.m, self.d)\n",
        ["assert Date.parse('2020-01-31').tuple() == (2020, 1, 31)", "assert isinstance(Date.parse('1-2-3'), Date)"],
        ("map(int, s.split('-'))", "map(int, s.split('-')[::-1])"),
    ),
    R(
        "class Animal:\n    def __init__(self, name):\n        self.name = name\n    def speak(self):\n        return '"
        "...'\n"
        "class Dog(Animal):\n    def __init__(self, name):\n        super().__init__(name)\n    def speak(self):"
        "\n        return self.name + ': woof'\n",
        [
            "assert Dog('rex').speak() == 'rex: woof'",
            "assert Animal('a').speak() == '...'",
            "assert isinstance(Dog('x'), Animal)",
        ],
        ("self.name + ': woof'", "'woof'"),
    ),
    R(
        "import abc\nclass Base(abc.ABC):\n    @abc.abstractmethod\n    def run(self):\n        ...\nclass Impl(Base):"
        "\n    def run(self):\n        return 42\n",
        [
            "assert Impl().run() == 42",
            "assert isinstance(Impl(), Base)",
            "try:\n    Base()\n    assert False\nexcept TypeError:\n    pass",
        ],
        ("return 42", "return 24"),
    ),
    R(
        "class Slotted:\n    __slots__ = ('a', 'b')\n    def __init__(self, a, b):\n        self.a, self.b = a, b"
        "\n    def total(self):\n        return self.a + self.b\n",
        ["assert Slotted(1, 2).total() == 3", "s = Slotted(1, 1)\ns.a = 5\nassert s.total() == 6"],
        ("self.a + self.b", "self.a * self.b"),
    ),
    R(
        "import functools\ndef product(xs):\n    return functools.reduce(lambda a, b: a * b, xs, 1)\n",
        ["assert product([2, 3, 4]) == 24", "assert product([]) == 1"],
        ("xs, 1)", "xs, 0)"),
    ),
    R(
        "import itertools\ndef runs(s):\n    return [(k, len(list(g))) for k, g in itertools.groupby(s)]\n",
        ["assert runs('aaabcc') == [('a', 3), ('b', 1), ('c', 2)]", "assert runs('') == []"],
        ("len(list(g))", "1"),
    ),
    R(
        "def rank(people):\n    return sorted(people, key=lambda p: (-p[1], p[0]))\n",
        ["assert rank([('b', 2), ('a', 2), ('c', 3)]) == [('c', 3), ('a', 2), ('b', 2)]"],
        ("(-p[1], p[0])", "(-p[1],)"),
    ),
    R(
        "def fib_memo(n, memo={}):\n    if n < 2:\n        return n\n    if n not in memo:\n        memo[n] = fib_memo("
        "n - 1) + fib_memo(n - 2)\n    return memo[n]\n",
        ["assert fib_memo(80) == 23416728348467685", "assert fib_memo(1) == 1"],
        ("fib_memo(n - 2)", "fib_memo(n - 1)"),
    ),
    R(
        "def percent(a, b):\n    return '%.1f%%' % (100 * a / b)\n",
        ["assert percent(1, 3) == '33.3%'", "assert percent(2, 2) == '100.0%'"],
        ("%.1f%%", "%.0f%%"),
    ),
    R(
        "def bits(n):\n    return bin(n).count('1')\ndef is_pow2(n):\n    return n > 0 and n & (n - 1) == 0\n",
        ["assert bits(255) == 8 and bits(0) == 0", "assert is_pow2(64) and not is_pow2(6) and not is_pow2(0)"],
        ("n & (n - 1) == 0", "n & (n + 1) == 0"),
    ),
    R(
        "def matmul(a, b):\n    return [[sum(x * y for x, y in zip(r, c)) for c in zip(*b)] for r in a]\n",
        [
            "assert matmul([[1, 2], [3, 4]], [[5, 6], [7, 8]]) == [[19, 22], [43, 50]]",
            "assert matmul([[2]], [[3]]) == [[6]]",
        ],
        ("zip(*b)", "b"),
    ),
    R(
        "def bsearch(xs, t):\n    lo, hi = 0, len(xs) - 1\n    while lo <= hi:\n        mid = (lo + hi) // 2\n        i"
        "f xs[mid] == t:\n"
        "            return mid\n        if xs[mid] < t:\n            lo = mid + 1\n        else:\n            hi = mid"
        " - 1\n    return -1\n",
        ["assert bsearch([1, 3, 5, 7], 7) == 3", "assert bsearch([1, 3], 2) == -1", "assert bsearch([], 1) == -1"],
        ("lo <= hi", "lo < hi"),
    ),
    R(
        "def two_sum(xs, t):\n    seen = {}\n    for i, x in enumerate(xs):\n        if t - x in seen:\n            ret"
        "urn (seen[t - x], i)\n"
        "        seen[x] = i\n    return None\n",
        [
            "assert two_sum([2, 7, 11, 15], 9) == (0, 1)",
            "assert two_sum([3, 3], 6) == (0, 1)",
            "assert two_sum([1], 5) is None",
        ],
        ("return (seen[t - x], i)", "return (i, seen[t - x])"),
    ),
    R(
        "def anagrams(words):\n    groups = {}\n    for w in words:\n        groups.setdefault(''.join(sorted(w)), [])."
        "append(w)\n"
        "    return sorted(sorted(g) for g in groups.values())\n",
        [
            "assert anagrams(['eat', 'tea', 'tan', 'nat', 'bat']) == [['bat'], ['eat', 'tea'], ['nat', 'tan']]",
            "assert anagrams(['ab', 'ba', 'c']) == [['ab', 'ba'], ['c']]",
        ],
        ("''.join(sorted(w))", "w"),
    ),
    R(
        "def sieve(n):\n    is_p = [True] * (n + 1)\n    is_p[:2] = [False, False]\n    for i in range(2, int(n ** 0.5)"
        " + 1):\n"
        "        if is_p[i]:\n            is_p[i * i::i] = [False] * len(is_p[i * i::i])\n    return [i for i, p in enu"
        "merate(is_p) if p]\n",
        ["assert sieve(30) == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]", "assert len(sieve(10000)) == 1229"],
        ("int(n ** 0.5) + 1", "int(n ** 0.5)"),
    ),
    R(
        "def roman(n):\n    vals = [(1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'), (100, 'C'), (90, 'XC'), (50, 'L'"
        "), (40, 'XL'),\n"
        "            (10, 'X'), (9, 'IX'), (5, 'V'), (4, 'IV'), (1, 'I')]\n    out = ''\n    for v, s in vals:"
        "\n        while n >= v:\n"
        "            out += s\n            n -= v\n    return out\n",
        ["assert roman(1994) == 'MCMXCIV'", "assert roman(4) == 'IV'", "assert roman(3888) == 'MMMDCCCLXXXVIII'"],
        ("(4, 'IV'), ", ""),
    ),
    R(
        "def rle(s):\n    out = []\n    for c in s:\n        if out and out[-1][0] == c:\n            out[-1][1] += 1"
        "\n        else:\n"
        "            out.append([c, 1])\n    return ''.join(f'{c}{k}' for c, k in out)\n",
        ["assert rle('aaabb') == 'a3b2'", "assert rle('') == ''", "assert rle('abc') == 'a1b1c1'"],
        ("out[-1][1] += 1", "out[-1][1] = 2"),
    ),
    R(
        "def balanced(s):\n    pairs, stack = {')': '(', ']': '[', '}': '{'}, []\n    for c in s:\n        if c in '([{"
        "':\n"
        "            stack.append(c)\n        elif c in pairs:\n            if not stack or stack.pop() != pairs[c]:"
        "\n                return False\n"
        "    return not stack\n",
        ["assert balanced('([]{})')", "assert not balanced('(]')", "assert not balanced('((')"],
        ("return not stack", "return True"),
    ),
    R(
        "def merge(intervals):\n    out = []\n    for a, b in sorted(intervals):\n        if out and a <= out[-1][1]:\n"
        "            out[-1][1] = max(out[-1][1], b)\n        else:\n            out.append([a, b])\n    return out\n",
        ["assert merge([[1, 3], [2, 6], [8, 10]]) == [[1, 6], [8, 10]]", "assert merge([[1, 4], [4, 5]]) == [[1, 5]]"],
        ("a <= out[-1][1]", "a < out[-1][1]"),
    ),
    R(
        "def lcs(a, b):\n    dp = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]\n    for i in range(len(a)):"
        "\n        for j in range(len(b)):\n"
        "            dp[i + 1][j + 1] = dp[i][j] + 1 if a[i] == b[j] else max(dp[i][j + 1], dp[i + 1][j])\n    return d"
        "p[-1][-1]\n",
        ["assert lcs('abcde', 'ace') == 3", "assert lcs('', 'a') == 0"],
        ("dp[i][j] + 1", "dp[i][j]"),
    ),
    R(
        "def knap(items, cap):\n    best = [0] * (cap + 1)\n    for w, v in items:\n        for c in range(cap, w - 1, "
        "-1):\n"
        "            best[c] = max(best[c], best[c - w] + v)\n    return best[cap]\n",
        ["assert knap([(1, 1), (3, 4), (4, 5), (5, 7)], 7) == 9", "assert knap([], 5) == 0"],
        ("max(best[c], best[c - w] + v)", "best[c - w] + v"),
    ),
    R(
        "from collections import deque\ndef steps(grid):\n    h, w = len(grid), len(grid[0])\n    q, seen = deque([(0, "
        "0, 0)]), {(0, 0)}\n"
        "    while q:\n        r, c, d = q.popleft()\n        if (r, c) == (h - 1, w - 1):\n            return d\n"
        "        for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1)):\n            nr, nc = r + dr, c + dc\n"
        "            if 0 <= nr < h and 0 <= nc < w and grid[nr][nc] == '.' and (nr, nc) not in seen:\n"
        "                seen.add((nr, nc))\n                q.append((nr, nc, d + 1))\n    return -1\n",
        [
            "assert steps(['..', '..']) == 2",
            "assert steps(['.#', '#.']) == -1",
            "assert steps(['...', '##.', '...']) == 4",
        ],
        ("d + 1", "d + 2"),
    ),
    R(
        "def perms(xs):\n    if len(xs) <= 1:\n        yield list(xs)\n        return\n    for i in range(len(xs)):\n"
        "        for p in perms(xs[:i] + xs[i + 1:]):\n            yield [xs[i]] + p\n",
        [
            "assert sorted(perms([1, 2, 3])) == "
            "sorted([[1, 2, 3], [1, 3, 2], [2, 1, 3], [2, 3, 1], [3, 1, 2], [3, 2, 1]])",
            "assert list(perms([])) == [[]]",
        ],
        ("xs[:i] + xs[i + 1:]", "xs[i + 1:]"),
    ),
    R(
        "import datetime\ndef weekday(y, m, d):\n    return datetime.date(y, m, d).strftime('%A')\n",
        ["assert weekday(2024, 1, 1) == 'Monday'", "assert weekday(2000, 2, 29) == 'Tuesday'"],
        ("%A", "%a"),
    ),
    R(
        "from decimal import Decimal\ndef total(prices):\n    return sum((Decimal(p) for p in prices), Decimal('0'))\n",
        [
            "from decimal import Decimal\nassert total(['0.10', '0.20']) == Decimal('0.30')",
            "assert str(total([])) == '0'",
        ],
        ("Decimal(p) for p in prices", "Decimal(float(p)) for p in prices"),
    ),
    R(
        "from fractions import Fraction\ndef cf(x, n):\n    out = []\n    for _ in range(n):\n        a = x.numerator /"
        "/ x.denominator\n"
        "        out.append(a)\n        x -= a\n        if x == 0:\n            break\n        x = 1 / x\n    return ou"
        "t\n",
        [
            "from fractions import Fraction\nassert cf(Fraction(415, 93), 10) == [4, 2, 6, 7]",
            "from fractions import Fraction\nassert cf(Fraction(3), 5) == [3]",
        ],
        ("x = 1 / x", "x = x"),
    ),
    R(
        "import enum\nclass Color(enum.Enum):\n    RED = 'r'\n    GREEN = 'g'\n    BLUE = 'b'\ndef names():\n    return"
        " [c.name for c in Color]\n",
        [
            "assert names() == ['RED', 'GREEN', 'BLUE']",
            "assert [c.value for c in Color] == ['r', 'g', 'b']",
            "assert Color('g') is Color.GREEN",
            "assert len(Color) == 3 and Color['BLUE'].value == 'b'",
        ],
        ("c.name for c", "c.value for c"),
    ),
    R(
        "from dataclasses import dataclass, field, asdict\n@dataclass\nclass Order:\n    id: int\n    items: list = fie"
        "ld(default_factory=list)\n"
        "def order(i, *items):\n    return Order(i, list(items))\n",
        [
            "assert order(1, 'a').items == ['a']",
            "import dataclasses\nassert dataclasses.asdict(order(2)) == {'id': 2, 'items': []}",
            "assert order(3, 'x') == order(3, 'x')",
        ],
        ("list(items)", "list(items[1:])"),
    ),
    R(
        "from dataclasses import dataclass\n@dataclass\nclass P:\n    name: str\n    age: int\ndef oldest(pairs):\n"
        "    people = [P(n, a) for n, a in pairs]\n    return max(people, key=lambda p: p.age)\n",
        ["assert oldest([('a', 3), ('b', 9)]).name == 'b'", "assert oldest([('z', 1)]).age == 1"],
        ("max(people", "min(people"),
    ),
    R(
        "import cmath\ndef roots(a, b, c):\n    d = cmath.sqrt(b * b - 4 * a * c)\n    return ((-b + d) / (2 * a), (-b "
        "- d) / (2 * a))\n",
        ["assert roots(1, 0, 1) == (1j, -1j)", "assert roots(1, -3, 2) == (2, 1)"],
        ("(2 * a)", "a"),
    ),
    R(
        "class AppError(Exception):\n    pass\nclass NotFound(AppError):\n    pass\ndef find(d, k):\n"
        "    if k not in d:\n"
        "        raise NotFound(k)\n    return d[k]\n",
        [
            "try:\n    find({}, 'x')\nexcept AppError as e:\n    assert isinstance(e, NotFound)\nelse:\n"
            "    assert False",
            "assert find({'a': 1}, 'a') == 1",
            "try:\n    find({}, 1)\nexcept NotFound:\n    pass",
        ],
        ("raise NotFound(k)", "raise KeyError(k)"),
    ),
    R(
        "def ops():\n    return {'add': lambda a, b: a + b, 'neg': lambda a: -a}\n",
        ["assert ops()['add'](1, 2) == 3", "assert ops()['neg'](4) == -4", "assert sorted(ops()) == ['add', 'neg']"],
        ("-a}", "a}"),
    ),
    R(
        "def evens_forever():\n    n = 0\n    while True:\n        yield n\n        n += 2\n",
        [
            "g = evens_forever()\nassert [next(g) for _ in range(3)] == [0, 2, 4]",
            "import itertools\nassert list(itertools.islice(evens_forever(), 2, 4)) == [4, 6]",
        ],
        ("n += 2", "n += 1"),
    ),
    R(
        "def append_to(x, xs=None):\n    if xs is None:\n        xs = []\n    xs.append(x)\n    return xs\n",
        [
            "assert append_to(1) == [1] and append_to(2) == [2]",
            "ys = [0]\nassert append_to(1, ys) is ys and ys == [0, 1]",
        ],
        ("    if xs is None:\n        xs = []\n", "    xs = list(xs or [])\n"),
    ),
    R(
        "import base64\ndef b64(s):\n    return base64.b64encode(s.encode()).decode()\n",
        ["assert b64('hi') == 'aGk='", "assert b64('') == ''"],
        ("b64encode", "b32encode"),
    ),
    R(
        "import json\ndef roundtrip(obj):\n    return json.loads(json.dumps(obj))\n",
        ["assert roundtrip({'a': [1, 2.5, None]}) == {'a': [1, 2.5, None]}", "assert roundtrip((1, 2)) == [1, 2]"],
        ("json.loads(json.dumps(obj))", "json.loads(json.dumps(obj, default=str)) if isinstance(obj, dict) else obj"),
    ),
    R(
        "def double(x):\n    return 2 * x\ndef apply(f, x):\n    return f(x)\n",
        [
            "assert apply(double, 3) == 6",
            "assert apply(lambda x: double(x) + 1, 3) == 7",
            "assert list(map(double, [1, 2])) == [2, 4]",
        ],
        ("return 2 * x", "return x + 2"),
    ),
    R(
        "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, xs):\n        self.items.ex"
        "tend(xs)\n"
        "        xs.clear()\ndef make(cls):\n    return cls()\n",
        [
            "assert isinstance(make(Stack), Stack)",
            "s = make(Stack)\nxs = [1, 2]\ns.push(xs)\nassert xs == [] and s.items == [1, 2]",
        ],
        ("        xs.clear()\n", ""),
    ),
    R(
        "def stable(pairs):\n    return sorted(pairs, key=lambda p: p[0])\n",
        ["assert stable([(1, 'b'), (0, 'z'), (1, 'a')]) == [(0, 'z'), (1, 'b'), (1, 'a')]"],
        ("key=lambda p: p[0]", "key=None"),
    ),
]


# ------------------------------------------------------------------------------------------------ families
def _value_rows():
    """One function per value shape, returning it; the test compares and uses it as Python would."""
    shapes = [  # (expression of n, test on f(3), wrong expression)
        ("[i * i for i in range(n)]", "assert f(3) == [0, 1, 4] and f(3).index(4) == 2", "[i * 2 for i in range(n)]"),
        ("tuple(range(n))", "assert f(3) == (0, 1, 2) and f(3).count(1) == 1", "tuple(range(1, n))"),
        ("set(range(n))", "assert f(3) == {0, 1, 2} and f(3).issuperset({1})", "set(range(n - 1))"),
        (
            "{i: str(i) for i in range(n)}",
            "assert f(3) == {0: '0', 1: '1', 2: '2'} and f(3).get(2) == '2'",
            "{i: i for i in range(n)}",
        ),
        (
            "'-'.join(map(str, range(n)))",
            "assert f(3) == '0-1-2' and f(3).split('-') == ['0', '1', '2']",
            "','.join(map(str, range(n)))",
        ),
        ("bytes(range(n))", "assert f(3) == b'\\x00\\x01\\x02' and f(3).hex() == '000102'", "bytes(n)"),
        ("bytearray(b'x' * n)", "assert f(3) == bytearray(b'xxx') and f(3).upper() == b'XXX'", "bytearray(n)"),
        ("n / 2", "assert f(3) == 1.5 and f(3).is_integer() is False", "n // 2"),
        ("n ** 100", "assert f(3) == 3 ** 100 and f(3).bit_length() == 159", "n ** 99"),
        ("complex(n, -n)", "assert f(3) == 3 - 3j and f(3).conjugate() == 3 + 3j", "complex(n, n)"),
        ("n > 2", "assert f(3) is True and f(2) is False", "n >= 2"),
        ("None if n else 0", "assert f(3) is None and f(0) == 0", "0 if n else None"),
        ("[[n] * n for _ in range(n)]", "assert f(3) == [[3, 3, 3]] * 3", "[[n] * n]"),
        ("{'k': [n, {'d': (n,)}]}", "assert f(3)['k'][1]['d'] == (3,)", "{'k': [n, {'d': [n]}]}"),
        ("frozenset({n, -n})", "assert f(3) == frozenset({3, -3}) and -3 in f(3)", "frozenset({n})"),
        ("str(n) * 600001", "assert len(f(3)) == 600001 and f(3)[:2] == '33'", "str(n) * 600000"),
        ("'[{' * 200000 * n", "assert f(3) == '[{' * 600000 and f(3).count('{') == 600000", "'[{' * 200000"),
        ("list(range(n * 100000))", "assert f(3)[-1] == 299999 and len(f(3)) == 300000", "list(range(n * 99999))"),
        ("'é✓' * n", "assert f(3) == 'é✓é✓é✓' and f(3).encode() == 'é✓é✓é✓'.encode()", "'e✓' * n"),
        ("-0.0 if n else 0.0", "import math\nassert f(3) == 0 and math.copysign(1, f(3)) == -1", "0.0"),
        ("float('1e308') * n", "assert f(3) == float('inf')", "1e308"),
        (
            "{(i, i + 1): i for i in range(n)}",
            "assert f(3)[(1, 2)] == 1 and (2, 3) in f(3)",
            "{(i, i): i for i in range(n)}",
        ),
        (
            "[None, True, 1, 1.0, '1', b'1']",
            "assert f(3) == [None, True, 1, 1.0, '1', b'1'] and type(f(3)[3]) is float",
            "[None, True, 1, 1, '1', b'1']",
        ),
        (
            "__import__('fractions').Fraction(n, 4)",
            "from fractions import Fraction\nassert f(3) == Fraction(3, 4) and f(3).limit_denominator(2) == 1",
            "__import__('fractions').Fraction(n, 5)",
        ),
        (
            "__import__('decimal').Decimal(n) / 4",
            "from decimal import Decimal\nassert f(3) == Decimal('0.75')",
            "__import__('decimal').Decimal(n) / 5",
        ),
    ]
    return [
        R(f"def f(n):\n    return {expr}\n", [test, "assert f(3) == f(3)"], (expr, wrong))
        for expr, test, wrong in shapes
    ]


def _arithmetic_rows():
    """Templates x values: one small function per operator, each with its own constants."""
    ops = [("+", "-"), ("-", "+"), ("*", "+"), ("//", "/"), ("%", "//"), ("**", "*")]
    rows = []
    for (op, wrong), (a, b) in itertools.product(ops, [(7, 3), (12, 5), (2, 9), (100, 7)]):
        expected = eval(f"{a} {op} {b}")
        program = f"def calc(a, b):\n    return a {op} b\n"
        tests = [
            f"assert calc({a}, {b}) == {expected!r}",
            f"assert calc({b}, {a}) == {eval(f'{b} {op} {a}')!r}",
            f"assert calc(1, 1) == {eval(f'1 {op} 1')!r}",
        ]
        rows.append(R(program, tests, (f"a {op} b", f"a {wrong} b")))
    return rows


def _string_rows():
    """Templates x values: string methods the program applies, the test checks with str methods of its own."""
    methods = [
        ("upper()", "lower()"),
        ("strip()", "lstrip()"),
        ("swapcase()", "upper()"),
        ("title()", "capitalize()"),
        ("replace('a', 'o')", "replace('o', 'a')"),
        ("center(9, '*')", "ljust(9, '*')"),
        ("zfill(6)", "rjust(6)"),
        ("split(',')", "split()"),
        ("casefold()", "lower().upper()"),
        ("expandtabs(2)", "expandtabs(4)"),
    ]
    rows = []
    for (method, wrong), text in itertools.product(methods, [" a,Ba\tn ", "Xa ,y"]):
        expected = eval(f"{text!r}.{method}")
        wrong_value = eval(f"{text!r}.{wrong}")
        if expected == wrong_value:
            continue
        program = f"def fix(s):\n    return s.{method}\n"
        tests = [
            f"assert fix({text!r}) == {expected!r}",
            f"assert fix('') == {eval(repr('') + '.' + method)!r}",
            f"assert type(fix({text!r})) is {type(expected).__name__}",
        ]
        rows.append(R(program, tests, (f"s.{method}", f"s.{wrong}")))
    return rows


def _io_rows():
    """stdin/stdout tasks: the program as a script."""

    def cases(pairs):
        return [{"input": i, "output": o} for i, o in pairs]

    return [
        R(
            "a, b = map(int, input().split())\nprint(a + b)\n",
            cases([("1 2\n", "3"), ("5 5\n", "10"), ("0 0\n", "0")]),
            ("a + b", "a * b"),
        ),
        R(
            "import sys\nnums = [int(x) for x in sys.stdin.read().split()]\nprint(max(nums))\n",
            cases([("1 9 3\n", "9"), ("-1\n-5\n", "-1")]),
            ("max(nums)", "nums[-1]"),
        ),
        R(
            "n = int(input())\nfor i in range(1, n + 1):\n    print('*' * i)\n",
            cases([("3\n", "*\n**\n***"), ("1\n", "*")]),
            ("range(1, n + 1)", "range(n)"),
        ),
        R("s = input()\nprint(s[::-1])\n", cases([("abc\n", "cba"), ("x\n", "x")]), ("s[::-1]", "s[:0:-1]")),
        R(
            "n = int(input())\nprint(f'{n / 3:.4f}')\n",
            cases([("1\n", "0.3333"), ("3\n", "1.0000")]),
            ("n / 3", "n / 3.001"),
        ),
        R(
            "t = int(input())\nfor _ in range(t):\n    a, b = map(int, input().split())\n    print(a * b)\n",
            cases([("2\n2 3\n4 5\n", "6\n20"), ("1\n0 7\n", "0")]),
            ("a * b", "a * b + 0 ** a"),
        ),
        R(
            "import sys\nfor line in sys.stdin:\n    print(len(line.strip()))\n",
            cases([("ab\nc\n", "2\n1"), ("\n", "0")]),
            ("len(line.strip())", "len(line)"),
        ),
        R(
            "from collections import Counter\nc = Counter(input().split())\nfor w, k in sorted(c.items()):\n    print(w"
            ", k)\n",
            cases([("b a b\n", "a 1\nb 2"), ("z\n", "z 1")]),
            ("sorted(c.items())", "c.items()"),
        ),
        R(
            "x = float(input())\nprint(x ** 0.5)\n",
            cases([("2\n", "1.41421356"), ("9\n", "3.0")]),
            ("x ** 0.5", "x / 2"),
        ),
        R(
            "def main():\n    n = int(input())\n    print(sum(range(n + 1)))\nif __name__ == '__main__':\n    main()\n",
            cases([("10\n", "55"), ("0\n", "0")]),
            ("range(n + 1)", "range(n)"),
        ),
    ]


def _named_class_rows():
    """Tasks that are a class: the tests build it and call its methods (the class is the entry point)."""
    return [
        R(
            f"class {name}:\n    def __init__(self):\n        self.data = {init}\n    def add(self, x):\n"
            f"        self.data.{op}(x)\n        return self\n    def size(self):\n        return len(self.data)\n",
            [
                f"o = {name}()\no.add(1).add(2)\nassert o.size() == {after}",
                f"assert {name}().size() == 0",
                f"assert isinstance({name}(), {name})",
            ],
            (f"self.data.{op}(x)", "pass"),
        )
        for name, init, op, after in [
            ("Bag", "[]", "append", 2),
            ("Uniq", "set()", "add", 2),
            ("Log", "[]", "append", 2),
            ("Pool", "set()", "add", 2),
        ]
    ]


def _loop_rows():
    """Templates x values: classic small tasks with their classic mistakes."""
    tasks = [
        ("def run(xs):\n    return sorted(xs)\n", "sorted(xs)", "xs", "run({v}) == {sorted}"),
        ("def run(xs):\n    return sum(xs)\n", "sum(xs)", "sum(xs[1:])", "run({v}) == {sum}"),
        ("def run(xs):\n    return max(xs)\n", "max(xs)", "xs[0]", "run({v}) == {max}"),
        ("def run(xs):\n    return len(set(xs))\n", "len(set(xs))", "len(xs)", "run({v}) == {nuniq}"),
        ("def run(xs):\n    return xs[::-1]\n", "xs[::-1]", "xs[::-1][1:] + xs[:1]", "run({v}) == {rev}"),
        ("def run(xs):\n    return [x for x in xs if x % 2 == 0]\n", "x % 2 == 0", "x % 2", "run({v}) == {evens}"),
        (
            "def run(xs):\n    out = 0\n    for x in xs:\n        out = out * 10 + x\n    return out\n",
            "out * 10 + x",
            "out + x",
            "run({v}) == {digits}",
        ),
    ]
    values = [[3, 1, 2], [5, 5, 9, 0], [8, 6, 7, 5, 3, 0, 9], [1, 2]]
    rows = []
    for (program, old, new, test), v in itertools.product(tasks, values):
        facts = {
            "v": v,
            "sorted": sorted(v),
            "sum": sum(v),
            "max": max(v),
            "nuniq": len(set(v)),
            "rev": v[::-1],
            "evens": [x for x in v if x % 2 == 0],
            "digits": int("".join(map(str, v))),
        }
        tests = ["assert " + test.format(**facts), "assert run(" + repr(v) + ") == run(list(" + repr(v) + "))"]
        wrong = program.replace(old, new)
        namespace: dict = {}
        exec(wrong, namespace)
        if eval(test.format(**facts), namespace):  # this value does not tell the mistake
            continue
        rows.append(R(program, tests, wrong))
    return rows


# ------------------------------------------------------------------------------------------------ Python's habits
_LISTNODE = answer_attacks.LISTNODE_SETUP
_TREENODE = """
class TreeNode:
    def __init__(self, val=0, left=None, right=None):
        self.val = val
        self.left = left
        self.right = right
def tree(xs, i=0):
    if i >= len(xs) or xs[i] is None:
        return None
    return TreeNode(xs[i], tree(xs, 2 * i + 1), tree(xs, 2 * i + 2))
"""


def _habit_rows():
    """Correct programs of the kinds public code-RL data is full of, that only plain Python's own behaviour scores
    right (issue 65): `exit()` at the end of a script, the test's own objects (a LeetCode ListNode built by the
    row's setup, a regex, a StringIO, an array), integers past 4,300 digits, the test's random/decimal/recursion
    state, identity and aliasing, introspection, a NamedTuple with methods."""

    def cases(pairs):
        return [{"input": i, "output": o} for i, o in pairs]

    big = "1" + "0" * 5000
    reverse = (
        "def reverse(head):\n    prev = None\n    while head:\n"
        "        head.next, prev, head = prev, head, head.next\n    return prev\n"
    )
    double = (
        "def double(head):\n    dummy = tail = ListNode()\n    while head:\n"
        "        tail.next = ListNode(head.val * 2)\n"
        "        tail, head = tail.next, head.next\n    return dummy.next\n"
    )
    cycle = (
        "def has_cycle(head):\n    seen = set()\n    while head:\n        if head in seen:\n            return True\n"
        "        seen.add(head)\n        head = head.next\n    return False\n"
    )
    return [
        # exit() and quit(): the site module's builtins, a habit of competitive programmers
        R(
            "a, b = map(int, input().split())\nprint(a + b)\nexit()\n",
            cases([("1 2\n", "3"), ("2 2\n", "4")]),
            ("a + b", "a - b"),
        ),
        R("a, b = map(int, input().split())\nprint(a * b)\nquit(0)\n", cases([("2 3\n", "6")]), ("a * b", "a + b")),
        R(
            "n = int(input())\nif n == 0:\n    print('zero')\n    exit(0)\nprint(n * 2)\n",
            cases([("0\n", "zero"), ("4\n", "8")]),
            ("n * 2", "n * 3"),
        ),
        R(
            "def main():\n    n = int(input())\n    print(n + 1)\n    exit()\nmain()\n",
            cases([("4\n", "5")]),
            ("n + 1", "n"),
        ),
        R("import sys\nprint(sum(map(int, sys.stdin)))\nsys.exit()\n", cases([("1\n2\n", "3")]), ("sum(", "max(")),
        R(
            "def check(n):\n    if n < 0:\n        exit(2)\n    return n\n",
            [
                "try:\n    check(-1)\n    assert False\nexcept SystemExit as e:\n    assert e.code == 2",
                "assert check(3) == 3",
            ],
            ("exit(2)", "exit(3)"),
        ),
        R(
            "print(copyright is not None and license is not None and help is not None)\n",
            cases([("", "True")]),
            ("print(", "print(not "),
        ),
        # the test's own objects: they stay the test's, the program reads and changes them
        R(
            reverse,
            [
                "assert to_list(reverse(build([1, 2, 3]))) == [3, 2, 1]",
                "assert reverse(None) is None",
                "h = build([1, 2])\nr = reverse(h)\nassert r.next is h and h.next is None",
            ],
            "def reverse(head):\n    return head\n",
            setup=_LISTNODE,
        ),
        R(
            double,
            [
                "assert to_list(double(build([1, 2, 3]))) == [2, 4, 6]",
                "assert isinstance(double(build([1])), ListNode)",
            ],
            ("head.val * 2", "head.val + 2"),
            setup=_LISTNODE,
        ),
        R(
            cycle,
            ["h = build([1, 2, 3])\nh.next.next.next = h\nassert has_cycle(h)", "assert not has_cycle(build([1, 2]))"],
            "def has_cycle(head):\n    return False\n",
            setup=_LISTNODE,
        ),
        R(
            "def depth(root):\n    if not root:\n        return 0\n"
            "    return 1 + max(depth(root.left), depth(root.right))\n",
            ["assert depth(tree([3, 9, 20, None, None, 15, 7])) == 3", "assert depth(None) == 0"],
            ("max(depth(root.left), depth(root.right))", "depth(root.left)"),
            setup=_TREENODE,
        ),
        R(
            "def invert(root):\n    if root:\n"
            "        root.left, root.right = invert(root.right), invert(root.left)\n    return root\n",
            ["t = tree([1, 2, 3])\nassert invert(t) is t and (t.left.val, t.right.val) == (3, 2)"],
            ("invert(root.right), invert(root.left)", "invert(root.left), invert(root.right)"),
            setup=_TREENODE,
        ),
        R(
            "def count(pattern, s):\n    return len(pattern.findall(s))\n",
            ["import re\nassert count(re.compile(r'a+'), 'aa b a') == 2"],
            ("len(pattern.findall(s))", "len(s)"),
        ),
        R(
            "def first(stream):\n    return stream.readline().strip() + stream.read()\n",
            ["import io\nassert first(io.StringIO('a\\nbc')) == 'abc'"],
            ("stream.read()", "''"),
        ),
        R(
            "def total(stream):\n    return sum(int(line) for line in stream)\n",
            ["import io\nassert total(io.StringIO('1\\n2\\n3\\n')) == 6"],
            ("sum(", "max("),
        ),
        R(
            "def total(arr):\n    arr.append(4)\n    return sum(arr)\n",
            ["import array\na = array.array('i', [1, 2, 3])\nassert total(a) == 10 and len(a) == 4"],
            ("arr.append(4)", "pass"),
        ),
        # integers past Python 3.11's 4,300-digit str limit
        R(
            "import sys\nsys.set_int_max_str_digits(0)\na, b = map(int, input().split())\nprint(a + b)\n",
            cases([(big + " 1\n", big[:-1] + "1"), ("1 2\n", "3"), ("-" + big + " 0\n", "-" + big)]),
            ("a + b", "a - b"),
        ),
        # the interpreter's state a test shares with the function it calls
        R(
            "import random\ndef roll():\n    return random.randint(1, 6)\n",
            [
                "import random\nrandom.seed(1)\nexpected = [random.randint(1, 6) for _ in range(3)]\nrandom.seed(1)\n"
                "assert [roll() for _ in range(3)] == expected",
                "import random\nrandom.seed(5)\nroll()\nnext_one = random.random()\n"
                "random.seed(5)\nrandom.randint(1, 6)\n"
                "assert random.random() == next_one",
            ],
            ("randint(1, 6)", "randint(2, 7)"),
        ),
        R(
            "from decimal import Decimal\ndef third():\n    return Decimal(1) / Decimal(3)\n",
            ["import decimal\ndecimal.getcontext().prec = 5\nassert str(third()) == '0.33333'"],
            ("Decimal(3)", "Decimal(4)"),
        ),
        R(
            "def depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\n",
            ["import sys\nsys.setrecursionlimit(10000)\nassert depth(5000) == 5000"],
            ("1 + depth", "2 + depth"),
        ),
        # identity, aliasing, order
        R(
            "def grid(n):\n    row = [0] * n\n    return [row] * n\n",
            ["g = grid(3)\ng[0][0] = 1\nassert g[1][0] == 1"],
            "def grid(n):\n    return [[0] * n for _ in range(n)]\n",
        ),
        R(
            "def name():\n    return 'alice'\n",
            ["assert name() is name()"],
            "def name():\n    return ''.join(['ali', 'ce'])\n",
        ),
        R(
            "def shrink():\n    s = set(range(100))\n    for i in range(95):\n        s.discard(i)\n    return s\n",
            ["assert list(shrink()) == [95, 96, 97, 98, 99]"],
            ("range(95)", "range(96)"),
        ),
        # a container the program keeps is the test's own, both ways, for the rest of the test
        R(
            "saved = []\ndef keep(xs):\n    saved.append(xs)\ndef total():\n    return sum(sum(x) for x in saved)\n",
            ["xs = [1]\nkeep(xs)\nxs.append(5)\nassert total() == 6"],
            ("saved.append(xs)", "saved.append(list(xs))"),
        ),
        R(
            "history = []\ndef log(x):\n    history.append(x)\n    return history\n",
            ["h = log(1)\nh.append(99)\nassert log(2) == [1, 99, 2] and log(3) is h and h == [1, 99, 2, 3]"],
            ("return history", "return list(history)"),
        ),
        R(
            "store = {}\ndef attach(d):\n    store['d'] = d\ndef bump():\n    store['d']['n'] += 1\n",
            ["d = {'n': 0}\nattach(d)\nbump()\nbump()\nassert d == {'n': 2}"],
            ("store['d'] = d", "store['d'] = dict(d)"),
        ),
        R(
            "class Stack:\n    def __init__(self, items):\n        self.items = items\n    def push(self, x):\n"
            "        self.items.append(x)\n",
            ["xs = []\ns = Stack(xs)\ns.push(1)\ns.push(2)\nassert xs == [1, 2]"],
            ("self.items = items", "self.items = list(items)"),
        ),
        # introspection
        R(
            "def f(x):\n    'Double x.'\n    return 2 * x\n",
            ["assert f.__doc__ == 'Double x.'"],
            ("'Double x.'", "'Twice x.'"),
        ),
        R(
            "def f(a, b=2, *rest, key=None):\n    return a\n",
            [
                "import inspect\nassert list(inspect.signature(f).parameters) == ['a', 'b', 'rest', 'key']",
                "import inspect\nassert inspect.signature(f).parameters['b'].default == 2",
            ],
            ("b=2", "b=3"),
        ),
        R(
            "from typing import NamedTuple\nclass v(NamedTuple):\n    x: int\n    y: int\n    def norm1(self):\n"
            "        return abs(self.x) + abs(self.y)\n",
            ["assert v(3, -4).norm1() == 7", "assert v(1, 2) == (1, 2)"],
            ("abs(self.x) + abs(self.y)", "self.x + self.y"),
        ),
    ]


def _test_object_rows():
    """The test's objects read whole and written back (program.TestObject): what the program writes is what the
    test's code sees whenever it runs (a callback, a method, the test after the call), in Python's order; a
    property's setter runs as the write happens; a list of 5,000 nodes is walked within the limits."""
    temp = (
        "class Temp:\n    def __init__(self):\n        self._c = 0\n    @property\n    def f(self):\n"
        "        return self._c * 9 / 5 + 32\n    @f.setter\n    def f(self, v):\n        self._c = (v - 32) * 5 / 9\n"
    )
    tree = (
        "class Node:\n    def __init__(self, val, children=None):\n        self.val = val\n"
        "        self.children = children or []\n    def doubled(self):\n        return self.val * 2\n"
    )
    n = 5000
    return [
        R(
            "def boil(t):\n    t.f = 212\n    return t.f\n",
            ["t = Temp()\nassert boil(t) == 212 and t._c == 100"],
            ("212\n", "211\n"),
            setup=temp,
        ),
        R(
            "def relink(a, b):\n    a.next = b\n    return a.val + a.next.val\n",
            ["a, b = ListNode(1), ListNode(2)\nassert relink(a, b) == 3 and a.next is b and b.next is None"],
            ("a.next = b", "a.next = a"),
            setup=_LISTNODE,
        ),
        R(
            "def reverse(head):\n    prev = None\n    while head:\n"
            "        head.next, prev, head = prev, head, head.next\n    return prev\n",
            [f"assert to_list(reverse(build(list(range({n}))))) == list(range({n}))[::-1]"],
            "def reverse(head):\n    return head\n",
            setup=_LISTNODE,
        ),
        R(
            "def total(root):\n    return root.val + sum(total(c) for c in root.children)\n",
            ["assert total(Node(1, [Node(2), Node(3, [Node(4)])])) == 10"],
            ("sum(total(c) for c in root.children)", "len(root.children)"),
            setup=tree,
        ),
        R(
            "def apply(node, f):\n    node.val = 5\n    return f()\n",
            ["n = Node(1)\nassert apply(n, lambda: n.val) == 5"],
            ("node.val = 5", "node.val = 4"),
            setup=tree,
        ),
        R(
            "def f(n):\n    n.val = 7\n    return n.doubled()\n",
            ["n = Node(1)\nassert f(n) == 14 and n.val == 7"],
            ("n.val = 7", "n.val = 6"),
            setup=tree,
        ),
    ]


ROWS = (
    _mutation_rows()
    + HAND
    + MORE
    + _value_rows()
    + _arithmetic_rows()
    + _string_rows()
    + _io_rows()
    + _named_class_rows()
    + _loop_rows()
    + _habit_rows()
    + _test_object_rows()
)


# ------------------------------------------------------------------------------------------------ Python's score
def python_score(program: str, tests: list, setup: str = "") -> float:
    """HumanEval-style: program, setup and one snippet in one fresh namespace per snippet; a stdin/stdout case runs
    the program as a script. The rows are ours and honest: they run here, in this process."""
    passed = 0
    for test in tests:
        if isinstance(test, dict):
            out = subprocess.run(
                [sys.executable, "-c", program], input=test["input"].encode(), capture_output=True, timeout=30
            )
            passed += out.returncode == 0 and sandbox.outputs_match(out.stdout, test["output"])
            continue
        namespace = {"__name__": "__main__"}
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(program, "solution.py", "exec"), namespace)
                if setup:
                    exec(setup, namespace)
                exec(compile(test, "<test>", "exec"), namespace)
            passed += 1
        except BaseException:  # noqa: BLE001 - a failed test, whatever it raised
            pass
    return passed / len(tests)


@pytest.fixture(scope="module")
def scored():
    sandbox.check_isolation()
    reward = sandbox.CodeReward(limits=LIMITS, workers=2)
    programs = [row[kind] for row in ROWS for kind in ("program", "wrong")]
    tests = [row["tests"] for row in ROWS for _ in range(2)]
    setups = [row["setup"] for row in ROWS for _ in range(2)]
    entries = [row["entry"] for row in ROWS for _ in range(2)]
    scores = reward([f"```python\n{p}```" for p in programs], tests, entry_point=entries, test_setup_code=setups)
    python = [python_score(p, t, s) for p, t, s in zip(programs, tests, setups)]
    return [
        {"program": p, "tests": t, "sandbox": a, "python": b, "honest": i % 2 == 0}
        for i, (p, t, a, b) in enumerate(zip(programs, tests, scores, python))
    ]


def _report(rows) -> str:
    return "\n".join(
        f"sandbox {r['sandbox']:.3f} python {r['python']:.3f}\n{r['program']}{r['tests']}\n" for r in rows[:8]
    )


def test_the_suite_is_broad():
    assert len(ROWS) >= 300, len(ROWS)


def test_honest_programs_score_as_python_does(scored):
    honest = [r for r in scored if r["honest"]]
    not_honest = [r for r in honest if r["python"] != 1.0]
    assert not not_honest, "rows whose honest program fails in Python:\n" + _report(not_honest)
    unequal = [r for r in honest if r["sandbox"] != r["python"]]
    assert not unequal, f"{len(unequal)}/{len(honest)} honest programs score otherwise than in Python:\n" + _report(
        unequal
    )


def test_wrong_twins_score_as_python_does(scored):
    wrong = [r for r in scored if not r["honest"]]
    right = [r for r in wrong if r["python"] >= 1.0]
    assert not right, "wrong twins that Python scores 1.0:\n" + _report(right)
    unequal = [r for r in wrong if r["sandbox"] != r["python"]]
    assert not unequal, f"{len(unequal)}/{len(wrong)} wrong twins score otherwise than in Python:\n" + _report(unequal)


def test_no_answer_forges_above_an_honest_wrong_answer():
    """tests/sandbox_answer_attacks.py: each forger scores at most its honest wrong answer."""
    sandbox.check_isolation()
    reward = sandbox.CodeReward(limits=LIMITS, workers=2)
    rows = answer_attacks.scored(reward)
    forged = [row for row in rows if row[1] > row[2]]
    assert not forged, "forgers above the honest wrong answer (name, forger, honest wrong):\n" + "\n".join(
        map(str, forged)
    )
    assert len(rows) >= 20


def test_the_answer_bound_counts_structure_not_string_bytes():
    from dsgrpo.rewards.sandbox import protocol

    assert protocol.containers(b'{"ok":"[[[[{{{{"}') == 1
    assert protocol.containers(b'{"ok":["a\\"[", "\\\\", "]"]}') == 2
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_untrusted(
            b'{"ok":' + b"[" * (protocol.MAX_CONTAINERS + 1) + b"]" * (protocol.MAX_CONTAINERS + 1) + b"}"
        )
