"""Per-token log-probabilities of completions under a (possibly ZeRO-3 sharded) causal LM."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..algorithms import Truncation, entropy_from_logits, truncate_logits


@dataclass
class Forward:
    logps: torch.Tensor                   # [B, T] log-probs of the completion tokens (truncated as the sampler did)
    entropy: Optional[torch.Tensor]       # [B, T], when asked
    full_logps: Optional[torch.Tensor]    # [B, T] untruncated log-probs, when asked (the KL term's)
    aux_loss: Optional[torch.Tensor]      # a MoE router's load-balancing loss, when asked


def policy_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                   temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False,
                   truncation: Optional[Truncation] = None, with_full: bool = False,
                   router_aux: bool = False) -> Forward:
    """One forward of `model` over prompt + completion, scored on the last `completion_len` tokens of each row.

    input_ids / attention_mask: [B, P+T] with left-padded prompts followed by right-padded completions. Logits are
    divided by the sampling temperature and truncated as the sampler truncates them (`truncation`: top_k / top_p /
    min_p), so the log-probs are of the distribution the sampler drew from (vLLM's processed logprobs).
    `entropy_grad`: the entropies keep their graph (an entropy bonus in the loss). `router_aux`: a MoE model also
    returns its router's load-balancing loss."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    extra = {"output_router_logits": True} if router_aux else {}
    # logits_to_keep: only the positions that predict completion tokens get an lm_head matmul ([B, T+1, V])
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                logits_to_keep=completion_len + 1, use_cache=False, **extra)
    logits = out.logits[:, :-1, :].float() / temperature                          # [B, T, V]
    targets = input_ids[:, -completion_len:]                                      # [B, T]
    sampled = logits if truncation is None else truncate_logits(logits, truncation, keep=targets)
    logps = torch.log_softmax(sampled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = full = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(sampled)
    if with_full:
        full = logps if sampled is logits else \
            torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return Forward(logps, entropy, full, getattr(out, "aux_loss", None) if router_aux else None)


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                        temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False,
                        truncation: Optional[Truncation] = None):
    """(log-probs [B, T], entropies [B, T] or None): policy_forward's two usual results."""
    f = policy_forward(model, input_ids, attention_mask, completion_len, temperature, with_entropy, entropy_grad,
                       truncation)
    return f.logps, f.entropy
