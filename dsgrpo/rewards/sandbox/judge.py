"""The judge: the trainer's side of code_reward. It starts one supervisor per scored completion, hands it the program
and (only once the program is running) the tests, compares stdin/stdout cases' outputs itself, and counts.

Everything on the far side (supervisor.py, and the two cells it contains: program.py and checker.py) is standard
library only, so that this module loads on its own in tests and the supervisor runs under `python -I -S`.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import struct
import subprocess
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# The supervisor loads this package under a name of its own, without running __init__ (which imports this module):
# nothing but the sandbox's own files is imported into it.
_SUPERVISOR_MAIN = (
    "import sys, types; package = types.ModuleType('dsgrpo_sandbox'); package.__path__ = [{!r}]; "
    "sys.modules['dsgrpo_sandbox'] = package; from dsgrpo_sandbox.supervisor import main; "
    "sys.exit(main())"
)
ISOLATION_MODES = ("isolated", "none")
_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)
_INT = re.compile(r"[+-]?[0-9]+\Z")
_SPACE = re.compile(r"\s")  # what str.split() splits on


class SandboxUnavailableError(RuntimeError):
    """The sandbox cannot be built on this machine: code_reward refuses to score rather than run code unconfined."""


class SandboxError(RuntimeError):
    """The sandbox could not judge one row (a fault of its own, or of the judge's comparison: never something the
    program did, which scores as Python would). code_reward scores such a row None and counts it by its reason in
    `rewards/<name>/errors`, rather than a 0.0 that would read as a wrong answer."""


@dataclass
class SandboxLimits:
    timeout_s: float = 5.0  # CPU seconds of one run: all its processes, the program's and the checker's
    wall_timeout_s: Optional[float] = None  # wall-clock backstop for a run that waits (default 2 × timeout_s + 1)
    cpu_s: int = 5  # CPU seconds of each process (RLIMIT_CPU)
    memory_bytes: int = 512 << 20  # memory of the program's processes together (its cgroup: anonymous memory,
    #                                 memfd, shared memory, tmpfs pages); address space of each
    checker_memory_bytes: int = 256 << 20  # memory of the checker: the tests and the decoding of answers
    file_bytes: int = 16 << 20  # largest file it may write (in its private /tmp)
    processes: int = 16  # processes and threads of the program
    output_bytes: int = 1 << 20  # stdout + stderr of one run; beyond it the run is killed and the row scores 0
    row_output_bytes: int = 64 << 20  # stdout + stderr of all a row's stdin/stdout cases together (each case's
    #                                   stdout reaches the trainer, is compared and dropped); beyond it the row
    #                                   stops and scores 0
    message_bytes: int = 16 << 20  # one answer of the program's, at most
    tmp_bytes: int = 16 << 20  # its private /tmp and /dev/shm (tmpfs: memory)


def extract_code(completion: str) -> str:
    """The last ```python block of a completion, or the whole text when it has none."""
    blocks = _CODE_BLOCK.findall(completion)
    return blocks[-1] if blocks else completion


def _binds() -> List[str]:
    """What a cell's root holds, read-only: the system's libraries and this interpreter's own files."""
    paths = ["/usr", "/bin", "/lib", "/lib32", "/lib64", "/sbin", "/etc/ld.so.cache"]
    for prefix in (sys.base_prefix, sys.base_exec_prefix):
        real = os.path.realpath(prefix)
        if not any(real == p or real.startswith(p + "/") for p in paths):
            paths.append(real)
    return paths


def _split_tests(tests: Sequence) -> tuple:
    snippets, cases = [], []
    for i, test in enumerate(tests):
        if isinstance(test, str):
            snippets.append(test)
        elif isinstance(test, dict) and isinstance(test.get("input"), str) and isinstance(test.get("output"), str):
            cases.append(test)
        else:
            raise ValueError(
                f"tests[{i}] = {test!r:.80}: code_reward takes Python snippets (usually asserts) or "
                "stdin/stdout cases {'input': str, 'output': str}."
            )
    return snippets, cases


def outputs_match(got: bytes, expected: str, float_tolerance: Optional[float] = 1e-6) -> bool:
    """A stdin/stdout case passes when the output's whitespace-separated tokens equal the expected ones (line
    breaks and runs of spaces aside): as text, or as the same integer ('+5' and '5'; never an integer within a
    tolerance). An expected token written as a decimal fraction or with an exponent ('0.333333', '1e-9') also
    accepts a number within `float_tolerance` (absolute or relative), as competitive-programming checkers do;
    None: text and integers only."""
    try:
        text = got.decode("utf-8")
    except UnicodeDecodeError:
        return False
    for g, w in itertools.zip_longest(_tokens(text), _tokens(expected)):
        if g is None or w is None:  # not as many tokens
            return False
        if g == w:
            continue
        if _INT.match(w):
            if not (_INT.match(g) and _canonical_integer(g) == _canonical_integer(w)):
                return False
            continue
        if float_tolerance is None:
            return False
        try:
            a, b = float(g), float(w)
        except ValueError:
            return False
        if not (
            math.isfinite(a)
            and math.isfinite(b)
            and math.isclose(a, b, rel_tol=float_tolerance, abs_tol=float_tolerance)
        ):
            return False
    return True


def _canonical_integer(token: str) -> str:
    """An integer token as a digit string, sign and leading zeros normalised: compared in time linear in its length,
    where int() would refuse past 4,300 digits (Python 3.11's limit) or take quadratic time where a library lifted
    it."""
    digits = token.lstrip("+-").lstrip("0") or "0"
    return "-" + digits if token.startswith("-") and digits != "0" else digits


def _tokens(text: str, chunk: int = 1 << 16):
    """text.split(), a chunk at a time: a case's megabyte of output never becomes a list of every token at once."""
    start, n = 0, len(text)
    while start < n:
        end = start + chunk
        if end < n:
            space = _SPACE.search(text, end)  # a chunk ends at whitespace: no token is cut
            end = space.start() if space else n
        yield from text[start:end].split()
        start = end


def _frame(obj) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack(">I", len(data)) + data


def _wall_s(limits: SandboxLimits) -> float:
    return limits.wall_timeout_s or 2 * limits.timeout_s + 1


def _run(
    code: str,
    snippets: List[str],
    cases: List[dict],
    limits: SandboxLimits,
    isolation: str,
    setup: str = "",
    entry_points: Sequence[str] = (),
    float_tolerance: Optional[float] = 1e-6,
) -> dict:
    """One supervisor process: the checker's verdicts on the snippets, and a verdict per stdin/stdout case. Each
    case's stdout arrives once that case has ended, is compared here (the expected outputs never leave this
    process) and dropped: what is held at any time is one case's output."""
    result_r, result_w = os.pipe()
    job = {
        "isolated": isolation == "isolated",
        "limits": asdict(limits),
        "code": code,
        "n_tests": len(snippets),
        "inputs": [c["input"].encode().hex() for c in cases],
        "base": "/tmp",
        "binds": _binds(),
        "cgroup_base": os.environ.get("DSGRPO_SANDBOX_CGROUP") or None,
        "result_fd": result_w,
    }
    # the tests follow in a frame of their own, read by the supervisor only after the program has forked
    material = {"tests": snippets, "setup": setup, "entry_points": list(entry_points)}
    payload = _frame(job) + (_frame(material) if snippets else b"")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _SUPERVISOR_MAIN.format(PACKAGE_DIR)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
            cwd="/",
            pass_fds=(result_w,),
        )
    finally:
        os.close(result_w)
    budget = (len(cases) + (1 if snippets else 0)) * (_wall_s(limits) + 2.0) + 10.0
    result: dict = {"io": []}
    failure: list = []
    received = [0]  # bytes of stdout so far

    def on_case(run: dict, stdout: bytes) -> None:
        received[0] += len(stdout)
        if received[0] > limits.row_output_bytes:  # the supervisor stops a row there; checked again here
            run.update(ok=False, fatal=True, ended=run["ended"] or "the row's output limit")
        run["passed"] = bool(run["ok"]) and outputs_match(stdout, cases[run["case"]]["output"], float_tolerance)
        result["io"].append(run)

    def read_results():  # the verdicts travel on a pipe of their own: nothing printed by anyone can reach it
        try:
            while True:
                message = _read_message(result_r)
                if message is None:
                    return
                if "case" not in message:
                    result.update(message, complete=True)
                    continue
                if message["case"] != len(result["io"]) or message["case"] >= len(cases):
                    raise ValueError(f"case {message['case']} out of order")
                stdout = _read_exact(result_r, message["stdout_bytes"])
                try:
                    on_case(message, stdout)
                except Exception as exc:  # the judge's own comparison: named as such, never blamed on the sandbox
                    failure.append(SandboxError(f"the judge could not compare case {message['case']}'s output: {exc}"))
        except (OSError, ValueError, KeyError, TypeError) as exc:  # a fault of the supervisor's: said below
            failure.append(exc)
            while os.read(result_r, 1 << 16):  # read on, so that the supervisor is never held in a write
                pass

    reader = threading.Thread(target=read_results, daemon=True)
    reader.start()
    try:
        _, err = proc.communicate(payload, timeout=budget)
        reader.join()
    except subprocess.TimeoutExpired:
        # the supervisor itself hangs (it should not: every wait in it has a deadline): its holders and cells die
        # with it (PDEATHSIG), their namespaces with them; what it made in the cgroups is emptied and removed here
        proc.kill()
        proc.communicate()
        reader.join(5)
        _remove_stale_cgroups(job["cgroup_base"], proc.pid)
        return {"hung": True}
    finally:
        os.close(result_r)
    if failure and isinstance(failure[0], SandboxError):
        raise failure[0]
    if failure or not result.pop("complete", False):
        why = f"{failure[0]}; " if failure else ""
        raise SandboxError(
            f"the sandbox supervisor failed (exit {proc.returncode}): {why}{err.decode(errors='replace')[-2000:]}"
        )
    return result


def _read_exact(fd: int, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise ValueError("the result pipe ended inside a frame")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read_message(fd: int):
    """One JSON frame of the supervisor's, or None at the end of the stream."""
    head = os.read(fd, 4)
    if not head:
        return None
    head += _read_exact(fd, 4 - len(head))
    return json.loads(_read_exact(fd, struct.unpack(">I", head)[0]))


def _remove_stale_cgroups(base, pid: int) -> None:
    from . import cgroups  # noqa: PLC0415 - only on this rare path

    try:
        cgroups.remove_stale(cgroups.where_runs_go(base), pid)
    except OSError:
        pass


def run_tests(
    code: str,
    tests: Sequence,
    limits: Optional[SandboxLimits] = None,
    isolation: str = "isolated",
    setup: str = "",
    entry_points: Sequence[str] = (),
    float_tolerance: Optional[float] = 1e-6,
    figures: Optional[dict] = None,
) -> float:
    """Fraction of `tests` the program passes: Python snippets (usually asserts), each run after the program (and
    after `setup`, the row's own setup code) in a fresh namespace, and stdin/stdout cases {'input': ...,
    'output': ...} (the program as a script, once per case). `entry_points`: the names the tests take from the
    program, where the row says (else they are inferred: checker.py). 0.0 when the program breaks a limit, exits
    or raises before the snippets, or answers out of protocol; SandboxError when the sandbox itself could not judge
    the row. `figures`, when given, receives what each run cost
    (CPU seconds of its processes, the checker's peak memory, wall seconds) and how it ended."""
    limits = limits or SandboxLimits()
    if isolation not in ISOLATION_MODES:
        raise ValueError(f"isolation={isolation!r}: expected one of {ISOLATION_MODES}.")
    tests = list(tests)
    if not tests:
        return 0.0
    snippets, cases = _split_tests(tests)
    result = _run(code, snippets, cases, limits, isolation, setup, entry_points, float_tolerance)
    if "unavailable" in result:
        raise SandboxUnavailableError(f"The code sandbox cannot be built here: {result['unavailable']}. {OPT_OUT}")
    if figures is not None:
        figures.update(
            supervisor_maxrss_kib=result.get("supervisor_maxrss_kib"),
            hung=bool(result.get("hung")),
            runs=[
                {k: run.get(k) for k in ("cpu_s", "checker_peak_bytes", "wall_s", "ended")}
                for run in result.get("io", []) + ([result["asserts"]] if "asserts" in result else [])
            ],
        )
    if result.get("hung"):
        raise SandboxError("the sandbox supervisor did not finish within its wall-clock budget and was killed")
    if any(run["fatal"] for run in result["io"]):  # an output limit, a malformed run: an attack, not a wrong answer
        return 0.0
    if len(result["io"]) != len(cases) or (snippets and "asserts" not in result):
        raise SandboxError("the sandbox run ended without every verdict")
    passed = sum(run["passed"] for run in result["io"])
    if snippets:
        passed += sum(1 for v in result["asserts"]["passed"] if v is True)
    return passed / len(tests)


_warned: set = set()


def _warn_once(message: str) -> None:
    if message[:200] not in _warned:
        _warned.add(message[:200])
        warnings.warn(message, RuntimeWarning, stacklevel=3)


OPT_OUT = (
    "If you trust the data and the model, set code_sandbox: none in the config (dsgrpo serve-reward "
    "--code-sandbox none) to run the code without containment."
)

# ---------------------------------------------------------------------------------------------- isolation check
# Functions the probe program defines (they run in the program's cell); the probe's tests call them, and some
# tests look at their own process too (they run in the checker's cell, which must be contained the same way).
_PROBE_PROGRAM = r"""
import os, socket
def pid():
    return os.getpid()
def processes():
    return len([p for p in os.listdir("/proc") if p.isdigit()])
def connect_errno():
    s = socket.socket()
    try:
        s.settimeout(1)
        s.connect(("127.0.0.1", 9))
        return 0
    except OSError as exc:
        return exc.errno or -1
    finally:
        s.close()
def writable(path):
    try:
        with open(os.path.join(path, "probe"), "w") as fh:
            fh.write("x")
        return True
    except OSError:
        return False
def exists(path):
    return os.path.exists(path)
def capabilities():
    for line in open("/proc/self/status"):
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
def uid():
    return os.getuid()
def seccomp():
    for line in open("/proc/self/status"):
        if line.startswith("Seccomp:"):
            return int(line.split()[1])
def refused(name):
    import ctypes, errno
    libc = ctypes.CDLL(None, use_errno=True)
    keyctl = {"x86_64": 250, "aarch64": 219}[os.uname().machine]
    calls = {"keyctl": lambda: libc.syscall(keyctl, 0, -3, 0, 0, 0), "shmget": lambda: libc.shmget(0, 4096, 0o1600),
             "unshare": lambda: libc.unshare(0x08000000), "inotify_init1": lambda: libc.inotify_init1(0)}
    return calls[name]() == -1 and ctypes.get_errno() == errno.EPERM
def memory_cgroup():
    for line in open("/proc/self/cgroup"):
        if ":memory:" in line or line.startswith("0::"):
            if "/dsgrpo-" in line:
                return True
    return False
def stdlib():
    import collections, json, math, re, heapq, itertools, functools, bisect, decimal, fractions, random
    return math.isqrt(17) + len(json.dumps([1]))
"""


def _probe_tests(canary: str) -> List[tuple]:
    me = os.getuid()
    return [
        ("assert pid() == 2", "a PID namespace of its own (unshare CLONE_NEWPID)"),
        ("assert processes() == 2", "a private /proc (mount proc in a new mount namespace)"),
        (
            "import errno\nassert connect_errno() in (errno.ENETUNREACH, errno.EACCES, errno.EPERM)",
            "a network namespace without interfaces (unshare CLONE_NEWNET)",
        ),
        ("assert not writable('/')", "a read-only root (mount namespace, pivot_root)"),
        ("assert writable('/tmp')", "a writable private /tmp (tmpfs)"),
        (f"assert not exists({canary!r})", "a root that hides the host's files (pivot_root)"),
        ("assert capabilities() == 0", "no capabilities left (capset)"),
        (f"assert uid() != {me} or {me} != 0", "a uid of its own when the trainer is root"),
        ("assert seccomp() == 2", "a seccomp filter (prctl PR_SET_SECCOMP)"),
        (
            "assert refused('keyctl') and refused('shmget') and refused('unshare') and refused('inotify_init1')",
            "the kernel keyring, System V IPC, new namespaces and inotify refused (seccomp)",
        ),
        ("assert memory_cgroup()", "a memory cgroup of the run's own (cgroup v1 or v2, writable)"),
        ("assert stdlib() == 7", "the interpreter's standard library readable inside the sandbox"),
        # the checker's own process: contained like the program
        (
            f"import os\nassert not os.path.exists({canary!r}) and os.getpid() > 1",
            "the checker's root hiding the host's files",
        ),
        (
            f"import os\nassert os.getuid() != {me} or {me} != 0",
            "the checker's uid of its own when the trainer is root",
        ),
        ("import os\nassert not os.access('/', os.W_OK)", "the checker's read-only root"),
        (
            "for line in open('/proc/self/status'):\n    if line.startswith('Seccomp:'):\n"
            "        assert int(line.split()[1]) == 2",
            "the checker's seccomp filter",
        ),
    ]


_checked: dict = {}
_check_lock = threading.Lock()


def check_isolation(isolation: str = "isolated") -> None:
    """Build the sandbox once and probe it from inside both cells; SandboxUnavailableError names what is missing
    and the opt-out. Cached per process."""
    if isolation == "none":
        return
    with _check_lock:
        if isolation in _checked:
            if _checked[isolation]:
                raise SandboxUnavailableError(_checked[isolation])
            return
        import tempfile

        with tempfile.NamedTemporaryFile(prefix="dsgrpo-canary-") as canary:
            probes = _probe_tests(canary.name)
            try:
                result = _run(
                    _PROBE_PROGRAM,
                    [t for t, _ in probes],
                    [],
                    SandboxLimits(timeout_s=20, wall_timeout_s=40, cpu_s=20),
                    isolation,
                )
            except RuntimeError as exc:
                result = {"unavailable": str(exc)}
        problem = None
        if "unavailable" in result:
            problem = result["unavailable"]
        elif result.get("hung") or result["asserts"]["ended"]:
            problem = f"the probe program did not run ({result.get('asserts', {}).get('ended') or 'hung'})"
        else:
            missing = [why for (_, why), ok in zip(probes, result["asserts"]["passed"]) if not ok]
            if missing:
                problem = "missing " + "; ".join(missing)
        _checked[isolation] = (
            (
                f"code_reward cannot isolate untrusted code on this machine: {problem}. Run as "
                "root, or enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1"
                ", user.max_user_namespaces > 0) and give this user a cgroup (DSGRPO_SANDBOX_CGROUP)"
                f". {OPT_OUT}"
            )
            if problem
            else ""
        )
        if problem:
            raise SandboxUnavailableError(_checked[isolation])


# ---------------------------------------------------------------------------------------------- the reward
def _per_row(column, n: int, name: str) -> list:
    if column is None:
        return [None] * n
    column = list(column)
    if len(column) != n:
        raise ValueError(f"code_reward: the {name} column has {len(column)} values for {n} completions.")
    return column


def _setup_code(setup, imports) -> str:
    """A row's setup: MBPP's `test_imports` (a list of import lines) then its `test_setup_code`."""
    parts = []
    if imports:
        parts.extend([imports] if isinstance(imports, str) else list(imports))
    if setup:
        parts.append(setup)
    return "\n".join(parts)


def _entry_points(value) -> list:
    if not value:
        return []
    names = [value] if isinstance(value, str) else list(value)
    for name in names:
        if not (isinstance(name, str) and name.isidentifier()):
            raise ValueError(f"code_reward: entry_point {name!r} is not a Python name.")
    return names


class CodeReward:
    """Built-in `code_reward`: the fraction of a row's `tests` the completion's program passes (its last
    ```python block, or the whole text). Optional columns: `entry_point` (the function the tests call, e.g.
    HumanEval's; a name or a list), `test_setup_code` and `test_imports` (MBPP's: run before each test). Rows are
    scored in parallel, one run per core."""

    def __init__(
        self,
        isolation: str = "isolated",
        limits: Optional[SandboxLimits] = None,
        workers: Optional[int] = None,
        float_tolerance: Optional[float] = 1e-6,
    ):
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"code_sandbox={isolation!r}: expected one of {ISOLATION_MODES}.")
        self.isolation, self.limits = isolation, limits or SandboxLimits()
        self.workers = workers or len(os.sched_getaffinity(0))
        self.float_tolerance = float_tolerance
        self.__name__ = "code_reward"
        self._errors: dict = {}  # rows the sandbox could not judge since the trainer last read them, by reason
        self._errors_lock = threading.Lock()

    def with_isolation(self, isolation: str) -> "CodeReward":
        if isolation == self.isolation:
            return self
        return CodeReward(isolation, self.limits, self.workers, self.float_tolerance)

    def check(self) -> None:
        """At trainer start: the sandbox can be built here, or training does not start."""
        check_isolation(self.isolation)
        if self.isolation == "none":
            warnings.warn(
                "code_sandbox='none': completions' code runs without containment, as this user.", stacklevel=2
            )

    def score(self, completion, tests, entry_point=None, setup: str = "") -> float:
        if isinstance(completion, list):  # conversational: the last message (this module imports nothing of dsgrpo,
            completion = completion[-1]["content"] if completion else ""  # so tests can load it on its own)
        tests = tests if isinstance(tests, (list, tuple)) else [tests]
        try:
            return run_tests(
                extract_code(completion),
                tests,
                self.limits,
                self.isolation,
                setup,
                _entry_points(entry_point),
                self.float_tolerance,
            )
        except SandboxError as exc:  # not the program's doing: no score (None), counted and said with its cause
            reason = str(exc)
            with self._errors_lock:
                self._errors[reason] = self._errors.get(reason, 0) + 1
            _warn_once(
                f"{self.__name__}: a row could not be judged and scores None (rewards/{self.__name__}/errors): {reason}"
            )
            return None

    def pop_errors(self) -> dict:
        """{reason: rows} the sandbox could not judge since the last call (the trainer logs their sum as
        `rewards/<name>/errors`)."""
        with self._errors_lock:
            errors, self._errors = self._errors, {}
        return errors

    def __call__(
        self, completions, tests, entry_point=None, test_setup_code=None, test_imports=None, **kwargs
    ) -> List[float]:
        n = len(completions)
        entry = _per_row(entry_point, n, "entry_point")
        setups = [
            _setup_code(s, i)
            for s, i in zip(_per_row(test_setup_code, n, "test_setup_code"), _per_row(test_imports, n, "test_imports"))
        ]
        if n <= 1 or self.workers <= 1:
            return [self.score(*row) for row in zip(completions, tests, entry, setups)]
        with ThreadPoolExecutor(max_workers=min(self.workers, n)) as pool:
            return list(pool.map(self.score, completions, tests, entry, setups))


code_reward = CodeReward()
