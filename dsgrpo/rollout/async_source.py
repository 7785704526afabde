"""`AsyncRolloutSource`: rounds cut from prompt groups generated in the background on every generating rank
(AsyncGRPOTrainer's source).

Each generating rank runs a rollout worker (rollout/worker.py): it claims prompt groups from one shared stream,
samples them with the trainer's sampler (plain generation, tool turns or a rollout_func) on the colocated vLLM
engine, scores them and pools them. The loop's step is GRPOTrainer's; only the source differs:

    next batch   wait until the ranks together hold a round's worth of fresh groups, cut the oldest ones,
                 and move groups so every training rank trains the same number (pool.plan_batch)
    weight sync  pause the worker between two chunks, stream the new weights in, bump the policy version

So while a rank trains round t its worker is already sampling round t+1 with the weights of round t (one
policy version stale; `max_staleness` bounds it and stale groups are dropped, never trained). Sampler
log-probs travel with each group: they are the behaviour policy of the importance-sampling correction.
With `async_load_balancing` a rank whose completions are short (or whose rewards are fast) simply claims more
groups, so the round is ready when the ranks' mean work is done, not the slowest rank's.

`async_placement="split"` gives the two jobs to different ranks: the lowest ranks train (ZeRO-3 over their own
process group) and never generate; the others only run vLLM, in their own small loop (rollout/generating_rank.py).
Each round the generators hand their completed groups to the trainers in the same batch cut, and after the update
training rank 0 broadcasts the gathered weights to them bucket by bucket (rollout/weight_sync.py)."""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Dict, List, Optional

import torch

from .. import compat, dist
from ..engines.weights import named_full_parameters
from ..errors import CheckpointError
from .batch import Batch
from .pool import ClaimCounter, Group, GroupPool, PromptStream, plan_batch
from .sources import Placement, RolloutSetup, RolloutSource
from .environments import EnvironmentSampler
from .samplers import ToolSampler
from .tensor_parallel import LeadingGenerator, MirrorLink, MirrorWorker, TensorParallelGenerator
from .weight_stream import send_weights
from .partial import overprovision_per_rank, staleness_metrics
from .worker import PartialRolloutWorker, RolloutWorker, as_rollout_rows

POLL_SECONDS = 0.01
ZERO_STD_GIVE_UP_ROUNDS = 20  # dynamic sampling gives up after this many rounds' worth of uninformative groups


