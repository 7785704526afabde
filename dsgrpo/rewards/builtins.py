"""Built-in reward functions, with TRL's names and signatures: `f(completions, **columns) -> list[float | None]`.

Registered by name in BUILTIN_REWARDS, so `reward_funcs=["accuracy_reward", ...]` works from YAML too."""

from __future__ import annotations

import re
from typing import Callable, List, Optional

from ..algorithms.registry import Registry

BUILTIN_REWARDS: Registry = Registry("built-in reward")


def completion_text(completion) -> str:
    """A completion as text: plain strings as they are, conversational ones as their last message's content."""
    if isinstance(completion, list):
        return completion[-1]["content"] if completion else ""
    return completion


def gold_answer(solution: str) -> str:
    """GSM8K solutions end with '#### <answer>'; anything else is taken whole (LaTeX or a plain value)."""
    return solution.split("####")[-1].strip().replace(",", "") if "####" in solution else solution


@BUILTIN_REWARDS.register("reasoning_gym_reward")
def reasoning_gym_reward(completions, reasoning_gym_entry, **kwargs) -> List[Optional[float]]:
    """reasoning-gym's own score of the completion's <answer> (task:reasoning_gym rows carry their entry as JSON):
    its task's scorer, partial credit where the task gives it; 0.0 without an answer, and 0.0 for an answer its
    scorer cannot read: some scorers raise on what a policy can write (prime_factorization on "[[[[", coin_flip on
    "1e999999"), and a completion must not end the run."""
    import json

    from reasoning_gym import get_score_answer_fn
    from reasoning_gym.utils import extract_answer

    out: List[Optional[float]] = []
    for completion, raw in zip(completions, reasoning_gym_entry):
        entry = json.loads(raw)
        answer = extract_answer(completion_text(completion))
        score = get_score_answer_fn(entry["metadata"]["source_dataset"])
        try:
            out.append(0.0 if answer is None else float(score(answer, entry)))
        except Exception:  # noqa: BLE001 - reasoning-gym's scorer failed on this answer: it is not a right one
            out.append(0.0)
    return out


@BUILTIN_REWARDS.register("accuracy_reward")
def accuracy_reward(completions, solution, **kwargs) -> List[Optional[float]]:
    """1.0 when math-verify finds the completion's answer equal to the gold solution, else 0.0; None when the
    gold answer itself cannot be parsed (the example says nothing about this completion)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    out: List[Optional[float]] = []
    for completion, sol in zip(completions, solution):
        gold = parse(gold_answer(sol), extraction_config=configs)
        if not gold:
            out.append(None)
            continue
        text = gold_answer(completion_text(completion))  # a GSM8K-style "#### N" ending is the answer
        answer = parse(text, extraction_config=configs)
        out.append(float(bool(answer) and verify(gold, answer)))
    return out


_THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>\s*\S.*$", re.DOTALL)


@BUILTIN_REWARDS.register("think_format_reward")
def think_format_reward(completions, **kwargs) -> List[float]:
    """1.0 when the completion is one <think>…</think> block followed by a non-empty answer, else 0.0."""
    return [1.0 if _THINK.match(completion_text(c).strip()) else 0.0 for c in completions]


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Callable:
    """DAPO's soft overlong punishment as a reward function (TRL's factory name): 0 up to L_max - L_cache
    tokens, then a linear ramp to -1 at L_max, and -1 beyond. Needs `completion_ids`."""
    import torch

    from ..algorithms import soft_overlong_penalty

    def soft_overlong_punishment(completions, completion_ids, **kwargs) -> List[float]:
        lengths = torch.tensor([len(ids) for ids in completion_ids])
        return soft_overlong_penalty(lengths, max_completion_len, soft_punish_cache).tolist()

    return soft_overlong_punishment


def get_length_penalty(target_length: int, coefficient: float = 1e-3) -> Callable:
    """-coefficient · |tokens - target_length|: a gentle push toward a length budget."""

    def length_penalty(completions, completion_ids, **kwargs) -> List[float]:
        return [-coefficient * abs(len(ids) - target_length) for ids in completion_ids]

    return length_penalty
