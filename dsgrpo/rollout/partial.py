"""Partial rollouts (`partial_rollout=True`): a round ends when enough prompt groups are complete, and the long tail
finishes in the next round on the new weights.

Generation waits for its longest completion: the last few decode alone, at a fraction of the engine's throughput.
Here each rank keeps `rollout_overprovision` more groups in flight than a round trains (its share, rounded up) and
steps the engine itself, one completion per request. Once the rank holds its share of complete groups the round's
batch is cut from them (oldest stream position first); the completions still running are stopped, their tokens so
far kept, and after the weight sync they are submitted again as prompt + prefix with the tokens left to go, beside
the next round's new groups. vLLM 0.32's offline engine cannot keep a request's KV blocks across a weight update
(`pause_generation(mode="keep")` lives in its async server), so the prefix is prefilled again with the new weights:
one prefill per carried completion and round, against decoding it alone.

Every token carries the policy version it was sampled with (the engine's version when its segment ran), so a
completion may mix versions. Staleness counts its oldest token: at the start of a round a completion whose oldest
token is more than `max_staleness` versions behind is sampled again from the start (its tokens are never trained).
The trainer corrects the rest with its sampler correction (vllm_importance_sampling_*) and masks tokens whose ratio
π_old / π_sampler leaves `partial_rollout_token_band` (IcePop's band).

With `partial_rollout_adaptive` (the default) the synchronous source over-provisions only while rounds have a long tail
(`has_long_tail`): the first round, and each round after one without a tail, is one plain batch through the sampler
(the same prompts and seeds as partial_rollout=False) once nothing is in flight; groups still in flight when the
tail goes are finished without new over-provisioning first.

With tools or environments a completion is an episode (tools.Episode): each sampled segment that ends with tool
calls has them answered on the spot (`InFlight.record`) and is submitted again with the tool turn's tokens, so a
round can cut an episode anywhere; its environment stays with it across rounds, and a resumed run starts episodes
that act on environments again from reset (a checkpoint cannot hold an environment).

Groups are identified by their position in the prompt stream (pool.PromptStream: the synchronous trainer's prompt
order). New positions are handed out in rank order from one counter every rank keeps the same, so a position is
sampled by one rank and trained once; a checkpoint keeps each rank's groups in flight with their prefixes."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

from .base import Rollout, round_seed
from .tools import Episode, SegmentTurns

SEGMENT_SEED_STRIDE = 7_919  # a continuation samples from its own seed (the first segment's + stride · segment)
# A round "has a long tail" when its longest completion is at least TAIL_RATIO x the mean length and TAIL_MIN_TOKENS
# beyond it: then at least half the engine's decode slots idle while the last completions run, which over-provisioning
# turns into new work. Below it (e.g. answers of 4-8 tokens) a cut saves a few decode steps and costs a re-prefill
# per carried completion, stepping the engine request by request and tokens one version old.
TAIL_RATIO = 2.0
TAIL_MIN_TOKENS = 16


@dataclass
class Completion(Episode):
    """One completion of a group, sampled in one or more segments (a segment per round it ran in, and with tools
    one per turn: tools.Episode holds its tokens, tool turns and conversation)."""

    member: int = 0
    seed: int = 0
    versions: List[int] = field(default_factory=list)
    segments: int = 0  # submissions so far (the next one's seed)
    finished: bool = False
    restarts: int = 0  # times it was sampled again from the start (over-stale)

    def oldest(self) -> Optional[int]:
        return min(self.versions) if self.versions else None

    def restart(self) -> int:
        """Forget the tokens (over-stale); returns how many were discarded."""
        dropped = len(self.tokens)
        self.restart_turns()
        self.versions, self.finished = [], False
        self.restarts += 1
        return dropped

    def to_json(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "routes"}
        if all(self.mask):  # every token sampled (no tool turn): from_json restores the mask from the tokens
            del out["mask"]
        return out


@dataclass
class InFlightGroup:
    position: int  # place in the prompt stream: the group's id
    prompt_index: int  # dataset row
    members: List[Completion]
    carried: int = 0  # rounds it was carried over unfinished

    def complete(self) -> bool:
        return all(c.finished for c in self.members)

    def to_json(self) -> dict:
        return {
            "position": self.position,
            "prompt_index": self.prompt_index,
            "carried": self.carried,
            "members": [c.to_json() for c in self.members],
        }

    @classmethod
    def from_json(cls, d: dict) -> "InFlightGroup":
        members = []
        for c in d["members"]:
            c = dict(c)
            if not c.get("mask") and c.get("tokens"):  # written before tool turns: every token was sampled
                c["mask"] = [1] * len(c["tokens"])
            members.append(Completion(**c))
        return cls(d["position"], d["prompt_index"], members, d.get("carried", 0))


def request_id(position: int, member: int, segment: int) -> str:
    return f"p{position}m{member}s{segment}"


def parse_request_id(rid: str) -> Tuple[int, int]:
    position, rest = rid[1:].split("m")
    return int(position), int(rest.split("s")[0])


def positions_for(needs: List[int], next_position: int, rank: int) -> List[int]:
    """New stream positions for `rank` when every rank asks for needs[r] in rank order from `next_position`."""
    start = next_position + sum(needs[:rank])
    return list(range(start, start + needs[rank]))


class InFlight:
    """One rank's groups being sampled (pure bookkeeping: the engine is driven by `run_round`).

    With `turns` (tools or environments: tools.SegmentTurns) a completion is an episode of several sampled segments:
    when one ends, its tool calls are answered (`record`) and it is submitted again as prompt + everything so far,
    in this round or, cut by the round's end, after the sync. Each episode keeps its runner and environment here
    (`live`) for as long as it is in flight, across rounds; a checkpoint cannot hold an environment, so a resumed
    run re-runs the episodes it had in flight from reset (`rerun_from_reset`)."""

    def __init__(self, num_generations: int, max_tokens: int, turns: Optional[SegmentTurns] = None):
        self.G, self.max_tokens, self.turns = num_generations, max_tokens, turns
        self.groups: Dict[int, InFlightGroup] = {}
        self.live: Dict[Tuple[int, int], Tuple[object, object]] = {}  # (position, member) -> (runner, environment)
        self.rerun_from_reset = 0  # episodes a resume started again from reset, and the tokens they had
        self.rerun_tokens = 0

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, position: int, prompt_index: int, first_seed: int) -> None:
        """A new group: G completions, member j seeded as the synchronous trainer seeds slot j of its run."""
        group = InFlightGroup(
            position, prompt_index, [Completion(member=j, seed=(first_seed + j) % (2**31 - 1)) for j in range(self.G)]
        )
        self.groups[position] = group
        for c in group.members:
            self._open(group, c)

    def _open(self, group: InFlightGroup, c: Completion, instance=None) -> None:
        """An episode's prompt (reset() may add to it), runner and environment."""
        if self.turns is not None:
            prompt, runner, instance = self.turns.open(group.prompt_index, instance)
            c.prompt = list(prompt)
            failed = self.turns.start_failure(instance)
            if failed is not None:  # its environment did not start: env/errors or env/timeouts, the episode runs on
                c.counts[failed] = c.counts.get(failed, 0) + 1
            self.live[(group.position, c.member)] = (runner, instance)

    def prompt_of(self, position: int, member: int, prompt_ids) -> List[int]:
        """The prompt completion `member` of group `position` answers: its own (an environment's reset may add to
        it), else its dataset row's."""
        group = self.groups[position]
        return group.members[member].prompt or list(prompt_ids(group.prompt_index))

    def restart_stale(self, version: int, max_staleness: int) -> Tuple[int, int]:
        """Sample again from the start every completion whose oldest token is more than `max_staleness` versions
        behind `version` (an environment's episode from its reset). Returns (completions restarted, tokens
        discarded)."""
        restarted = tokens = 0
        for group in self.groups.values():
            for c in group.members:
                oldest = c.oldest()
                if oldest is not None and version - oldest > max_staleness:
                    tokens += c.restart()
                    restarted += 1
                    if self.turns is not None and self.turns.stateful:
                        self._open(group, c, self.live[(group.position, c.member)][1])
        return restarted, tokens

    def at_risk(self, version: int, max_staleness: int) -> List[int]:
        """Groups that must complete in the round sampling `version`: a token of theirs would be over-stale in the
        next one (it would be sampled again from the start, its work lost)."""
        return sorted(
            p
            for p, g in self.groups.items()
            if any(c.oldest() is not None and c.oldest() <= version - max_staleness for c in g.members)
        )

    def requests(self, skip=()) -> List[Tuple[str, List[int], int, int]]:
        """(request id, tokens so far, tokens left, seed) of every unfinished completion, oldest group first (but
        those whose current request id is in `skip`: already running)."""
        out = []
        for position in sorted(self.groups):
            for c in self.groups[position].members:
                if not c.finished and (not skip or request_id(position, c.member, c.segments - 1) not in skip):
                    seed = (c.seed + SEGMENT_SEED_STRIDE * c.segments) % (2**31 - 1)
                    out.append(
                        (request_id(position, c.member, c.segments), c.tokens, self.max_tokens - len(c.tokens), seed)
                    )
                    c.segments += 1
        return out

    def record(
        self, rid: str, tokens: List[int], logprobs: List[float], finished: bool, truncated: bool, version: int
    ) -> None:
        """A request's new tokens, sampled on `version`. A completion that ended a turn with tool calls has them
        answered here and goes on in a new request (it stays unfinished)."""
        position, member = parse_request_id(rid)
        c = self.groups[position].members[member]
        c.append(list(tokens), list(logprobs))
        c.versions.extend([version] * len(tokens))
        if not finished:
            return
        c.finished, c.truncated = True, truncated
        if self.turns is not None:
            c.finished = not self.turns.after_segment(c, self.live[(position, member)][0], self.max_tokens)
            # the tool turn's tokens (outside the loss) carry the version that answered them; a cut drops some
            del c.versions[len(c.tokens) :]
            c.versions.extend([version] * (len(c.tokens) - len(c.versions)))

    def complete(self) -> List[int]:
        return sorted(p for p, g in self.groups.items() if g.complete())

    def take(self, n: int) -> List[InFlightGroup]:
        """n complete groups out of flight: those with the oldest tokens first (the next round could no longer train
        them), then by stream position."""

        def age(p):
            oldest = [c.oldest() for c in self.groups[p].members if c.oldest() is not None]
            return (min(oldest) if oldest else float("inf"), p)

        chosen = sorted(self.complete(), key=age)[:n]
        return [self.groups.pop(p) for p in sorted(chosen)]

    def rollout(self, groups: List[InFlightGroup], prompt_ids) -> Rollout:
        """Taken groups as rows (as_rollout), with their tool turns and environments: the episodes leave flight."""
        rollout = as_rollout(groups, prompt_ids)
        if self.turns is None:
            return rollout
        members = [c for g in groups for c in g.members]
        rollout.tool_mask = [list(c.mask) for c in members]
        rollout.messages = [list(c.messages) for c in members]
        rollout.tool_counts = [c.tool_counts() for c in members]
        instances = [self.live.pop((g.position, c.member))[1] for g in groups for c in g.members]
        if self.turns.stateful:
            rollout.columns = {"environments": instances}
            self.turns.handed(instances)
        return rollout

    def end_round(self) -> None:
        for group in self.groups.values():
            if not group.complete():
                group.carried += 1

    def state(self) -> List[dict]:
        return [self.groups[p].to_json() for p in sorted(self.groups)]

    def load(self, groups: List[dict]) -> None:
        """Groups a checkpoint held. Episodes that act on environments (which it could not hold) start again from
        reset, finished members too: a group's rewards come from its environments' state."""
        self.groups = {g["position"]: InFlightGroup.from_json(g) for g in groups}
        self.live = {}
        for group in self.groups.values():
            for c in group.members:
                if self.turns is not None and self.turns.stateful:
                    self.rerun_tokens += c.restart()
                    self.rerun_from_reset += 1
                self._open(group, c)


