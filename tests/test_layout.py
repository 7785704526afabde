"""Issue 27, one process: packed layout (dsgrpo/layout.py), the packed forward against the padded one on a real tiny
model, and the per-token loss weights that keep each loss type's normaliser."""

import random

import pytest
import torch

from dsgrpo import layout
from dsgrpo.algorithms import LOSS_TYPES, aggregation_weights, entropy_bonus_weights, policy_loss
from dsgrpo.engines.forward import packed_forward, policy_forward
from dsgrpo.rollout.base import Rollout


def micro_batches(lengths, B=4, pad=0, seed=0):
    """Padded micro-batches (Rollout.tensors) of random prompts and completions of the given lengths."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 200) for _ in range(rng.randrange(2, 7))] for _ in lengths]
    completions = [[rng.randrange(5, 200) for _ in range(n)] for n in lengths]
    rollout = Rollout(prompts, completions, [[-1.0] * n for n in lengths], [False] * len(lengths))
    return [rollout.tensors(pad, slice(s, s + B)) for s in range(0, len(lengths), B)]


LONG_TAILED = [1, 3, 2, 30, 5, 1, 4, 2, 7, 1, 25, 3, 2, 6, 1, 9]


def plan(micro, budget, groups=None):
    widths = [mb["completion_mask"].shape[1] for mb in micro]
    groups = groups or [list(range(len(micro)))]
    return layout.plan_steps([layout.sequences_of(micro, g) for g in groups], budget, 64, 0, widths)


def test_packed_steps_hold_every_sequence_once_within_the_budget():
    micro = micro_batches(LONG_TAILED)
    for budget in (40, 64, 200):
        (steps,) = plan(micro, budget)
        seen = sorted((s.micro, s.row) for st in steps for s in st.sequences)
        assert seen == [(j, b) for j in range(len(micro)) for b in range(4)]
        longest = max(s.length for st in steps for s in st.sequences)
        for st in steps:
            assert st.tokens <= budget and st.input_ids.shape[1] <= longest
            # positions restart at each sequence; each scored state is the one before its target
            assert (st.input_ids.reshape(-1)[st.score_at + 1] == st.targets).all()
            for s in st.sequences:
                assert s.length == s.prompt_len + s.completion_len
    # a bigger budget never needs more steps, and packs more than one sequence a row
    assert len(plan(micro, 200)[0]) < len(plan(micro, 40)[0])
    assert any(len(st.sequences) > st.input_ids.shape[0] for st in plan(micro, 200)[0])


def test_steps_are_balanced_by_cost_and_a_group_with_nothing_gets_a_stand_in():
    micro = micro_batches([20, 20, 20, 20, 2, 2, 2, 2])
    (steps,) = plan(micro, 60)
    loads = [sum(layout.sequence_cost(s.length, 64) for s in st.sequences) for st in steps]
    assert max(loads) - min(loads) <= max(layout.sequence_cost(s.length, 64) for st in steps for s in st.sequences)
    empty_micro = micro_batches([0, 0, 0, 0])  # nothing to score: no sequence, one stand-in step
    (stand_in,) = plan(empty_micro, 60)
    assert len(stand_in) == 1 and stand_in[0].empty and stand_in[0].tokens == 1


def test_scatter_and_rows_put_values_back_where_the_padded_layout_has_them():
    micro = micro_batches(LONG_TAILED)
    (steps,) = plan(micro, 64)
    truth = [
        torch.randn(mb["completion_mask"].shape) * mb["attention_mask"][:, -mb["completion_mask"].shape[1] :]
        for mb in micro
    ]
    flat = [torch.cat([truth[s.micro][s.row, : s.completion_len] for s in st.sequences]) for st in steps]
    back = layout.scatter(steps, flat, [t.shape for t in truth])
    assert all(torch.equal(a, b) for a, b in zip(back, truth))
    for st, f in zip(steps, flat):
        assert torch.equal(st.rows(f), st.gather(truth))


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    from dsgrpo.testing import tiny_model

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32, attn_implementation="sdpa")


def test_a_packed_forward_gives_the_padded_forwards_log_probs_and_entropies(model):
    micro = micro_batches(LONG_TAILED)
    (steps,) = plan(micro, 48)
    with torch.no_grad():
        padded = [
            policy_forward(
                model,
                mb["input_ids"],
                mb["attention_mask"],
                mb["completion_mask"].shape[1],
                temperature=0.7,
                with_entropy=True,
            )
            for mb in micro
        ]
        packed = [packed_forward(model, st, temperature=0.7, with_entropy=True) for st in steps]
    shapes = [f.logps.shape for f in padded]
    for name in ("logps", "entropy"):
        back = layout.scatter(steps, [getattr(f, name) for f in packed], shapes)
        for a, b in zip(back, padded):
            assert (a - getattr(b, name)).abs().max() <= 1e-5


def test_a_row_that_restarts_trains_each_piece_after_its_own_prompt(model):
    """Rollout.restarts (an agent that rewrote its history): the row's completion from token `at` on was sampled after
    a prompt of its own. Packed, each piece is scored after its own prompt — the log-probs the padded forward gives
    each piece as a row of its own — and lands in its own columns of the logical row."""
    first, second, third = [11, 12, 13], [40, 41, 42, 43, 44], [70, 71]
    c1, c2, c3 = [20, 21, 22, 23], [50, 51, 52], [80, 81, 82, 83, 84]
    row = Rollout([first], [c1 + c2 + c3], [[-1.0] * 12], [False], restarts=[[[4, second], [7, third]]])
    alone = Rollout([first, second, third], [c1, c2, c3], [[-1.0] * 4, [-1.0] * 3, [-1.0] * 5], [False] * 3)
    micro = [row.tensors(0)]
    (steps,) = plan(micro, 64)
    pieces = steps[0].sequences
    assert [(s.ids.tolist(), s.prompt_len, s.first) for s in sorted(pieces, key=lambda s: s.first)] == [
        (first + c1, 3, 0),
        (second + c2, 5, 4),
        (third + c3, 2, 7),
    ]
    with torch.no_grad():
        packed = [packed_forward(model, st, temperature=0.7) for st in steps]
        mb = alone.tensors(0)
        separate = policy_forward(model, mb["input_ids"], mb["attention_mask"], 5, temperature=0.7).logps
    (back,) = layout.scatter(steps, [f.logps for f in packed], [micro[0]["completion_mask"].shape])
    expected = torch.cat([separate[0, :4], separate[1, :3], separate[2, :5]])
    assert (back[0] - expected).abs().max() <= 1e-5
    # rows() and gather() agree column by column; a piece's gathered row holds only its own columns
    truth = torch.arange(1.0, 13.0).unsqueeze(0)
    flat = torch.cat([truth[0, s.first : s.first + s.completion_len] for s in steps[0].sequences])
    assert torch.equal(steps[0].rows(flat), steps[0].gather([truth]))
    assert torch.equal(layout.scatter(steps, [flat], [truth.shape])[0], truth)
    # the padded layout would read the pieces as one context: a MoE route replay cannot be given for their prompts
    with pytest.raises(ValueError, match="routing_replay='off'"):
        layout.sequences_of([{**micro[0], "routes": torch.zeros(1, 15, 1, 1)}])


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES.names()))
def test_token_weights_give_each_loss_type_its_micro_batch_normaliser(loss_type):
    """The loss of a micro-batch equals the sum of its rows' weighted losses however the rows are split."""
    torch.manual_seed(1)
    B, T = 4, 6
    mask = (torch.rand(B, T) > 0.3).float()
    logps = (torch.randn(B, T) * 0.1 - 2).requires_grad_()
    old, adv = logps.detach() + torch.randn(B, T) * 0.05, torch.randn(B)
    ent = torch.rand(B, T).requires_grad_()
    common = dict(
        loss_type=loss_type,
        max_completion_length=T,
        num_items_in_batch=torch.tensor(40.0),
        num_processes=2,
        gradient_accumulation_steps=3,
        importance_sampling_level="sequence",
        entropies=ent,
        entropy_coef=0.1,
    )
    whole, _ = policy_loss(logps, old, adv, mask, **common)
    weights = aggregation_weights(
        loss_type,
        mask,
        max_completion_length=T,
        num_items_in_batch=torch.tensor(40.0),
        num_processes=2,
        gradient_accumulation_steps=3,
    )
    bonus = entropy_bonus_weights(mask, None, 3)
    parts = [
        policy_loss(
            logps[rows],
            old[rows],
            adv[rows],
            mask[rows],
            token_weights=weights[rows],
            bonus_weights=bonus[rows],
            **{**common, "entropies": ent[rows]},
        )[0]
        for rows in ([0, 2], [1], [3])
    ]
    assert sum(parts).item() == pytest.approx(whole.item(), abs=1e-6)
    g_whole = torch.autograd.grad(whole, (logps, ent))
    g_parts = torch.autograd.grad(sum(parts), (logps, ent))
    for a, b in zip(g_whole, g_parts):
        assert (a - b).abs().max() <= 1e-6


def test_the_budget_is_planned_or_refused_before_training():
    assert layout.resolve_budget(None, 8, 100, 400) == 8 * 500  # one padded micro-batch's worth
    assert layout.resolve_budget(0, 8, 100, 400) is None  # padded micro-batches
    assert layout.resolve_budget(-1, 8, 100, 400) is None
    assert layout.resolve_budget(600, 8, 100, 400) == 600
    with pytest.raises(ValueError, match=r"token_budget=300 .* 500 tokens \(longest prompt 100 \+ max_completion_len"):
        layout.resolve_budget(300, 8, 100, 400)
