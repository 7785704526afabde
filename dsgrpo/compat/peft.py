"""peft 0.21.2: LoRA layers and their merged weights.
(See dsgrpo/compat/__init__.py: every symbol here is pinned in PINS.)"""

from __future__ import annotations

import contextlib


def lora_layer_types():
    """(LoraLayer, the LoRA linear layer classes) of the installed peft: lora.Linear, and with bitsandbytes its
    4- and 8-bit layers (QLoRA), which are LoraLayers but not lora.Linear."""
    from peft.tuners.lora import Linear, LoraLayer

    linear = (Linear,)
    try:
        from peft.tuners.lora.bnb import Linear4bit, Linear8bitLt

        linear += (Linear4bit, Linear8bitLt)
    except ImportError:  # no bitsandbytes: no quantised layers either
        pass
    return LoraLayer, linear


@contextlib.contextmanager
def params_holding(params, tensors):
    """Each parameter's `.data` is the given full tensor for the duration (a ZeRO-3 parameter outside a gather holds
    an empty placeholder there): PEFT's delta weight reads lora_A / lora_B through `.weight`, and the weight sync
    gathers into buffers of its own, not into the parameters."""
    saved = [p.data for p in params]
    try:
        for p, t in zip(params, tensors):
            p.data = t
        yield
    finally:
        for p, d in zip(params, saved):
            p.data = d


def lora_merged_weight(layer, base, adapter: str):
    """W + ΔW of one LoRA layer, W its base weight as a full-precision tensor (call while its adapter is
    gathered)."""
    return base + layer.get_delta_weight(adapter).to(base.dtype)
