"""Per-token log-probabilities of completions under a (possibly ZeRO-3 sharded) causal LM."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..algorithms import entropy_from_logits


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                        temperature: float = 1.0, with_entropy: bool = False,
                        entropy_grad: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log π(token_t | prefix) for the last `completion_len` tokens of each row.

    input_ids / attention_mask: [B, P+T] with left-padded prompts followed by right-padded completions.
    Returns logps [B, T] (fp32) and, if asked, entropies [B, T]. Logits are divided by the sampling temperature,
    matching the distribution the sampler drew from (vLLM's processed logprobs). `entropy_grad`: the entropies
    keep their graph (an entropy bonus in the loss); otherwise they are computed without one."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    # logits_to_keep: only the positions that predict completion tokens get an lm_head matmul ([B, T+1, V])
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                logits_to_keep=completion_len + 1, use_cache=False)
    logits = out.logits[:, :-1, :].float() / temperature                          # [B, T, V]
    targets = input_ids[:, -completion_len:]                                      # [B, T]
    logps = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits)
    return logps, entropy
