"""What an evaluation reports beyond the mean reward: pass@k and avg@n over the `num_generations_eval` samples of
each prompt, the way reasoning-RL papers, verl and OpenRLHF report them.

A completion counts as correct when its reward reaches `eval_correct_threshold` (1.0 by default: a verifier's
"right"), the reward being one function's (`eval_correctness_reward`) or the weighted total (what eval_reward
averages). pass@k is Chen et al.'s unbiased estimator (Codex paper, 2021): with n samples of a prompt of which c
are correct, 1 - C(n-c, k) / C(n, k), the chance that k samples drawn without replacement hold a correct one,
averaged over prompts. avg@n is the mean reward over all n samples of every prompt. With eval_do_sample=False an
evaluation draws one greedy completion per prompt (temperature 0): pass@1 is the greedy accuracy.

maj@k (self-consistency, Wang et al. 2022; verl's maj@N): the samples of a prompt vote with their final answer (as
math-verify parses it, the way accuracy_reward reads it; a sample without one abstains), and the vote is right when
a sample holding the winning answer is correct. Each prompt's n samples are cut into n // k consecutive sets of k
(a deterministic stand-in for verl's bootstrap) and the votes averaged; ties go to the answer voted first.

Evaluation never moves the training's random streams: its completions are seeded per slot (rollout/sources.py) and
vLLM draws from per-request generators, so a run with evaluations trains exactly as one without."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch

from .config_checks import eval_group  # the config's rule, used by evaluate() and the trainer


def eval_sampling(sampling, args):
    """The sampling of an evaluation: the training's, or greedy (temperature 0) with eval_do_sample=False."""
    return sampling if args.eval_do_sample else dataclasses.replace(sampling, temperature=0.0)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt: n samples, c of them correct."""
    if n - c < k:
        return 1.0
    # 1 - prod_{i=n-c+1}^{n} (1 - k / i): the binomial ratio without the huge factorials
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def sample_metrics(
    rewards: torch.Tensor, correctness: torch.Tensor, group: int, ks: List[int], threshold: float
) -> Dict[str, float]:
    """`rewards` [N] (the weighted totals) and `correctness` [N] (the rewards that decide right / wrong) of N
    completions in prompt groups of `group` consecutive rows → {"pass@k": ..., "avg@n": ...}. A reward of None
    (NaN) counts as wrong and is left out of avg@n."""
    correct = (torch.nan_to_num(correctness, nan=float("-inf")) >= threshold).view(-1, group)
    counts = correct.sum(dim=1).tolist()
    out = {f"pass@{k}": sum(pass_at_k(group, int(c), k) for c in counts) / len(counts) for k in ks}
    out[f"avg@{group}"] = torch.nanmean(rewards).item()
    return out


def final_answer(completion) -> Optional[str]:
    """The answer a completion votes for in maj@k: math-verify's reading of its final answer (a GSM8K-style "#### N"
    ending first), as a string; None when it states none."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    from .rewards.builtins import completion_text, gold_answer

    parsed = parse(
        gold_answer(completion_text(completion)), extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()]
    )
    return str(parsed[0]) if parsed else None


def majority_metrics(
    answers: List[Optional[str]], correctness: torch.Tensor, group: int, ks: List[int], threshold: float
) -> Dict[str, float]:
    """maj@k for each k over N samples in prompt groups of `group` consecutive rows: `answers` [N] (None abstains),
    `correctness` [N] (NaN counts as wrong)."""
    correct = (torch.nan_to_num(correctness, nan=float("-inf")) >= threshold).tolist()
    out = {}
    for k in ks:
        scores = []
        for start in range(0, len(answers), group):
            for first in range(start, start + (group // k) * k, k):
                votes: Dict[str, List[int]] = {}
                for i in range(first, first + k):
                    if answers[i] is not None:
                        votes.setdefault(answers[i], []).append(i)
                if not votes:
                    scores.append(0.0)
                    continue
                winner = max(votes.values(), key=len)  # dicts keep insertion order: a tie goes to the first voted
                scores.append(float(any(correct[i] for i in winner)))
        out[f"maj@{k}"] = sum(scores) / len(scores)
    return out


def metric_names(args, eval_sets: List[str], reward_names: List[str]) -> List[str]:
    """Every metric an evaluation of this run logs (eval_reward, per function, pass@k, avg@n), by eval set."""
    group = eval_group(args)
    keys = ["reward", *(f"rewards/{r}/mean" for r in reward_names)]
    if args.eval_pass_at_k:
        keys += [*(f"pass@{k}" for k in args.eval_pass_at_k), f"avg@{group}"]
    keys += [f"maj@{k}" for k in args.eval_maj_at_k or []]
    return [f"{f'eval_{name}_' if name else 'eval_'}{key}" for name in eval_sets for key in keys]


def check(args, reward_names: List[str]) -> Optional[int]:
    """Refuse, before anything loads, an eval_correctness_reward that is not one of the run's reward functions;
    the column of the reward that decides correctness (None: the weighted total)."""
    name = args.eval_correctness_reward
    if name is None:
        return None
    if name not in reward_names:
        raise ValueError(
            f"eval_correctness_reward={name!r} is not one of this run's reward functions "
            f"{reward_names}. Set it to one of them, or None for the weighted total."
        )
    return reward_names.index(name)
