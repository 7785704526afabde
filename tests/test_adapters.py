"""Environments from other libraries (dsgrpo/adapters/): TextArena's games, real and offline, played by scripted
players through the adapter's tool; the 2-rank run through the trainer is tests/test_api_dist.py's `textarena`."""

import random
import re

import pytest

from dsgrpo.adapters.textarena import OFFLINE_GAMES, TextArenaGame, textarena_dataset
from dsgrpo.rollout.environments import tool_methods
from dsgrpo.tasks import TASKS


def play(game, seed, player, cls=TextArenaGame, moves=40):
    env = cls()
    said = env.reset(game=game, seed=seed, prompt="a dataset column the game does not take")
    for _ in range(moves):
        move = player(said)
        if move is None or env.done:
            break
        said = env.act(move)
    return env


def bisection():
    low, high, last = 1, 20, None

    def move(said):
        nonlocal low, high, last
        bounds = re.search(r"between (\d+) and (\d+)", said)
        if bounds:
            low, high = int(bounds.group(1)), int(bounds.group(2))
        if last is not None:
            low, high = (last + 1, high) if "higher" in said else (low, last - 1) if "lower" in said else (low, high)
        last = (low + high) // 2
        return str(last)  # without brackets: the adapter adds them, as TextArena's wrapper does

    return move


def hanoi(n, a="A", b="B", c="C"):
    return [] if n == 0 else hanoi(n - 1, a, c, b) + [f"[{a} {c}]"] + hanoi(n - 1, b, a, c)


def test_textarena_games_score_a_good_player_high_and_a_bad_one_low():
    pytest.importorskip("textarena")
    assert [m.__name__ for m in tool_methods(TextArenaGame())] == ["act"]
    assert [play("GuessTheNumber-v0", s, bisection()).get_reward() for s in range(6)] == [1.0] * 6
    same = [play("GuessTheNumber-v0", s, lambda said: "[1]") for s in range(6)]
    assert all(e.done for e in same) and max(e.get_reward() for e in same) < 1.0
    strict = type("Strict", (TextArenaGame,), {"solved_only": True})
    assert all(play("GuessTheNumber-v0", s, lambda said: "[1]", strict).get_reward() == 0.0 for s in range(1, 6))
    moves = iter(hanoi(3))
    solved = play("TowerOfHanoi-v0", 0, lambda said: next(moves, None))
    assert solved.get_reward() == 1.0 and solved.moves == 7
    assert play("TowerOfHanoi-v0", 0, lambda said: "[A C]").get_reward() == 0.0  # illegal twice: forfeit
    garbage = play("GuessTheNumber-v0", 3, lambda said: "I think it is five")
    assert garbage.done and garbage.get_reward() == 0.0 and garbage.act("[3]") == "The game is over; no more moves."
    unfinished = TextArenaGame()
    unfinished.reset(game="TowerOfHanoi-v0", seed=0)
    unfinished.act("[A C]")
    assert not unfinished.done and unfinished.get_reward() == 0.0


def test_textarena_deals_by_seed_and_leaves_the_global_random_state_alone():
    pytest.importorskip("textarena")
    random.seed(1234)
    state = random.getstate()
    first = TextArenaGame()
    first.reset(game="GuessTheNumber-v0", seed=123)
    for s in range(3):
        TextArenaGame().reset(game="Minesweeper-v0-small", seed=s)
    again = TextArenaGame()
    again.reset(game="GuessTheNumber-v0", seed=123)
    assert first._env.game_number == again._env.game_number
    assert random.getstate() == state  # textarena reseeds `random` at every reset: not the trainer's


def test_textarena_rows_and_refusals():
    rows = TASKS["textarena"]("GuessTheNumber-v0,TowerOfHanoi-v0")
    assert set(rows.column_names) == {"prompt", "game", "seed"} and len(rows) == 256
    assert set(rows["game"]) == {"GuessTheNumber-v0", "TowerOfHanoi-v0"}
    assert rows[0]["prompt"][0]["role"] == "user"
    with pytest.raises(ValueError, match="Wordle-v0.*not among the games checked to run offline"):
        textarena_dataset("Wordle-v0")
    with pytest.raises(ValueError, match="nltk word lists.*cannot run offline"):
        TextArenaGame().reset(game="Wordle-v0", seed=0)
    assert len(OFFLINE_GAMES) >= 20


def test_an_openenv_environment_plays_in_process_through_the_adapter():
    """openenv-core's own Environment/Action/Observation classes, no server: bisection finds the number (reward
    1), a fixed guess runs out of tries (0), a guess pydantic rejects is answered with why and does not step."""
    pytest.importorskip("openenv")
    from dsgrpo.adapters.openenv import OpenEnvAdapter, named_arguments
    from dsgrpo.adapters.openenv_example import GuessNumber, GuessNumberEnvironment

    assert [m.__name__ for m in tool_methods(GuessNumber())] == ["act"]

    def bisect(env):
        low, high = 1, 100
        while not env.done:
            guess = (low + high) // 2
            said = env.act(str(guess))
            low, high = (guess + 1, high) if "higher" in said else (low, guess - 1) if "lower" in said else (low, high)
        return env

    for seed in range(5):
        env = GuessNumber()
        assert "between 1 and 100" in env.reset(seed=seed, prompt="not the environment's", game="x")
        assert bisect(env).get_reward() == 1.0 and env.steps <= 7
    stubborn = GuessNumber()
    stubborn.reset(seed=0)
    while not stubborn.done:
        stubborn.act("101" if stubborn.env.target != 101 else "1")
    assert stubborn.steps == 8 and stubborn.get_reward() == 0.0 and stubborn.act("5") == "The episode is over."
    picky = GuessNumber()
    picky.reset(seed=1)
    assert picky.act("fifty").startswith("Invalid action:") and picky.steps == 0 and not picky.done
    same = [GuessNumber(), GuessNumber()]
    for env in same:
        env.reset(seed=42)
    assert same[0].env.target == same[1].env.target
    assert named_arguments(GuessNumberEnvironment().reset, {"seed": 3, "prompt": "x", "episode_id": None}) == {
        "seed": 3
    }
    with pytest.raises(TypeError, match="set env_class and action_class"):
        OpenEnvAdapter()
