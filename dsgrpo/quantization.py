"""TRL 1.16's `quantization_config` (a BitsAndBytesConfig or its dict): QLoRA, a LoRA adapter trained on a 4- or
8-bit base model, on CUDA and on the CPU (bitsandbytes 0.50's CPU backend).

- The policy alone loads quantised (the argument, or `model_init_kwargs["quantization_config"]`): reward models keep
  their precision, and the reference is the policy with its adapter switched off (engines/lora.py), never a second
  copy. A quantised base trains only through an adapter, so `peft_config` is required.
- ZeRO-3 partitions the quantised weights as it does any frozen parameter: a 4-bit weight is a Params4bit holding
  packed bytes (its quant state, absmax and code book, stays whole on every rank, a few bytes per 64 weights), an
  8-bit one an Int8Params. Gathered, they are dequantised here (`dense_weight`) for vLLM and for exports: vLLM
  samples with the weights the trainer computes with, so the sampler's log-probs differ by rounding, not by the
  quantisation error.
- The memory planner counts a quantised base at its packed size (plan.py)."""

from __future__ import annotations

import sys
from typing import Dict, Optional, Tuple

import torch

from . import compat

BNB_VERSION = "0.50.2"  # the bitsandbytes both locks pin (its CPU backend runs 4- and 8-bit layers)


def bits_of(config) -> str:
    """'4-bit', '8-bit' or 'quantised' for a BitsAndBytesConfig, its dict, or another quantisation config."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    if get("load_in_4bit", False):
        return "4-bit"
    if get("load_in_8bit", False):
        return "8-bit"
    return "quantised"


def given(quantization_config, model_init_kwargs: Optional[dict]):
    """The quantization_config a run sets: the trainer argument (or YAML key), else model_init_kwargs' (both at
    once is an error, as in TRL)."""
    kwargs = model_init_kwargs if isinstance(model_init_kwargs, dict) else {}
    if quantization_config is not None and "quantization_config" in kwargs:
        raise ValueError(
            "quantization_config is set both as a GRPOTrainer argument and in args.model_init_kwargs: "
            "set it in one place (the trainer argument, as TRL prefers)."
        )
    return quantization_config if quantization_config is not None else kwargs.get("quantization_config")


def check(model, quantization_config, model_init_kwargs: Optional[dict], peft_config=None) -> Optional[str]:
    """Refuse what cannot train before anything is loaded: a quantised base without an adapter, a config that is
    not bitsandbytes', bitsandbytes missing. Returns a warning to print when the setting is ignored (a model passed
    as an instance, as TRL ignores it then), else None."""
    config = given(quantization_config, model_init_kwargs)
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
    if config is not None and not loaded_quantised and bits_of(config) == "quantised":
        raise ValueError(
            f"{what}: dsgrpo loads a quantised policy with bitsandbytes only; set load_in_4bit=True (QLoRA's "
            "nf4) or load_in_8bit=True."
        )
    has_adapter = peft_config is not None or type(model).__name__.startswith("Peft")
    if not has_adapter:
        raise ValueError(
            f"{what} without peft_config: a quantised base cannot be trained, only an adapter on it (QLoRA). "
            "Pass peft_config (e.g. peft.LoraConfig(r=16, lora_alpha=32, target_modules='all-linear')), or drop "
            "quantization_config to train the full-precision model."
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ImportError(
            f"{what} needs bitsandbytes: pip install bitsandbytes=={BNB_VERSION} (make setup installs it), or "
            "pip install 'dsgrpo[qlora]'."
        ) from None
    return None


def bnb_config(quantization_config, model_init_kwargs: Optional[dict], dtype: torch.dtype):
    """The BitsAndBytesConfig the policy loads with (None: not quantised). A dict (a YAML run) becomes one, its
    dtypes given by name; a 4-bit compute dtype the user left unset is the run's training dtype."""
    config = given(quantization_config, model_init_kwargs)
    if config is None:
        return None
    from transformers import BitsAndBytesConfig

    if isinstance(config, BitsAndBytesConfig):
        return _checked_storage(config, dtype)
    if not isinstance(config, dict):
        raise TypeError(
            f"quantization_config must be a transformers.BitsAndBytesConfig or a dict of its fields, not "
            f"{type(config).__name__}."
        )
    fields = dict(config)
    for key in ("bnb_4bit_compute_dtype", "bnb_4bit_quant_storage"):
        if isinstance(fields.get(key), str):
            fields[key] = getattr(torch, fields[key].replace("torch.", ""))
    fields.setdefault("bnb_4bit_compute_dtype", dtype)
    try:
        made = BitsAndBytesConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"quantization_config: {exc}. Give BitsAndBytesConfig's fields, e.g. "
            "{load_in_4bit: true, bnb_4bit_quant_type: nf4, bnb_4bit_use_double_quant: true}."
        ) from None
    return _checked_storage(made, dtype)


