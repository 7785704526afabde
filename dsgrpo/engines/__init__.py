"""DeepSpeed engines for the policy, the frozen reference and reward models, and ZeRO-3 gathering helpers."""

from .builder import ModelLoader, build_inference_engine, build_policy_engine, fill_auto_values, is_zero3, resolve
from .forward import Forward, completion_logprobs, policy_forward
from .gather import full_parameters
from .weights import named_full_parameters

__all__ = [
    "ModelLoader",
    "build_policy_engine",
    "build_inference_engine",
    "fill_auto_values",
    "is_zero3",
    "resolve",
    "completion_logprobs",
    "policy_forward",
    "Forward",
    "full_parameters",
    "named_full_parameters",
]
