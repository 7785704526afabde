"""When a run logs, evaluates and saves: TrainingArguments' strategies and step counts resolved against the run's
length (a step count below 1 is a fraction of the run, as in transformers), and its learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple


def resolve_steps(value: Optional[float], total_steps: int) -> Optional[int]:
    """A step count, or (below 1) a fraction of `total_steps`, as a whole number of optimizer steps (>= 1)."""
    if value is None:
        return None
    if value < 1:
        return max(1, math.ceil(value * total_steps))
    return int(value)


def warmup_steps(args, total_steps: int) -> int:
    """warmup_steps (below 1: a fraction of the run) wins over warmup_ratio when > 0."""
    if args.warmup_steps > 0:
        return resolve_steps(args.warmup_steps, total_steps)
    return math.ceil(args.warmup_ratio * total_steps)


@dataclass(frozen=True)
class Schedule:
    total_steps: int
    logging: str
    logging_every: int
    logging_first_step: bool
    saving: str
    save_every: int
    evaluating: str
    eval_every: int
    eval_delay: float

    @classmethod
    def from_args(cls, args, total_steps: int) -> "Schedule":
        logging_every = resolve_steps(args.logging_steps, total_steps)
        return cls(
            total_steps=total_steps,
            logging=args.logging_strategy,
            logging_every=logging_every,
            logging_first_step=args.logging_first_step,
            saving=args.save_strategy,
            save_every=resolve_steps(args.save_steps, total_steps),
            evaluating=args.eval_strategy,
            eval_every=resolve_steps(args.eval_steps, total_steps) or logging_every,
            eval_delay=args.eval_delay,
        )

    def due(self, step_before: int, step: int, epochs_before: int, epochs: int) -> Tuple[bool, bool, bool]:
        """(log, evaluate, save) after a round that took the run from `step_before` to `step` optimizer steps and
        from `epochs_before` to `epochs` completed passes over the prompts."""
        epoch_ended = epochs > epochs_before
        last = step >= self.total_steps

        def crossed(every: int) -> bool:
            return step // every > step_before // every

        log = {"steps": crossed(self.logging_every) or last, "epoch": epoch_ended or last, "no": False}[self.logging]
        log = log or (self.logging_first_step and step_before == 0 and step > 0)
        evaluate = {"steps": crossed(self.eval_every), "epoch": epoch_ended, "no": False}[self.evaluating]
        evaluate = evaluate and step >= self.eval_delay
        save = {"steps": crossed(self.save_every), "epoch": epoch_ended, "no": False}[self.saving]
        return log, evaluate, save


def lr_scheduler_factory(args, total_steps: int):
    """optimizer → the learning-rate schedule transformers' get_scheduler builds for these arguments (DeepSpeed
    calls it with the optimizer it made)."""
    from transformers import get_scheduler

    warmup = warmup_steps(args, total_steps)
    kwargs = dict(args.lr_scheduler_kwargs or {})

    def make(optimizer):
        try:
            return get_scheduler(
                args.lr_scheduler_type,
                optimizer,
                num_warmup_steps=warmup,
                num_training_steps=total_steps,
                scheduler_specific_kwargs=kwargs,
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"lr_scheduler_type={args.lr_scheduler_type!r} with lr_scheduler_kwargs={kwargs}: {exc}. "
                "Give the schedule's own arguments (e.g. {min_lr_rate: 0.1} for cosine_with_min_lr)."
            ) from None

    return make
