"""The rollout_func contract (dsgrpo/rollout/custom.py): a valid output becomes a Rollout plus reward columns;
every way of breaking the contract is a ValueError naming the key and row."""

import re

import numpy as np
import pytest

from dsgrpo.rollout.custom import CONTRACT, rollout_from_func_output

EOS = 2


def output(**override):
    """What a rollout_func returns for 2 prompts × 2 generations = 4 rows (prompts repeat, one row per completion)."""
    out = {
        "prompt_ids": [[10, 11], [10, 11], [20], [20]],
        "completion_ids": [[5, 6, EOS], [7, 8, 9], [5], []],
        "logprobs": [[-0.1, -0.2, -0.3], [-1.0, -1.5, -2.0], [-0.5], []],
        "answer": ["5", "5", "7", "7"],
    }
    out.update(override)
    return out


def test_valid_output_becomes_rollout_and_columns():
    rollout, columns = rollout_from_func_output(output(), 4, eos_token_id=EOS, max_tokens=3)
    assert rollout.prompt_ids == [[10, 11], [10, 11], [20], [20]]
    assert rollout.completion_ids == [[5, 6, EOS], [7, 8, 9], [5], []]
    assert rollout.sampler_logprobs == [[-0.1, -0.2, -0.3], [-1.0, -1.5, -2.0], [-0.5], []]
    # row 0 has max_tokens tokens but ends with eos; row 1 has max_tokens without eos: cut
    assert rollout.truncated == [False, True, False, False]
    assert rollout.tool_mask is None
    assert columns == {"answer": ["5", "5", "7", "7"]}
    # no eos id: max_tokens tokens is truncated whatever the last token; no max_tokens: nothing is
    assert rollout_from_func_output(output(), 4, max_tokens=3)[0].truncated == [True, True, False, False]
    assert rollout_from_func_output(output(), 4)[0].truncated == [False] * 4


def test_numpy_ids_and_tuples_are_accepted_as_python_numbers():
    out = output(completion_ids=[(np.int64(5),), [7], [5], []], logprobs=[[np.float32(-0.5)], [-1], [-0.5], []])
    rollout, _ = rollout_from_func_output(out, 4)
    assert rollout.completion_ids[0] == [5] and type(rollout.completion_ids[0][0]) is int
    assert rollout.sampler_logprobs[:2] == [[-0.5], [-1.0]] and type(rollout.sampler_logprobs[1][0]) is float


def test_env_mask_becomes_the_tool_mask_not_a_column():
    rollout, columns = rollout_from_func_output(output(env_mask=[[1, 0, 1], [1, 1, 1], [True], []]), 4)
    assert rollout.tool_mask == [[1, 0, 1], [1, 1, 1], [1], []]
    assert "env_mask" not in columns
    assert rollout.tensors(pad_id=0)["completion_mask"][0].tolist() == [1.0, 0.0, 1.0]


def test_restarts_become_the_rollouts_pieces_not_a_column_and_bad_ones_are_named():
    restarts = [[[1, [30, 31]]], [], [], []]  # row 0: tokens 1-2 were sampled after the prompt [30, 31]
    rollout, columns = rollout_from_func_output(output(restarts=restarts), 4)
    assert rollout.restarts == restarts and "restarts" not in columns
    assert rollout.tensors(pad_id=0)["restarts"] == restarts
    assert "restarts" not in rollout.tensors(pad_id=0, rows=slice(1, 4))  # no row of these restarts
    for bad, why in (
        ([[[0, [30]]], [], [], []], r"'restarts'\[0\]\[0\] is \[0, \[30\]\]"),  # at the start
        ([[[3, [30]]], [], [], []], r"'restarts'\[0\]\[0\]"),  # past the completion
        ([[[2, [30]], [1, [31]]], [], [], []], r"'restarts'\[0\]\[1\]"),  # not rising
        ([[[1, []]], [], [], []], "has no prompt ids"),
    ):
        with pytest.raises(ValueError, match=why):
            rollout_from_func_output(output(restarts=bad), 4)


def message(exc_info) -> str:
    return str(exc_info.value)


