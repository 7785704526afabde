"""Per-token entropy of the policy and the high-entropy token mask ("Beyond the 80/20 rule",
arXiv:2506.01939)."""

from __future__ import annotations

from typing import Optional

import torch


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    """[..., V] logits → [...] entropies H = logsumexp(z) - Σ softmax(z)·z.

    Rows are processed `chunk_size` at a time so that the softmax of a large vocabulary is never held for the
    whole batch at once next to the logits themselves."""
    flat = logits.reshape(-1, logits.shape[-1])  # [B*T, V]
    parts = []
    for start in range(0, flat.shape[0], chunk_size):
        z = flat[start : start + chunk_size].float()
        # a truncated distribution holds -inf logits: their probability is 0 and so is their term (not 0 · -inf)
        finite = torch.where(torch.isinf(z), torch.zeros_like(z), z)
        parts.append(torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * finite).sum(-1))
    out = torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.float32)
    return out.reshape(logits.shape[:-1])


def entropy_threshold(active_entropies: torch.Tensor, top_quantile: float) -> torch.Tensor:
    """The entropy at or above which a token is in the top `top_quantile` fraction of `active_entropies` [N]
    (TRL gathers these from every rank, so the threshold is the same on all of them)."""
    if active_entropies.numel() == 0:
        return torch.tensor(float("inf"))
    return torch.quantile(active_entropies.float(), 1.0 - top_quantile)


def entropy_mask(
    entropies: torch.Tensor, mask: torch.Tensor, top_quantile: float, threshold: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """[B, T] → [B, T] bool: the active tokens whose entropy is in the top `top_quantile` fraction.

    top_quantile = 1 keeps every active token; 0 keeps only the highest-entropy ones. `threshold`: one computed
    over every rank's active entropies (entropy_threshold); None: over this micro-batch's own."""
    active = mask.bool()
    if top_quantile >= 1.0 or not active.any():
        return active
    if threshold is None:
        threshold = entropy_threshold(entropies[active], top_quantile)
    return (entropies >= threshold) & active


class AdaptiveEntropyCoef:
    """Skywork-OR1's adaptive entropy control (arXiv:2505.22312), TRL 1.16's rule: after each optimizer step the
    coefficient moves by `delta` up when the step's entropy (over every rank's tokens) was at or below `target`
    and down otherwise, within [low, high]; the bonus applies only on steps that follow one at or below target.
    Static control (adaptive off) keeps `coef` and always applies it."""

    def __init__(self, coef: float, adaptive: bool, low: float, high: float, delta: float, target: float):
        self.coef, self.adaptive = coef, adaptive
        self.low, self.high, self.delta, self.target = low, high, delta, target
        self.last_entropy = float("inf")  # no step yet: above any target, so no bonus until measured

    @property
    def enabled(self) -> bool:
        return self.adaptive or self.coef != 0.0

    def applied(self) -> float:
        """The coefficient the current optimizer step uses (fixed by the end of the previous one)."""
        if self.adaptive:
            return self.coef if self.last_entropy <= self.target else 0.0
        return self.coef

    def update(self, step_entropy: float) -> None:
        if not self.adaptive:
            return
        step = self.delta if step_entropy <= self.target else -self.delta
        self.coef = min(self.high, max(self.low, self.coef + step))
        self.last_entropy = step_entropy

    def state_dict(self) -> dict:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.coef, self.last_entropy = state["coef"], state["last_entropy"]
