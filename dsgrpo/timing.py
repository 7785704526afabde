"""Wall-clock timers around each phase of a step, reported as `time/<phase>`, and each phase's peak memory,
reported as `memory/peak_gib/<phase>` (the CUDA allocator's peak on GPU; on CPU the resident set's high-water
mark, which Linux lets a process reset: /proc/self/clear_refs), and `memory/rise_gib/<phase>`, how far the peak
rose above what was in use when the phase began: what the phase itself costs (its activations, say), without the
process's baseline (weights, optimizer state, a colocated engine) that dominates the peak of a small model."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional

GiB = 2**30
_highest = 0  # the largest phase peak this process has seen (resetting the mark must not lose the process's peak)
_phases: Dict[int, List[str]] = {}  # thread id → the phases it is in (innermost last): what the heartbeat reports
_failed_in: List[str] = []  # the innermost phase an exception left on the main thread, until it enters another
phase_listeners: List[Callable[[], None]] = []  # called when the main thread enters a phase (the heartbeat)


@contextmanager
def phase(name: str):
    """Label what this thread is doing (the heartbeat names the main thread's phase when a rank is lost). An
    exception leaving it carries the innermost phase it left, as `exc.dsgrpo_phase`."""
    stack = _phases.setdefault(threading.get_ident(), [])
    main = threading.get_ident() == threading.main_thread().ident
    if main:
        _failed_in.clear()
    stack.append(name)
    _changed()
    try:
        yield
    except BaseException as exc:
        if getattr(exc, "dsgrpo_phase", None) is None:
            if main:  # while the error unwinds (a collective that timed out, being diagnosed) the rank is still there
                _failed_in[:] = [name]
            try:
                exc.dsgrpo_phase = name
            except AttributeError:  # an exception type without a __dict__
                pass
        raise
    finally:
        stack.pop()  # no beat on leaving: the next phase's entry (or the periodic beat) reports it


def _changed() -> None:
    if threading.get_ident() == threading.main_thread().ident:
        for listener in phase_listeners:
            listener()


def current_phase() -> str:
    """The main thread's innermost phase: 'startup' before it entered any, the phase an error is leaving while it
    unwinds, 'between phases' between two."""
    stack = _phases.get(threading.main_thread().ident)
    if stack is None:
        return "startup"
    if stack:
        return stack[-1]
    return _failed_in[0] if _failed_in else "between phases"


class PhaseTimer:
    def __init__(self):
        self.seconds: Dict[str, float] = {}
        self.peaks: Dict[str, int] = {}
        self.rises: Dict[str, int] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        _reset_peak()
        in_use = _in_use()
        try:
            with phase(name):
                yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            from . import device

            device.return_freed_memory()  # the next phase starts from this one's live memory, not its heap
            peak = _peak()
            self.peaks[name] = max(self.peaks.get(name, 0), peak)
            if peak and in_use is not None:
                self.rises[name] = max(self.rises.get(name, 0), peak - in_use)
            global _highest
            _highest = max(_highest, peak)

    def pop(self) -> Dict[str, float]:
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        out.update({f"memory/peak_gib/{k}": v / GiB for k, v in self.peaks.items() if v})
        out.update({f"memory/rise_gib/{k}": v / GiB for k, v in self.rises.items()})
        self.seconds, self.peaks, self.rises = {}, {}, {}
        return out


def highest_peak() -> int:
    """This process's peak memory so far (over the phases, and what the current high-water mark says)."""
    return max(_highest, _peak())


def _reset_peak() -> None:
    from . import device

    if device.on_gpu():
        import torch

        torch.cuda.reset_peak_memory_stats()
        return
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM, the resident set's high-water mark
    except OSError:
        pass


def _peak() -> int:
    from . import device

    if device.on_gpu():
        import torch

        return int(torch.cuda.max_memory_allocated())
    return proc_kib("/proc/self/status", "VmHWM") or 0


def _in_use() -> Optional[int]:
    from . import device

    if device.on_gpu():
        import torch

        return int(torch.cuda.memory_allocated())
    return proc_kib("/proc/self/status", "VmRSS")


def proc_kib(path: str, key: str) -> Optional[int]:
    """A `Key:   N kB` line of a /proc file (status, meminfo) in bytes; None when absent or unreadable."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def step_breakdown(times: Dict[str, float], tokens: int, devices: int, step_s: float) -> Dict[str, float]:
    """A step's time in NeMo-RL's terms: step time = generation + log-probs (the old policy's and the reference's)
    + training + refit (the weight sync), the rest being scoring and bookkeeping; and tokens/s/GPU, the step's
    tokens (prompts and completions, every rank's) over the stage's time × the devices (ranks here) that ran it."""
    stages = {
        "generation": "time/generate",
        "logprobs": "time/reference",
        "training": "time/train",
        "refit": "time/sync",
        "reward": "time/reward",
    }
    out = {"perf/step_time_s": step_s}
    for stage, key in stages.items():
        out[f"perf/{stage}_s"] = times.get(key, 0.0)
    devices = max(1, devices)
    out["perf/tokens_per_s_per_gpu"] = tokens / max(1e-9, step_s * devices)
    for stage in ("generation", "training"):
        if out[f"perf/{stage}_s"] > 0:
            out[f"perf/tokens_per_s_per_gpu/{stage}"] = tokens / (out[f"perf/{stage}_s"] * devices)
    return out


def process_started_at() -> float:
    """The unix time this process started (psutil reads /proc on Linux); now where it cannot be read."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - no psutil, or a platform without the figure: the clock starts now
        return time.time()


class StartupClock:
    """Where the time from launch to the trainer's first step goes, part by part (issue 69): `mark(part)` ends the
    part that ran since the previous mark. The first trainer of a process counts from the process's start (its
    interpreter, imports and whatever the script did first); a later one from its own construction."""

    _first = True
    current: Optional["StartupClock"] = None  # the trainer being built (startup_mark marks it)

    def __init__(self):
        started = process_started_at() if StartupClock._first else time.time()
        StartupClock._first = False
        self.started = self.last = started
        self.parts: Dict[str, float] = {}
        StartupClock.current = self

    def finish(self, part: str) -> Dict[str, float]:
        """Mark the last part; the parts and their total, in seconds."""
        self.mark(part)
        if StartupClock.current is self:
            StartupClock.current = None
        return dict(self.parts, total=self.total())

    def mark(self, part: str) -> None:
        now = time.time()
        self.parts[part] = self.parts.get(part, 0.0) + (now - self.last)
        self.last = now

    def total(self) -> float:
        return self.last - self.started

    def line(self) -> str:
        """`start-up 9.3 s: python, imports and the script 4.1, process group 0.2, ...` (parts under 0.05 s left
        out)."""
        shown = ", ".join(f"{part} {seconds:.1f}" for part, seconds in self.parts.items() if seconds >= 0.05)
        return f"start-up {self.total():.1f} s: {shown}"


def startup_mark(part: str) -> None:
    """End `part` of the start-up of the trainer being built, if one is (modules below the trainer mark theirs)."""
    if StartupClock.current is not None:
        StartupClock.current.mark(part)
