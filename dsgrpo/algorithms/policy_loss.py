"""The clipped policy objective of GRPO and its successors, with sampler correction, KL and an entropy bonus.

Notation: B completions in this micro-batch, T completion tokens (padded), m the [B, T] completion mask.

The returned loss of one micro-batch is scaled so that summing it over the micro-batches of one optimizer step
and averaging over ranks (what data-parallel gradient averaging does) gives exactly the objective of the
chosen `loss_type`. See each aggregator for its normaliser. The order of the terms is TRL 1.16's:

    term = per_token(w, A, ...)            the variant's surrogate (clipped, CISPO, SAPO's soft gate, VESPO's φ)
    term *= off-policy mask                DeepSeek-V3.2's sequence mask (off_policy_mask_threshold)
    term *= high-entropy mask              top_entropy_quantile
    term *= ρ                              the sampler correction (VESPO folds it into φ instead)
    term += β · KL (· w with use_bias_correction_kl)
    loss  = aggregate(term, m) − c · mean entropy / GA      (entropy_coef)

Positions outside the mask never enter an exponential: a padding token's log-ratio can be anything (a padded
reference log-prob reached 156 nats in a run), and inf · 0 is NaN, not 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from .kl import kl_divergence
from .registry import Registry


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over positions where mask is 1 (x broadcast to mask's shape); 0 when the mask is empty."""
    x = x.expand_as(mask) if x.shape != mask.shape else x
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x where mask is 1, 0 elsewhere (before an exponential, so padding cannot overflow)."""
    return torch.where(mask.bool(), x, torch.zeros_like(x))


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
@dataclass(frozen=True)
class LossHyperparams:
    """The variants' own constants (TRL 1.16's GRPOConfig names and defaults)."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: Optional[float] = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0


@dataclass
class TermInputs:
    """What a per-token term is computed from (one signature for every variant)."""

    ratio: torch.Tensor  # [B, T] or [B, 1]: w = π_θ/π_old at the chosen importance-sampling level
    log_ratio: torch.Tensor  # [B, T]: per-token log π_θ/π_old, 0 on padding
    advantages: torch.Tensor  # [B, 1]
    logps: torch.Tensor  # [B, T]: log π_θ (with grad)
    mask: torch.Tensor  # [B, T]
    sampler_ratio: Optional[torch.Tensor]  # the sampler correction ρ ([B, T] or [B, 1]) or None
    hp: LossHyperparams


def _clipped_term(x: TermInputs) -> torch.Tensor:
    """PPO-style pessimistic term: -min(w·A, clip(w, 1-ε_low, 1+ε_high)·A); `delta` caps w first (two-sided,
    INTELLECT-2)."""
    hp = x.hp
    clipped = torch.clamp(x.ratio, 1 - hp.epsilon_low, 1 + hp.epsilon_high)
    capped = x.ratio if hp.delta is None else torch.clamp(x.ratio, max=hp.delta)
    return -torch.min(capped * x.advantages, clipped * x.advantages)


def _cispo_term(x: TermInputs) -> torch.Tensor:
    """CISPO (MiniMax-M1, arXiv:2506.13585): clip the weight, not the update; every token keeps a gradient
    through log π_θ. -sg(min(w, ε_high))·A·log π_θ."""
    return -torch.clamp(x.ratio, max=x.hp.epsilon_high).detach() * x.advantages * x.logps


def sapo_token_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, temperature_pos: float = 1.0, temperature_neg: float = 1.05
) -> torch.Tensor:
    """SAPO (arXiv:2511.20347): a smooth gate instead of a hard clip, -σ(τ(w-1))·4/τ·A, with τ = temperature_pos
    where A > 0 and temperature_neg elsewhere. At w = 1 the gate is 2/τ and its slope 1 (the on-policy gradient)."""
    tau = torch.where(
        advantages > 0, torch.full_like(advantages, temperature_pos), torch.full_like(advantages, temperature_neg)
    )
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages


def _sapo_term(x: TermInputs) -> torch.Tensor:
    return sapo_token_loss(x.ratio, x.advantages, x.hp.sapo_temperature_pos, x.hp.sapo_temperature_neg)


