"""Partial rollouts (issue 46) on 2 ranks: ZeRO-3 policy, real in-process vLLM, fp32 on CPU, long-tailed lengths.
One launch of tests/dist_scripts/partial_rollout_checks.py; each test asserts on a part of it."""

import pytest

from launch import part, rank_results, torchrun

pytestmark = pytest.mark.dist

MAX_STALENESS = 1


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("partial_rollout_checks")
    torchrun("tests/dist_scripts/partial_rollout_checks.py", str(out), timeout=900)
    return rank_results(out)


def test_with_the_option_off_the_trainer_builds_the_plain_source(results):
    for r in part(results, "option_off_is_the_plain_source"):
        assert r["off"] == r["plain"] and r["on"] == r["partial"]


def trained(results, name):
    """{position: (rank, round, group)} over both ranks; fails on a position trained twice."""
    seen = {}
    for rank, r in enumerate(part(results, name)):
        for rd in r["rounds"]:
            for p, g in rd["groups"].items():
                assert p not in seen, f"position {p} trained twice: {seen[p][:2]} and {(rank, rd['round'])}"
                seen[p] = (rank, rd["round"], g)
    return seen


def test_every_group_is_trained_once_and_each_round_takes_each_ranks_share(results):
    seen = trained(results, "run")
    runs = part(results, "run")
    for r in runs:
        assert len(r["rounds"]) == 6
        assert all(len(rd["groups"]) == r["share"] for rd in r["rounds"])
    # the trained positions and those still in flight are exactly the stream's claimed prefix: none lost
    claimed = set(int(p) for p in seen) | {p for r in runs for p in r["in_flight_at_end"]}
    assert claimed == set(range(len(claimed)))


def test_carried_completions_continue_their_prefix_on_the_new_weights_with_versions(results):
    seen = trained(results, "run")
    carried = mixed = 0
    for rank, r in enumerate(part(results, "run")):
        for before, rd in zip(r["rounds"], r["rounds"][1:]):
            for p, tokens in before["after"].items():  # left in flight after a round ...
                if p in rd["groups"]:  # ... and trained in the next one
                    g = rd["groups"][p]
                    for prefix, completion in zip(tokens, g["completions"]):
                        assert completion[: len(prefix)] == prefix  # its tokens so far, kept
                        carried += bool(prefix)
    for p, (rank, rd, g) in seen.items():
        version = next(x["version"] for x in part(results, "run")[rank]["rounds"] if x["round"] == rd)
        for c, lp, v in zip(g["completions"], g["logprobs"], g["versions"]):
            assert len(c) == len(lp) == len(v)
            assert v == sorted(v)  # versions only grow along a completion
            assert all(version - x <= MAX_STALENESS for x in v), (v, version)  # bounded by the oldest token
            mixed += len(set(v)) > 1
    assert carried > 0 and mixed > 0, (carried, mixed)  # the long tail really finished on new weights


def test_tokens_are_scored_by_the_weights_they_were_sampled_with(results):
    """The sampler–trainer gap of tokens sampled with the current weights is fp32 noise, also for the continuations
    of carried prefixes (a continuation sampled without its prefix, or labelled with the wrong version, shows here);
    older tokens differ by what one step at lr 3e-2 moved."""
    hist = part(results, "run")[0]["history"]
    age0 = [h["partial/sampler_gap/age0"] for h in hist if "partial/sampler_gap/age0" in h]
    age1 = [h["partial/sampler_gap/age1"] for h in hist if "partial/sampler_gap/age1" in h]
    assert age0 and max(age0) < 1e-4, age0
    assert age1 and max(age1) > 1e-3, age1
    for h in hist:
        assert 0.0 <= h["sampling/token_band_masked"] <= 1.0
        assert abs(sum(h[f"partial/staleness/{a}"] for a in range(MAX_STALENESS + 1)) - 1.0) < 1e-6
        assert h["rollout/weight_version_max"] - h["rollout/weight_version_min"] <= MAX_STALENESS
    assert sum(h["partial/completions_stopped"] for h in hist) > 0
    assert max(h["partial/staleness/1"] for h in hist) > 0


def test_without_a_tail_the_adaptive_source_samples_what_the_plain_one_does_token_for_token(results):
    for r in part(results, "adaptive_even_lengths"):
        plain, adaptive = r["plain"], r["adaptive"]
        assert len(adaptive["rounds"]) == 3 and adaptive["losses"]
        for p, a in zip(plain["rounds"], adaptive["rounds"]):
            assert a["completions"] == p["completions"]
            assert a["logprobs"] == p["logprobs"]
            assert a["metrics"]["partial/long_tail"] == 0.0 and a["metrics"]["partial/overprovisioned"] == 0.0
            assert a["metrics"]["partial/completions_stopped"] == 0.0
        assert adaptive["losses"] == plain["losses"]


