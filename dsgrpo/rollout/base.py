"""The `Generator` protocol and the `Rollout` batch it returns.

A generator turns prompt token ids into completions, each with the sampler's own log-probability of every
sampled token (for the importance-sampling correction). Backends: `vllm` (colocated, in-process) and `hf`
(DeepSpeed engine's `generate`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Protocol, Tuple

import torch


@dataclass
class SamplingConfig:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: float = 1.0
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_args(cls, args) -> "SamplingConfig":
        return cls(max_tokens=args.max_completion_length, temperature=args.temperature, top_p=args.top_p,
                   top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                   extra=dict(args.generation_kwargs or {}))


@dataclass
class Rollout:
    """Completions of one rank, in slot order. Row i answers `prompt_ids[i]` (prompts repeat within a group)."""
    prompt_ids: List[List[int]]
    completion_ids: List[List[int]]        # sampled tokens (and inserted ones: tool_mask), eos included if it stopped
    sampler_logprobs: List[List[float]]    # the sampler's log-prob of each sampled token
    truncated: List[bool]                  # True when max_tokens cut the completion
    # 1 = sampled token, 0 = token the trainer inserted (a tool result, see rollout/tools.py): inserted tokens stay
    # in input_ids as context but leave the loss; their sampler_logprobs are 0.0. None: every token was sampled.
    tool_mask: Optional[List[List[int]]] = None
    # with tools: each completion as TRL's reward functions see it, the turns as messages (assistant turns with
    # their "tool_calls", then the tool results); None: the decoded text is the one assistant message
    messages: Optional[List[List[dict]]] = None

    def __len__(self) -> int:
        return len(self.completion_ids)

    def tensors(self, pad_id: int, rows: Optional[slice] = None) -> dict:
        """Padded tensors for rows: input_ids [B, P+T] (prompts left-padded, completions right-padded),
        attention_mask [B, P+T], completion_mask [B, T] (0 at padding and tool-result tokens), sampler_logps [B, T]."""
        idx = range(len(self))[rows or slice(None)]
        P = max(len(self.prompt_ids[i]) for i in idx)
        T = max(1, max(len(self.completion_ids[i]) for i in idx))
        B = len(idx)
        input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
        attention = torch.zeros((B, P + T), dtype=torch.long)
        sampler = torch.zeros((B, T), dtype=torch.float32)
        sampled = torch.ones((B, T), dtype=torch.float32)
        for row, i in enumerate(idx):
            p, c = self.prompt_ids[i], self.completion_ids[i]
            input_ids[row, P - len(p):P] = torch.tensor(p)
            attention[row, P - len(p):P + len(c)] = 1
            if c:
                input_ids[row, P:P + len(c)] = torch.tensor(c)
                sampler[row, :len(c)] = torch.tensor(self.sampler_logprobs[i], dtype=torch.float32)
                if self.tool_mask is not None:
                    sampled[row, :len(c)] = torch.tensor(self.tool_mask[i], dtype=torch.float32)
        completion_mask = attention[:, P:].float() * sampled
        return {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion_mask,
                "sampler_logps": sampler}

    def lengths(self) -> torch.Tensor:
        return torch.tensor([len(c) for c in self.completion_ids], dtype=torch.float32)


def round_seed(seed: int, round_index: int, slot: int) -> int:
    """A sampling seed for the prompt run starting at `slot` of generation round `round_index`."""
    return (seed * 1_000_003 + round_index * 100_003 + slot) % (2 ** 31 - 1)


class Generator(Protocol):
    def generate(self, prompt_ids: List[List[int]], counts: List[int], sampling: SamplingConfig,
                 seeds: Optional[List[int]] = None) -> Rollout:
        """Generate counts[j] completions for prompt j (sampled from seeds[j] when given); rows come out prompt
        by prompt, in order."""

    def load_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights with these HF-named full tensors (a no-op for backends that share the
        policy's parameters)."""

    def needs_weight_sync(self) -> bool: ...
