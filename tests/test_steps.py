"""The step arithmetic (dsgrpo/steps.py) against TRL 1.16's own: TRL's RepeatSampler gives the generation rounds of
an epoch and the length of each process's dataloader, transformers' Trainer.set_initial_training_values turns that
into optimizer steps, and its training loop's rule (every update takes gradient_accumulation_steps batches, the
last of an epoch what is left) says which micro-steps each optimizer step accumulates. Table-driven over
steps_per_generation, generation_batch_size, num_iterations, gradient_accumulation_steps, num_train_epochs,
max_steps and the world size."""

import itertools
import math
from types import SimpleNamespace

import pytest

from dsgrpo import GRPOConfig
from dsgrpo.steps import StepPlan

transformers = pytest.importorskip("transformers")
trl_utils = pytest.importorskip("trl.trainer.utils")


def trl_count(rows, world, per_device, G, spg, iters, GA, epochs, max_steps):
    """What TRL 1.16 does: (max_steps, batches per process per epoch, micro-steps of each optimizer step in order)."""
    generation_batch = per_device * world * spg
    sampler = trl_utils.RepeatSampler(
        list(range(rows)),
        mini_repeat_count=G,
        batch_size=generation_batch // G,
        repeat_count=iters * spg,
        shuffle=False,
    )
    # the sampler is global; each process's dataloader takes every world-th batch of per_device × spg samples
    batches_per_process = len(sampler) // (per_device * spg) // world
    stand_in = SimpleNamespace(
        get_total_train_batch_size=lambda a: per_device * GA * world,
        get_sp_size=lambda: 1,
        num_examples=lambda dl: len(sampler),
    )
    args = SimpleNamespace(max_steps=max_steps, gradient_accumulation_steps=GA, num_train_epochs=epochs)
    values = transformers.Trainer.set_initial_training_values(stand_in, args, range(batches_per_process))
    _, per_epoch, _, _, _, steps_in_epoch, total = values
    # transformers' _inner_training_loop: per epoch, updates of GA batches, the last one of the remainder
    remainder = steps_in_epoch % GA or GA
    windows = []
    while len(windows) < total:
        for update in range(per_epoch):
            windows.append(GA if update != per_epoch - 1 else remainder)
            if len(windows) == total:
                break
    return total, steps_in_epoch, windows


def plan_of(rows, world, per_device, G, spg, iters, GA, epochs, max_steps, generation_batch_size=None):
    args = GRPOConfig(
        per_device_train_batch_size=per_device,
        num_generations=G,
        num_iterations=iters,
        gradient_accumulation_steps=GA,
        num_train_epochs=epochs,
        max_steps=max_steps,
        **(
            {"generation_batch_size": generation_batch_size} if generation_batch_size else {"steps_per_generation": spg}
        ),
    )
    prompts_per_round = args.resolved_generation_batch_size(world) // G
    rounds = rows // prompts_per_round if rows >= prompts_per_round else rows / prompts_per_round
    return StepPlan.from_args(args, prompts_per_round, args.resolved_steps_per_generation(world), rounds)


def dsgrpo_windows(plan: StepPlan):
    """The micro-steps of each optimizer step as the update runs them: rounds of micro_per_round micro-steps, each
    micro-step's (accumulation, ends) from plan.window, stopping at max_steps."""
    windows, open_count, rounds = [], 0, 0
    while len(windows) < plan.max_steps:
        start = plan.round_start(rounds)
        for i in range(plan.micro_per_round):
            length, ends = plan.window(start + i)
            open_count += 1
            if ends:
                assert open_count == length, (rounds, i, open_count, length)
                windows.append(length)
                open_count = 0
                if len(windows) == plan.max_steps:
                    break
        rounds += 1
    return windows, rounds


