"""Rewards: the stack that evaluates reward functions into an [N, K] matrix."""

from .stack import RewardStack, reward_name

__all__ = ["RewardStack", "reward_name"]
