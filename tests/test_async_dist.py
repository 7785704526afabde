"""AsyncGRPOTrainer on 2 ranks with real DeepSpeed ZeRO-3 and real in-process vLLM (fp32, CPU). One launch of
tests/dist_scripts/async_checks.py records numbers; each test below asserts on one part of them.

A plan is what tests/dist_scripts/async_checks.py records per round: {"round": r, "groups": [[version, position,
holding rank, training rank], ...]}, the same on both ranks (it is cut from all-gathered pool summaries)."""

import json

import pytest

from launch import part, torchrun

pytestmark = pytest.mark.dist

MAX_STALENESS = 1  # every run of the script but `equivalence` (0)
IN_FLIGHT = 2 * 1  # claimed groups not yet pooled, at most: one chunk per rank, async_chunk_groups=1


COLOCATE_CHECKS = "equivalence,straggler,dynamic_sampling,resume,learning,worker_error"


def launch(out, checks):
    torchrun("tests/dist_scripts/async_checks.py", str(out), checks, timeout=900)
    return [json.load(open(out / f"result-{r}.json")) for r in range(2)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("async_checks"), COLOCATE_CHECKS)


@pytest.fixture(scope="module")
def split_results(tmp_path_factory):
    """Split placement gives ranks different roles for the life of the process: its own launch."""
    return launch(tmp_path_factory.mktemp("async_split"), "split")


def steps(history):
    """Training-step entries of a log_history (one per round: one optimizer step per round in these runs)."""
    return [h for h in history if "async/staleness/max" in h]


def mean(xs):
    return sum(xs) / len(xs)


def nominal_rank(position, plan):
    """The synchronous layout's owner: rank r holds the r-th half of each round's P positions."""
    P = len(plan["groups"])
    return (position % P) // (P // 2)


def runs_with_plans(results, rank=0):
    """(name, plans, max_staleness) of every recorded run, as rank `rank` recorded them."""
    eq, st, rs = (part(results, name)[rank] for name in ("equivalence", "straggler", "resume"))
    return [
        ("equivalence", eq["plans"], 0),
        ("straggler/balanced", st["balanced"]["plans"], MAX_STALENESS),
        ("straggler/fixed", st["fixed"]["plans"], MAX_STALENESS),
        ("resume/before", rs["plans_a"], MAX_STALENESS),
        ("resume/after", rs["plans_b"], MAX_STALENESS),
    ]


# ------------------------------------------------------------------ 1. max_staleness=0, no balancing == GRPOTrainer
def test_on_policy_async_equals_the_synchronous_trainer(results):
    for e in part(results, "equivalence"):
        assert e["weights_moved"] > 1e-3  # the comparison is not vacuous
        assert e["max_weight_diff"] <= 2e-5, e["max_weight_diff"]
        assert len(e["sync_rewards"]) == len(e["async_rewards"]) == 4
        assert all(abs(a - b) <= 1e-6 for a, b in zip(e["sync_rewards"], e["async_rewards"])), (
            e["sync_rewards"],
            e["async_rewards"],
        )
        assert [p["round"] for p in e["plans"]] == [0, 1, 2, 3]
        for plan in e["plans"]:
            P = len(plan["groups"])
            assert sorted(p for _, p, _, _ in plan["groups"]) == list(range(plan["round"] * P, (plan["round"] + 1) * P))
            for version, position, holder, trainer in plan["groups"]:
                assert version == plan["round"], plan  # staleness 0: sampled by the weights it trains
                assert holder == trainer == nominal_rank(position, plan), plan  # the synchronous layout, nothing moved


# ------------------------------------------------------------------ 2. a straggler rank: balancing on vs off
def test_balancing_moves_work_off_the_straggler(results):
    s = part(results, "straggler")[0]
    for name in ("balanced", "fixed"):
        run = s[name]
        print(
            f"\n[straggler/{name}] wall {run['wall_s']:.1f} s, mean time/wait_for_rollout "
            f"{mean([h['time/wait_for_rollout'] for h in steps(run['history'])]):.2f} s"
        )  # shown, never asserted
    balanced, fixed = steps(s["balanced"]["history"]), steps(s["fixed"]["history"])
    assert sum(h["async/groups_stolen"] for h in balanced) > 0
    last = balanced[-1]
    assert last["async/completions_generated/rank0"] > last["async/completions_generated/rank1"], last
    assert all(h["async/groups_stolen"] == 0 and h["async/groups_moved"] == 0 for h in fixed)
    for plan in s["fixed"]["plans"]:
        assert all(holder == trainer == nominal_rank(p, plan) for _, p, holder, trainer in plan["groups"]), plan


