"""code_reward's sandbox under attack (issue 25): every hostile program of tests/sandbox_attacks.py scores no
more than an honest wrong answer, raises nothing, leaves no process and touches nothing of the trainer's, as
the user the suite runs as and (when that is root) again as an unprivileged uid; the program never sees a
test; runs cannot see each other; isolation that cannot be built refuses to score, naming what is missing."""

import contextlib
import json
import os
import resource
import shutil
import stat
import subprocess
import sys
import threading

import pytest

from dsgrpo.rewards import sandbox
from dsgrpo.rewards.sandbox import cgroups
from dsgrpo.rewards.sandbox import protocol as runner

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import sandbox_attacks as attacks  # noqa: E402

UNPRIVILEGED = 54321
FAST = sandbox.SandboxLimits(timeout_s=2.0, cpu_s=2)


def check_row(row: dict) -> None:
    name = row["name"]
    assert row.get("error") is None, f"{name}: raised {row['error']}"
    assert isinstance(row["score"], float) and 0.0 <= row["score"] <= row["ceiling"] + 1e-9, (
        f"{name}: scored {row['score']} > {row['ceiling']}"
    )
    if name == "honest":
        assert row["score"] == 1.0 and abs(row["baseline"] - 1 / 3) < 1e-9
        return
    if name.startswith("baseline"):
        assert abs(row["score"] - row["expected"]) < 1e-9, f"{name}: {row['score']}"
        return
    assert row["left"] == [], f"{name}: processes left behind: {row['left']}"
    assert not row["kernel_objects_left"], f"{name}: left in the kernel: {row['kernel_objects_left']}"
    assert not row["cgroups_left"], f"{name}: cgroups left: {row['cgroups_left']}"
    assert not row["hung"], f"{name}: the supervisor hung"
    # the run's CPU time (every process of it, the checker's included) and the checker's memory stay bounded
    assert row["run_cpu_s"] <= row["timeout_s"] + 1.0, f"{name}: the run used {row['run_cpu_s']} s of CPU"
    assert row["checker_peak_bytes"] <= row["checker_memory_bytes"], f"{name}: checker {row['checker_peak_bytes']}"
    assert row["supervisor_maxrss_kib"] < 40 * 1024, f"{name}: supervisor {row['supervisor_maxrss_kib']} KiB"
    assert row["hits"] == 0, f"{name}: reached the network"
    assert row["victim_intact"], f"{name}: changed the trainer's file"
    assert abs(row["baseline"] - 1 / 3) < 1e-9, f"after {name}, an honest wrong answer scores {row['baseline']}"
    assert row["seconds"] < 10, f"{name}: took {row['seconds']} s"


# ------------------------------------------------------------------------------------------------ pure parts
def test_plain_data_crosses_the_boundary_by_exact_type():
    values = [
        None,
        True,
        0,
        -7,
        2**70,
        1.5,
        float("inf"),
        "é",
        b"\x00\xff",
        [1, [2]],
        (1, (2, 3)),
        {1, 2},
        frozenset({3}),
        {"a": 1, 2: [3]},
        1 + 2j,
    ]
    for v in values:
        wire = json.loads(json.dumps(runner.encode(v), allow_nan=False))
        back = runner.decode(wire)
        assert back == v and type(back) is type(v)
    nan = runner.decode(json.loads(json.dumps(runner.encode(float("nan")))))
    assert nan != nan

    class Liar(int):
        def __eq__(self, other):
            return True

    # a subclass crosses as a plain copy of its base value: its methods do not travel
    assert runner.encode(Liar(3)) == 3 and type(runner.decode(runner.encode(Liar(3)))) is int
    with pytest.raises(TypeError):  # an object of no plain type, without a handle table, cannot cross
        runner.encode(object())
    for bad in ({"pickle": "x"}, {"tuple": 1}, {"a": 1, "b": 2}, {"handle": 1}, {"float": "1e999"}, {"dict": [[1]]}):
        with pytest.raises(ValueError):
            runner.decode(bad)


def test_stdin_stdout_comparison():
    assert sandbox.outputs_match(b"3\n", "3")
    assert sandbox.outputs_match(b"1 2\n3   4\n\n", "1 2\n3 4")
    assert sandbox.outputs_match(b"0.3333333\n", "0.33333333333")
    assert not sandbox.outputs_match(b"3 4", "3")
    assert not sandbox.outputs_match(b"\xff", "3")
    assert not sandbox.outputs_match(b"nan", "nan ") or sandbox.outputs_match(b"nan", "nan")  # equal text
    assert not sandbox.outputs_match(b"inf", "1e309")


