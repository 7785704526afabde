"""The asynchronous trainer's pure parts (rollout/pool.py, and rollout/worker.py without its thread): the prompt
stream against the synchronous trainer's layout, the batch cut, the pool and its checkpoint form, the zero-std
test, the claim counter and the worker's claim and chunk rules. No process group, no engine: fast."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsgrpo.algorithms import compute_advantages
from dsgrpo.data import PromptSource
from dsgrpo.rollout.base import Rollout, round_seed
from dsgrpo.algorithms import zero_std_groups
from dsgrpo.rollout.pool import ClaimCounter, Group, GroupPool, PromptStream, plan_batch
from dsgrpo.rollout.samplers import GeneratorSampler
from dsgrpo.rollout.worker import RolloutWorker, as_rollout_rows

NAN = float("nan")


class ToySource(PromptSource):
    """PromptSource's own ordering code (order, round_prompts, rank_slice) over n rows, without a dataset or a
    tokenizer (building the tiny tokenizer costs seconds)."""

    def __init__(self, n: int):
        self.dataset = range(n)
        self._orders = {}
        self.prompt_ids = [[100 + i] for i in range(n)]


# --------------------------------------------------------------------------------------- the prompt stream
# (n rows, P prompts per round, G, world): every P is a multiple of world, so no group straddles two ranks.
# n=1 repeats one prompt (rank_slice must still cut runs at group boundaries); n < P wraps epochs inside a round.
LAYOUTS = [(1, 2, 3, 2), (5, 4, 2, 2), (7, 6, 4, 3), (13, 8, 1, 4), (3, 4, 4, 1), (6, 4, 2, 4), (10, 6, 2, 2)]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("n,P,G,world", LAYOUTS)
def test_stream_is_the_synchronous_trainers_layout(n, P, G, world, shuffle):
    seed = 7
    source = ToySource(n)
    stream = PromptStream(source, P, G, world, seed, shuffle)
    per_rank = P // world
    assert stream.per_rank == per_rank
    rounds = 2 * n // P + 3  # several epochs
    for rnd in range(rounds):
        prompts = source.round_prompts(rnd, P, seed, shuffle)
        assert [stream.prompt_index(rnd * P + j) for j in range(P)] == prompts
        for r in range(world):
            share = PromptSource.rank_slice(prompts, G, r, world)  # what GRPOTrainer._sample gives rank r
            assert share.counts == [G] * per_rank  # whole groups: one prompt run per group
            sync_seeds = [round_seed(seed, rnd, share.first_slot + sum(share.counts[:j])) for j in range(per_rank)]
            owned = [stream.owned_position(r, rnd * per_rank + k) for k in range(per_rank)]
            assert owned == list(range(rnd * P + r * per_rank, rnd * P + (r + 1) * per_rank))
            assert [stream.prompt_index(p) for p in owned] == share.indices
            assert [stream.sampling_seed(p) for p in owned] == sync_seeds
            assert [stream.nominal_rank(p) for p in owned] == [r] * per_rank


@pytest.mark.parametrize("n,P,G,world", LAYOUTS)
def test_owned_positions_partition_the_stream(n, P, G, world):
    stream = PromptStream(ToySource(n), P, G, world, seed=1, shuffle=True)
    rounds = 5
    owned = {r: [stream.owned_position(r, k) for k in range(rounds * stream.per_rank)] for r in range(world)}
    assert sorted(p for ps in owned.values() for p in ps) == list(range(rounds * P))
    for r, ps in owned.items():
        assert ps == sorted(ps)  # a rank's k-th group comes after its (k-1)-th
        assert all(stream.nominal_rank(p) == r for p in ps)


def test_sampling_seed_by_hand():
    # seed 1, P = 4 prompts, G = 2: position 6 is prompt j = 2 of round 1, whose run starts at slot j·G = 4:
    # round_seed = 1·1_000_003 + 1·100_003 + 4 = 1_100_010
    stream = PromptStream(ToySource(5), 4, 2, 2, seed=1, shuffle=False)
    assert stream.sampling_seed(6) == 1_100_010
    # unshuffled: 5 rows hold one whole round of 4 (TRL leaves an epoch's remainder out), so position 6 is round 1 =
    # epoch 1, slot 2: row 2 (row 4 is left out of every unshuffled epoch)
    assert stream.prompt_index(6) == 2
    assert stream.nominal_rank(6) == 1 and stream.owned_position(1, 2) == 6


# --------------------------------------------------------------------------------------- the batch cut
def test_plan_takes_the_oldest_groups_first():
    # version first, then stream position: (0, 5) and (0, 7) beat the older position 0 of version 1
    plan = plan_batch([[(1, 0), (0, 5)], [(0, 7), (2, 1)]], 2)
    assert plan.chosen == [(0, 5, 0), (0, 7, 1)]
    assert plan.destination == {5: 0, 7: 1}
    assert plan.kept(0) == [5] and plan.kept(1) == [7] and plan.outgoing(0) == plan.outgoing(1) == {}


def test_plan_keeps_a_ranks_share_and_moves_only_the_surplus():
    # rank 0 holds the 4 oldest groups; a batch of 4 over 2 ranks is 2 each: rank 0 keeps its first two in stream
    # order (1 and 2; position 0 is newer), and its other two move to rank 1, which trains none of its own
    held = [[(0, 3), (0, 1), (0, 2), (1, 0)], [(2, 4), (2, 5)]]
    plan = plan_batch(held, 4)
    assert [p for _, p, _ in plan.chosen] == [1, 2, 3, 0]
    assert sorted(plan.kept(0)) == [0, 1] and plan.outgoing(0) == {2: 1, 3: 1}
    assert plan.kept(1) == [] and plan.outgoing(1) == {}
    assert plan.trained_on(0) == [0, 1] and plan.trained_on(1) == [2, 3]


def test_plan_refuses_too_few_groups_and_uneven_splits():
    with pytest.raises(ValueError, match="only 3 groups held; a batch needs 4"):
        plan_batch([[(0, 0), (0, 1)], [(0, 2)]], 4)
    with pytest.raises(ValueError, match="3 groups cannot be split evenly over 2 ranks"):
        plan_batch([[(0, 0), (0, 1)], [(0, 2), (0, 3)]], 3)


@st.composite
def holdings(draw):
    world = draw(st.integers(1, 4))
    share = draw(st.integers(1, 4))
    total = draw(st.integers(world * share, world * share + 8))
    positions = draw(st.permutations(range(total + 5)))[:total]  # unique, with gaps
    versions = draw(st.lists(st.integers(0, 3), min_size=total, max_size=total))
    holders = draw(st.lists(st.integers(0, world - 1), min_size=total, max_size=total))
    held = [[(v, p) for v, p, h in zip(versions, positions, holders) if h == r] for r in range(world)]
    return held, world * share


@settings(max_examples=300, deadline=None)
@given(holdings())
def test_plan_properties(case):
    held, N = case
    world, share = len(held), N // len(held)
    plan = plan_batch(held, N)
    everything = sorted((v, p, r) for r, pairs in enumerate(held) for v, p in pairs)
    assert plan.chosen == everything[:N]
    chosen_positions = [p for _, p, _ in plan.chosen]
    assert sorted(plan.destination) == sorted(chosen_positions)  # each chosen group has exactly one destination
    assert [plan.trained_on(r) for r in range(world)] == [
        sorted(p for p, d in plan.destination.items() if d == r) for r in range(world)
    ]
    assert [len(plan.trained_on(r)) for r in range(world)] == [share] * world
    mine = {r: sorted(p for _, p, h in plan.chosen if h == r) for r in range(world)}
    moved = [p for _, p, h in plan.chosen if plan.destination[p] != h]
    assert len(moved) == sum(max(0, len(mine[r]) - share) for r in range(world))  # the fewest moves possible
    for r in range(world):
        assert sorted(plan.kept(r)) == mine[r][:share]  # a rank keeps its earliest chosen groups, up to its share
        assert sorted(plan.outgoing(r)) == mine[r][share:]
        incoming = [p for p in moved if plan.destination[p] == r]
        assert not incoming or len(mine[r]) < share  # only ranks short of their share receive
        assert plan.trained_on(r) == sorted(plan.kept(r) + incoming)


# --------------------------------------------------------------------------------------- the pool
def make_group(position, version, rank=0, G=2, tool_mask=False, rewards=None):
    completions = [[position, r, 9][: 1 + (position + r) % 3] for r in range(G)]  # lengths 1..3
    rollout = Rollout(
        [[100 + position]] * G,
        completions,
        [[-0.5 * (t + 1) for t in range(len(c))] for c in completions],
        [len(c) == 3 for c in completions],
        [[1, 0, 1][: len(c)] for c in completions] if tool_mask else None,
    )
    return Group(position, 50 + position, version, rank, rollout, rewards)


def test_pool_drop_take_and_summary():
    pool = GroupPool()
    pool.add([make_group(5, 2), make_group(1, 3), make_group(4, 1), make_group(2, 2), make_group(0, 1)])
    assert pool.summary() == [(1, 0), (1, 4), (2, 2), (2, 5), (3, 1)]
    assert pool.drop_older_than(2) == 2 and len(pool) == 3
    assert pool.summary() == [(2, 2), (2, 5), (3, 1)]
    assert pool.drop_older_than(2) == 0
    taken = pool.take([5, 1])
    assert [g.position for g in taken] == [5, 1]  # in the order asked
    assert pool.summary() == [(2, 2)]
    with pytest.raises(KeyError):
        pool.take([5])  # a group is trained once


def test_pool_json_round_trip_keeps_rollouts_rewards_and_tool_masks():
    pool = GroupPool()
    scored = make_group(3, 1, rank=1, tool_mask=True, rewards=torch.tensor([[0.25, NAN], [NAN, NAN]]))
    plain = make_group(1, 0, rank=0, rewards=None)
    pool.add([scored, plain])
    text = json.dumps(pool.to_json())  # what a checkpoint's rollout_state_<rank>.json holds
    assert [d["position"] for d in json.loads(text)] == [1, 3]  # stream order
    back = GroupPool()
    back.load_json(json.loads(text))
    assert back.summary() == pool.summary()
    for before in (scored, plain):
        after = back.take([before.position])[0]
        assert (after.position, after.prompt_index, after.version, after.rank) == (
            before.position,
            before.prompt_index,
            before.version,
            before.rank,
        )
        assert after.rollout == before.rollout  # every field, tool_mask included
        if before.rewards is None:
            assert after.rewards is None
        else:
            assert after.rewards.dtype == torch.float32
            torch.testing.assert_close(after.rewards, before.rewards, equal_nan=True, rtol=0, atol=0)
    assert scored.rollout.tool_mask == [[1, 0, 1][: len(c)] for c in scored.rollout.completion_ids]


def test_tool_turns_and_rollout_func_columns_survive_the_pool():
    """What tools and a rollout_func add to a rollout (messages, per-row tool counts, extra columns) travels with a
    group through a checkpoint or a split-placement exchange (JSON), and is kept by the row slicing and the batch
    concatenation the async trainer does."""
    rollout = Rollout(
        [[1], [1], [2], [2]],
        [[5], [6, 7], [8], [9]],
        [[-0.1], [-0.2, 0.0], [-0.3], [-0.4]],
        [False, True, False, False],
        tool_mask=[[1], [1, 0], [1], [1]],
        messages=[[{"role": "assistant", "content": f"m{i}"}] for i in range(4)],
        tool_counts=[[0, 0], [2, 1], [1, 0], [0, 0]],
        columns={"tag": ["a", "b", "c", "d"]},
    )
    first, second = rollout.rows(slice(0, 2)), rollout.rows(slice(2, 4))
    assert first.columns == {"tag": ["a", "b"]} and second.tool_counts == [[1, 0], [0, 0]]
    back = Group.from_json(json.loads(json.dumps(Group(7, 3, 1, 0, second).to_json()))).rollout
    assert back == second
    assert Rollout.concat([first, back]) == rollout
    # a part without messages or columns: concatenation keeps only what every part has
    plain = Rollout([[3]], [[4]], [[-1.0]], [False])
    mixed = Rollout.concat([first, plain])
    assert mixed.messages is None and mixed.columns is None and mixed.tool_mask == [[1], [1, 0], [1]]


def test_pool_json_from_before_tool_mask_loads():
    d = make_group(2, 0).to_json()
    del d["tool_mask"]
    assert Group.from_json(d).rollout.tool_mask is None


# --------------------------------------------------------------------------------------- zero-std groups
def test_zero_std_groups_by_hand():
    # G = 2, K = 2, weights (1, 0.5); a group's weighted totals, NaN skipped inside a row (weighted_sum):
    #   g0: (1, 0), (0, 2)       → 1, 1      equal             → True   (unweighted 1, 2 → False)
    #   g1: (1, 2), (1, 0)       → 2, 1                        → False
    #   g2: (NaN, 2), (1, NaN)   → 1, 1      one NaN per row   → True
    #   g3: (NaN, NaN), (3, 0)   → NaN, 3    one known reward: no spread → True
    #   g4: all NaN              → NaN, NaN                    → True
    #   g5: (NaN, NaN), (0, 0)   → NaN, 0    an unknown reward is not a 0 one, still one known → True
    # unweighted: g0 → 1, 2; g1 → 3, 1; g2 → 2, 1: False; g3..g5 as above
    rewards = torch.tensor(
        [
            [1, 0],
            [0, 2],
            [1, 2],
            [1, 0],
            [NAN, 2],
            [1, NAN],
            [NAN, NAN],
            [3, 0],
            [NAN, NAN],
            [NAN, NAN],
            [NAN, NAN],
            [0, 0],
        ]
    )
    assert zero_std_groups(rewards, 2, [1.0, 0.5]) == [True, False, True, True, True, True]
    assert zero_std_groups(rewards, 2) == [False, False, False, True, True, True]
    # G = 3: (NaN, NaN) then 1, 1 → two known totals that agree → True; 1, 2 → False
    assert zero_std_groups(torch.tensor([[NAN, NAN], [1, 0], [0, 1], [NAN, NAN], [1, 0], [2, 0]]), 3) == [True, False]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 4), st.data())
def test_zero_std_groups_agree_with_the_trainers_count(G, K, groups, data):
    values = st.sampled_from([0.0, 0.5, 1.0, NAN])
    rewards = torch.tensor(
        data.draw(st.lists(st.lists(values, min_size=K, max_size=K), min_size=G * groups, max_size=G * groups))
    )
    weights = data.draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=K, max_size=K))
    _, stats = compute_advantages(rewards, G, reward_weights=weights)
    expected = torch.isclose(stats["std_per_group"], torch.zeros(groups)).tolist()
    assert zero_std_groups(rewards, G, weights) == expected


# --------------------------------------------------------------------------------------- the claim counter
def test_local_claim_counter():
    c = ClaimCounter(shared=False)
    assert not c.shared
    assert c.add("claimed", 0) == 0  # add 0 reads
    assert c.add("claimed", 3) == 3 and c.add("claimed", 2) == 5  # add returns the new total
    assert c.add("dropped", 1) == 1 and c.add("claimed", 0) == 5  # independent keys
    c.set("claimed", 10)  # a resumed run's counter
    assert c.add("claimed", 1) == 11 and c.add("dropped", 0) == 1
    with pytest.raises(KeyError):
        c.add("other", 1)


def test_shared_claim_counter_without_a_process_group_is_local():
    c = ClaimCounter(shared=True)
    assert not c.shared and c.add("claimed", 4) == 4


def test_ranks_racing_at_the_staleness_bound_never_claim_past_it():
    """Two ranks' counters on one real TCPStore (each its own client, as dist.counter_store makes them), claiming
    one position at a time from threads until the bound stops them: together they claim exactly the bound. Reading
    the bound and adding were two steps once, and a run's uninterrupted reference sampled position 12 of a
    12-position allowance with the old weights."""
    import datetime
    import socket
    import threading

    import torch.distributed as td

    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = td.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    counters = [
        ClaimCounter(
            shared=True,
            store=td.PrefixStore(
                "race/", td.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=30))
            ),
        )
        for _ in range(2)
    ]
    assert all(c.shared for c in counters)
    for bound in (12, 40, 41):  # the allowance grows, as a new version loads
        claimed = [[] for _ in counters]
        go = threading.Barrier(len(counters))

        def claimer(i):
            go.wait()
            while True:
                start, end = counters[i].claim(1, bound)
                if start == end:
                    return
                claimed[i].extend(range(start, end))

        threads = [threading.Thread(target=claimer, args=(i,)) for i in range(len(counters))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        every = sorted(claimed[0] + claimed[1])
        assert every == list(range(every[0], bound)) and counters[0].add("claimed", 0) == bound, (bound, claimed)
    counters[1].add("dropped", 2)  # two groups dropped: two more places
    assert counters[0].claim(5, 41) == (41, 43) and counters[1].claim(5, 41) == (43, 43)
    del server


# --------------------------------------------------------------------------------------- the worker, no thread
class FakeGenerator:
    """Row r of prompt j: completion (prompt token, j, r), tool mask (1, 0, 1): a tool result in the middle."""

    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, counts, sampling, seeds=None):
        self.calls.append((prompt_ids, counts, seeds))
        rows = [(p, j, r) for j, (p, n) in enumerate(zip(prompt_ids, counts)) for r in range(n)]
        return Rollout(
            [p for p, _, _ in rows],
            [[p[0], j, r] for p, j, r in rows],
            [[-0.1, 0.0, -0.3] for _ in rows],
            [False] * len(rows),
            [[1, 0, 1] for _ in rows],
        )


def make_worker(*, balanced=True, rank=0, chunk=3, score=None, drop=False, P=4, G=2, world=2):
    stream = PromptStream(ToySource(10), P, G, world, seed=3, shuffle=True)
    return RolloutWorker(
        sampler=GeneratorSampler(FakeGenerator(), None),
        prompts=stream.source,
        stream=stream,
        counter=ClaimCounter(shared=False),
        pool=GroupPool(),
        score=score,
        balanced=balanced,
        chunk_groups=chunk,
        max_staleness=1,
        drop_zero_std=drop,
        reward_weights=None,
        rank=rank,
        version=0,
    )


def test_claims_stop_at_the_staleness_bound():
    # balanced, P = 4, max_staleness 1: with version v loaded, positions below (v + 1 + 1)·P + dropped may be claimed
    w = make_worker(balanced=True, chunk=3)
    assert [w._claim() for _ in range(4)] == [[0, 1, 2], [3, 4, 5], [6, 7], []]  # 2·4 = 8
    w.counter.add("dropped", 2)  # two dropped groups are replaced
    assert [w._claim() for _ in range(2)] == [[8, 9], []]
    w.version = 1  # 3·4 + 2 = 14
    assert [w._claim() for _ in range(3)] == [[10, 11, 12], [13], []]
    # fixed shares: rank 1 owns positions 2, 3 of each round (n = 2); (0 + 2)·2 = 4 of its own groups
    w = make_worker(balanced=False, rank=1, chunk=3)
    assert [w._claim() for _ in range(3)] == [[2, 3, 6], [7], []]


def rewards_constant_on_even_rows(indices, rollout):
    """[k·G, 1]: every completion of an even dataset row gets 1 (zero std); odd rows get 0, 1, ..."""
    G = len(rollout) // len(indices)
    return torch.tensor([[1.0 if i % 2 == 0 else float(r)] for i in indices for r in range(G)])


def test_produce_slices_groups_with_their_tool_masks():
    w = make_worker(score=rewards_constant_on_even_rows)
    w.version = 3
    w._produce([5, 2])
    stream = w.stream
    prompts, counts, seeds = w.sampler.generator.calls[0]
    assert prompts == [[100 + stream.prompt_index(5)], [100 + stream.prompt_index(2)]]
    assert counts == [2, 2] and seeds == [stream.sampling_seed(5), stream.sampling_seed(2)]
    assert w.completions_generated == 4 and len(w.pool) == 2
    for j, p in enumerate([5, 2]):
        g = w.pool.take([p])[0]
        idx = stream.prompt_index(p)
        assert (g.position, g.prompt_index, g.version, g.rank) == (p, idx, 3, 0)
        assert g.rollout.completion_ids == [[100 + idx, j, 0], [100 + idx, j, 1]]
        assert g.rollout.tool_mask == [[1, 0, 1], [1, 0, 1]]
        assert g.rewards.tolist() == ([[1.0], [1.0]] if idx % 2 == 0 else [[0.0], [1.0]])


def test_produce_drops_zero_std_groups_and_frees_their_places():
    w = make_worker(score=rewards_constant_on_even_rows, drop=True, chunk=4)
    positions = w._claim()
    assert positions == [0, 1, 2, 3]
    w._produce(positions)
    even = [p for p in positions if w.stream.prompt_index(p) % 2 == 0]
    assert even  # the seed's order puts at least one even row in the first four (else the test proves nothing)
    assert sorted(g for _, g in w.pool.summary()) == [p for p in positions if p not in even]
    assert w.zero_std_dropped == len(even) and w.counter.add("dropped", 0) == len(even)
    assert w.completions_generated == 8  # dropped groups were generated all the same


def test_rollout_rows_concatenate_tool_masks():
    a, b, c = make_group(4, 0, tool_mask=True), make_group(1, 0), make_group(2, 0, tool_mask=True)
    for g in (a, b, c):
        g.rewards = torch.full((2, 1), float(g.position))
    out, rewards = as_rollout_rows([a, b, c])
    assert out.completion_ids == a.rollout.completion_ids + b.rollout.completion_ids + c.rollout.completion_ids
    assert out.tool_mask == a.rollout.tool_mask + [[1] * len(x) for x in b.rollout.completion_ids] + c.rollout.tool_mask
    assert rewards.view(-1).tolist() == [4, 4, 1, 1, 2, 2]
    # the mask reaches the loss: tool-result tokens (0 in the mask) are out of completion_mask
    mask = out.tensors(pad_id=0)["completion_mask"]
    for i, m in enumerate(out.tool_mask):
        assert mask[i, : len(m)].tolist() == [float(x) for x in m] and mask[i, len(m) :].sum() == 0
    plain, none = as_rollout_rows([b, make_group(7, 0, rewards=None)])
    assert plain.tool_mask is None and none is None  # one unscored group: rewards are computed later
    assert as_rollout_rows([]) == (Rollout([], [], [], []), None)


def test_one_worker_claims_a_whole_round_per_call_and_many_a_quarter_of_their_share():
    from dsgrpo.rollout.async_source import default_chunk_groups

    assert default_chunk_groups(8, workers=1) == 8  # no one to balance against: one engine call per round
    assert default_chunk_groups(16, workers=2) == 2  # a quarter of each worker's 8
    assert default_chunk_groups(4, workers=4) == 1
