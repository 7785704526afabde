"""What a resume may change without the checkpoint's identity check refusing it, said once so nothing is skipped
silently: another train dataset (the prompt stream continues at the checkpoint's round, so the new set's first
rounds' worth of prompts would be skipped unless reset_data_position starts it from its beginning), and another
reward function list or reward weights (the rewards of the rounds to come are on another scale)."""

from __future__ import annotations

from typing import List, Optional


def recorded(prompts, reward_names: List[str], args) -> dict:
    """The trainer state's entries these checks read at the next resume: the train prompts', the rewards'."""
    return {
        "data": prompts.identity(),
        "data_round_offset": prompts.round_offset,
        "reward_funcs": list(reward_names),
        "reward_weights": args.reward_weights,
    }


def data_changed(saved: dict, current: dict) -> bool:
    """Whether the train dataset differs from the checkpoint's (checkpoints written before dsgrpo recorded it
    carry none: nothing to compare)."""
    if not saved:
        return False
    if saved.get("fingerprint") and current.get("fingerprint"):
        return saved["fingerprint"] != current["fingerprint"] or saved.get("rows") != current.get("rows")
    return saved.get("rows") != current.get("rows")


def resume_note(path: str, state: dict, now: dict, args, prompts_per_round: int) -> tuple:
    """(the new round offset of the prompt stream, the one message to print or None, whether the dataset changed).
    `state`: the checkpoint's trainer state; `now`: this run's `recorded` entries."""
    round_index = state["generation_round"]
    changed = data_changed(state.get("data") or {}, now["data"])
    offset = int(state.get("data_round_offset", 0))
    reset = args.reset_data_position or args.ignore_data_skip
    parts: List[str] = []
    if reset:
        parts.append(f"reset_data_position: the train dataset starts from its first prompt at round {round_index}")
        offset = round_index
    elif changed:
        was, is_ = state["data"], now["data"]
        skipped = (round_index - offset) * prompts_per_round
        parts.append(
            f"the train dataset is another than the checkpoint's ({_describe(was)} then, {_describe(is_)} now); "
            f"the prompt stream continues at round {round_index}, so the new set's first {skipped} prompt "
            "position(s) are skipped. Set reset_data_position=True (or ignore_data_skip=True) to start it "
            "from its beginning"
        )
    if changed:
        parts.append("the groups sampled from the old set's rows and not yet trained are dropped")
    saved_funcs, saved_weights = state.get("reward_funcs"), state.get("reward_weights")
    if saved_funcs is not None and (saved_funcs != now["reward_funcs"] or saved_weights != now["reward_weights"]):
        parts.append(
            f"the rewards changed: reward functions {saved_funcs} -> {now['reward_funcs']}, reward_weights "
            f"{saved_weights} -> {now['reward_weights']} (rewards and advantages from here on are on the new "
            "scale; the logged reward before and after is not comparable)"
        )
    note = f"dsgrpo: resuming {path}: " + "; ".join(parts) + "." if parts else None
    return offset, note, changed


def _describe(identity: Optional[dict]) -> str:
    identity = identity or {}
    rows = identity.get("rows")
    fp = identity.get("fingerprint")
    return (f"{rows} rows" if rows is not None else "a stream") + (f", fingerprint {fp}" if fp else "")