def test_with_a_long_tail_the_adaptive_source_measures_one_plain_round_then_cuts(results):
    for r in part(results, "adaptive_long_tail"):
        rounds = [rd["metrics"] for rd in r["rounds"]]
        assert rounds[0]["partial/overprovisioned"] == 0.0 and rounds[0]["partial/completions_stopped"] == 0.0
        assert rounds[0]["partial/long_tail"] == 1.0, rounds[0]
        assert all(m["partial/overprovisioned"] == 1.0 for m in rounds[1:]), rounds
        assert sum(m["partial/completions_stopped"] for m in rounds[1:]) > 0
    for m in part(results, "run")[0]["rounds"]:  # partial_rollout_adaptive=False: every round over-provisions
        assert m["metrics"]["partial/overprovisioned"] == 1.0


def test_a_checkpoint_carries_the_groups_in_flight_and_the_resumed_run_continues_them(results):
    for rank, r in enumerate(part(results, "resumed")):
        saved = {str(g["position"]): g for g in r["saved"]["partial_rollout"]["in_flight"]}
        assert saved, "nothing was in flight at the checkpoint"
        first = r["rounds"][0]
        assert set(first["before"]) >= set(saved)  # the resumed source holds them before its first round
        for p, g in saved.items():
            assert first["before"][p] == [c["tokens"] for c in g["members"]]
        continued = [p for p in saved if p in first["groups"]]
        for p in continued:
            for c, completion in zip(saved[p]["members"], first["groups"][p]["completions"]):
                assert completion[: len(c["tokens"])] == c["tokens"]
                # a token sampled before the checkpoint keeps the version it was sampled with
                assert first["groups"][p]["versions"][c["member"]][: len(c["versions"])] == c["versions"]
        if rank == 0:
            assert "prompt group(s) in flight" in r["printed"] and "continue from their prefixes" in r["printed"]
    # across the original run's first 3 rounds and the resumed run's, no position is trained twice
    before = {p for r in part(results, "run") for rd in r["rounds"][:3] for p in rd["groups"]}
    after = [p for r in part(results, "resumed") for rd in r["rounds"] for p in rd["groups"]]
    assert len(after) == len(set(after)) and not before & set(after)


def test_the_async_trainer_pools_each_group_once_with_its_oldest_version_bounded(results):
    seen, mixed = {}, 0
    for rank, r in enumerate(part(results, "async")):
        assert len(r["rounds"]) == 6
        for rd in r["rounds"]:
            for p, g in rd["groups"].items():
                assert p not in seen, f"position {p} trained twice"
                seen[p] = rd["round"]
                for c, v in zip(g["completions"], g["versions"]):
                    assert len(c) == len(v) and v == sorted(v)
                    assert rd["round"] - min(v) <= MAX_STALENESS, (rd["round"], v)
                    mixed += len(set(v)) > 1
    assert mixed > 0  # a pause (the weight sync) stopped completions that then finished on the new weights
    hist = part(results, "async")[0]["history"]
    age0 = [h["partial/sampler_gap/age0"] for h in hist if "partial/sampler_gap/age0" in h]
    assert age0 and max(age0) < 1e-4, age0
    assert hist[-1]["partial/completions_stopped_total"] > 0
    assert all(abs(sum(h[f"partial/staleness/{a}"] for a in range(MAX_STALENESS + 1)) - 1.0) < 1e-6 for h in hist)


def test_an_async_checkpoint_keeps_the_groups_in_flight_and_the_resumed_run_trains_them_once(results):
    run, resumed = part(results, "async"), part(results, "async_resumed")
    in_flight = {g["position"]: g for r in run for g in r["saved_in_flight"]}
    assert in_flight and any(c["tokens"] for g in in_flight.values() for c in g["members"])
    first3 = {p for r in run for rd in r["rounds"][:3] for p in rd["groups"]}
    later = [p for r in resumed for rd in r["rounds"] for p in rd["groups"]]
    assert len(later) == len(set(later)) and not first3 & set(later)
    continued = 0
    for r in resumed:
        for rd in r["rounds"]:
            for p, g in rd["groups"].items():
                if int(p) in in_flight:
                    for c, completion in zip(in_flight[int(p)]["members"], g["completions"]):
                        continued += bool(c["tokens"]) and completion[: len(c["tokens"])] == c["tokens"]
    assert continued > 0  # a prefix saved in flight was continued, not sampled again
