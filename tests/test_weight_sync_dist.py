"""The weight sync (issue 45) on 2 ranks: a ZeRO-3 policy whose every parameter is partitioned, real in-process vLLM,
fp32 on CPU. One launch of tests/dist_scripts/weight_sync_checks.py; each test asserts on a part of it."""

import pytest

from launch import part, rank_results, torchrun

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("weight_sync_checks")
    torchrun("tests/dist_scripts/weight_sync_checks.py", str(out), timeout=600)
    return rank_results(out)


def test_the_source_is_vllms_weight_source_contract(results):
    for r in part(results, "source"):
        assert [tuple(m) for m in r["meta"]] == [tuple(s) for s in r["seen"]]  # metadata is the iteration
        assert r["gathered_for_metadata"] == 0  # shapes without a gather
        assert r["group_names_ok"] and r["groups"] == r["layers"] + 2  # a group per decoder layer
        assert r["first_group"] == ["model.embed_tokens.weight", "lm_head.weight"]  # tied: the head beside it
        assert r["last_group"] == ["model.norm.weight"]
        assert r["gather"] == "shared_memory"  # one CPU host: the shared buffer


def test_the_shared_buffer_gathers_what_deepspeed_gathers(results):
    for r in part(results, "shared_memory_equals_deepspeed"):
        assert r["tensors"] == 27 and r["worst"] == 0.0  # bit for bit, every tensor
        assert r["names_same"] and r["worst_vs_old_path"] == 0.0  # and what the bucketed path streamed


def test_a_native_sync_serves_the_policy_timed_by_phase_within_its_memory_bound(results):
    for r in part(results, "native_sync"):
        assert r["path"] == "native" and r["gather"] == "shared_memory"
        assert r["max_gap"] < 1e-5, r["served"]  # vLLM's log-probs are the policy's after the sync
        assert r["version"] == "5" and r["engine_version"] == "5"
        m = r["metrics"]
        for phase in ("gather_s", "convert_s", "wire_s", "load_s", "wait_s", "verify_s", "total_s"):
            assert m[f"sync/{phase}"] >= 0.0
        assert m["sync/load_s"] > 0 and m["sync/gather_s"] > 0 and m["sync/verify_s"] > 0
        assert m["sync/bytes"] == 2232832 and m["sync/x_memcpy"] > 1  # every tensor, the head included
        assert 0 < r["peak_extra"] <= r["bound"]  # one group's full weights and one bucket at most


def test_every_token_carries_its_weight_version(results):
    for r in part(results, "versions"):
        assert r["versions"] == [[5] * 5, [5] * 5]
        assert r["spans"] == [["5", 0, 3]]  # as vLLM labelled them
        assert "version(s) [4]" in r["refused"] and "synced version 5" in r["refused"]


def test_the_reload_fallback_serves_the_same_weights(results):
    for r in part(results, "reload_equals_native"):
        assert r["path"] == "reload" and r["diff"] == 0.0 and r["gap"] < 1e-5


def test_a_corrupted_transfer_is_caught_naming_the_tensor(results):
    for r in part(results, "corruption_caught"):
        assert r["refusal"] and r["tampered"] in r["refusal"] and "differs" in r["refusal"]
        assert r["max_gap"] < 1e-5  # the next clean sync serves the policy again


def test_a_stalled_sync_fails_naming_the_phase_and_the_rank(results):
    stalled = part(results, "stall")
    r0 = stalled[0]
    assert "WeightSyncError" in r0["failure"] and "Ranks 1 failed to pass" in r0["failure"]
    assert "released the shared weight slot" in r0["failure"]  # the phase
    assert 3.5 < r0["seconds"] < 10  # weight_sync_timeout_s=4, not the group's timeout
    # rank 1 reaches the barrier after rank 0 has failed and left: it names the lost peer, or the stall if it sees
    # the timeout before the peer's exit
    other = stalled[1]["failure"]
    assert "WeightSyncError" in other or ("RankLostError" in other and "lost rank 0" in other), other
