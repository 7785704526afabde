"""Colocated vLLM with tensor parallelism (`vllm_tensor_parallel_size=N`): N consecutive ranks run one engine whose
weights are sharded over them, for a model whose vLLM copy does not fit beside its ZeRO-3 shard on one device.

Under vLLM's external_launcher every rank of an engine must make the same generate call. So each rank still asks
for its own slots of the round (the rollout source and the seeds do not change: a seed is a function of (seed,
round, slot), so resume stays exact), the requests of the engine's ranks are gathered over dist.TP, every rank runs
the group's call, and each keeps its own rows. Tool turns continue in lock-step: a round of continuations runs
while any rank of the engine has one, a rank with none joining the call with no rows (`lockstep`). Weight sync is
unchanged: each rank streams the full tensors of a bucket (a ZeRO-3 gather gives them to every rank) and its engine
rank's loader keeps its shard, so no rank holds more than one bucket of the full model at once.

AsyncGRPOTrainer: the engine generates in a background thread while the main thread trains, and the ranks of an
engine must still make the same calls in the same order. So only the engine's first rank (the leader) runs a
rollout worker that claims groups; each call it makes is first broadcast over dist.TP_WORKER (a group only these
threads use) to a `MirrorWorker` thread on every other rank of the engine, which makes the same call and keeps
nothing (the leader holds the engine's groups; the batch cut spreads them over the training ranks). Pauses (weight
loads, checkpoints, evaluation: collective points of every rank) are announced too: the leader, holding its
worker's lock, sends PAUSE; a follower's pause waits until its mirror has taken that PAUSE, so every call sent
before it has run on both sides, and the mirror takes nothing more until the follower's pause ends. An idle leader
sends a no-op now and then, so a follower never sits in one receive past the process group's timeout."""

from __future__ import annotations

import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import replace
from typing import Iterable, List, Optional, Tuple

import torch

from .. import dist
from .base import Generator, Rollout, SamplingConfig
from .worker import BackgroundThread


class TensorParallelGenerator(Generator):
    loads_weight_groups = True

    def __init__(self, engine):
        self.engine = engine
        self.llm = engine.llm  # rollout_func users reach the engine here (the same call on every TP rank)

    @property
    def max_model_len(self) -> Optional[int]:
        return self.engine.max_model_len

    def weights_not_held(self) -> set:
        return self.engine.weights_not_held()

    def load_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        self.engine.load_weights(named_tensors)

    def load_weight_groups(self, groups, stats):
        return self.engine.load_weight_groups(groups, stats)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.engine.weight_version = version

    def end_generation(self) -> None:
        self.engine.end_generation()

    def needs_weights(self) -> bool:
        return self.engine.needs_weights()

    @staticmethod
    def lockstep(continuing: bool) -> bool:
        """Whether any rank of the engine has tool turns to continue (every rank then joins the call)."""
        return dist.all_gather_object(continuing, group=dist.TP).count(True) > 0

    def generate(
        self,
        prompt_ids: List[List[int]],
        counts: List[int],
        sampling: SamplingConfig,
        seeds: Optional[List[int]] = None,
    ) -> Rollout:
        requests = dist.all_gather_object((prompt_ids, counts, seeds, sampling.max_tokens), group=dist.TP)
        me = dist.rank(dist.TP)
        ids = [p for r in requests for p in r[0]]
        all_counts = [n for r in requests for n in r[1]]
        all_seeds = None if any(r[2] is None for r in requests) else [s for r in requests for s in r[2]]
        # one call with one budget: tool turns ask each rank's largest room left, and a rank cuts its rows to its own
        rollout = self.engine.generate(
            ids, all_counts, replace(sampling, max_tokens=max(r[3] for r in requests)), seeds=all_seeds
        )
        start = sum(sum(r[1]) for r in requests[:me])
        return rollout.rows(slice(start, start + sum(counts)))


