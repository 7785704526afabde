"""`AgentPartialSource`: partial rollouts for agents that run their own loop (`agent_rollout` with
partial_rollout=True on GRPOTrainer). An agent's episode is user code waiting on the policy's endpoint, so it is
not cut token by token as PartialRolloutSource cuts completions: it is paused between its calls.

    a round     claim new prompt groups up to this rank's share + over-provision (stream positions dealt in rank
                order, as PartialRolloutSource deals them) and start each group's G episodes in the agent's own
                background loop; serve their calls until `share` groups have finished every episode; pause the
                endpoint (a call under way finishes, the others wait); train the share, the groups carried longest
                first. The other episodes stay where they are: their waiting calls are generated after the weight
                sync, with the new weights, and every token keeps the version it was sampled with.
    staleness   an episode holding a token more than max_staleness versions old is cancelled and run again.
    checkpoint  the stream position and the positions in flight: an agent's loop cannot be saved, so a resumed run
                runs those groups' episodes again from their start (said once)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .. import dist
from .agents import AgentRollout
from .partial import positions_for
from .partial_source import PartialRolloutSource
from .sources import RolloutSetup, RolloutSource

WAIT_S = 0.02  # how often a round looks at its episodes


@dataclass
class AgentGroup:
    position: int  # place in the prompt stream: the group's id
    prompt_index: int  # dataset row
    rows: List[dict]  # what each episode's agent gets (the row, once per member)
    runs: List[Tuple[str, Future]] = field(default_factory=list)  # (episode id, its future) per member
    carried: int = 0  # rounds it was carried over unfinished

    def complete(self) -> bool:
        return all(future.done() for _, future in self.runs)


class AgentPartialSource(PartialRolloutSource):
    def __init__(self, setup: RolloutSetup):
        RolloutSource.__init__(self, setup)  # the token source's stream and claims, not its engine stepping
        self._claims(setup)
        self.agent: AgentRollout = setup.sampler.rollout_func
        self.trainer = setup.sampler.trainer
        self.groups: Dict[int, AgentGroup] = {}
        self.resumed_positions: List[int] = []

    @classmethod
    def check(
        cls, args, *, placement, prompts_per_round: int, reward_models: bool, evaluates: bool, streaming: bool = False
    ) -> None:
        super().check(
            args,
            placement=placement,
            prompts_per_round=prompts_per_round,
            reward_models=reward_models,
            evaluates=evaluates,
            streaming=streaming,
        )
        if args.vllm_tensor_parallel_size > 1:
            raise ValueError(
                "partial_rollout=True with agent_rollout pauses each rank's endpoint on its own, and a "
                "tensor-parallel engine serves several ranks at once: set vllm_tensor_parallel_size=1 "
                "or partial_rollout=False."
            )

    # ---- the round (PartialRolloutSource.next_batch decides the over-provision and reads the tail)
    def _holds_groups(self) -> bool:
        return bool(self.groups)

    def _plain_round(self, version: int):
        return self._partial_round(version, 0)

    def _partial_round(self, version: int, extra: int):
        G, endpoint = self.stream.G, self.agent.serving(self.trainer)
        restarted, discarded = self._restart_stale(version)
        want = max(0, self.share + extra - len(self.groups) - len(self.resumed_positions))
        needs = dist.all_gather_object((want, len(self.groups) + len(self.resumed_positions)))
        if self.resumed_note is not None:
            if dist.is_main():
                print(
                    f"dsgrpo: resumed {sum(n[1] for n in needs)} prompt group(s) in flight: {self.resumed_note}",
                    flush=True,
                )
            self.resumed_note = None
        for position in self.resumed_positions + positions_for([n[0] for n in needs], self.next_position, dist.rank()):
            self._start(position)
        self.resumed_positions = []
        self.next_position += sum(n[0] for n in needs)
        carried = sum(1 for g in self.groups.values() if g.carried)
        endpoint.resume()
        while sum(g.complete() for g in self.groups.values()) < self.share:
            time.sleep(WAIT_S)
        endpoint.pause()  # the trainer's from here until the next round (the weight sync included)
        done = sorted((p for p, g in self.groups.items() if g.complete()), key=lambda p: (-self.groups[p].carried, p))[
            : self.share
        ]
        groups = [self.groups.pop(p) for p in sorted(done)]
        stopped = sum(not f.done() for g in self.groups.values() for _, f in g.runs)
        sampled = sum(
            self._tokens_at(episode_id, version)
            for g in list(self.groups.values()) + groups
            for episode_id, _ in g.runs
        )
        for g in self.groups.values():
            g.carried += 1
        self.last_positions = [g.position for g in groups]
        rows = [row for g in groups for row in g.rows]
        out, versions = self.agent.rows_of(
            self.trainer, rows, [i for g in groups for i, _ in g.runs], [f.result() for g in groups for _, f in g.runs]
        )
        rollout = self.setup.sampler.to_rollout(out, len(rows), self.setup.prompts)
        rollout.weight_versions = versions
        self.setup.generator.end_generation()  # sleep mode: nothing runs until the next round
        batch = self.setup.build_batch(self.setup.prompts, [g.prompt_index for g in groups], [G] * len(groups), rollout)
        self._add_metrics(
            batch,
            rollout,
            version,
            [stopped, sampled, restarted, discarded, carried, len(self.groups), sum(1 for g in groups if g.carried)],
        )
        return batch, dist.all_gather(self._lengths(rollout, [], extra))

    def _start(self, position: int) -> None:
        index, G = self.stream.prompt_index(position), self.stream.G
        prompts, columns = self.setup.prompts.rows_for([index], [G])
        rows = [{"prompt": p, **{c: v[j] for c, v in columns.items()}} for j, p in enumerate(prompts)]
        group = AgentGroup(position, index, rows)
        group.runs = [self.agent.start(self.trainer, row) for row in rows]
        self.groups[position] = group

    def _calls(self, episode_id: str) -> list:
        return self.agent.endpoint.episodes.get(episode_id).calls

    def _tokens_at(self, episode_id: str, version: int) -> int:
        return sum(v == version for call in self._calls(episode_id) for choice in call.choices for v in choice.versions)

    def _restart_stale(self, version: int) -> Tuple[int, int]:
        """Episodes holding a token older than max_staleness versions: cancelled and run again from their start.
        Returns (episodes run again, tokens discarded)."""
        restarted = discarded = 0
        for group in self.groups.values():
            for j, (episode_id, future) in enumerate(group.runs):
                versions = [v for call in self._calls(episode_id) for v in call.sampled.versions]
                if versions and min(versions) < version - self.args.max_staleness:
                    discarded += len(versions)
                    restarted += 1
                    self.agent.discard(episode_id, future)
                    group.runs[j] = self.agent.start(self.trainer, group.rows[j])
        return restarted, discarded

    # ---- checkpoints: positions only (an agent's loop is not state a checkpoint can hold)
    def state_dict(self) -> dict:
        return {
            "agent_partial": {
                "next_position": self.next_position,
                "overprovisioning": self.overprovisioning,
                "in_flight": sorted(self.groups) + self.resumed_positions,
            }
        }

    def load_state_dict(self, state: Optional[dict]) -> None:
        mine = (state or {}).get("agent_partial")
        if mine is None:  # written without agents' partial rollouts: nothing in flight; the stream goes on at the round
            return
        self.next_position = int(mine["next_position"])
        self.overprovisioning = bool(mine.get("overprovisioning", True)) or not self.args.partial_rollout_adaptive
        self.resumed_positions = [int(p) for p in mine["in_flight"]]
        self.resumed_note = (
            "agents run their own loop, which a checkpoint cannot hold: their episodes run again from the start"
        )

    def without_samples(self, state: Optional[dict]) -> Optional[dict]:
        if state and "agent_partial" in state:
            state = {"agent_partial": {**state["agent_partial"], "in_flight": []}}
        return state

    def reshard_state(self, states, rank: int, world: int) -> dict:
        """The writing ranks' positions in flight dealt out (old rank r's go to rank r % world)."""
        if any(not s or "agent_partial" not in s for s in states):
            return {}
        first = states[0]["agent_partial"]
        return {
            "agent_partial": {
                **first,
                "in_flight": [
                    p for r in range(len(states)) if r % world == rank for p in states[r]["agent_partial"]["in_flight"]
                ],
            }
        }

    def reshard_note(self, saved_world: int, world: int) -> Optional[str]:
        return f"the {saved_world} ranks' agent groups in flight are dealt out to {world} and run again"