def run_round(
    engine, inflight: InFlight, prompt_ids, sampling, need: int, version: int, max_staleness: Optional[int] = None
) -> dict:
    """Submit every unfinished completion (prompt + its tokens so far), step the engine until `need` groups are
    complete (or nothing runs), then stop the rest: their tokens stay in `inflight` for the next round. With
    `max_staleness`, the round also waits for the groups that would be over-stale in the next one (the sampler is
    paced rather than their work discarded). Returns counts for the metrics."""
    must = set(inflight.at_risk(version, max_staleness)) if max_staleness is not None else set()

    def done() -> bool:
        complete = inflight.complete()
        return len(complete) >= need and must <= set(complete)

    running = set()

    def submit() -> int:
        """Every unfinished completion not running (all at the start; then the continuations after tool turns)."""
        new = inflight.requests(skip=running)
        for rid, prefix, left, seed in new:
            position, member = parse_request_id(rid)
            engine.submit(rid, inflight.prompt_of(position, member, prompt_ids) + list(prefix), sampling, left, seed)
            running.add(rid)
        return len(new)

    # groups finished beyond the last round's need may already fill this one: then nothing is submitted
    submitted = submit() if not done() else 0
    sampled = 0
    while running and not done():
        for rid, tokens, logprobs, finished, truncated in engine.advance():
            inflight.record(rid, tokens, logprobs, finished, truncated, version)
            sampled += len(tokens)
            if finished:
                running.discard(rid)
        if not done():
            submitted += submit()
        if running and not engine.unfinished():  # the engine lost requests it was given
            raise RuntimeError(
                f"the generation engine holds none of the {len(running)} completions it was given "
                f"(e.g. {sorted(running)[:3]}): they were never finished nor stopped."
            )
    engine.abort(sorted(running))
    inflight.end_round()
    return {"submitted": submitted, "stopped": len(running), "sampled": sampled, "waited_for": len(must)}