@torch.no_grad()
def vespo_weights(
    advantages: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    sampler_ratio: Optional[torch.Tensor],
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> torch.Tensor:
    """VESPO (arXiv:2602.10693): [B, 1] gamma weights φ(w) = e^λ · w^k · e^(-λw) (φ(1) = 1) of the sequence
    importance weight w = Π_t π_θ/π_old (× the token sampler correction ρ_t), with (k, λ) chosen by the sign of
    A; computed in log space, log-weights clamped to [log 1e-8, 20] as the reference implementation does, and
    detached: φ only scales the gradient of -A·log π_θ."""
    lower = math.log(1e-8)
    log_w = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)  # [B, 1]
    if sampler_ratio is not None:
        log_w = log_w + (torch.clamp(torch.log(sampler_ratio), lower, 20.0) * mask).sum(-1, keepdim=True)
    log_w = torch.clamp(log_w, lower, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, torch.full_like(log_w, k_pos), torch.full_like(log_w, k_neg))
    lam = torch.where(nonneg, torch.full_like(log_w, lambda_pos), torch.full_like(log_w, lambda_neg)).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _vespo_term(x: TermInputs) -> torch.Tensor:
    """-φ(w)·A·log π_θ."""
    hp = x.hp
    phi = vespo_weights(
        x.advantages,
        x.log_ratio,
        x.mask,
        x.sampler_ratio,
        hp.vespo_k_pos,
        hp.vespo_lambda_pos,
        hp.vespo_k_neg,
        hp.vespo_lambda_neg,
    )
    return -phi * x.advantages * x.logps


# ------------------------------------------------------------------------------------ aggregation
@dataclass
class LossContext:
    """What an aggregator may use besides the per-token loss and the mask."""

    max_completion_length: Optional[int]
    num_items_in_batch: Optional[float]
    num_processes: int
    gradient_accumulation_steps: int


