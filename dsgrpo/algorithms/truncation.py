"""The sampler's truncation of the next-token distribution (top_k, top_p, min_p), so the trainer scores tokens
under the distribution they were drawn from.

With any of them set, the sampler draws from a truncated, renormalised distribution, and vLLM reports that
distribution's log-probs; the trainer's unfiltered log-softmax is lower by log Z (the kept mass) at every token,
≈ 7 nats a token on a small random model with top_k=10, so the sampler correction's weights fell to 0 and nothing
learned. dsgrpo's semantics: the policy being trained IS the truncated distribution the sampler draws from (as in
the sampler), so the policy term, π_old and the sampler correction all use it; the KL term keeps the untruncated
distributions of policy and reference (TRL's formula: a token outside the reference's top-k is not an infinite KL).

Order as the engines apply it, on tempered logits: vLLM masks min_p first, then top_k, then top_p (on what min_p
left); transformers' generate applies top_k, top_p, then min_p. min_p's rule (p ≥ min_p · p_max) is unchanged by
renormalisation, so the two orders differ only when min_p and top_p are both set."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Truncation:
    top_k: Optional[int] = None  # None or 0: off
    top_p: Optional[float] = None  # None or 1.0: off
    min_p: Optional[float] = None  # None or 0.0: off
    order: str = "vllm"  # "vllm" (min_p, top_k, top_p) or "hf" (top_k, top_p, min_p)

    @property
    def active(self) -> bool:
        return bool(self.top_k) or (self.top_p is not None and self.top_p < 1.0) or bool(self.min_p)


def _top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # ties at the k-th value are kept
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches p (the most likely one always)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= 1 - p
    remove[..., -1] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return sorted_logits.scatter(-1, order, sorted_logits)


def _min_p(logits: torch.Tensor, m: float) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    return logits.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * m, float("-inf"))


def truncate_logits(logits: torch.Tensor, truncation: Truncation, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[..., V] tempered logits → the same with the tokens the sampler could not draw set to -inf. `keep` [...]:
    token ids never removed (the sampled ones: at a tie on the top-k boundary, or where the engine's logits differ
    from the trainer's by rounding, a sampled token may fall just outside; it keeps a finite log-prob)."""
    if not truncation.active:
        return logits
    original = logits
    steps = {
        "min_p": lambda z: _min_p(z, truncation.min_p) if truncation.min_p else z,
        "top_k": lambda z: _top_k(z, truncation.top_k) if truncation.top_k else z,
        "top_p": lambda z: _top_p(z, truncation.top_p) if truncation.top_p is not None and truncation.top_p < 1 else z,
    }
    names = ("min_p", "top_k", "top_p") if truncation.order == "vllm" else ("top_k", "top_p", "min_p")
    for name in names:
        logits = steps[name](logits)
    if keep is not None:
        index = keep.unsqueeze(-1)
        logits = logits.scatter(-1, index, original.gather(-1, index))
    return logits