@pytest.mark.parametrize(
    "out, count, expected",
    [
        ([1, 2], 4, "rollout_func returned a list, not a dict."),
        (output(prompt_ids=None), 4, "rollout_func's 'prompt_ids' is a NoneType, not a list with one row per prompt."),
        (
            {k: v for k, v in output().items() if k != "logprobs"},
            4,
            "rollout_func's output has no 'logprobs' key (it has ['answer', 'completion_ids', 'prompt_ids']).",
        ),
        (
            output(),
            2,
            "rollout_func's 'prompt_ids' has 4 rows but it was given 2 prompts; it must return one row per "
            "prompt, in order.",
        ),
        (output(answer=["5"]), 4, "rollout_func's 'answer' has 1 rows but it was given 4 prompts"),
        (output(answer="5"), 4, "rollout_func's 'answer' is a str, not a list with one row per prompt."),
        (
            output(completion_ids=np.zeros((4, 3), dtype=int)),
            4,
            "rollout_func's 'completion_ids' is a ndarray, not a list with one row per prompt. "
            "Convert it with .tolist().",
        ),
        (
            output(completion_ids=[[5, 6, EOS], "789", [5], []]),
            4,
            "rollout_func's 'completion_ids'[1] is a str, not a list.",
        ),
        (
            output(completion_ids=[[5, 6, EOS], [7, 8.0, 9], [5], []]),
            4,
            "rollout_func's 'completion_ids'[1][1] is 8.0, not a token id (int).",
        ),
        (output(prompt_ids=[[10, 11], [10, 11], [20], []]), 4, "rollout_func's 'prompt_ids'[3] is empty"),
        (
            output(logprobs=[[-0.1, -0.2, -0.3], [-1.0, -1.5], [-0.5], []]),
            4,
            "rollout_func's 'logprobs'[1] has 2 values but 'completion_ids'[1] has 3 tokens: give the sampler's "
            "log-prob of each completion token, in order.",
        ),
        (
            output(logprobs=[[-0.1, None, -0.3], [-1.0, -1.5, -2.0], [-0.5], []]),
            4,
            "rollout_func's 'logprobs'[0][1] is None, not a log-probability (float).",
        ),
        (
            output(logprobs=[[-0.1, float("nan"), -0.3], [-1.0, -1.5, -2.0], [-0.5], []]),
            4,
            "rollout_func's 'logprobs'[0][1] is nan, not a log-probability (float).",
        ),
        (
            output(env_mask=[[1, 0], [1, 1, 1], [1], []]),
            4,
            "rollout_func's 'env_mask'[0] has 2 values but 'completion_ids'[0] has 3 tokens; it must hold one 0 or 1 "
            "per token of 'completion_ids'[0] (1 = sampled by the model, 0 = inserted by the environment).",
        ),
        (
            output(env_mask=[[1, 0, 2], [1, 1, 1], [1], []]),
            4,
            "rollout_func's 'env_mask'[0][2] is 2; it must hold one 0 or 1",
        ),
        (
            output(completions=["a"] * 4),
            4,
            "rollout_func's extra key 'completions' has the name of an argument the reward "
            "functions already get (prompts, completions, completion_ids); rename the key.",
        ),
    ],
)
def test_contract_violations_name_the_key_and_row(out, count, expected):
    with pytest.raises(ValueError) as e:
        rollout_from_func_output(out, count)
    assert message(e).startswith(expected)


def test_structural_errors_end_with_the_contract():
    with pytest.raises(ValueError) as e:
        rollout_from_func_output(output(logprobs=[[-0.1], [-1.0], [-0.5], []]), 4)
    assert message(e).endswith(CONTRACT)
    assert "one row per entry of `prompts` (one per completion; each prompt repeats num_generations times)" in CONTRACT


def test_checks_that_need_the_trainer():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "rollout_func's 'completion_ids'[0] has 3 tokens, more than max_completion_length=2: cut completions to "
            "trainer.args.max_completion_length in rollout_func, or raise max_completion_length."
        ),
    ):
        rollout_from_func_output(output(), 4, max_tokens=2)
    with pytest.raises(
        ValueError,
        match=re.escape("rollout_func's 'prompt_ids'[0][1] = 11 is not a token id of this model (vocabulary size 11)"),
    ):
        rollout_from_func_output(output(), 4, vocab_size=11)
    with pytest.raises(ValueError, match="rollout_func's extra key 'answer' is also a dataset column"):
        rollout_from_func_output(output(), 4, dataset_columns=["answer", "level"])
