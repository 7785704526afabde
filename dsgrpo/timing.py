"""Wall-clock timers around each phase of a step, reported as `time/<phase>`, and each phase's peak memory,
reported as `memory/peak_gib/<phase>` (the CUDA allocator's peak on GPU; on CPU the resident set's high-water
mark, which Linux lets a process reset: /proc/self/clear_refs)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Dict

GiB = 2 ** 30
_highest = 0  # the largest phase peak this process has seen (resetting the mark must not lose the process's peak)


class PhaseTimer:
    def __init__(self):
        self.seconds: Dict[str, float] = {}
        self.peaks: Dict[str, int] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        _reset_peak()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start
            peak = _peak()
            self.peaks[phase] = max(self.peaks.get(phase, 0), peak)
            global _highest
            _highest = max(_highest, peak)

    def pop(self) -> Dict[str, float]:
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        out.update({f"memory/peak_gib/{k}": v / GiB for k, v in self.peaks.items() if v})
        self.seconds, self.peaks = {}, {}
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
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
