"""OpenEnv environments (`openenv-core`), run in this process, as an `environment_factory` (issue 55, item 5).

An OpenEnv environment is a class with `reset(seed=None, episode_id=None, **kw) -> Observation` and
`step(action) -> Observation`, its Action and Observation pydantic models whose observation carries `done` and
`reward`. OpenEnv usually serves it over HTTP (Docker, a uv subprocess, a Space) to an `EnvClient`; a trainer that
acts on it from its own process needs none of that: the adapter makes the class and calls it. Name the environment
and how the model's text becomes an action:

    class GuessNumber(OpenEnvAdapter):
        env_class = GuessNumberEnvironment      # an openenv Environment subclass, or a zero-argument factory
        action_class = GuessAction
        action_field = "guess"                  # the Action field the tool's text fills (pydantic converts "7")

    GRPOTrainer(model, train_dataset=rows_with_a_seed_column, environment_factory=GuessNumber, ...)

The one tool is `act(action)`: it builds the action (a value the Action model rejects is answered with pydantic's
reason and the environment does not step), steps, and answers with the observation's own fields. `reset(**row)`
passes the environment the row's columns its `reset` names (with `**kwargs`, only `seed` and `episode_id`) and
returns the first observation. `get_reward()`: the sum of the step rewards (`reward_mode = "last"`: the last one),
clipped to `reward_clip` when set. For an action of several fields, override `act` (a typed signature and an Args:
docstring) and call `self._step(fields)`. openenv-core 0.3.0 ships the base classes and no runnable environment
(those live in OpenEnv's repository and on Spaces); `dsgrpo.adapters.openenv_example` is one written with its
classes."""

from __future__ import annotations

import inspect
from typing import Any, Dict, Optional, Tuple

NOT_OBSERVED = ("done", "reward", "metadata")  # what every Observation has; the rest is what the model reads


def observation_text(observation: Any, max_chars: int = 4000) -> str:
    """An observation's own fields as text (the value alone when it has one field)."""
    if observation is None:
        return ""
    fields = (
        {k: v for k, v in observation.model_dump().items() if k not in NOT_OBSERVED}
        if hasattr(observation, "model_dump")
        else {"observation": observation}
    )
    text = str(next(iter(fields.values()))) if len(fields) == 1 else "\n".join(f"{k}: {v}" for k, v in fields.items())
    if len(text) > max_chars:
        text = text[: max_chars // 2] + "\n[...]\n" + text[-max_chars // 2 :]
    return text


def named_arguments(fn, row: Dict[str, Any]) -> Dict[str, Any]:
    """The row's columns `fn` names as parameters; a `**kwargs` catch-all takes `seed` and `episode_id` only (the
    row holds the prompt and whatever else the dataset has)."""
    parameters = inspect.signature(fn).parameters.values()
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if any(p.kind == p.VAR_KEYWORD for p in parameters):
        names |= {"seed", "episode_id"}
    return {k: v for k, v in row.items() if k in names and v is not None}


class OpenEnvAdapter:
    """An in-process OpenEnv environment the model acts on through `act(action)`; subclass it (see the module)."""

    env_class: Any = None
    action_class: Any = None
    action_field = "message"
    reward_mode = "sum"  # or "last"
    reward_clip: Optional[Tuple[float, float]] = None
    max_chars = 4000

    def __init__(self):
        if self.env_class is None or self.action_class is None:
            raise TypeError(
                f"{type(self).__name__}: set env_class and action_class on a subclass of "
                "OpenEnvAdapter (dsgrpo.adapters.openenv's docstring shows how)."
            )
        self.env = self.env_class()  # one environment an instance, reset for each of its episodes
        self.rewards, self.done, self.steps = [], False, 0

    def reset(self, **row) -> str:
        self.rewards, self.done, self.steps = [], False, 0
        observation = self.env.reset(**named_arguments(self.env.reset, row))
        self.done = bool(getattr(observation, "done", False))
        return "\n\n" + observation_text(observation, self.max_chars)

    def act(self, action: str) -> str:
        """Send your next action to the environment.

        Args:
            action: The action, as text.
        """
        return self._step({self.action_field: action})

    def get_reward(self) -> float:
        values = [float(r) for r in self.rewards if r is not None]
        total = (values[-1] if self.reward_mode == "last" else sum(values)) if values else 0.0
        if self.reward_clip is not None:
            total = min(self.reward_clip[1], max(self.reward_clip[0], total))
        return float(total)

    def _step(self, fields: Dict[str, Any]) -> str:
        """Build the action from `fields` and step (for an `act` of one's own with several arguments)."""
        if self.done:
            return "The episode is over."
        try:
            action = self.action_class(**fields)
        except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError: the model reads why, nothing steps
            return f"Invalid action: {' '.join(str(exc).split())}"
        observation = self.env.step(action)
        self.steps += 1
        self.rewards.append(getattr(observation, "reward", None))
        self.done = bool(getattr(observation, "done", False))
        return observation_text(observation, self.max_chars) + ("\n\nThe episode is over." if self.done else "")
