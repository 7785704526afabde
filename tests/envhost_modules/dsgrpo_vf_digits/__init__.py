"""A verifiers v1 environment of our own (issue 66): a local Taskset whose tasks ask for digits, the plain chat
harness, and a reward on the answer (the fraction of its characters that are digits). It runs in the verifiers
venv of the env host; dsgrpo never imports it."""

import verifiers.v1 as vf


class DigitsData(vf.TaskData):
    count: int = 4


class DigitsTask(vf.Task[DigitsData]):
    @vf.reward(weight=1.0)
    async def digits(self, trace: vf.Trace) -> float:
        text = trace.last_reply
        return sum(c.isdigit() for c in text) / max(len(text), 1)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class DigitsConfig(vf.TasksetConfig):
    num_tasks: int = 16


class DigitsTaskset(vf.Taskset[DigitsTask, DigitsConfig]):
    def load(self):
        return [
            DigitsTask(DigitsData(prompt=f"Write {n} digits.", count=n), self.config.task)
            for n in range(1, self.config.num_tasks + 1)
        ]


__all__ = ["DigitsTaskset"]
