"""Preparations that run beside the unit tests. Two things the suite needs take a minute of one core each and load
no model of a launch: pip's resolver over the GPU lock, and fine-tuning the tool-calling model test_api_dist
launches with. They start, each in a process of its own, as soon as collection knows a selected test needs one
(conftest.pytest_collection_finish), while the unit tests, which run first and keep one core busy about a third of
their time, go on; the test that needs one waits for its result. Nothing is skipped: the same commands, run
earlier."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (the node id prefix of the tests that need it, the command; {out} is a folder of the job's own)
JOBS = {
    "gpu_lock_resolve": ("tests/test_gpu_lock.py::test_pip_resolves_the_lock_unchanged_for_a_cuda_machine",
                         [sys.executable, os.path.join(REPO, "requirements", "gpu_lock.py"), "check"]),
    "tool_caller_model": ("tests/test_api_dist.py::",
                          [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                           "from test_api_dist import fine_tune_tool_caller; fine_tune_tool_caller(sys.argv[2])",
                           os.path.join(REPO, "tests"), "{out}"]),
}
_running: dict = {}  # name -> (Popen, its folder)
_root = None


def start_needed(nodeids) -> None:
    for name, (prefix, _) in JOBS.items():
        if name not in _running and any(n.startswith(prefix) for n in nodeids):
            start(name)


def start(name: str) -> None:
    global _root
    _root = _root or tempfile.mkdtemp(prefix="dsgrpo-suite-")
    folder = os.path.join(_root, name)
    os.makedirs(os.path.join(folder, "out"))
    argv = [a.replace("{out}", os.path.join(folder, "out")) for a in JOBS[name][1]]
    # one thread of compute: the other core is the unit tests'
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": REPO}
    log = open(os.path.join(folder, "log"), "w")
    _running[name] = (subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), folder)


def result(name: str, timeout: float = 1500) -> tuple:
    """(exit code, its output, its folder for files) of a job, once it has ended; started now if nothing had."""
    if name not in _running:
        start(name)
    popen, folder = _running[name]
    try:
        popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        popen.kill()
        raise AssertionError(f"{name} ({' '.join(popen.args)}) did not end within {timeout} s") from None
    with open(os.path.join(folder, "log")) as fh:
        return popen.returncode, fh.read(), os.path.join(folder, "out")


def stop_all() -> None:
    for popen, _ in _running.values():
        if popen.poll() is None:
            popen.kill()
            popen.wait()
    if _root:
        shutil.rmtree(_root, ignore_errors=True)
