"""The policy as a Hugging Face model folder: full weights (gathered from ZeRO-3 in buckets; a LoRA policy's merged),
config and tokenizer, loadable by AutoModelForCausalLM and vLLM."""

from __future__ import annotations

from .. import dist, quantization
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
        if quantization.quantised_layers(model):
            _save_dequantised(model, output_dir, state_dict)
        else:
            model.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)


def _save_dequantised(model, output_dir: str, state_dict: dict) -> None:
    """A QLoRA policy's merged model as a plain checkpoint: transformers' save_pretrained of a bitsandbytes model
    writes its own quantised state, not the tensors given, so the dequantised ones are written here (sharded as
    save_pretrained shards) with the model's config less its quantization_config."""
    import copy
    import os

    from huggingface_hub import save_torch_state_dict

    os.makedirs(output_dir, exist_ok=True)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(output_dir)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(output_dir)
    save_torch_state_dict(state_dict, output_dir, max_shard_size="5GB")
