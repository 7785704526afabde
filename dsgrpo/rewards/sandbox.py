"""Score untrusted code: the completion's program against a row's tests, in a sandbox it cannot forge, crash or
leave.

Under RL the policy is an adversary of its own reward, so nothing the program says about itself is believed.
The program runs in a process of its own (dsgrpo/rewards/sandbox_runner.py has the whole picture) and only
answers questions: for a test snippet such as `assert add(1, 2) == 3`, the snippet runs in a separate
supervisor process, which asks the program for `add(1, 2)`, receives plain data (an int, a list, ...; an object
of the program's own stays behind as an opaque handle) and does the comparison itself. For a stdin/stdout case
the program only ever sees the input; its output comes back here and is compared with the expected output,
which never leaves this process. So:

- the tests are never readable by the program: they live in the supervisor (another PID namespace, no shared
  file) or here; a printed marker, a patched harness, patched builtins, an object equal to everything, frame
  inspection or `sys.settrace` change nothing but the program's own answers;
- the reward is passed tests / all tests, in [0, 1]; a program that breaks a limit (time, memory, output,
  answer size), exits, or answers anything malformed scores 0.0 and never raises;
- containment (isolation="isolated", the default): the program is PID 1 of its own PID namespace (no process
  of the run outlives it: the kernel kills the whole namespace), with its own network namespace (no interface
  up), mount namespace (a read-only root holding only the interpreter's files, a private 16 MiB /tmp and
  /dev/shm, a private /proc: the trainer's files, environment and other runs are not there), IPC and UTS
  namespaces; as root it runs under a uid of its own, as another user inside a user namespace with every
  capability dropped; no exec can regain privileges (NO_NEW_PRIVS). Limits: wall clock, CPU seconds, address
  space per process, resident memory of all the run's processes together (checked every 20 ms), processes
  (threads included) of the run, file size, 1 MiB of stdout + stderr.

When isolation cannot be had (no user namespaces, a mount refused), `check_isolation` says what is missing, and
training with code_reward does not start; `isolation="none"` (config `code_sandbox: none`) is the opt-out for
data and models you trust: limits and a killed process group only, no containment and no integrity promise.
"""

from __future__ import annotations

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

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_runner.py")
ISOLATION_MODES = ("isolated", "none")
_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


class SandboxUnavailableError(RuntimeError):
    """The sandbox cannot be built on this machine: code_reward refuses to score rather than run code unconfined."""


@dataclass
class SandboxLimits:
    timeout_s: float = 5.0          # wall clock of one program run (the snippets' run, or one stdin/stdout case)
    cpu_s: int = 5                  # CPU seconds of each process
    memory_bytes: int = 512 << 20   # resident memory of all the run's processes together; address space of each
    file_bytes: int = 16 << 20      # largest file it may write (in its private /tmp)
    processes: int = 16             # processes and threads of the run
    output_bytes: int = 1 << 20     # stdout + stderr; beyond it the run is killed and scores 0
    message_bytes: int = 16 << 20   # all its answers to the test snippets together
    tmp_bytes: int = 16 << 20       # its private /tmp and /dev/shm (tmpfs: memory)


def extract_code(completion: str) -> str:
    """The last ```python block of a completion, or the whole text when it has none."""
    blocks = _CODE_BLOCK.findall(completion)
    return blocks[-1] if blocks else completion


def _binds() -> List[str]:
    """What the program's root holds, read-only: the system's libraries and this interpreter's own files."""
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
            raise ValueError(f"tests[{i}] = {test!r:.80}: code_reward takes Python snippets (usually asserts) or "
                             "stdin/stdout cases {'input': str, 'output': str}.")
    return snippets, cases


