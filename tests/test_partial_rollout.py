"""Partial rollouts' pure parts (rollout/partial.py): the bookkeeping of groups in flight, the round driver against a
scripted engine, the staleness histogram, IcePop's token band in the loss, resharding, and the config's refusals."""

import pytest
import torch

from dsgrpo import GRPOConfig
from dsgrpo.algorithms.policy_loss import policy_loss, token_band_mask
from dsgrpo.rollout.base import Rollout
from dsgrpo.rollout.partial import (
    InFlight,
    as_rollout,
    parse_request_id,
    positions_for,
    request_id,
    run_round,
    staleness_metrics,
    SEGMENT_SEED_STRIDE,
)
from dsgrpo.rollout.partial_source import PartialRolloutSource


class ScriptedEngine:
    """Each request emits its script's tokens one per step and finishes when the script ends (a stop token)."""

    def __init__(self, scripts):
        self.scripts, self.queue, self.submitted, self.aborted = scripts, {}, [], []

    def submit(self, rid, prompt_ids, sampling, max_tokens, seed):
        position, member = parse_request_id(rid)
        self.submitted.append((rid, list(prompt_ids), max_tokens, seed))
        done = len(prompt_ids) - 1  # prompts are one token long here: the rest is the prefix
        self.queue[rid] = list(self.scripts[(position, member)][done:])[:max_tokens]

    def advance(self):
        out = []
        for rid in list(self.queue):
            left = self.queue[rid]
            token = left.pop(0)
            finished = not left
            out.append((rid, [token], [-0.5], finished, False))
            if finished:
                del self.queue[rid]
        return out

    def unfinished(self):
        return len(self.queue)

    def abort(self, ids):
        self.aborted.extend(ids)
        for rid in ids:
            self.queue.pop(rid, None)


def test_a_round_ends_when_its_share_is_complete_and_the_tail_continues_from_its_prefix():
    G, L = 2, 10
    scripts = {(0, 0): [1] * 2, (0, 1): [1] * 3, (1, 0): [2] * 9, (1, 1): [2] * 2, (2, 0): [3] * 4, (2, 1): [3] * 1}
    engine, flight = ScriptedEngine(scripts), InFlight(G, L)
    for p in range(3):
        flight.add(p, prompt_index=p, first_seed=100 * p)
    counts = run_round(engine, flight, lambda i: [50 + i], None, need=2, version=0)
    # groups 0 (3 steps) and 2 (4 steps) are complete after 4 steps; group 1's long member was stopped at 4 tokens
    assert flight.complete() == [0, 2] and counts["stopped"] == 1 and counts["sampled"] == 2 + 3 + 4 + 2 + 4 + 1
    taken = flight.take(2)
    assert [g.position for g in taken] == [0, 2] and list(flight.groups) == [1]
    carried = flight.groups[1]
    assert carried.members[0].tokens == [2] * 4 and carried.members[1].finished and carried.carried == 1
    # next round, on version 1: only the unfinished member is submitted, as prompt + prefix, with what is left
    flight.add(3, prompt_index=3, first_seed=300)
    scripts.update({(3, 0): [4] * 2, (3, 1): [4] * 2})
    run_round(engine, flight, lambda i: [50 + i], None, need=2, version=1)
    rid, prompt, left, seed = next(s for s in engine.submitted if s[0].startswith("p1m0s1"))
    assert prompt == [51] + [2] * 4 and left == L - 4 and seed == 100 + SEGMENT_SEED_STRIDE
    groups = flight.take(2)
    rollout = as_rollout(groups, lambda i: [50 + i])
    first = [g.position for g in groups].index(1) * G
    assert rollout.completion_ids[first] == [2] * 9
    assert rollout.weight_versions[first] == [0] * 4 + [1] * 5  # every token labelled with its segment's version
    assert rollout.weight_versions[first + 1] == [0, 0]


def test_over_stale_completions_are_sampled_again_from_the_start():
    flight = InFlight(2, 8)
    flight.add(0, 0, 0)
    flight.record(request_id(0, 0, 0), [5, 6], [-1.0, -1.0], False, False, version=3)
    flight.record(request_id(0, 1, 0), [7], [-1.0], True, False, version=4)
    assert flight.restart_stale(version=5, max_staleness=1) == (1, 2)  # member 0 (v3) is 2 behind; member 1 is not
    m0, m1 = flight.groups[0].members
    assert m0.tokens == [] and m0.restarts == 1 and not m0.finished
    assert m1.tokens == [7] and m1.finished
    assert flight.restart_stale(version=6, max_staleness=1) == (1, 1)  # now member 1 (v4), finished, too


def test_positions_are_dealt_in_rank_order_from_one_counter():
    assert positions_for([2, 0, 3], 10, 0) == [10, 11]
    assert positions_for([2, 0, 3], 10, 1) == []
    assert positions_for([2, 0, 3], 10, 2) == [12, 13, 14]
    assert parse_request_id(request_id(123, 7, 4)) == (123, 7)


