"""Preemption: SIGTERM or SIGUSR1 asks the run to stop at the end of the current generation round, write a
checkpoint and exit with `checkpoint.PREEMPTED_EXIT_CODE` (75), which batch scripts requeue on. A second
signal exits at once with 128 + the signal number."""

from __future__ import annotations

import os
import signal
import sys

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    def __init__(self):
        self.requested = False
        self._previous = {}

    def _handle(self, signum, frame):
        if self.requested:  # the second signal: no more waiting
            print(f"dsgrpo: second signal {signal.Signals(signum).name}: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.requested = True
        print(
            f"dsgrpo: {signal.Signals(signum).name} received: checkpointing at the end of this round, then "
            "exiting with code 75 (send it again to exit at once)",
            file=sys.stderr,
            flush=True,
        )

    def __enter__(self) -> "Preemption":
        import threading

        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
