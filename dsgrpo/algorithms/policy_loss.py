"""The clipped policy objective of GRPO and its successors, with sampler correction and KL.

Notation: B completions in this micro-batch, T completion tokens (padded), m the [B, T] completion mask.

The returned loss of one micro-batch is scaled so that summing it over the micro-batches of one optimizer step
and averaging over ranks (what data-parallel gradient averaging does) gives exactly the objective of the
chosen `loss_type`. See `aggregate` for each normaliser.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from .kl import kl_divergence
from .registry import Registry


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over positions where mask is 1 (x broadcast to mask's shape); 0 when the mask is empty."""
    x = x.expand_as(mask) if x.shape != mask.shape else x
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


# ------------------------------------------------------------------------------------------- ratios
IMPORTANCE_LEVELS: Registry = Registry("importance_sampling_level")


@IMPORTANCE_LEVELS.register("token")
def _token_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] → [B, T]: per-token log π_θ/π_old (GRPO)."""
    return log_ratio


@IMPORTANCE_LEVELS.register("sequence")
def _sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] → [B, 1]: length-normalised sequence log-ratio (GSPO, arXiv:2507.18071), shared by every token."""
    return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


# -------------------------------------------------------------------------------- per-token terms
@dataclass
class LossContext:
    """What an aggregator may use besides the per-token loss and the mask."""
    max_completion_length: Optional[int]
    num_items_in_batch: Optional[float]
    num_processes: int
    gradient_accumulation_steps: int


def _clipped_term(ratio, advantages, logps, eps_low, eps_high, delta):
    """PPO-style pessimistic term: -min(w·A, clip(w, 1-ε_low, 1+ε_high)·A); `delta` caps w first (two-sided)."""
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    capped = ratio if delta is None else torch.clamp(ratio, max=delta)
    return -torch.min(capped * advantages, clipped * advantages)


def _cispo_term(ratio, advantages, logps, eps_low, eps_high, delta):
    """CISPO (MiniMax-M1, arXiv:2506.13585): clip the weight, not the update; every token keeps a gradient
    through log π_θ. -sg(min(w, ε_high))·A·log π_θ."""
    return -torch.clamp(ratio, max=eps_high).detach() * advantages * logps


