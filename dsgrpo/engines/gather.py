"""Full (unsharded) checkpoint tensors out of a ZeRO-3 module, a bounded bucket at a time.

`GatheredParameters` is a collective: every rank must iterate these generators to the end, in the same order.
Only public DeepSpeed APIs are used; never `state_dict()` on a ZeRO-3 module (it returns empty shards).

A checkpoint tensor is a `Unit`: the parameters to gather and how to make the tensor from them. For a plain
model each unit is one parameter; for a LoRA policy a target layer's unit is its base weight and its two
adapter matrices, merged while gathered (engines/lora.py, assembled by engines/weights.py), so the merged model
streams out one layer at a time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, List, Optional, Tuple, TypeVar

import torch

from .. import compat

T = TypeVar("T")


@dataclass
class Unit:
    name: str                                   # the name in a Hugging Face checkpoint of the model
    params: Tuple[torch.nn.Parameter, ...]      # gathered together
    combine: Optional[Callable[[], torch.Tensor]] = None  # builds the tensor while gathered; None: copy params[0]

    @property
    def shape(self) -> Tuple[int, ...]:
        return compat.full_shape(self.params[0])

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


def _nbytes(p: torch.nn.Parameter) -> int:
    return compat.full_numel(p) * p.element_size()


def plain_units(named_params) -> List[Unit]:
    return [Unit(name, (p,)) for name, p in named_params]


def byte_buckets(items: Iterable[T], nbytes: Callable[[T], int], bucket_bytes: int,
                 key: Optional[Callable[[T], Any]] = None) -> Iterator[List[T]]:
    """Group a stream into consecutive buckets of at most ~bucket_bytes (an item larger than that is a bucket of
    its own). With `key`, a bucket also holds items of one key only (one dtype per flat buffer, say). Lazy: a
    bucket is yielded as soon as the next item would not fit, so at most one bucket is held."""
    bucket: List[T] = []
    size = 0
    for item in items:
        n = nbytes(item)
        if bucket and (size + n > bucket_bytes or (key is not None and key(item) != key(bucket[0]))):
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += n
    if bucket:
        yield bucket


def full_tensors(units: List[Unit], bucket_bytes: int) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) for each unit, gathering at most ~bucket_bytes at a time (a unit larger than
    the bucket is gathered alone). The tensors are owned by the caller; the gathered storage is released
    before the next bucket, so peak extra memory is one bucket plus its tensors."""
    import deepspeed

    for bucket in byte_buckets(units, Unit.nbytes, bucket_bytes):
        params = {id(p): p for u in bucket for p in u.params if compat.is_zero3_param(p)}
        GatherStats.peak_bytes = max(GatherStats.peak_bytes, sum(_nbytes(p) for p in params.values()))
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None), torch.no_grad():
            tensors = [(u.name, u.tensor()) for u in bucket]
        yield from tensors


def full_parameters(params: List[Tuple[str, torch.nn.Parameter]], bucket_bytes: int) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, full copy) of each given parameter, bucket by bucket."""
    return full_tensors(plain_units(params), bucket_bytes)
