"""The reward stack: K reward functions → an [N, K] matrix (NaN where a function returned None), kept before
weighting so each function is logged on its own.

Contract of a reward function (TRL's): `f(prompts, completions, completion_ids=..., **columns)` returns one
float or None per completion; every dataset column other than `prompt` arrives as a keyword argument, one
value per completion."""

from __future__ import annotations

import asyncio
import inspect
import math
from typing import Any, Callable, Dict, List, Sequence

import torch


def reward_name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


class RewardStack:
    def __init__(self, reward_funcs: Any, reward_weights=None):
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs:
            raise ValueError("reward_funcs is empty: give at least one reward function.")
        self.funcs: List[Callable] = [self._resolve(f, i) for i, f in enumerate(funcs)]
        self.names = [reward_name(f) for f in self.funcs]
        if reward_weights is not None and len(reward_weights) != len(self.funcs):
            raise ValueError(f"reward_weights has {len(reward_weights)} entries but there are {len(self.funcs)} "
                             "reward functions; give one weight per function.")

    @staticmethod
    def _resolve(f: Any, index: int) -> Callable:
        if callable(f) and not hasattr(f, "config"):
            return f
        raise TypeError(f"reward_funcs[{index}] = {f!r}: only Python callables "
                        "f(prompts, completions, **columns) -> list[float | None] are supported yet; reward "
                        "models, built-in names and remote scorers come with the reward-stack issue.")

    def __call__(self, prompts: Sequence, completions: Sequence, completion_ids: Sequence,
                 columns: Dict[str, Sequence]) -> torch.Tensor:
        """[N, K] float32, NaN for None."""
        results = [None] * len(self.funcs)
        pending = {}
        for k, f in enumerate(self.funcs):
            out = f(prompts=list(prompts), completions=list(completions), completion_ids=list(completion_ids), **columns)
            if inspect.isawaitable(out):
                pending[k] = out
            else:
                results[k] = out
        if pending:  # async reward functions run concurrently
            async def gather():
                return await asyncio.gather(*pending.values())
            for k, out in zip(pending, asyncio.run(gather())):
                results[k] = out
        matrix = torch.full((len(completions), len(self.funcs)), math.nan)
        for k, values in enumerate(results):
            values = list(values)
            if len(values) != len(completions):
                raise ValueError(f"Reward function {self.names[k]!r} returned {len(values)} values for "
                                 f"{len(completions)} completions; return one float (or None) per completion.")
            for i, v in enumerate(values):
                if v is None:
                    continue  # no opinion: NaN, excluded from this function's statistics
                v = float(v)
                if math.isinf(v):
                    raise ValueError(f"Reward function {self.names[k]!r} returned {v} for completion {i}; return a "
                                     "finite float, or None to abstain.")
                matrix[i, k] = v
        return matrix
