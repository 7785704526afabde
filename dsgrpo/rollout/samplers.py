"""Samplers: how completions are made for some prompt rows. Every rollout source (the synchronous round, the async
worker's chunk, a split-placement generator) makes them through the one call

    sampler.sample(prompts, indices, counts, seeds) -> Rollout     # counts[j] completions of dataset row indices[j]

- `GeneratorSampler`: the prompts' token ids through a generator (colocated vLLM, or the policy's HF generate);
- `ToolSampler`: the same, answering tool calls between turns (rollout/tools.py), around any generator;
- `EnvironmentSampler`: tool turns against an environment instance per completion (rollout/environments.py);
- `RolloutFuncSampler`: the user's `rollout_func(prompts, trainer)` (rollout/custom.py), its extra keys kept as
  the rollout's columns for the reward functions.

Rows come out prompt by prompt, in order; `seeds[j]` seeds prompt j's run (None: unseeded)."""

from __future__ import annotations

import inspect

from typing import Callable, List, Optional, Protocol

from .base import Generator, Rollout, SamplingConfig
from .custom import rollout_from_func_output
from . import tool_formats as formats
from .environments import EnvironmentSampler
from .tensor_parallel import TensorParallelGenerator
from .tools import SegmentTurns, ToolRunner, run_tool_turns


class Sampler(Protocol):
    uses_tools: bool  # its rollouts carry tool_counts (the tools/* metrics)

    def sample(self, prompts, indices: List[int], counts: List[int], seeds: Optional[List[int]]) -> Rollout: ...

    def turns(self, prompts) -> Optional[SegmentTurns]:
        """Its tool turns for a source that steps the engine request by request (partial rollouts); None: one
        sampled segment per completion."""


class GeneratorSampler:
    uses_tools = False

    def __init__(self, generator: Generator, sampling: SamplingConfig):
        self.generator, self.sampling = generator, sampling

    def sample(self, prompts, indices, counts, seeds):
        return self.generator.generate([prompts.prompt_ids[i] for i in indices], counts, self.sampling, seeds=seeds)

    def turns(self, prompts):
        return None


class ToolSampler:
    uses_tools = True

    def __init__(
        self,
        generator: Generator,
        sampling: SamplingConfig,
        tokenizer,
        runner: ToolRunner,
        max_iterations: Optional[int],
        call_format=None,
        lockstep=None,
    ):
        self.generator, self.sampling, self.tokenizer = generator, sampling, tokenizer
        self.runner, self.max_iterations, self.call_format = runner, max_iterations, call_format
        self.lockstep = lockstep  # tools.run_tool_turns: the ranks of a tensor-parallel engine continue together

    def sample(self, prompts, indices, counts, seeds):
        rollout, _ = run_tool_turns(
            self.generator,
            self.tokenizer,
            [prompts.prompt_ids[i] for i in indices],
            counts,
            self.sampling,
            seeds,
            self.runner,
            self.max_iterations,
            chat_template_kwargs=prompts.chat_template_kwargs,
            call_format=self.call_format,
            lockstep=self.lockstep,
        )
        return rollout

    def turns(self, prompts):
        return SegmentTurns(prompts, self.tokenizer, self.call_format, self.max_iterations, self.runner)


class RolloutFuncSampler:
    """TRL's rollout_func contract: the user's function generates the rows; its extra keys become columns. Beyond
    TRL: a function that takes a `columns` keyword also gets the dataset's other columns (one list per column, a
    value per row), and one whose `reports_tool_counts` is true (rollout/agents.py) returns per-row `tool_counts`
    (tools.COUNTS' order) for the tools/* and episode/* metrics."""

    def __init__(self, rollout_func: Callable, trainer, tokenizer, max_tokens: int):
        self.rollout_func, self.trainer, self.tokenizer, self.max_tokens = rollout_func, trainer, tokenizer, max_tokens
        try:
            self.takes_columns = "columns" in inspect.signature(rollout_func).parameters
        except (TypeError, ValueError):  # a builtin or C callable: TRL's two arguments
            self.takes_columns = False
        self.uses_tools = bool(getattr(rollout_func, "reports_tool_counts", False))

    def sample(self, prompts, indices, counts, seeds):
        rows, columns = prompts.rows_for(indices, counts)
        out = self.rollout_func(rows, self.trainer, **({"columns": columns} if self.takes_columns else {}))
        return self.to_rollout(out, len(rows), prompts)

    def to_rollout(self, out, count: int, prompts) -> Rollout:
        """What the function returned for `count` rows, checked (custom.py), as a Rollout with its columns."""
        tool_counts = out.pop("tool_counts", None) if self.uses_tools and isinstance(out, dict) else None
        rollout, extra = rollout_from_func_output(
            out,
            count,
            eos_token_id=self.tokenizer.eos_token_id,
            max_tokens=self.max_tokens,
            vocab_size=len(self.tokenizer),
            dataset_columns=prompts.columns,
        )
        rollout.columns = extra
        if rollout.restarts is not None and any(rollout.restarts) and self.trainer.budget is None:
            raise ValueError(
                "rollout_func returned 'restarts' (completions sampled after prompts of their own), "
                "which train as separate sequences in packed steps, but this run trains padded "
                "micro-batches (token_budget=0, or a model that lets packed sequences attend to each "
                "other): leave token_budget unset, or return each row's last piece alone."
            )
        if self.uses_tools:
            rollout.tool_counts = tool_counts
        return rollout

    def turns(self, prompts):
        return None  # its own rollouts (partial rollouts of agents: rollout/agent_partial.py)


def make_sampler(
    generator: Optional[Generator],
    sampling: SamplingConfig,
    *,
    tokenizer,
    tool_runner: Optional[ToolRunner] = None,
    max_tool_calling_iterations: Optional[int] = None,
    rollout_func: Optional[Callable] = None,
    trainer=None,
    environments=None,
    tool_call_format: Optional[str] = None,
    lockstep: Optional[Callable[[bool], bool]] = None,
):
    """The sampler the trainer's arguments ask for (None where this rank has no generator and no rollout_func).
    `lockstep`: the generator's ranks must make the same calls (tools.run_tool_turns)."""
    if rollout_func is not None:
        return RolloutFuncSampler(rollout_func, trainer, tokenizer, sampling.max_tokens)
    if generator is None:
        return None
    call_format = formats.tool_call_format(tokenizer, tool_call_format)
    if lockstep is None and isinstance(generator, TensorParallelGenerator):
        lockstep = generator.lockstep
    if environments is not None:
        return EnvironmentSampler(
            generator, sampling, tokenizer, environments, max_tool_calling_iterations, call_format, lockstep
        )
    if tool_runner is not None:
        return ToolSampler(
            generator, sampling, tokenizer, tool_runner, max_tool_calling_iterations, call_format, lockstep
        )
    return GeneratorSampler(generator, sampling)
