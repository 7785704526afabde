"""Accumulate per-micro-batch metrics into one value per name, then reduce over ranks in one collective.
Names ending in /min or /max keep the extreme; others are weighted means (weight = tokens, by default 1)."""

from __future__ import annotations

import math
from typing import Dict, List

import torch

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
        return {
            k: v if k.endswith(("/min", "/max")) else v / max(self.weights[k], 1e-12) for k, v in self.values.items()
        }

    def reduce(self) -> Dict[str, float]:
        """Collective: every rank must call it with the same names."""
        return dist.reduce_metrics(self.local(), self.weights)


def round_metrics(
    stats: dict,
    rewards: torch.Tensor,
    names: List[str],
    lengths: torch.Tensor,
    truncated: torch.Tensor,
    prompt_lengths: torch.Tensor,
) -> Dict[str, float]:
    """A round's reward and length metrics over every rank's completions (TRL's names). `reward` is the mean of the
    completions' weighted totals (reward_weights applied, as advantages see them; NaN: every function declined),
    `rewards/<name>/mean|std` each function's own values, unweighted. `_completion_tokens` and `_tokens` are the
    round's token counts (throughput), not logged as such."""
    from .algorithms import nan_std

    metrics = {
        "reward": torch.nanmean(stats["rewards"]).item(),
        "reward_std": stats["std_per_group"].mean().item(),
        "frac_reward_zero_std": stats["frac_reward_zero_std"].item(),
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.mean().item(),
        "_completion_tokens": lengths.sum().item(),
        "_tokens": (lengths.sum() + prompt_lengths.sum()).item(),
    }
    for k, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(rewards[:, k]).item()
        metrics[f"rewards/{name}/std"] = nan_std(rewards[:, k], dim=0).item()
    return metrics


def completion_rows(batch, advantages, totals, per_function, names, group: int, rank: int) -> List[dict]:
    """This rank's rows of TRL's completions table: prompt, completion, reward (weighted total) and advantage; and,
    for `dsgrpo report`'s episodes, each function's reward, the group (rank, prompt) and, for multi-turn episodes,
    the turns as messages (assistant turns with their tool calls, the tools' or environment's answers)."""
    messages = batch.rollout.messages
    rows, label, size, previous = [], -1, 0, None
    for i, (p, c) in enumerate(zip(batch.prompts, batch.completions)):
        if str(p) != previous or size == group:  # a group: consecutive rows of one prompt, at most G of them
            label, size, previous = label + 1, 0, str(p)
        size += 1
        row = {
            "prompt": str(p),
            "completion": str(c),
            "advantage": float(advantages[i]),
            "reward": float(totals[i]),
            "rank": rank,
            "group": f"{rank}/{label}",
            "rewards": {n: (None if math.isnan(v) else v) for n, v in zip(names, per_function[i].tolist())},
        }
        if messages is not None:
            row["messages"] = messages[i]
        rows.append(row)
    return rows
