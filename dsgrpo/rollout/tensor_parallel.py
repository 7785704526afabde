"""Colocated vLLM with tensor parallelism (`vllm_tensor_parallel_size=N`): N consecutive ranks run one engine whose
weights are sharded over them, for a model whose vLLM copy does not fit beside its ZeRO-3 shard on one device.

Under vLLM's external_launcher every rank of an engine must make the same generate call. So each rank still asks
for its own slots of the round (the rollout source and the seeds do not change: a seed is a function of (seed,
round, slot), so resume stays exact), the requests of the engine's ranks are gathered over dist.TP, every rank runs
the group's call, and each keeps its own rows. Weight sync is unchanged: each rank streams the full tensors of a
bucket (a ZeRO-3 gather gives them to every rank) and its engine rank's loader keeps its shard, so no rank holds
more than one bucket of the full model at once."""

from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

import torch

from .. import dist
from .base import Rollout, SamplingConfig


class TensorParallelGenerator:
    def __init__(self, engine):
        self.engine = engine
        self.llm = engine.llm          # rollout_func users reach the engine here (the same call on every TP rank)

    def needs_weight_sync(self) -> bool:
        return True

    def load_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        self.engine.load_weights(named_tensors)

    def end_generation(self) -> None:
        self.engine.end_generation()

    def needs_weights(self) -> bool:
        return self.engine.needs_weights()

    def generate(self, prompt_ids: List[List[int]], counts: List[int], sampling: SamplingConfig,
                 seeds: Optional[List[int]] = None) -> Rollout:
        requests = dist.all_gather_object((prompt_ids, counts, seeds), group=dist.TP)
        me = dist.rank(dist.TP)
        ids = [p for r in requests for p in r[0]]
        all_counts = [n for r in requests for n in r[1]]
        all_seeds = None if any(r[2] is None for r in requests) else [s for r in requests for s in r[2]]
        rollout = self.engine.generate(ids, all_counts, sampling, seeds=all_seeds)
        start = sum(sum(r[1]) for r in requests[:me])
        return rollout.rows(slice(start, start + sum(counts)))
