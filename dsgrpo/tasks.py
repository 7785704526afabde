"""Built-in tasks for the CPU demo, tests and benchmarks.

`copy_digits`: the prompt shows a number ("Repeat this number: 384"); the reward is the fraction of digit
positions the answer gets right (1.0 for "384", 0.33 for "394", 0 for no number).

The demo's warm-up (`copy_warmup`, seconds) is supervised and leaves the tiny local model where GRPO is used in
practice: it can do the task, but seldom does. Its targets are the copy one time in five and otherwise the number
with every digit one higher ("384" -> "495"): the model learns to read the prompt and the answer format, answers
each digit right about one time in five when it samples (mean reward ≈ 0.2) and never greedily (its most likely
answer is the off-by-one). GRPO's job is then the one it has on an instruct model at pass@1 0.2-0.5: sharpen what
already succeeds sometimes. Supervised learning converges to the mixture it is shown whatever the seed or the
kernels' float order, so the start, and the curve, do not depend on either (docs/demo.md). An earlier demo warmed up
the format only and asked RL to discover copying: a chaotic search whose outcome the instruction set decided.

`copy_digits_heldout`: numbers the training set never shows, for the before/after evaluation (`evaluate_copy`)."""

from __future__ import annotations

import random
import re
from typing import List, Optional

from .rewards.builtins import completion_text

PROMPT = "Repeat this number: {number}"


def _numbers(n: int, digits: int, seed: int) -> List[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("0123456789") for _ in range(digits)) for _ in range(int(n))]


def _rows(numbers):
    from datasets import Dataset

    return Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": PROMPT.format(number=number)}], "answer": number}
            for number in numbers
        ]
    )


def copy_digits_dataset(n: int = 512, digits: int = 3, seed: int = 0):
    """A datasets.Dataset of conversational prompts with an `answer` column (`task:copy_digits:N`: N prompts)."""
    return _rows(_numbers(n, digits, seed))


def copy_digits_heldout(n: int = 200, digits: int = 3, seed: int = 1):
    """`n` distinct numbers that `copy_digits_dataset()` (the demo's training set) never shows, same format."""
    seen = set(_numbers(512, digits, 0))
    rng = random.Random(seed)
    unseen = sorted(set(f"{i:0{digits}d}" for i in range(10**digits)) - seen)
    if n > len(unseen):
        raise ValueError(
            f"copy_digits_heldout: n={n}, but only {len(unseen)} {digits}-digit numbers are not in "
            "the training set; ask for fewer."
        )
    return _rows(rng.sample(unseen, int(n)))


def copy_digits_reward(completions, answer, **kwargs) -> List[Optional[float]]:
    """Fraction of the answer's digit positions matched by the first number in the completion; a number of
    the wrong length is scored against the longer of the two, so padding with digits never pays."""
    out = []
    for completion, target in zip(completions, answer):
        found = re.search(r"\d+", completion_text(completion))
        out.append(digit_score(found.group(0), target) if found else 0.0)
    return out


def digit_score(guess: str, target: str) -> float:
    """The fraction of `target`'s digit positions `guess` matches, over the longer of the two."""
    return sum(a == b for a, b in zip(guess, target)) / max(len(guess), len(target), 1)


def off_by_one(number: str) -> str:
    """The warm-up's wrong answer: every digit one higher ("384" -> "495", "9" -> "0"); scores 0."""
    return "".join(str((int(c) + 1) % 10) for c in number)


# what `python -m dsgrpo.tasks warmup` builds; an init_model written with another recipe is rebuilt, not reused
WARMUP_RECIPE = {
    "task": "copy_digits",
    "kind": "copy_or_off_by_one",
    "copy_fraction": 0.2,
    "steps": 150,
    "batch_size": 32,
    "lr": 3e-3,
    "digits": 3,
    "seed": 0,
}


def copy_warmup(
    model_path: str,
    out_dir: str,
    steps: int = 150,
    copy_fraction: float = 0.2,
    batch_size: int = 32,
    lr: float = 3e-3,
    digits: int = 3,
    seed: int = 0,
) -> str:
    """Supervised warm-up of the demo (plain torch, one process, seconds on a CPU): each target is the copy with
    probability `copy_fraction`, else `off_by_one` of the shown number. Saves model, tokenizer and the recipe
    (warmup.json) to out_dir and returns it."""

    def example(tok, rng):
        shown = "".join(rng.choice("0123456789") for _ in range(digits))
        reply = shown if rng.random() < copy_fraction else off_by_one(shown)
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": PROMPT.format(number=shown)}], tokenize=False, add_generation_prompt=True
        )
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        a = tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return p + a, [-100] * len(p) + a

    recipe = dict(
        WARMUP_RECIPE, steps=steps, copy_fraction=copy_fraction, batch_size=batch_size, lr=lr, digits=digits, seed=seed
    )
    return supervised_warmup(model_path, out_dir, example, recipe)


