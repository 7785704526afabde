"""A user's own rollout (TRL's `GRPOTrainer(rollout_func=...)`): `rollout_func(prompts, trainer) -> dict` replaces
the trainer's generation, e.g. to drive an environment or an agent loop.

Contract (TRL's), checked by `rollout_from_func_output`:
- `prompts` is this rank's list with one entry per completion to produce: each prompt of the round repeated
  num_generations times, consecutively. Row i of every returned list answers `prompts[i]`, so a group's rows stay
  together and the trainer's group statistics apply unchanged.
- Required keys: `prompt_ids` and `completion_ids` (per row, a list of token ids) and `logprobs` (per row, the
  sampler's log-prob of each completion token, aligned token by token with `completion_ids`).
- Optional `env_mask` (TRL's name): per row, 1 for each token the model sampled and 0 for each token the
  environment inserted (tool output, observations); 0 tokens stay in the forward pass but leave the loss.
- Optional `restarts` (dsgrpo's): per row, a list of [at, prompt_ids] pairs: the completion from token `at` on was
  sampled after `prompt_ids`, not after the row's prompt and completion so far (an agent that rewrote its history,
  rollout/agents.py). The row then trains as one sequence per piece, each after its own prompt, sharing the row's
  advantage (packed steps only: token_budget unset or > 0).
- Any other key is a list with one value per row, handed to the reward functions as a column."""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Dict, Iterable, List, Optional, Tuple

from .base import Rollout

REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")
ENV_MASK_KEY = "env_mask"
RESTARTS_KEY = "restarts"
# the reward functions' own arguments (rewards/stack.py): a column of that name would shadow them
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids")
CONTRACT = (
    "rollout_func(prompts, trainer) must return a dict with 'prompt_ids', 'completion_ids' and 'logprobs': "
    "lists with one row per entry of `prompts` (one per completion; each prompt repeats num_generations "
    "times), a row of 'prompt_ids'/'completion_ids' being a list of token ids and a row of 'logprobs' a list "
    "of floats, one per completion token. Optional 'env_mask' rows (0/1 per completion token) and any other "
    "key (one value per row, passed to the reward functions as a column)."
)


def rollout_from_func_output(
    out,
    prompts_count: int,
    *,
    eos_token_id: Optional[int] = None,
    max_tokens: Optional[int] = None,
    vocab_size: Optional[int] = None,
    dataset_columns: Iterable[str] = (),
) -> Tuple[Rollout, Dict[str, list]]:
    """Check `out` (what rollout_func returned for `prompts_count` prompts) and turn it into (Rollout, extra columns).

    A row is marked truncated when it has `max_tokens` completion tokens and does not end with `eos_token_id`
    (with no eos id given: when it has max_tokens tokens). A row longer than `max_tokens`, a token id outside
    `vocab_size`, or an extra key that is also a dataset column is refused. Raises ValueError naming the key and
    row, followed by the contract."""
    if not isinstance(out, dict):
        raise ValueError(f"rollout_func returned a {type(out).__name__}, not a dict. {CONTRACT}")
    for key in REQUIRED_KEYS:
        if key not in out:
            raise ValueError(f"rollout_func's output has no {key!r} key (it has {sorted(out)}). {CONTRACT}")
    for key, value in out.items():
        _check_rows(key, value, prompts_count)

    prompt_ids = [_token_row(out, "prompt_ids", i, vocab_size) for i in range(prompts_count)]
    completion_ids = [_token_row(out, "completion_ids", i, vocab_size) for i in range(prompts_count)]
    for i, p in enumerate(prompt_ids):
        if not p:
            raise ValueError(
                f"rollout_func's 'prompt_ids'[{i}] is empty: every completion needs its prompt's token ids. {CONTRACT}"
            )
    logprobs = [_logprob_row(out, i, len(completion_ids[i])) for i in range(prompts_count)]
    tool_mask = None
    if ENV_MASK_KEY in out:
        tool_mask = [_mask_row(out, i, len(completion_ids[i])) for i in range(prompts_count)]
    restarts = None
    if RESTARTS_KEY in out:
        restarts = [_restarts_row(out, i, len(completion_ids[i]), vocab_size) for i in range(prompts_count)]
    if max_tokens is not None:
        for i, c in enumerate(completion_ids):
            if len(c) > max_tokens:
                raise ValueError(
                    f"rollout_func's 'completion_ids'[{i}] has {len(c)} tokens, more than "
                    f"max_completion_length={max_tokens}: cut completions to "
                    "trainer.args.max_completion_length in rollout_func, or raise max_completion_length."
                )
    truncated = [
        max_tokens is not None
        and len(c) >= max_tokens
        and not (eos_token_id is not None and c and c[-1] == eos_token_id)
        for c in completion_ids
    ]

    dataset_columns = set(dataset_columns)
    columns = {}
    for key, value in out.items():
        if key in REQUIRED_KEYS or key in (ENV_MASK_KEY, RESTARTS_KEY):
            continue
        if key in RESERVED_COLUMNS:
            raise ValueError(
                f"rollout_func's extra key {key!r} has the name of an argument the reward functions "
                f"already get ({', '.join(RESERVED_COLUMNS)}); rename the key."
            )
        if key in dataset_columns:
            raise ValueError(
                f"rollout_func's extra key {key!r} is also a dataset column, and a reward function can "
                "get only one of them; rename the key or the column."
            )
        columns[key] = list(value)
    rollout = Rollout(prompt_ids, completion_ids, logprobs, truncated, tool_mask=tool_mask, restarts=restarts)
    return rollout, columns