def default_chunk_groups(round_groups: int, workers: int) -> int:
    """Groups a rollout worker claims per engine call: with one worker there is no one to balance against, and each
    call has a fixed cost, so it takes a whole round at once (single process, tiny workload: 0.45x the synchronous
    trainer with a quarter-round per call, 1.2x with a whole round; bench/throughput.py --async). Otherwise a quarter
    of a worker's share, so the other workers can take over what a slow one has not claimed yet."""
    if workers <= 1:
        return max(1, round_groups)
    return max(1, round_groups // workers // 4)


class GroupExchange:
    """The pooled groups of one generating rank and the round's batch cut: shared by the training ranks' source
    and split placement's generating ranks, which take part in the same collectives."""

    def __init__(self, setup: RolloutSetup):
        a, self.setup, self.args = setup.args, setup, setup.args
        self.placement: Placement = setup.placement
        self.stream = PromptStream(
            setup.prompts,
            setup.prompts_per_round,
            a.num_generations,
            self.placement.generators,
            a.seed,
            a.shuffle_dataset,
            order_seed=a.order_seed,
        )
        self.pool = GroupPool()
        self.counter = ClaimCounter(shared=a.async_load_balancing)
        self.stale_dropped = 0
        self.worker: Optional[RolloutWorker] = None
        if self.placement.generates:
            me = dist.rank(dist.EVERYONE)
            sampler, link = setup.sampler, None
            if isinstance(setup.generator, TensorParallelGenerator):  # one worker per engine, on its first rank
                if me != dist.tensor_parallel_leader():
                    self.worker = MirrorWorker(setup.generator.engine, me)
                    return
                link = MirrorLink()
                sampler = copy.copy(sampler)
                sampler.generator = LeadingGenerator(setup.generator.engine, link)
                if isinstance(sampler, (ToolSampler, EnvironmentSampler)):  # the leader alone runs the tool turns:
                    sampler.lockstep = None  # the mirrors repeat its calls
            partial = (
                {"overprovision": overprovision_per_rank(a.rollout_overprovision, self.placement.generators)}
                if a.partial_rollout
                else {}
            )
            self.worker = (PartialRolloutWorker if a.partial_rollout else RolloutWorker)(
                **partial,
                sampler=sampler,
                prompts=setup.prompts,
                stream=self.stream,
                counter=self.counter,
                pool=self.pool,
                score=self._score_groups if setup.scores_anywhere else None,
                balanced=a.async_load_balancing,
                chunk_groups=a.async_chunk_groups
                or default_chunk_groups(
                    self.stream.P, workers=self.placement.generators // max(1, a.vllm_tensor_parallel_size)
                ),
                max_staleness=a.max_staleness,
                drop_zero_std=a.drop_zero_std_groups,
                reward_weights=setup.reward_weights,
                rank=me,
                version=0,
                slot=me - self.placement.first_generator,
                link=link,
            )

    def is_last(self, round_index: int) -> bool:
        return self.setup.steps_after_round(round_index) >= self.setup.max_steps

    def start_worker(self, version: int) -> None:
        if self.worker is not None and not self.worker.started:
            self.worker.version = version  # weights of the rounds trained so far (a resumed run synced them)
            self.worker.start()

    def paused(self):
        return self.worker.paused() if self.worker is not None else contextlib.nullcontext(0.0)

    def cut(self, round_index: int):
        """Every rank: wait until the generating ranks hold a round's worth of groups fresh enough for round
        `round_index`, cut the oldest, and hand each training rank its share. Returns (this rank's groups in stream
        order, plan, what each rank held, seconds waited, last status)."""
        args, need = self.args, self.setup.prompts_per_round
        share = need // self.placement.generators
        start = time.perf_counter()
        zero_std_at_start = None
        while True:
            stale = self.pool.drop_older_than(round_index - args.max_staleness)
            if stale:
                self.stale_dropped += stale
                self.counter.add("dropped", stale)  # the worker claims replacements
            w = self.worker
            mine = [
                len(self.pool),
                float(w is not None and w.error is not None),
                w.zero_std_dropped if w else 0,
                w.completions_generated if w else 0,
                self.stale_dropped,
                getattr(w, "stopped", 0),
                getattr(w, "resampled", 0),
            ]
            status = dist.all_gather(torch.tensor([mine], dtype=torch.float64), group=dist.EVERYONE)
            if status[:, 1].any():
                self.raise_worker_error()
            zero_std = int(status[:, 2].sum())
            zero_std_at_start = zero_std if zero_std_at_start is None else zero_std_at_start
            held_counts = status[self.placement.first_generator :, 0]
            if held_counts.sum() >= need if args.async_load_balancing else held_counts.min() >= share:
                break
            if zero_std - zero_std_at_start > ZERO_STD_GIVE_UP_ROUNDS * need:
                raise RuntimeError(
                    f"drop_zero_std_groups: {zero_std - zero_std_at_start} groups in a row had rewards "
                    "that all agree, so no batch can be filled. The task is too easy or too hard for "
                    "the policy, or the reward is constant; check it, or set drop_zero_std_groups=False."
                )
            time.sleep(POLL_SECONDS)
        waited = time.perf_counter() - start
        summary = self.pool.summary()
        held = dist.all_gather_object(summary if args.async_load_balancing else summary[:share], group=dist.EVERYONE)
        plan = plan_batch(held, need, trainers=self.placement.trainers)
        me = dist.rank(dist.EVERYONE)
        kept = self.pool.take(plan.kept(me))
        outgoing = self.pool.take(list(plan.outgoing(me)))
        parcels = dist.all_gather_object(
            [(plan.destination[g.position], g.to_json()) for g in outgoing], group=dist.EVERYONE
        )
        received = [Group.from_json(g) for parcel in parcels for dest, g in parcel if dest == me]
        if self.is_last(round_index) and self.worker is not None:
            self.worker.stop_claiming()  # the last round is cut: nothing later would be trained on
        groups = sorted(kept + received, key=lambda g: g.position)  # stream order: the synchronous slot order
        return groups, plan, held, waited, status

    def _score_groups(self, indices: List[int], rollout) -> torch.Tensor:
        """The worker's scorer: [k·G, K] rewards of k groups (plain Python / remote sources only)."""
        setup = self.setup
        batch = setup.build_batch(
            setup.prompts, indices, [self.args.num_generations] * len(indices), rollout, micro=False
        )
        return setup.reward_matrix(batch)

    def raise_worker_error(self):
        errors = dist.all_gather_object(self.worker.error if self.worker else None, group=dist.EVERYONE)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if self.worker is not None:
            self.worker.shutdown(timeout=5)
        raise RuntimeError(
            "the rollout worker failed on rank(s) "
            + ", ".join(str(r) for r, _ in failed)
            + ":\n"
            + "\n".join(f"--- rank {r} ---\n{e}" for r, e in failed)
        )

    # ---- what a checkpoint keeps of a rank
    def state_dict(self) -> dict:
        """The pool and the claim counters, so a resumed run trains the groups already generated and claims
        exactly the positions not yet claimed."""
        state = {
            "pool": self.pool.to_json(),
            "claimed": self.counter.add("claimed", 0),
            "dropped": self.counter.add("dropped", 0),
            "completions_generated": self.worker.completions_generated if self.worker else 0,
        }
        if isinstance(self.worker, PartialRolloutWorker):  # claimed, not pooled yet: the groups in flight
            state["in_flight"] = self.worker.inflight.state()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.pool.load_json(state["pool"])
        if dist.is_main() or not self.counter.shared:
            self.counter.set("claimed", state["claimed"])
            self.counter.set("dropped", state["dropped"])
        if self.worker is not None:
            self.worker.completions_generated = state["completions_generated"]
        if isinstance(self.worker, PartialRolloutWorker):
            inflight = self.worker.inflight
            inflight.load(state.get("in_flight", []))
            if inflight.rerun_from_reset:
                print(
                    f"dsgrpo: rank {dist.rank()} resumed {len(inflight)} prompt group(s) in flight that act on "
                    f"environments, which a checkpoint cannot hold: their {inflight.rerun_from_reset} episodes start "
                    "again from reset.",
                    flush=True,
                )

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


class AsyncRolloutSource(RolloutSource):
    """The training ranks' side (every rank in colocate placement). `GeneratingRank` is the other side."""

    generates_while_training = True

    def __init__(self, setup: RolloutSetup):
        super().__init__(setup)
        compat.ignore_compiling_in_other_threads()  # vLLM may compile in the rollout thread while ZeRO-3 traces
        self.exchange = GroupExchange(setup)
        self.split = not setup.placement.generates
        self._dropped_reported = 0  # stale + zero-std drops already logged (over all ranks)
        self._generators_state: Dict[str, dict] = {}  # split: the generators' state at the last checkpoint order
        self._counters = None  # split: the claim counters read at the same moment
        self.last_plan = None

    @property
    def worker(self) -> Optional[RolloutWorker]:
        return self.exchange.worker

    # ---- before anything is built
    @staticmethod
    def placement(args) -> Placement:
        if args.async_placement != "split":
            return Placement.colocated()
        world = dist.world_size(dist.EVERYONE)
        if world < 2:
            raise ValueError(
                "async_placement='split' needs at least 2 ranks (some train, some generate); launch "
                "more ranks or use async_placement='colocate'."
            )
        generators = args.async_generator_ranks or world // 2
        trains = dist.split_roles(world - generators)
        return Placement(
            trains=trains,
            generates=not trains,
            trainers=world - generators,
            generators=generators,
            first_generator=world - generators,
        )

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
        split = args.async_placement == "split"
        if streaming:
            raise ValueError(
                "AsyncGRPOTrainer hands prompt groups out by dataset position, out of order, so it needs "
                "a map-style datasets.Dataset, not an IterableDataset. Use GRPOTrainer, or load the "
                "dataset without streaming."
            )
        if args.vllm_enable_sleep_mode and dist.is_main():
            print(
                "dsgrpo: warning: vllm_enable_sleep_mode has no effect with AsyncGRPOTrainer: its engine generates "
                "while training runs, so it never sleeps.",
                flush=True,
            )
        if args.vllm_tensor_parallel_size > 1 and args.vllm_mode == "colocate":
            if split:
                raise NotImplementedError(
                    "async_placement='split' with vllm_tensor_parallel_size > 1: the generating "
                    "ranks' engines are one rank each for now. Use async_placement='colocate'."
                )
            if not args.async_load_balancing:
                raise ValueError(
                    "vllm_tensor_parallel_size > 1 with AsyncGRPOTrainer: only each engine's first rank "
                    "claims and holds groups, and the batch cut must move them to the engine's other "
                    "ranks. Set async_load_balancing=True."
                )
        if not args.use_vllm:
            raise ValueError(
                "AsyncGRPOTrainer generates in a background thread with vLLM; use_vllm=False (HF generate) "
                "is collective under ZeRO-3 and cannot run there. Set use_vllm=True or use GRPOTrainer."
            )
        if prompts_per_round % placement.trainers:
            raise ValueError(
                f"AsyncGRPOTrainer trains whole prompt groups on each rank, but a round has "
                f"{prompts_per_round} prompts for {placement.trainers} training ranks. Make generation "
                f"batch / num_generations (= {prompts_per_round}) a multiple of {placement.trainers}."
            )
        if not args.async_load_balancing and prompts_per_round % placement.generators:
            raise ValueError(
                f"async_load_balancing=False gives each generating rank a fixed share of a round's "
                f"{prompts_per_round} prompts, which {placement.generators} ranks cannot split "
                "evenly. Turn balancing on or change the batch geometry."
            )
        if args.drop_zero_std_groups and reward_models:
            raise ValueError(
                "drop_zero_std_groups needs rewards computed as groups complete, but reward models are "
                "ZeRO-3 engines scored in lock-step by all ranks. Serve the reward model with "
                "`dsgrpo serve-reward` and pass a RemoteReward, or set drop_zero_std_groups=False."
            )
        if split and reward_models:
            raise ValueError(
                "async_placement='split' scores on the generating ranks, which hold no DeepSpeed engine: "
                "serve reward models with `dsgrpo serve-reward` and pass a RemoteReward, or use 'colocate'."
            )
        if split and evaluates:
            raise ValueError(
                "async_placement='split' has no engine on the training ranks to evaluate with; set "
                "eval_strategy='no' (evaluate the saved model separately) or use 'colocate'."
            )

    # ---- the round
    def next_batch(self, round_index: int) -> Batch:
        """Cut this round's batch from the groups the ranks hold (a collective: every rank, every round)."""
        self.exchange.start_worker(round_index)
        groups, plan, held, waited, status = self.exchange.cut(round_index)
        rollout, rewards = as_rollout_rows(groups)
        batch = self.setup.build_batch(
            self.setup.prompts, [g.prompt_index for g in groups], [len(g.rollout) for g in groups], rollout
        )
        batch.rewards = rewards
        batch.metrics.update(self._rollout_metrics(round_index, plan, held, waited, status))
        if self.args.partial_rollout:  # completions mix versions: the token-age histogram over the ranks
            mine = staleness_metrics(rollout, round_index, self.args.max_staleness)
            tokens = sum(len(c) for c in rollout.completion_ids)
            batch.metrics.update(
                dist.reduce_metrics(mine, {k: tokens if "staleness" in k else len(rollout) for k in mine})
            )
        batch.metrics.update(self._tool_metrics(batch))
        return batch

    def _rollout_metrics(self, round_index: int, plan, held, waited: float, status) -> Dict[str, float]:
        first = self.setup.placement.first_generator
        staleness = [round_index - v for v, _, _ in plan.chosen]
        stolen = sum(1 for _, p, r in plan.chosen if r - first != self.exchange.stream.nominal_rank(p))
        dropped_total = int(status[:, 2].sum() + status[:, 4].sum())
        metrics = {
            "async/staleness/mean": sum(staleness) / len(staleness),
            "async/staleness/max": float(max(staleness)),
            "async/groups_stolen": float(stolen),
            "async/groups_moved": float(sum(1 for _, p, r in plan.chosen if plan.destination[p] != r)),
            "async/groups_dropped": float(dropped_total - self._dropped_reported),
            "async/groups_pooled": float(sum(len(h) for h in held) - len(plan.chosen)),
            "time/wait_for_rollout": waited,
        }
        self._dropped_reported = dropped_total
        if self.args.partial_rollout:  # since the start: completions a pause stopped, and over-stale ones re-sampled
            metrics["partial/completions_stopped_total"] = float(status[:, 5].sum())
            metrics["partial/completions_resampled_total"] = float(status[:, 6].sum())
        for r in range(first, status.shape[0]):
            metrics[f"async/completions_generated/rank{r}"] = float(status[r, 3])
        self.last_plan = plan
        return metrics

    def sync_weights(self, policy_module, round_index: int, needed: bool = True) -> None:
        bucket = self.args.weight_sync_bucket_bytes
        if self.split:  # training rank 0 → generators; the other training ranks only join the gathers
            sender = dist.rank(dist.EVERYONE) == 0
            if sender:
                dist.broadcast_object(needed, src=0, group=dist.WEIGHTS)
            if needed:
                send_weights(
                    named_full_parameters(policy_module, bucket, self.setup.tied),
                    bucket,
                    dist.GroupChannel(dist.WEIGHTS),
                    src=0,
                    sending=sender,
                )
            return
        with self.exchange.paused() as waited:
            super().sync_weights(policy_module, round_index, needed)
            if needed:
                self.worker.version = round_index + 1  # this round's update is what vLLM samples next
        timer = self.setup.timer
        timer.seconds["wait_for_weights"] = timer.seconds.get("wait_for_weights", 0.0) + waited

    def end_round(self, save: bool, stop: bool, preempted: bool) -> None:
        if not self.split:
            return
        # split: the generating ranks follow the trainers' decisions; before a checkpoint they hand over their
        # pools and the claim counters are read while they are held still, so the three agree
        dist.broadcast_object({"save": save, "stop": stop, "preempted": preempted}, src=0, group=dist.EVERYONE)
        if save:
            states = dist.all_gather_object(None, group=dist.EVERYONE)
            self._generators_state = {str(r): s for r, s in enumerate(states) if s is not None}
            self._counters = (self.exchange.counter.add("claimed", 0), self.exchange.counter.add("dropped", 0))
            dist.barrier("the generators' pools are taken; they may sample again", group=dist.EVERYONE)

    def paused(self):
        return self.exchange.paused()

    def check_before_save(self) -> None:
        """A worker that died since the last batch cut took its claimed chunk with it (claimed, never pooled): a
        checkpoint now would record the claim, and the resumed run would wait forever for a round that position
        can never fill. Every rank learns of it here, with its workers paused (no error can arrive meanwhile)."""
        if self.split:  # training ranks have no worker; the generators' errors reach them at the next cut
            return
        w = self.worker
        failed = dist.all_gather(torch.tensor([[float(w is not None and w.error is not None)]]), group=dist.EVERYONE)
        if failed.any():
            self.exchange.raise_worker_error()

    def state_dict(self) -> dict:
        state = self.exchange.state_dict()
        if self.split and dist.is_main():
            if self._counters is not None:
                state["claimed"], state["dropped"] = self._counters
            state["generators"] = self._generators_state
        return state

    def load_state_dict(self, state: Optional[dict]) -> None:
        if not state:  # no file (or a synchronous run's empty state)
            raise CheckpointError(
                "the checkpoint holds no rollout pool for this rank: it was written by a trainer "
                "without an async rollout source. Resume it with the trainer that wrote it."
            )
        self.exchange.load_state_dict(state)

    def without_samples(self, state: Optional[dict]) -> Optional[dict]:
        if not state:
            return state
        if self.split:
            raise CheckpointError(
                "async_placement='split' keeps the generating ranks' pools of the old train "
                "dataset's rows; resume with the checkpoint's train dataset, or with "
                "async_placement='colocate'."
            )
        # every rank's own pool and groups in flight go, and their places are claimed again: a shared counter
        # (rank 0 restores it) learns of every rank's, a rank's own counter of its own
        mine = len(state.get("pool", [])) + len(state.get("in_flight", []))
        every = int(dist.all_reduce_sum(torch.tensor([float(mine)]))[0])
        return {
            **state,
            "pool": [],
            "in_flight": [],
            "dropped": state["dropped"] + (every if self.exchange.counter.shared else mine),
        }

    @classmethod
    def check_world_change(cls, args, path: str, saved_world: int, world: int) -> None:
        if args.async_placement == "split":
            raise CheckpointError(
                f"{path} was written by {saved_world} rank(s) and this run has {world}: "
                "async_placement='split' keeps each generating rank's pool and state by rank number. "
                f"Resume it on {saved_world} rank(s), or continue with async_placement='colocate'."
            )
        if not args.async_load_balancing:
            raise CheckpointError(
                f"{path} was written by {saved_world} rank(s) and this run has {world}: with "
                "async_load_balancing=False each rank's claims follow its fixed share of every round, "
                f"which another number of ranks splits differently. Resume it on {saved_world} "
                "rank(s), or set async_load_balancing=True (the claims are then one shared counter)."
            )

    def reshard_state(self, states, rank: int, world: int) -> dict:
        """The writing ranks' pools dealt out (old rank r's groups go to rank r % world): a paused pool holds exactly
        what was claimed, every group is a whole prompt group with its policy version, and the batch cut moves
        groups between ranks anyway, so none is lost or trained twice. The claim counters are shared (balancing)."""
        if any(not s for s in states):
            raise CheckpointError(
                "the checkpoint lacks a rollout pool of some rank: it was written by a trainer "
                "without an async rollout source. Resume it with the trainer that wrote it."
            )
        mine = [r for r in range(len(states)) if r % world == rank]
        return {
            "pool": [g for r in mine for g in states[r]["pool"]],
            "claimed": states[0]["claimed"],
            "dropped": states[0]["dropped"],
            "completions_generated": sum(states[r]["completions_generated"] for r in mine),
            "in_flight": [g for r in mine for g in states[r].get("in_flight", [])],
        }

    def reshard_note(self, saved_world: int, world: int) -> Optional[str]:
        return (
            f"the {saved_world} ranks' pooled groups are dealt out to {world} (each trained once, with the policy "
            "version that generated it); which rank samples which later group follows the new ranks' speed"
        )

    def close(self) -> None:
        self.exchange.close()
