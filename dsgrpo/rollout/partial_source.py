"""`PartialRolloutSource`: GRPOTrainer's source with `partial_rollout=True` (how it works: rollout/partial.py).

next batch   with nothing in flight and no long tail in the last round (partial_rollout_adaptive): the round's
             groups as one plain batch, as partial_rollout=False samples them. Else restart over-stale
             completions; claim new groups so this rank holds its share + overprovision (+ 0 when the tail
             is gone: the groups in flight drain); step the engine until the share is complete; the rest stop
             and keep their tokens. Either way the round's tail decides whether the next over-provisions.
weight sync  as the synchronous source (nothing is running: the engine is empty between rounds)
checkpoint   each rank's groups in flight with their prefixes, and the stream position"""

from __future__ import annotations

from typing import List, Optional

import torch

from .. import dist
from .partial import (
    InFlight,
    has_long_tail,
    overprovision_per_rank,
    positions_for,
    run_round,
    segment_seed,
    staleness_metrics,
)
from .batch import Batch
from .pool import PromptStream
from .sources import RolloutSetup, RolloutSource, check_on_policy, label_versions, version_metrics


class PartialRolloutSource(RolloutSource):
    def __init__(self, setup: RolloutSetup):
        super().__init__(setup)
        self._claims(setup)
        self.sampling = setup.sampler.sampling
        self.inflight = InFlight(
            self.args.num_generations, self.sampling.max_tokens, turns=setup.sampler.turns(setup.prompts)
        )

    def _claims(self, setup: RolloutSetup) -> None:
        """The prompt stream groups are claimed from, and how many this rank keeps in flight."""
        a, world = self.args, setup.placement.trainers
        self.share = setup.prompts_per_round // world
        self.extra = overprovision_per_rank(a.rollout_overprovision, world)
        self.stream = PromptStream(
            setup.prompts,
            setup.prompts_per_round,
            a.num_generations,
            world,
            a.seed,
            a.shuffle_dataset,
            order_seed=a.order_seed,
        )
        self.next_position: Optional[int] = None  # the stream's next unclaimed position (the same on every rank)
        self.resumed_note: Optional[str] = None
        self.last_positions: List[int] = []
        # adaptive: the first round is a plain batch that measures the tail; each round decides the next's
        self.overprovisioning = not a.partial_rollout_adaptive
        if self.extra > self.share * max(1, a.max_staleness) and dist.is_main():
            # a carried group must be trained within max_staleness rounds, and a round trains `share` of them
            print(
                f"dsgrpo: note: rollout_overprovision={a.rollout_overprovision} keeps {self.extra} groups per rank "
                f"in flight beyond a round's {self.share}; with max_staleness={a.max_staleness} some will be "
                f"over-stale before a round can train them and are sampled again (work lost). Keep it at most "
                f"{self.share * max(1, a.max_staleness) * world} or raise max_staleness.",
                flush=True,
            )

    @classmethod
    def check(
        cls, args, *, placement, prompts_per_round: int, reward_models: bool, evaluates: bool, streaming: bool = False
    ) -> None:
        if streaming:
            raise ValueError(
                "partial_rollout=True hands prompt groups out by stream position, so it needs a map-style "
                "datasets.Dataset, not an IterableDataset. Load it without streaming, or set "
                "partial_rollout=False."
            )
        if prompts_per_round % placement.trainers:
            raise ValueError(
                f"partial_rollout=True keeps whole prompt groups on each rank, but a round has "
                f"{prompts_per_round} prompts for {placement.trainers} ranks. Make generation batch / "
                f"num_generations (= {prompts_per_round}) a multiple of {placement.trainers}."
            )

    def _prompt_ids(self, index: int) -> List[int]:
        return self.setup.prompts.prompt_ids[index]

    # ---- the round
    def next_batch(self, round_index: int) -> Batch:
        a, generator = self.args, self.setup.generator
        version = int(generator.weight_version)
        if self.next_position is None:  # a fresh run, or one resumed from a checkpoint without partial rollouts
            self.next_position = round_index * self.stream.P
        if not self.overprovisioning and not self._holds_groups():
            batch, ranks = self._plain_round(version)
        else:
            batch, ranks = self._partial_round(version, self.extra if self.overprovisioning else 0)
        tail = has_long_tail(int(ranks[:, 0].max()), int(ranks[:, 1].sum()), int(ranks[:, 2].sum()))
        batch.metrics.update({"partial/long_tail": float(tail), "partial/overprovisioned": float(ranks[0, 3] > 0)})
        if a.partial_rollout_adaptive:  # the same decision on every rank: the figures are over all of them
            self.overprovisioning = tail
        return batch

    def _holds_groups(self) -> bool:
        return bool(self.inflight.groups)

    @staticmethod
    def _lengths(rollout, running: List[int], extra: int) -> torch.Tensor:
        """[longest (those still running count at their length so far), trained tokens, trained completions,
        groups over-provisioned] of this rank, for the all-gather that decides the next round."""
        lengths = [len(c) for c in rollout.completion_ids]
        return torch.tensor(
            [[max(lengths + running, default=0), sum(lengths), len(lengths), extra]], dtype=torch.float64
        )

    def _plain_round(self, version: int):
        """Nothing in flight and no tail seen: the round's groups as one batch through the sampler, exactly what
        partial_rollout=False samples for them (same prompts, same seeds); the stream moves on by one round. One
        collective (the lengths), as a plain round has none of the partial one's counts to agree."""
        a, G = self.args, self.stream.G
        positions = positions_for([self.share] * self.setup.placement.trainers, self.next_position, dist.rank())
        self.next_position += self.stream.P
        indices = [self.stream.prompt_index(p) for p in positions]
        rollout = self.setup.sampler.sample(
            self.setup.prompts,
            indices,
            [G] * len(indices),
            [segment_seed(a.seed, p, self.stream.P, G) for p in positions],
        )
        label_versions(rollout, version)
        self.last_positions = positions
        self.setup.generator.end_generation()
        check_on_policy(rollout, version)
        batch = self.setup.build_batch(self.setup.prompts, indices, [G] * len(indices), rollout)
        ranks = dist.all_gather(self._lengths(rollout, [], 0))
        batch.metrics.update(version_metrics(rollout))
        batch.metrics.update(self._tool_metrics(batch))
        batch.metrics.update({f"partial/staleness/{age}": float(age == 0) for age in range(a.max_staleness + 1)})
        batch.metrics.update(
            {
                f"partial/{k}": 0.0
                for k in (
                    "mixed_version_completions",
                    "completions_stopped",
                    "completions_resampled",
                    "tokens_discarded",
                    "groups_carried_in",
                    "groups_in_flight",
                    "groups_trained_carried",
                )
            }
        )
        batch.metrics["partial/tokens_sampled"] = float(ranks[:, 1].sum())
        return batch, ranks

    def _partial_round(self, version: int, extra: int):
        """Claim new groups up to this rank's share + `extra`, step the engine until the share is complete (and the
        groups the next round could no longer train), stop the rest: they keep their tokens for the next round."""
        a, generator = self.args, self.setup.generator
        restarted, discarded = self.inflight.restart_stale(version, a.max_staleness)
        want = max(0, self.share + extra - len(self.inflight))
        held_tokens = sum(len(c.tokens) for g in self.inflight.groups.values() for c in g.members)
        if self.resumed_note is not None:  # (episodes started again from reset had these, before the checkpoint)
            held_tokens += self.inflight.rerun_tokens
        needs = dist.all_gather_object((want, len(self.inflight), held_tokens))
        if self.resumed_note is not None:
            if dist.is_main():
                groups, tokens = sum(n[1] for n in needs), sum(n[2] for n in needs)
                print(
                    f"dsgrpo: resumed {groups} prompt group(s) in flight ({tokens} tokens sampled before the "
                    f"checkpoint): {self.resumed_note}",
                    flush=True,
                )
            self.resumed_note = None
        for position in positions_for([n[0] for n in needs], self.next_position, dist.rank()):
            self.inflight.add(
                position,
                self.stream.prompt_index(position),
                segment_seed(a.seed, position, self.stream.P, self.stream.G),
            )
        self.next_position += sum(n[0] for n in needs)
        carried = sum(1 for g in self.inflight.groups.values() if g.carried)
        counts = run_round(
            generator, self.inflight, self._prompt_ids, self.sampling, self.share, version, a.max_staleness
        )
        groups = self.inflight.take(self.share)
        self.last_positions = [g.position for g in groups]  # the stream positions this round trains
        generator.end_generation()  # sleep mode: nothing runs until the next round
        rollout = self.inflight.rollout(groups, self._prompt_ids)
        batch = self.setup.build_batch(
            self.setup.prompts, [g.prompt_index for g in groups], [len(g.members) for g in groups], rollout
        )
        self._add_metrics(
            batch,
            rollout,
            version,
            [
                counts["stopped"],
                counts["sampled"],
                restarted,
                discarded,
                carried,
                len(self.inflight),
                sum(1 for g in groups if g.carried),
            ],
        )
        running = [len(c.tokens) for g in self.inflight.groups.values() for c in g.members if not c.finished]
        return batch, dist.all_gather(self._lengths(rollout, running, extra))

    def _add_metrics(self, batch: Batch, rollout, version: int, counts: List[float]) -> None:
        a = self.args
        batch.metrics.update(version_metrics(rollout))
        batch.metrics.update(self._tool_metrics(batch))
        tokens = sum(len(c) for c in rollout.completion_ids)
        mine = staleness_metrics(rollout, version, a.max_staleness)
        batch.metrics.update(dist.reduce_metrics(mine, {k: tokens if "staleness" in k else len(rollout) for k in mine}))
        totals = dist.all_reduce_sum(torch.tensor(counts, dtype=torch.float64)).tolist()
        batch.metrics.update(
            {
                "partial/completions_stopped": totals[0],  # still running when the round was cut: carried over
                "partial/tokens_sampled": totals[1],  # this round, trained now or later
                "partial/completions_resampled": totals[2],  # over-stale: sampled again from the start
                "partial/tokens_discarded": totals[3],
                "partial/groups_carried_in": totals[4],  # groups that had run in an earlier round
                "partial/groups_in_flight": totals[5],  # after the cut
                "partial/groups_trained_carried": totals[6],
            }
        )

    # ---- checkpoints
    def state_dict(self) -> dict:
        return {
            "partial_rollout": {
                "next_position": self.next_position,
                "in_flight": self.inflight.state(),
                "overprovisioning": self.overprovisioning,
            }
        }

    def load_state_dict(self, state: Optional[dict]) -> None:
        mine = (state or {}).get("partial_rollout")
        if mine is None:  # written with partial_rollout=False: nothing was in flight; the stream goes on at the round
            return
        self.next_position = int(mine["next_position"])
        self.inflight.load(mine["in_flight"])
        self.overprovisioning = bool(mine.get("overprovisioning", True)) or not self.args.partial_rollout_adaptive
        self.resumed_note = (
            "they continue from their prefixes (their old tokens keep their versions; "
            "max_staleness re-samples the ones too old)"
        )
        if self.inflight.turns is not None and self.inflight.turns.stateful:
            self.resumed_note = (
                "they act on environments, which a checkpoint cannot hold: each episode starts again "
                "from reset (the tokens above are sampled again)"
            )

    def without_samples(self, state: Optional[dict]) -> Optional[dict]:
        if state and "partial_rollout" in state:
            state = {"partial_rollout": {**state["partial_rollout"], "in_flight": []}}
        return state

    def reshard_state(self, states, rank: int, world: int) -> dict:
        """The writing ranks' groups in flight dealt out (old rank r's go to rank r % world): each is a whole group
        with its prefixes and their versions, so none is lost or sampled twice; the stream position is shared."""
        if any(not s or "partial_rollout" not in s for s in states):  # written without partial rollouts
            return {}
        mine = [r for r in range(len(states)) if r % world == rank]
        return {
            "partial_rollout": {
                "next_position": states[0]["partial_rollout"]["next_position"],
                "overprovisioning": states[0]["partial_rollout"].get("overprovisioning", True),
                "in_flight": [g for r in mine for g in states[r]["partial_rollout"]["in_flight"]],
            }
        }

    def reshard_note(self, saved_world: int, world: int) -> Optional[str]:
        return (
            f"the {saved_world} ranks' prompt groups in flight are dealt out to {world} (each continued from its "
            "prefix, none sampled twice)"
        )
