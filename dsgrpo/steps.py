"""The step arithmetic TRL users plan by: how many optimizer steps a run makes, which micro-steps each one
accumulates, and the plan said once at start.

TRL 1.16 counts through transformers' Trainer, in micro-steps (its `training_step` calls): an epoch is the whole
generation rounds the prompt set fills (TRL's RepeatSampler: `len(dataset) // prompts_per_round` rounds; the rest of
each epoch's order is left out), each round num_iterations × steps_per_generation micro-steps. An optimizer step
accumulates gradient_accumulation_steps micro-steps, except the last of an epoch, which takes what is left
(transformers' `remainder`) and divides its loss by that count instead. max_steps, unless set, is
ceil(num_train_epochs × optimizer steps per epoch). So an optimizer step may span rounds but never an epoch's end.

Without epochs (an IterableDataset, or fewer prompts than one round: read round after round without a break, where
TRL's sampler would yield nothing) every optimizer step is gradient_accumulation_steps micro-steps, spanning rounds
as they fall."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class StepPlan:
    prompts_per_round: int  # distinct prompts a generation round samples (over every rank)
    rounds_per_epoch: Optional[int]  # None: no epochs (a stream, or fewer prompts than one round)
    micro_per_round: int  # num_iterations × steps_per_generation: training_step calls a round makes
    accumulation: int  # gradient_accumulation_steps
    max_steps: int  # optimizer steps the run makes (the learning-rate schedule's length)
    fractional_rounds_per_epoch: float = 0.0  # rounds in one pass when there are no whole-round epochs

    @classmethod
    def from_args(
        cls, args, prompts_per_round: int, steps_per_generation: int, rounds_per_epoch: Optional[float]
    ) -> "StepPlan":
        """`rounds_per_epoch`: PromptSource.rounds_per_epoch (None for a stream)."""
        whole = int(rounds_per_epoch) if rounds_per_epoch is not None and rounds_per_epoch >= 1 else None
        micro = args.num_iterations * steps_per_generation
        GA = args.gradient_accumulation_steps
        if args.max_steps > 0:
            total = args.max_steps
        elif whole is not None:
            total = max(1, math.ceil(args.num_train_epochs * math.ceil(whole * micro / GA)))
        else:  # a prompt set smaller than one round: epochs are fractions of a round (TRL would train nothing)
            rounds = math.ceil(args.num_train_epochs * rounds_per_epoch)
            total = max(1, rounds * micro // GA)
        return cls(prompts_per_round, whole, micro, GA, total, float(rounds_per_epoch or 0.0))

    # ------------------------------------------------------------------------------------------ per epoch
    @property
    def micro_per_epoch(self) -> Optional[int]:
        return None if self.rounds_per_epoch is None else self.rounds_per_epoch * self.micro_per_round

    @property
    def steps_per_epoch(self) -> Optional[int]:
        m = self.micro_per_epoch
        return None if m is None else math.ceil(m / self.accumulation)

    def window(self, position: int) -> Tuple[int, bool]:
        """(how many micro-steps the optimizer step of micro-step `position` accumulates, whether this micro-step
        ends it). `position` counts from the start of the epoch (from the start of training without epochs)."""
        GA, M = self.accumulation, self.micro_per_epoch
        if M is None:
            return GA, (position + 1) % GA == 0
        position %= M
        start = position - position % GA
        return min(GA, M - start), (position + 1) % GA == 0 or position == M - 1

    def round_start(self, rounds_of_data: int) -> int:
        """The micro-step position (as `window` counts it) where data round `rounds_of_data` begins."""
        if self.rounds_per_epoch is None:
            return rounds_of_data * self.micro_per_round
        return (rounds_of_data % self.rounds_per_epoch) * self.micro_per_round

    def steps_after(self, rounds: int) -> int:
        """Optimizer steps completed once `rounds` rounds of data are trained (whole rounds, no max_steps cut)."""
        if self.rounds_per_epoch is None:
            return rounds * self.micro_per_round // self.accumulation
        epochs, rest = divmod(rounds, self.rounds_per_epoch)
        return epochs * self.steps_per_epoch + rest * self.micro_per_round // self.accumulation

    def rounds_for(self, steps: int) -> int:
        """Rounds of data that complete `steps` optimizer steps."""
        low, high = 0, max(1, steps) * self.accumulation  # every round completes a step or adds a micro-step to one
        while low < high:  # the fewest rounds whose steps reach `steps` (steps_after grows with rounds)
            mid = (low + high) // 2
            low, high = (mid + 1, high) if self.steps_after(mid) < steps else (low, mid)
        return low

    def training_steps(self) -> int:
        """training_step calls (micro-steps) of the whole run: the last round stops at max_steps."""
        if self.rounds_per_epoch is None:
            return self.max_steps * self.accumulation
        epochs, rest = divmod(self.max_steps, self.steps_per_epoch)
        return epochs * self.micro_per_epoch + rest * self.accumulation

    # ------------------------------------------------------------------------------------------ said at start
    def describe(self, dataset_rows: Optional[int], num_generations: int, scheduler: str, warmup_steps: int) -> str:
        """The run's plan in one paragraph: prompts per round, rounds per epoch, optimizer steps, where the
        learning-rate schedule ends."""
        P, GA, S = self.prompts_per_round, self.accumulation, self.steps_per_epoch
        head = f"{P} prompts × {num_generations} completions a round, {self.micro_per_round} micro-steps a round"
        if self.rounds_per_epoch is None:
            data = (
                "a stream (no epochs)"
                if dataset_rows is None
                else f"{dataset_rows} prompts, fewer than a round ({self.fractional_rounds_per_epoch:.3g} of a round "
                f"an epoch: read round after round)"
            )
            body = f"{data}; optimizer steps of {GA} micro-steps, spanning rounds"
        else:
            left_out = dataset_rows - self.rounds_per_epoch * P
            M = self.micro_per_epoch
            shape = f"{S} × {GA}" if M % GA == 0 else f"{S - 1} × {GA} + 1 × {M % GA}"
            body = (
                f"{dataset_rows} prompts: {self.rounds_per_epoch} round(s) an epoch"
                + (f" ({left_out} left out of each epoch's order)" if left_out else "")
                + f", {M} micro-steps an epoch in {S} optimizer steps ({shape} micro-steps)"
            )
            body += f"; {self.max_steps / S:.3g} epoch(s)"
        rounds = self.rounds_for(self.max_steps)
        return (
            f"{head}; {body}: {self.max_steps} optimizer steps in {rounds} round(s), {self.training_steps()} "
            f"micro-steps; the learning rate ({scheduler}, {warmup_steps} warm-up steps) ends its schedule at "
            f"step {self.max_steps}."
        )
