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

`async_placement="split"` gives the two jobs to different ranks: the lowest ranks train (ZeRO-3 over their own
process group) and never generate; the others only run vLLM. Each round the generators hand their completed
groups to the trainers in the same batch cut, and after the update training rank 0 broadcasts the gathered
weights to them bucket by bucket (rollout/weight_sync.py). A generating rank's main thread follows the
trainers' round in `_generate_only`; its rollout worker samples meanwhile.
"""

from __future__ import annotations

import json
import os
import time
from typing import Dict, List

import torch

from . import checkpoint, dist
from .engines.builder import ignore_compiling_in_other_threads
from .engines.gather import named_full_parameters
from .rollout.pool import ClaimCounter, Group, GroupPool, PromptStream, plan_batch
from .rollout.weight_sync import broadcast_weights, received_weights
from .rollout.worker import RolloutWorker, as_rollout_rows
from .trainer import GRPOTrainer

POLL_SECONDS = 0.01
ZERO_STD_GIVE_UP_ROUNDS = 20  # dynamic sampling gives up after this many rounds' worth of uninformative groups


class AsyncGRPOTrainer(GRPOTrainer):
    """GRPOTrainer's signature; `async_placement`, `max_staleness`, `async_load_balancing`,
    `async_chunk_groups`, `async_generator_ranks` and `drop_zero_std_groups` in GRPOConfig steer it."""

    # ================================================================================================ set-up
    def _set_up_roles(self) -> None:
        a = self.args
        self.split = a.async_placement == "split"
        world = dist.world_size(dist.EVERYONE)
        if self.split:
            if world < 2:
                raise ValueError("async_placement='split' needs at least 2 ranks (some train, some generate); launch "
                                 "more ranks or use async_placement='colocate'.")
            generators = a.async_generator_ranks or world // 2
            a.validate(world_size=world - generators)
            self.trains = dist.split_roles(world - generators)
            self.first_generator, self.generating_ranks = world - generators, generators
        else:
            self.trains, self.first_generator, self.generating_ranks = True, 0, world

    def _check_before_loading(self) -> None:
        args = self.args
        if self.rollout_func is not None or self.tool_runner is not None:
            raise NotImplementedError("AsyncGRPOTrainer's rollout workers generate with vLLM directly; tools and "
                                      "rollout_func run in GRPOTrainer for now.")
        if not args.use_vllm:
            raise ValueError("AsyncGRPOTrainer generates in a background thread with vLLM; use_vllm=False (HF generate) "
                             "is collective under ZeRO-3 and cannot run there. Set use_vllm=True or use GRPOTrainer.")
        if self.prompts_per_round % self.world:
            raise ValueError(f"AsyncGRPOTrainer trains whole prompt groups on each rank, but a round has "
                             f"{self.prompts_per_round} prompts for {self.world} training ranks. Make generation batch "
                             f"/ num_generations (= {self.prompts_per_round}) a multiple of {self.world}.")
        if not args.async_load_balancing and self.prompts_per_round % self.generating_ranks:
            raise ValueError(f"async_load_balancing=False gives each generating rank a fixed share of a round's "
                             f"{self.prompts_per_round} prompts, which {self.generating_ranks} ranks cannot split "
                             "evenly. Turn balancing on or change the batch geometry.")
        if args.drop_zero_std_groups and self.rewards.has_models:
            raise ValueError("drop_zero_std_groups needs rewards computed as groups complete, but reward models are "
                             "ZeRO-3 engines scored in lock-step by all ranks. Serve the reward model with "
                             "`dsgrpo serve-reward` and pass a RemoteReward, or set drop_zero_std_groups=False.")
        if self.split and self.rewards.has_models:
            raise ValueError("async_placement='split' scores on the generating ranks, which hold no DeepSpeed engine: "
                             "serve reward models with `dsgrpo serve-reward` and pass a RemoteReward, or use 'colocate'.")
        if self.split and self.eval_prompts is not None and args.eval_strategy != "no":
            raise ValueError("async_placement='split' has no engine on the training ranks to evaluate with; set "
                             "eval_strategy='no' (evaluate the saved model separately) or use 'colocate'.")

    def _build_engines(self, model, optimizers) -> None:
        if self.trains:
            return super()._build_engines(model, optimizers)
        from .rollout.vllm_engine import VLLMGenerator  # a generating rank: vLLM only, no DeepSpeed engine
        self.policy = self.reference = None
        self.zero3 = True
        self.generator = VLLMGenerator(self.model_path, self.args, dtype=self.dtype)

    def _make_generator(self):
        if not self.split:
            return super()._make_generator()
        from .rollout.vllm_engine import join_engine_setup_without_engine
        join_engine_setup_without_engine(self.model_path, self.args, dtype=self.dtype)  # the generators' vLLM start
        return None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        ignore_compiling_in_other_threads()  # vLLM may compile in the rollout thread while ZeRO-3 traces
        a = self.args
        self.stream = PromptStream(self.train_prompts, self.prompts_per_round, a.num_generations,
                                   self.generating_ranks, a.seed, a.shuffle_dataset)
        self.pool = GroupPool()
        self.counter = ClaimCounter(shared=a.async_load_balancing)
        self.worker = None
        if self.generator is not None:
            self.worker = RolloutWorker(
                generator=self.generator, stream=self.stream, counter=self.counter, pool=self.pool,
                sampling=self.sampling, prompt_ids=self.train_prompts.prompt_ids,
                score=None if self.rewards.has_models else self._score_groups, balanced=a.async_load_balancing,
                chunk_groups=a.async_chunk_groups or max(1, self.stream.per_rank // 4), max_staleness=a.max_staleness,
                drop_zero_std=a.drop_zero_std_groups, reward_weights=a.reward_weights,
                rank=dist.rank(dist.EVERYONE), version=0, slot=dist.rank(dist.EVERYONE) - self.first_generator)
        self._dropped_reported = 0     # stale + zero-std drops already logged (over all ranks)
        self._stale_dropped = 0
        self._generator_states: Dict[str, dict] = {}  # split: the generators' pools, gathered for a checkpoint

    # ================================================================================================ the loop
    def train(self):
        try:
            return super().train() if self.trains else self._generate_only()
        finally:
            if self.worker is not None:
                self.worker.shutdown()

    def _next_batch(self):
        """Cut this round's batch from the groups the ranks hold (a collective: every rank, every round)."""
        rnd = self.state.generation_round
        self._start_worker(rnd)
        last = self.state.global_step + self._steps_per_round() >= self.state.max_steps
        groups, plan, held, waited, status = self._exchange(rnd, last)
        rollout, rewards = as_rollout_rows(groups)
        batch = self._batch(self.train_prompts, [g.prompt_index for g in groups], [len(g.rollout) for g in groups],
                            rollout)
        return batch, rewards, self._rollout_metrics(plan, held, waited, status)

    def _start_worker(self, version: int) -> None:
        if self.worker is not None and not self.worker.started:
            self.worker.version = version  # weights of the rounds trained so far (a resumed run synced them)
            self.worker.start()

    def _exchange(self, rnd: int, last: bool):
        """Every rank: wait until the generating ranks hold a round's worth of groups fresh enough for round
        `rnd`, cut the oldest, and hand each training rank its share. Returns (this rank's groups in stream
        order, plan, what each rank held, seconds waited, last status)."""
        args, need = self.args, self.prompts_per_round
        share = need // self.generating_ranks
        start = time.perf_counter()
        zero_std_at_start = None
        while True:
            stale = self.pool.drop_older_than(rnd - args.max_staleness)
            if stale:
                self._stale_dropped += stale
                self.counter.add("dropped", stale)  # the worker claims replacements
            w = self.worker
            mine = [len(self.pool), float(w is not None and w.error is not None), w.zero_std_dropped if w else 0,
                    w.completions_generated if w else 0, self._stale_dropped]
            status = dist.all_gather(torch.tensor([mine], dtype=torch.float64), group=dist.EVERYONE)
            if status[:, 1].any():
                self._raise_worker_error()
            zero_std = int(status[:, 2].sum())
            zero_std_at_start = zero_std if zero_std_at_start is None else zero_std_at_start
            held_counts = status[self.first_generator:, 0]
            if held_counts.sum() >= need if args.async_load_balancing else held_counts.min() >= share:
                break
            if zero_std - zero_std_at_start > ZERO_STD_GIVE_UP_ROUNDS * need:
                raise RuntimeError(f"drop_zero_std_groups: {zero_std - zero_std_at_start} groups in a row had rewards "
                                   "that all agree, so no batch can be filled. The task is too easy or too hard for "
                                   "the policy, or the reward is constant; check it, or set drop_zero_std_groups=False.")
            time.sleep(POLL_SECONDS)
        waited = time.perf_counter() - start
        summary = self.pool.summary()
        held = dist.all_gather_object(summary if args.async_load_balancing else summary[:share], group=dist.EVERYONE)
        plan = plan_batch(held, need, trainers=self.world)
        me = dist.rank(dist.EVERYONE)
        kept = self.pool.take(plan.kept(me))
        outgoing = self.pool.take(list(plan.outgoing(me)))
        parcels = dist.all_gather_object([(plan.destination[g.position], g.to_json()) for g in outgoing],
                                         group=dist.EVERYONE)
        received = [Group.from_json(g) for parcel in parcels for dest, g in parcel if dest == me]
        if last and self.worker is not None:
            self.worker.stop_claiming()  # the last round is cut: nothing later would be trained on
        groups = sorted(kept + received, key=lambda g: g.position)  # stream order: the synchronous slot order
        return groups, plan, held, waited, status

    def _rollout_metrics(self, plan, held, waited: float, status) -> Dict[str, float]:
        rnd = self.state.generation_round
        staleness = [rnd - v for v, _, _ in plan.chosen]
        stolen = sum(1 for _, p, r in plan.chosen if r - self.first_generator != self.stream.nominal_rank(p))
        dropped_total = int(status[:, 2].sum() + status[:, 4].sum())
        metrics = {"async/staleness/mean": sum(staleness) / len(staleness), "async/staleness/max": float(max(staleness)),
                   "async/groups_stolen": float(stolen),
                   "async/groups_moved": float(sum(1 for _, p, r in plan.chosen if plan.destination[p] != r)),
                   "async/groups_dropped": float(dropped_total - self._dropped_reported),
                   "async/groups_pooled": float(sum(len(h) for h in held) - len(plan.chosen)),
                   "time/wait_for_rollout": waited}
        self._dropped_reported = dropped_total
        for r in range(self.first_generator, status.shape[0]):
            metrics[f"async/completions_generated/rank{r}"] = float(status[r, 3])
        self.last_plan = plan
        return metrics

    def _steps_per_round(self) -> int:
        return self.args.num_iterations * self.spg // self.args.gradient_accumulation_steps

    def _sync_generator(self, needed: bool = True) -> None:
        if self.split:  # training rank 0 → generators; the other training ranks only join the gathers
            if dist.rank(dist.EVERYONE) == 0:
                torch.distributed.broadcast_object_list([needed], src=0, group=dist.broadcast_group())
            if needed:
                broadcast_weights(named_full_parameters(self.policy.module, self.args.weight_sync_bucket_bytes,
                                                        self.tied), dist.broadcast_group(),
                                  self.args.weight_sync_bucket_bytes, sending=dist.rank(dist.EVERYONE) == 0)
            return
        with self.worker.paused() as waited:
            super()._sync_generator(needed)
            if needed:
                self.worker.version = self.state.generation_round + 1  # this round's update is what vLLM samples
        self.timer.seconds["wait_for_weights"] = self.timer.seconds.get("wait_for_weights", 0.0) + waited

    def _score_groups(self, indices: List[int], rollout) -> torch.Tensor:
        """The worker's scorer: [k·G, K] rewards of k groups (plain Python / remote sources only)."""
        batch = self._batch(self.train_prompts, indices, [self.args.num_generations] * len(indices), rollout, micro=False)
        return self._reward_matrix(batch)

    def _raise_worker_error(self):
        errors = dist.all_gather_object(self.worker.error if self.worker else None, group=dist.EVERYONE)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if self.worker is not None:
            self.worker.shutdown(timeout=5)
        raise RuntimeError("the rollout worker failed on rank(s) " + ", ".join(str(r) for r, _ in failed) + ":\n"
                           + "\n".join(f"--- rank {r} ---\n{e}" for r, e in failed))

    # ================================================================================ split: the generating ranks
    def _generate_only(self):
        """A generating rank's main thread: follow the trainers round by round (batch cut, weights, checkpoint
        requests) while the rollout worker samples."""
        rnd = 0
        if self.resume_path:
            rnd = self._load_generator_state(self.resume_path)
            self._receive_weights(rnd)
        self._start_worker(rnd)
        while True:
            self._exchange(rnd, last=(rnd + 1) * self._steps_per_round() >= self.state.max_steps)
            self._receive_weights(rnd + 1)
            order = dist.broadcast_object(None, src=0, group=dist.EVERYONE)  # from _end_round on training rank 0
            if order["save"]:
                with self.worker.paused():
                    dist.all_gather_object(self.rank_extra_state(), group=dist.EVERYONE)
                    dist.barrier("the checkpoint holds this pool; sampling resumes", group=dist.EVERYONE)
            rnd += 1
            if order["preempted"]:
                raise SystemExit(checkpoint.PREEMPTED_EXIT_CODE)
            if order["stop"]:
                return self.state

    def _receive_weights(self, version: int) -> None:
        box = [None]
        torch.distributed.broadcast_object_list(box, src=0, group=dist.broadcast_group())
        if box[0]:
            with self.worker.paused():
                self.generator.load_weights(received_weights(dist.broadcast_group()))
                self.worker.version = version

    def _end_round(self, save: bool, stop: bool, preempted: bool) -> None:
        if not self.split:
            return super()._end_round(save, stop, preempted)
        dist.broadcast_object({"save": save, "stop": stop, "preempted": preempted}, src=0, group=dist.EVERYONE)
        if save:
            states = dist.all_gather_object(None, group=dist.EVERYONE)
            self._generator_states = {str(r): s for r, s in enumerate(states) if s is not None}
        super()._end_round(save, stop, preempted)
        if save:
            dist.barrier("the checkpoint holds the generators' pools; they may sample again", group=dist.EVERYONE)

    def _load_generator_state(self, path: str) -> int:
        with open(os.path.join(path, "extra_state_0.json")) as fh:
            state = json.load(fh)["generators"][str(dist.rank(dist.EVERYONE))]
        self.load_rank_extra_state(state)
        with open(os.path.join(path, "trainer_state.json")) as fh:
            return json.load(fh)["generation_round"]

    # ================================================================================ pausing for other work
    def save_checkpoint(self) -> str:
        if self.worker is None:
            return super().save_checkpoint()
        with self.worker.paused():  # a still pool: the checkpoint holds exactly the groups claimed so far
            return super().save_checkpoint()

    def evaluate(self) -> Dict[str, float]:
        with self.worker.paused():  # evaluation shares the engine
            return super().evaluate()

    def rank_extra_state(self) -> dict:
        """Saved per rank inside each checkpoint: the pool and the claim counters, so a resumed run trains the
        groups already generated and claims exactly the positions not yet claimed (in split placement training
        rank 0 also keeps the generators' pools)."""
        state = {"pool": self.pool.to_json(), "claimed": self.counter.add("claimed", 0),
                 "dropped": self.counter.add("dropped", 0),
                 "completions_generated": self.worker.completions_generated if self.worker else 0}
        if self._generator_states and dist.is_main():
            state["generators"] = self._generator_states
        return state

    def load_rank_extra_state(self, state: dict) -> None:
        self.pool.load_json(state["pool"])
        if dist.is_main() or not self.counter.shared:
            self.counter.set("claimed", state["claimed"])
            self.counter.set("dropped", state["dropped"])
        if self.worker is not None:
            self.worker.completions_generated = state["completions_generated"]
