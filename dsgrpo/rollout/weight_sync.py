"""After an optimizer step, stream the policy's ZeRO-3 parameters into the generation engine."""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from ..engines.gather import byte_buckets
from ..engines.weights import checkpoint_layout, named_full_parameters


def expected_checkpoint_shapes(module, tied_lm_head: bool) -> Dict[str, Tuple[int, ...]]:
    """Names and full shapes the sync will send (ZeRO-3 keeps the full shape in `ds_shape`; fused MoE experts are
    sent one expert at a time, as the checkpoint names them)."""
    shapes = {name: shape for entries in checkpoint_layout(module).values() for name, shape in entries}
    if tied_lm_head:
        emb = [n for n in shapes if n.endswith("embed_tokens.weight")]
        if emb:
            shapes["lm_head.weight"] = shapes[emb[0]]
    return shapes


def check_against_checkpoint(module, model_path: str, tied_lm_head: bool) -> None:
    """A reload that fails half-way leaves vLLM's weights on the meta device and kills the engine, so check
    names and shapes against the checkpoint vLLM loaded before the first sync."""
    import glob
    import os

    from safetensors import safe_open

    files = glob.glob(os.path.join(model_path, "*.safetensors"))
    if not files:
        return  # a hub id or .bin checkpoint: nothing local to compare against
    on_disk = {}
    for f in files:
        with safe_open(f, framework="pt") as fh:
            for key in fh.keys():
                on_disk[key] = tuple(fh.get_slice(key).get_shape())
    sending = expected_checkpoint_shapes(module, tied_lm_head)
    missing = sorted(set(on_disk) - set(sending))
    wrong = sorted(n for n in set(on_disk) & set(sending) if on_disk[n] != sending[n])
    if missing or wrong:
        raise ValueError(f"Weight sync would not match the checkpoint vLLM loaded from {model_path}: "
                         f"missing {missing[:5]}, shape mismatch {wrong[:5]}. The policy must be the same "
                         "architecture as that checkpoint.")


def sync_weights(policy_module, generator, bucket_bytes: int, tied_lm_head: bool) -> None:
    """Every rank calls this (the gathers are collective), after every optimizer step that precedes a
    generation."""
    if not generator.needs_weight_sync():
        return
    generator.load_weights(named_full_parameters(policy_module, bucket_bytes, tied_lm_head))


# ------------------------------------------------------------------------------ weights to another process's engine
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
    for bucket in byte_buckets(named_tensors, lambda nt: nt[1].numel() * nt[1].element_size(), bucket_bytes,
                               key=lambda nt: nt[1].dtype):
        channel.broadcast_plain([(n, tuple(t.shape), str(t.dtype)) for n, t in bucket], src=src)
        channel.broadcast(torch.cat([t.reshape(-1) for _, t in bucket]), src=src)
    channel.broadcast_plain([], src=src)


WEIGHT_DTYPES = {str(t): t for t in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn,
                                     torch.float8_e5m2, torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool)}


def manifest_dtype(manifest) -> torch.dtype:
    """A bucket's manifest is [[name, shape, dtype], ...] with one dtype; anything else (it may come from the
    network) is refused before a byte is allocated."""
    if not isinstance(manifest, list) or not all(
            isinstance(e, (list, tuple)) and len(e) == 3 and isinstance(e[0], str) and isinstance(e[1], (list, tuple))
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in e[1])
            and e[2] == manifest[0][2] for e in manifest):
        raise ValueError("malformed weight manifest: expected [[name, shape, dtype], ...] of one dtype")
    if manifest[0][2] not in WEIGHT_DTYPES:
        raise ValueError(f"weight manifest names dtype {manifest[0][2]!r}: not one of {sorted(WEIGHT_DTYPES)}")
    return WEIGHT_DTYPES[manifest[0][2]]


def received_weights(channel, src: int):
    """The receiving side: yield (name, tensor) as buckets arrive, until the empty manifest."""
    while True:
        manifest = channel.broadcast_plain(None, src=src)
        if not manifest:
            return
        dtype = manifest_dtype(manifest)
        flat = torch.empty(sum(int(torch.Size(shape).numel()) for _, shape, _ in manifest), dtype=dtype)
        channel.broadcast(flat, src=src)
        offset = 0
        for name, shape, _ in manifest:
            n = int(torch.Size(shape).numel())
            yield name, flat[offset:offset + n].view(shape)
            offset += n