def test_integer_tokens_compare_as_digit_strings_of_any_length():
    """No int(): Python 3.11 refuses past 4,300 digits (the row then failed whole), and where a library lifted the
    limit, int() is quadratic in the trainer's process. Sign and leading zeros are normalised."""
    big = "9" * 1_000_000
    assert sandbox.outputs_match(big.encode(), big)
    assert sandbox.outputs_match(("+000" + big).encode(), big)
    assert not sandbox.outputs_match((big[:-1] + "8").encode(), big)
    assert sandbox.outputs_match(("-" + big).encode(), "-" + big) and not sandbox.outputs_match(big.encode(), "-" + big)
    assert sandbox.outputs_match(b"-0 +0 -000", "0 0 0")
    assert not sandbox.outputs_match("\u0661".encode(), "1")  # ASCII digits only (Arabic-Indic one is text)


def test_a_row_the_sandbox_cannot_judge_is_a_counted_error_not_a_zero(isolation):
    """The judge's own fault (here its comparison, with a tolerance that is not a number) scores None, is counted by
    its reason, and reaches the trainer as rewards/<name>/errors; a wrong answer beside it still scores 0."""
    from dsgrpo.rewards.stack import RewardStack

    reward = sandbox.CodeReward(limits=FAST, float_tolerance="not a number", workers=1)
    stack = RewardStack([reward])
    assert stack.counted_names == ["code_reward"]
    with pytest.warns(RuntimeWarning, match="could not compare case 0"):
        scores = reward(
            ["```python\nprint(0.5)\n```", "```python\nprint(2)\n```", "```python\nprint(1)\n```"],
            [[{"input": "", "output": "0.50"}], [{"input": "", "output": "1"}], [{"input": "", "output": "1"}]],
        )
    assert scores == [None, 0.0, 1.0]
    assert stack.pop_errors() == [1.0] and stack.pop_errors() == [0.0]


# ------------------------------------------------------------------------------------------------ the corpus
@pytest.fixture(scope="module")
def isolation():
    sandbox.check_isolation()  # this machine can isolate (CI: root; a developer: user namespaces)


def test_every_attack_as_this_user(isolation, tmp_path):
    rows = list(attacks.run_corpus(sandbox, str(tmp_path)))
    assert len(rows) > 40
    for row in rows:
        check_row(row)


@pytest.mark.skipif(os.geteuid() != 0, reason="the suite runs unprivileged already: the corpus above covered it")
def test_every_attack_as_an_unprivileged_user(tmp_path):
    """CI runs as root: the same corpus as uid 54321 (no passwd entry needed), under an interpreter that uid may
    run, with only user namespaces and a cgroup delegated to it (DSGRPO_SANDBOX_CGROUP) to isolate it."""
    python = _world_executable_python()
    if python is None:
        pytest.skip("no interpreter an unprivileged user may run (e.g. /usr/bin/python3)")
    code = _copy_for(tmp_path, UNPRIVILEGED)
    # without a cgroup of its own the sandbox cannot count the run's memory and CPU: it refuses, naming it
    probe = (
        f"import sys; sys.path.insert(0, {code!r}); import sandbox_attacks as a\n"
        f"sb = a.load_sandbox({os.path.join(code, 'sandbox')!r})\n"
        "try:\n    sb.check_isolation()\n    print('ISOLATED')\nexcept sb.SandboxUnavailableError as e:\n"
        "    print('REFUSED', e)\n"
    )
    out = subprocess.run(
        [python, "-c", probe],
        user=UNPRIVILEGED,
        group=UNPRIVILEGED,
        extra_groups=[],
        cwd=code,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert "REFUSED" in out.stdout and "cgroup" in out.stdout and "DSGRPO_SANDBOX_CGROUP" in out.stdout, out
    with delegated_cgroup(UNPRIVILEGED) as cgroup:
        out = subprocess.run(
            [python, os.path.join(code, "sandbox_attacks.py"), os.path.join(code, "sandbox"), str(tmp_path / "work")],
            user=UNPRIVILEGED,
            group=UNPRIVILEGED,
            extra_groups=[],
            cwd=code,
            capture_output=True,
            text=True,
            timeout=600,
            env={"PATH": "/usr/bin:/bin", "DSGRPO_SANDBOX_CGROUP": cgroup},
        )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) > 40
    for row in rows:
        check_row(row)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to build a user namespace with user namespaces off")
