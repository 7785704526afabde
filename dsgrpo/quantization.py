"""TRL 1.16's `quantization_config` (a BitsAndBytesConfig or its dict: QLoRA's 4- or 8-bit base model under LoRA).

What dsgrpo does with it today: refuse it before anything is loaded, naming why and what to do. bitsandbytes'
quantised weights need CUDA, and the DeepSpeed path for them (a quantised frozen base under LoRA, dequantised
merged weights for vLLM's sync, the memory planner counting the quantised base) is not built yet. A TRL user
passing it gets this error at once instead of a TypeError, or a load that fails deep inside transformers."""

from __future__ import annotations

from typing import Optional

from . import device


def bits_of(config) -> str:
    """'4-bit', '8-bit' or 'quantised' for a BitsAndBytesConfig, its dict, or another quantisation config."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    if get("load_in_4bit", False):
        return "4-bit"
    if get("load_in_8bit", False):
        return "8-bit"
    return "quantised"


def check(model, quantization_config, model_init_kwargs: Optional[dict]) -> Optional[str]:
    """Refuse a quantised base before any load. Returns a warning to print when the setting is ignored (a model
    passed as an instance, as TRL ignores it then), else None."""
    kwargs = model_init_kwargs if isinstance(model_init_kwargs, dict) else {}
    if quantization_config is not None and "quantization_config" in kwargs:
        raise ValueError(
            "quantization_config is set both as a GRPOTrainer argument and in args.model_init_kwargs: "
            "set it in one place (the trainer argument, as TRL prefers)."
        )
    config = quantization_config if quantization_config is not None else kwargs.get("quantization_config")
    loaded_quantised = getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
    if config is None and not loaded_quantised:
        return None
    if not isinstance(model, str) and not loaded_quantised:
        return (
            "quantization_config is ignored: the model was passed already loaded (TRL ignores it then too). "
            "Pass the model's name or path to load it quantised."
        )
    what = (
        "a model loaded in {} bits".format("4" if getattr(model, "is_loaded_in_4bit", False) else "8")
        if loaded_quantised
        else f"quantization_config ({bits_of(config)}, bitsandbytes)"
    )
    if not device.on_gpu():
        raise ValueError(
            f"{what}: bitsandbytes' quantised weights need a CUDA device, and this machine trains on "
            "the CPU (no CUDA device, or DS_ACCELERATOR=cpu). Drop quantization_config and train the "
            "full-precision model (with peft_config for LoRA), or run on a CUDA machine."
        )
    raise NotImplementedError(
        f"{what}: a quantised base under DeepSpeed (QLoRA) is not supported by dsgrpo yet. "
        "Drop quantization_config and train LoRA on the full-precision base (peft_config), "
        "which ZeRO-3 shards across the ranks."
    )
