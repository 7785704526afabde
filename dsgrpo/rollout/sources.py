"""Rollout sources: the one seam through which the training loop gets each round's batch.

    batch = source.next_batch(round)            # this rank's share, scored when the source scores (Batch.rewards)
    ...update...
    source.sync_weights(policy, round, needed)  # the new weights reach whatever generates
    source.end_round(save, stop, preempted)     # what follows the round (split placement tells its generators)
    with source.paused(): evaluate / checkpoint # the engine and the source's state held still
    source.state_dict() / load_state_dict()     # what must survive a resume (rollout_state_<rank>.json)

`GenerationSource` generates the round when asked (GRPOTrainer). `AsyncRolloutSource` (rollout/async_source.py)
cuts it from groups generated in the background (AsyncGRPOTrainer). How completions are made is the sampler's
business (rollout/samplers.py: plain generation, tool turns, rollout_func), so every source takes every sampler.
A trainer chooses its source class; the step never asks which one it has."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from .. import dist
from ..evaluation import eval_sampling
from .base import Generator, Rollout, round_seed
from .batch import Batch, BatchBuilder
from .tools import ToolStats


@dataclass(frozen=True)
class Placement:
    """Which ranks train and which generate."""

    trains: bool  # this rank runs the policy update
    generates: bool  # this rank runs a generation engine
    trainers: int  # training ranks (the world a ZeRO-3 engine spans)
    generators: int  # generating ranks
    first_generator: int  # global rank of the first generating rank

    @classmethod
    def colocated(cls) -> "Placement":
        world = dist.world_size(dist.EVERYONE)
        return cls(trains=True, generates=True, trainers=world, generators=world, first_generator=0)


@dataclass
class RolloutSetup:
    """What a source is built from (the trainer makes it once)."""

    args: object  # GRPOConfig
    prompts: object  # the training PromptSource
    sampler: object  # rollout.samplers.Sampler; None on a split-placement training rank
    generator: Optional[Generator]  # the engine weights are synced into; None where this rank has none
    build_batch: BatchBuilder
    reward_matrix: Callable[[Batch], torch.Tensor]  # [L, K] of a batch (the reward stack)
    scores_anywhere: bool  # the rewards hold no collective (no sharded reward model)
    placement: Placement
    prompts_per_round: int
    steps_after_round: Callable[[int], int]  # optimizer steps completed once a generation round is trained
    max_steps: int
    tied: bool  # tied embeddings: lm_head.weight is sent too
    timer: object  # PhaseTimer: sources may add phases (time/wait_for_weights)
    reward_weights: Optional[list] = None  # each reward source's weight (the stack's: environments' included)
    weight_sync: Optional[Callable] = None  # the trainer's weight_sync.TrainerWeightSync


class RolloutSource:
    """The synchronous defaults of every method; `next_batch` is each source's own."""

    generates_while_training = False  # the engine's memory is never free for training (sleep mode cannot apply)
    last_sync = None  # rollout/weight_sync.py SyncStats of the last sync

    def __init__(self, setup: RolloutSetup):
        self.setup = setup
        self.args = setup.args

    # ---- before anything is built (rollout/choice.py picks the class)
    @staticmethod
    def placement(args) -> Placement:
        return Placement.colocated()

    @classmethod
    def check(
        cls,
        args,
        *,
        placement: Placement,
        prompts_per_round: int,
        reward_models: bool,
        evaluates: bool,
        streaming: bool = False,
    ) -> None:
        """Refuse settings this source cannot serve, before any model is loaded."""

    # ---- the round
    def next_batch(self, round_index: int) -> Batch:
        raise NotImplementedError

    def evaluation_batch(self, prompts, group: int) -> Batch:
        """Every prompt of `prompts` once (`group` completions each), split over the ranks; wrapped round to a
        multiple of the world size."""
        world = self.setup.placement.trainers
        rows = [i % len(prompts) for i in range(math.ceil(len(prompts) / world) * world)]
        sampler = self.setup.sampler
        training = getattr(sampler, "sampling", None)  # (a rollout_func samples as it will)
        if training is not None:  # eval_do_sample=False: greedy, for this batch only (the engine is paused)
            sampler.sampling = eval_sampling(training, self.args)
        try:
            return self._sample(prompts, rows, 0, group, chunk=self.args.per_device_eval_batch_size)
        finally:
            if training is not None:
                sampler.sampling = training

    def sync_weights(self, policy_module, round_index: int, needed: bool = True) -> None:
        """After the round's update (every training rank; the gathers are collective). `needed` is False after the
        last round (its weights are never sampled from) and after a round without an optimizer step; an engine that
        discarded its weights (sleep mode) gets them anyway, so an evaluation or the next round can generate."""
        generator = self.setup.generator
        if generator is not None and (needed or generator.needs_weights()):
            self.last_sync = self.setup.weight_sync(policy_module, generator, version=str(round_index + 1))
            if self.last_sync is not None:
                generator.weight_version = round_index + 1

    def sync_metrics(self) -> dict:
        """sync/* of the last weight sync (once: the next call returns {} until another sync ran)."""
        stats, self.last_sync = self.last_sync, None
        return stats.metrics() if stats is not None else {}

    def end_round(self, save: bool, stop: bool, preempted: bool) -> None:
        """Told after a round's logging and evaluation what follows (a checkpoint, the end of the run)."""

    @contextlib.contextmanager
    def paused(self):
        """Hold the engine and the source's state still (evaluation, checkpoints)."""
        yield

    def check_before_save(self) -> None:
        """Collective, with the source paused: raise instead of letting a checkpoint record lost work."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """`state` is what state_dict() saved, or None when the checkpoint holds none for this rank."""

    def without_samples(self, state: Optional[dict]) -> Optional[dict]:
        """A saved state with the sampled groups not yet trained left out (a resume with another train dataset: they
        hold the old set's rows), their places counted as dropped."""
        return state

    # ---- resuming on another number of ranks (checkpoint.load)
    @classmethod
    def check_world_change(cls, args, path: str, saved_world: int, world: int) -> None:
        """Refuse, before anything loads, a checkpoint of `saved_world` ranks this source cannot continue on `world`."""

    def reshard_state(self, states: List[Optional[dict]], rank: int, world: int) -> Optional[dict]:
        """This rank's state from the states the writing run's ranks saved (`states[r]` of its rank r)."""
        return states[rank] if rank < len(states) else None

    def reshard_note(self, saved_world: int, world: int) -> Optional[str]:
        """What of this source's state did not carry over exactly, for the resume's one message (None: all did)."""
        return None

    def close(self) -> None:
        pass

    # ---- shared by the sources
    def _sample(self, prompts, rows, round_index: int, group: int, chunk: Optional[int] = None) -> Batch:
        """This rank's slots of a round over dataset rows `rows`, sampled now, seeded from (seed, round, slot) so
        a resumed run samples exactly what the original would. `chunk`: at most this many completions per
        sampler call (per_device_eval_batch_size for evaluation); the seeds are the same either way."""
        world = self.setup.placement.trainers
        share = prompts.rank_slice(rows, group, dist.rank(), world)
        seeds = [
            round_seed(self.args.seed, round_index, share.first_slot + sum(share.counts[:j]))
            for j in range(len(share.counts))
        ]
        parts, start = [], 0
        while start < len(share.indices):
            end, size = start, 0
            while end < len(share.indices) and (end == start or chunk is None or size + share.counts[end] <= chunk):
                size += share.counts[end]
                end += 1
            parts.append(
                self.setup.sampler.sample(prompts, share.indices[start:end], share.counts[start:end], seeds[start:end])
            )
            start = end
        rollout = (
            parts[0]
            if len(parts) == 1
            else Rollout.concat(parts)
            if parts
            else self.setup.sampler.sample(prompts, [], [], [])
        )
        label_versions(rollout, engine_version(self.setup.generator))
        batch = self.setup.build_batch(prompts, share.indices, share.counts, rollout)
        batch.metrics.update(self._tool_metrics(batch))
        batch.metrics.update(version_metrics(rollout))
        return batch

    def _tool_metrics(self, batch: Batch) -> dict:
        """tools/* over every rank's batch, and an environment's own metrics where its rollout_func reports them
        (`round_metrics()`: the env host's env_metrics/*), as means over ranks (a collective: every rank runs
        tools, or none does)."""
        sampler = self.setup.sampler
        if sampler is None or not sampler.uses_tools:
            return {}
        stats = ToolStats.of(batch.rollout)
        metrics, weights = stats.metrics(), stats.weights()
        ecosystem = getattr(getattr(sampler, "rollout_func", None), "round_metrics", None)
        if ecosystem is not None:
            means, counts = ecosystem()
            metrics.update(means)
            weights.update(counts)
        return dist.reduce_metrics(metrics, weights)


def engine_version(generator: Optional[Generator]) -> int:
    """The weights the engine holds (0 where this rank has none: a rollout_func makes the rows)."""
    return generator.weight_version if generator is not None else 0


def label_versions(rollout: Rollout, version: int) -> None:
    """Every completion token carries the policy version it was sampled with: the engine's labels where it gave them,
    else the generator's current version."""
    if rollout.weight_versions is None:
        rollout.weight_versions = [[version] * len(c) for c in rollout.completion_ids]


def version_metrics(rollout: Rollout) -> dict:
    """rollout/weight_version_min|max: the policy versions this rank's completion tokens were sampled with."""
    versions = [v for row in rollout.weight_versions or [] for v in row]
    if not versions:
        return {}
    return {"rollout/weight_version_min": float(min(versions)), "rollout/weight_version_max": float(max(versions))}


def check_on_policy(rollout: Rollout, version: int) -> None:
    """A synchronous round samples from the weights of the last sync only: a token labelled otherwise means the engine
    served other weights than the trainer synced (a reload that did not take), and training on it would be wrong."""
    stale = sorted({v for row in rollout.weight_versions or [] for v in row if v != version})
    if stale:
        raise RuntimeError(
            f"the generation engine sampled tokens with weights of version(s) {stale[:5]}, but the "
            f"trainer synced version {version}: its weights are not the policy's. The weight sync "
            "did not take; rerun with verify_weight_sync='checksum' to find where."
        )


class GenerationSource(RolloutSource):
    """GRPOTrainer's source: each round is generated when the loop asks for it, by every rank's own engine."""

    def next_batch(self, round_index: int) -> Batch:
        args = self.args
        rows = self.setup.prompts.round_prompts(
            round_index, self.setup.prompts_per_round, args.order_seed, args.shuffle_dataset
        )
        batch = self._sample(self.setup.prompts, rows, round_index, args.num_generations)
        self.setup.generator.end_generation()  # sleep mode: the engine's memory goes to training until the sync
        check_on_policy(batch.rollout, engine_version(self.setup.generator))
        return batch