def test_no_isolation_refuses_naming_what_is_missing(tmp_path):
    """An unprivileged user where user namespaces are disabled: check_isolation refuses (never a silent fallback),
    naming the namespace and the opt-out; code_sandbox='none' still scores."""
    python = _world_executable_python()
    if python is None:
        pytest.skip("no interpreter an unprivileged user may run")
    code = _copy_for(tmp_path, UNPRIVILEGED)
    probe = (
        f"import sys; sys.path.insert(0, {code!r}); import sandbox_attacks as a\n"
        f"sb = a.load_sandbox({os.path.join(code, 'sandbox')!r})\n"
        "try:\n    sb.check_isolation()\n    print('ISOLATED')\nexcept sb.SandboxUnavailableError as e:\n"
        "    print('REFUSED', e)\n"
        "print('NONE', sb.run_tests('def add(a, b):\\n    return a + b', a.TESTS, isolation='none'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT_USER_NAMESPACES, python, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=code,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "REFUSED" in out.stdout and "user namespace" in out.stdout and "code_sandbox: none" in out.stdout
    assert "NONE 1.0" in out.stdout


# runs argv[1:] as uid 54321 inside a user namespace (uids 0..65535 mapped) whose max_user_namespaces is 0
_WITHOUT_USER_NAMESPACES = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
go_r, go_w = os.pipe(); ready_r, ready_w = os.pipe()
pid = os.fork()
if pid == 0:
    assert libc.unshare(0x10000000) == 0, ctypes.get_errno()
    os.write(ready_w, b"x"); os.read(go_r, 1)
    open("/proc/sys/user/max_user_namespaces", "w").write("0")
    os.setgroups([]); os.setresgid(54321, 54321, 54321); os.setresuid(54321, 54321, 54321)
    os.execv(sys.argv[1], sys.argv[1:])
os.read(ready_r, 1)
for name in ("uid_map", "gid_map"):
    open(f"/proc/{pid}/{name}", "w").write("0 0 65536")
os.write(go_w, b"x")
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@contextlib.contextmanager
def delegated_cgroup(uid: int):
    """A cgroup under ours in every hierarchy, handed to `uid` as a delegation would; yields its relative path."""
    name = f"dsgrpo-test-delegated-{os.getpid()}"
    where = cgroups.where_runs_go()
    made = []
    try:
        for base in set(where["dirs"].values()):
            path = os.path.join(base, name)
            os.mkdir(path)
            made.append(path)
            os.chown(path, uid, uid)
            for f in os.listdir(path):
                if os.path.isfile(os.path.join(path, f)):
                    os.chown(os.path.join(path, f), uid, uid)
        yield name
    finally:
        for path in made:
            for sub in sorted((d for d, _, _ in os.walk(path)), key=len, reverse=True):
                try:
                    os.rmdir(sub)
                except OSError:
                    pass


def _world_executable_python():
    for candidate in (
        sys.executable,
        getattr(sys, "_base_executable", ""),
        "/usr/bin/python3",
        "/usr/local/bin/python3",
    ):
        path = os.path.realpath(candidate) if candidate else ""
        if path and os.path.isfile(path) and _reachable(path):
            out = subprocess.run(
                [path, "-c", "import sys; print(sys.version_info >= (3, 10))"],
                capture_output=True,
                text=True,
                user=UNPRIVILEGED,
                group=UNPRIVILEGED,
                extra_groups=[],
            )
            if out.stdout.strip() == "True":
                return path
    return None


def _reachable(path: str) -> bool:
    parent = os.path.dirname(path)
    while parent != "/":
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(parent)
    return bool(os.stat(path).st_mode & stat.S_IXOTH)


def _copy_for(tmp_path, uid: int) -> str:
    """The sandbox package and the corpus where `uid` can read them; a work folder it owns."""
    os.chmod(tmp_path, 0o755)
    parent = str(tmp_path)
    while parent != "/":
        os.chmod(parent, os.stat(parent).st_mode | stat.S_IXOTH)
        parent = os.path.dirname(parent)
    code = tmp_path / "code"
    code.mkdir()
    shutil.copy(attacks.__file__, code)
    shutil.copytree(os.path.dirname(sandbox.__file__), code / "sandbox", ignore=shutil.ignore_patterns("__pycache__"))
    for directory in (code, code / "sandbox"):
        os.chmod(directory, 0o755)
        for f in directory.iterdir():
            if f.is_file():
                os.chmod(f, 0o644)
    work = tmp_path / "work"
    work.mkdir()
    os.chown(work, uid, uid)
    return str(code)


# ------------------------------------------------------------------------------------------------ behaviour
def test_correct_answers_score_and_output_at_exit_changes_nothing(isolation):
    honest = attacks.HONEST
    assert sandbox.run_tests(honest, attacks.TESTS, FAST) == 1.0
    at_exit = (
        honest + "import atexit, sys\natexit.register(lambda: sys.stdout.write('\\n__RESULT__{oops'))\n"
        "print('noise', 'é', end='')\nsys.stdout.buffer.write(b'\\xff\\xfe')\n"
    )
    assert sandbox.run_tests(at_exit, attacks.TESTS, FAST) == 1.0
    # each test starts from the program's names (its own definitions do not reach the next test: a test can run the
    # program's code, so no test may change what another sees); tests may define helpers and use the program's
    # classes and objects
    program = (
        "class Stack:\n    def __init__(self): self.items = []\n    def push(self, x): self.items.append(x)\n"
        "    def pop(self): return self.items.pop()\n    def __len__(self): return len(self.items)\n"
        "def squares(n):\n    for i in range(n):\n        yield i * i\n"
        "def fail(x):\n    raise ValueError('no')\nTABLE = {'a': (1, 2)}\n"
    )
    tests = [
        "s = Stack(); s.push(1); s.push(2)\nassert s.pop() == 2 and len(s) == 1",
        "assert list(squares(4)) == [0, 1, 4, 9] and 9 in squares(4)",
        "def check(candidate):\n    assert candidate(3) == [0, 1, 4]\ncheck(lambda n: list(squares(n)))",
        "try:\n    fail(1)\n    raise AssertionError\nexcept ValueError as e:\n    assert str(e) == 'no'",
        "assert TABLE == {'a': (1, 2)} and type(TABLE['a']) is tuple",
        "assert s.items == [1]",  # `s` was the first test's: a NameError here
        "assert Stack() == Stack()",
    ]  # two objects of the program are not equal by identity: fails
    assert sandbox.run_tests(program, tests, FAST) == pytest.approx(5 / 7)


@pytest.mark.parametrize(
    "ending",
    [
        "raise ValueError('after defining it')",  # raises after the definitions
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",  # killed
        "import os\nos._exit(0)",  # leaves before the tests run
        "import sys\nsys.exit(0)",
        "import time\ntime.sleep(60)",  # times out
    ],
)
def test_no_credit_for_a_correct_function_that_never_reaches_the_tests(isolation, ending):
    assert sandbox.run_tests(attacks.HONEST + ending, attacks.TESTS, FAST) == 0.0


def test_standard_library_names_mean_the_module(isolation):
    """A test that uses `math` the program imported gets Python's math, not the program's object of that name."""
    tests = ["assert math.isclose(area(1.0), 3.14159, rel_tol=1e-3)"]
    assert sandbox.run_tests("import math\ndef area(r):\n    return math.pi * r * r", tests, FAST) == 1.0
    fake = (
        "class math:\n    @staticmethod\n    def isclose(*a, **k):\n        return True\ndef area(r):\n    return 0.0"
    )
    assert sandbox.run_tests(fake, tests, FAST) == 0.0


def test_stdin_stdout_cases(isolation):
    cases = [
        {"input": "1 2\n", "output": "3"},
        {"input": "10 20\n", "output": "30\n"},
        {"input": "5 5", "output": "10"},
    ]
    right = "a, b = map(int, input().split())\nprint(a + b)"
    assert sandbox.run_tests(right, cases, FAST) == 1.0
    assert sandbox.run_tests(
        "a, b = map(int, input().split())\nprint(a * b if a == 1 else a + b)", cases, FAST
    ) == pytest.approx(2 / 3)
    # exit status counts; a case that times out fails alone; big input is fed while output is read
    assert sandbox.run_tests(right + "\nraise SystemExit(3)", cases, FAST) == 0.0
    slow = "import time\na, b = map(int, input().split())\nif a == 10: time.sleep(30)\nprint(a + b)"
    assert sandbox.run_tests(slow, cases, FAST) == pytest.approx(2 / 3)
    big = [{"input": "\n".join(str(i) for i in range(200_000)) + "\n", "output": str(sum(range(200_000)))}]
    assert sandbox.run_tests("import sys\nprint(sum(int(x) for x in sys.stdin))", big, FAST) == 1.0
    # the expected output is never in the sandbox: a program that looks for it everywhere finds nothing
    secret = {"input": "go\n", "output": "SECRET-OUTPUT-" + os.urandom(6).hex()}
    hunt = (
        "import glob, os\nfound = ''\nfor p in glob.glob('/proc/*/cmdline') + glob.glob('/proc/*/environ') + "
        "glob.glob('/tmp/**', recursive=True):\n    try:\n        t = open(p, 'rb').read()\n    except OSError:\n"
        "        continue\n    if b'SECRET-OUTPUT-' in t:\n        i = t.index(b'SECRET-OUTPUT-')\n"
        "        found = t[i:i + 26].decode()\nprint(found)"
    )
    assert sandbox.run_tests(hunt, [secret], FAST) == 0.0
    # flooding stderr is an attack, not a wrong answer: the completion scores 0 even with other cases right
    flood = right + "\nimport sys\nsys.stderr.write('x' * (2 << 20))"
    assert sandbox.run_tests(flood, cases, FAST) == 0.0
    with pytest.raises(ValueError, match="tests\\[1\\]"):
        sandbox.run_tests(right, [cases[0], {"input": 1}], FAST)


def test_runs_cannot_see_or_touch_each_other(isolation):
    """Two runs at once: the first leaves files in its /tmp and /dev/shm and waits; the second looks for any trace
    of it (files, processes) and tries to signal every process it can name."""
    marker = "MARK" + os.urandom(4).hex()
    first = (
        f"import time\nopen('/tmp/{marker}', 'w').write('x')\nopen('/dev/shm/{marker}', 'w').write('x')\n"
        "time.sleep(1.5)\ndef alive():\n    return True"
    )
    second = (
        f"import glob, os, signal\ndef seen():\n    hits = [p for p in glob.glob('/tmp/**', recursive=True) + "
        f"glob.glob('/dev/shm/*') if '{marker}' in p]\n    procs = [p for p in os.listdir('/proc') if p.isdigit()]\n"
        "    for p in procs:\n        try: os.kill(int(p), signal.SIGKILL) if int(p) != os.getpid() else None\n"
        "        except OSError: pass\n    return hits, len(procs)"
    )
    results = {}
    t = threading.Thread(target=lambda: results.__setitem__("first", sandbox.run_tests(first, ["assert alive()"])))
    t.start()
    import time

    time.sleep(0.5)
    assert sandbox.run_tests(second, ["assert seen() == ([], 2)"], FAST) == 1.0  # itself and its PID 1
    t.join()
    assert results["first"] == 1.0


def test_scorer_memory_stays_bounded_under_a_flood(isolation):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = sandbox.judge._run(
        "import os\nb = b'x' * (1 << 20)\nfor _ in range(1024):\n    os.write(1, b)\n" + attacks.HONEST,
        attacks.TESTS,
        [],
        FAST,
        "isolated",
    )
    assert result["asserts"]["passed"] == [False] * 3 and "output limit" in result["asserts"]["ended"]
    assert result["supervisor_maxrss_kib"] < 100 * 1024
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024


def test_code_reward_scores_rows_in_parallel_and_conversational_completions(isolation):
    right = "```python\n" + attacks.HONEST + "```"
    wrong = [{"role": "assistant", "content": "```python\n" + attacks.HONEST_WRONG + "```"}]
    reward = sandbox.CodeReward(limits=FAST, workers=2)
    scores = reward([right, wrong] * 4, [attacks.TESTS] * 8)
    assert scores == pytest.approx([1.0, 1 / 3] * 4)
    assert reward([right], [attacks.TESTS[0]]) == [1.0]  # a row whose tests are one snippet
    assert reward([right], [[]]) == [0.0]  # a row without tests: nothing passed


# ------------------------------------------------------------------------------------------------ issue 44
WORK = "def work(n):\n    s = 0\n    for i in range(n):\n        s += i * i\n    return s\n"
WORK_TESTS = [f"assert work(6_000_000) == {sum(i * i for i in range(6_000_000))}"] * 3  # ~0.8 s of CPU in all


def test_an_honest_neighbour_keeps_its_score_beside_fourteen_spinning_processes(isolation):
    """Two rows scored at once on 2 cores: one completion spins in 14 processes, the other needs ~0.8 s of CPU
    under a 2 s limit. The limit counts the run's own CPU time and runs share the CPU by cgroup, so the honest row
    scores as it does alone (with a wall-clock limit shared with the spinner it timed out: 0.0)."""
    spinner = "import os\nfor _ in range(14):\n    if os.fork() == 0:\n        break\nwhile True:\n    pass\n"
    limits = sandbox.SandboxLimits(timeout_s=2.0, cpu_s=2)
    alone: dict = {}
    assert sandbox.run_tests(WORK, WORK_TESTS, limits, figures=alone) == 1.0
    reward = sandbox.CodeReward(limits=limits, workers=2)
    for _ in range(2):
        scores = reward([f"```python\n{spinner}```", f"```python\n{WORK}```"], [WORK_TESTS, WORK_TESTS])
        assert scores == [0.0, 1.0]
    assert alone["runs"][0]["cpu_s"] > 0.3  # the honest row's work is real CPU time, counted


def test_answers_of_standard_library_types_score_as_python_would(isolation):
    program = (
        "import collections, fractions, decimal, math\nPoint = collections.namedtuple('Point', 'x y')\n"
        "def counts(s):\n    return collections.Counter(s)\n"
        "def groups(words):\n    d = collections.defaultdict(list)\n    for w in words:\n"
        "        d[len(w)].append(w)\n    return d\n"
        "def point(x, y):\n    return Point(x, y)\n"
        "def half(n):\n    return fractions.Fraction(n, 2)\n"
        "def fact(n):\n    return math.factorial(n)\n"
        "def ordered(pairs):\n    return collections.OrderedDict(pairs)\n"
        "def window(xs):\n    return collections.deque(xs, maxlen=2)\n"
        "def money(s):\n    return decimal.Decimal(s)\n"
        "def raw(n):\n    return bytearray(n)\n"
        "def evens(n):\n    return range(0, n, 2)\n"
    )
    setup = (
        "from collections import Counter, OrderedDict, defaultdict, deque, namedtuple\nimport math\n"
        "from fractions import Fraction\nfrom decimal import Decimal"
    )
    tests = [
        "assert counts('aab') == Counter({'a': 2, 'b': 1}) and type(counts('')) is Counter",
        "assert groups(['a', 'bb', 'c']) == {1: ['a', 'c'], 2: ['bb']} and groups([])[3] == []",
        "p = point(1, 2)\nassert p == (1, 2) and p.x == 1 and p.y == 2 and type(p).__name__ == 'Point'",
        "assert half(3) == Fraction(3, 2) and half(4) == 2",
        "assert fact(1500) == math.factorial(1500)",
        "assert list(ordered([('b', 1), ('a', 2)])) == ['b', 'a']",
        "assert window([1, 2, 3]) == deque([2, 3]) and window([]).maxlen == 2",
        "assert money('1.10') + money('2.20') == Decimal('3.30')",
        "assert raw(3) == bytearray(3)",
        "assert evens(7) == range(0, 7, 2) and list(evens(5)) == [0, 2, 4]",
    ]
    assert sandbox.run_tests(program, tests, FAST, setup=setup) == 1.0
    wrong = program.replace("math.factorial(n)", "math.factorial(n) + 1").replace("Fraction(n, 2)", "Fraction(n, 3)")
    assert sandbox.run_tests(wrong, tests, FAST, setup=setup) == pytest.approx(8 / 10)


def test_a_task_named_like_a_builtin_or_a_library_function(isolation):
    """The tests' own names decide what the program answers for: `pow` alone is the task (an empty program fails
    it: it scored 1.0 through the builtin), `abs` beside it stays Python's; `gcd` is the task when the tests use
    nothing else; a row's entry_point settles the rest."""
    tests = ["assert pow(2, 3) == 8", "assert pow(3, 2) == 9", "assert abs(pow(2, 2) - 4) < 1e-9"]
    assert sandbox.run_tests("pass", tests, FAST) == 0.0
    honest = "def pow(a, b):\n    r = 1\n    for _ in range(b):\n        r *= a\n    return r\n"
    assert sandbox.run_tests(honest, tests, FAST) == 1.0
    assert sandbox.run_tests("def pow(a, b):\n    return 0\ndef abs(x):\n    return 0\n", tests, FAST) == 0.0
    gcd_tests = ["assert gcd(4, 6) == 2", "assert gcd(7, 5) == 1"]
    assert sandbox.run_tests("from math import gcd", gcd_tests, FAST) == 1.0  # the real gcd is a right answer
    assert sandbox.run_tests("pass", gcd_tests, FAST) == 0.0
    assert sandbox.run_tests("def gcd(a, b):\n    return 1\n", gcd_tests, FAST) == 0.5
    # two functions, one named like a library's: the row names its entry points
    two = ["assert merge([1], [0]) == [0, 1]", "assert isclose(mean([1, 2]), 1.5)"]
    program = (
        "def merge(a, b):\n    return sorted(a + b)\ndef mean(xs):\n    return sum(xs) / len(xs)\n"
        "def isclose(a, b):\n    return True\n"
    )
    assert sandbox.run_tests(program, two, FAST, setup="from math import isclose") == 1.0
    assert sandbox.run_tests(program.replace("/ len(xs)", "/ 3"), two, FAST, setup="from math import isclose") == 0.5
    # HumanEval's shape: one check(candidate) snippet and its entry point
    check = ["def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(0, 0) == 0\ncheck(add)"]
    assert sandbox.run_tests(attacks.HONEST, check, FAST, entry_points=["add"]) == 1.0
    assert sandbox.run_tests("pass", ["assert sorted([2, 1]) == [1, 2]"], FAST, entry_points=["sorted"]) == 0.0


def test_which_names_the_program_answers_for():
    """names.entry_points is a pure function of the row: the tests, the setup code, the declared entry points."""
    from dsgrpo.rewards.sandbox.names import entry_points

    assert entry_points(attacks.TESTS, "", [])[0] == {"add"}  # abs is Python's
    assert entry_points(["assert isclose(f(1), 2)", "assert f(0) == 0"], "", [])[0] == {"f"}
    assert entry_points(["assert pow(2, 3) == 8", "assert abs(pow(1, 1)) == 1"], "", [])[0] == {"pow"}
    assert entry_points(["assert gcd(4, 6) == 2", "assert lcm(2, 3) == 6"], "", [])[0] == {"gcd", "lcm"}
    assert entry_points(["import numpy as np", "assert np.allclose(f(), [1.0])"], "", [])[0] == {"f"}
    assert entry_points(
        ["s = Stack()\nassert s.pop() == 1", "def check(candidate):\n    assert candidate(1)\ncheck(solve)"], "", []
    )[0] == {"Stack", "solve"}
    assert entry_points(["assert isclose(f(1), 2)"], "from math import isclose", [])[0] == {"f"}
    assert entry_points(["assert sorted(x) == [1]"], "x = [1]", ["sorted"])[0] == {"sorted"}
    assert entry_points(["assert f(("], "", [])[0] == set()  # a test that does not parse names nothing


def test_stdin_stdout_integers_compare_exactly(isolation):
    assert not sandbox.outputs_match(b"1000000001\n", "1000000000")  # within 1e-6 relative, and wrong
    assert sandbox.outputs_match(b"+5 007\n", "5 7")  # the same integers
    assert not sandbox.outputs_match(b"3.0", "3")  # an integer is expected
    assert sandbox.outputs_match(b"3", "3.000000")  # a decimal fraction: 1e-6
    assert not sandbox.outputs_match(b"0.3334", "0.3333", float_tolerance=None)
    off_by_one = "a, b = map(int, input().split())\nprint(a + b - 1)"
    cases = [
        {"input": "999999999 2\n", "output": "1000000001"},
        {"input": "500000000 500000000\n", "output": "1000000000"},
    ]
    assert sandbox.run_tests(off_by_one, cases, FAST) == 0.0
    assert sandbox.run_tests(off_by_one.replace(" - 1", ""), cases, FAST) == 1.0


def test_printing_tests_score_as_python_would(isolation):
    """A test's prints go nowhere near the verdicts (they broke the supervisor's result channel: every completion
    scored 0)."""
    tests = [
        "print(add(1, 2))\nassert add(1, 2) == 3",
        "print('\\x00\\x00\\x00\\x05{}', add(0, 0))",
        "import sys\nsys.stdout.write('x' * 100000)\nassert add(2, 2) == 4",
    ]
    assert sandbox.run_tests(attacks.HONEST, tests, FAST) == 1.0
    assert sandbox.run_tests(attacks.HONEST_WRONG, tests, FAST) == pytest.approx(1 / 3)


def test_a_program_that_stops_reading_stdin_ends_within_its_limits(isolation):
    """Issue 53: a program that reads one line of a large stdin and then spins (or sleeps) held the supervisor in a
    blocking write: 15 s of wall clock against a 3 s limit, 9 s of CPU against 1 s, its cgroups left behind. RLIMIT_CPU
    is set far above the run's limit here, so only the supervisor's own checks can end it."""
    limits = sandbox.SandboxLimits(timeout_s=1.0, wall_timeout_s=3.0, cpu_s=30)
    case = [{"input": attacks.BIG_STDIN, "output": "0"}]
    for ending, cpu_s in (("while True:\n    pass", 1.0), ("import time\ntime.sleep(3600)", 0.0)):
        figures: dict = {}
        assert sandbox.run_tests(f"import sys\nsys.stdin.readline()\n{ending}\n", case, limits, figures=figures) == 0.0
        (run,) = figures["runs"]
        assert run["ended"] == "the time limit" and not figures["hung"], figures
        assert run["cpu_s"] <= cpu_s + 0.25 and run["wall_s"] <= 3.0 + 0.75, (ending, run)
        assert attacks.cgroups_left(sandbox) == []


@pytest.mark.parametrize("stale", [False, True])
def test_a_runs_cgroups_are_emptied_before_they_are_removed(isolation, stale):
    """No cgroup stays, whatever is still running in it: RunCgroups.remove (the supervisor's) and remove_stale (the
    judge's, after a supervisor that hung was killed) kill every process in the run's cgroups and wait for them to
    be gone before removing them. Four processes here, one ignoring SIGTERM, sleeping in the program's part."""
    where = cgroups.where_runs_go(os.environ.get("DSGRPO_SANDBOX_CGROUP") or None)
    run = cgroups.RunCgroups(where, f"dsgrpo-{os.getpid()}-{9000 + stale}", 64 << 20, 64 << 20, 16)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            import signal
            import time

            run.join("program")
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.fork()
            os.fork()
            os.write(w, b"x")
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(w)
    got = b""
    while len(got) < 4:
        got += os.read(r, 4)
    os.close(r)
    if stale:
        cgroups.remove_stale(where, os.getpid())
    else:
        run.remove()
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9
    assert not any(os.path.exists(os.path.join(base, run.name)) for base in set(where["dirs"].values()))


def test_each_cases_stdout_is_compared_as_it_arrives_and_dropped(isolation):
    """Issue 53: every case's stdout was kept until the row ended (hex in one JSON result): 60 cases of ~1 MiB cost
    the supervisor 129 MiB and the trainer +344 MiB. Each case's stdout now reaches the judge raw, right after the
    case, is compared and dropped. bench/sandbox_stdout_memory.py, in a process of its own (its peak is its own)."""
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "..", "bench", "sandbox_stdout_memory.py"),
            "--cases",
            "60",
            "--sandbox",
            os.path.dirname(sandbox.__file__),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    figures = dict(line.split(": ", 1) for line in out.stdout.splitlines())
    assert "score 1.0" in figures["cases"], out.stdout  # every case compared, all right
    assert float(figures["supervisor peak RSS"].split()[0]) < 40, out.stdout
    assert float(figures["trainer peak RSS growth"].split()[0]) < 64, out.stdout


