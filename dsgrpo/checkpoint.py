"""Checkpoints, resume and export.

Layout (the Hugging Face convention):

    output_dir/
      checkpoint-<step>/          complete checkpoints only
        engine/                   DeepSpeed's own files: weights, optimizer and scheduler states, per rank
        reference/                the reference engine, when sync_ref_model mixes it (its state changes)
        trainer_state.json        step, generation round, token count, log history, run identity
        rng_state_<rank>.json     python / numpy / torch RNG states of each rank (JSON: nothing to unpickle)
        rollout_state_<rank>.json what the rollout source keeps of each rank (the async trainer's pool), as JSON
        resolved_config.yaml, config.json, generation_config.json, tokenizer files (for `dsgrpo export`)
        COMPLETE                  written last inside the folder
      latest                      the name of the newest complete checkpoint (replaced atomically)

A checkpoint is written into `.checkpoint-<step>.partial/` and renamed into place only when every rank has
finished and COMPLETE exists; `latest` moves after the rename; older checkpoints are pruned after that. A kill
at any point leaves the previous `latest` intact. Generation is seeded per round, and the prompt order is a
function of the round number, so a resumed run continues exactly where the interrupted one was.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from . import dist
from .errors import CheckpointError

ENGINE_TAG = "engine"
REFERENCE_TAG = "reference"
COMPLETE = "COMPLETE"
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again", a checkpoint was written; batch scripts requeue on it
# Settings a checkpoint cannot be continued under: data order, batch geometry or the model would change.
IDENTITY_FIELDS = ("num_generations", "per_device_train_batch_size", "gradient_accumulation_steps", "seed",
                   "steps_per_generation", "generation_batch_size", "shuffle_dataset", "data_seed")


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step}"


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE)) and os.path.isfile(os.path.join(path, "trainer_state.json"))


def complete_checkpoints(output_dir: str) -> List[str]:
    """Complete checkpoint folders, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        if name.startswith("checkpoint-") and name[len("checkpoint-"):].isdigit() and is_complete(path):
            found.append((int(name[len("checkpoint-"):]), path))
    return [p for _, p in sorted(found)]


def resolve_resume(spec: Any, output_dir: str) -> Optional[str]:
    """`resume_from_checkpoint` → a complete checkpoint folder, or None for a fresh start. `true`/"latest" with
    no checkpoint yet is a fresh start (the first run of a requeued job); a named path must exist."""
    if spec in (None, False, "", "false", "False"):
        return None
    if spec is True or str(spec).lower() in ("true", "latest"):
        pointer = os.path.join(output_dir, "latest")
        if os.path.isfile(pointer):
            path = os.path.join(output_dir, open(pointer).read().strip())
            if is_complete(path):
                return path
        found = complete_checkpoints(output_dir)
        return found[-1] if found else None
    path = str(spec)
    if not os.path.isdir(path):
        raise CheckpointError(f"resume_from_checkpoint={path!r}: no such directory. Pass a checkpoint-<step> folder, "
                              "or true/'latest' to take the newest complete one in output_dir.")
    if not is_complete(path):
        raise CheckpointError(f"resume_from_checkpoint={path!r} is not a complete checkpoint (no {COMPLETE} marker or "
                              "trainer_state.json): it was interrupted while being written. Resume from an older one.")
    return path


def run_identity(args, world_size: int, model_config, adapter: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """What a checkpoint must share with the run that continues it (`adapter`: a LoRA policy's shape)."""
    return {"world_size": world_size, "model_config": _model_fingerprint(model_config), "adapter": adapter,
            **{k: getattr(args, k) for k in IDENTITY_FIELDS}}


def check_resume(path: str, args, world_size: int, model_config, adapter: Optional[Dict[str, Any]] = None) -> None:
    """Before any engine exists: can this checkpoint continue this run?"""
    with open(os.path.join(path, "trainer_state.json")) as fh:
        state = json.load(fh)
    if state.get("model_only"):
        raise CheckpointError(f"{path} was written with save_only_model=True: it holds the model but no optimizer, "
                              "scheduler or RNG state, so no run can continue from it. Start a new run with "
                              f"model={path!r}, or resume from a checkpoint written without save_only_model.")
    check_can_continue(state["identity"], run_identity(args, world_size, model_config, adapter), path)


def _model_fingerprint(config) -> Dict[str, Any]:
    keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "tie_word_embeddings")
    return {k: getattr(config, k, None) for k in keys}