# ------------------------------------------------------------------------------------ aggregation
def _token_sum(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (loss * mask).sum()


def _grpo(loss, mask, ctx: LossContext):
    """Mean over sequences of each sequence's token mean (DeepSeekMath); length-biased."""
    per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_seq.mean() / ctx.gradient_accumulation_steps


def _bnpo(loss, mask, ctx: LossContext):
    """Token mean over this micro-batch."""
    return _token_sum(loss, mask) / mask.sum().clamp(min=1.0) / ctx.gradient_accumulation_steps


def _dr_grpo(loss, mask, ctx: LossContext):
    """Dr. GRPO (arXiv:2503.20783): a constant normaliser B · max_completion_length removes the length bias."""
    if ctx.max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' needs max_completion_length (the constant normaliser).")
    return _token_sum(loss, mask) / (loss.shape[0] * ctx.max_completion_length) / ctx.gradient_accumulation_steps


def _global_token_mean(loss, mask, ctx: LossContext):
    """DAPO (arXiv:2503.14476): divide by the active-token count of the whole optimizer step over all ranks.
    Ranks average gradients, so each rank divides by count / num_processes."""
    count = mask.sum() if ctx.num_items_in_batch is None else torch.as_tensor(ctx.num_items_in_batch, dtype=loss.dtype)
    return _token_sum(loss, mask) / (count.clamp(min=1.0) / ctx.num_processes)


@dataclass(frozen=True)
class LossType:
    """A loss variant: its per-token term and how the terms become one number."""
    per_token: Callable
    aggregate: Callable


LOSS_TYPES: Registry = Registry("loss_type")
LOSS_TYPES.register("grpo")(LossType(_clipped_term, _grpo))
LOSS_TYPES.register("bnpo")(LossType(_clipped_term, _bnpo))
LOSS_TYPES.register("dr_grpo")(LossType(_clipped_term, _dr_grpo))
LOSS_TYPES.register("dapo")(LossType(_clipped_term, _global_token_mean))
LOSS_TYPES.register("cispo")(LossType(_cispo_term, _global_token_mean))


# ------------------------------------------------------------------------- sampler correction
SAMPLER_CORRECTIONS: Registry = Registry("vllm_importance_sampling_mode")


def _token_rho(old, sampler, mask):
    return torch.exp(old - sampler)                                               # [B, T]


def _sequence_rho(old, sampler, mask):
    return torch.exp(((old - sampler) * mask).sum(-1, keepdim=True))              # [B, 1]


def _truncate(rho, lo, hi):
    return torch.clamp(rho, min=lo, max=hi)


def _mask(rho, lo, hi):
    inside = (rho <= hi) & (rho >= (lo if lo is not None else float("-inf")))
    return torch.where(inside, rho, torch.zeros_like(rho))


for _level, _rho in (("token", _token_rho), ("sequence", _sequence_rho)):
    for _kind, _limit in (("truncate", _truncate), ("mask", _mask)):
        SAMPLER_CORRECTIONS.register(f"{_level}_{_kind}")(
            lambda old, sampler, mask, lo, hi, _r=_rho, _l=_limit: _l(_r(old, sampler, mask), lo, hi))


def sampler_correction(old_logps, sampler_logps, mask, mode, clip_min=None, clip_max=3.0) -> torch.Tensor:
    """Importance weight ρ = π_old / π_sampler correcting for the generation engine's numerics (TIS/MIS,
    arXiv:2506.13585 and the "off-policy RL" notes). Token modes: [B, T]; sequence modes: [B, 1], the masked
    SUM of log-ratios. `*_truncate` clamps to [clip_min, clip_max]; `*_mask` zeroes ρ outside that range."""
    return SAMPLER_CORRECTIONS.get(mode)(old_logps.detach(), sampler_logps.detach(), mask, clip_min, clip_max)


# ------------------------------------------------------------------------------------ the loss
def policy_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: Optional[torch.Tensor],
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: Optional[float] = None,
    importance_sampling_level: str = "token",
    beta: float = 0.0,
    ref_per_token_logps: Optional[torch.Tensor] = None,
    kl_estimator: str = "k3",
    sampler_per_token_logps: Optional[torch.Tensor] = None,
    vllm_is_mode: Optional[str] = None,
    vllm_is_clip_max: float = 3.0,
    vllm_is_clip_min: Optional[float] = None,
    max_completion_length: Optional[int] = None,
    num_items_in_batch: Optional[float] = None,
    num_processes: int = 1,
    gradient_accumulation_steps: int = 1,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Loss of one micro-batch and its metrics.

    Args:
        per_token_logps: [B, T] log π_θ of the sampled tokens (with grad).
        old_per_token_logps: [B, T] log π_old, or None for π_old = π_θ.detach() (num_iterations == 1).
        advantages: [B].
        completion_mask: [B, T], 1 on tokens that count.
        sampler_per_token_logps: [B, T] the generation engine's logprobs; used with `vllm_is_mode`.
        num_items_in_batch: active tokens, over all ranks, of the completions of one optimizer step
            (dapo/cispo); None means this micro-batch's own count.

    Returns:
        loss (scalar) and metrics: clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean,
        kl (when beta != 0), sampling/importance_sampling_ratio/{min,mean,max} (when a correction ran).
    """
    variant = LOSS_TYPES.get(loss_type)
    mask = completion_mask.to(per_token_logps.dtype)
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    adv = advantages.reshape(-1, 1).to(per_token_logps.dtype)                    # [B, 1]

    log_w = IMPORTANCE_LEVELS.get(importance_sampling_level)(per_token_logps - old, mask)
    ratio = torch.exp(log_w)                                                      # [B, T] or [B, 1]
    per_token = variant.per_token(ratio, adv, per_token_logps, epsilon_low, epsilon_high, delta)

    metrics: Dict[str, torch.Tensor] = {}
    if vllm_is_mode is not None:
        if sampler_per_token_logps is None:
            raise ValueError(f"vllm_is_mode={vllm_is_mode!r} needs sampler_per_token_logps.")
        rho = sampler_correction(old, sampler_per_token_logps, mask, vllm_is_mode, vllm_is_clip_min, vllm_is_clip_max)
        per_token = per_token * rho
        rho_tokens = rho.expand_as(mask)[mask.bool()] if rho.shape == mask.shape else rho.reshape(-1)
        if rho_tokens.numel():
            metrics["sampling/importance_sampling_ratio/min"] = rho_tokens.min().detach()
            metrics["sampling/importance_sampling_ratio/mean"] = rho_tokens.mean().detach()
            metrics["sampling/importance_sampling_ratio/max"] = rho_tokens.max().detach()

    if beta != 0.0:
        if ref_per_token_logps is None:
            raise ValueError(f"beta={beta} needs ref_per_token_logps (the reference model's logprobs).")
        kl = kl_divergence(per_token_logps, ref_per_token_logps, kl_estimator)    # [B, T]
        per_token = per_token + beta * kl
        metrics["kl"] = masked_mean(kl.detach(), mask)

    ctx = LossContext(max_completion_length, num_items_in_batch, num_processes, gradient_accumulation_steps)
    loss = variant.aggregate(per_token, mask, ctx)

    with torch.no_grad():
        low = ((ratio < 1 - epsilon_low) & (adv < 0)).to(mask.dtype)
        high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(mask.dtype)
        metrics["clip_ratio/low_mean"] = masked_mean(low, mask)
        metrics["clip_ratio/high_mean"] = masked_mean(high, mask)
        metrics["clip_ratio/region_mean"] = masked_mean(torch.clamp(low + high, max=1.0), mask)
    return loss, metrics
