"""DAPO's helpers (arXiv:2503.14476) and the KL-in-reward alternative to a KL loss term."""

from __future__ import annotations

import torch

from typing import List, Optional, Sequence

from .advantages import is_zero_std, nan_std, weighted_sum
from .kl import kl_divergence


def zero_std_groups(rewards: torch.Tensor, group_size: int, weights: Optional[Sequence[float]] = None) -> List[bool]:
    """For each group of `rewards` [n·G, K] (or [n·G]): do its weighted rewards all agree (no learning signal)?
    The trainer's own test (compute_advantages' frac_reward_zero_std): an all-NaN row is unknown, not 0, and a
    group with fewer than two known rewards has no spread."""
    if rewards.dim() == 1:
        rewards = rewards.unsqueeze(1)
    w = torch.tensor(weights if weights is not None else [1.0] * rewards.shape[1], dtype=torch.float32)
    std = nan_std(weighted_sum(rewards.float(), w).view(-1, group_size), dim=1)  # [n]
    return is_zero_std(std).tolist()


def dynamic_sampling_filter(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """[N] rewards → [N] bool: keep the completions of groups whose rewards are not all equal (a group with zero
    std has zero advantages and only dilutes the batch)."""
    keep = ~torch.tensor(zero_std_groups(rewards, num_generations), dtype=torch.bool)  # [N/G]
    return keep.repeat_interleave(num_generations)


def soft_overlong_penalty(lengths: torch.Tensor, max_completion_length: int, cache_length: int) -> torch.Tensor:
    """[N] completion lengths → [N] penalties: 0 up to L_max - L_cache, then falling linearly to -1 at L_max,
    and -1 beyond (DAPO eq. 13)."""
    if not 0 < cache_length <= max_completion_length:
        raise ValueError(f"cache_length={cache_length} must be in (0, max_completion_length={max_completion_length}].")
    lengths = lengths.float()
    start = max_completion_length - cache_length
    ramp = (start - lengths) / cache_length
    return torch.where(
        lengths <= start,
        torch.zeros_like(lengths),
        torch.where(lengths <= max_completion_length, ramp, torch.full_like(lengths, -1.0)),
    )


def kl_penalized_token_rewards(
    rewards: torch.Tensor,
    per_token_logps: torch.Tensor,
    ref_per_token_logps: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    estimator: str = "k1",
) -> torch.Tensor:
    """KL in the reward instead of the loss (as OpenRLHF and verl offer): every active token is rewarded
    -β·KL_t, and the last active token also receives the sequence reward. [B], [B, T]×3 → [B, T]."""
    mask = mask.to(per_token_logps.dtype)
    token_rewards = -beta * kl_divergence(per_token_logps, ref_per_token_logps, estimator).detach() * mask
    T = mask.shape[1]
    last_index = T - 1 - mask.flip(-1).argmax(-1, keepdim=True)  # [B, 1]
    last = (torch.arange(T, device=mask.device) == last_index) & mask.bool()  # [B, T], one True per non-empty row
    return token_rewards + last.to(mask.dtype) * rewards.reshape(-1, 1).to(mask.dtype)
