"""Weight sync's pure parts (issue 45): how tensors are grouped by layer, what a sync reports, how a transfer is
checked, the wire settings a server push must agree on. The 2-rank sync itself: tests/test_weight_sync_dist.py."""

import pytest
import torch

from dsgrpo.engines.gather import layer_groups
from dsgrpo.rollout.weight_stream import largest_bucket_bytes, received_weights
from dsgrpo.rollout.weight_sync import SyncStats, WeightSyncError, check_received, memcpy_seconds
from dsgrpo.rollout.weight_source import ParamMeta
from dsgrpo.timing import step_breakdown


def test_one_group_per_decoder_layer():
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.q.weight",
        "model.layers.0.mlp.experts.3.w1",
        "model.layers.1.q.weight",
        "model.layers.0.mlp.experts.7.w1",  # late: still layer 0's
        "model.norm.weight",
        "lm_head.weight",
    ]
    groups = [[names[i] for i in g] for g in layer_groups(names)]
    assert groups == [
        ["model.embed_tokens.weight"],
        ["model.layers.0.q.weight", "model.layers.0.mlp.experts.3.w1", "model.layers.0.mlp.experts.7.w1"],
        ["model.layers.1.q.weight"],
        ["model.norm.weight", "lm_head.weight"],
    ]
    # two stacks (a vision tower, then the language model) keep their first-seen order; indices sort numerically
    names = ["visual.blocks.10.w", "visual.blocks.2.w", "model.layers.0.w", "visual.merger.w"]
    assert [[names[i] for i in g] for g in layer_groups(names)] == [
        ["visual.blocks.2.w"],
        ["visual.blocks.10.w"],
        ["model.layers.0.w"],
        ["visual.merger.w"],
    ]
    assert layer_groups([]) == [] and layer_groups(["a", "b"]) == [[0, 1]]


def test_a_steps_time_in_nemo_rls_terms():
    times = {"time/generate": 2.0, "time/reference": 0.5, "time/train": 1.0, "time/sync": 0.25, "time/reward": 0.25}
    out = step_breakdown(times, tokens=8000, devices=2, step_s=4.0)
    assert out["perf/step_time_s"] == 4.0 and out["perf/refit_s"] == 0.25 and out["perf/logprobs_s"] == 0.5
    assert out["perf/tokens_per_s_per_gpu"] == 8000 / (4.0 * 2)  # 1000
    assert out["perf/tokens_per_s_per_gpu/generation"] == 8000 / (2.0 * 2)  # 2000
    assert out["perf/tokens_per_s_per_gpu/training"] == 8000 / (1.0 * 2)  # 4000


def test_sync_stats_report_each_phase_and_the_memcpy_ratio():
    stats = SyncStats(version="3", gather_s=0.1, load_s=0.5, total_s=0.6, bytes=64 << 20)
    m = stats.metrics()
    assert m["sync/gather_s"] == 0.1 and m["sync/load_s"] == 0.5 and m["sync/bytes"] == 64 << 20
    assert m["sync/x_memcpy"] == pytest.approx(0.6 / memcpy_seconds(64 << 20))
    assert m["sync/x_memcpy"] > 1  # nothing moves 64 MiB faster than a memcpy of it


def test_the_memcpy_probe_copies_the_syncs_own_size_within_1_to_64_mib(monkeypatch):
    import dsgrpo.rollout.weight_sync as ws

    probed = []
    ones = torch.ones
    monkeypatch.setattr(ws, "_memcpy_rate", {})
    monkeypatch.setattr(ws.torch, "ones", lambda n, **kw: probed.append(n) or ones(n, **kw))
    for nbytes in (2232832, 2232832, 1000, 3 << 20, 200 << 20):
        assert 0 < memcpy_seconds(nbytes) < 10
    assert probed == [2232832, 1 << 20, 3 << 20, 64 << 20]  # once per size; the demo's 2.2 MB sync probes 2.2 MB
    assert memcpy_seconds(200 << 20) == pytest.approx(memcpy_seconds(100 << 20) * 2)  # scaled from 64 MiB
    assert memcpy_seconds(0) == 0.0


def test_received_checksums_must_match_what_was_sent():
    sent = [("a", [1.0, 2.0, 3]), ("b", [0.5, 0.25, 2])]
    check_received(sent, [("a", [1.0, 2.0, 3]), ("b", [0.5 + 1e-12, 0.25, 2])], "1")  # float noise passes
    with pytest.raises(WeightSyncError, match="b as the engine received it"):
        check_received(sent, [("a", [1.0, 2.0, 3]), ("b", [0.75, 0.25, 2])], "1")
    with pytest.raises(WeightSyncError, match="received 1 tensors, 2 were sent"):
        check_received(sent, sent[:1], "1")


class _Channel:
    """A channel that replays one manifest (a unit test of the receiver's size check)."""

    def __init__(self, manifest):
        self.messages = [manifest, []]

    def broadcast_plain(self, obj, src):
        return self.messages.pop(0)

    def broadcast(self, tensor, src):
        return tensor


def test_a_bucket_beyond_what_the_engine_takes_is_refused_before_allocation():
    big = [["w", [1 << 20, 64], "torch.float32"]]  # 256 MiB
    with pytest.raises(ValueError, match="at most 1048576"):
        list(received_weights(_Channel(big), src=0, max_bytes=1 << 20))
    small = [["w", [4, 4], "torch.float32"]]
    assert [n for n, _ in received_weights(_Channel(small), src=0, max_bytes=1 << 20)] == ["w"]
    # the largest bucket a push can make: a bucket, or a tensor larger than one (sent alone)
    meta = [ParamMeta("e", torch.float32, (1000, 100)), ParamMeta("w", torch.bfloat16, (10, 10))]
    assert largest_bucket_bytes(meta, 1 << 20) == 1 << 20
    assert largest_bucket_bytes(meta, 1000) == 400_000
