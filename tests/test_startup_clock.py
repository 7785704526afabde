"""The start-up breakdown (dsgrpo/timing.py: StartupClock, issue 69): the parts add up to the total, the first
trainer of a process counts from the process's start, a later one from its construction, and modules below the
trainer mark the clock of the trainer being built. The line each trainer prints is checked in a 2-rank launch
(tests/test_api_dist.py, its reasoning_gym check)."""

import time

from dsgrpo import timing


def test_parts_add_up_and_only_the_first_trainer_counts_the_process_start(monkeypatch):
    monkeypatch.setattr(timing.StartupClock, "_first", True)
    monkeypatch.setattr(timing, "process_started_at", lambda: time.time() - 5.0)
    first = timing.StartupClock()
    first.mark("python, imports and the script")
    timing.startup_mark("process group")  # a module below the trainer marks the current clock
    time.sleep(0.06)
    timing.startup_mark("generation engine")
    seconds = first.finish("the rest")
    assert timing.StartupClock.current is None
    assert 5.0 <= seconds["python, imports and the script"] < 5.5 and seconds["generation engine"] >= 0.06
    assert abs(sum(v for k, v in seconds.items() if k != "total") - seconds["total"]) < 1e-6
    line = first.line()
    assert line.startswith(f"start-up {seconds['total']:.1f} s: python, imports and the script 5.")
    assert "generation engine 0.1" in line and "process group" not in line  # parts under 0.05 s are left out

    second = timing.StartupClock()  # a second trainer in the same process: from its own construction
    second.mark("python, imports and the script")
    assert second.parts["python, imports and the script"] < 0.05
    timing.startup_mark("engine")
    assert "engine" in second.parts and "engine" not in first.parts
    second.finish("the rest")
    timing.startup_mark("after")  # no trainer being built: nothing to mark
    assert "after" not in second.parts


def test_the_process_start_is_read_from_the_system():
    assert time.time() - 3600 < timing.process_started_at() <= time.time()
