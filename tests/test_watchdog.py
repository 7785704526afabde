"""The heartbeat (dsgrpo/watchdog.py) on its own, against a real in-process TCPStore: no launch."""

import time

import torch.distributed as tdist

from dsgrpo import watchdog
from dsgrpo.testing import _free_port


def test_the_heartbeat_beats_and_stops_before_the_interpreter_finalizes(monkeypatch):
    port = _free_port()
    server = tdist.TCPStore("127.0.0.1", port, world_size=1, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    beat = watchdog.Heartbeat(0, 1, step=lambda: 7)
    try:
        time.sleep(watchdog.HEARTBEAT_S * 2.5)
        first = beat.read()[0]
        assert first.step == 7 and first.pid > 0 and first.count >= 2  # the thread beats on its own
        beat.stop()  # what atexit runs: a daemon thread inside the store's C++ call at finalization aborts
        assert not beat._thread.is_alive()
        count = beat.read()[0].count
        time.sleep(watchdog.HEARTBEAT_S * 1.5)
        assert beat.read()[0].count == count
    finally:
        beat.stop()
        del server