def test_logged_rollout_metrics_match_the_plans(results):
    s = part(results, "straggler")[0]
    for name in ("balanced", "fixed"):
        plans, history = s[name]["plans"], steps(s[name]["history"])
        assert len(plans) == len(history) == 6
        for plan, h in zip(plans, history):
            assert h["step"] == plan["round"] + 1
            g = plan["groups"]
            assert h["async/groups_stolen"] == sum(holder != nominal_rank(p, plan) for _, p, holder, _ in g), (
                name,
                plan,
            )
            assert h["async/groups_moved"] == sum(holder != trainer for _, _, holder, trainer in g), (name, plan)
            lags = [plan["round"] - v for v, _, _, _ in g]
            assert h["async/staleness/max"] == max(lags) and abs(h["async/staleness/mean"] - mean(lags)) < 1e-9


# ------------------------------------------------------------------ staleness and uniqueness, every run
def test_staleness_stays_within_the_bound(results):
    for name, plans, bound in runs_with_plans(results):
        assert plans, name
        for plan in plans:
            lags = [plan["round"] - v for v, _, _, _ in plan["groups"]]
            assert 0 <= min(lags) and max(lags) <= bound, (name, plan)
    histories = {
        "straggler/balanced": part(results, "straggler")[0]["balanced"]["history"],
        "straggler/fixed": part(results, "straggler")[0]["fixed"]["history"],
        "dynamic_sampling": part(results, "dynamic_sampling")[0]["history"],
        "learning": part(results, "learning")[0]["history"],
    }
    for name, history in histories.items():
        assert steps(history), name
        assert all(
            0 <= h["async/staleness/mean"] <= h["async/staleness/max"] <= MAX_STALENESS for h in steps(history)
        ), name


def test_no_group_is_trained_twice_and_both_ranks_cut_the_same_plans(results):
    for name, plans, _ in runs_with_plans(results):
        positions = [p for plan in plans for _, p, _, _ in plan["groups"]]
        assert len(positions) == len(set(positions)), name
        assert all(len(plan["groups"]) == len(plans[0]["groups"]) for plan in plans), name
    assert runs_with_plans(results, rank=0) == runs_with_plans(results, rank=1)


# ------------------------------------------------------------------ 3. dynamic sampling (DAPO)
def test_dynamic_sampling_trains_only_informative_groups(results):
    for d in part(results, "dynamic_sampling"):
        seen = d["seen"]  # one scored batch per round on this rank
        assert len(seen) == 3
        assert all(b["rows"] == 8 for b in seen)  # full batches although groups were dropped
        assert min(s for b in seen for s in b["std"]) > 0
        idx = [i for b in seen for i in b["idx"]]
        assert len(idx) == 3 * 2 and all(i % 2 == 1 for i in idx), idx  # even rows get a constant reward
        history = steps(d["history"])
        assert sum(h["async/groups_dropped"] for h in history) > 0
        assert all(h["frac_reward_zero_std"] == 0 for h in history)  # the trainer's own count, over both ranks


# ------------------------------------------------------------------ 4. checkpoint with a non-empty pool, then resume
def test_resume_trains_the_saved_pool_and_claims_where_it_stopped(results):
    ranks = part(results, "resume")
    r = ranks[0]
    assert ranks[1]["claimed"] == r["claimed"]  # one shared counter
    assert [p["round"] for p in r["plans_a"]] == [0, 1] and [p["round"] for p in r["plans_b"]] == [2, 3]
    before = {p for plan in r["plans_a"] for _, p, _, _ in plan["groups"]}
    after = [p for plan in r["plans_b"] for _, p, _, _ in plan["groups"]]
    first_after = {p for _, p, _, _ in r["plans_b"][0]["groups"]}
    saved = [p for rank in ranks for p in rank["saved_pool"]]
    assert len(saved) == len(set(saved))  # each pooled group is in one rank's checkpoint
    saved = set(saved)
    assert not before & set(after)
    # the checkpoint holds exactly the claimed, untrained groups: nothing is dropped in the first two rounds (a
    # stale drop at round t removes versions < t - 1) and the save pauses every worker, so no chunk is in flight
    assert before | saved == set(range(r["claimed"])) and not before & saved
    # claimed after round 0's weight sync (version-0 claims stop at 2·P, all trained by round 1) and before the
    # last cut of the first run (its worker stops there, before the round-1 sync): version 1, one round stale at
    # round 2, so not dropped, and older than anything the resumed run samples (version >= 2)
    assert all(v == 1 for rank in ranks for v in rank["saved_versions"])
    assert saved <= first_after
    new = [p for p in after if p not in saved]
    assert min(new) >= r["claimed"]  # the counter resumes where it stopped: nothing claimed twice
    # every trained group is one of the earliest claims but for those in flight when a batch is cut (a group
    # in the pool is older than, or as old as, any later-claimed group, so it is chosen first)
    assert max(new) < r["claimed"] + len(new) + IN_FLIGHT, (r["claimed"], after)


