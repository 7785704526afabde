"""Which rank was lost, and where, when a collective fails.

Every rank runs a heartbeat thread that writes `dsgrpo/heartbeat/<rank>` = {count, time, phase, step, pid, host} to
the job's rendezvous store, through a store client of its own, every HEARTBEAT_S seconds. When a collective
fails on a rank — a peer's socket closed (the peer was killed) or the collective timed out after ddp_timeout (a
peer is stopped, or hung in a device call or a reward call) — `diagnose()` reads every heartbeat twice,
DIAGNOSE_S apart: a rank whose count did not move is lost, and its last phase and step say where. On the same
host /proc tells gone (killed, crashed) from stopped (SIGSTOP) from alive-but-stuck. The store lives in rank 0's
process (or in torchrun's agent): when it cannot be reached at all, the lost rank is its host.

The surviving ranks then end with RankLostError instead of a backend error without names. `dsgrpo train` prints
it as one `dsgrpo: error:` block and exits at once with RANK_LOST_EXIT_CODE (a process whose peer is gone can
hang in its own shutdown: engine threads, process-group teardown), bounded by ddp_timeout + DIAGNOSE_S.

That explains a collective that failed; a collective that never fails (DeepSpeed's own: ZeRO's gradient reduction,
its CPU shared-memory allreduce) or a C call holding the GIL would wait forever. So the heartbeat also starts the
rank's watcher (watcher.py), a process of its own that beats for the rank from /proc (alive and running, not
stopped, not blocked on a full pipe) and ends the rank, with the same message and exit code, once a peer's beats
stop for ddp_timeout. Liveness is the watcher's count: a rank whose main thread holds the GIL is alive."""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from . import dist
from .watcher import ALIVE_KEY, HEARTBEAT_KEY as KEY, RANK_LOST_EXIT_CODE, describe_process, start_time

HEARTBEAT_S = 1.0
DIAGNOSE_S = 3.0  # > 2 heartbeats: a live rank's count moves at least twice in this window
LOST_SIGNAL = signal.SIGQUIT  # its handler is _exit, called with the signal's number: RANK_LOST_EXIT_CODE
assert int(LOST_SIGNAL) == RANK_LOST_EXIT_CODE


class RankLostError(RuntimeError):
    """A peer rank stopped answering (killed, stopped or hung); the message names it and its last phase."""


@dataclass
class Beat:
    count: int
    time: float
    phase: str
    since: float  # when the main thread entered that phase
    step: int
    pid: int
    host: str

    @classmethod
    def parse(cls, raw: bytes) -> "Beat":
        return cls(**json.loads(raw))


