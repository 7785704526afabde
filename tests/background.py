"""Work that runs beside the unit tests. Some of what the suite needs takes a minute of one core and is no 2-rank
launch: pip's resolver over the GPU lock, fine-tuning the tool-calling model test_api_dist launches with, the two
one-process `dsgrpo train` runs test_report reads. Each starts in processes of its own as soon as collection knows
a selected test needs it (conftest.pytest_collection_finish), while the unit tests, which run first and keep one
core busy about a third of their time, go on; the test that needs one waits for its result. Nothing is skipped:
the same commands, run earlier."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # one core of compute: the other is the unit tests'

# name -> (the node id prefix (or prefixes) of the tests that need it, "module:function" that starts it:
# function(folder) returns a function that waits for it and returns its result)
JOBS = {
    "gpu_lock_resolve": (
        "tests/test_gpu_lock.py::test_pip_resolves_the_lock_unchanged_for_a_cuda_machine",
        "test_gpu_lock:start_resolve",
    ),
    "tool_caller_model": (
        ("tests/test_api_dist.py::", "tests/test_scale_dist.py::"),  # agents' checks too
        "test_api_dist:start_fine_tune",
    ),
    "report_runs": ("tests/test_report.py::", "test_report:start_runs"),
    # the verifiers ecosystem's own venv (issue 66's env host), built on first use and cached by its pins
    "verifiers_env": ("tests/test_api_dist.py::", "test_api_dist:start_verifiers_env"),
}
_waiting: dict = {}  # name -> the function that waits for it
_results: dict = {}
_started: list = []  # every process started here (stop_all kills what is left)
_root = None


def start_needed(nodeids) -> None:
    for name, (prefix, _) in JOBS.items():
        if name not in _waiting and any(n.startswith(prefix) for n in nodeids):
            start(name)


def start(name: str) -> None:
    global _root
    _root = _root or tempfile.mkdtemp(prefix="dsgrpo-suite-")
    folder = os.path.join(_root, name)
    os.makedirs(folder)
    module, _, function = JOBS[name][1].partition(":")
    _waiting[name] = getattr(importlib.import_module(module), function)(folder)


def result(name: str):
    """What the job's wait function returns, once (started now if nothing had started it)."""
    if name not in _results:
        if name not in _waiting:
            start(name)
        _results[name] = _waiting.pop(name)()
    return _results[name]


def command(
    argv: list, folder: str, name: str = "job", timeout: float = 1500, env: dict | None = None, cwd: str = REPO
):
    """Start argv, its output in folder/NAME.stdout and NAME.stderr; the wait function returns its
    subprocess.CompletedProcess (the files' text) once it has ended."""
    out, err = (
        open(os.path.join(folder, f"{name}.{stream}"), "w+") for stream in ("stdout", "stderr")
    )  # no pipe fills
    full_env = {**os.environ, "PYTHONPATH": REPO, **ONE_THREAD, **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}  # env={NAME: None} unsets NAME
    popen = track(subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=err, text=True, env=full_env))

    def wait() -> subprocess.CompletedProcess:
        try:
            popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{' '.join(map(str, argv))} did not end within {timeout} s") from None
        finally:
            popen.kill()
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess(popen.args, popen.returncode, out.read(), err.read())

    return wait


def track(popen: subprocess.Popen) -> subprocess.Popen:
    """A process a job started itself: killed at the session's end if it is still running."""
    _started.append(popen)
    return popen


def stop_all() -> None:
    for popen in _started:
        if popen.poll() is None:
            popen.kill()
            popen.wait()
    if _root:
        shutil.rmtree(_root, ignore_errors=True)