def check_can_continue(saved: Dict[str, Any], current: Dict[str, Any], path: str) -> None:
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, this run {current[k]!r}" for k in current if saved.get(k) != current[k]]
    if diffs:
        raise CheckpointError(f"Cannot continue {path} under this config: " + "; ".join(diffs) + ". Use the checkpoint's "
                              "settings (a changed world size needs a fresh run or a converted universal checkpoint), "
                              "or start a new output_dir.")


# ------------------------------------------------------------------------------------------------ RNG states
def rng_state() -> Dict[str, Any]:
    np_state = np.random.get_state()
    return {"python": _jsonable(random.getstate()),
            "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
            "torch": torch.get_rng_state().tolist()}


def set_rng_state(state: Dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


# ------------------------------------------------------------------------------------------------ save / load
def save(trainer) -> str:
    """Write checkpoint-<global_step> (every rank calls this; the engine save is collective)."""
    args, step = trainer.args, trainer.state.global_step
    final = os.path.join(args.output_dir, checkpoint_name(step))
    partial = os.path.join(args.output_dir, f".{checkpoint_name(step)}.partial")
    if dist.is_main():
        shutil.rmtree(partial, ignore_errors=True)  # debris of a save that was killed
        os.makedirs(partial)
    dist.barrier("partial checkpoint folder exists before ranks write into it")
    if args.save_only_model:  # the model in Hugging Face format, nothing to resume from (transformers' meaning)
        trainer.write_model(partial)
    else:
        # a LoRA policy's frozen base weights are reloaded from the model at resume: only the adapter is state
        trainer.policy.save_checkpoint(partial, tag=ENGINE_TAG, save_latest=False,
                                       exclude_frozen_parameters=trainer.lora_policy)
        if args.sync_ref_model and trainer.reference is not None:  # the mixed reference is state too
            trainer.reference.save_checkpoint(partial, tag=REFERENCE_TAG, save_latest=False)
    with open(os.path.join(partial, f"rng_state_{dist.rank()}.json"), "w") as fh:
        json.dump(rng_state(), fh)
    with open(os.path.join(partial, rollout_state_name(dist.rank())), "w") as fh:
        json.dump(trainer.source.state_dict(), fh)
    dist.barrier("every rank's shards and RNG state are on disk")
    if dist.is_main():
        state = {"global_step": step, "generation_round": trainer.state.generation_round,
                 "num_input_tokens_seen": trainer.state.num_input_tokens_seen, "max_steps": trainer.state.max_steps,
                 "epoch": trainer.state.epoch, "log_history": trainer.state.log_history,
                 "entropy_control": trainer.update.entropy_coef.state_dict(), "model_only": bool(args.save_only_model),
                 "identity": run_identity(args, trainer.world, trainer.policy.module.config, trainer.adapter)}
        with open(os.path.join(partial, "trainer_state.json"), "w") as fh:
            json.dump(state, fh)
        args.save(os.path.join(partial, "resolved_config.yaml"))
        trainer.policy.module.config.save_pretrained(partial)
        if trainer.lora_policy:  # `dsgrpo export` rebuilds the adapter from it
            module = trainer.policy.module
            module.peft_config[module.active_adapters[0]].save_pretrained(partial)
        generation_config = getattr(trainer.policy.module, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(partial)
        trainer.tokenizer.save_pretrained(partial)
        open(os.path.join(partial, COMPLETE), "w").close()
        if os.path.exists(final):  # an older save of the same step (a rerun): replace it
            shutil.rmtree(final)
        os.rename(partial, final)
        _point_latest(args.output_dir, checkpoint_name(step))
        prune(args.output_dir, args.save_total_limit)
    dist.barrier("checkpoint published")
    return final


def rollout_state_name(rank: int) -> str:
    return f"rollout_state_{rank}.json"


def read_rollout_state(path: str, rank: int) -> Optional[dict]:
    """A rank's rollout-source state, or None when the checkpoint holds none (a synchronous run's, or one written
    before rollout sources had state; those named it extra_state_<rank>.json)."""
    for name in (rollout_state_name(rank), f"extra_state_{rank}.json"):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file) as fh:
                return json.load(fh)
    return None


def generator_state(path: str, rank: int):
    """Split placement, a generating rank resuming: (its saved state, the generation round to continue from).
    Training rank 0 kept the generators' states in its own rollout state."""
    saved = (read_rollout_state(path, 0) or {}).get("generators", {})
    if str(rank) not in saved:
        raise CheckpointError(f"{path} holds no state for generating rank {rank}: it was not written by a split-"
                              "placement run with this many generating ranks.")
    with open(os.path.join(path, "trainer_state.json")) as fh:
        return saved[str(rank)], json.load(fh)["generation_round"]


def _point_latest(output_dir: str, name: str) -> None:
    tmp = os.path.join(output_dir, ".latest.tmp")
    with open(tmp, "w") as fh:
        fh.write(name)
    os.replace(tmp, os.path.join(output_dir, "latest"))


def prune(output_dir: str, keep: Optional[int]) -> None:
    if not keep:
        return
    for path in complete_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def load(trainer, path: str) -> None:
    """Restore engine, trainer state and this rank's RNG states from a complete checkpoint (every rank)."""
    with open(os.path.join(path, "trainer_state.json")) as fh:
        state = json.load(fh)
    check_can_continue(state["identity"], run_identity(trainer.args, trainer.world, trainer.policy.module.config, trainer.adapter),
                       path)
    rng_file = os.path.join(path, f"rng_state_{dist.rank()}.json")
    if not os.path.isfile(rng_file):
        raise CheckpointError(f"{path} has no {os.path.basename(rng_file)}: it was written by fewer ranks.")
    loaded, _ = trainer.policy.load_checkpoint(path, tag=ENGINE_TAG, load_optimizer_states=True,
                                               load_lr_scheduler_states=True,
                                               load_module_strict=not trainer.lora_policy)
    if loaded is None:
        raise CheckpointError(f"DeepSpeed found no engine state in {path}/{ENGINE_TAG}.")
    if trainer.args.sync_ref_model and trainer.reference is not None:
        if not os.path.isdir(os.path.join(path, REFERENCE_TAG)):
            raise CheckpointError(f"{path} has no {REFERENCE_TAG}/ (the mixed reference of sync_ref_model): it was "
                                  "written without sync_ref_model. Resume with the settings that wrote it.")
        trainer.reference.load_checkpoint(path, tag=REFERENCE_TAG, load_optimizer_states=False,
                                          load_lr_scheduler_states=False)
    with open(rng_file) as fh:
        set_rng_state(json.load(fh))
    try:
        trainer.source.load_state_dict(read_rollout_state(path, dist.rank()))
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    trainer.state.global_step = state["global_step"]
    trainer.state.generation_round = state["generation_round"]
    trainer.state.num_input_tokens_seen = state["num_input_tokens_seen"]
    trainer.state.epoch = state.get("epoch", 0.0)
    trainer.state.log_history = state["log_history"]
    if "entropy_control" in state:
        trainer.update.entropy_coef.load_state_dict(state["entropy_control"])
    trainer.last_checkpoint = path


# ------------------------------------------------------------------------------------------------ export
def export(checkpoint: str, out_dir: str, merged: bool = False) -> str:
    """`dsgrpo export CHECKPOINT OUT [--merged]`: consolidate the (ZeRO-2 or ZeRO-3) shards into a Hugging Face
    folder (config, safetensors, tokenizer, generation config) in one process. A LoRA run's checkpoint exports
    its adapter in PEFT's format, and with `merged` the merged model in OUT/merged too."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not is_complete(checkpoint):
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint; nothing exported.")
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint, tag=ENGINE_TAG)
    if os.path.isfile(os.path.join(checkpoint, "adapter_config.json")):
        from .engines.lora import export_adapter
        export_adapter(checkpoint, state_dict, out_dir, merged)
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        for folder in [out_dir] + ([os.path.join(out_dir, "merged")] if merged else []):
            tokenizer.save_pretrained(folder)
        return out_dir
    if merged:
        raise CheckpointError(f"--merged: {checkpoint} is not a LoRA run's checkpoint; its export is the whole model.")
    config = AutoConfig.from_pretrained(checkpoint)
    config.use_cache = True
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(state_dict, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise CheckpointError(f"{checkpoint}: the engine state lacks {missing[:5]}; it does not hold this model.")
    if os.path.isfile(os.path.join(checkpoint, "generation_config.json")):
        from transformers import GenerationConfig
        model.generation_config = GenerationConfig.from_pretrained(checkpoint)
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(checkpoint).save_pretrained(out_dir)
    return out_dir
