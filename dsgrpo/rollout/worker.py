"""The asynchronous trainer's rollout worker: a thread per rank that keeps the colocated vLLM engine sampling.

It claims prompt groups from the stream, samples them with the engine's current weights (through the trainer's
sampler: plain generation, tool turns or a rollout_func), scores them with the reward functions (plain Python and remote ones: nothing collective runs in this thread) and puts them in
the rank's pool. It never waits for the other ranks. The training loop pauses it (`paused()`) while it
replaces the engine's weights, writes a checkpoint or evaluates; a claim, its generation and its scoring
happen under one lock, so a pause never splits a chunk and a paused pool is exactly what was claimed.

How far ahead it may run is the staleness bound: with version v loaded it claims only groups that round
v + max_staleness can still train on; dropped groups (stale, or zero-std with dynamic sampling) are replaced."""

from __future__ import annotations

import threading
import time
import traceback
from contextlib import contextmanager
from typing import Callable, List, Optional

import torch

from ..algorithms.dapo import zero_std_groups
from .base import Rollout
from .pool import ClaimCounter, Group, GroupPool, PromptStream


class BackgroundThread:
    """The thread of a rollout worker (and of a tensor-parallel mirror): started once, by the main thread."""
    thread_name = "dsgrpo-rollout"
    rank: int
    _thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"{self.thread_name}-rank{self.rank}", daemon=True)
            self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def _run(self) -> None:
        raise NotImplementedError


class RolloutWorker(BackgroundThread):
    def __init__(self, *, sampler, prompts, stream: PromptStream, counter: ClaimCounter, pool: GroupPool,
                 score: Optional[Callable], balanced: bool, chunk_groups: int, max_staleness: int, drop_zero_std: bool,
                 reward_weights, rank: int, version: int, slot: Optional[int] = None, link=None):
        self.sampler, self.prompts, self.stream, self.counter, self.pool = sampler, prompts, stream, counter, pool
        self.score = score
        self.balanced, self.chunk, self.max_staleness = balanced, chunk_groups, max_staleness
        self.drop_zero_std, self.reward_weights, self.rank = drop_zero_std, reward_weights, rank
        self.slot = rank if slot is None else slot  # this rank's index among the generating ranks
        self.version = version              # weight syncs the engine has seen
        self.link = link                    # tensor parallel: the engine's other ranks (tensor_parallel.MirrorLink)
        self.completions_generated = 0
        self.zero_std_dropped = 0
        self.error: Optional[str] = None     # the traceback, when the thread died
        self._work = threading.Lock()        # held for a whole chunk: claim, generate, score, pool
        self._pause_requests = 0
        self._pause_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------------------------ control (main thread)
    @contextmanager
    def paused(self):
        """Hold the engine and the pool still; yields the seconds spent waiting for the chunk in flight."""
        with self._pause_lock:
            self._pause_requests += 1
        start = time.perf_counter()
        try:
            with self._work:
                if self.link is not None and self.started:
                    self.link.pause()  # the mirrors take every call sent before it, then hold still
                yield time.perf_counter() - start
        finally:
            with self._pause_lock:
                self._pause_requests -= 1

    def stop_claiming(self) -> None:
        """No new chunks (the last round is cut); the chunk in flight finishes."""
        self._stop.set()

    def shutdown(self, timeout: float = 120.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():  # a generate call that does not return: the daemon thread dies with us
                print(f"[dsgrpo] rank {self.rank}: rollout worker still busy after {timeout:.0f} s; leaving it",
                      flush=True)

    # ------------------------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._pause_requests:  # let the training loop in before taking the lock again
                    time.sleep(0.002)
                    continue
                with self._work:
                    positions = self._claim()
                    if positions:
                        self._produce(positions)
                        continue
                    if self.link is not None:
                        self.link.idle()
                self._stop.wait(0.01)  # nothing may be claimed until a new version or a drop
        except BaseException:  # noqa: BLE001 - the loop re-raises it with this traceback
            self.error = traceback.format_exc()
        finally:
            if self.link is not None:
                with self._work:
                    self.link.stop()

    def _claim(self) -> List[int]:
        per_round = self.stream.P if self.balanced else self.stream.per_rank
        allowed = (self.version + self.max_staleness + 1) * per_round + self.counter.add("dropped", 0)
        k = min(self.chunk, allowed - self.counter.add("claimed", 0))
        if k <= 0:
            return []
        end = self.counter.add("claimed", k)
        if self.balanced:
            return list(range(end - k, end))
        return [self.stream.owned_position(self.slot, i) for i in range(end - k, end)]

    def _produce(self, positions: List[int]) -> None:
        G = self.stream.G
        indices = [self.stream.prompt_index(p) for p in positions]
        version = self.version
        rollout = self.sampler.sample(self.prompts, indices, [G] * len(positions),
                                      [self.stream.sampling_seed(p) for p in positions])
        self.completions_generated += len(rollout)
        rewards = self.score(indices, rollout) if self.score is not None else None  # [k·G, K]
        keep = [True] * len(positions)
        if rewards is not None and self.drop_zero_std:
            keep = [not z for z in zero_std_groups(rewards, G, self.reward_weights)]
        groups = []
        for j, (position, index) in enumerate(zip(positions, indices)):
            if keep[j]:
                rows = slice(j * G, (j + 1) * G)
                groups.append(Group(position, index, version, self.rank, rollout.rows(rows),
                                    None if rewards is None else rewards[rows].clone()))
        dropped = len(positions) - len(groups)
        if dropped:
            self.zero_std_dropped += dropped
            self.counter.add("dropped", dropped)  # their places are claimed again
        self.pool.add(groups)


def as_rollout_rows(groups: List[Group]):
    """(the groups' rows as one Rollout, in the given order; their rewards [n·G, K] when every group was scored)."""
    rollout = Rollout.concat([g.rollout for g in groups])
    rewards = torch.cat([g.rewards for g in groups]) if groups and all(g.rewards is not None for g in groups) else None
    return rollout, rewards
