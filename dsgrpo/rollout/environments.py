"""Environments (TRL 1.16's `GRPOTrainer(environment_factory=...)`): a stateful world each rollout acts in.

`environment_factory` is a callable returning an environment instance, or a dict {name: callable} where each
dataset row's `environment` column picks one. Every completion gets an instance of its own (drawn from a pool that
grows to the most instances a round needs: "construct once, reset often"); then, per completion:

    observation = env.reset(**row)          # a str is appended to the prompt's last message (None: nothing)
    tool turns as with `tools`              # the environment's public methods are its tools (rollout/tools.py)
    env.get_reward()                        # optional: a reward source of weight 1, named after the class

The trained sequence is what the policy sampled plus the tool turns' tokens (masked out of the loss), exactly as
for `tools`: nothing is re-tokenised from text. A method that raises or hangs (`tool_timeout_s`) becomes an
error message to the model, never a crashed run; a reset() that raises or hangs, or a get_reward() that raises, is
the episode's error (env/errors, env/timeouts; its environment scores None) where TRL's run would end. Reward
functions receive the instances as `environments=`.

Nothing here imports vLLM or DeepSpeed."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence

from .base import Generator, SamplingConfig, round_seed
from .tools import COUNTS, SegmentTurns, ToolRunner, call_within, run_tool_turns, tool_schemas

# methods of an environment that are not tools: TRL's contract
NOT_TOOLS = ("reset", "get_reward")
ENVIRONMENT_COLUMN = "environment"
EMPTY_PROMPT = [{"role": "user", "content": ""}]


def tool_methods(instance) -> List[Callable]:
    """An environment's tools: its public methods (functions of its class, bound to the instance), by name."""
    return [
        getattr(instance, name)
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if name not in NOT_TOOLS and not name.startswith("_")
    ]


def _label(name: Optional[str]) -> str:
    return "environment_factory" if name is None else f"environment_factory[{name!r}]"