def supervised_warmup(model_path: str, out_dir: str, example, recipe: dict) -> str:
    """Fine-tune `model_path` on `recipe["steps"]` batches of `example(tokenizer, rng) -> (ids, labels)` (labels
    -100 where no loss is taken) with AdamW at `recipe["lr"]` (gradients clipped to `recipe["max_grad_norm"]` when
    the recipe has one), seeded by `recipe["seed"]`; saves model, tokenizer and the recipe (warmup.json) to out_dir
    and returns it."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(recipe["seed"])
    rng = random.Random(recipe["seed"] + 1)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe["lr"])
    model.train()
    for _ in range(recipe["steps"]):
        ids, labels = zip(*(example(tok, rng) for _ in range(recipe["batch_size"])))
        loss = _causal_lm_loss(model, tok.pad_token_id, ids, labels)
        loss.backward()
        if recipe.get("max_grad_norm"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe["max_grad_norm"])
        opt.step()
        opt.zero_grad()
    model.eval()
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    with open(f"{out_dir}/warmup.json", "w") as fh:
        json.dump(recipe, fh, indent=1)
    return out_dir


SHARED_PREFIX_MIN = 64  # a batch sharing a prompt this long (a system prompt listing tools) runs it once


def _causal_lm_loss(model, pad_id: int, ids, labels):
    """Mean next-token loss of right-padded sequences. When every sequence opens with the same unlabelled prefix of
    SHARED_PREFIX_MIN tokens or more, the prefix runs once and its keys and values serve the whole batch: the same
    loss and gradients (the prefix's gradient is the batch's sum either way) at a fraction of the compute."""
    import torch

    shared = 0
    while all(len(x) > shared + 1 and x[shared] == ids[0][shared] and y[shared] == -100 for x, y in zip(ids, labels)):
        shared += 1
    shared -= 1  # the prefix's last token stays in the batch: its logits predict the first labelled token
    shared = shared if shared >= SHARED_PREFIX_MIN else 0
    cache = None
    if shared:
        cache = model(input_ids=torch.tensor([ids[0][:shared]]), use_cache=True).past_key_values
        for layer in cache.layers:  # one sequence's keys and values, seen by every row
            layer.keys = layer.keys.expand(len(ids), -1, -1, -1)
            layer.values = layer.values.expand(len(ids), -1, -1, -1)
    rest = [x[shared:] for x in ids]
    width = max(len(x) for x in rest)
    input_ids = torch.tensor([x + [pad_id] * (width - len(x)) for x in rest])
    label_t = torch.tensor([y[shared:] + [-100] * (width - len(x)) for x, y in zip(rest, labels)])
    attention = (torch.arange(width)[None, :] < torch.tensor([len(x) for x in rest])[:, None]).long()
    if shared:
        attention = torch.cat([torch.ones(len(ids), shared, dtype=torch.long), attention], dim=1)
    return model(input_ids=input_ids, attention_mask=attention, past_key_values=cache, labels=label_t).loss


def evaluate_copy(model_dir: str, n: int = 200, samples: int = 4, seed: int = 0) -> dict:
    """A model on `copy_digits_heldout(n)` with transformers' generate (one process): greedy pass@1 (the exact
    number), greedy mean reward, and the mean reward of `samples` answers a prompt at temperature 1 (what GRPO
    trains on)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rows = copy_digits_heldout(n)
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    answers = list(rows["answer"])
    out = {}
    with torch.no_grad():
        for name, kwargs, k in (
            ("greedy", dict(do_sample=False), 1),
            ("sampled", dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0), samples),
        ):
            made = model.generate(
                **batch, max_new_tokens=8, pad_token_id=tok.pad_token_id, num_return_sequences=k, **kwargs
            )
            replies = tok.batch_decode(made[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
            scores = copy_digits_reward(replies, [a for a in answers for _ in range(k)])
            out[f"{name}_reward"] = sum(scores) / len(scores)
            out[f"{name}_pass@1"] = sum(s == 1.0 for s in scores) / len(scores)
    return out


# ------------------------------------------------------------------------------ door: an environment to act in
DOOR_PROMPT = "Get through the door."


class Door:
    """The CPU environment example's world (`environment_factory=Door`): a door, locked or not (the dataset's
    `locked` column, given to `reset`, which tells the model in one sentence). Tools: `unlock()` and
    `walk_through()`; walking through a locked door fails and says so, and the episode goes on. Reward
    (`get_reward`): 1 for getting through with no wasted call, else 0 (a partial credit for getting through after a
    wasted call kept one seed of three on "always walk through", which half the doors reward). State crosses turns:
    an unlocked door stays unlocked."""

    def reset(self, locked: bool, **row) -> str:
        self.locked = self.was_locked = bool(locked)
        self.through, self.calls = False, 0
        return " The door is locked." if self.locked else " The door is open."

    def unlock(self) -> str:
        """Unlock the door."""
        self.calls += 1
        self.locked = False
        return "unlocked"

    def walk_through(self) -> str:
        """Walk through the door."""
        self.calls += 1
        if self.locked:
            return "the door is locked"
        self.through = True
        return "you are through"

    def get_reward(self) -> float:
        return float(self.through and self.calls == 1 + self.was_locked)


def door_dataset(n: int = 512, seed: int = 0):
    """`task:door`: conversational prompts with the door's `locked` column, locked half the time."""
    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": DOOR_PROMPT}], "locked": rng.random() < 0.5} for _ in range(int(n))]
    )


def door_transcript(locked: bool, right: bool) -> List[dict]:
    """An episode as chat messages, the env answering each call: the right way (unlock only a locked door, then
    walk through), or the warm-up's usual mistake (walk into a locked door; unlock an open one first)."""
    env = Door()
    observation = env.reset(locked)
    calls = (
        (["unlock"] if locked else []) + ["walk_through"]
        if right
        else (["walk_through"] if locked else ["unlock", "walk_through"])
    )
    messages = [{"role": "user", "content": DOOR_PROMPT + observation}]
    for name in calls:
        messages += [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}],
            },
            {"role": "tool", "content": getattr(env, name)()},
        ]
    return messages + [{"role": "assistant", "content": "Done."}]


