"""Rewards: the stack that turns reward sources into an [N, K] matrix, built-in rewards, reward models, remote
scorers and the code-execution sandbox."""

from .builtins import (
    BUILTIN_REWARDS,
    accuracy_reward,
    get_length_penalty,
    get_soft_overlong_punishment,
    think_format_reward,
)
from .remote import RemoteReward, RemoteRewardError
from .sandbox import code_reward
from .stack import RewardError, RewardStack, reward_name

BUILTIN_REWARDS.register("code_reward")(code_reward)

__all__ = [
    "RewardStack",
    "RewardError",
    "reward_name",
    "accuracy_reward",
    "think_format_reward",
    "code_reward",
    "get_soft_overlong_punishment",
    "get_length_penalty",
    "RemoteReward",
    "RemoteRewardError",
    "BUILTIN_REWARDS",
]
