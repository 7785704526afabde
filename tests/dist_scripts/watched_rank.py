"""One pretend rank for tests/test_watchdog.py: a heartbeat and its watcher against the test's own TCPStore, no
process group. `watched_rank.py RANK SCENARIO TIMEOUT_S`; every rank enters phase 'reward' at step 7, then:

    stop      rank 1 SIGSTOPs itself; rank 0 waits in a C call that holds the GIL (ctypes.PyDLL's sleep)
    gil       rank 1 holds the GIL in a C call for TIMEOUT_S + 2 s (alive: must not be taken for lost); rank 0 waits
    pipe      rank 1 writes to a pipe nobody reads (its stdout, replaced); rank 0 waits in a GIL-holding C call
    finish    both finish; rank 1 at once, rank 0 after TIMEOUT_S + 3 s (a finished peer is never lost)

A rank that is not ended prints `SURVIVED` and exits 0."""

import ctypes
import os
import signal
import sys
import time

from dsgrpo import dist, watchdog
from dsgrpo.process_exit import leave
from dsgrpo.timing import phase

rank, scenario, timeout_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
dist._timeout["s"] = timeout_s  # what dist.init sets from ddp_timeout
store = dist.rendezvous_store_client(timeout_s=60)  # both start together, as dist.init's rendezvous makes ranks do
store.set(f"ready/{rank}", b"1")
store.wait([f"ready/{1 - rank}"])
beat = watchdog.start(rank, 2, step=lambda: 7)
print(f"READY {rank}", flush=True)
hold_gil = ctypes.PyDLL(None).sleep  # PyDLL: the GIL stays held for the whole call
hold_gil.argtypes = [ctypes.c_uint]
with phase("reward"):
    time.sleep(2 * watchdog.HEARTBEAT_S)  # both ranks' beats say where they are
    if scenario == "stop" and rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    elif scenario == "gil" and rank == 1:
        hold_gil(int(timeout_s) + 2)
    elif scenario == "pipe" and rank == 1:
        read_end, write_end = os.pipe()
        os.dup2(write_end, 1)
        sys.stdout.write("x" * (1 << 20))
        sys.stdout.flush()
    elif scenario == "finish" and rank == 1:
        pass
    else:
        # a survivor of stop / pipe is ended by its watcher within this (pipe: its grace, then TIMEOUT_S)
        hold_gil(int(timeout_s) + 3 if scenario in ("gil", "finish") else int(3 * timeout_s) + 3)
print(f"SURVIVED {rank}", flush=True)
leave(0)
