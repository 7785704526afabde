"""LoRA policies (`peft_config`) on ZeRO-3.

- The model is wrapped with peft before DeepSpeed sees it, so only the adapter matrices require gradients and
  only they get optimizer state; the base weights stay frozen and partitioned.
- The reference model is the same network with the adapters disabled (`PeftModel.disable_adapter`): no second
  engine, no second copy of the weights.
- vLLM and Hugging Face exports get merged weights, W + scaling·B·A, built one layer at a time while that
  layer's base weight and adapter are gathered (`merged_units`, consumed by engines/gather.py).
- `save_adapter` writes the adapter alone in PEFT's format (adapter_config.json + adapter_model.safetensors)."""

from __future__ import annotations

import os
import sys
from typing import Any, List

import torch

from .. import compat, quantization
from ..errors import CheckpointError
from .gather import Unit, full_parameters

UNSUPPORTED = {  # LoraConfig field -> why the merged weight sync cannot honour it yet
    "use_dora": "DoRA rescales the merged weight by a learned magnitude",
    "modules_to_save": "fully trained module copies are not part of the merged-weight stream",
}


def require_peft():
    try:
        import peft
    except ImportError:
        raise ImportError(
            "peft_config needs the `peft` package: `pip install 'dsgrpo[peft]'` (make setup installs it)."
        ) from None
    return peft


def is_peft_model(model: Any) -> bool:
    peft = sys.modules.get("peft")  # a PeftModel exists only once peft is imported: plain runs never import it
    return peft is not None and isinstance(model, peft.PeftModel)


def as_lora_config(peft_config):
    """A peft.LoraConfig from what a user may pass: the config itself, or a dict of its fields (YAML runs)."""
    peft = require_peft()
    if isinstance(peft_config, dict):
        try:
            peft_config = peft.LoraConfig(**peft_config)
        except TypeError as exc:
            raise ValueError(
                f"peft_config: {exc}. Give peft.LoraConfig's fields, e.g. "
                "{r: 16, lora_alpha: 32, target_modules: all-linear}."
            ) from None
    if not isinstance(peft_config, peft.PeftConfig) or peft_config.peft_type != peft.PeftType.LORA:
        kind = getattr(peft_config, "peft_type", type(peft_config).__name__)
        raise ValueError(
            f"peft_config must be a peft.LoraConfig (got {kind}): dsgrpo merges LoRA adapters into "
            "the weights it sends to vLLM, and only LoRA has that merge."
        )
    for field, why in UNSUPPORTED.items():
        if getattr(peft_config, field, None):
            raise ValueError(f"peft_config.{field} is not supported ({why}); leave it unset.")
    return peft_config


def check_lora_model(model, peft_config) -> None:
    """Before loading: a model that is already a PeftModel carries its own adapter config."""
    if peft_config is not None and is_peft_model(model):
        raise ValueError(
            "model is already a PeftModel and peft_config was given too: which adapter to train is "
            "ambiguous. Pass the PeftModel with peft_config=None to train its adapter, or the base "
            "model with peft_config to add a new one."
        )


def fingerprint(peft_config) -> dict:
    """What a checkpoint's adapter must match to be resumed (JSON-able)."""
    targets = peft_config.target_modules
    return {
        "r": peft_config.r,
        "lora_alpha": peft_config.lora_alpha,
        "use_rslora": bool(peft_config.use_rslora),
        "target_modules": sorted(targets) if isinstance(targets, (set, list, tuple)) else targets,
    }


def wrap_with_lora(model, peft_config, seed: int):
    """The peft-wrapped policy. The adapters are initialised from `seed` in every rank alike, so ZeRO-3
    partitions one consistent initialisation (each rank keeps its slice of its own copy)."""
    peft = require_peft()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapped = peft.get_peft_model(model, peft_config)
    check_lora_layers(wrapped)
    return wrapped


def check_lora_layers(peft_model) -> None:
    LoraLayer, Linear = compat.lora_layer_types()
    adapters = peft_model.active_adapters
    if len(adapters) != 1:
        raise ValueError(
            f"the LoRA policy has {len(adapters)} active adapters {adapters}; dsgrpo trains one. "
            "Activate one with model.set_adapter(name)."
        )
    other = [n for n, m in peft_model.named_modules() if isinstance(m, LoraLayer) and not isinstance(m, Linear)]
    if other:
        raise ValueError(
            f"peft_config targets non-linear layers {other[:3]}: dsgrpo merges LoRA into linear "
            "layers only. Narrow target_modules to linear projections (e.g. 'all-linear')."
        )


