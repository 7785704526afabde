"""The asynchronous trainer's rollout worker: a thread per rank that keeps the colocated vLLM engine sampling.

It claims prompt groups from the stream, samples them with the engine's current weights (through the trainer's
sampler: plain generation, tool turns or a rollout_func), scores them with the reward functions (plain Python and
remote ones: nothing collective runs in this thread) and puts them in the rank's pool. It never waits for the other
ranks. The training loop pauses it (`paused()`) while it replaces the engine's weights, writes a checkpoint or
evaluates; a claim, its generation and its scoring happen under one lock, so a pause never splits a chunk and a
paused pool is exactly what was claimed.

How far ahead it may run is the staleness bound: with version v loaded it claims only groups that round
v + max_staleness can still train on; dropped groups (stale, or zero-std with dynamic sampling) are replaced."""

from __future__ import annotations

import threading
import time
import traceback
from contextlib import contextmanager
from typing import Callable, List, Optional

import torch

from .. import compat
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
            threads = torch.get_num_threads()

            def run() -> None:
                compat.engine_thread_threads(threads)  # vLLM-CPU's attention wants the main thread's OpenMP count
                self._run()

            self._thread = threading.Thread(target=run, name=f"{self.thread_name}-rank{self.rank}", daemon=True)
            self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def _run(self) -> None:
        raise NotImplementedError


class RolloutWorker(BackgroundThread):
    def __init__(
        self,
        *,
        sampler,
        prompts,
        stream: PromptStream,
        counter: ClaimCounter,
        pool: GroupPool,
        score: Optional[Callable],
        balanced: bool,
        chunk_groups: int,
        max_staleness: int,
        drop_zero_std: bool,
        reward_weights,
        rank: int,
        version: int,
        slot: Optional[int] = None,
        link=None,
    ):
        self.sampler, self.prompts, self.stream, self.counter, self.pool = sampler, prompts, stream, counter, pool
        self.score = score
        self.balanced, self.chunk, self.max_staleness = balanced, chunk_groups, max_staleness
        self.drop_zero_std, self.reward_weights, self.rank = drop_zero_std, reward_weights, rank
        self.slot = rank if slot is None else slot  # this rank's index among the generating ranks
        self.version = version  # weight syncs the engine has seen
        self.link = link  # tensor parallel: the engine's other ranks (tensor_parallel.MirrorLink)
        self.completions_generated = 0
        self.zero_std_dropped = 0
        self.error: Optional[str] = None  # the traceback, when the thread died
        self._work = threading.Lock()  # held for a whole chunk: claim, generate, score, pool
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
                print(
                    f"[dsgrpo] rank {self.rank}: rollout worker still busy after {timeout:.0f} s; leaving it",
                    flush=True,
                )

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
        start, end = self.counter.claim(self.chunk, (self.version + self.max_staleness + 1) * per_round)
        if self.balanced:
            return list(range(start, end))
        return [self.stream.owned_position(self.slot, i) for i in range(start, end)]

    def _produce(self, positions: List[int]) -> None:
        G = self.stream.G
        indices = [self.stream.prompt_index(p) for p in positions]
        version = self.version
        rollout = self.sampler.sample(
            self.prompts, indices, [G] * len(positions), [self.stream.sampling_seed(p) for p in positions]
        )
        self._pool(positions, indices, rollout, [version] * len(positions))

    def _pool(self, positions: List[int], indices: List[int], rollout, versions: List[int]) -> None:
        """Score k complete groups (their rows in order), drop the uninformative ones (dynamic sampling), pool the
        rest; `versions[j]`: the policy version group j counts as (its oldest token's)."""
        G = self.stream.G
        self.completions_generated += len(rollout)
        rewards = self.score(indices, rollout) if self.score is not None else None  # [k·G, K]
        keep = [True] * len(positions)
        if rewards is not None and self.drop_zero_std:
            keep = [not z for z in zero_std_groups(rewards, G, self.reward_weights)]
        groups = []
        for j, (position, index) in enumerate(zip(positions, indices)):
            if keep[j]:
                rows = slice(j * G, (j + 1) * G)
                groups.append(
                    Group(
                        position,
                        index,
                        versions[j],
                        self.rank,
                        rollout.rows(rows),
                        None if rewards is None else rewards[rows].clone(),
                    )
                )
        dropped = len(positions) - len(groups)
        if dropped:
            self.zero_std_dropped += dropped
            self.counter.add("dropped", dropped)  # their places are claimed again
        self.pool.add(groups)