# ------------------------------------------------------------------ 5. learning, one step off-policy
def rewards_of(history):
    return [h["reward"] for h in history if "reward" in h]


def test_async_run_learns(results):
    rewards = rewards_of(part(results, "learning")[0]["history"])
    assert len(rewards) >= 10
    first, last = mean(rewards[:5]), mean(rewards[-5:])
    # a random model writes ~25% digit characters; RL one step off-policy still pushes that up
    assert last >= first + 0.08, (first, last, rewards)


def test_async_learns_like_the_synchronous_trainer(results):
    learning = part(results, "learning")[0]
    if "sync_history" not in learning:
        pytest.skip("async_checks.py recorded no synchronous run (learning/sync_history)")
    asyn, sync = rewards_of(learning["history"]), rewards_of(learning["sync_history"])
    assert len(asyn) == len(sync) >= 10
    assert abs(mean(asyn[-5:]) - mean(sync[-5:])) <= 0.06, (asyn[-5:], sync[-5:])


# ------------------------------------------------------------------ 6. an error in one rank's rollout worker
def test_a_worker_error_stops_every_rank_with_its_traceback(results):
    ranks = part(results, "worker_error")
    for w in ranks:
        message = w["message"]
        assert message is not None, w  # train() raised on this rank too
        assert message.startswith("the rollout worker failed on rank(s) 1:"), message[:200]
        assert "--- rank 1 ---" in message and "--- rank 0 ---" not in message
        assert "reward exploded on purpose" in message and "Traceback" in message
        assert w["thread_alive"] is False
        assert w["seconds"] < 60, w["seconds"]
        assert w["steps"] < 8  # stopped early, not at max_steps
    assert ranks[0]["message"] == ranks[1]["message"]  # the same gathered report on both


def test_split_generator_weights_equal_the_trainers_after_each_broadcast(split_results):
    trainer, generator = part(split_results, "split")
    assert trainer["first"]["trains"] and not generator["first"]["trains"]
    for run in ("first", "resumed"):
        mine, theirs = trainer[run]["by_version"], generator[run]["by_version"]
        common = sorted(set(mine) & set(theirs), key=int)
        assert len(common) >= 3, (run, sorted(mine), sorted(theirs))
        for version in common:  # log-probs of one fixed sequence: policy (rank 0) vs vLLM (rank 1)
            gap = max(abs(a - b) for a, b in zip(mine[version], theirs[version]))
            assert gap <= 1e-4, (run, version, gap)
    first = trainer["first"]["by_version"]
    assert max(abs(a - b) for a, b in zip(first["0"], first["3"])) > 1e-3  # the weights really moved


def test_split_generates_on_rank1_and_trains_on_rank0(split_results):
    trainer, _ = part(split_results, "split")
    for run in ("first", "resumed"):
        for plan in trainer[run]["plans"]:
            assert all(holder == 1 and dest == 0 for _, _, holder, dest in plan["groups"]), plan
            assert all(0 <= plan["round"] - v <= MAX_STALENESS for v, _, _, _ in plan["groups"]), plan
    history = steps(trainer["first"]["history"])
    generated = [h["async/completions_generated/rank1"] for h in history]
    assert generated == sorted(generated) and generated[-1] >= 16 * len(history)
    assert "async/completions_generated/rank0" not in history[-1]  # a training rank generates nothing


def test_split_checkpoint_keeps_the_generators_pool(split_results):
    trainer, _ = part(split_results, "split")
    pools = trainer["generator_pools"]
    assert set(pools) == {"1"}
    before = {p for plan in trainer["first"]["plans"] if plan["round"] < 2 for _, p, _, _ in plan["groups"]}
    after = [p for plan in trainer["resumed"]["plans"] for _, p, _, _ in plan["groups"]]
    assert not before & set(after)
    assert before | set(pools["1"]) == set(range(trainer["claimed_at_save"])), (before, pools)
    first_round = trainer["resumed"]["plans"][0]
    assert set(pools["1"]) <= {p for _, p, _, _ in first_round["groups"]} | set(after)