def test_a_rows_output_has_a_budget(isolation):
    """Beyond row_output_bytes of the row's cases together the row scores 0 and no further case runs."""
    program = "import sys\ninput()\nsys.stdout.write('7 ' * 500_000)\n"  # 1,000,000 bytes a case
    cases = [{"input": f"{i}\n", "output": "7 " * 500_000} for i in range(5)]
    figures: dict = {}
    limits = sandbox.SandboxLimits(timeout_s=2.0, cpu_s=2, row_output_bytes=2_500_000)
    assert sandbox.run_tests(program, cases, limits, figures=figures) == 0.0
    assert [run["ended"] for run in figures["runs"]] == [None, None, "the row's output limit"]
    assert (
        sandbox.run_tests(program, cases, sandbox.SandboxLimits(timeout_s=2.0, cpu_s=2, row_output_bytes=5_000_000))
        == 1.0
    )


def test_output_tokens_are_read_a_chunk_at_a_time():
    import random

    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice("ab \n\t\x1c\u3000") for _ in range(rng.randrange(40)))
        for chunk in (1, 2, 3, 7, 1 << 16):
            assert list(sandbox.judge._tokens(text, chunk)) == text.split(), (text, chunk)


def test_the_seccomp_filter_names_every_call_on_both_architectures():
    """Every denied call has its number on each architecture the filter supports (inotify_init aside: aarch64
    never had it), file watches among them (issue 53: inotify on the shared standard library showed the program
    which modules a test imported)."""
    from dsgrpo.rewards.sandbox import limits

    watches = {"inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init", "fanotify_mark"}
    assert watches <= set(limits.DENIED)
    for machine in limits.AUDIT_ARCH:
        numbers = dict(limits.SYSCALLS[machine], **limits.COMMON)
        missing = [n for n in limits.DENIED if n not in numbers and n not in limits.NOT_EVERYWHERE]
        assert not missing, (machine, missing)
        assert len(set(numbers.values())) == len(numbers), machine  # no two calls share a number
        assert len(limits.filter_program(machine, new_processes=False)) % 8 == 0
    assert limits.SYSCALLS["x86_64"]["inotify_init1"] == 294 and limits.SYSCALLS["aarch64"]["inotify_init1"] == 26


