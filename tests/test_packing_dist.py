"""Issue 27: packed token-budget steps train exactly as padded micro-batches do, for every loss type and the options
that touch the normalisers, in one process and over two ZeRO-3 ranks whose rows differ in length (rank 0 all long,
rank 1 all short: unequal packed step counts would hang ZeRO-3). One launch of tests/dist_scripts/packing_checks.py
per world size."""

import json

import pytest

from launch import part, side_by_side, torchrun

pytestmark = pytest.mark.dist

LR = 0.05  # SGD: a parameter's change is LR x its gradient, so PARAM_TOL / LR bounds the gradients' difference
GRAD_TOL = 1e-5


def launch(tmp_path_factory, nproc: int) -> list:
    out = tmp_path_factory.mktemp(f"packing{nproc}")
    torchrun("tests/dist_scripts/packing_checks.py", str(out), nproc=nproc, timeout=900)
    return [json.load(open(out / f"result-{r}.json")) for r in range(nproc)]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    # the 1-rank launch keeps one core busy: beside the 2-rank one it costs about half its time
    return side_by_side(lambda: launch(tmp_path_factory, 1), lambda: launch(tmp_path_factory, 2))


@pytest.fixture(scope="module", params=[1, 2], ids=["one", "two"])
def results(request, worlds):
    return worlds[request.param - 1]


def assert_same_training(run):
    padded, packed = run["padded"], run["packed"]
    assert run["param_diff"] / LR <= GRAD_TOL  # the gradients of every optimizer step, through SGD's updates
    assert packed["steps"] == padded["steps"]
    assert packed["loss"] == pytest.approx(padded["loss"], abs=1e-5)
    assert packed["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-5)
    assert packed["entropy"] == pytest.approx(padded["entropy"], abs=1e-5)
    for a, b in zip(padded["logps"], packed["logps"]):  # old-policy and reference log-probs, token by token
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= 1e-5


@pytest.mark.parametrize("name", ["dapo_iterations_ref_entropy", "gspo_window_across_rounds", "zero3_sharded"])
def test_packed_steps_train_as_padded_micro_batches_do(results, name):
    runs = part(results, name)
    for run in runs:
        assert_same_training(run)
        assert run["padded"]["logps"] or name == "zero3_sharded"  # those runs computed old / reference log-probs
    # every rank ran the same number of packed micro-steps (rank 1's short rows needed fewer: it ran stand-ins)
    assert len({run["packed"]["micro_steps"] for run in runs}) == 1


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "luspo", "cispo", "sapo", "vespo"])
def test_every_loss_type_keeps_its_normaliser_when_packed(results, loss_type):
    for run in part(results, "other_loss_types"):
        assert_same_training(run[loss_type])


def test_a_budget_smaller_than_a_sequence_is_refused_with_both_numbers(results):
    for run in part(results, "budget_errors"):
        assert "token_budget=20" in run["message"] and "43 tokens" in run["message"]


def test_the_default_packs_only_where_attention_keeps_packed_sequences_apart(results):
    """token_budget=None (the default) plans a budget for qwen2 and falls back to padded micro-batches for OPT,
    whose attention spans the packed row; token_budget=64 on OPT is refused, naming the model and the fix."""
    for run in part(results, "attention_that_leaks"):
        assert run["qwen2_None"]["budget"] > 0
        assert run["opt_None"]["budget"] is None
        message = run["opt_64"]["error"]
        assert "token_budget=64" in message and "OPTForCausalLM" in message and "token_budget=0" in message
