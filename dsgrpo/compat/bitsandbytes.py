"""bitsandbytes 0.50.2: what QLoRA relies on beyond its public layers.
(See dsgrpo/compat/__init__.py: every symbol here is pinned in PINS.)"""

from __future__ import annotations

# (nothing heavy at import: the rank watcher imports compat, and must start in a fraction of a second)


def keep_4bit_training_layout(model) -> int:
    """Stop every 4-bit layer of `model` repacking its weight for bitsandbytes' CPU inference kernel: on a CPU with
    AVX-512 BF16, Linear4bit's first forward in eval mode without gradients replaces `weight.data` with another
    layout and routes every later forward, training ones too, through a kernel with no backward (and under
    ZeRO-3 the repacked bytes are not the partitioned parameter's). The trainer's no-grad forwards (reference,
    old log-probs) run in eval mode, so the flag is cleared once, at load. Returns the layers changed."""
    import bitsandbytes as bnb

    changed = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit) and getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            changed += 1
    return changed


def int8_rows_and_scales(layer):
    """An 8-bit layer's int8 rows and their scales (absmax / 127 a row). bitsandbytes moves both from the weight
    (CB, SCB) to the layer's matmul state at its first forward; under ZeRO-3 the gathered `weight.data` holds the
    rows."""
    weight = layer.weight
    scales = weight.SCB if getattr(weight, "SCB", None) is not None else layer.state.SCB
    rows = weight.data if weight.data.numel() else layer.state.CB
    return rows, scales
