"""The policy as a Hugging Face model folder: full weights (gathered from ZeRO-3 in buckets; a LoRA policy's merged),
config and tokenizer, loadable by AutoModelForCausalLM and vLLM."""

from __future__ import annotations

from .. import dist
from . import lora
from .weights import named_full_parameters


def save_hf_model(
    module, output_dir: str, bucket_bytes: int, tokenizer=None, gathers_on_every_rank: bool = True
) -> None:
    """Full (for a LoRA policy: merged) weights of `module` in Hugging Face format. With `gathers_on_every_rank`
    every rank iterates the (collective) gathers and rank 0 writes; without, the caller alone does both."""
    writes = dist.is_main() or not gathers_on_every_rank
    state_dict = {}
    for name, tensor in named_full_parameters(module, bucket_bytes):
        if writes:
            state_dict[name] = tensor
    if writes:
        model = module.get_base_model() if lora.is_peft_model(module) else module
        model.config.use_cache = True  # gradient checkpointing turned it off for training only
        model.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
