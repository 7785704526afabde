"""Generation: the `Generator` protocol and `Rollout`; the colocated vLLM and HF backends; samplers (plain, tool
turns, rollout_func); rollout sources (how the loop gets each round's batch); weight sync."""

from .base import Generator, Rollout, SamplingConfig
from .weight_sync import TrainerWeightSync, check_against_checkpoint

__all__ = [
    "Generator",
    "Rollout",
    "SamplingConfig",
    "TrainerWeightSync",
    "check_against_checkpoint",
    "connect_generator",
    "make_generator",
]


def connect_generator(args):
    """An engine in other processes, reached before any model loads (a missing server or a refused token fails in
    seconds); None when this rank's engine is built by make_generator."""
    if args.use_vllm and args.vllm_mode == "server":
        from .server_client import ServerGenerator

        return ServerGenerator(args)
    return None


def make_generator(
    args,
    placement,
    *,
    model_path,
    policy_engine,
    tokenizer,
    dtype,
    zero3,
    tied,
    connected=None,
    total_steps=None,
    weight_sync=None,
):
    """The engine this rank generates with: vLLM (colocated) or the policy's own `generate`; None on a
    split-placement training rank, which only joins the generating ranks' engine start-up."""
    if not placement.generates:
        from .vllm_engine import join_engine_setup_without_engine

        join_engine_setup_without_engine(model_path, args, dtype=dtype, total_steps=total_steps)
        return None
    if connected is not None:  # a `dsgrpo vllm-serve` server (connect_generator)
        return connected.attach(policy_engine.module, tied, weight_sync)
    if args.use_vllm:
        from .vllm_engine import VLLMGenerator

        if args.vllm_tensor_parallel_size > 1:  # consecutive ranks share one engine
            from .. import dist
            from .tensor_parallel import TensorParallelGenerator

            dist.tensor_parallel_groups(args.vllm_tensor_parallel_size)
            return TensorParallelGenerator(VLLMGenerator(model_path, args, dtype=dtype, total_steps=total_steps))
        engine = VLLMGenerator(model_path, args, dtype=dtype, total_steps=total_steps)
        if not args.use_vllm_chosen_automatically or policy_engine is None:
            return engine
        from .hf_generate import FollowsReplacedGenerate

        return FollowsReplacedGenerate(
            engine, lambda: _hf_generator(args, policy_engine, tokenizer, zero3), policy_engine.module
        )
    return _hf_generator(args, policy_engine, tokenizer, zero3)


def _hf_generator(args, policy_engine, tokenizer, zero3):
    from .hf_generate import HFGenerator

    return HFGenerator(
        policy_engine,
        tokenizer,
        zero3=zero3,
        gather_for_generation=args.ds3_gather_for_generation,
        cache_implementation=args.cache_implementation,
    )