class Environments:
    """The environments of a run: one probe instance of each (its `reset` and tools checked before any compute; it
    seeds the pool), the tools each shows the model, and the reward sources of those that own a reward."""

    def __init__(
        self, factory: Any, standalone_tools: Sequence[Callable], timeout_s: float, reset_timeout_s: float = 300.0
    ):
        self.multi = isinstance(factory, dict)
        factories = dict(factory) if self.multi else {None: factory}
        if not factories:
            raise ValueError(
                "environment_factory is an empty dict: map at least one name to a factory, or pass one "
                "factory (a class or a function returning an environment)."
            )
        for name, make in factories.items():
            if self.multi and not isinstance(name, str):
                raise TypeError(
                    f"environment_factory's keys name environments (the dataset's '{ENVIRONMENT_COLUMN}' "
                    f"column picks one): got {name!r}; use strings."
                )
            if not callable(make):
                raise TypeError(
                    f"{_label(name)} = {make!r} is not callable: pass a class or a function that returns "
                    "an environment instance."
                )
        self.factories = factories
        self.standalone = list(standalone_tools or [])
        self.timeout_s = timeout_s
        if not (isinstance(reset_timeout_s, (int, float)) and reset_timeout_s > 0):
            raise ValueError(
                f"environment_reset_timeout_s={reset_timeout_s!r}: an environment's reset() needs a positive number "
                "of seconds."
            )
        self.reset_timeout_s = reset_timeout_s
        # id(instance) -> how its latest reset() failed ("raised", "timeout"): its episode runs from the row's prompt,
        # scores None from its environment and counts in env/errors or env/timeouts; the run goes on
        self.failed: Dict[int, str] = {}
        self.warned = False
        self.pool: Dict[Optional[str], list] = {}
        self.tools: Dict[Optional[str], List[Callable]] = {}  # each environment's own tools (probe's bound methods)
        self.schemas: Dict[Optional[str], List[dict]] = {}  # what the model is shown: standalone tools + its own
        for name, make in factories.items():
            instance = make()
            if not callable(getattr(instance, "reset", None)):
                raise ValueError(
                    f"{_label(name)} made a {type(instance).__name__} without a callable `reset`: each "
                    "environment must define reset(self, **row), called before every rollout (return a "
                    "string to append it to the prompt's last message, or None)."
                )
            methods = tool_methods(instance)
            try:
                self.schemas[name] = tool_schemas(self.standalone + methods)
            except ValueError as exc:
                raise ValueError(f"{_label(name)} ({type(instance).__name__}): {exc}") from None
            self.tools[name] = methods
            self.pool[name] = [instance]
        self.reward_sources = self._reward_sources()
        self.last: List[Any] = []  # the instances of the latest rollout, in row order (TRL's trainer.environments)

    # ------------------------------------------------------------------------------------------------ set-up
    def _reward_sources(self) -> List[Callable]:
        """One reward source per environment class that defines get_reward (two names of one class: one source):
        it scores the rollouts of that class, and abstains (None) on the others."""
        sources, seen = [], set()
        for pool in self.pool.values():
            cls = type(pool[0])
            if cls in seen or not callable(getattr(pool[0], "get_reward", None)):
                continue
            seen.add(cls)
            sources.append(_environment_reward(cls, self))
        return sources

    def all_tools(self) -> List[Callable]:
        """Every tool any environment shows (TRL's trainer.tools): the standalone ones, then each environment's, each
        name once."""
        out, names = [], set()
        for fn in self.standalone + [m for methods in self.tools.values() for m in methods]:
            if fn.__name__ not in names:
                names.add(fn.__name__)
                out.append(fn)
        return out

    def all_schemas(self) -> List[dict]:
        """The schemas of all_tools(): what the longest prompt could list (for the prompt-length checks)."""
        return tool_schemas(self.all_tools())

    def check_rows(self, names: Sequence[Any], field: str = "train_dataset") -> None:
        """Every row names a known environment (dict factories): one error naming the first unknown one."""
        if not self.multi:
            return
        unknown = sorted({repr(n) for n in names if n not in self.factories})
        if unknown:
            raise ValueError(
                f"{field} has rows with environment={unknown[0]}, which is not among the environments "
                f"passed to environment_factory. Expected one of: {list(self.factories)}. Fix the "
                f"'{ENVIRONMENT_COLUMN}' column or add that environment to the dict."
            )

    def check_dataset(self, prompts, names_too: bool = False) -> None:
        """A dict factory needs the dataset's environment column (checked at construction) naming known environments
        (checked when training starts, as TRL does; a streamed dataset's rows are checked as they come)."""
        if not self.multi:
            return
        if ENVIRONMENT_COLUMN not in prompts.columns:
            raise ValueError(
                f"A dict environment_factory routes each example by its '{ENVIRONMENT_COLUMN}' column, "
                f"which {prompts.field} lacks (columns: {['prompt'] + list(prompts.columns)}). Add it "
                "(and keep remove_unused_columns=False), or pass a single environment factory."
            )
        if names_too and not prompts.streaming:
            self.check_rows(prompts.dataset[ENVIRONMENT_COLUMN], prompts.field)

    # ------------------------------------------------------------------------------------------------ a round
    def take(self, names: Sequence[Optional[str]]) -> List[Any]:
        """One instance per rollout, each used once in this round; the pool grows when a round needs more."""
        handed: Dict[Optional[str], int] = {}
        out = []
        for name in names:
            pool, k = self.pool[name], handed.get(name, 0)
            if k == len(pool):
                pool.append(self.factories[name]())
            handed[name] = k + 1
            out.append(pool[k])
        return out

    def reset(self, instance, row: dict) -> Optional[str]:
        """`instance.reset(**row)`'s observation, within reset_timeout_s. One that raises or hangs does
        not end the run: the episode runs from the row's prompt (observation None) and scores None from its
        environment (`self.failed`), warned once. A hung instance leaves the pool (its thread may still hold it)."""
        value, kind, _ = call_within(instance.reset, row, self.reset_timeout_s, f"reset-{type(instance).__name__}")
        if kind == "ok":
            self.failed.pop(id(instance), None)
            return value
        self.failed[id(instance)] = kind
        if kind == "timeout":
            for pool in self.pool.values():
                pool[:] = [other for other in pool if other is not instance]
        what = (
            f"raised {type(value).__name__}: {value}"
            if kind == "raised"
            else f"did not return within environment_reset_timeout_s={self.reset_timeout_s:g} s"
        )
        self.warn(
            f"an environment's reset() {what} (its episode runs from the row's prompt and scores None from "
            f"{type(instance).__name__}; counted in env/{'errors' if kind == 'raised' else 'timeouts'})"
        )
        return None

    def warn(self, what: str) -> None:
        """Say the first failure of the run (the metrics count the rest)."""
        if not self.warned:
            self.warned = True
            print(f"dsgrpo: warning: {what}", flush=True)

    def runner(self, name: Optional[str], instance) -> ToolRunner:
        return ToolRunner(self.standalone + tool_methods(instance), self.timeout_s, schemas=self.schemas[name])


