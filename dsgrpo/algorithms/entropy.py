"""Per-token entropy of the policy and the high-entropy token mask ("Beyond the 80/20 rule",
arXiv:2506.01939)."""

from __future__ import annotations

from typing import Optional

import torch


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    """[..., V] logits → [...] entropies H = logsumexp(z) - Σ softmax(z)·z.

    Rows are processed `chunk_size` at a time so that the softmax of a large vocabulary is never held for the
    whole batch at once next to the logits themselves."""
    flat = logits.reshape(-1, logits.shape[-1])                       # [B*T, V]
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], chunk_size):
        z = flat[start:start + chunk_size].float()
        logz = torch.logsumexp(z, dim=-1)
        out[start:start + chunk_size] = logz - (torch.softmax(z, dim=-1) * z).sum(-1)
    return out.reshape(logits.shape[:-1])


def entropy_threshold(active_entropies: torch.Tensor, top_quantile: float) -> torch.Tensor:
    """The entropy at or above which a token is in the top `top_quantile` fraction of `active_entropies` [N]
    (TRL gathers these from every rank, so the threshold is the same on all of them)."""
    if active_entropies.numel() == 0:
        return torch.tensor(float("inf"))
    return torch.quantile(active_entropies.float(), 1.0 - top_quantile)


def entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, top_quantile: float,
                 threshold: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B, T] → [B, T] bool: the active tokens whose entropy is in the top `top_quantile` fraction.

    top_quantile = 1 keeps every active token; 0 keeps only the highest-entropy ones. `threshold`: one computed
    over every rank's active entropies (entropy_threshold); None: over this micro-batch's own."""
    active = mask.bool()
    if top_quantile >= 1.0 or not active.any():
        return active
    if threshold is None:
        threshold = entropy_threshold(entropies[active], top_quantile)
    return (entropies >= threshold) & active
