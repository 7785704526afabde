"""Per-token entropy of the policy and the high-entropy token mask ("Beyond the 80/20 rule",
arXiv:2506.01939)."""

from __future__ import annotations

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


def entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, top_quantile: float) -> torch.Tensor:
    """[B, T] → [B, T] bool: the active tokens whose entropy is in the top `top_quantile` fraction.

    top_quantile = 1 keeps every active token; 0 keeps only the highest-entropy ones. Pass entropies gathered
    from every rank to make the threshold global; the mask is then applied to this rank's slice."""
    active = mask.bool()
    if top_quantile >= 1.0 or not active.any():
        return active
    threshold = torch.quantile(entropies[active].float(), 1.0 - top_quantile)
    return (entropies >= threshold) & active
