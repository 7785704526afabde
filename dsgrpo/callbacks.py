"""Callbacks with TrainerCallback's method names. A callback implements any subset of them; each is called
as `cb.on_x(args, state, control, **kwargs)` like transformers does, so existing TrainerCallbacks work."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

EVENTS = ("on_train_begin", "on_step_end", "on_log", "on_evaluate", "on_save", "on_train_end")


@dataclass
class TrainerState:
    global_step: int = 0
    max_steps: int = 0
    generation_round: int = 0
    num_input_tokens_seen: int = 0
    log_history: List[Dict[str, float]] = field(default_factory=list)
    is_world_process_zero: bool = True


@dataclass
class TrainerControl:
    should_training_stop: bool = False
    should_save: bool = False
    should_log: bool = False
    should_evaluate: bool = False


class CallbackHandler:
    def __init__(self, callbacks: List[Any] | None):
        self.callbacks = list(callbacks or [])
        for cb in self.callbacks:
            if not any(hasattr(cb, e) for e in EVENTS):
                raise TypeError(f"callback {cb!r} implements none of {EVENTS}.")

    def fire(self, event: str, args, state: TrainerState, control: TrainerControl, **kwargs) -> TrainerControl:
        for cb in self.callbacks:
            fn = getattr(cb, event, None)
            if fn is not None:
                result = fn(args, state, control, **kwargs)
                if isinstance(result, TrainerControl):
                    control = result
        return control
