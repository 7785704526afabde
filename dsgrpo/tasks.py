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

    return Dataset.from_list([{"prompt": [{"role": "user", "content": PROMPT.format(number=number)}],
                               "answer": number} for number in numbers])


def copy_digits_dataset(n: int = 512, digits: int = 3, seed: int = 0):
    """A datasets.Dataset of conversational prompts with an `answer` column (`task:copy_digits:N`: N prompts)."""
    return _rows(_numbers(n, digits, seed))


def copy_digits_heldout(n: int = 200, digits: int = 3, seed: int = 1):
    """`n` distinct numbers that `copy_digits_dataset()` (the demo's training set) never shows, same format."""
    seen = set(_numbers(512, digits, 0))
    rng = random.Random(seed)
    unseen = sorted(set(f"{i:0{digits}d}" for i in range(10 ** digits)) - seen)
    if n > len(unseen):
        raise ValueError(f"copy_digits_heldout: n={n}, but only {len(unseen)} {digits}-digit numbers are not in "
                         "the training set; ask for fewer.")
    return _rows(rng.sample(unseen, int(n)))


def copy_digits_reward(completions, answer, **kwargs) -> List[Optional[float]]:
    """Fraction of the answer's digit positions matched by the first number in the completion; a number of
    the wrong length is scored against the longer of the two, so padding with digits never pays."""
    out = []
    for completion, target in zip(completions, answer):
        found = re.search(r"\d+", completion_text(completion))
        if not found:
            out.append(0.0)
            continue
        guess = found.group(0)
        hits = sum(a == b for a, b in zip(guess, target))
        out.append(hits / max(len(guess), len(target)))
    return out


def off_by_one(number: str) -> str:
    """The warm-up's wrong answer: every digit one higher ("384" -> "495", "9" -> "0"); scores 0."""
    return "".join(str((int(c) + 1) % 10) for c in number)


# what `python -m dsgrpo.tasks warmup` builds; an init_model written with another recipe is rebuilt, not reused
WARMUP_RECIPE = {"task": "copy_digits", "kind": "copy_or_off_by_one", "copy_fraction": 0.2, "steps": 150,
                 "batch_size": 32, "lr": 3e-3, "digits": 3, "seed": 0}


def copy_warmup(model_path: str, out_dir: str, steps: int = 150, copy_fraction: float = 0.2, batch_size: int = 32,
                lr: float = 3e-3, digits: int = 3, seed: int = 0) -> str:
    """Supervised warm-up of the demo (plain torch, one process, seconds on a CPU): each target is the copy with
    probability `copy_fraction`, else `off_by_one` of the shown number. Saves model, tokenizer and the recipe
    (warmup.json) to out_dir and returns it."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed + 1)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        ids, labels = [], []
        for _ in range(batch_size):
            shown = "".join(rng.choice("0123456789") for _ in range(digits))
            reply = shown if rng.random() < copy_fraction else off_by_one(shown)
            prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT.format(number=shown)}],
                                             tokenize=False, add_generation_prompt=True)
            p = tok(prompt, add_special_tokens=False)["input_ids"]
            a = tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids.append(p + a)
            labels.append([-100] * len(p) + a)
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in ids])
        label_t = torch.tensor([x + [-100] * (width - len(x)) for x in labels])
        attention = (torch.arange(width)[None, :] < torch.tensor([len(x) for x in ids])[:, None]).long()
        loss = model(input_ids=input_ids, attention_mask=attention, labels=label_t).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    recipe = dict(WARMUP_RECIPE, steps=steps, copy_fraction=copy_fraction, batch_size=batch_size, lr=lr,
                  digits=digits, seed=seed)
    with open(f"{out_dir}/warmup.json", "w") as fh:
        json.dump(recipe, fh, indent=1)
    return out_dir


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
        for name, kwargs, k in (("greedy", dict(do_sample=False), 1),
                                ("sampled", dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0), samples)):
            made = model.generate(**batch, max_new_tokens=8, pad_token_id=tok.pad_token_id, num_return_sequences=k,
                                  **kwargs)
            replies = tok.batch_decode(made[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
            scores = copy_digits_reward(replies, [a for a in answers for _ in range(k)])
            out[f"{name}_reward"] = sum(scores) / len(scores)
            out[f"{name}_pass@1"] = sum(s == 1.0 for s in scores) / len(scores)
    return out


GSM8K_SYSTEM = ("Solve the math problem step by step. End your answer with a line '#### <number>' holding only "
                "the final number.")


def gsm8k_dataset(source: str = "openai/gsm8k", split: str = "train"):
    """GSM8K as conversational prompts with a `solution` column for `accuracy_reward`. `source` is a local
    .jsonl with question/answer rows (e.g. shared/data/gsm8k/train.jsonl) or a cached hub id."""
    import datasets

    if source.endswith(".jsonl"):
        raw = datasets.load_dataset("json", data_files=source, split="train")
    else:
        raw = datasets.load_dataset(source, "main", split=split)
    return raw.map(lambda row: {"prompt": [{"role": "system", "content": GSM8K_SYSTEM},
                                           {"role": "user", "content": row["question"]}],
                                "solution": row["answer"]}, remove_columns=raw.column_names)


TASKS = {"copy_digits": copy_digits_dataset, "copy_digits_heldout": copy_digits_heldout,
         "gsm8k": gsm8k_dataset}
WARMUP_TASKS = ("copy_digits",)  # tasks whose model `python -m dsgrpo.tasks warmup` builds (the CPU demo's)


def _print_evaluation(before: str, after: str, n: int) -> None:
    rows = [("greedy pass@1 (the exact number)", "greedy_pass@1"), ("greedy mean reward", "greedy_reward"),
            ("exact answers, sampled at temperature 1", "sampled_pass@1"),
            ("mean reward, sampled at temperature 1", "sampled_reward")]
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
    parser.add_argument("--base", default="qwen2", help="tiny model to start from (dsgrpo.testing.TINY_SPECS)")
    parser.add_argument("--steps", type=int, default=WARMUP_RECIPE["steps"])
    parser.add_argument("--copy-fraction", type=float, default=WARMUP_RECIPE["copy_fraction"])
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
    wanted = dict(WARMUP_RECIPE, steps=args.steps, copy_fraction=args.copy_fraction)
    recipe = os.path.join(args.out, "warmup.json")
    if os.path.exists(recipe):
        with open(recipe) as fh:
            if json.load(fh) == wanted:
                print(f"{args.out} exists (same warm-up recipe); keeping it")
                return 0
    if os.path.exists(os.path.join(args.out, "config.json")):
        print(f"{args.out} was built by another warm-up recipe; rebuilding it")
    copy_warmup(tiny_model(args.base), args.out, steps=args.steps, copy_fraction=args.copy_fraction)
    print(f"warm-up saved to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
