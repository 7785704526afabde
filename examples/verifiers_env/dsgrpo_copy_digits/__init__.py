"""The CPU demo's task as a verifiers v1 environment (issue 66's example): a local Taskset of "Repeat this number:
NNN" prompts (the same 512 numbers as dsgrpo's task:copy_digits), the plain chat harness, and a reward on the answer
(the fraction of digit positions right, scored over the longer of the two numbers, as the demo scores). It runs in
the env host's verifiers venv; `examples/cpu_verifiers.yaml` trains the demo's warm-up model on it."""

import random
import re

import verifiers.v1 as vf

PROMPT = "Repeat this number: {number}"


class CopyData(vf.TaskData):
    answer: str


class CopyTask(vf.Task[CopyData]):
    @vf.reward(weight=1.0)
    async def digits_right(self, trace: vf.Trace) -> float:
        found = re.search(r"\d+", trace.last_reply)
        if not found:
            return 0.0
        guess, target = found.group(0), self.data.answer
        return sum(a == b for a, b in zip(guess, target)) / max(len(guess), len(target), 1)


class CopyConfig(vf.TasksetConfig):
    num_tasks: int = 512
    digits: int = 3
    seed: int = 0


class CopyTaskset(vf.Taskset[CopyTask, CopyConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        numbers = [
            "".join(rng.choice("0123456789") for _ in range(self.config.digits)) for _ in range(self.config.num_tasks)
        ]
        return [CopyTask(CopyData(prompt=PROMPT.format(number=n), answer=n), self.config.task) for n in numbers]


__all__ = ["CopyTaskset"]
