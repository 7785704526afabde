"""Per-token log-probabilities of completions under a (possibly ZeRO-3 sharded) causal LM."""

from __future__ import annotations

from typing import Optional

import torch

from ..algorithms import Truncation, entropy_from_logits, truncate_logits


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                        temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False,
                        truncation: Optional[Truncation] = None, with_full: bool = False):
    """log π(token_t | prefix) for the last `completion_len` tokens of each row.

    input_ids / attention_mask: [B, P+T] with left-padded prompts followed by right-padded completions.
    Returns logps [B, T] (fp32) and, if asked, entropies [B, T]. Logits are divided by the sampling temperature and
    truncated as the sampler truncates them (`truncation`: top_k / top_p / min_p), so the log-probs are of the
    distribution the sampler drew from (vLLM's processed logprobs). `entropy_grad`: the entropies keep their graph
    (an entropy bonus in the loss). `with_full`: a third return, the untruncated log-probs (the KL term's)."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    # logits_to_keep: only the positions that predict completion tokens get an lm_head matmul ([B, T+1, V])
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                logits_to_keep=completion_len + 1, use_cache=False)
    logits = out.logits[:, :-1, :].float() / temperature                          # [B, T, V]
    targets = input_ids[:, -completion_len:]                                      # [B, T]
    sampled = logits if truncation is None else truncate_logits(logits, truncation, keep=targets)
    logps = torch.log_softmax(sampled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(sampled)
    if not with_full:
        return logps, entropy
    full = logps if sampled is logits else torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logps, entropy, full