def _check_rows(key: str, value, prompts_count: int) -> None:
    if not isinstance(value, (list, tuple)):
        hint = " Convert it with .tolist()." if hasattr(value, "tolist") else ""
        raise ValueError(
            f"rollout_func's {key!r} is a {type(value).__name__}, not a list with one row per prompt.{hint} {CONTRACT}"
        )
    if len(value) != prompts_count:
        raise ValueError(
            f"rollout_func's {key!r} has {len(value)} rows but it was given {prompts_count} prompts; it "
            f"must return one row per prompt, in order. {CONTRACT}"
        )


def _sequence(out: dict, key: str, i: int) -> list:
    row = out[key][i]
    if not isinstance(row, (list, tuple)):
        hint = " Convert it with .tolist()." if hasattr(row, "tolist") else ""
        raise ValueError(f"rollout_func's {key!r}[{i}] is a {type(row).__name__}, not a list.{hint} {CONTRACT}")
    return list(row)


def _token_row(out: dict, key: str, i: int, vocab_size: Optional[int]) -> List[int]:
    row = _sequence(out, key, i)
    for t, tok in enumerate(row):
        if not isinstance(tok, Integral) or isinstance(tok, bool):
            raise ValueError(f"rollout_func's {key!r}[{i}][{t}] is {tok!r}, not a token id (int). {CONTRACT}")
        if vocab_size is not None and not 0 <= tok < vocab_size:
            raise ValueError(
                f"rollout_func's {key!r}[{i}][{t}] = {tok} is not a token id of this model (vocabulary "
                f"size {vocab_size}): tokenize with the trainer's processing_class."
            )
    return [int(tok) for tok in row]


def _logprob_row(out: dict, i: int, completion_len: int) -> List[float]:
    row = _sequence(out, "logprobs", i)
    if len(row) != completion_len:
        raise ValueError(
            f"rollout_func's 'logprobs'[{i}] has {len(row)} values but 'completion_ids'[{i}] has "
            f"{completion_len} tokens: give the sampler's log-prob of each completion token, in order. "
            f"{CONTRACT}"
        )
    for t, value in enumerate(row):
        if not isinstance(value, Real) or isinstance(value, bool) or math.isnan(value):
            raise ValueError(
                f"rollout_func's 'logprobs'[{i}][{t}] is {value!r}, not a log-probability (float). {CONTRACT}"
            )
    return [float(v) for v in row]


def _mask_row(out: dict, i: int, completion_len: int) -> List[int]:
    row = _sequence(out, ENV_MASK_KEY, i)
    rule = f"one 0 or 1 per token of 'completion_ids'[{i}] (1 = sampled by the model, 0 = inserted by the environment)"
    if len(row) != completion_len:
        raise ValueError(
            f"rollout_func's {ENV_MASK_KEY!r}[{i}] has {len(row)} values but 'completion_ids'[{i}] has "
            f"{completion_len} tokens; it must hold {rule}."
        )
    for t, value in enumerate(row):
        if value not in (0, 1):  # True/False pass as 1/0
            raise ValueError(f"rollout_func's {ENV_MASK_KEY!r}[{i}][{t}] is {value!r}; it must hold {rule}.")
    return [int(v) for v in row]


def _restarts_row(out: dict, i: int, completion_len: int, vocab_size: Optional[int]) -> List[list]:
    row = _sequence(out, RESTARTS_KEY, i)
    rule = (
        f"a list of [at, prompt_ids] pairs, `at` rising inside 'completion_ids'[{i}] (1 to {completion_len - 1}) "
        "and prompt_ids the token ids the rest was sampled after"
    )
    pairs, last = [], 0
    for k, pair in enumerate(row):
        if not (
            isinstance(pair, (list, tuple))
            and len(pair) == 2
            and isinstance(pair[0], Integral)
            and not isinstance(pair[0], bool)
            and last < pair[0] < completion_len
        ):
            raise ValueError(f"rollout_func's {RESTARTS_KEY!r}[{i}][{k}] is {pair!r}; the row must hold {rule}.")
        prompt = (
            _token_row({RESTARTS_KEY: [pair[1]]}, RESTARTS_KEY, 0, vocab_size)
            if isinstance(pair[1], (list, tuple))
            else None
        )
        if not prompt:
            raise ValueError(f"rollout_func's {RESTARTS_KEY!r}[{i}][{k}] has no prompt ids; the row must hold {rule}.")
        pairs.append([int(pair[0]), prompt])
        last = pair[0]
    return pairs