def _checked_storage(config, dtype: torch.dtype):
    """A 4-bit weight's packed bytes held in a floating dtype other than the engine's would be converted, value by
    value, when DeepSpeed casts the model to its precision: refused, naming the two choices that are safe."""
    storage = getattr(config, "bnb_4bit_quant_storage", torch.uint8)
    if config.load_in_4bit and storage.is_floating_point and storage != dtype:
        name = str(dtype).replace("torch.", "")
        raise ValueError(
            f"quantization_config.bnb_4bit_quant_storage={str(storage).replace('torch.', '')} but the engines hold "
            f"the model in {name}: DeepSpeed's cast to {name} would convert the packed 4-bit bytes as numbers. Set "
            f"bnb_4bit_quant_storage to {name} (what ZeRO-3 QLoRA recipes use) or leave it uint8."
        )
    return config


def bytes_per_weight(config) -> Optional[float]:
    """What one quantised weight costs (the memory planner): 4-bit, half a byte and its block's absmax (fp32 a block
    of 64, or with double quantisation 8 bits a block plus fp32 a block of 256 blocks); 8-bit, a byte (and a
    row's scale, negligible). None: not quantised."""
    if config is None:
        return None
    bits = bits_of(config)
    if bits == "8-bit":
        return 1.0
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    block = 64
    absmax = (1 + 4 / 256) / block if get("bnb_4bit_use_double_quant", False) else 4 / block
    return 0.5 + absmax


# ---------------------------------------------------------------------------------------------- quantised weights
def _kind(weight) -> Optional[str]:
    bnb = sys.modules.get("bitsandbytes")  # a quantised weight exists only once bitsandbytes is imported
    if bnb is None:
        return None
    if isinstance(weight, bnb.nn.Params4bit):
        return "4-bit"
    if isinstance(weight, bnb.nn.Int8Params):
        return "8-bit"
    return None


def quantised_layers(model: torch.nn.Module) -> Dict[int, torch.nn.Module]:
    """id(weight) -> its layer, for every bitsandbytes layer of `model` (empty for a model in full precision)."""
    if "bitsandbytes" not in sys.modules:
        return {}
    return {
        id(m.weight): m
        for m in model.modules()
        if isinstance(getattr(m, "weight", None), torch.nn.Parameter) and _kind(m.weight) is not None
    }


def prepare_loaded(model: torch.nn.Module) -> None:
    """A policy just loaded quantised, made trainable: its 4-bit weights keep the layout training reads."""
    compat.keep_4bit_training_layout(model)


def dense_spec(layer, dtype: torch.dtype) -> Tuple[Tuple[int, ...], torch.dtype]:
    """The shape and dtype a quantised layer's weight has in a checkpoint (its parameter holds packed bytes)."""
    return (layer.out_features, layer.in_features), dtype


def dense_weight(layer, dtype: torch.dtype) -> torch.Tensor:
    """A quantised layer's weight as a full-precision [out, in] tensor: call while its weight is gathered (under
    ZeRO-3 its `.data` then holds the whole packed weight)."""
    import bitsandbytes.functional as F

    weight = layer.weight
    if _kind(weight) == "4-bit":
        return F.dequantize_4bit(weight.data, weight.quant_state).to(dtype).reshape(layer.out_features, -1)
    rows, scales = compat.int8_rows_and_scales(layer)  # 8-bit: int8 rows, one scale (absmax / 127) a row
    return (rows.float() * scales.float().unsqueeze(1) / 127.0).to(dtype)