class Heartbeat:
    """One per process; started once the process group exists; a daemon thread, and a beat whenever the main
    thread enters a phase (so the last beat of a killed rank says where it died)."""

    def __init__(
        self, rank: int, world: int, step: Callable[[], int], watch: bool = True, lost_after_s: Optional[float] = None
    ):
        from . import timing

        self.rank, self.world, self.step = rank, world, step
        self.store = dist.rendezvous_store_client(timeout_s=10)
        self.host = socket.gethostname()
        self.count = 0
        self.phase, self.since = timing.current_phase(), time.time()
        self._lock = threading.Lock()  # one store client, two threads
        self._broken = False
        self._stopping = threading.Event()
        self.beat()  # the first beat is written before any collective can fail
        timing.phase_listeners.append(self.beat)
        self._thread = threading.Thread(target=self._run, name="dsgrpo-heartbeat", daemon=True)
        self._thread.start()
        lost_after_s = dist.collective_timeout_s() if lost_after_s is None else lost_after_s
        self.watcher = start_watcher(rank, world, lost_after_s) if watch else None
        atexit.register(self.stop)  # beats until the process ends

    def stop(self) -> None:
        """Tell the watcher this rank ends on purpose, and join the beating thread before the interpreter finalizes.
        A daemon thread still inside the store's C++ call then is ended by a forced unwind through pybind11's
        noexcept frame, which aborts the whole process ('terminate called without an active exception', SIGABRT
        after a finished run: seen once in a full test run, rank 0 of a resumed run that had written all its
        results)."""
        self._stopping.set()
        if self.watcher is not None:
            from .process_exit import exit_code

            failed = exit_code() not in (0, None) or getattr(sys, "last_value", None) is not None
            try:  # a finished rank is never lost; a failed one is, to a peer waiting for it
                self.watcher.stdin.write("failed\n" if failed else "finished\n")
                self.watcher.stdin.close()
            except (OSError, ValueError):
                pass
            self.watcher = None
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=HEARTBEAT_S + 10)  # one beat in flight at most (the client's timeout: 10 s)

    def beat(self) -> None:
        from .timing import current_phase

        if self._broken:
            return
        with self._lock:
            now, phase = time.time(), current_phase()
            if phase != self.phase:
                self.phase, self.since = phase, now
            self.count += 1
            value = json.dumps(
                {
                    "count": self.count,
                    "time": now,
                    "phase": phase,
                    "since": self.since,
                    "step": self.step(),
                    "pid": os.getpid(),
                    "host": self.host,
                }
            )
            try:
                self.store.set(KEY.format(rank=self.rank), value)
            except Exception as exc:  # the store's host is gone: diagnose() will say so; nothing to beat to
                self._broken = True
                if os.environ.get("DSGRPO_DEBUG"):
                    print(f"dsgrpo: heartbeat of rank {self.rank} stops: {exc!r}", flush=True)

    def _run(self) -> None:
        while not self._broken and not self._stopping.wait(HEARTBEAT_S):
            self.beat()

    def read(self) -> Dict[int, Optional[Beat]]:
        """Every rank's last beat (None: it never wrote one). Raises when the store cannot be reached."""
        out = {}
        with self._lock:
            for rank in range(self.world):
                key = KEY.format(rank=rank)
                out[rank] = Beat.parse(self.store.get(key)) if self.store.check([key]) else None
        return out

    def read_alive(self) -> Dict[int, Optional[dict]]:
        """Every rank's watcher record ({count, note, done, ...}; None: no watcher beat for it)."""
        out = {}
        with self._lock:
            for rank in range(self.world):
                key = ALIVE_KEY.format(rank=rank)
                out[rank] = json.loads(self.store.get(key)) if self.store.check([key]) else None
        return out

    def diagnose(self, pause: float = DIAGNOSE_S, stuck_after: Optional[float] = None) -> Optional[str]:
        """A sentence naming every lost rank and where it was, or None when all are alive (the failure was
        something else). A rank is lost when its heartbeat stops (killed, or the whole process stopped), or,
        with `stuck_after` (a collective timed out), when it has been in one phase that long while its
        heartbeat goes on (its main thread is stuck there). Takes `pause` seconds."""
        try:
            first, alive_first = self.read(), self.read_alive()
            time.sleep(pause)
            second, alive = self.read(), self.read_alive()
        except (RuntimeError, OSError, TimeoutError) as exc:  # the rendezvous store is gone with its host
            host = "torchrun's agent" if os.environ.get("TORCHELASTIC_RUN_ID") else "rank 0"
            if self.rank == 0 and host == "rank 0":
                return None  # it is our own store: something else failed
            return (
                f"lost {host}: the job's rendezvous store, which it hosts, cannot be reached "
                f"({type(exc).__name__}: {exc})"
            )
        others = [r for r in range(self.world) if r != self.rank]

        def still(r):  # the watcher's count when it beats for the rank (a GIL-holding rank is alive), else ours
            if alive_first[r] is not None and alive[r] is not None:
                return alive[r]["count"] == alive_first[r]["count"]
            return second[r] is None or first[r] is None or second[r].count == first[r].count

        lost = [r for r in others if still(r)]
        if lost:
            return "; ".join(_describe(r, second[r], (alive[r] or {}).get("note")) for r in lost)
        if stuck_after is not None:
            now = time.time()
            stuck = [r for r in others if now - second[r].since >= stuck_after]
            if stuck:
                return "; ".join(
                    f"rank {r} (pid {second[r].pid} on {second[r].host}) is stuck in phase "
                    f"'{second[r].phase}' at step {second[r].step}: {now - second[r].since:.0f} s there, "
                    "its heartbeat still running (a hung device, reward or I/O call?)"
                    for r in stuck
                )
        return None


