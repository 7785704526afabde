"""vLLM's sleep mode (`vllm_enable_sleep_mode`, GPU): the engine hands its GPU memory to training between rounds.

Level 2 discards the weights and the KV cache, so an engine asleep at level 2 can generate again only after new
weights are loaded. The state machine below makes each transition explicit, so no generation ever reaches a
sleeping engine:

    awake ──round's generation done──▶ asleep (level 2) ──load_weights──▶ awake
    asleep and a generation is asked for (an evaluation after the last round, whose weights are not synced):
        refused; the rollout source syncs an engine that `needs_weights()` even when the round's sync is skipped

The sleep happens once a round's completions are all made (GenerationSource.next_batch), never after each call:
tool turns, rollout_func and evaluation make several calls per round. AsyncGRPOTrainer's engine generates while
training runs, so it never sleeps."""

from __future__ import annotations

AWAKE, ASLEEP = "awake", "asleep"


class EngineSleep:
    """Sleep / wake of one vLLM LLM; a no-op when sleep mode is off."""

    def __init__(self, llm, enabled: bool):
        self.llm, self.enabled = llm, enabled
        self.state = AWAKE

    def needs_weights(self) -> bool:
        """Asleep at level 2: only a weight load makes it usable again."""
        return self.state == ASLEEP

    def before_generate(self) -> None:
        if self.state == ASLEEP:
            raise RuntimeError(
                "generation on a vLLM engine asleep at level 2 (its weights were discarded): load "
                "weights first (vllm_enable_sleep_mode)"
            )

    def sleep(self) -> None:
        """The round's generation is done: release the weights and the KV cache until the next load."""
        if self.enabled and self.state == AWAKE:
            self.llm.sleep(level=2)
            self.state = ASLEEP

    def load(self, reload) -> None:
        """Run `reload()` (the weight update) on an engine whose weight memory is back, then restore its KV cache."""
        if self.state == ASLEEP:
            self.llm.wake_up(tags=["weights"])
        reload()
        if self.state == ASLEEP:
            self.llm.wake_up(tags=["kv_cache"])
            self.state = AWAKE
