"""Built-in tasks for the CPU demo, tests and benchmarks.

`copy_digits`: the prompt shows a number ("Repeat this number: 384"); the reward is the fraction of digit
positions the answer gets right (1.0 for "384", 0.33 for "394", 0 for no number). It is the smallest task whose
reward means something and that a 0.5M-parameter model can learn by RL in minutes on a CPU: the policy has to
learn to attend to the prompt's digits and copy them in order, which is a real capability (copying/induction)
rather than a format trick.

The demo first runs a brief supervised warm-up that teaches only the answer FORMAT (a 3-digit number, then
<|im_end|>) with random digits, so the warmed-up model scores ≈ 0.1 (chance per digit); everything above that
is learned by GRPO. Brief on purpose: the warm-up's targets ignore the prompt, so each step of it also teaches
ignoring the prompt. 150 steps left GRPO on a plateau at chance for 100-200 steps that varied by seed and CPU
(final rewards 0.27-0.72 in 300-400 steps); 50 steps left one of six seed x instruction-set runs under 0.5
(0.47); 30 steps learn the format as well and brought all six to 0.50-0.84 (bench/demo_robustness.py); 20 do not
learn the format (seed 0 started at 0.04 and stayed there)."""

from __future__ import annotations

import random
import re
from typing import List, Optional

from .rewards.builtins import completion_text

PROMPT = "Repeat this number: {number}"


def copy_digits_dataset(n: int = 512, digits: int = 3, seed: int = 0):
    """A datasets.Dataset of conversational prompts with an `answer` column (`task:copy_digits:N`: N prompts)."""
    from datasets import Dataset

    n = int(n)
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        number = "".join(rng.choice("0123456789") for _ in range(digits))
        rows.append({"prompt": [{"role": "user", "content": PROMPT.format(number=number)}], "answer": number})
    return Dataset.from_list(rows)


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


def format_warmup(model_path: str, out_dir: str, steps: int = 30, batch_size: int = 32, lr: float = 3e-3,
                  digits: int = 3, seed: int = 0) -> str:
    """Supervised warm-up on the answer format only (random digits, unrelated to the prompt). Plain torch,
    one process, a few seconds on a CPU. Saves the model and tokenizer to out_dir and returns it."""
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
            reply = "".join(rng.choice("0123456789") for _ in range(digits))  # NOT the copy: format only
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
    return out_dir


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


TASKS = {"copy_digits": copy_digits_dataset, "gsm8k": gsm8k_dataset}
WARMUP_TASKS = ("copy_digits",)  # tasks whose model `python -m dsgrpo.tasks warmup` builds (the CPU demo's)


def main(argv=None) -> int:
    """`python -m dsgrpo.tasks warmup --out DIR`: the demo's format warm-up of the tiny local model."""
    import argparse

    from .testing import tiny_model

    parser = argparse.ArgumentParser(prog="python -m dsgrpo.tasks")
    parser.add_argument("command", choices=["warmup"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--base", default="qwen2", help="tiny model to start from (dsgrpo.testing.TINY_SPECS)")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    import os
    if os.path.exists(os.path.join(args.out, "config.json")):
        print(f"{args.out} exists; keeping it")
        return 0
    format_warmup(tiny_model(args.base), args.out, steps=args.steps)
    print(f"format warm-up saved to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
