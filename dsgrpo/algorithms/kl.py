"""KL estimators between the policy and the reference model, per token (Schulman, "Approximating KL
divergence", 2020). With r = ref - logp (log π_ref/π_θ) on tokens sampled from π_θ:
k1 = -r, k2 = r²/2, k3 = e^r - r - 1 (unbiased and always >= 0; DeepSeekMath's choice)."""

from __future__ import annotations

import torch

from .registry import Registry

KL_ESTIMATORS: Registry = Registry("kl_estimator")


@KL_ESTIMATORS.register("k1")
def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return -log_ratio


@KL_ESTIMATORS.register("k2")
def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio**2


@KL_ESTIMATORS.register("k3")
def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_ratio) - log_ratio - 1


def kl_divergence(
    per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor, estimator: str = "k3"
) -> torch.Tensor:
    """[B, T] per-token KL(π_θ || π_ref) estimate."""
    return KL_ESTIMATORS.get(estimator)(ref_per_token_logps - per_token_logps)
