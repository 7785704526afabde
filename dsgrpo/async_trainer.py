"""`AsyncGRPOTrainer`: GRPOTrainer's signature and step, fed by rollouts generated in the background on every rank
(rollout/async_source.py says how). Tools and rollout_func work as in GRPOTrainer: the rollout workers sample
through the same samplers.

`async_placement`, `max_staleness`, `async_load_balancing`, `async_chunk_groups`, `async_generator_ranks` and
`drop_zero_std_groups` in GRPOConfig steer it."""

from __future__ import annotations

from .rollout.async_source import AsyncRolloutSource
from .trainer import GRPOTrainer


class AsyncGRPOTrainer(GRPOTrainer):
    rollout_source = AsyncRolloutSource
