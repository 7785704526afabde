"""Group-relative advantages (GRPO, Dr. GRPO, multi-reward GDPO-style normalisation).

Notation: N completions, G = num_generations, N/G groups of consecutive rows, K reward functions.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple, Union

import torch

from .registry import Registry

EPS = 1e-4  # TRL's denominator guard: (r - mu) / (sigma + 1e-4)


def nan_mean(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Mean ignoring NaN; NaN where every entry is NaN."""
    return torch.nanmean(x, dim=dim, keepdim=keepdim)


def nan_std(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Bessel-corrected std ignoring NaN. With fewer than two valid entries the spread is unknown: 0, so that
    such a group gives no signal (its centred rewards are 0 or NaN anyway)."""
    valid = ~torch.isnan(x)
    count = valid.sum(dim=dim, keepdim=True)
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    sq = torch.where(valid, (x - mean) ** 2, torch.zeros_like(x)).sum(dim=dim, keepdim=True)
    var = sq / (count - 1).clamp(min=1)
    std = torch.where(count >= 2, var.sqrt(), torch.zeros_like(var))
    return std if keepdim else std.squeeze(dim)


def is_zero_std(std: torch.Tensor) -> torch.Tensor:
    """The one rule for "a group's rewards all agree" (TRL's): its std is 0 within isclose's tolerance. Such a
    group has zero advantages: it is counted in frac_reward_zero_std and dropped by dynamic sampling."""
    return torch.isclose(std, torch.zeros_like(std))


def weighted_sum(rewards: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[N, K] · [K] → [N]: NaN-skipping weighted sum; a row that is all NaN stays NaN."""
    summed = torch.nansum(rewards * weights, dim=1)
    return torch.where(torch.isnan(rewards).all(dim=1), torch.full_like(summed, float("nan")), summed)


AGGREGATIONS: Registry = Registry("multi_objective_aggregation")


@AGGREGATIONS.register("sum_then_normalize")
def _sum_then_normalize(
    rewards: torch.Tensor, weights: torch.Tensor, G: int, scale: str
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted sum of the K rewards, then group-relative centring and scaling. Returns (A, r, σ_group)."""
    r = weighted_sum(rewards, weights)  # [N]
    grouped = r.view(-1, G)  # [N/G, G]
    mu = nan_mean(grouped, dim=1, keepdim=True)  # [N/G, 1]
    sigma = nan_std(grouped, dim=1, keepdim=True)  # [N/G, 1]
    centred = grouped - mu
    if scale == "group":
        adv = centred / (sigma + EPS)
    elif scale == "batch":
        adv = centred / (nan_std(r, dim=0) + EPS)
    elif scale == "none":
        adv = centred
    else:
        raise ValueError(f"scale_rewards={scale!r} is not one of ['group', 'batch', 'none'] (or True/False).")
    return adv.reshape(-1), r, sigma.reshape(-1)


@AGGREGATIONS.register("normalize_then_sum")
def _normalize_then_sum(
    rewards: torch.Tensor, weights: torch.Tensor, G: int, scale: str
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Z-score each reward within its group, weighted sum, then z-score over the batch (GDPO: one reward with a
    large spread cannot drown the others). `scale` does not apply: both normalisations are part of the method."""
    N, K = rewards.shape
    grouped = rewards.view(-1, G, K)  # [N/G, G, K]
    z = (grouped - nan_mean(grouped, dim=1, keepdim=True)) / (nan_std(grouped, dim=1, keepdim=True) + EPS)
    combined = weighted_sum(z.reshape(N, K), weights)  # [N]
    adv = (combined - nan_mean(combined, dim=0)) / (nan_std(combined, dim=0) + EPS)
    r = weighted_sum(rewards, weights)
    return adv, r, nan_std(r.view(-1, G), dim=1)


def compute_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    *,
    reward_weights: Optional[Union[Sequence[float], torch.Tensor]] = None,
    scale_rewards: Union[str, bool] = "group",
    multi_objective_aggregation: str = "sum_then_normalize",
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Advantages of N completions from their [N, K] rewards.

    Args:
        rewards: [N, K] float; rows i*G .. i*G+G-1 share a prompt; NaN = the function declined (returned None).
        num_generations: G.
        reward_weights: [K] weights (None: all 1).
        scale_rewards: "group" (A = (r - μ_g)/(σ_g + 1e-4)), "batch" (σ over all N), "none" (A = r - μ_g);
            True/False mean "group"/"none", as in TRL.
        multi_objective_aggregation: "sum_then_normalize" or "normalize_then_sum".

    Returns:
        advantages [N] (NaN → 0) and stats: `rewards` [N] (weighted sum, NaN kept), `std_per_group` [N/G],
        `frac_reward_zero_std` (scalar: fraction of groups whose reward std is 0).
    """
    if rewards.dim() == 1:
        rewards = rewards.unsqueeze(1)
    N, K = rewards.shape
    if num_generations < 1 or N % num_generations != 0:
        raise ValueError(f"{N} completions cannot be split into groups of num_generations={num_generations}.")
    scale = ("group" if scale_rewards else "none") if isinstance(scale_rewards, bool) else scale_rewards
    rewards = rewards.float()
    if reward_weights is None:
        weights = torch.ones(K, dtype=rewards.dtype, device=rewards.device)
    else:
        weights = torch.as_tensor(reward_weights, dtype=rewards.dtype, device=rewards.device)
        if weights.shape != (K,):
            raise ValueError(
                f"reward_weights has {weights.numel()} entries but there are {K} reward functions; "
                "give one weight per reward function."
            )
    adv, r, std_per_group = AGGREGATIONS.get(multi_objective_aggregation)(rewards, weights, num_generations, scale)
    adv = torch.nan_to_num(adv, nan=0.0)
    stats = {
        "rewards": r,
        "std_per_group": std_per_group,
        "frac_reward_zero_std": is_zero_std(std_per_group).float().mean(),
    }
    return adv, stats
