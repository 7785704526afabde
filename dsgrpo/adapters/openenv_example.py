"""An OpenEnv environment written with openenv-core's own classes (which ships none that run), and its adapter:
guess a number in [1, 100] in 8 tries, told higher or lower; reward 1 on the step that finds it.

    environment_factory: dsgrpo.adapters.openenv_example:GuessNumber     # YAML; rows need a `seed` column"""

from __future__ import annotations

import random
from typing import Optional
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from .openenv import OpenEnvAdapter


class GuessAction(Action):
    guess: int = Field(..., description="Your guess")


class GuessObservation(Observation):
    message: str = Field(default="")


class GuessNumberEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, high: int = 100, tries: int = 8):
        super().__init__()
        self.high, self.tries = high, tries
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs) -> GuessObservation:
        self.target, self.left = random.Random(seed).randint(1, self.high), self.tries
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return GuessObservation(
            message=f"Guess my number between 1 and {self.high}. You have {self.left} tries.", done=False, reward=0.0
        )

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        self.left -= 1
        if action.guess == self.target:
            return GuessObservation(message="Correct!", done=True, reward=1.0)
        over = self.left <= 0
        hint = "higher" if action.guess < self.target else "lower"
        return GuessObservation(
            message=f"{action.guess} is wrong: the number is {hint}."
            + (f" No tries left; it was {self.target}." if over else ""),
            done=over,
            reward=0.0,
        )

    @property
    def state(self) -> State:
        return self._state


class GuessNumber(OpenEnvAdapter):
    env_class = GuessNumberEnvironment
    action_class = GuessAction
    action_field = "guess"
