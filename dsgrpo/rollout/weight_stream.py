"""Weights to an engine in another process (a `dsgrpo vllm-serve` server, split placement's generating ranks): the
sender packs full tensors into buckets of one dtype and broadcasts each bucket's manifest, then its bytes; the
receiver checks each manifest (it may come from the network) before it allocates anything."""

from __future__ import annotations

from typing import Optional

import torch

from ..engines.gather import byte_buckets


def largest_bucket_bytes(source_meta, bucket_bytes: int) -> int:
    """The largest bucket send_weights can make of these tensors: a tensor larger than a bucket is sent alone."""
    sizes = [int(torch.Size(m.shape).numel()) * torch.empty((), dtype=m.dtype).element_size() for m in source_meta]
    return max([bucket_bytes] + sizes)


def send_weights(named_tensors, bucket_bytes: int, channel, src: int, sending: bool) -> None:
    """The sending side of a weight stream to engines in other processes (split placement's generators, a vLLM
    server). Every training rank iterates `named_tensors` (its ZeRO-3 gathers are collective over the training
    ranks); the `sending` rank packs the full tensors into buckets of about `bucket_bytes` (one dtype each) and
    broadcasts each over `channel` (dist.GroupChannel or dist.Communicator) from rank `src`: first the bucket's
    manifest, then one flat buffer. An empty manifest ends the stream."""
    if not sending:
        for _ in named_tensors:  # the gathers are collective: take part, send nothing
            pass
        return
    for bucket in byte_buckets(
        named_tensors, lambda nt: nt[1].numel() * nt[1].element_size(), bucket_bytes, key=lambda nt: nt[1].dtype
    ):
        channel.broadcast_plain([(n, tuple(t.shape), str(t.dtype)) for n, t in bucket], src=src)
        channel.broadcast(torch.cat([t.reshape(-1) for _, t in bucket]), src=src)
    channel.broadcast_plain([], src=src)


WEIGHT_DTYPES = {
    str(t): t
    for t in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.bool,
    )
}


def manifest_dtype(manifest) -> torch.dtype:
    """A bucket's manifest is [[name, shape, dtype], ...] with one dtype; anything else (it may come from the
    network) is refused before a byte is allocated."""
    if not isinstance(manifest, list) or not all(
        isinstance(e, (list, tuple))
        and len(e) == 3
        and isinstance(e[0], str)
        and isinstance(e[1], (list, tuple))
        and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in e[1])
        and e[2] == manifest[0][2]
        for e in manifest
    ):
        raise ValueError("malformed weight manifest: expected [[name, shape, dtype], ...] of one dtype")
    if manifest[0][2] not in WEIGHT_DTYPES:
        raise ValueError(f"weight manifest names dtype {manifest[0][2]!r}: not one of {sorted(WEIGHT_DTYPES)}")
    return WEIGHT_DTYPES[manifest[0][2]]


def received_weights(channel, src: int, max_bytes: Optional[int] = None):
    """The receiving side: yield (name, tensor) as buckets arrive, until the empty manifest. A bucket larger than
    `max_bytes` is refused before anything is allocated for it."""
    while True:
        manifest = channel.broadcast_plain(None, src=src)
        if not manifest:
            return
        dtype = manifest_dtype(manifest)
        numel = sum(int(torch.Size(shape).numel()) for _, shape, _ in manifest)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if max_bytes is not None and nbytes > max_bytes:
            raise ValueError(
                f"a weight bucket of {nbytes} bytes arrived; this engine takes at most {max_bytes} "
                "(--max-weight-bucket-bytes)"
            )
        flat = torch.empty(numel, dtype=dtype)
        channel.broadcast(flat, src=src)
        offset = 0
        for name, shape, _ in manifest:
            n = int(torch.Size(shape).numel())
            yield name, flat[offset : offset + n].view(shape)
            offset += n