def assistant_only(tok, messages: List[dict], tools) -> tuple:
    """(ids, labels) of a conversation, the loss on the assistant's turns only: the chat template's text cut where
    each message starts, each piece tokenised alone (as the rollout joins sampled ids and tool turns' ids)."""
    ids, labels = [], []
    done = ""
    for k in range(1, len(messages) + 1):
        upto = tok.apply_chat_template(
            messages[:k],
            tools=tools,
            tokenize=False,
            add_generation_prompt=k < len(messages) and messages[k]["role"] == "assistant",
        )
        if not upto.startswith(done):
            raise ValueError("the chat template rewrites earlier turns; assistant_only cannot cut it into pieces")
        piece = tok(upto[len(done) :], add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if messages[k - 1]["role"] == "assistant" else [-100] * len(piece)
        done = upto
    return ids, labels


DOOR_WARMUP = {
    "task": "door",
    "kind": "right_or_usual_mistake",
    "copy_fraction": 0.15,
    "steps": 200,
    "batch_size": 16,
    "lr": 3e-3,
    "max_grad_norm": 1.0,
    "seed": 0,
}


def door_warmup(model_path: str, out_dir: str, **changes) -> str:
    """The environment example's warm-up: episodes played the right way a `copy_fraction` of the time (the demo's
    name for how often the warm-up is right), else with the usual mistake, as copy_warmup does for copy_digits."""
    from .rollout.environments import tool_methods
    from .rollout.tools import tool_schemas

    recipe = dict(DOOR_WARMUP, **changes)
    schemas = tool_schemas(tool_methods(Door()))  # the tools the trainer lists for a Door, in its order

    def example(tok, rng):
        locked = rng.random() < 0.5
        return assistant_only(tok, door_transcript(locked, rng.random() < recipe["copy_fraction"]), schemas)

    return supervised_warmup(model_path, out_dir, example, recipe)


GSM8K_SYSTEM = (
    "Solve the math problem step by step. End your answer with a line '#### <number>' holding only the final number."
)


def gsm8k_dataset(source: str = "openai/gsm8k", split: str = "train"):
    """GSM8K as conversational prompts with a `solution` column for `accuracy_reward`. `source` is a local
    .jsonl with question/answer rows (e.g. shared/data/gsm8k/train.jsonl) or a cached hub id."""
    import datasets

    if source.endswith(".jsonl"):
        raw = datasets.load_dataset("json", data_files=source, split="train")
    else:
        raw = datasets.load_dataset(source, "main", split=split)
    return raw.map(
        lambda row: {
            "prompt": [{"role": "system", "content": GSM8K_SYSTEM}, {"role": "user", "content": row["question"]}],
            "solution": row["answer"],
        },
        remove_columns=raw.column_names,
    )


def textarena_dataset(games: str = "GuessTheNumber-v0"):
    """`task:textarena[:GAME,GAME]`: rows for dsgrpo.adapters.textarena.TextArenaGame (its `game` and `seed`)."""
    from .adapters.textarena import textarena_dataset as rows

    return rows(games)


def _top_level(text: str, where: str) -> List[str]:
    """`text` split at the commas outside any bracket ((), [], {}), pieces stripped, empty ones dropped."""
    pieces, depth, piece = [], 0, ""
    for ch in text + ",":
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth < 0:
                raise ValueError(f"task:reasoning_gym: {where!r} closes a {ch!r} it never opened")
        if ch == "," and depth == 0:
            pieces.append(piece.strip())
            piece = ""
        else:
            piece += ch
    if depth:
        raise ValueError(f"task:reasoning_gym: {where!r} opens a bracket and does not close it")
    return [p for p in pieces if p]


REASONING_GYM_OPTIONS = ("system_prompt",)  # the dataset's own options, beside the tasks: `system_prompt=direct`


def reasoning_gym_options(names: str) -> tuple:
    """(the tasks' part of `names`, {option: value}) for the dataset's own options written among the tasks as
    `key=value` (no brackets): `system_prompt=NAME` picks reasoning-gym's system prompt (SYSTEM_PROMPTS: default,
    direct, simple, ...) or `none` (the question alone: what a small model learns from in minutes)."""
    tasks, options = [], {}
    for piece in _top_level(str(names), str(names)):
        key, eq, value = piece.partition("=")
        if not eq or "(" in key:
            tasks.append(piece)
            continue
        if key.strip() not in REASONING_GYM_OPTIONS:
            raise ValueError(
                f"task:reasoning_gym: {piece!r} is not a task nor an option of the dataset "
                f"({', '.join(REASONING_GYM_OPTIONS)}); a task's own keys go in its brackets: chain_sum(min_terms=2)"
            )
        options[key.strip()] = value.strip()
    return ",".join(tasks), options


def reasoning_gym_specs(names: str) -> List[tuple]:
    """`NAME[(key=value, ...)][,NAME...]` as [(name, {key: value})]: each task's own configuration (its
    difficulty: `chain_sum(min_terms=2, max_terms=2)`), values read as YAML (2 -> int, true -> bool, [+, -] ->
    a list)."""
    import yaml

    specs = []
    for piece in _top_level(str(names), str(names)):
        name, _, rest = piece.partition("(")
        if rest and not rest.endswith(")"):
            raise ValueError(f"task:reasoning_gym: {piece!r} has text after its ')'")
        config = {}
        for item in _top_level(rest[:-1], piece):
            key, eq, value = item.partition("=")
            if not eq or not key.strip().isidentifier():
                raise ValueError(
                    f"task:reasoning_gym: {item!r} in {piece!r} is not key=value (e.g. chain_sum(min_terms=2, "
                    "max_terms=2))"
                )
            config[key.strip()] = yaml.safe_load(value.strip())
        specs.append((name.strip(), config))
    return specs


def reasoning_gym_sets(names: str, size: int, seed: int) -> list:
    """reasoning-gym's datasets for `NAME[(config)][,NAME...]`, each made here (nothing downloaded)."""
    import reasoning_gym

    chosen = reasoning_gym_specs(names)
    if not chosen:
        raise ValueError("task:reasoning_gym:NAME[,NAME] names no task; e.g. task:reasoning_gym:basic_arithmetic")
    sets = []
    for name, config in chosen:
        try:
            sets.append(reasoning_gym.create_dataset(name, size=size, seed=seed, **config))
        except Exception as exc:  # its registry's or config's own error: name the task and the fix
            raise ValueError(
                f"task:reasoning_gym: {name!r} with {config or 'its defaults'} cannot be made ({type(exc).__name__}: "
                f"{exc}); see reasoning_gym's registered datasets (reasoning_gym.factory.DATASETS) and the task's "
                "config class for its keys"
            ) from None
    return sets


def reasoning_gym_prompt(entry: dict, system_prompt: str = "default") -> list:
    """A reasoning-gym entry as the policy is asked it: reasoning-gym's own system prompt (the answer in <answer>
    tags; `system_prompt` names one of its SYSTEM_PROMPTS, `none` leaves it out), then the question."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    question = [{"role": "user", "content": entry["question"]}]
    if system_prompt == "none":
        return question
    if system_prompt not in SYSTEM_PROMPTS:
        raise ValueError(
            f"task:reasoning_gym: system_prompt={system_prompt!r} is not one of reasoning-gym's "
            f"({', '.join(sorted(SYSTEM_PROMPTS))}) nor none"
        )
    return [{"role": "system", "content": SYSTEM_PROMPTS[system_prompt]}] + question


def reasoning_gym_entries(names: str, size: int, seed: int) -> tuple:
    """(`size` reasoning-gym entries drawn from the named tasks in turn, the dataset's options)."""
    tasks, options = reasoning_gym_options(names)
    sets = reasoning_gym_sets(tasks, size, seed)
    entries = [sets[i % len(sets)][i // len(sets) if len(sets) > 1 else i] for i in range(size)]
    return entries, options


def reasoning_gym_dataset(names: str = "basic_arithmetic", size: int = 512, seed: int = 0):
    """`task:reasoning_gym:NAME[(key=value,...)][,NAME...][,system_prompt=NAME]`: reasoning-gym's procedurally
    generated tasks (made here, nothing downloaded), each with its own configuration when given
    (`chain_sum(min_terms=2, max_terms=2)`), as conversational prompts under reasoning-gym's own system prompt (or
    the one named, or none), with a `reasoning_gym_entry` column (the entry as JSON) that `reasoning_gym_reward`
    scores with the task's own scorer. Several names draw `size` rows from them in turn."""
    import json

    from datasets import Dataset

    entries, options = reasoning_gym_entries(names, size, seed)
    system_prompt = options.get("system_prompt", "default")
    rows = [
        {
            "prompt": reasoning_gym_prompt(entry, system_prompt),
            "answer": str(entry["answer"]),
            "reasoning_gym_entry": json.dumps(entry, default=str),
        }
        for entry in entries
    ]
    return Dataset.from_list(rows)


# the reasoning-gym example's warm-up (examples/cpu_reasoning_gym.yaml): one-digit sums and differences, asked
# without a system prompt (the tiny model learns them in minutes from the question alone; under reasoning-gym's
# 30-token `direct` prompt it did not within 2,000 steps at lr 3e-3; not tried at 1e-3), right 1 time in 5, else one
# more than the answer. At lr 3e-3 the model learnt the sums for one order of the rows and never for another; at
# 1e-3 it learns them whole (answered right only: greedy 100/100 after 1,500 steps)
REASONING_GYM_TASK = "chain_sum(min_terms=2, max_terms=2, min_digits=1, max_digits=1), system_prompt=none"
REASONING_GYM_WARMUP = {
    "task": "reasoning_gym",
    "kind": "right_or_one_more",
    "spec": REASONING_GYM_TASK,
    "copy_fraction": 0.2,
    "steps": 1500,
    "batch_size": 32,
    "lr": 1e-3,
    "seed": 0,
}


def one_more(answer: str, other: str) -> str:
    """The warm-up's wrong answer: an integer answer plus one, else another row's (different) answer."""
    try:
        return str(int(answer) + 1)
    except ValueError:
        return other if other != answer else answer + "0"


def reasoning_gym_warmup(model_path: str, out_dir: str, **changes) -> str:
    """The reasoning-gym example's warm-up: the task's own rows (seed 10**6, apart from the run's) answered in
    <answer> tags, right a `copy_fraction` of the time, else `one_more`, as copy_warmup does for copy_digits."""
    recipe = dict(REASONING_GYM_WARMUP, **changes)
    entries, options = reasoning_gym_entries(recipe["spec"], 4096, 10**6)
    system_prompt = options.get("system_prompt", "default")

    def example(tok, rng):
        entry = entries[rng.randrange(len(entries))]
        answer = str(entry["answer"])
        if rng.random() >= recipe["copy_fraction"]:
            answer = one_more(answer, str(entries[rng.randrange(len(entries))]["answer"]))
        prompt = tok.apply_chat_template(
            reasoning_gym_prompt(entry, system_prompt), tokenize=False, add_generation_prompt=True
        )
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        a = tok(f"<answer>{answer}</answer>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return p + a, [-100] * len(p) + a

    return supervised_warmup(model_path, out_dir, example, recipe)


TASKS = {
    "copy_digits": copy_digits_dataset,
    "copy_digits_heldout": copy_digits_heldout,
    "gsm8k": gsm8k_dataset,
    "door": door_dataset,
    "textarena": textarena_dataset,
    "reasoning_gym": reasoning_gym_dataset,
}
# tasks whose model `python -m dsgrpo.tasks warmup --task T` builds
WARMUP_TASKS = ("copy_digits", "door", "reasoning_gym")


def _print_evaluation(before: str, after: str, n: int) -> None:
    rows = [
        ("greedy pass@1 (the exact number)", "greedy_pass@1"),
        ("greedy mean reward", "greedy_reward"),
        ("exact answers, sampled at temperature 1", "sampled_pass@1"),
        ("mean reward, sampled at temperature 1", "sampled_reward"),
    ]
    results = [evaluate_copy(path, n) for path in (before, after)]
    print(f"\nheld-out copy_digits ({n} numbers the run never trained on)   before   after")
    for label, key in rows:
        print(f"  {label:58s} {results[0][key]:6.2f}  {results[1][key]:6.2f}")


def main(argv=None) -> int:
    """`python -m dsgrpo.tasks warmup --out DIR`: the demo's warm-up of the tiny local model.
    `python -m dsgrpo.tasks evaluate --before DIR --after DIR`: both on the held-out set, side by side."""
    import argparse
    import json
    import os

    from .testing import tiny_model

    parser = argparse.ArgumentParser(prog="python -m dsgrpo.tasks")
    parser.add_argument("command", choices=["warmup", "evaluate"])
    parser.add_argument("--out", help="warmup: where the warm-up model goes")
    parser.add_argument(
        "--task",
        choices=WARMUP_TASKS,
        default="copy_digits",
        help="warmup: copy_digits (the demo's), door (the environment example's) or reasoning_gym (its example's)",
    )
    parser.add_argument("--base", default="qwen2", help="tiny model to start from (dsgrpo.testing.TINY_SPECS)")
    parser.add_argument("--steps", type=int, default=None, help="warmup: supervised steps (the task's recipe)")
    parser.add_argument(
        "--copy-fraction",
        type=float,
        default=None,
        help="warmup: how often the warm-up's answer is right (the task's recipe: 0.2)",
    )
    parser.add_argument("--seed", type=int, default=None, help="warmup: its seed (the task's recipe: 0)")
    parser.add_argument("--before", help="evaluate: the model before training (the warm-up)")
    parser.add_argument("--after", help="evaluate: the trained model (a run's output_dir)")
    parser.add_argument("-n", type=int, default=200, help="evaluate: held-out prompts")
    args = parser.parse_args(argv)
    if args.command == "evaluate":
        if not (args.before and args.after):
            parser.error("evaluate needs --before DIR and --after DIR")
        _print_evaluation(args.before, args.after, args.n)
        return 0
    if not args.out:
        parser.error("warmup needs --out DIR")
    base, build = {
        "copy_digits": (WARMUP_RECIPE, copy_warmup),
        "door": (DOOR_WARMUP, door_warmup),
        "reasoning_gym": (REASONING_GYM_WARMUP, reasoning_gym_warmup),
    }[args.task]
    changes = {
        k: v
        for k, v in (("steps", args.steps), ("copy_fraction", args.copy_fraction), ("seed", args.seed))
        if v is not None
    }
    wanted = dict(base, **changes)
    recipe = os.path.join(args.out, "warmup.json")
    if os.path.exists(recipe):
        with open(recipe) as fh:
            if json.load(fh) == wanted:
                print(f"{args.out} exists (same warm-up recipe); keeping it")
                return 0
    if os.path.exists(os.path.join(args.out, "config.json")):
        print(f"{args.out} was built by another warm-up recipe; rebuilding it")
    build(tiny_model(args.base), args.out, **changes)
    print(f"warm-up saved to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
