"""The rank watcher: a small process beside every rank that ends the job when a peer is lost, whatever the rank
waits in.

A rank whose peer is stopped (SIGSTOP, a debugger) or whose host is gone waits in a collective until it times
out, and only the collectives dsgrpo creates were seen to be bounded: in DeepSpeed's own (ZeRO-2's gradient
reduction, allreduce_bucket) the CPU demo waited over 180 s with ddp_timeout 60, DeepSpeed's CPU shared-memory
allreduce spins in C with no timeout, and a C call that holds the GIL keeps every Python thread of the rank from
running. So the watcher is a process of its own, the standard library alone (0.15 s to start, 18 MiB; no torch),
started by the rank's heartbeat (watchdog.Heartbeat). Every HEARTBEAT_S it

  1. beats on behalf of its rank, `dsgrpo/alive/<rank>` in the rendezvous store, from what /proc says of the
     rank's process: the count moves while the process lives and runs, and stops while it is stopped ('T') or
     blocked writing to a full pipe. A live rank in a long compute, a GIL-holding C call or a slow reward is not
     lost: its Python heartbeat thread may not run then, the watcher does;
  2. reads every peer's count: one that has not moved for `timeout_s` (ddp_timeout) is lost. The watcher then
     writes the RankLostError message (which rank, its phase and step from its Python heartbeat, what /proc or its
     own watcher says of its process, this rank's phase) to the rank's stderr and ends its rank with
     RANK_LOST_EXIT_CODE (watchdog.install_lost_exit: the rank's SIGQUIT handler is libc's _exit);
  3. ends its rank when the rank is stopped and its launcher asked it to end (SIGTERM pending: a stopped process
     cannot act on it), and when a launcher the rank must end with is gone (process_exit.end_with_launcher).

It dies with its rank (PR_SET_PDEATHSIG), and says goodbye when the rank ends on purpose: `done` in its record,
"finished" (a peer that finished is never lost: rank 0 may upload for an hour after rank 1 left) or "failed" (an
exception ended it: a peer waiting for it in a collective that never times out is ended)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Dict, List, Optional

ALIVE_KEY = "dsgrpo/alive/{rank}"
HEARTBEAT_KEY = "dsgrpo/heartbeat/{rank}"  # the rank's own heartbeat thread (watchdog.py): phase and step
RANK_LOST_EXIT_CODE = 3
BLOCKED_NOTE = "blocked writing to its {stream} (a full pipe: is the launcher's output read?)"


def proc_stat(pid: int) -> Optional[List[str]]:
    """/proc/<pid>/stat's fields after the command name (state first), or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields


def start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks (field 22 of stat): a pid reused by another process differs."""
    fields = proc_stat(pid)
    return fields[19] if fields else None


def blocked_writing(pid: int) -> Optional[str]:
    """'stdout' / 'stderr' / 'a pipe' when the process's main thread sleeps in a pipe write, else None."""
    try:
        with open(f"/proc/{pid}/wchan") as fh:
            if "pipe_write" not in fh.read():  # pipe_write, anon_pipe_write (6.x)
                return None
    except OSError:
        return None
    try:  # write(fd, ...): syscall 1 on x86_64, 64 on arm64
        with open(f"/proc/{pid}/syscall") as fh:
            parts = fh.read().split()
        if parts and parts[0] in ("1", "64") and len(parts) > 1:
            return {1: "stdout", 2: "stderr"}.get(int(parts[1], 16), "a pipe")
    except (OSError, ValueError):
        pass
    return "a pipe"


def signals_pending(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            status = dict(line.split(":", 1) for line in fh if ":" in line)
        return int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)
    except (OSError, KeyError, ValueError):
        return 0


def describe_process(pid: int, host: str, note: Optional[str]) -> str:
    """What is known of a lost rank's process: /proc on this host, else what its own watcher last said."""
    if host == socket.gethostname():
        fields = proc_stat(pid)
        if fields is None:
            return "the process is gone (killed or crashed)"
        if fields[0] in ("T", "t"):
            return "the process is stopped (SIGSTOP, or a debugger)"
        if note:
            return f"the process is {note}"
        return f"the process is alive but not answering (state {fields[0]}: hung in a device, reward or I/O call?)"
    if note:
        return f"the process is {note} (said its watcher)"
    return "it stopped sending heartbeats (another host: killed, stopped or hung; its watcher is gone too)"


