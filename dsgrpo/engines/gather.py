"""Full (unsharded) parameters out of a ZeRO-3 module, a bounded bucket at a time.

`GatheredParameters` is a collective: every rank must iterate these generators to the end, in the same order.
Only public DeepSpeed APIs are used; never `state_dict()` on a ZeRO-3 module (it returns empty shards)."""

from __future__ import annotations

from typing import Iterator, List, Tuple

import torch


def _is_partitioned(p: torch.nn.Parameter) -> bool:
    return hasattr(p, "ds_id")


def _nbytes(p: torch.nn.Parameter) -> int:
    return (p.ds_numel if _is_partitioned(p) else p.numel()) * p.element_size()


def full_parameters(params: List[Tuple[str, torch.nn.Parameter]], bucket_bytes: int) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield (name, full tensor copy) for each parameter, gathering at most ~bucket_bytes at a time (a parameter
    larger than the bucket is gathered alone). The copies are owned by the caller; the gathered storage is
    released before the next bucket, so peak extra memory is one bucket plus its copies."""
    import deepspeed

    bucket: List[Tuple[str, torch.nn.Parameter]] = []
    size = 0

    def flush():
        ps = [p for _, p in bucket]
        with deepspeed.zero.GatheredParameters([p for p in ps if _is_partitioned(p)], modifier_rank=None):
            return [(n, p.data.detach().clone()) for n, p in bucket]

    for name, p in params:
        if bucket and size + _nbytes(p) > bucket_bytes:
            yield from flush()
            bucket, size = [], 0
        bucket.append((name, p))
        size += _nbytes(p)
    if bucket:
        yield from flush()


def named_full_parameters(module: torch.nn.Module, bucket_bytes: int, tied_lm_head: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
    """Checkpoint-named full tensors of an HF model. With tied embeddings `named_parameters()` lists the shared
    weight once (as the embedding); `tied_lm_head=True` also yields it as `lm_head.weight`, which vLLM needs."""
    input_embedding = module.get_input_embeddings().weight if tied_lm_head else None
    for name, tensor in full_parameters(list(module.named_parameters()), bucket_bytes):
        yield name, tensor
        if input_embedding is not None and name.endswith("embed_tokens.weight"):
            yield "lm_head.weight", tensor