def merged_units(peft_model) -> List[Unit]:
    """Checkpoint units of the merged model, in the base model's parameter order and names: a LoRA layer's
    weight unit gathers its base weight and adapter together and yields W + ΔW; a quantised weight (QLoRA's
    base) is dequantised on the way; everything else is a copy."""
    LoraLayer, _ = compat.lora_layer_types()
    base = peft_model.get_base_model()
    adapter = peft_model.active_adapters[0]
    quantised, dtype = quantization.quantised_layers(base), _loaded_dtype(base)
    layer_of = {}  # id(parameter) -> (layer name, layer) for every parameter inside a LoRA layer
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            layer_of.update({id(p): (name, module) for p in module.parameters()})
    units, done = [], set()
    for name, p in base.named_parameters():
        if id(p) not in layer_of:
            units.append(_plain_unit(name, p, quantised, dtype))
            continue
        layer_name, layer = layer_of[id(p)]
        if layer_name in done:
            continue
        done.add(layer_name)
        base_layer = layer.get_base_layer()
        weight = base_layer.weight
        q = quantised.get(id(weight))
        units.append(
            Unit(
                f"{layer_name}.weight",
                (weight, layer.lora_A[adapter].weight, layer.lora_B[adapter].weight),
                combine=_merge(layer, weight, adapter, q, dtype),
                dense=quantization.dense_spec(q, dtype) if q is not None else None,
            )
        )
        bias = layer.get_base_layer().bias
        if bias is not None:
            units.append(Unit(f"{layer_name}.bias", (bias,)))
    return units


def model_units(model) -> List[Unit]:
    """Checkpoint units of a model without an adapter: its parameters, a quantised weight dequantised."""
    quantised, dtype = quantization.quantised_layers(model), _loaded_dtype(model)
    return [_plain_unit(name, p, quantised, dtype) for name, p in model.named_parameters()]


def _loaded_dtype(model) -> torch.dtype:
    """The precision the model was loaded in: its input embedding's (never quantised), else its first floating
    parameter's."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embedding is not None and getattr(embedding, "weight", None) is not None:
        return embedding.weight.dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _plain_unit(name: str, p, quantised: dict, dtype) -> Unit:
    q = quantised.get(id(p))
    if q is None:
        return Unit(name, (p,))
    return Unit(name, (p,), lambda: quantization.dense_weight(q, dtype), quantization.dense_spec(q, dtype))


def _merge(layer, weight, adapter, quantised, dtype):
    if quantised is None:
        return lambda: compat.lora_merged_weight(layer, weight.data, adapter)
    return lambda: compat.lora_merged_weight(layer, quantization.dense_weight(quantised, dtype), adapter)


def save_adapter(peft_model, output_dir: str, bucket_bytes: int, is_main: bool) -> None:
    """The adapter (every trainable parameter, gathered) in PEFT's format; every rank calls it, `is_main` writes."""
    trainable = [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad]
    state = {n: t for n, t in full_parameters(trainable, bucket_bytes)}
    if is_main:
        peft_model.save_pretrained(output_dir, state_dict=state, safe_serialization=True)


def adapter_summary(peft_model) -> str:
    trainable = sum(compat.full_numel(p) for p in peft_model.parameters() if p.requires_grad)
    total = sum(compat.full_numel(p) for p in peft_model.parameters())
    return f"LoRA: {trainable:,} trainable parameters of {total:,} ({100 * trainable / max(total, 1):.2f}%)"


def export_adapter(checkpoint: str, state_dict: dict, out_dir: str, merged: bool) -> None:
    """`dsgrpo export` of a LoRA run's checkpoint: its engine state holds the adapter only (peft names). The
    adapter is rebuilt on a weightless (meta) base and saved in PEFT's format; `merged` loads the base model
    named in adapter_config.json and writes base + adapter to out_dir/merged."""
    from transformers import AutoConfig, AutoModelForCausalLM

    peft = require_peft()
    config = peft.PeftConfig.from_pretrained(checkpoint)
    if merged:
        base = AutoModelForCausalLM.from_pretrained(config.base_model_name_or_path, dtype=torch.float32)
    else:
        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint))
    model = peft.get_peft_model(base, config)
    adapter = {n for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(adapter - set(state_dict))
    if missing:
        raise CheckpointError(
            f"{checkpoint}: the engine state lacks adapter weights {missing[:3]}; it was not "
            "written with this adapter_config.json."
        )
    model.load_state_dict({n: state_dict[n] for n in adapter}, strict=False, assign=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if merged:
        model.merge_and_unload().save_pretrained(os.path.join(out_dir, "merged"), safe_serialization=True)
