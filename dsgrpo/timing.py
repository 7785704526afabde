"""Wall-clock timers around each phase of a step, reported as `time/<phase>`."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Dict


class PhaseTimer:
    def __init__(self):
        self.seconds: Dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def pop(self) -> Dict[str, float]:
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        self.seconds = {}
        return out
