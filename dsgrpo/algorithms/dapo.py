"""DAPO's helpers (arXiv:2503.14476) and the KL-in-reward alternative to a KL loss term."""

from __future__ import annotations

import torch

from .advantages import nan_std
from .kl import kl_divergence


def dynamic_sampling_filter(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """[N] rewards → [N] bool: keep the completions of groups whose rewards are not all equal (a group with zero
    std has zero advantages and only dilutes the batch)."""
    std = nan_std(rewards.float().view(-1, num_generations), dim=1)              # [N/G]
    return (std > 0).repeat_interleave(num_generations)


def soft_overlong_penalty(lengths: torch.Tensor, max_completion_length: int, cache_length: int) -> torch.Tensor:
    """[N] completion lengths → [N] penalties: 0 up to L_max - L_cache, then falling linearly to -1 at L_max,
    and -1 beyond (DAPO eq. 13)."""
    if not 0 < cache_length <= max_completion_length:
        raise ValueError(f"cache_length={cache_length} must be in (0, max_completion_length={max_completion_length}].")
    lengths = lengths.float()
    start = max_completion_length - cache_length
    ramp = (start - lengths) / cache_length
    return torch.where(lengths <= start, torch.zeros_like(lengths),
                       torch.where(lengths <= max_completion_length, ramp, torch.full_like(lengths, -1.0)))


def kl_penalized_token_rewards(rewards: torch.Tensor, per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor,
                               mask: torch.Tensor, beta: float, estimator: str = "k1") -> torch.Tensor:
    """KL in the reward instead of the loss (as OpenRLHF and verl offer): every active token is rewarded
    -β·KL_t, and the last active token also receives the sequence reward. [B], [B, T]×3 → [B, T]."""
    mask = mask.to(per_token_logps.dtype)
    token_rewards = -beta * kl_divergence(per_token_logps, ref_per_token_logps, estimator).detach() * mask
    T = mask.shape[1]
    last_index = T - 1 - mask.flip(-1).argmax(-1, keepdim=True)                # [B, 1]
    last = (torch.arange(T, device=mask.device) == last_index) & mask.bool()    # [B, T], one True per non-empty row
    return token_rewards + last.to(mask.dtype) * rewards.reshape(-1, 1).to(mask.dtype)
