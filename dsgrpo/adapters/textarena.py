"""TextArena's single-player games as an `environment_factory` (issue 55, item 5).

    GRPOTrainer(model, train_dataset=textarena_dataset(["GuessTheNumber-v0"]), environment_factory=TextArenaGame,
                args=GRPOConfig(max_tool_calling_iterations=8, ...))      # no reward_funcs: the game scores

A row names its game and the seed that deals it (`game`, `seed` columns). `reset` starts the game and returns its
rules and first board, appended to the prompt; the one tool, `act(move)`, plays a move and answers with what the
game says next (a hint, the new board, an invalid-move warning, the result); `get_reward()` is the game's score
for the player, clipped to [0, 1]: 1 solved, a fraction the game's own progress measure when it ended at its turn
limit or by forfeit (two invalid moves in a row), 0 for a game the rollout left unfinished (`partial_credit = True`
scores its progress instead). TextArena's progress credit is generous (GuessTheNumber gives about 0.5 for
guessing the same number until it ends): `solved_only = True` scores 1 for a solved game and 0 otherwise.

Offline: `textarena==0.7.4` (requirements/cpu-lock.txt) reads nothing outside its package and opens no connection
for the games in OFFLINE_GAMES (strace over reset and steps); the games in NEEDS_NETWORK download word lists or
call a hosted model and are refused at reset, naming why.

TextArena's state reseeds the process-wide `random` module at every reset and the games draw from it. Each game
here runs with textarena's modules pointed at a `random.Random` of its own (one game call at a time, process-wide),
so the trainer's global random state is never touched and a (game, seed) row deals the same game whatever ran
before it. The price: one game call runs at a time in a process, and a call that never returns (past
`tool_timeout_s`, left running in its thread) would hold every other game; TextArena's offline games answer in
milliseconds."""

from __future__ import annotations

import random
import sys
import threading
from contextlib import contextmanager
from typing import List, Sequence

OFFLINE_GAMES = (
    "GuessTheNumber-v0",
    "GuessTheNumber-v0-hardcore",
    "TowerOfHanoi-v0",
    "TowerOfHanoi-v0-medium",
    "Minesweeper-v0-small",
    "Minesweeper-v0",
    "Sudoku-v0-very-easy",
    "Sudoku-v0-easy",
    "Mastermind-v0",
    "FrozenLake-v0",
    "FrozenLake-v0-random",
    "LightsOut-v0",
    "FifteenPuzzle-v0",
    "2048-v0-super-easy",
    "PegJump-v0",
    "RushHour-v0",
    "Crosswords-v0",
    "LogicPuzzle-v0",
    "Blackjack-v0",
    "Bandit-v0",
    "Secretary-v0",
    "Set-v0",
    "Countdown-v0",
    "Cryptarithm-v0",
    "Slitherlink-v0",
    "ThreeCardMonte-v0",
)
NEEDS_NETWORK = {
    "Wordle": "downloads nltk word lists at reset",
    "Hangman": "downloads nltk word lists at reset",
    "WordLadder": "downloads nltk word lists at reset",
    "WordSearch": "downloads nltk word lists at reset",
    "TwentyQuestions": "asks a hosted model (OpenRouter)",
    "GuessWho": "asks a hosted model (OpenRouter)",
}
PROMPT = (
    "You are playing a text game. Make one move per call of the `act` tool, in the format the game asks for, "
    "and keep playing until the game says it is over."
)

_ONE_GAME_CALL = threading.Lock()  # a game call repoints module globals: one at a time in the process


class _GameRandom(random.Random):
    """A game's own RNG, standing in for the `random` module inside textarena (which also builds random.Random)."""

    Random = random.Random
    SystemRandom = random.SystemRandom


