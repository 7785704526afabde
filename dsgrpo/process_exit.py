"""`leave(code)`: end a process dsgrpo owns (a launcher's rank, a test launch) without the interpreter's teardown.

A rank that trained with torch, transformers, DeepSpeed and vLLM holds millions of Python objects. A normal exit
tears its modules down and collects garbage over all of them: 2.5 s a rank on CPU, after the run's work is done and
its files are written, at the end of every run and every test launch (vLLM's engine shutdown collects twice more:
compat.skip_garbage_collection_at_exit). `leave` does what a normal exit does that matters and skips the rest:

    1. waits for the threads a normal exit would wait for (non-daemon ones, e.g. a tracker's uploader), after
       threading's own exit hooks (they end idle ThreadPoolExecutor workers),
    2. runs the atexit handlers (trackers' own, callbacks', the engine's shutdown),
    3. flushes every file Python still holds open for writing (a reward function's log kept in a global, say),
    4. os._exit(code).

Only for entry points: called from a library function it would end the caller's process."""

from __future__ import annotations

import atexit
import gc
import io
import os
import sys
import threading
from typing import NoReturn


_exit_code: list = []


def exit_code():
    """The code leave() was called with (None before): what exit hooks see of how the process ends."""
    return _exit_code[0] if _exit_code else None


def say_line(text: str, fd: int = 2) -> None:
    """Write `text` and its newline in one write. Ranks share the launcher's stderr pipe, and print() writes the text
    and its newline separately: another rank's line could land between them (a test's marker line, then unreadable,
    failed CI). One write of up to PIPE_BUF (4096) bytes is never split on a pipe; a flush first keeps order with
    what the stream already holds."""
    stream = sys.stderr if fd == 2 else sys.stdout if fd == 1 else None
    if stream is not None:
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os.write(fd, (text.rstrip("\n") + "\n").encode("utf-8", "backslashreplace"))


def leave(code: int = 0) -> NoReturn:
    _exit_code.append(code)
    # CPython's own first exit step (private; 3.11-3.13): threading's exit hooks first, which tell idle
    # ThreadPoolExecutor workers to end, then the join of every non-daemon thread. Joining without the hooks waited
    # forever on a live executor's idle worker (a rank hung at exit now and then).
    threading._shutdown()
    atexit._run_exitfuncs()  # the interpreter's next step (private, unchanged since 3.0): each handler once, last first
    is_file = {}  # type -> a file? (issubclass per object: 0.8 s over a rank's 650k objects; per type: 0.2)
    for obj in gc.get_objects():
        kind = type(obj)  # (type(): isinstance on a dead weak proxy raises)
        found = is_file.get(kind)
        if found is None:
            found = is_file[kind] = issubclass(kind, io.IOBase)
        if found:
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:  # noqa: BLE001 - a pipe whose reader left, a detached buffer: flush what can be
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code if isinstance(code, int) else 1)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def set_parent_death_signal(sig: int) -> bool:
    """Have the kernel send `sig` to this process when the thread that started it ends (Linux; False elsewhere)."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def end_with_launcher() -> None:
    """A launched rank ends with the launcher that started it: SIGKILL from the kernel when its parent ends (a
    SIGTERM would be taken as a preemption request, and a stopped rank cannot act on either). Launchers above the
    parent that must be followed too (DeepSpeed's runner, which does not pass a SIGTERM on to its node launcher on
    one node) are followed by the rank's watcher (watchdog.launchers_to_follow). Called once, at the start of
    dist.init."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return  # not started by a launcher (a world of one, a notebook): its parent is a shell, not its job
    import signal

    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != _PARENT:  # the launcher ended between this process's start and the line above
        os._exit(1)


_PARENT = os.getppid()  # at import: the process that started this one


def parent_at_start() -> int:
    """The pid of the process that started this one, as it was when this module was imported."""
    return _PARENT