def _describe(rank: int, beat: Optional[Beat], note: Optional[str] = None) -> str:
    if beat is None:
        return f"lost rank {rank}: it never sent a heartbeat"
    ago = time.time() - beat.time
    where = f"in phase '{beat.phase}' at step {beat.step}"
    return (
        f"lost rank {rank} (pid {beat.pid} on {beat.host}) {where}: {describe_process(beat.pid, beat.host, note)}, "
        f"last heartbeat {ago:.0f} s ago"
    )


def install_lost_exit() -> None:
    """The watcher ends its rank with LOST_SIGNAL, whose handler here is libc's _exit itself: a C handler runs
    whatever the rank waits in (a collective that never returns, a C call holding the GIL), where a Python
    handler would wait for the interpreter forever, and _exit(signal number) exits with RANK_LOST_EXIT_CODE."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.signal.argtypes, libc.signal.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p
    libc.signal(int(LOST_SIGNAL), ctypes.cast(libc._exit, ctypes.c_void_p))


def launchers_to_follow() -> dict:
    """{pid: start time} of launchers above this rank's parent that it ends with (watcher.py checks them)."""
    from .compat import deepspeed_runner_above
    from .process_exit import parent_at_start

    runner = deepspeed_runner_above(parent_at_start())
    return {runner: start_time(runner)} if runner else {}


def start_watcher(rank: int, world: int, timeout_s: float) -> Optional[subprocess.Popen]:
    """This rank's watcher process (watcher.py), started from the main thread: its death signal follows the
    thread that starts it. Its stdin is the rank's goodbye (stop()); its stdout and stderr are the rank's."""
    if threading.current_thread() is not threading.main_thread():
        return None
    install_lost_exit()
    spec = {
        "rank": rank,
        "world": world,
        "pid": os.getpid(),
        "addr": os.environ["MASTER_ADDR"],
        "port": int(os.environ["MASTER_PORT"]),
        "timeout_s": timeout_s,
        "interval_s": HEARTBEAT_S,
        "store_host": "torchrun's agent" if os.environ.get("TORCHELASTIC_RUN_ID") else "rank 0",
        "follow": launchers_to_follow(),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "dsgrpo.watcher", json.dumps(spec)], stdin=subprocess.PIPE, text=True, close_fds=True
    )  # (no gloo socket held open past the rank's death)


@contextmanager
def _launcher_signals_held():
    """A launcher that saw a rank die sends the others SIGTERM (torchrun at once, deepspeed's within a second) and
    SIGKILL 30 s later: the diagnosis, a few seconds, must finish first, or nobody learns which rank was lost."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    previous = {sig: signal.signal(sig, lambda *a: None) for sig in held}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_heartbeat: List[Heartbeat] = []


def start(rank: int, world: int, step: Callable[[], int], lost_after_s: Optional[float] = None) -> Optional[Heartbeat]:
    """Start this process's heartbeat and watcher (idempotent; none in a world of one). The watcher ends the rank
    once a peer's beats stop for `lost_after_s` (ddp_timeout; default: the collectives' timeout), also where
    DEEPSPEED_TIMEOUT gives collectives longer."""
    if world < 2:
        return None
    if not _heartbeat:
        _heartbeat.append(Heartbeat(rank, world, step, lost_after_s=lost_after_s))
    _heartbeat[0].step = step
    return _heartbeat[0]


def explain(error: BaseException) -> Optional[RankLostError]:
    """For an error raised by a collective: a RankLostError naming the lost ranks, or None (nobody is lost)."""
    if not _heartbeat or type(error).__module__.startswith("dsgrpo"):  # our own errors say what they are
        return None
    from .timing import current_phase

    text = str(error).strip()
    timed_out = "timed out" in text.lower() or "timeout" in text.lower()
    with _launcher_signals_held():
        found = _heartbeat[0].diagnose(stuck_after=_timeout_s() / 2 if timed_out else None)
    if found is None:
        return None
    first_line = text.splitlines()[0] if text else type(error).__name__
    where = getattr(error, "dsgrpo_phase", None) or current_phase()
    return RankLostError(
        f"{found}. This rank ({_heartbeat[0].rank}) was in phase '{where}' when its collective "
        f"failed: {first_line[:300]}"
    )


def _timeout_s() -> float:
    return dist.collective_timeout_s()
