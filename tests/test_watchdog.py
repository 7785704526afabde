"""The heartbeat (dsgrpo/watchdog.py) and the rank watcher (dsgrpo/watcher.py), against a real in-process TCPStore:
no launch (the watcher's test runs pretend ranks, tests/dist_scripts/watched_rank.py)."""

import json
import os
import subprocess
import sys
import time

import pytest
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


# ---------------------------------------------------------------------------------------------- the rank watcher
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_scripts", "watched_rank.py")
TIMEOUT_S = 4.0


def _pretend_job(scenario):
    """Two pretend ranks (dist_scripts/watched_rank.py) with their watchers, over a store of their own."""
    server = tdist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(server.port),
        "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    }
    env.pop("TORCHELASTIC_RUN_ID", None)
    ranks = [
        subprocess.Popen(
            [sys.executable, SCRIPT, str(r), scenario, str(TIMEOUT_S)],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for r in range(2)
    ]
    return server, ranks


def _end(proc, within):
    try:
        out, err = proc.communicate(timeout=within)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return None, out, err


@pytest.mark.slow  # 8 processes, ~20 s: mostly the ddp_timeout each case must wait out
def test_the_watcher_ends_a_rank_whose_peer_is_stopped_or_blocked_and_spares_live_and_finished_peers():
    """A stopped peer and a peer blocked writing to a full stdout pipe are lost after TIMEOUT_S without a beat; the
    survivor is ended by its watcher with RANK_LOST_EXIT_CODE while its main thread holds the GIL in a C call (so
    no Python thread of it could have done this). A peer that holds the GIL itself is alive (its Python heartbeat
    stalls, its watcher beats for it), and a peer that finished is not lost either. Four jobs side by side."""
    jobs = {name: _pretend_job(name) for name in ("stop", "pipe", "gil", "finish")}
    try:
        # during the GIL-holding call: rank 1's Python heartbeat stands still, its watcher's count moves
        server = jobs["gil"][0]
        deadline = time.time() + 60
        while not server.check(["dsgrpo/heartbeat/1"]) and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(2 * watchdog.HEARTBEAT_S + 2)  # (its phase beats, then the hold starts)
        beats = [json.loads(server.get(k)) for k in ("dsgrpo/heartbeat/1", "dsgrpo/alive/1")]
        time.sleep(2.5)
        again = [json.loads(server.get(k)) for k in ("dsgrpo/heartbeat/1", "dsgrpo/alive/1")]
        assert again[0]["count"] == beats[0]["count"], "the GIL-holding rank's Python thread still beat?"
        assert again[1]["count"] >= beats[1]["count"] + 2, "its watcher did not beat for it"

        started = time.time()
        code, _, err = _end(jobs["stop"][1][1 - 1], within=60)
        assert code == watchdog.RANK_LOST_EXIT_CODE, (code, err)
        assert "lost rank 1 (pid " in err and "in phase 'reward' at step 7" in err, err
        assert "the process is stopped (SIGSTOP" in err and "This rank (0) was in phase 'reward'" in err, err

        code, _, err = _end(jobs["pipe"][1][0], within=60)
        assert code == watchdog.RANK_LOST_EXIT_CODE, (code, err)
        assert (
            "lost rank 1 (pid " in err
            and "blocked writing to its stdout (a full pipe: is the launcher's output read?)" in err
        ), err

        for name in ("gil", "finish"):
            for rank, proc in enumerate(jobs[name][1]):
                code, out, err = _end(proc, within=60)
                assert code == 0 and f"SURVIVED {rank}" in out, (name, rank, code, err)
        assert time.time() - started < 45
    finally:
        for server, ranks in jobs.values():
            for proc in ranks:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
