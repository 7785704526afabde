"""dsgrpo: GRPO training on DeepSpeed ZeRO-3 with a colocated vLLM engine.

`from dsgrpo import GRPOConfig, GRPOTrainer` mirrors TRL. Heavy modules (deepspeed, vllm) load only when the
trainer is first touched, so `import dsgrpo` and `import dsgrpo.algorithms` stay light.
"""

from .config import GRPOConfig

__version__ = "0.1.0"
__all__ = [
    "GRPOConfig",
    "GRPOTrainer",
    "AsyncGRPOTrainer",
    "AsyncRLGRPOTrainer",
    "agent_rollout",
    "agent_reward",
    "env_host_rollout",
    "env_host_dataset",
    "__version__",
]


def __getattr__(name):
    if name == "GRPOTrainer":
        from .trainer import GRPOTrainer

        return GRPOTrainer
    if name in ("AsyncGRPOTrainer", "AsyncRLGRPOTrainer"):  # the second name is the seed's
        from .async_trainer import AsyncGRPOTrainer

        return AsyncGRPOTrainer
    if name in ("agent_rollout", "agent_reward"):  # agents that run their own loop (rollout/agents.py)
        from .rollout import agents

        return getattr(agents, name)
    if name in ("env_host_rollout", "env_host_dataset"):  # ecosystems in their own Python (envhost/)
        from . import envhost

        return getattr(envhost, name)
    raise AttributeError(f"module 'dsgrpo' has no attribute {name!r}")
