"""Issue 28, one process: the pure parts of sequence parallelism (dsgrpo/sequence_parallel.py): how a packed step is
cut into shards, the block-diagonal causal attention the core attention gets over a gathered row, and the knob.
The group's forwards and gradients are checked on two ranks (tests/test_sp_dist.py)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dsgrpo import layout, sequence_parallel
from dsgrpo.sequence_parallel import SequenceParallel, requested_size, shard
from test_layout import LONG_TAILED, micro_batches, plan


@pytest.mark.parametrize("size", [2, 3, 4])
def test_shards_cover_the_step_and_each_scores_its_own_run(size):
    step = plan(micro_batches(LONG_TAILED), 10_000)[0][0]
    flat_ids, n = step.input_ids.reshape(-1), step.input_ids.numel()
    pieces = [shard(step, SequenceParallel(size, r, None, pad_id=7)) for r in range(size)]
    whole = torch.cat([p.input_ids[0] for p in pieces])
    assert whole.numel() % size == 0 and whole.numel() - n < size  # padded to a multiple of N, no more
    assert torch.equal(whole[:n], flat_ids) and (whole[n:] == 7).all()
    positions = torch.cat([p.position_ids[0] for p in pieces])
    assert (
        torch.equal(positions[:n], step.position_ids.reshape(-1))
        and (positions[n:] == torch.arange(whole.numel() - n)).all()
    )
    assert all(p.counts == pieces[0].counts for p in pieces) and sum(pieces[0].counts) == step.targets.numel()
    # each shard's runs, in member order, are the step's score order: positions and targets
    S = whole.numel() // size
    at = torch.cat([p.score_at + r * S for r, p in enumerate(pieces)])
    assert torch.equal(at, step.score_at) and torch.equal(torch.cat([p.targets for p in pieces]), step.targets)
    assert [p.score_at.numel() for p in pieces] == pieces[0].counts
    assert all(p.routes is None for p in pieces)


@pytest.mark.parametrize("size", [2, 3])
def test_a_moe_steps_routes_are_cut_with_its_tokens(size):
    """Routing replay: each shard's routes are those of its tokens, in the same order; the padding that makes the
    row a multiple of N has none (-1: routed by the trainer)."""
    step = plan(micro_batches(LONG_TAILED), 10_000)[0][0]
    R, L = step.input_ids.shape
    # a route that names its token: expert ids from the token's place in the row
    step.routes = torch.arange(R * L * 3 * 2).view(R, L, 3, 2)
    pieces = [shard(step, SequenceParallel(size, r, None, pad_id=7)) for r in range(size)]
    assert all(p.routes.shape == (1, p.input_ids.shape[1], 3, 2) for p in pieces)
    whole = torch.cat([p.routes[0] for p in pieces])
    assert torch.equal(whole[: R * L], step.routes.reshape(R * L, 3, 2)) and (whole[R * L :] == -1).all()


def test_the_core_attention_keeps_packed_sequences_apart():
    """sdpa over a gathered row of three packed sequences with the block-diagonal causal mask equals sdpa over each
    sequence alone."""
    g = torch.Generator().manual_seed(0)
    lengths = [5, 3, 6]
    q, k, v = (torch.randn(1, 2, sum(lengths), 8, generator=g) for _ in range(3))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = SimpleNamespace(is_causal=True, num_key_value_groups=1)
    out, _ = sequence_parallel._block_causal(sdpa_attention_forward)(module, q, k, v, None, position_ids=positions)
    assert out.shape == (1, sum(lengths), 2, 8)  # transformers' layout: [batch, length, heads, head_dim]
    at = 0
    for n in lengths:
        alone = F.scaled_dot_product_attention(
            q[:, :, at : at + n], k[:, :, at : at + n], v[:, :, at : at + n], is_causal=True
        )
        assert torch.allclose(out[:, at : at + n], alone.transpose(1, 2), atol=1e-6)
        at += n
    # one sequence: a single causal call
    whole, _ = sequence_parallel._block_causal(sdpa_attention_forward)(
        module, q, k, v, None, position_ids=torch.arange(14).unsqueeze(0)
    )
    assert torch.allclose(whole, F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2), atol=1e-6)


def test_the_knob_reads_parallelism_config_and_the_deepspeed_config():
    args = lambda pc: SimpleNamespace(parallelism_config=pc)  # noqa: E731
    assert requested_size(args(None), {}) == 1
    assert requested_size(args({"sp_backend": "deepspeed", "sp_size": 4}), {}) == 4
    assert requested_size(args(SimpleNamespace(sp_size=2, sp_backend="deepspeed", cp_size=1, tp_size=1)), {}) == 2
    assert requested_size(args(None), {"sequence_parallel_size": 8}) == 8
    assert requested_size(args({"sp_size": 2}), {"sequence_parallel_size": 2}) == 2
    with pytest.raises(ValueError, match="sp_backend='deepspeed'"):
        requested_size(args({"sp_size": 2, "sp_backend": "torch"}), {})
    with pytest.raises(ValueError, match="Two sequence-parallel sizes"):
        requested_size(args({"sp_size": 2}), {"sequence_parallel_size": 4})


def test_the_budget_is_per_rank_so_a_step_holds_n_times_it():
    assert layout.resolve_budget(None, 8, 100, 4000, sp_size=4) == 8 * 1025  # a padded micro-batch / N
    assert layout.resolve_budget(1100, 8, 100, 4000, sp_size=4) == 1100  # 4 shards of 1100 hold 4100
    with pytest.raises(ValueError, match=r"token_budget=1000 .* in 4 sequence-parallel shards.* at least 1025"):
        layout.resolve_budget(1000, 8, 100, 4000, sp_size=4)
    assert layout.TokenBudget(1100, 64, 0, SimpleNamespace(size=4)).step_tokens == 4400


def test_heads_and_world_are_checked_before_anything_loads():
    config = SimpleNamespace(get_text_config=lambda: SimpleNamespace(num_attention_heads=4, num_key_value_heads=2))
    args = SimpleNamespace(token_budget=None)
    sequence_parallel.check(2, args, 4, config, split=False)
    sequence_parallel.check(4, args, 4, config, split=False)  # 4 ranks share 2 key/value heads
    with pytest.raises(ValueError, match="4 query and 2 key/value heads"):
        sequence_parallel.check(8, args, 8, config, split=False)
    with pytest.raises(ValueError, match="world divisible"):
        sequence_parallel.check(2, args, 3, config, split=False)
    with pytest.raises(NotImplementedError, match="async_placement='split'"):
        sequence_parallel.check(2, args, 4, config, split=True)