def as_rollout(groups: List[InFlightGroup], prompt_ids) -> Rollout:
    """The groups' completions as rows (group by group, member order), with each token's policy version."""
    rollout = Rollout([], [], [], [])
    rollout.weight_versions = []
    for g in groups:
        for c in g.members:
            rollout.prompt_ids.append(list(c.prompt) if c.prompt else list(prompt_ids(g.prompt_index)))
            rollout.completion_ids.append(list(c.tokens))
            rollout.sampler_logprobs.append(list(c.logprobs))
            rollout.truncated.append(c.truncated)
            rollout.weight_versions.append(list(c.versions))
    return rollout


def staleness_metrics(rollout: Rollout, version: int, max_age: int) -> Dict[str, float]:
    """partial/staleness/{0..max_age}: the share of the batch's completion tokens sampled that many versions before
    the policy they train (the histogram), and partial/mixed_version_completions: the share of completions whose
    tokens come from more than one version."""
    ages = [version - v for row in rollout.weight_versions or [] for v in row]
    out: Dict[str, float] = {}
    if ages:
        for age in range(max_age + 1):
            out[f"partial/staleness/{age}"] = sum(1 for a in ages if a == age) / len(ages)
    rows = rollout.weight_versions or []
    if rows:
        out["partial/mixed_version_completions"] = sum(1 for r in rows if len(set(r)) > 1) / len(rows)
    return out


def has_long_tail(longest: int, total_tokens: int, completions: int) -> bool:
    """Whether a round of `completions` completions (over all ranks), `total_tokens` tokens in all, the longest at
    least `longest` tokens, waited on a tail worth cutting (TAIL_RATIO, TAIL_MIN_TOKENS)."""
    if completions <= 0:
        return False
    mean = total_tokens / completions
    return longest >= TAIL_RATIO * mean and longest - mean >= TAIL_MIN_TOKENS


def overprovision_per_rank(overprovision: int, world: int) -> int:
    return math.ceil(overprovision / max(1, world))


def segment_seed(seed: int, position: int, prompts_per_round: int, num_generations: int) -> int:
    round_index, j = divmod(position, prompts_per_round)
    return round_seed(seed, round_index, j * num_generations)