class PartialRolloutWorker(RolloutWorker):
    """The rollout worker with `partial_rollout=True`: it steps the engine itself, one completion per request, keeps
    `chunk_groups + overprovision` groups in flight (claiming a new one as soon as one completes, so the engine's
    batch never drains to the long tail) and pools each group the moment its last completion ends. A pause (weight
    sync, checkpoint, evaluation) stops the running completions; they keep their tokens and continue as prompt +
    prefix, on the weights the pause loaded (rollout/partial.py). A group counts as the version of its oldest
    token; completions more than max_staleness versions behind are sampled again from the start."""

    def __init__(self, *, overprovision: int, **kw):
        super().__init__(**kw)
        from .partial import InFlight

        self.engine, self.sampling = self.sampler.generator, self.sampler.sampling
        self.target = self.chunk + overprovision  # groups in flight
        self.inflight = InFlight(self.stream.G, self.sampling.max_tokens, turns=self.sampler.turns(self.prompts))
        self.running: set = set()  # request ids the engine holds
        self.stopped = self.resampled = 0  # completions stopped by pauses; sampled again (over-stale)

    @contextmanager
    def paused(self):
        with super().paused() as waited:
            self._stop_running()
            yield waited

    def _stop_running(self) -> None:
        """With the work lock held: the engine drops the running completions; their tokens stay in flight."""
        if self.running:
            self.engine.abort(sorted(self.running))
            self.stopped += len(self.running)
            self.running.clear()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._pause_requests:
                    time.sleep(0.002)
                    continue
                with self._work:
                    if self._step():
                        continue
                self._stop.wait(0.01)  # nothing to sample until a new version or a drop
        except BaseException:  # noqa: BLE001 - the loop re-raises it with this traceback
            self.error = traceback.format_exc()
        finally:
            with self._work:
                self._stop_running()

    def _step(self) -> bool:
        """Claim up to the target, submit what is not running, one engine step, pool what completed. False when
        there was nothing to do."""
        from .partial import parse_request_id, segment_seed

        restarted, _ = self.inflight.restart_stale(self.version, self.max_staleness)
        self.resampled += restarted
        want = self.target - len(self.inflight)
        for position in self._claim_up_to(want) if want > 0 else []:
            self.inflight.add(
                position,
                self.stream.prompt_index(position),
                segment_seed(self.stream.seed, position, self.stream.P, self.stream.G),
            )
        for rid, prefix, left, seed in self.inflight.requests(skip=self.running):
            position, member = parse_request_id(rid)
            prompt = self.inflight.prompt_of(position, member, self._prompt_ids)
            self.engine.submit(rid, prompt + list(prefix), self.sampling, left, seed)
            self.running.add(rid)
        if not self.running:
            return False
        for rid, tokens, logprobs, finished, truncated in self.engine.advance():
            # a completion that ended a turn with tool calls goes on: the next step submits its continuation
            self.inflight.record(rid, tokens, logprobs, finished, truncated, self.version)
            if finished:
                self.running.discard(rid)
        done = self.inflight.take(len(self.inflight.complete()))
        if done:
            rollout = self.inflight.rollout(done, self._prompt_ids)
            self._pool(
                [g.position for g in done],
                [g.prompt_index for g in done],
                rollout,
                [min(min(c.versions or [self.version]) for c in g.members) for g in done],
            )
        return True

    def _prompt_ids(self, index: int) -> List[int]:
        return self.prompts.prompt_ids[index]

    def _claim_up_to(self, k: int) -> List[int]:
        chunk, self.chunk = self.chunk, k
        try:
            return self._claim()
        finally:
            self.chunk = chunk


def as_rollout_rows(groups: List[Group]):
    """(the groups' rows as one Rollout, in the given order; their rewards [n·G, K] when every group was scored)."""
    rollout = Rollout.concat([g.rollout for g in groups])
    rewards = torch.cat([g.rewards for g in groups]) if groups and all(g.rewards is not None for g in groups) else None
    return rollout, rewards