def outputs_match(got: bytes, expected: str) -> bool:
    """A stdin/stdout case passes when the output's tokens equal the expected ones (whitespace and line breaks
    aside); numbers that are not equal as text may differ by 1e-6 (absolute or relative)."""
    try:
        got_tokens = got.decode("utf-8").split()
    except UnicodeDecodeError:
        return False
    want_tokens = expected.split()
    if len(got_tokens) != len(want_tokens):
        return False
    for g, w in zip(got_tokens, want_tokens):
        if g == w:
            continue
        try:
            a, b = float(g), float(w)
        except ValueError:
            return False
        if not (math.isfinite(a) and math.isfinite(b) and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)):
            return False
    return True


def _frame(obj) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack(">I", len(data)) + data


def _run(code: str, snippets: List[str], inputs: List[str], limits: SandboxLimits, isolation: str) -> dict:
    """One supervisor process: its verdicts on the snippets and the programs' outputs for the inputs."""
    job = {"isolated": isolation == "isolated", "limits": asdict(limits), "code": code, "n_tests": len(snippets),
           "inputs": [s.encode().hex() for s in inputs], "base": "/tmp", "binds": _binds()}
    # the snippets follow in a frame of their own, read by the supervisor only after the program has forked
    payload = _frame(job) + (_frame({"tests": snippets}) if snippets else b"")
    proc = subprocess.Popen([sys.executable, "-I", "-S", RUNNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
                            cwd="/")
    budget = (len(inputs) + (1 if snippets else 0)) * (limits.timeout_s + 1.0) + 10.0
    try:
        out, err = proc.communicate(payload, timeout=budget)
    except subprocess.TimeoutExpired:
        # the supervisor's own test code hangs (a test snippet that never ends): its holders and programs die
        # with it (PDEATHSIG), their namespaces with them
        proc.kill()
        proc.communicate()
        return {"hung": True}
    if len(out) < 4 or len(out) != 4 + struct.unpack(">I", out[:4])[0]:
        raise RuntimeError(f"the sandbox supervisor failed (exit {proc.returncode}): "
                           f"{err.decode(errors='replace')[-2000:]}")
    return json.loads(out[4:])


def run_tests(code: str, tests: Sequence, limits: Optional[SandboxLimits] = None,
              isolation: str = "isolated") -> float:
    """Fraction of `tests` the program passes: Python snippets (usually asserts), run after the program as if
    they followed it, and stdin/stdout cases {'input': ..., 'output': ...} (the program as a script, once per
    case). 0.0 when the program breaks a limit, exits or raises before the snippets, or answers out of protocol."""
    limits = limits or SandboxLimits()
    if isolation not in ISOLATION_MODES:
        raise ValueError(f"isolation={isolation!r}: expected one of {ISOLATION_MODES}.")
    tests = list(tests)
    if not tests:
        return 0.0
    snippets, cases = _split_tests(tests)
    try:
        result = _run(code, snippets, [c["input"] for c in cases], limits, isolation)
    except RuntimeError as exc:  # a fault of the supervisor's own (no program can reach it): said, never a reward
        _warn_once(f"code_reward: a sandbox run failed and scores 0.0: {exc}")
        return 0.0
    if "unavailable" in result:
        raise SandboxUnavailableError(f"The code sandbox cannot be built here: {result['unavailable']}. "
                                      f"{OPT_OUT}")
    if result.get("hung"):
        return 0.0
    passed = 0
    for case, run in zip(cases, result["io"]):
        if run.get("fatal"):  # the output limit, a malformed run: an attack, not a wrong answer
            return 0.0
        passed += bool(run["ok"]) and outputs_match(bytes.fromhex(run["stdout"]), case["output"])
    if snippets:
        verdicts = result["asserts"]["passed"]
        passed += sum(1 for v in verdicts if v is True)
    return passed / len(tests)


_warned: set = set()


def _warn_once(message: str) -> None:
    if message[:200] not in _warned:
        _warned.add(message[:200])
        warnings.warn(message, RuntimeWarning, stacklevel=3)


OPT_OUT = ("If you trust the data and the model, set code_sandbox: none in the config (dsgrpo serve-reward "
           "--code-sandbox none) to run the code without containment.")

# ---------------------------------------------------------------------------------------------- isolation check
_PROBE_PROGRAM = r'''
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
def stdlib():
    import collections, json, math, re, heapq, itertools, functools, bisect, decimal, fractions, random
    return math.isqrt(17) + len(json.dumps([1]))
'''


def _probe_tests(canary: str) -> List[tuple]:
    return [
        ("assert pid() == 2", "a PID namespace of its own (unshare CLONE_NEWPID)"),
        ("assert processes() == 2", "a private /proc (mount proc in a new mount namespace)"),
        ("import errno\nassert connect_errno() in (errno.ENETUNREACH, errno.EACCES, errno.EPERM)",
         "a network namespace without interfaces (unshare CLONE_NEWNET)"),
        ("assert not writable('/')", "a read-only root (mount namespace, pivot_root)"),
        ("assert writable('/tmp')", "a writable private /tmp (tmpfs)"),
        (f"assert not exists({canary!r})", "a root that hides the host's files (pivot_root)"),
        ("assert capabilities() == 0", "no capabilities left (capset)"),
        (f"assert uid() != {os.getuid()} or {os.getuid()} != 0", "a uid of its own when the trainer is root"),
        ("assert stdlib() == 7", "the interpreter's standard library readable inside the sandbox"),
    ]


_checked: dict = {}
_check_lock = threading.Lock()


def check_isolation(isolation: str = "isolated") -> None:
    """Build the sandbox once and probe it from inside; SandboxUnavailableError names what is missing and the
    opt-out. Cached per process."""
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
                result = _run(_PROBE_PROGRAM, [t for t, _ in probes], [], SandboxLimits(timeout_s=20, cpu_s=20),
                              isolation)
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
        _checked[isolation] = (f"code_reward cannot isolate untrusted code on this machine: {problem}. Run as "
                               "root, or enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1"
                               f", user.max_user_namespaces > 0). {OPT_OUT}") if problem else ""
        if problem:
            raise SandboxUnavailableError(_checked[isolation])


# ---------------------------------------------------------------------------------------------- the reward
class CodeReward:
    """Built-in `code_reward`: the fraction of a row's `tests` the completion's program passes (its last
    ```python block, or the whole text). Rows are scored in parallel, one run per core."""

    def __init__(self, isolation: str = "isolated", limits: Optional[SandboxLimits] = None,
                 workers: Optional[int] = None):
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"code_sandbox={isolation!r}: expected one of {ISOLATION_MODES}.")
        self.isolation, self.limits = isolation, limits or SandboxLimits()
        self.workers = workers or len(os.sched_getaffinity(0))
        self.__name__ = "code_reward"

    def with_isolation(self, isolation: str) -> "CodeReward":
        return self if isolation == self.isolation else CodeReward(isolation, self.limits, self.workers)

    def check(self) -> None:
        """At trainer start: the sandbox can be built here, or training does not start."""
        check_isolation(self.isolation)
        if self.isolation == "none":
            warnings.warn("code_sandbox='none': completions' code runs without containment, as this user.",
                          stacklevel=2)

    def score(self, completion, tests) -> float:
        if isinstance(completion, list):  # conversational: the last message (this module imports nothing of dsgrpo,
            completion = completion[-1]["content"] if completion else ""  # so tests can load it on its own)
        tests = tests if isinstance(tests, (list, tuple)) else [tests]
        return run_tests(extract_code(completion), tests, self.limits, self.isolation)

    def __call__(self, completions, tests, **kwargs) -> List[float]:
        if len(completions) <= 1 or self.workers <= 1:
            return [self.score(c, t) for c, t in zip(completions, tests)]
        with ThreadPoolExecutor(max_workers=min(self.workers, len(completions))) as pool:
            return list(pool.map(self.score, completions, tests))


code_reward = CodeReward()