def _environment_reward(cls, envs: Environments) -> Callable:
    def score(instance) -> Optional[float]:
        if type(instance) is not cls or id(instance) in envs.failed:
            return None  # another class's rollout, or one whose reset() failed
        try:
            return float(instance.get_reward())
        except Exception as exc:  # noqa: BLE001 - an environment's failure ends its episode, not the run
            envs.warn(f"{cls.__name__}.get_reward() raised {type(exc).__name__}: {exc} (the rollout scores None)")
            return None

    def reward(environments=None, **kwargs):
        if environments is None:
            raise ValueError(f"the {cls.__name__} reward scores environments: call it with environments=[...].")
        return [score(e) for e in environments]

    reward.__name__ = cls.__name__
    return reward


def _with_observation(prompt: Any, observation: Any) -> list:
    """The prompt's messages with reset()'s string appended to the last message (a new list: the row is untouched)."""
    if not isinstance(prompt, list):
        raise ValueError(
            "environment_factory needs conversational prompts (lists of messages): the chat template "
            "is what shows the model its tools. Give train_dataset a 'prompt' column of message lists."
        )
    if observation is None:
        return list(prompt)
    if not isinstance(observation, str):
        raise TypeError(
            f"an environment's reset() returned a {type(observation).__name__}: return a string (appended "
            "to the prompt's last message) or None."
        )
    last = prompt[-1]
    return list(prompt[:-1]) + [{**last, "content": (last.get("content") or "") + observation}]


class EnvironmentSampler:
    """Completions acted out in environments: reset each rollout's instance with its row, render its prompt with its
    environment's tools, then tool turns against that instance (rollout/tools.py)."""

    uses_tools = True

    def __init__(
        self,
        generator: Generator,
        sampling: SamplingConfig,
        tokenizer,
        environments: Environments,
        max_iterations: Optional[int],
        call_format=None,
        lockstep=None,
    ):
        self.generator, self.sampling, self.tokenizer = generator, sampling, tokenizer
        self.environments, self.max_iterations, self.call_format = environments, max_iterations, call_format
        self.lockstep = lockstep  # tools.run_tool_turns: the ranks of a tensor-parallel engine continue together

    def sample(self, prompts, indices, counts, seeds):
        envs = self.environments
        rows, names = episode_rows(envs, prompts, indices, counts)
        instances = envs.take(names)
        prompt_ids, runners = [], []
        for row, name, instance in zip(rows, names, instances):
            prompt_ids.append(start_episode(envs, self.tokenizer, prompts, row, name, instance))
            runners.append(envs.runner(name, instance))
        failed = [envs.failed.get(id(instance)) for instance in instances]  # read now: a later reset may clear it
        # each rollout has a prompt of its own (reset may differ per instance): one sample per prompt, seeded from
        # its group's seed and its place in the group (round 0 of round_seed; tool turns use rounds 1, 2, ...)
        row_seeds = None if seeds is None else [round_seed(s, 0, k) for s, n in zip(seeds, counts) for k in range(n)]
        rollout, _ = run_tool_turns(
            self.generator,
            self.tokenizer,
            prompt_ids,
            [1] * len(prompt_ids),
            self.sampling,
            row_seeds,
            runners,
            self.max_iterations,
            chat_template_kwargs=template_kwargs(prompts),
            call_format=self.call_format,
            lockstep=self.lockstep,
        )
        for counts, kind in zip(rollout.tool_counts, failed):
            if kind is not None:  # an episode whose reset() failed: env/errors or env/timeouts
                counts[COUNTS.index("errors" if kind == "raised" else "timeouts")] += 1
        rollout.columns = {"environments": instances}
        envs.last = instances
        return rollout

    def turns(self, prompts) -> "EnvironmentTurns":
        return EnvironmentTurns(prompts, self.tokenizer, self.call_format, self.max_iterations, self.environments)


