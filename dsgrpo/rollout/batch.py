"""`Batch`: one rank's share of a generation round as the update sees it, and how a rollout becomes one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from ..data import completions_for_rewards
from .base import Rollout


@dataclass
class Batch:
    """This rank's share of one generation round, ready for the update."""

    rollout: Rollout
    prompts: list  # dataset prompts, one per completion
    completions: list  # completions as reward functions get them (text, or message lists)
    columns: Dict[str, list]  # other dataset columns (and a rollout_func's extra keys), one value per completion
    micro: List[dict]  # padded tensors of each micro-batch (Rollout.tensors)
    rewards: Optional[torch.Tensor] = None  # [L, K] when the source scored the completions already
    metrics: Dict[str, float] = field(default_factory=dict)  # the source's own, reduced over ranks (tools/*, async/*)


CHAIN_MARK = "\n\n[the agent rewrote its history: a new chain of calls starts here]\n\n"


def chains_text(tokenizer, completion_ids: List[int], restarts: List[list]) -> str:
    """A split episode's completion as text (completions.jsonl, the report, text rewards): each chain's tokens
    decoded on their own, joined by CHAIN_MARK, so the chains do not read as one reply."""
    cuts = [0] + [at for at, _ in restarts] + [len(completion_ids)]
    pieces = [completion_ids[a:b] for a, b in zip(cuts, cuts[1:])]
    return CHAIN_MARK.join(tokenizer.decode(p, skip_special_tokens=True) for p in pieces)


class BatchBuilder:
    """Rollout rows + their dataset rows → Batch (completions decoded, micro-batches padded)."""

    def __init__(self, tokenizer, micro_batch_size: int, pad_to_multiple_of: Optional[int] = None):
        self.tokenizer, self.micro_batch_size, self.pad_to_multiple_of = tokenizer, micro_batch_size, pad_to_multiple_of

    def __call__(
        self, prompts, indices: Sequence[int], counts: Sequence[int], rollout: Rollout, micro: bool = True
    ) -> Batch:
        B = self.micro_batch_size
        tensors = (
            [
                rollout.tensors(self.tokenizer.pad_token_id, slice(s, s + B), self.pad_to_multiple_of)
                for s in range(0, len(rollout), B)
            ]
            if micro
            else []
        )
        rows, columns = prompts.rows_for(indices, counts)
        if rollout.columns:
            columns.update(rollout.columns)
        if rollout.messages is not None and prompts.conversational:  # tool turns: TRL's message lists
            completions = rollout.messages
        else:
            texts = self.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
            for i, restarts in enumerate(rollout.restarts or []):
                if restarts:  # an agent that rewrote its history: its chains, each after its own prompt, marked
                    texts[i] = chains_text(self.tokenizer, rollout.completion_ids[i], restarts)
            completions = completions_for_rewards(texts, prompts.conversational)
        return Batch(rollout, rows, completions, columns, tensors)