def test_where_the_runs_cgroups_go():
    """cgroups.locate, a pure function of /proc/self/mountinfo and /proc/self/cgroup: v1 with one hierarchy per
    controller or cpu and cpuacct mounted together, v2, a mount whose root is not the hierarchy's, the override."""
    v1 = (
        "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
        "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
        "39 31 0:36 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
    )
    own = "4:memory:/job/7\n3:cpu,cpuacct:/\n2:pids:/job/7\n0::/\n"
    where = cgroups.locate(v1, own)
    assert where == {
        "version": 1,
        "dirs": {
            "memory": "/sys/fs/cgroup/memory/job/7",
            "cpu": "/sys/fs/cgroup/cpu,cpuacct",
            "cpuacct": "/sys/fs/cgroup/cpu,cpuacct",
            "pids": "/sys/fs/cgroup/pids/job/7",
        },
    }
    assert cgroups.locate(v1, own, "me")["dirs"]["memory"] == "/sys/fs/cgroup/memory/job/7/me"
    assert cgroups.locate(v1, own, "/sandbox")["dirs"]["cpu"] == "/sys/fs/cgroup/cpu,cpuacct/sandbox"
    v2 = "30 23 0:26 /job /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    assert cgroups.locate(v2, "0::/job/step\n") == {"version": 2, "dirs": {"": "/sys/fs/cgroup/step"}}
    assert cgroups.locate(v2, "0::/job/step\n", "/job/sandbox")["dirs"][""] == "/sys/fs/cgroup/sandbox"
    with pytest.raises(cgroups.CgroupUnavailable):
        cgroups.locate("1 0 0:1 / / rw - ext4 /dev/root rw\n", "0::/\n")