class Watcher:
    def __init__(
        self,
        rank: int,
        world: int,
        pid: int,
        addr: str,
        port: int,
        timeout_s: float,
        interval_s: float,
        store_host: str,
        follow: Dict[int, str],
    ):
        self.rank, self.world, self.pid = rank, world, pid
        self.addr, self.port = addr, port
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.store_host = store_host  # who hosts the rendezvous store: "rank 0" or "torchrun's agent"
        self.follow = follow  # pid -> start time: launchers the rank ends with
        self.host = socket.gethostname()
        self.count = 0
        self.store = None
        self.store_lost_since: Optional[float] = None
        self.seen: Dict[int, dict] = {}  # peer -> its last alive record
        self.moved: Dict[int, float] = {}  # peer -> when its count last moved (this clock)
        self.blocked_since: Optional[float] = None

    # ------------------------------------------------------------------------------------------ the store
    def _store(self):
        if self.store is None:
            from .compat import StoreWire

            self.store = StoreWire(self.addr, self.port, timeout_s=max(1.0, min(5.0, self.timeout_s / 3)))
        return self.store

    def _io(self, fn):
        """fn(store), or None when the store cannot be reached (the connection is made again next time)."""
        try:
            out = fn(self._store())
            self.store_lost_since = None
            return out
        except (OSError, ConnectionError, ValueError):
            if self.store is not None:
                self.store.close()
            self.store = None
            if self.store_lost_since is None:
                self.store_lost_since = time.monotonic()
            return None

    def _record(self, rank: int, key: str) -> Optional[dict]:
        raw = self._io(lambda s: s.get(key.format(rank=rank)))
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return None

    # ------------------------------------------------------------------------------------------ one tick
    def beat(self, done: Optional[str] = None) -> bool:
        """Beat for the rank; False when the rank is gone."""
        fields = proc_stat(self.pid)
        if fields is None:
            return False
        note = None
        if fields[0] in ("T", "t"):
            note = "stopped (SIGSTOP, or a debugger)"
        else:
            stream = blocked_writing(self.pid)
            now = time.monotonic()
            if stream is None:
                self.blocked_since = None
            elif self.blocked_since is None:
                self.blocked_since = now
            # a blocked write of a few seconds is a slow reader; one that lasts is a reader that is not there
            if stream is not None and now - self.blocked_since >= min(10.0, self.timeout_s / 2):
                note = BLOCKED_NOTE.format(stream=stream)
        if note is None:
            self.count += 1
        record = {
            "count": self.count,
            "time": time.time(),
            "pid": self.pid,
            "host": self.host,
            "note": note,
            "done": done,
        }
        self._io(lambda s: s.set(ALIVE_KEY.format(rank=self.rank), json.dumps(record).encode()))
        return True

    def lost_peers(self) -> List[int]:
        now = time.monotonic()
        lost = []
        for peer in range(self.world):
            if peer == self.rank:
                continue
            record = self._record(peer, ALIVE_KEY)
            if record is None and self.store is None:  # the store itself is out of reach: judged below
                continue
            last = self.seen.get(peer)
            if record is not None and (last is None or record["count"] != last["count"]):
                self.moved[peer] = now
            if record is not None:
                self.seen[peer] = record
            self.moved.setdefault(peer, now)
            if (record or {}).get("done") == "finished":
                continue
            if now - self.moved[peer] >= self.timeout_s:
                lost.append(peer)
        return lost

    def store_lost(self) -> bool:
        if self.store_lost_since is None:
            return False
        host_rank = 0 if self.store_host == "rank 0" else None
        if host_rank is not None and (self.seen.get(host_rank) or {}).get("done") == "finished":
            return False  # the store left with its finished host: nothing more to watch
        return time.monotonic() - self.store_lost_since >= self.timeout_s

    # ------------------------------------------------------------------------------------------ ending the rank
    def message(self, lost: List[int]) -> str:
        parts = []
        for peer in lost:
            alive = self.seen.get(peer) or {}
            beat = self._record(peer, HEARTBEAT_KEY) or {}
            pid, host = beat.get("pid", alive.get("pid")), beat.get("host", alive.get("host"))
            if alive.get("done") == "failed":
                state = "the process ended with an error (see its traceback)"
            elif pid is None:
                state = "it never sent a heartbeat"
            else:
                state = describe_process(pid, host, alive.get("note"))
            where = f" in phase '{beat.get('phase', '?')}' at step {beat.get('step', '?')}" if beat else ""
            silent = time.monotonic() - self.moved.get(peer, time.monotonic())
            parts.append(
                f"lost rank {peer}"
                + (f" (pid {pid} on {host})" if pid else "")
                + f"{where}: {state}, no heartbeat for {silent:.0f} s"
            )
        return "; ".join(parts)

    def end_rank(self, why: str) -> None:
        """Say why on the rank's stderr, then end the rank with RANK_LOST_EXIT_CODE."""
        own = self._record(self.rank, HEARTBEAT_KEY) or {}
        text = (
            f"dsgrpo: error: {why}. This rank ({self.rank}) was in phase '{own.get('phase', '?')}' at step "
            f"{own.get('step', '?')}; its watcher ends it (exit code {RANK_LOST_EXIT_CODE}) after "
            f"{self.timeout_s:g} s without the peer's heartbeat (ddp_timeout)\n"
        )
        write_with_deadline(2, text.encode(), seconds=2.0)
        try:
            os.kill(self.pid, signal.SIGQUIT)  # the rank's handler: _exit(3) (watchdog.install_lost_exit)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and proc_stat(self.pid) is not None:
            time.sleep(0.05)
        if proc_stat(self.pid) is not None:  # no handler (a rank that replaced it): end it anyway
            kill(self.pid)

    def tick(self) -> bool:
        """One round; False once the watcher's work is over."""
        if not self.beat():
            return False
        fields = proc_stat(self.pid)
        if fields is not None and fields[0] in ("T", "t"):
            if signals_pending(self.pid) & (1 << (signal.SIGTERM - 1)):
                kill(self.pid)  # stopped, its launcher asked it to end: it cannot act on that itself
                return False
            return True  # a stopped rank waits for nothing: it ends nobody
        for pid, started in self.follow.items():
            if start_time(pid) != started:
                write_with_deadline(
                    2,
                    f"dsgrpo: rank {self.rank} ends with its launcher (pid {pid}), which is gone\n".encode(),
                    seconds=2.0,
                )
                kill(self.pid)
                return False
        lost = self.lost_peers()
        if lost:
            self.end_rank(self.message(lost))
            return False
        if self.store_lost():
            host = self.seen.get(0) if self.store_host == "rank 0" else None
            state = f" ({describe_process(host['pid'], host['host'], host.get('note'))})" if host else ""
            self.end_rank(
                f"lost {self.store_host}{state}: the job's rendezvous store, which it hosts, cannot be "
                f"reached for {self.timeout_s:g} s"
            )
            return False
        return True

    def run(self, control) -> None:
        while True:
            ready, _, _ = select.select([control], [], [], self.interval_s)
            if ready:
                line = control.readline()
                if line.strip() in ("finished", "failed"):
                    self.beat(done=line.strip())
                if not line or line.strip() in ("finished", "failed"):
                    return  # the rank said goodbye, or is gone (its end of the pipe closed)
            if not self.tick():
                return


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def write_with_deadline(fd: int, data: bytes, seconds: float) -> None:
    """Write to a stream that may be a full pipe nobody reads (the rank's own reason to be lost, say)."""

    def write():
        try:
            os.write(fd, data)
        except OSError:
            pass

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    writer.join(seconds)


def main(argv: List[str]) -> None:
    spec = json.loads(argv[0])
    from .process_exit import set_parent_death_signal

    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != spec["pid"]:  # the rank ended before the line above: nothing to watch
        os._exit(0)
    # A terminal's Ctrl-C, and a launcher's SIGTERM to the rank's process group (torchrun's killpg), are for the
    # rank: the watcher ends with it (PDEATHSIG), and must outlive a stopped rank's SIGTERM to SIGKILL it.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    Watcher(
        spec["rank"],
        spec["world"],
        spec["pid"],
        spec["addr"],
        spec["port"],
        spec["timeout_s"],
        spec["interval_s"],
        spec["store_host"],
        {int(k): v for k, v in spec["follow"].items()},
    ).run(sys.stdin)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
