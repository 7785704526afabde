"""Full (unsharded) checkpoint tensors out of a ZeRO-3 module, a bounded bucket at a time.

`GatheredParameters` is a collective: every rank must iterate these generators to the end, in the same order.
Only public DeepSpeed APIs are used; never `state_dict()` on a ZeRO-3 module (it returns empty shards).

A checkpoint tensor is a `Unit`: the parameters to gather and how to make the tensor from them. For a plain
model each unit is one parameter; for a LoRA policy a target layer's unit is its base weight and its two
adapter matrices, merged while gathered (engines/lora.py), so the merged model streams out one layer at a time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Tuple

import torch


@dataclass
class Unit:
    name: str                                   # the name in a Hugging Face checkpoint of the model
    params: Tuple[torch.nn.Parameter, ...]      # gathered together
    combine: Optional[Callable[[], torch.Tensor]] = None  # builds the tensor while gathered; None: copy params[0]

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(getattr(self.params[0], "ds_shape", self.params[0].shape))

    def nbytes(self) -> int:
        return sum(_nbytes(p) for p in self.params)

    def tensor(self) -> torch.Tensor:
        return self.combine() if self.combine is not None else self.params[0].data.detach().clone()


class GatherStats:
    """Peak bytes of full parameters held gathered at once by the gathers below (per rank), so a sync's memory
    cost can be reported: the goal is one bucket or one layer, never the model."""
    peak_bytes = 0

    @classmethod
    def reset(cls) -> None:
        cls.peak_bytes = 0


def _is_partitioned(p: torch.nn.Parameter) -> bool:
    return hasattr(p, "ds_id")


def _nbytes(p: torch.nn.Parameter) -> int:
    return (p.ds_numel if _is_partitioned(p) else p.numel()) * p.element_size()


def plain_units(named_params) -> List[Unit]:
    return [Unit(name, (p,)) for name, p in named_params]


def full_tensors(units: List[Unit], bucket_bytes: int) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) for each unit, gathering at most ~bucket_bytes at a time (a unit larger than
    the bucket is gathered alone). The tensors are owned by the caller; the gathered storage is released
    before the next bucket, so peak extra memory is one bucket plus its tensors."""
    import deepspeed

    bucket: List[Unit] = []
    size = 0

    def flush():
        params = {id(p): p for u in bucket for p in u.params if _is_partitioned(p)}
        GatherStats.peak_bytes = max(GatherStats.peak_bytes, sum(_nbytes(p) for p in params.values()))
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None), torch.no_grad():
            return [(u.name, u.tensor()) for u in bucket]

    for unit in units:
        if bucket and size + unit.nbytes() > bucket_bytes:
            yield from flush()
            bucket, size = [], 0
        bucket.append(unit)
        size += unit.nbytes()
    if bucket:
        yield from flush()


def full_parameters(params: List[Tuple[str, torch.nn.Parameter]], bucket_bytes: int) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, full copy) of each given parameter, bucket by bucket."""
    return full_tensors(plain_units(params), bucket_bytes)


def checkpoint_units(module: torch.nn.Module) -> List[Unit]:
    """The units of a Hugging Face checkpoint of `module`: its parameters, or a LoRA policy's merged layers."""
    from .lora import is_peft_model, merged_units
    return merged_units(module) if is_peft_model(module) else plain_units(module.named_parameters())


def named_full_parameters(module: torch.nn.Module, bucket_bytes: int, tied_lm_head: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
    """Checkpoint-named full tensors of an HF model (a LoRA policy: merged). With tied embeddings
    `named_parameters()` lists the shared weight once (as the embedding); `tied_lm_head=True` also yields it as
    `lm_head.weight`, which vLLM needs."""
    for name, tensor in full_tensors(checkpoint_units(module), bucket_bytes):
        yield name, tensor
        if tied_lm_head and name.endswith("embed_tokens.weight"):
            yield "lm_head.weight", tensor
