"""What evaluations report beyond the mean reward (dsgrpo/evaluation.py): the unbiased pass@k estimator against
exact enumeration, pass@k / avg@n of prompt groups, the config's checks. Pure functions; the 2-rank run that logs
them is tests/dist_scripts/api_checks.py's best_model check."""

import itertools
import math

import pytest
import torch

from dsgrpo import GRPOConfig
from dsgrpo.evaluation import check, pass_at_k, sample_metrics


@pytest.mark.parametrize("n, c", [(8, 0), (8, 1), (8, 3), (8, 8), (5, 2), (16, 7)])
def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_correct_one(n, c):
    samples = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        draws = list(itertools.combinations(range(n), k))
        exact = sum(any(samples[i] for i in d) for d in draws) / len(draws)
        assert abs(pass_at_k(n, c, k) - exact) < 1e-12, (n, c, k)
        assert abs(pass_at_k(n, c, k) - (1 - math.comb(n - c, k) / math.comb(n, k))) < 1e-12
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)  # pass@1 is the fraction correct


def test_group_metrics_average_over_prompts_and_count_a_missing_reward_as_wrong():
    # two prompts of 4 samples: rewards 1, 0, 0.5, 1 and 0, 0, None, 2 (None: a reward function abstained)
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, float("nan"), 2.0])
    out = sample_metrics(rewards, rewards, 4, [1, 2, 4], threshold=1.0)
    # correct: 2 of 4 and 1 of 4
    assert out["pass@1"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert out["pass@2"] == pytest.approx((pass_at_k(4, 2, 2) + pass_at_k(4, 1, 2)) / 2)
    assert out["pass@4"] == pytest.approx(1.0)
    assert out["avg@4"] == pytest.approx((1 + 0 + 0.5 + 1 + 0 + 0 + 2) / 7)
    # correctness decided by another column (one function's), the average still of the totals
    verdicts = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    out = sample_metrics(rewards, verdicts, 4, [1], threshold=0.5)
    assert out["pass@1"] == pytest.approx(0.5) and out["avg@4"] == pytest.approx(4.5 / 7)


def test_the_config_refuses_a_k_an_evaluation_cannot_draw_and_an_unknown_correctness_reward():
    assert GRPOConfig(num_generations=8, eval_pass_at_k=[1, 8]).eval_pass_at_k == [1, 8]
    with pytest.raises(
        ValueError,
        match=r"eval_pass_at_k=\[1, 16\]: each k must be a whole number from 1 to the 8 "
        r"samples",
    ):
        GRPOConfig(num_generations=8, eval_pass_at_k=[1, 16])
    assert GRPOConfig(num_generations=2, num_generations_eval=8, eval_pass_at_k=[8]).eval_pass_at_k == [8]
    with pytest.raises(ValueError, match="each k must be a whole number"):
        GRPOConfig(num_generations=8, eval_pass_at_k=[0])
    args = GRPOConfig(eval_pass_at_k=[1], eval_correctness_reward="accuracy")
    assert check(args, ["format", "accuracy"]) == 1
    with pytest.raises(
        ValueError,
        match=r"eval_correctness_reward='accuracy' is not one of this run's reward "
        r"functions \['format'\]",
    ):
        check(args, ["format"])
    assert check(GRPOConfig(), ["format"]) is None


def test_greedy_evaluation_draws_one_completion_per_prompt_and_refuses_more():
    from dsgrpo.evaluation import eval_group, eval_sampling, metric_names
    from dsgrpo.rollout.base import SamplingConfig

    args = GRPOConfig(num_generations=8, eval_do_sample=False, eval_pass_at_k=[1])
    assert eval_group(args) == 1 and eval_group(GRPOConfig(num_generations=8)) == 8
    assert metric_names(args, [""], ["f"])[-2:] == ["eval_pass@1", "eval_avg@1"]
    training = SamplingConfig(max_tokens=16, temperature=0.7, top_p=0.9)
    assert eval_sampling(training, args) == SamplingConfig(max_tokens=16, temperature=0.0, top_p=0.9)
    assert eval_sampling(training, GRPOConfig()) is training and training.temperature == 0.7
    with pytest.raises(
        ValueError, match="eval_do_sample=False draws one greedy completion per prompt, but num_generations_eval=4"
    ):
        GRPOConfig(eval_do_sample=False, num_generations_eval=4)
    with pytest.raises(ValueError, match=r"eval_pass_at_k=\[1, 4\]: each k must be a whole number from 1 to the 1 "):
        GRPOConfig(eval_do_sample=False, eval_pass_at_k=[1, 4])


def test_majority_vote_follows_the_most_common_answer_in_sets_of_k():
    from dsgrpo.evaluation import final_answer, majority_metrics

    assert final_answer("so the total is #### 1,024") == "1024"
    assert final_answer("The answer is $\\frac{1}{2}$") == "1/2"
    assert final_answer("no number here") is None
    # prompt 0: answers 7, 7, 3, None; only the 3 is correct: the vote (7) is wrong
    # prompt 1: answers 5, 2, 2, 5; the 5s are correct: a 2-2 tie goes to the first voted (5), right
    answers = ["7", "7", "3", None, "5", "2", "2", "5"]
    correct = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    out = majority_metrics(answers, correct, 4, [1, 2, 4], 1.0)
    assert out["maj@4"] == 0.5
    # k=2: sets (7,7) wrong, (3,None) right, (5,2) tie -> 5 right, (2,5) tie -> 2 wrong
    assert out["maj@2"] == 0.5
    # k=1: each sample alone; the abstaining correct sample counts as wrong
    assert out["maj@1"] == 3 / 8
    nan = majority_metrics(["1", "1"], torch.tensor([float("nan"), 1.0]), 2, [2], 1.0)
    assert nan["maj@2"] == 1.0  # a correct sample holds the winning answer
    with pytest.raises(ValueError, match=r"eval_maj_at_k=\[8\]: each k must be a whole number from 1 to the 4 "):
        GRPOConfig(num_generations=4, eval_maj_at_k=[8])
