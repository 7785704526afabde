"""A checkpoint's run identity: what a run that continues it must share (the data order, a round's prompts and
optimizer steps, the model and adapter), the per-rank geometry it was written under, and the refusal naming each
difference with the settings that would keep the round (checkpoint.check_resume calls it before anything loads)."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

from .errors import CheckpointError

# Settings a checkpoint cannot be continued under: the data order, a round's prompts and optimizer steps, or the
# model would change. The per-rank geometry (world size, per-device batch, accumulation) may change as long as
# each round keeps its prompts and its optimizer steps: the prompt stream is a function of the round.
IDENTITY_FIELDS = ("num_generations", "seed", "shuffle_dataset", "data_seed", "num_iterations")
CONTINUE_KEYS = ("model_config", "adapter", "prompts_per_round", "steps_per_round") + IDENTITY_FIELDS
# What checkpoints written before world-size changes were possible compared (their identity has these only)
LEGACY_KEYS = (
    "world_size",
    "model_config",
    "adapter",
    "num_generations",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "seed",
    "steps_per_generation",
    "generation_batch_size",
    "shuffle_dataset",
    "data_seed",
)
GEOMETRY_FIELDS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "generation_batch_size",
)


def run_identity(args, world_size: int, model_config, adapter: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """What a checkpoint must share with the run that continues it (`adapter`: a LoRA policy's shape), and the
    per-rank geometry it was written under (recorded, compared only for checkpoints of older dsgrpo)."""
    steps = args.num_iterations * args.resolved_steps_per_generation(world_size) / args.gradient_accumulation_steps
    return {
        "world_size": world_size,
        "model_config": _model_fingerprint(model_config),
        "adapter": adapter,
        "prompts_per_round": args.resolved_generation_batch_size(world_size) // args.num_generations,
        "steps_per_round": steps,
        **{k: getattr(args, k) for k in IDENTITY_FIELDS + GEOMETRY_FIELDS},
    }


def deepspeed_auto_of(path: str) -> Dict[str, str]:
    """What deepspeed / ref_deepspeed "auto" resolved to in the run that wrote checkpoint `path` ({} before dsgrpo
    recorded it, when auto meant ZeRO-3 with more than one rank): a resume with "auto" keeps it."""
    with open(os.path.join(path, "trainer_state.json")) as fh:
        return dict(json.load(fh).get("deepspeed_auto") or {})


def _model_fingerprint(config) -> Dict[str, Any]:
    keys = (
        "model_type",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "tie_word_embeddings",
    )
    return {k: getattr(config, k, None) for k in keys}


def check_can_continue(saved: Dict[str, Any], current: Dict[str, Any], path: str) -> None:
    legacy = "prompts_per_round" not in saved  # written before the world size could change
    keys = LEGACY_KEYS if legacy else CONTINUE_KEYS
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, this run {current[k]!r}" for k in keys if saved.get(k) != current[k]]
    if not diffs:
        return
    hint = ""
    if legacy:
        hint = " (this checkpoint was written by a dsgrpo that kept the world size and per-device geometry fixed)"
    elif ({"prompts_per_round", "steps_per_round"} & {d.split(":")[0] for d in diffs}) and saved["world_size"]:
        hint = _round_hint(saved, current["world_size"])
    raise CheckpointError(
        f"Cannot continue {path} under this config: " + "; ".join(diffs) + hint + ". Use the "
        "checkpoint's settings, or start a new output_dir."
    )


def _round_hint(saved: Dict[str, Any], world: int) -> str:
    """How `world` ranks keep the checkpoint's round: its completions per optimizer step, split over the ranks."""
    per_step = saved["prompts_per_round"] * saved["num_generations"] / saved["steps_per_round"]
    head = (
        f". A round must keep its {saved['prompts_per_round']} prompts and {saved['steps_per_round']:g} optimizer "
        f"step(s), i.e. {per_step:g} completions per optimizer step"
    )
    if per_step % world:
        return (
            head + f", which {world} rank(s) cannot share evenly: resume on a number of ranks that divides {per_step:g}"
        )
    per_rank = int(per_step // world)
    device = saved["per_device_train_batch_size"]
    if per_rank % device:  # the checkpoint's micro-batch does not fit: one micro-batch of the whole share
        device = per_rank
    return (
        head + f": on {world} rank(s) set per_device_train_batch_size × gradient_accumulation_steps = {per_rank} "
        f"(e.g. per_device_train_batch_size={device}, gradient_accumulation_steps={per_rank // device}; the "
        f"checkpoint's ranks had {saved['per_device_train_batch_size']} and {saved['gradient_accumulation_steps']}), "
        "and leave generation_batch_size / steps_per_generation unset or equal to the checkpoint's"
    )
