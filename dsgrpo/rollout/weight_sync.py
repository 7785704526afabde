"""After an optimizer step, stream the policy's ZeRO-3 parameters into the generation engine."""

from __future__ import annotations

from typing import Dict, Tuple

from ..engines.gather import named_full_parameters


def expected_checkpoint_shapes(module, tied_lm_head: bool) -> Dict[str, Tuple[int, ...]]:
    """Names and full shapes the sync will send (ZeRO-3 keeps the full shape in `ds_shape`)."""
    shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()}
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
