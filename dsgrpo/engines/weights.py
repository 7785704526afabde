"""A policy's weights as a Hugging Face checkpoint names them, streamed full from ZeRO-3 shards a bounded bucket at a
time: what weight sync, exports and the initial save of a model instance all read. A LoRA policy streams its
merged weights (engines/lora.py builds those units); everything else streams its parameters."""

from __future__ import annotations

from typing import Iterator, List, Tuple

import torch

from .gather import Unit, full_tensors, plain_units
from .lora import is_peft_model, merged_units


def checkpoint_units(module: torch.nn.Module) -> List[Unit]:
    """The units of a Hugging Face checkpoint of `module`: its parameters, or a LoRA policy's merged layers."""
    return merged_units(module) if is_peft_model(module) else plain_units(module.named_parameters())


def named_full_parameters(module: torch.nn.Module, bucket_bytes: int,
                          tied_lm_head: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
    """Checkpoint-named full tensors of an HF model (a LoRA policy: merged). With tied embeddings
    `named_parameters()` lists the shared weight once (as the embedding); `tied_lm_head=True` also yields it as
    `lm_head.weight`, which vLLM needs."""
    for name, tensor in full_tensors(checkpoint_units(module), bucket_bytes):
        yield name, tensor
        if tied_lm_head and name.endswith("embed_tokens.weight"):
            yield "lm_head.weight", tensor