# (rows, world, per_device, G, spg, iters, GA, epochs, max_steps)
CASES = [
    (17, 1, 6, 4, 4, 2, 3, 3, -1),  # TRL's test_prepare_input_called_with_correct_data: 48 training_step calls
    (17, 1, 6, 4, 4, 2, 3, 3, 10),
    (17, 1, 6, 4, 4, 2, 3, 1.5, -1),
    (100, 2, 4, 4, 3, 1, 2, 2, -1),
    (100, 2, 4, 8, 2, 3, 4, 1, -1),
    (64, 2, 4, 4, 1, 1, 1, 2, -1),
    (64, 2, 4, 4, 8, 1, 8, 1, 20),
    (30, 1, 4, 4, 5, 2, 3, 2.5, -1),
]
CASES += [
    (rows, world, 4, 4, spg, iters, GA, epochs, max_steps)
    for rows, world, spg, iters, GA, epochs, max_steps in itertools.product(
        (13, 40), (1, 2), (1, 2, 3, 4), (1, 2), (1, 2, 3, 5), (1, 2.5), (-1, 7)
    )
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_steps_and_accumulation_are_trls(case):
    rows, world, per_device, G, spg, iters, GA, epochs, max_steps = case
    total, batches_per_epoch, trl_windows = trl_count(*case)
    plan = plan_of(*case)
    if plan.rounds_per_epoch is None:  # fewer prompts than a round: TRL's sampler yields nothing to train on
        assert batches_per_epoch == 0
        return
    assert plan.micro_per_epoch == batches_per_epoch
    assert plan.max_steps == total
    windows, _ = dsgrpo_windows(plan)
    assert windows == trl_windows
    assert plan.training_steps() == sum(trl_windows)  # training_step calls
    assert plan.steps_after(plan.rounds_for(total)) >= total > plan.steps_after(plan.rounds_for(total) - 1)


def test_the_trl_test_counts_48_micro_steps_in_18_optimizer_steps():
    plan = plan_of(17, 1, 6, 4, 4, 2, 3, 3, -1)
    assert (plan.rounds_per_epoch, plan.micro_per_epoch, plan.steps_per_epoch) == (2, 16, 6)
    assert (plan.max_steps, plan.training_steps(), plan.rounds_for(plan.max_steps)) == (18, 48, 6)
    # the sixth step of each epoch takes the one micro-step left, and divides its loss by 1
    assert [plan.window(p) for p in (14, 15, 16)] == [(3, True), (1, True), (3, False)]
    text = plan.describe(17, 4, "linear", 0)
    assert "2 round(s) an epoch (5 left out" in text and "6 optimizer steps (5 × 3 + 1 × 1" in text
    assert "18 optimizer steps in 6 round(s), 48 micro-steps" in text and "ends its schedule at step 18" in text


def test_generation_batch_size_sets_the_round_as_trl_does():
    a = plan_of(40, 2, 4, 4, None, 1, 2, 1, -1, generation_batch_size=24)  # spg 3 on 2 ranks
    b = plan_of(40, 2, 4, 4, 3, 1, 2, 1, -1)
    assert a == b and a.prompts_per_round == 6 and a.micro_per_round == 3


def test_without_epochs_steps_span_rounds_and_never_shorten():
    stream = StepPlan(prompts_per_round=4, rounds_per_epoch=None, micro_per_round=3, accumulation=2, max_steps=9)
    assert [stream.window(p) for p in range(4)] == [(2, False), (2, True), (2, False), (2, True)]
    assert stream.steps_after(3) == 4 and stream.rounds_for(9) == 6 and stream.training_steps() == 18
    small = plan_of(1, 1, 4, 4, 2, 1, 1, 2, -1)  # 1 prompt, 2 a round: read round after round
    assert small.rounds_per_epoch is None and small.max_steps == 2  # ceil(2 epochs × 0.5) rounds × 2 steps
    assert "fewer than a round" in small.describe(1, 4, "linear", 0)


def test_round_start_restarts_each_epoch():
    plan = plan_of(17, 1, 6, 4, 4, 2, 3, 3, -1)
    assert [plan.round_start(r) for r in range(5)] == [0, 8, 0, 8, 0]
    assert math.isclose(plan.fractional_rounds_per_epoch, 2.0)
