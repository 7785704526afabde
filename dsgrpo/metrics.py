"""Accumulate per-micro-batch metrics into one value per name, then reduce over ranks in one collective.
Names ending in /min or /max keep the extreme; others are weighted means (weight = tokens, by default 1)."""

from __future__ import annotations

from typing import Dict

from . import dist


class MetricAccumulator:
    def __init__(self):
        self.values: Dict[str, float] = {}
        self.weights: Dict[str, float] = {}

    def add(self, name: str, value, weight: float = 1.0) -> None:
        value = float(value)
        if name.endswith("/min") or name.endswith("/max"):
            pick = min if name.endswith("/min") else max
            self.values[name] = pick(self.values.get(name, value), value)
            self.weights[name] = 1.0
            return
        self.values[name] = self.values.get(name, 0.0) + value * weight
        self.weights[name] = self.weights.get(name, 0.0) + weight

    def local(self) -> Dict[str, float]:
        return {k: v if k.endswith(("/min", "/max")) else v / max(self.weights[k], 1e-12) for k, v in self.values.items()}

    def reduce(self) -> Dict[str, float]:
        """Collective: every rank must call it with the same names."""
        return dist.reduce_metrics(self.local(), self.weights)
