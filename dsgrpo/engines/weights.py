"""A policy's weights as a Hugging Face checkpoint names them, streamed full from ZeRO-3 shards a bounded bucket at a
time: what weight sync, exports and the initial save of a model instance all read. A LoRA policy streams its
merged weights (engines/lora.py builds those units); everything else streams its parameters.

"As the checkpoint names them" matters for models whose modules differ from their checkpoints: transformers 5 keeps
a mixture-of-experts layer's experts fused (`mlp.experts.gate_up_proj` [E, 2I, H]) while checkpoints and vLLM name
them one expert at a time. Each gathered parameter goes through transformers' own reverse conversion
(compat.to_checkpoint_format) on its way out."""

from __future__ import annotations

from typing import Dict, Iterator, List, Tuple

import torch

from .. import compat
from .gather import Unit, full_tensors
from .lora import is_peft_model, merged_units, model_units


def checkpoint_units(module: torch.nn.Module) -> List[Unit]:
    """The units of a Hugging Face checkpoint of `module`: its parameters, or a LoRA policy's merged layers."""
    return merged_units(module) if is_peft_model(module) else model_units(module)


def base_model(module: torch.nn.Module) -> torch.nn.Module:
    return module.get_base_model() if is_peft_model(module) else module


def checkpoint_layout(module: torch.nn.Module) -> Dict[str, List[Tuple[str, Tuple[int, ...]]]]:
    """unit name → [(checkpoint name, full shape), ...] of what it streams out as: one entry named as itself for
    most units, several for a fused MoE tensor. Computed on meta tensors (nothing is gathered)."""
    units = checkpoint_units(module)
    with torch.device("meta"):
        meta = {u.name: torch.empty(u.shape) for u in units}
    converted = compat.to_checkpoint_format(base_model(module), dict(meta))
    layout: Dict[str, List[Tuple[str, Tuple[int, ...]]]] = {}
    kept = set(converted) & set(meta)
    for name in kept:
        layout[name] = [(name, tuple(converted[name].shape))]
    new = {n: t for n, t in converted.items() if n not in kept}
    if new:  # which unit each new name came from: convert each changed unit alone
        for name in (n for n in meta if n not in kept):
            layout[name] = [
                (k, tuple(v.shape))
                for k, v in compat.to_checkpoint_format(base_model(module), {name: meta[name]}).items()
            ]
    return layout


def named_full_parameters(
    module: torch.nn.Module, bucket_bytes: int, tied_lm_head: bool = False
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Checkpoint-named full tensors of an HF model (a LoRA policy: merged; a MoE layer: expert by expert). With
    tied embeddings `named_parameters()` lists the shared weight once (as the embedding); `tied_lm_head=True` also
    yields it as `lm_head.weight`, which vLLM needs."""
    layout = checkpoint_layout(module)
    model = base_model(module)
    for name, tensor in full_tensors(checkpoint_units(module), bucket_bytes):
        if layout[name] == [(name, tuple(tensor.shape))]:
            yield name, tensor
        else:
            yield from compat.to_checkpoint_format(model, {name: tensor}).items()
        if tied_lm_head and name.endswith("embed_tokens.weight"):
            yield "lm_head.weight", tensor


@torch.no_grad()
def mix_partitions(target: torch.nn.Module, source: torch.nn.Module, alpha: float) -> None:
    """target ← α·source + (1 − α)·target, parameter by parameter, on this rank's ZeRO-3 partitions (whole
    parameters when unpartitioned). When both modules are the same architecture partitioned over the same ranks,
    partition i of a target parameter holds the elements partition i of the source's does: nothing is gathered.
    A target parameter that ZeRO-3 keeps whole (a persistent small one) has its full copy mixed too, from the
    source's full copy (gathered when the source does not hold it: collective, every rank takes the same path).
    When one side is ZeRO-3 and the other whole (a ZeRO-3 policy beside a reference the plan keeps whole), the
    partitioned side is gathered for the mix, and a gathered target is partitioned again from rank 0's copy."""
    import deepspeed

    for (name, t), (other, s) in zip(target.named_parameters(), source.named_parameters()):
        if name != other or compat.full_shape(t) != compat.full_shape(s):
            raise ValueError(
                f"sync_ref_model: the reference's {name} does not match the policy's {other}; the two "
                "must be the same architecture."
            )
        if compat.is_zero3_param(t) != compat.is_zero3_param(s):  # one side whole: mix whole tensors
            partitioned = t if compat.is_zero3_param(t) else s
            with deepspeed.zero.GatheredParameters([partitioned], modifier_rank=0 if partitioned is t else None):
                t.data.mul_(1.0 - alpha).add_(s.data.to(t.dtype), alpha=alpha)
            continue
        t_part, s_part = compat.local_partition(t), compat.local_partition(s)
        t_part.mul_(1.0 - alpha).add_(s_part.to(t_part.dtype), alpha=alpha)
        if compat.is_zero3_param(t) and compat.held_whole(t):
            with deepspeed.zero.GatheredParameters([s], modifier_rank=None):
                t.data.mul_(1.0 - alpha).add_(s.data.to(t.dtype), alpha=alpha)
