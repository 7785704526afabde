"""Generation: the `Generator` protocol, the colocated vLLM and HF backends, and weight sync."""

from .base import Generator, Rollout, SamplingConfig
from .weight_sync import check_against_checkpoint, sync_weights

__all__ = ["Generator", "Rollout", "SamplingConfig", "sync_weights", "check_against_checkpoint", "make_generator"]


def make_generator(args, *, model_path, policy_engine, tokenizer, dtype, zero3):
    """The generator the config asks for: vLLM (colocated) or the policy's own `generate`."""
    if args.use_vllm:
        from .vllm_engine import VLLMGenerator
        return VLLMGenerator(model_path, args, dtype=dtype)
    from .hf_generate import HFGenerator
    return HFGenerator(policy_engine, tokenizer, zero3=zero3)