def _token_sum(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (loss * mask).sum()


def _sequence_mean(loss, mask, ctx: LossContext):
    """Mean over sequences of each sequence's token mean (DeepSeekMath's GRPO; SAPO); length-biased."""
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


def _sequence_sum_mean(loss, mask, ctx: LossContext):
    """LUSPO (arXiv:2602.05261): each sequence's loss summed over its tokens (scaled by its length, undoing
    GSPO's length normalisation), then averaged over sequences."""
    return (loss * mask).sum(-1).mean() / ctx.gradient_accumulation_steps


@dataclass(frozen=True)
class LossType:
    """A loss variant: its per-token term, how the terms become one number, and which clip statistics it logs
    ("ppo": clip_ratio/*, "cispo": cispo_clip_ratio, "vespo": vespo/phi_seq_mean, None: none)."""

    per_token: Callable[[TermInputs], torch.Tensor]
    aggregate: Callable
    clip_metrics: Optional[str] = "ppo"
    folds_sampler_correction: bool = False  # the term applies ρ itself (VESPO's φ)


LOSS_TYPES: Registry = Registry("loss_type")
LOSS_TYPES.register("grpo")(LossType(_clipped_term, _sequence_mean))
LOSS_TYPES.register("bnpo")(LossType(_clipped_term, _bnpo))
LOSS_TYPES.register("dr_grpo")(LossType(_clipped_term, _dr_grpo))
LOSS_TYPES.register("dapo")(LossType(_clipped_term, _global_token_mean))
LOSS_TYPES.register("luspo")(LossType(_clipped_term, _sequence_sum_mean))
LOSS_TYPES.register("cispo")(LossType(_cispo_term, _global_token_mean, clip_metrics="cispo"))
LOSS_TYPES.register("sapo")(LossType(_sapo_term, _sequence_mean, clip_metrics=None))
LOSS_TYPES.register("vespo")(
    LossType(_vespo_term, _global_token_mean, clip_metrics="vespo", folds_sampler_correction=True)
)


# ------------------------------------------------------------------------- sampler correction
SAMPLER_CORRECTIONS: Registry = Registry("vllm_importance_sampling_mode")


def _log_ratio(old, sampler, mask):
    # a token the sampler could not score (NaN: a generate that returns no scores) is no evidence of a mismatch
    return torch.nan_to_num(masked(old - sampler, mask), nan=0.0)


def _token_rho(old, sampler, mask):
    return torch.exp(_log_ratio(old, sampler, mask))  # [B, T]


def _sequence_rho(old, sampler, mask):
    return torch.exp(_log_ratio(old, sampler, mask).sum(-1, keepdim=True))  # [B, 1]


def _truncate(rho, lo, hi):
    return torch.clamp(rho, min=lo, max=hi)


def _mask(rho, lo, hi):
    inside = torch.ones_like(rho, dtype=torch.bool)
    if hi is not None:
        inside &= rho <= hi
    if lo is not None:
        inside &= rho >= lo
    return torch.where(inside, rho, torch.zeros_like(rho))


for _level, _rho in (("token", _token_rho), ("sequence", _sequence_rho)):
    for _kind, _limit in (("truncate", _truncate), ("mask", _mask)):
        SAMPLER_CORRECTIONS.register(f"{_level}_{_kind}")(
            lambda old, sampler, mask, lo, hi, _r=_rho, _l=_limit: _l(_r(old, sampler, mask), lo, hi)
        )


def sampler_correction(old_logps, sampler_logps, mask, mode, clip_min=None, clip_max=3.0) -> torch.Tensor:
    """Importance weight ρ = π_old / π_sampler correcting for the generation engine's numerics (TIS/MIS,
    arXiv:2506.13585 and the "off-policy RL" notes). Token modes: [B, T]; sequence modes: [B, 1], the masked
    SUM of log-ratios. `*_truncate` clamps to [clip_min, clip_max]; `*_mask` zeroes ρ outside that range (a
    bound of None is no bound). A token the sampler could not score (NaN) has ratio 1."""
    return SAMPLER_CORRECTIONS.get(mode)(old_logps.detach(), sampler_logps.detach(), mask, clip_min, clip_max)


def token_band_mask(old_logps: torch.Tensor, sampler_logps: torch.Tensor, band: Tuple[float, float]) -> torch.Tensor:
    """[B, T]: 1 where the token ratio π_old / π_sampler lies in [low, high] (IcePop's band), else 0. A token the
    sampler could not score (NaN) stays in."""
    ratio = torch.exp(old_logps.detach() - sampler_logps.detach())
    low, high = band
    outside = (ratio < low) | (ratio > high)
    return (~outside).to(old_logps.dtype)


def off_policy_mask(
    advantages: torch.Tensor,
    per_token_logps: torch.Tensor,
    behaviour_logps: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (arXiv:2512.02556, eq. 9): [B, 1], 0 for a sequence with a
    negative advantage whose mean per-token KL(π_behaviour || π_θ) estimate, log π_behaviour − log π_θ, exceeds
    `threshold`; 1 otherwise. Tokens the sampler could not score (NaN) count as no evidence."""
    kl = torch.nan_to_num(masked(behaviour_logps - per_token_logps.detach(), mask), nan=0.0)
    mean_kl = kl.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    keep = (advantages.reshape(-1, 1) >= 0) | (mean_kl <= threshold)
    return keep.to(mask.dtype)


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
    hyperparams: Optional[LossHyperparams] = None,
    importance_sampling_level: str = "token",
    beta: float = 0.0,
    ref_per_token_logps: Optional[torch.Tensor] = None,
    kl_estimator: str = "k3",
    kl_bias_correction: bool = False,
    kl_per_token_logps: Optional[torch.Tensor] = None,
    sampler_per_token_logps: Optional[torch.Tensor] = None,
    vllm_is_mode: Optional[str] = None,
    vllm_is_clip_max: Optional[float] = 3.0,
    vllm_is_clip_min: Optional[float] = None,
    off_policy_mask_threshold: Optional[float] = None,
    token_band: Optional[Tuple[float, float]] = None,
    keep_mask: Optional[torch.Tensor] = None,
    entropies: Optional[torch.Tensor] = None,
    entropy_coef: float = 0.0,
    max_completion_length: Optional[int] = None,
    num_items_in_batch: Optional[float] = None,
    num_processes: int = 1,
    gradient_accumulation_steps: int = 1,
    token_weights: Optional[torch.Tensor] = None,
    bonus_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Loss of one micro-batch and its metrics.

    Args:
        per_token_logps: [B, T] log π_θ of the sampled tokens (with grad).
        old_per_token_logps: [B, T] log π_old, or None for π_old = π_θ.detach() (num_iterations == 1).
        advantages: [B].
        completion_mask: [B, T], 1 on tokens that count (the normaliser of every aggregation).
        hyperparams: the variants' constants; `epsilon_low` / `epsilon_high` / `delta` fill it when None.
        kl_bias_correction: multiply the KL term by w (TRL's use_bias_correction_kl): the unbiased reverse-KL
            gradient (DeepSeek-V3.2); it changes the gradient even on-policy, where w = 1 but ∇w ≠ 0.
        kl_per_token_logps: [B, T] the policy's log-probs the KL term compares with the reference's (with grad);
            None: per_token_logps. The sampler's truncation (top_k/top_p) applies to the policy term, not the KL.
        sampler_per_token_logps: [B, T] the generation engine's logprobs; used with `vllm_is_mode` and as the
            behaviour policy of `off_policy_mask_threshold` (π_old without a sampler).
        token_band: (low, high): tokens whose ratio π_old / π_sampler leaves [low, high] leave the policy term
            (IcePop; partial rollouts, whose completions mix policy versions). Needs sampler_per_token_logps.
        keep_mask: [B, T] policy-term mask (the high-entropy tokens of top_entropy_quantile); the KL term and the
            normaliser keep `completion_mask`.
        entropies: [B, T] per-token entropy with grad, for the entropy bonus (`entropy_coef` > 0).
        num_items_in_batch: active tokens, over all ranks, of the completions of one optimizer step
            (dapo/cispo/vespo); None means this micro-batch's own count.
        token_weights: [B, T] each token's weight in the loss (`aggregation_weights` of the micro-batch it belongs
            to), for rows that are not one micro-batch (a packed step's sequences): the loss is the weighted sum.
        bonus_weights: [B, T] the same for the entropy bonus (`entropy_bonus_weights`).

    Returns:
        loss (scalar) and metrics: clip_ratio/low_mean|high_mean|region_mean (or cispo_clip_ratio, or
        vespo/phi_seq_mean), kl (when beta != 0), sampling/importance_sampling_ratio/{min,mean,max} (when a
        correction ran), policy_loss (the loss before the entropy bonus, when there is one).
    """
    variant = LOSS_TYPES.get(loss_type)
    hp = hyperparams or LossHyperparams(epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta)
    mask = completion_mask.to(per_token_logps.dtype)
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    adv = advantages.reshape(-1, 1).to(per_token_logps.dtype)  # [B, 1]

    log_ratio = masked(per_token_logps - old, mask)  # [B, T], 0 on padding
    log_w = IMPORTANCE_LEVELS.get(importance_sampling_level)(log_ratio, mask)
    ratio = torch.exp(log_w)  # [B, T] or [B, 1]

    metrics: Dict[str, torch.Tensor] = {}
    rho = None
    if vllm_is_mode is not None:
        if sampler_per_token_logps is None:
            raise ValueError(f"vllm_is_mode={vllm_is_mode!r} needs sampler_per_token_logps.")
        rho = sampler_correction(old, sampler_per_token_logps, mask, vllm_is_mode, vllm_is_clip_min, vllm_is_clip_max)
        rho_tokens = rho.expand_as(mask)[mask.bool()] if rho.shape == mask.shape else rho.reshape(-1)
        if rho_tokens.numel():
            metrics["sampling/importance_sampling_ratio/min"] = rho_tokens.min().detach()
            metrics["sampling/importance_sampling_ratio/mean"] = rho_tokens.mean().detach()
            metrics["sampling/importance_sampling_ratio/max"] = rho_tokens.max().detach()

    per_token = variant.per_token(TermInputs(ratio, log_ratio, adv, per_token_logps, mask, rho, hp))
    if off_policy_mask_threshold is not None:
        behaviour = sampler_per_token_logps if sampler_per_token_logps is not None else old
        per_token = per_token * off_policy_mask(adv, per_token_logps, behaviour, mask, off_policy_mask_threshold)
    if token_band is not None:
        if sampler_per_token_logps is None:
            raise ValueError("token_band needs sampler_per_token_logps.")
        inside = token_band_mask(old, sampler_per_token_logps, token_band)
        per_token = per_token * inside
        outside = (1.0 - inside) * mask
        metrics["sampling/token_band_masked"] = outside.sum() / mask.sum().clamp(min=1.0)
    if keep_mask is not None:
        per_token = per_token * keep_mask.to(per_token.dtype)
    if rho is not None and not variant.folds_sampler_correction:
        per_token = per_token * rho

    if beta != 0.0:
        if ref_per_token_logps is None:
            raise ValueError(f"beta={beta} needs ref_per_token_logps (the reference model's logprobs).")
        policy_logps = per_token_logps if kl_per_token_logps is None else kl_per_token_logps
        kl = kl_divergence(policy_logps, _masked_ref(policy_logps, ref_per_token_logps, mask), kl_estimator)
        if kl_bias_correction:
            kl = kl * ratio
        per_token = per_token + beta * kl
        metrics["kl"] = masked_mean(kl.detach(), mask)

    if token_weights is None:
        ctx = LossContext(max_completion_length, num_items_in_batch, num_processes, gradient_accumulation_steps)
        loss = variant.aggregate(per_token, mask, ctx)
    else:
        loss = (per_token * token_weights).sum()

    if entropy_coef != 0.0:
        if entropies is None:
            raise ValueError(f"entropy_coef={entropy_coef} needs the per-token entropies (with grad).")
        if bonus_weights is None:
            bonus_weights = entropy_bonus_weights(mask, keep_mask, gradient_accumulation_steps)
        metrics["policy_loss"] = loss.detach()  # this micro-batch's share, like the loss
        loss = loss - entropy_coef * (entropies * bonus_weights).sum()

    with torch.no_grad():
        if variant.clip_metrics == "ppo":
            low = ((ratio < 1 - hp.epsilon_low) & (adv < 0)).to(mask.dtype)
            high = ((ratio > 1 + hp.epsilon_high) & (adv > 0)).to(mask.dtype)
            metrics["clip_ratio/low_mean"] = masked_mean(low, mask)
            metrics["clip_ratio/high_mean"] = masked_mean(high, mask)
            metrics["clip_ratio/region_mean"] = masked_mean(torch.clamp(low + high, max=1.0), mask)
        elif variant.clip_metrics == "cispo":
            metrics["cispo_clip_ratio"] = masked_mean(((ratio > hp.epsilon_high) & (adv > 0)).to(mask.dtype), mask)
        elif variant.clip_metrics == "vespo":
            phi = vespo_weights(
                adv, log_ratio, mask, rho, hp.vespo_k_pos, hp.vespo_lambda_pos, hp.vespo_k_neg, hp.vespo_lambda_neg
            )
            metrics["vespo/phi_seq_mean"] = phi.mean()
    return loss, metrics


def _masked_ref(per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The reference log-probs with padding replaced by the policy's own (a log-ratio of 0 there: no overflow)."""
    return torch.where(mask.bool(), ref_per_token_logps, per_token_logps.detach())


def aggregation_weights(
    loss_type: str,
    mask: torch.Tensor,
    *,
    max_completion_length: Optional[int] = None,
    num_items_in_batch: Optional[float] = None,
    num_processes: int = 1,
    gradient_accumulation_steps: int = 1,
) -> torch.Tensor:
    """[B, T]: each token's weight in a micro-batch's aggregated loss. Every aggregation is linear in the per-token
    loss, so its gradient with respect to that loss is the weights, whatever the values: the loss of any subset of
    the micro-batch's sequences is then the weighted sum of their terms, with the normaliser of the whole micro-batch
    (how a packed step keeps each loss type's meaning)."""
    x = torch.zeros_like(mask, dtype=torch.float32, requires_grad=True)
    ctx = LossContext(max_completion_length, num_items_in_batch, num_processes, gradient_accumulation_steps)
    with torch.enable_grad():
        (weights,) = torch.autograd.grad(LOSS_TYPES.get(loss_type).aggregate(x, mask.float(), ctx), x)
    return weights


def entropy_bonus_weights(
    mask: torch.Tensor, keep_mask: Optional[torch.Tensor], gradient_accumulation_steps: int
) -> torch.Tensor:
    """[B, T]: the entropy bonus is the mean entropy of a micro-batch's trained tokens (high-entropy ones with
    top_entropy_quantile), scaled for accumulation."""
    effective = mask if keep_mask is None else mask * keep_mask.to(mask.dtype)
    return effective / effective.sum().clamp(min=1.0) / gradient_accumulation_steps
