"""The one place that picks the rollout source a trainer builds: the trainer's own (GenerationSource for
GRPOTrainer, AsyncSource for AsyncGRPOTrainer) or the variant an option asks for. The sources never choose among
themselves, so none imports another to hand over to it."""

from __future__ import annotations

from .agent_partial import AgentPartialSource
from .agents import AgentRollout
from .partial_source import PartialRolloutSource
from .sources import GenerationSource, RolloutSource


def choose_source(args, trainer_source: type, rollout_func=None) -> type:
    """The RolloutSource class to build for `args`. partial_rollout=True turns GenerationSource (or a subclass)
    into PartialRolloutSource, or AgentPartialSource for agent_rollout's agents; AsyncSource carries partial
    rollouts in its own worker."""
    if not issubclass(trainer_source, RolloutSource):
        raise TypeError(f"rollout_source must be a RolloutSource class, not {trainer_source!r}.")
    if args.partial_rollout and issubclass(trainer_source, GenerationSource):
        return AgentPartialSource if isinstance(rollout_func, AgentRollout) else PartialRolloutSource
    return trainer_source
