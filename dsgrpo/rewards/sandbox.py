"""Run untrusted completion code against tests in a throw-away subprocess.

Containment, each layer independent of the others:
- a fresh temporary working directory, deleted afterwards; the child runs `python -I` (isolated mode: no
  user site, no PYTHON* variables) with a minimal environment;
- resource limits set in the child before exec: CPU seconds, address space, file size, number of processes
  (a fork bomb hits RLIMIT_NPROC), no core dumps; a wall-clock timeout kills the whole process group;
- no network: the child first tries to enter fresh user+network namespaces (only a loopback device, down);
  where the kernel refuses, the harness replaces `socket.socket` before the untrusted code runs;
- writes outside the working directory: when the trainer runs as root (our CI, most containers) the program
  runs as `nobody`, which owns nothing but that directory; otherwise it runs as the trainer's user, and only
  RLIMIT_FSIZE and the HOME/TMPDIR redirection stand in the way. Run untrusted code as root-launched or in a
  container for hostile workloads.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import List, Optional, Sequence

_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)

# The harness runs the completion's code, then each test in its own try block, and prints one JSON line.
_HARNESS = r'''
import json, socket, sys
def _no_network(*a, **k):
    raise OSError("network access is disabled in the reward sandbox")
socket.socket = _no_network
socket.create_connection = _no_network
spec = json.load(open("spec.json"))
ns = {"__name__": "__main__"}
passed = 0
try:
    exec(compile(spec["code"], "solution.py", "exec"), ns)
    ok = True
except BaseException:
    ok = False
if ok:
    for test in spec["tests"]:
        try:
            exec(compile(test, "test.py", "exec"), ns)
            passed += 1
        except BaseException:
            pass
sys.stdout.write("\n__RESULT__" + json.dumps({"passed": passed}) + "\n")
'''


@dataclass
class SandboxLimits:
    timeout_s: float = 5.0        # wall clock for the whole program + tests
    cpu_s: int = 5                # CPU seconds
    memory_bytes: int = 512 << 20  # address space
    file_bytes: int = 16 << 20    # largest file it may write
    processes: int = 64           # RLIMIT_NPROC (per user: the sandbox's own plus the caller's)


def extract_code(completion: str) -> str:
    """The last ```python block of a completion, or the whole text when it has none."""
    blocks = _CODE_BLOCK.findall(completion)
    return blocks[-1] if blocks else completion


NOBODY = 65534


def _enter_isolation(limits: SandboxLimits, drop_to_nobody: bool):
    def setup():  # runs in the child between fork and exec
        os.setsid()  # its own process group, so a timeout can kill every descendant
        _try_unshare_network()
        for res, value in ((resource.RLIMIT_CPU, limits.cpu_s), (resource.RLIMIT_AS, limits.memory_bytes),
                           (resource.RLIMIT_FSIZE, limits.file_bytes), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(res, (value, value))
        if drop_to_nobody:
            # root ignores RLIMIT_NPROC and may write anywhere: run the program as nobody, which owns only the
            # working directory and may start at most `processes` processes
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        else:  # the limit counts all of this user's processes: allow a margin over what runs already
            mine = sum(1 for d in os.listdir("/proc") if d.isdigit() and _owner(d) == os.getuid())
            resource.setrlimit(resource.RLIMIT_NPROC, (mine + limits.processes,) * 2)
    return setup


def _world_executable(path: str) -> bool:
    """Can a user with no rights of its own (nobody) execute `path`? Every directory on the way needs o+x."""
    import stat

    path = os.path.realpath(path)
    if not os.path.isfile(path) or not os.stat(path).st_mode & stat.S_IXOTH:
        return False
    parent = os.path.dirname(path)
    while parent != "/":
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(parent)
    return True


def _interpreter() -> tuple:
    """(python to run, whether to drop to nobody). As root, prefer an interpreter nobody can execute (a venv
    under /root is not); the harness needs only the standard library."""
    if os.getuid() != 0:
        return sys.executable, False
    for candidate in (sys.executable, getattr(sys, "_base_executable", ""), "/usr/bin/python3", "/usr/local/bin/python3"):
        if candidate and _world_executable(candidate):
            return candidate, True
    return sys.executable, False


def _owner(pid: str) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


def _try_unshare_network() -> bool:
    import ctypes

    CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWNET) == 0:  # root: a network namespace alone keeps uid 0 semantics
            return True
        return libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0
    except OSError:
        return False


def run_tests(code: str, tests: Sequence[str], limits: Optional[SandboxLimits] = None) -> float:
    """Fraction of `tests` (Python snippets, usually asserts) that pass after running `code`; 0.0 when the
    program crashes, times out or exceeds a limit."""
    limits = limits or SandboxLimits()
    if not tests:
        return 0.0
    workdir = tempfile.mkdtemp(prefix="dsgrpo-sandbox-")
    try:
        with open(os.path.join(workdir, "spec.json"), "w") as fh:
            json.dump({"code": code, "tests": list(tests)}, fh)
        python, drop = _interpreter()
        if drop:
            os.chown(workdir, NOBODY, NOBODY)
            os.chown(os.path.join(workdir, "spec.json"), NOBODY, NOBODY)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "PYTHONDONTWRITEBYTECODE": "1",
               "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([python, "-I", "-c", _HARNESS], cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, preexec_fn=_enter_isolation(limits, drop))
        try:
            out, _ = proc.communicate(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return 0.0
        finally:
            _kill_group(proc)  # descendants left behind by the program (fork bombs, daemons)
        marker = out.rfind(b"__RESULT__")
        if marker < 0:
            return 0.0
        return json.loads(out[marker + len(b"__RESULT__"):].decode())["passed"] / len(tests)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def code_reward(completions, tests, **kwargs) -> List[float]:
    """Built-in: fraction of a row's `tests` (a list of Python snippets) the completion's code passes."""
    from .builtins import completion_text

    return [run_tests(extract_code(completion_text(c)), t if isinstance(t, (list, tuple)) else [t])
            for c, t in zip(completions, tests)]