def test_in_flight_state_round_trips_and_reshards_without_loss_or_duplicates():
    flight = InFlight(2, 8)
    for p in (4, 9):
        flight.add(p, p, p)
    flight.record(request_id(9, 1, 0), [3, 4], [-0.1, -0.2], False, False, version=2)
    copy = InFlight(2, 8)
    copy.load(flight.state())
    assert copy.state() == flight.state()
    # a completion without tool turns is written without its mask (all ones) and read back with it
    assert "mask" not in flight.state()[1]["members"][1] and copy.groups[9].members[1].mask == [1, 1]
    states = [{"partial_rollout": {"next_position": 12, "in_flight": [g]}} for g in flight.state()] + [
        {"partial_rollout": {"next_position": 12, "in_flight": []}}
    ]
    source = PartialRolloutSource.__new__(PartialRolloutSource)
    dealt = [source.reshard_state(states, rank, 2)["partial_rollout"] for rank in range(2)]
    assert [g["position"] for d in dealt for g in d["in_flight"]] == [4, 9]
    assert all(d["next_position"] == 12 for d in dealt)
    assert source.reshard_state([{}, {}], 0, 1) == {}  # written without partial rollouts: nothing in flight


def test_the_staleness_histogram_counts_tokens_by_age():
    r = Rollout([[1], [1]], [[5, 6, 7], [8]], [[0.0] * 3, [0.0]], [False, False])
    r.weight_versions = [[2, 3, 3], [3]]
    m = staleness_metrics(r, version=3, max_age=1)
    assert m == {"partial/staleness/0": 0.75, "partial/staleness/1": 0.25, "partial/mixed_version_completions": 0.5}
    t = r.tensors(0)
    assert t["token_versions"].tolist() == [[2, 3, 3], [3, -1, -1]]


def test_the_token_band_drops_tokens_whose_ratio_leaves_it_from_the_policy_term():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    sampler = torch.log(torch.tensor([[0.5, 2.0, 0.05, 0.9]]))  # ratios 1, 0.25, 10, 0.56
    assert token_band_mask(old, sampler, (0.5, 5.0)).tolist() == [[1.0, 0.0, 0.0, 1.0]]
    logps = old.clone().requires_grad_(True)
    mask = torch.ones(1, 4)
    loss, metrics = policy_loss(
        logps, None, torch.tensor([1.0]), mask, loss_type="dapo", sampler_per_token_logps=sampler, token_band=(0.5, 5.0)
    )
    loss.backward()
    assert logps.grad[0, 1] == 0 and logps.grad[0, 2] == 0 and logps.grad[0, 0] != 0 and logps.grad[0, 3] != 0
    assert float(metrics["sampling/token_band_masked"]) == pytest.approx(0.5)


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(partial_rollout=True, vllm_mode="server"), "vllm_mode='colocate'"),
        (dict(partial_rollout=True, use_vllm=False), "use_vllm=True"),
        (dict(partial_rollout=True, vllm_tensor_parallel_size=2), "vllm_tensor_parallel_size=1"),
        (dict(partial_rollout=True, num_iterations=2), "num_iterations=1"),
        (dict(partial_rollout=True, partial_rollout_token_band=[2.0, 5.0]), "partial_rollout_token_band"),
        (dict(rollout_overprovision=-1), "rollout_overprovision"),
    ],
)
def test_settings_partial_rollouts_cannot_serve_are_refused_naming_the_field(tmp_path, kw, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace("[", r"\[")):
        GRPOConfig(output_dir=str(tmp_path), report_to="none", **kw).validate(world_size=2)


def test_a_round_waits_for_the_groups_the_next_one_could_no_longer_train():
    G, L = 2, 20
    scripts = {(0, 0): [1] * 8, (0, 1): [1] * 2, (1, 0): [2] * 2, (1, 1): [2] * 2}
    engine, flight = ScriptedEngine(scripts), InFlight(G, L)
    flight.add(0, 0, 0)
    flight.record(request_id(0, 0, 0), [1] * 3, [-0.5] * 3, False, False, version=4)  # carried from version 4
    flight.groups[0].members[0].segments = 1
    flight.add(1, 1, 0)
    assert flight.at_risk(version=5, max_staleness=1) == [0] and flight.at_risk(version=5, max_staleness=2) == []
    # need 1: group 1 is complete after 2 steps, but group 0's tokens would be 2 versions old next round: it is waited
    # for (5 more tokens), and taken first
    counts = run_round(engine, flight, lambda i: [50 + i], None, need=1, version=5, max_staleness=1)
    assert counts["waited_for"] == 1 and counts["stopped"] == 0 and flight.complete() == [0, 1]
    assert [g.position for g in flight.take(1)] == [0]
    assert flight.restart_stale(version=6, max_staleness=1) == (0, 0)  # nothing was lost


def test_a_long_tail_is_a_longest_completion_twice_the_mean_and_16_tokens_beyond_it():
    from dsgrpo.rollout.partial import has_long_tail

    assert not has_long_tail(8, 4 * 128, 128)  # the demo: 4-token answers, 8 at most: nothing worth cutting
    assert not has_long_tail(20, 8 * 64, 64)  # 2.5x the mean but only 12 tokens beyond it
    assert has_long_tail(512, 74 * 16, 16)  # the long-tailed workload: mean 74, one at the cap
    assert not has_long_tail(120, 70 * 16, 16)  # 1.7x: most slots stay busy to the end
    assert has_long_tail(140, 70 * 16, 16)  # exactly 2x and 70 beyond
    assert not has_long_tail(0, 0, 0)  # nothing sampled (a rank with an empty share)
