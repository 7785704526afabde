"""Issue 26: user code that copies, sums and takes norms of trainer.model's parameters never breaks training and
changes nothing, in one process and over two ranks, with deepspeed 'auto' (whole parameters: the plan fits them)
and with a ZeRO-3 config that really shards.
One launch of tests/dist_scripts/param_reads_checks.py per world size."""

import json

import pytest

from launch import part, side_by_side, torchrun

pytestmark = pytest.mark.dist


def launch(tmp_path_factory, nproc: int) -> list:
    out = tmp_path_factory.mktemp(f"reads{nproc}")
    torchrun("tests/dist_scripts/param_reads_checks.py", str(out), nproc=nproc, timeout=900)
    return [json.load(open(out / f"result-{r}.json")) for r in range(nproc)]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    # the 1-rank launch keeps one core busy: beside the 2-rank one it costs about half its time
    return side_by_side(lambda: launch(tmp_path_factory, 1), lambda: launch(tmp_path_factory, 2))


@pytest.fixture(scope="module")
def one(worlds):
    return worlds[0]


@pytest.fixture(scope="module")
def two(worlds):
    return worlds[1]


@pytest.mark.parametrize("world", ["one", "two"])
def test_reading_the_parameters_changes_nothing(world, request):
    results = request.getfixturevalue(world)
    for name, stage in (("auto", 2), ("sharded_zero3", 3)):  # auto: the plan fits whole weights in both worlds
        for run in part(results, name):
            assert run["stage"] == stage, (name, run["stage"])
            assert run["moved"] > 1e-3, (name, run)  # it trained
            assert run["max_diff"] <= 1e-7, (name, run)  # and the reads changed nothing
            assert run["losses"] == run["losses_plain"] and len(run["losses"]) == 3


def test_a_world_of_one_holds_real_weights_that_move_like_trls_tests_expect(one):
    (run,) = part(one, "trl_pattern")
    assert run["stage"] == 2 and run["ref_stage"] == 0
    assert run["empty"] == [] and run["unchanged"] == []
    assert run["ref_is_module"] and run["no_ref_at_beta_0"]
    assert run["ref_unchanged"] == []  # sync_ref_model mixed the policy into the (whole) reference


@pytest.mark.parametrize("world", ["one", "two"])
def test_training_step_is_called_per_micro_step_with_the_round_rows(world, request):
    results = request.getfixturevalue(world)
    for rank, run in enumerate(part(results, "training_step")):
        rounds = 6 if world == "one" else 3  # 3 epochs of 17 // 6 rounds, or of 17 // 12 over two ranks
        assert run["rounds"] == rounds and run["epoch"] == 3.0
        assert run["calls"] == rounds * 4 * 2 and run["model_is_policy"]  # steps_per_generation 4 × num_iterations 2

        # each rank's 24 completions of a round: 6 prompts, each num_generations = 4 times, in dataset order
        def rows(first_prompt):
            return [f"p{i:02d}" for i in range(first_prompt, first_prompt + 6) for _ in range(4)]

        assert run["first"] == rows(6 * rank)
        # the 9th call opens round 2: prompts 6-11 in one process; over two ranks epoch 2, which starts again at 0
        assert run["ninth"] == rows(6 if world == "one" else 6 * rank)


def test_a_gemma2_policy_syncs_into_vllm_with_soft_capped_logits(one):
    (run,) = part(one, "gemma2_vllm")
    assert run["moved"] > 1e-3
    assert max(abs(a - b) for a, b in zip(run["policy"], run["vllm"])) <= 1e-4, run


def test_two_ranks_hold_real_weights_by_default_and_zero3_really_empties_them(two):
    for run in part(two, "trl_pattern"):  # deepspeed 'auto': the plan fits whole weights, so ZeRO-2
        assert run["stage"] == 2 and run["ref_stage"] == 0
        assert run["empty"] == [] and run["unchanged"] == [] and run["ref_unchanged"] == []
        assert run["ref_is_module"] and run["no_ref_at_beta_0"]
    for run in part(two, "trl_pattern_zero3"):
        assert run["stage"] == 3 and run["ref_stage"] == 3
        assert run["empty"]  # outside a gather a partitioned parameter is empty: what whole weights avoid
        assert run["ref_is_module"]
