"""`AsyncGRPOTrainer`: the same GRPO step, fed by rollouts generated in the background on every rank.

Each rank runs a rollout worker (rollout/worker.py) beside its training loop: it claims prompt groups from one
shared stream, samples them with the colocated vLLM engine, scores them and pools them. The loop's step is
GRPOTrainer's; only two stages differ:

    next batch   wait until the ranks together hold a round's worth of fresh groups, cut the oldest ones,
                 and move groups so every rank trains the same number (pool.plan_batch)
    weight sync  pause the worker between two chunks, stream the new weights in, bump the policy version

So while a rank trains round t its worker is already sampling round t+1 with the weights of round t (one
policy version stale; `max_staleness` bounds it and stale groups are dropped, never trained). Sampler
log-probs travel with each group: they are the behaviour policy of the importance-sampling correction.
With `async_load_balancing` a rank whose completions are short (or whose rewards are fast) simply claims more
groups, so the round is ready when the ranks' mean work is done, not the slowest rank's.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Dict, List, Optional

import torch

from . import dist
from .rollout.pool import ClaimCounter, Group, GroupPool, PromptStream, plan_batch
from .rollout.worker import RolloutWorker, as_rollout_rows
from .trainer import GRPOTrainer

POLL_SECONDS = 0.01
ZERO_STD_GIVE_UP_ROUNDS = 20  # dynamic sampling gives up after this many rounds' worth of uninformative groups


class AsyncGRPOTrainer(GRPOTrainer):
    """GRPOTrainer's signature; `async_placement`, `max_staleness`, `async_load_balancing`,
    `async_chunk_groups` and `drop_zero_std_groups` in GRPOConfig steer it."""

    def _check_before_loading(self) -> None:
        args = self.args
        if args.async_placement == "split":
            raise NotImplementedError("async_placement='split' is not implemented yet; use 'colocate' (every rank "
                                      "trains and generates in the background).")
        if not args.use_vllm:
            raise ValueError("AsyncGRPOTrainer generates in a background thread with the colocated vLLM engine; "
                             "use_vllm=False (HF generate) is collective under ZeRO-3 and cannot run there. Set "
                             "use_vllm=True or use GRPOTrainer.")
        if self.prompts_per_round % self.world:
            raise ValueError(f"AsyncGRPOTrainer trains whole prompt groups on each rank, but a round has "
                             f"{self.prompts_per_round} prompts for {self.world} ranks. Make generation batch / "
                             f"num_generations (= {self.prompts_per_round}) a multiple of the world size.")
        if args.drop_zero_std_groups and self.rewards.has_models:
            raise ValueError("drop_zero_std_groups needs rewards computed as groups complete, but reward models are "
                             "ZeRO-3 engines scored in lock-step by all ranks. Serve the reward model with "
                             "`dsgrpo serve-reward` and pass a RemoteReward, or set drop_zero_std_groups=False.")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        a = self.args
        self.stream = PromptStream(self.train_prompts, self.prompts_per_round, a.num_generations, self.world,
                                   a.seed, a.shuffle_dataset)
        self.pool = GroupPool()
        self.counter = ClaimCounter(shared=a.async_load_balancing)
        self.worker = RolloutWorker(
            generator=self.generator, stream=self.stream, counter=self.counter, pool=self.pool, sampling=self.sampling,
            prompt_ids=self.train_prompts.prompt_ids, score=None if self.rewards.has_models else self._score_groups,
            balanced=a.async_load_balancing, chunk_groups=a.async_chunk_groups or max(1, self.stream.per_rank // 4),
            max_staleness=a.max_staleness, drop_zero_std=a.drop_zero_std_groups, reward_weights=a.reward_weights,
            rank=dist.rank(), version=0)
        self._dropped_reported = 0   # stale + zero-std drops already logged (over all ranks)
        self._stale_dropped = 0

    # ================================================================================================ the loop
    def train(self):
        try:
            return super().train()
        finally:
            self.worker.shutdown()

    def _next_batch(self):
        """Cut this round's batch from the groups the ranks hold (a collective: every rank, every round)."""
        args, rnd = self.args, self.state.generation_round
        if not self.worker.started:
            self.worker.version = rnd  # weights of the rounds trained so far (a resumed run synced them)
            self.worker.start()
        need = self.prompts_per_round
        share = need // self.world
        start = time.perf_counter()
        zero_std_at_start = None
        while True:
            stale = self.pool.drop_older_than(rnd - args.max_staleness)
            if stale:
                self._stale_dropped += stale
                self.counter.add("dropped", stale)  # the worker claims replacements
            status = dist.all_gather(torch.tensor([[len(self.pool), float(self.worker.error is not None),
                                                    self.worker.zero_std_dropped]], dtype=torch.float64))
            if status[:, 1].any():
                self._raise_worker_error()
            zero_std = int(status[:, 2].sum())
            zero_std_at_start = zero_std if zero_std_at_start is None else zero_std_at_start
            ready = status[:, 0].sum() >= need if args.async_load_balancing else status[:, 0].min() >= share
            if ready:
                break
            if zero_std - zero_std_at_start > ZERO_STD_GIVE_UP_ROUNDS * need:
                raise RuntimeError(f"drop_zero_std_groups: {zero_std - zero_std_at_start} groups in a row had rewards "
                                   "that all agree, so no batch can be filled. The task is too easy or too hard for "
                                   "the policy, or the reward is constant; check it, or set drop_zero_std_groups=False.")
            time.sleep(POLL_SECONDS)
        waited = time.perf_counter() - start
        held = dist.all_gather_object(self.pool.summary() if args.async_load_balancing else self.pool.summary()[:share])
        plan = plan_batch(held, need)
        me = dist.rank()
        kept = self.pool.take(plan.kept(me))
        outgoing = self.pool.take(list(plan.outgoing(me)))
        parcels = dist.all_gather_object([(plan.destination[g.position], g.to_json()) for g in outgoing])
        received = [Group.from_json(g) for parcel in parcels for dest, g in parcel if dest == me]
        groups = sorted(kept + received, key=lambda g: g.position)  # stream order: the synchronous slot order
        if self.state.global_step + self._steps_per_round() >= self.state.max_steps:
            self.worker.stop_claiming()  # the last round is cut: nothing later would be trained on
        rollout, rewards = as_rollout_rows(groups)
        batch = self._batch(self.train_prompts, [g.prompt_index for g in groups], [len(g.rollout) for g in groups],
                            rollout)
        return batch, rewards, self._rollout_metrics(plan, held, waited)

    def _rollout_metrics(self, plan, held, waited: float) -> Dict[str, float]:
        rnd = self.state.generation_round
        staleness = [rnd - v for v, _, _ in plan.chosen]
        stolen = sum(1 for _, p, r in plan.chosen if r != self.stream.nominal_rank(p))
        generated = dist.all_gather(torch.tensor([[float(self.worker.completions_generated),
                                                   float(self.worker.zero_std_dropped + self._stale_dropped)]]))
        dropped_total = int(generated[:, 1].sum())
        metrics = {"async/staleness/mean": sum(staleness) / len(staleness), "async/staleness/max": float(max(staleness)),
                   "async/groups_stolen": float(stolen),
                   "async/groups_moved": float(sum(1 for _, p, r in plan.chosen if plan.destination[p] != r)),
                   "async/groups_dropped": float(dropped_total - self._dropped_reported),
                   "async/groups_pooled": float(sum(len(h) for h in held) - len(plan.chosen)),
                   "time/wait_for_rollout": waited}
        self._dropped_reported = dropped_total
        for r in range(self.world):
            metrics[f"async/completions_generated/rank{r}"] = float(generated[r, 0])
        self.last_plan = plan
        return metrics

    def _steps_per_round(self) -> int:
        return self.args.num_iterations * self.spg // self.args.gradient_accumulation_steps

    def _sync_generator(self) -> None:
        with self.worker.paused() as waited:
            super()._sync_generator()
            self.worker.version = self.state.generation_round + 1  # this round's update is now what vLLM samples
        self.timer.seconds["wait_for_weights"] = self.timer.seconds.get("wait_for_weights", 0.0) + waited

    def _score_groups(self, indices: List[int], rollout) -> torch.Tensor:
        """The worker's scorer: [k·G, K] rewards of k groups (plain Python / remote sources only)."""
        batch = self._batch(self.train_prompts, indices, [self.args.num_generations] * len(indices), rollout, micro=False)
        return self._reward_matrix(batch)

    def _raise_worker_error(self):
        errors = dist.all_gather_object(self.worker.error)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        self.worker.shutdown(timeout=5)
        raise RuntimeError("the rollout worker failed on rank(s) " + ", ".join(str(r) for r, _ in failed) + ":\n"
                           + "\n".join(f"--- rank {r} ---\n{e}" for r, e in failed))

    # ================================================================================ pausing for other work
    def save_checkpoint(self) -> str:
        with self.worker.paused():  # a still pool: the checkpoint holds exactly the groups claimed so far
            return super().save_checkpoint()

    def evaluate(self) -> Dict[str, float]:
        with self.worker.paused():  # evaluation shares the engine
            return super().evaluate()

    def rank_extra_state(self) -> dict:
        """Saved per rank inside each checkpoint: the pool and the claim counters, so a resumed run trains the
        groups already generated and claims exactly the positions not yet claimed."""
        return {"pool": self.pool.to_json(), "claimed": self.counter.add("claimed", 0),
                "dropped": self.counter.add("dropped", 0), "version": self.worker.version,
                "completions_generated": self.worker.completions_generated}

    def load_rank_extra_state(self, state: dict) -> None:
        self.pool.load_json(state["pool"])
        if dist.is_main() or not self.counter.shared:
            self.counter.set("claimed", state["claimed"])
            self.counter.set("dropped", state["dropped"])
        self.worker.completions_generated = state["completions_generated"]
