"""Callbacks with TrainerCallback's method names. A callback implements any subset of them; each is called
as `cb.on_x(args, state, control, **kwargs)` like transformers does, with transformers' own TrainerState and
TrainerControl, so existing TrainerCallbacks work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

from transformers import TrainerControl as _HFTrainerControl
from transformers import TrainerState as _HFTrainerState

EVENTS = (
    "on_init_end",
    "on_train_begin",
    "on_epoch_begin",
    "on_step_begin",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_step_end",
    "on_epoch_end",
    "on_log",
    "on_evaluate",
    "on_save",
    "on_train_end",
)


@dataclass
class TrainerState(_HFTrainerState):
    """transformers' TrainerState (what callbacks read: global_step, epoch, max_steps, log_history, ...) plus the
    generation round, which a checkpoint restores with it."""

    generation_round: int = 0


TrainerControl = _HFTrainerControl  # transformers' own: callbacks may set its should_* flags


class CallbackHandler:
    """transformers' callback contract: every event is `cb.on_x(args, state, control, **kwargs)` with the keyword
    arguments TRL's trainer passes (model, processing_class, optimizer, lr_scheduler, train_dataloader,
    eval_dataloader, and the event's own: logs, metrics, checkpoint); a callback may return a TrainerControl.
    Callbacks may be given as instances or as classes (instantiated without arguments), like transformers'."""

    def __init__(self, callbacks: List[Any] | None):
        self.callbacks: List[Any] = []
        self.context: Dict[str, Any] = {
            "model": None,
            "processing_class": None,
            "optimizer": None,
            "lr_scheduler": None,
            "train_dataloader": None,
            "eval_dataloader": None,
        }
        for cb in callbacks or []:
            self.add(cb)

    def add(self, callback) -> None:
        cb = callback() if isinstance(callback, type) else callback
        if not any(hasattr(cb, e) for e in EVENTS):
            raise TypeError(f"callback {cb!r} implements none of {EVENTS}.")
        self.callbacks.append(cb)

    def _find(self, callback):
        for cb in self.callbacks:
            if cb is callback or (isinstance(callback, type) and isinstance(cb, callback)):
                return cb
        return None

    def pop(self, callback):
        """Remove and return the callback (an instance, or the first of a class); None when absent."""
        cb = self._find(callback)
        if cb is not None:
            self.callbacks.remove(cb)
        return cb

    def fire(self, event: str, args, state: TrainerState, control: TrainerControl, **kwargs) -> TrainerControl:
        for cb in self.callbacks:
            fn = getattr(cb, event, None)
            if fn is not None:
                result = fn(args, state, control, **{**self.context, **kwargs})
                if isinstance(result, TrainerControl):
                    control = result
        return control