class EnvironmentTurns(SegmentTurns):
    """Episodes in environments for partial rollouts: an episode gets an instance of its own for as long as it is in
    flight (it may continue over several rounds, so the round-by-round pool cannot lend it), reset with its row."""

    stateful = True

    def __init__(self, prompts, tokenizer, call_format, max_iterations, environments: Environments):
        super().__init__(prompts, tokenizer, call_format, max_iterations, chat_template_kwargs=template_kwargs(prompts))
        self.environments = environments

    def open(self, index, instance=None):
        envs = self.environments
        (row,), (name,) = episode_rows(envs, self.prompts, [index], [1])
        if instance is None:
            instance = envs.factories[name]()
        return (
            start_episode(envs, self.tokenizer, self.prompts, row, name, instance),
            envs.runner(name, instance),
            instance,
        )

    def start_failure(self, instance) -> Optional[str]:
        return self.environments.failed.get(id(instance))

    def handed(self, instances):
        self.environments.last = instances


def template_kwargs(prompts) -> dict:
    """The chat template's arguments, but the tools: each environment lists its own."""
    return {k: v for k, v in prompts.chat_template_kwargs.items() if k != "tools"}


def episode_rows(envs: Environments, prompts, indices, counts):
    """One row (prompt and columns) per completion of dataset rows `indices`, and the environment each names."""
    row_prompts, columns = prompts.rows_for(indices, counts)
    rows = [{"prompt": p, **{c: v[k] for c, v in columns.items()}} for k, p in enumerate(row_prompts)]
    names = [row.get(ENVIRONMENT_COLUMN) if envs.multi else None for row in rows]
    envs.check_rows(names, prompts.field)
    return rows, names


def start_episode(envs: Environments, tokenizer, prompts, row: dict, name, instance) -> List[int]:
    """Reset `instance` with its row and return the episode's prompt ids: the row's messages (reset's string
    appended) rendered with its environment's tools."""
    # the `environment` column routes the row; it is not the environment's business (TRL's contract)
    observation = envs.reset(instance, {k: v for k, v in row.items() if not (envs.multi and k == ENVIRONMENT_COLUMN)})
    messages = _with_observation(row["prompt"], observation)
    text = tokenizer.apply_chat_template(
        messages, tools=envs.schemas[name], tokenize=False, add_generation_prompt=True, **template_kwargs(prompts)
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def check_data_source(train_dataset: Any, environment_factory: Any, args) -> None:
    """Where the prompts come from: a train_dataset, or (one environment, max_steps set) the environment itself,
    whose reset() returns each prompt. Refused before anything is built."""
    if train_dataset is not None:
        return
    if environment_factory is None:
        raise ValueError(
            "`train_dataset` is required unless an `environment_factory` is provided: pass a "
            "datasets.Dataset with a 'prompt' column."
        )
    if isinstance(environment_factory, dict):
        raise ValueError(
            "A dict environment_factory (several environments) requires a `train_dataset` with an "
            f"'{ENVIRONMENT_COLUMN}' column to route each example to its environment. Provide one, or "
            "pass a single environment factory."
        )
    if not (args.max_steps and args.max_steps > 0):
        raise ValueError(
            "Without a train_dataset the environment owns the data (its reset() returns each prompt), "
            "so nothing sets the run's length: set max_steps to a positive number of steps."
        )


def environment_prompts(dataset, rows: int):
    """The prompts of environments: the dataset's, where it has a 'prompt' column; else empty user messages that
    reset() fills (one round's worth of rows, cycled, when the environment owns the data: no dataset at all)."""
    if dataset is None:
        from datasets import Dataset

        return Dataset.from_dict({"prompt": [EMPTY_PROMPT] * max(rows, 1)})
    names = getattr(dataset, "column_names", None)
    if names is not None and "prompt" not in names and hasattr(dataset, "add_column"):
        return dataset.add_column("prompt", [EMPTY_PROMPT] * len(dataset))
    return dataset