class TextArenaGame:
    """One TextArena single-player game per episode (the row's `game`, dealt by its `seed`). Tool: `act(move)`."""

    max_chars = 4000  # a longer observation keeps its head and tail
    partial_credit = False  # an unfinished game scores 0, or (True) the game's progress measure
    solved_only = False  # True: 1 for a solved game, else 0

    def __init__(self):
        self._env, self._rng, self._reward = None, _GameRandom(), None
        self.done, self.moves = False, 0

    def reset(self, game: str, seed: int = 0, **row) -> str:
        stem = str(game).split("-v")[0]
        if stem in NEEDS_NETWORK:
            raise ValueError(
                f"TextArena's {game} {NEEDS_NETWORK[stem]}: it cannot run offline. Offline games: "
                f"{', '.join(OFFLINE_GAMES)}."
            )
        try:
            import textarena as ta
            from textarena.envs.registration import ENV_REGISTRY
        except ImportError:
            raise ImportError("TextArenaGame needs the textarena package: pip install textarena==0.7.4") from None
        raw = game if game.endswith("-raw") else game + "-raw"  # the bare game: this class writes the text
        self._env = ta.make(raw if raw in ENV_REGISTRY else game)
        self._rng, self._reward = _GameRandom(int(seed)), None
        self.done, self.moves = False, 0
        with self._own_random():
            self._env.reset(num_players=1, seed=int(seed))
            _, messages = self._env.get_observation()
        return "\n\n" + self._text(messages)

    def act(self, move: str) -> str:
        """Make your next move in the game.

        Args:
            move: Your move, written in the format the game asks for, e.g. "[5]" or "[A C]".
        """
        if self._env is None:
            return "No game is running."
        if self.done:
            return "The game is over; no more moves."
        move = str(move).strip()
        if "[" not in move and "]" not in move:  # the brackets TextArena's own action wrapper adds
            move = f"[{move}]"
        with self._own_random():
            done, _ = self._env.step(move)
            _, messages = self._env.get_observation()
            rewards, info = self._env.close() if done else (None, None)
        self.moves += 1
        text = self._text(messages)
        if done:
            self.done = True
            player = (info or {}).get(0, {})
            self._reward = _score((rewards or {}).get(0))
            if self.solved_only:
                self._reward = 1.0 if self._reward >= 1.0 and not player.get("invalid_move") else 0.0
            text = (
                (text + "\n\n" if text else "")
                + f"Game over. {player.get('reason') or ''}".strip()
                + f" Score: {self._reward:.2f}"
            )
        return text or "(the game said nothing)"

    def get_reward(self) -> float:
        if self._reward is not None:
            return self._reward
        progress = getattr(self._env, "_get_percentage_completion", None)
        if self.partial_credit and not self.solved_only and callable(progress):
            with self._own_random():
                try:
                    return _score(progress())
                except Exception:  # noqa: BLE001 - a game without a progress measure for this state
                    return 0.0
        return 0.0

    @contextmanager
    def _own_random(self):
        with _ONE_GAME_CALL:
            modules = [
                m
                for name, m in list(sys.modules.items())
                if name.startswith("textarena") and getattr(m, "random", None) is random
            ]
            for m in modules:
                m.random = self._rng
            try:
                yield
            finally:
                for m in modules:
                    m.random = random

    def _text(self, messages) -> str:
        import textarena as ta

        parts = [
            str(text).strip() for _, text, kind in messages or [] if kind != ta.ObservationType.PLAYER_ACTION
        ]  # the model's own move, echoed back
        text = "\n\n".join(p for p in parts if p)
        if len(text) > self.max_chars:
            half = self.max_chars // 2
            text = text[:half] + "\n[...]\n" + text[-half:]
        return text


def _score(value) -> float:
    """The game's reward for the player as a float in [0, 1] (a forfeit's -1 and the string some 0.7.4 games leave
    through an upstream bug are 0)."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return 0.0
    return min(1.0, max(0.0, x)) if x == x else 0.0


def textarena_dataset(games: Sequence[str] | str = ("GuessTheNumber-v0",), n: int = 256, seed: int = 0):
    """`task:textarena[:GAME,GAME,...]`: conversational prompts with `game` and `seed` columns."""
    from datasets import Dataset

    if isinstance(games, str):
        games = [g for g in games.split(",") if g]
    unknown = [g for g in games if g not in OFFLINE_GAMES]
    if unknown:
        raise ValueError(f"task:textarena: {unknown} not among the games checked to run offline: {OFFLINE_GAMES}.")
    rng = random.Random(seed)
    rows: List[dict] = [
        {"prompt": [{"role": "user", "content": PROMPT}], "game": rng.choice(list(games)), "seed": rng.randrange(2**31)}
        for _ in range(int(n))
    ]
    return Dataset.from_list(rows)


__all__ = ["TextArenaGame", "textarena_dataset", "OFFLINE_GAMES", "NEEDS_NETWORK"]