# ------------------------------------------------------------------------------- AsyncGRPOTrainer: leader and mirrors
PAUSE, STOP, NOOP = "pause", "stop", "noop"
HEARTBEAT_S = 10.0


class MirrorLink:
    """The leader's end: what its rollout worker tells the engine's other ranks (always under the worker's lock)."""

    def __init__(self):
        self.leader = dist.tensor_parallel_leader()
        self.stopped = False
        self.last_sent = time.monotonic()

    def send(self, message) -> None:
        if not self.stopped:
            dist.broadcast_object(message, src=self.leader, group=dist.TP_WORKER)
            self.last_sent = time.monotonic()
            self.stopped = message == STOP

    def pause(self) -> None:
        self.send(PAUSE)

    def stop(self) -> None:
        self.send(STOP)

    def idle(self) -> None:
        if time.monotonic() - self.last_sent > HEARTBEAT_S:
            self.send(NOOP)


class LeadingGenerator(Generator):
    """The leader's rollout worker generates through this: the call goes to the mirrors, then to the engine."""

    def __init__(self, engine, link: MirrorLink):
        self.engine, self.link = engine, link

    @property
    def weight_version(self) -> int:  # the worker labels its tokens itself; an agent's endpoint reads this
        return self.engine.weight_version

    @property
    def max_model_len(self) -> Optional[int]:
        return self.engine.max_model_len

    def generate(
        self,
        prompt_ids: List[List[int]],
        counts: List[int],
        sampling: SamplingConfig,
        seeds: Optional[List[int]] = None,
    ) -> Rollout:
        self.link.send((prompt_ids, counts, sampling, seeds))
        return self.engine.generate(prompt_ids, counts, sampling, seeds=seeds)


class MirrorWorker(BackgroundThread):
    """A follower's rollout thread: makes the leader's calls on this rank's engine shard; claims and holds nothing.
    Has what GroupExchange reads of a RolloutWorker."""

    thread_name = "dsgrpo-tp-mirror"

    def __init__(self, engine, rank: int):
        self.engine, self.rank = engine, rank
        self.version = 0
        self.completions_generated = 0
        self.zero_std_dropped = 0
        self.error: Optional[str] = None
        self._leader = dist.tensor_parallel_leader()
        self._state = threading.Condition()
        self._pauses_taken = 0  # PAUSE messages the mirror has taken
        self._pauses_done = 0  # pauses of this rank's main thread that have ended
        self._pauses_entered = 0
        self._stopped = False

    @contextmanager
    def paused(self):
        """The follower's side of a pause: wait for the leader's PAUSE (or its end), then hold the mirror still."""
        start = time.perf_counter()
        if self._thread is None:  # the leader's worker has not started either: it sends no PAUSE
            yield 0.0
            return
        with self._state:
            self._pauses_entered += 1
            k = self._pauses_entered
            self._state.wait_for(lambda: self._pauses_taken >= k or self._stopped)
        try:
            yield time.perf_counter() - start
        finally:
            with self._state:
                self._pauses_done = k
                self._state.notify_all()

    def stop_claiming(self) -> None:
        """Nothing to do: the leader stops, and tells the mirror."""

    def shutdown(self, timeout: float = 120.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while True:
                message = dist.broadcast_object(None, src=self._leader, group=dist.TP_WORKER)
                if message == STOP:
                    break
                if message == PAUSE:
                    with self._state:
                        self._pauses_taken += 1
                        k = self._pauses_taken
                        self._state.notify_all()
                        self._state.wait_for(lambda: self._pauses_done >= k)
                    continue
                if message == NOOP:
                    continue
                prompt_ids, counts, sampling, seeds = message
                self.engine.generate(prompt_ids, counts, sampling, seeds=seeds)
        except BaseException:  # noqa: BLE001 - reported through the batch cut's status, as a worker's error
            self.error = traceback.format_exc()
        finally:
            with self._state:
                self._stopped = True
                self._state.notify_all()
