"""The mathematics of GRPO and its successors as pure torch functions (no DeepSpeed, no vLLM).

Notation in docstrings and shape comments: B completions in a micro-batch, G = num_generations, N completions
in a generation batch, T completion tokens, V vocabulary, K reward functions.
"""

from .advantages import compute_advantages, is_zero_std, nan_mean, nan_std
from .dapo import dynamic_sampling_filter, kl_penalized_token_rewards, soft_overlong_penalty, zero_std_groups
from .entropy import AdaptiveEntropyCoef, entropy_from_logits, entropy_mask, entropy_threshold
from .kl import KL_ESTIMATORS, kl_divergence
from .truncation import Truncation, truncate_logits
from .policy_loss import (
    LOSS_TYPES,
    SAMPLER_CORRECTIONS,
    LossHyperparams,
    aggregation_weights,
    entropy_bonus_weights,
    masked_mean,
    off_policy_mask,
    policy_loss,
    sampler_correction,
    sapo_token_loss,
    vespo_weights,
)

__all__ = [
    "compute_advantages",
    "policy_loss",
    "kl_divergence",
    "sampler_correction",
    "masked_mean",
    "entropy_from_logits",
    "entropy_mask",
    "entropy_threshold",
    "off_policy_mask",
    "sapo_token_loss",
    "vespo_weights",
    "aggregation_weights",
    "entropy_bonus_weights",
    "LossHyperparams",
    "AdaptiveEntropyCoef",
    "Truncation",
    "truncate_logits",
    "dynamic_sampling_filter",
    "soft_overlong_penalty",
    "kl_penalized_token_rewards",
    "nan_mean",
    "nan_std",
    "is_zero_std",
    "zero_std_groups",
    "LOSS_TYPES",
    "KL_ESTIMATORS",
    "SAMPLER_CORRECTIONS",
]
