"""Checkpoints, resume and export.

Layout (the Hugging Face convention):

    output_dir/
      checkpoint-<step>/          complete checkpoints only
        engine/                   DeepSpeed's own files: weights, optimizer and scheduler states, per rank
        reference/                the reference engine, when sync_ref_model mixes it (its state changes)
        engine_universal/         engine/ converted once to DeepSpeed's universal format, when a run on another
                                  number of ranks resumed from it (its own checksums.json)
        trainer_state.json        step, generation round, token count, log history, run identity
        rng_state_<rank>.json     python / numpy / torch RNG states of each rank (JSON: nothing to unpickle)
        rollout_state_<rank>.json what the rollout source keeps of each rank (the async trainer's pool), as JSON
        resolved_config.yaml, config.json, generation_config.json, tokenizer files (for `dsgrpo export`)
        checksums.json            size and sha256 of every file above (each rank hashes a share)
        COMPLETE                  written last inside the folder
      latest                      the name of the newest complete checkpoint (replaced atomically)

A checkpoint is written into `.checkpoint-<step>.partial/` and renamed into place only when every rank has
finished and COMPLETE exists; `latest` moves after the rename; older checkpoints are pruned after that. A kill
at any point leaves the previous `latest` intact. Generation is seeded per round, and the prompt order is a
function of the round number, so a resumed run continues exactly where the interrupted one was, on the same
number of ranks or another one as long as a round keeps its prompts and optimizer steps.

A resume first checks the checkpoint against its checksums.json (sizes, then each rank hashes a share of the
files), before any state is read: a truncated shard or a changed byte is refused naming the file, never loaded
(torch's zip reader would fail deep inside DeepSpeed without the name) and never a silent fresh start. Writing
that fails on any rank (a full disk) fails the save on every rank, removes the partial folder and leaves
`latest` and the previous checkpoints as they were.

Beside this module: run_identity.py (what a continuing run must share, refused naming each difference),
checkpoint_integrity.py (checksums), world_change.py (another number of ranks: DeepSpeed's universal copy) and
resume_guards.py (another dataset or reward list, said once; reset_data_position).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import sys
import warnings
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from . import dist, resume_guards
from .checkpoint_integrity import (
    CHECKSUMS,
    COMPLETE,
    DamagedCheckpointError,
    _digest_share,
    check_intact,
    checkpoint_files,
)
from .errors import CheckpointError
from .run_identity import check_can_continue, run_identity
from .world_change import ENGINE_TAG, _saved_world, check_world_change, universal_engine, world_change_note

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again", a checkpoint was written; batch scripts requeue on it


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
        if name.startswith("checkpoint-") and name[len("checkpoint-") :].isdigit() and is_complete(path):
            found.append((int(name[len("checkpoint-") :]), path))
    return [p for _, p in sorted(found)]


def resolve_resume(spec: Any, output_dir: str) -> Optional[str]:
    """`resume_from_checkpoint` → a complete checkpoint folder, or None for a fresh start. `true`/"latest" with
    no checkpoint yet is a fresh start (the first run of a requeued job); a named path must exist."""
    if spec in (None, False, "", "false", "False"):
        return None
    if spec is True or str(spec).lower() in ("true", "latest"):
        pointer = os.path.join(output_dir, "latest")
        path = None
        if os.path.isfile(pointer):
            path = os.path.join(output_dir, open(pointer).read().strip())
        if path is None or not is_complete(path):
            found = complete_checkpoints(output_dir)
            path = found[-1] if found else None
        if path is not None:
            _check_newest(path, output_dir, spec)
        return path
    path = str(spec)
    if not os.path.isdir(path):
        raise CheckpointError(
            f"resume_from_checkpoint={path!r}: no such directory. Pass a checkpoint-<step> folder, "
            "or true/'latest' to take the newest complete one in output_dir."
        )
    if not is_complete(path):
        raise CheckpointError(
            f"resume_from_checkpoint={path!r} is not a complete checkpoint (no {COMPLETE} marker or "
            "trainer_state.json): it was interrupted while being written. Resume from an older one."
        )
    check_intact(path)
    if not os.path.realpath(path).startswith(os.path.realpath(output_dir) + os.sep):
        warn_checkpoint_can_run_code(path, f"was not written by this run (it is outside output_dir {output_dir})")
    return path


def _check_newest(path: str, output_dir: str, spec) -> None:
    """`latest` found a damaged checkpoint: say so, and name the newest intact one to resume from instead (a
    person decides: training silently from an older state would redo steps without anyone knowing)."""
    try:
        check_intact(path)
        return
    except DamagedCheckpointError as exc:
        damaged = exc
    for older in reversed(
        [
            p
            for p in complete_checkpoints(output_dir)
            if os.path.abspath(p) != os.path.abspath(path) and _step_of(p) < _step_of(path)
        ]
    ):
        try:
            check_intact(older)
        except DamagedCheckpointError:
            continue
        raise CheckpointError(
            f"resume_from_checkpoint={spec!r}: the newest checkpoint, {path}, is damaged: "
            f"{damaged.what}. The newest intact one is {older}: resume from it with "
            f"resume_from_checkpoint={older} (or move {os.path.basename(path)} away so that "
            "'latest' finds it)."
        )
    raise CheckpointError(
        f"resume_from_checkpoint={spec!r}: the newest checkpoint, {path}, is damaged: {damaged.what}, "
        "and no older intact checkpoint is left in the folder. Start a new output_dir."
    )


def _step_of(path: str) -> int:
    name = os.path.basename(os.path.normpath(path))
    return int(name[len("checkpoint-") :]) if name[len("checkpoint-") :].isdigit() else -1


def check_resume(
    path: str, args, world_size: int, model_config, adapter: Optional[Dict[str, Any]] = None, rollout_source=None
) -> None:
    """Before any engine exists: can this checkpoint continue this run? Written by another number of ranks, its
    engine state is converted to DeepSpeed's universal format here (once; collective), before anything loads."""
    with open(os.path.join(path, "trainer_state.json")) as fh:
        state = json.load(fh)
    if state.get("model_only"):
        raise CheckpointError(
            f"{path} was written with save_only_model=True: it holds the model but no optimizer, "
            "scheduler or RNG state, so no run can continue from it. Start a new run with "
            f"model={path!r}, or resume from a checkpoint written without save_only_model."
        )
    saved = state["identity"]
    check_can_continue(saved, run_identity(args, world_size, model_config, adapter), path)
    if saved["world_size"] != world_size:
        check_world_change(path, args, saved["world_size"], world_size, rollout_source)
        universal_engine(path)


# ------------------------------------------------------------------------------------------------ RNG states
def rng_state() -> Dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "python": _jsonable(random.getstate()),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }


def set_rng_state(state: Dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


# ------------------------------------------------------------------------------------------------ save / load
def save(policy, state, source, run: Dict[str, Any]) -> str:
    """Write checkpoint-<global_step> of `policy` (policy.py), the TrainerState `state` and the rollout `source`'s
    state, with `run`: the trainer state's other entries (the entropy control's, resume_guards.recorded). Every rank
    calls this; the engine save is collective. A write that fails on any rank (OSError: a full disk, a lost mount)
    fails it on every rank with CheckpointWriteError, after the partial folder is removed; `latest` and the older
    checkpoints are untouched."""
    args, step = policy.args, state.global_step
    final = os.path.join(args.output_dir, checkpoint_name(step))
    partial = os.path.join(args.output_dir, f".{checkpoint_name(step)}.partial")
    _agree_or_fail(
        _attempt(lambda: check_space(args.output_dir, checkpoint_name(step)), args.output_dir),
        partial,
        "there is room for the checkpoint",
    )
    if dist.is_main():
        shutil.rmtree(partial, ignore_errors=True)  # debris of a save that was killed
        os.makedirs(partial)
    dist.barrier("partial checkpoint folder exists before ranks write into it")
    failure = _attempt(lambda: _write_rank_state(policy, source, partial), args.output_dir)
    _agree_or_fail(failure, partial, "every rank's shards and RNG state are on disk")
    failure = (
        _attempt(lambda: _write_trainer_state(policy, state, run, partial), args.output_dir) if dist.is_main() else None
    )
    _agree_or_fail(failure, partial, "trainer state and model files are on disk")
    failure, share = None, {}
    try:
        share = _digest_share(partial, dist.rank(), dist.world_size())
    except OSError as exc:
        failure = f"rank {dist.rank()}: {exc}"
    digests = dist.all_gather_object((failure, share))
    failures = [f for f, _ in digests if f]
    if not failures and dist.is_main():
        failure = _attempt(
            lambda: _publish(
                partial,
                final,
                {k: v for _, d in digests for k, v in d.items()},
                args,
                step,
                state.best_model_checkpoint,
            ),
            args.output_dir,
        )
    _agree_or_fail(failures[0] if failures else failure, partial, "checkpoint published")
    return final


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed on some rank; nothing of it was published."""


def _attempt(write, folder: str) -> Optional[str]:
    """None, or what went wrong on this rank while `write` wrote into `folder`."""
    try:
        write()
        return None
    except (OSError, RuntimeError) as exc:  # torch's zip writer reports a full disk as a RuntimeError
        text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        try:  # torch's words for ENOSPC ("unexpected pos ...") do not say it: the free space does
            text += f" ({shutil.disk_usage(folder).free / 2**20:.1f} MiB free there)"
        except OSError:
            pass
        return f"rank {dist.rank()}: {text}"


def check_space(output_dir: str, name: str) -> None:
    """Refuse to start a checkpoint the disk cannot hold: the newest complete one's size is the estimate (none
    before the first: then a failing write is caught as it happens)."""
    found = complete_checkpoints(output_dir)
    if not found:
        return
    need = sum(os.path.getsize(os.path.join(found[-1], f)) for f in checkpoint_files(found[-1]))
    free = shutil.disk_usage(output_dir).free
    if free < need * 1.05:
        raise OSError(
            errno.ENOSPC,
            f"no room for {name} in {output_dir}: {free / 2**20:.1f} MiB free, and "
            f"{os.path.basename(found[-1])} took {need / 2**20:.1f} MiB",
        )


def _agree_or_fail(failure: Optional[str], partial: str, reason: str) -> None:
    """Collective: every rank learns whether any rank's writes failed, and all raise the same error."""
    failures = [f for f in dist.all_gather_object(failure) if f]
    if not failures:
        dist.barrier(reason)
        return
    if dist.is_main():
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier("the failed checkpoint's partial folder is removed")
    raise CheckpointWriteError(
        f"writing {os.path.basename(partial)[1 : -len('.partial')]} failed ({'; '.join(failures)}). "
        f"Nothing of it was published: latest and the older checkpoints in "
        f"{os.path.dirname(partial)} are as they were. Free space (or fix the mount) and resume."
    )


def _write_rank_state(policy, source, partial: str) -> None:
    if policy.args.save_only_model:  # the model in Hugging Face format, nothing to resume from (transformers' meaning)
        policy.write(partial)
    else:
        policy.save_engines(partial)
    with open(os.path.join(partial, f"rng_state_{dist.rank()}.json"), "w") as fh:
        json.dump(rng_state(), fh)
    with open(os.path.join(partial, rollout_state_name(dist.rank())), "w") as fh:
        json.dump(source.state_dict(), fh)


def _write_trainer_state(policy, state, run: Dict[str, Any], partial: str) -> None:
    args = policy.args
    saved = {
        "global_step": state.global_step,
        "generation_round": state.generation_round,
        "num_input_tokens_seen": state.num_input_tokens_seen,
        "max_steps": state.max_steps,
        "epoch": state.epoch,
        "log_history": state.log_history,
        "model_only": bool(args.save_only_model),
        "identity": policy.identity(),
        **run,
        **{k: getattr(state, k) for k in BEST_FIELDS},
    }
    with open(os.path.join(partial, "trainer_state.json"), "w") as fh:
        json.dump(saved, fh)
    args.save(os.path.join(partial, "resolved_config.yaml"))
    policy.write_description(partial)


def _publish(
    partial: str, final: str, digests: Dict[str, Dict[str, Any]], args, step: int, best: Optional[str]
) -> None:
    with open(os.path.join(partial, CHECKSUMS), "w") as fh:
        json.dump(dict(sorted(digests.items())), fh, indent=0)
    open(os.path.join(partial, COMPLETE), "w").close()
    if os.path.exists(final):  # an older save of the same step (a rerun): replace it
        shutil.rmtree(final)
    os.rename(partial, final)
    _point_latest(args.output_dir, checkpoint_name(step))
    prune(args.output_dir, args.save_total_limit, keep_also=best)


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
        raise CheckpointError(
            f"{path} holds no state for generating rank {rank}: it was not written by a split-"
            "placement run with this many generating ranks."
        )
    with open(os.path.join(path, "trainer_state.json")) as fh:
        return saved[str(rank)], json.load(fh)["generation_round"]


def _point_latest(output_dir: str, name: str) -> None:
    tmp = os.path.join(output_dir, ".latest.tmp")
    with open(tmp, "w") as fh:
        fh.write(name)
    os.replace(tmp, os.path.join(output_dir, "latest"))


def prune(output_dir: str, keep: Optional[int], keep_also: Optional[str] = None) -> None:
    """Keep the newest `keep` checkpoints, and `keep_also` (the best one) wherever it is."""
    if not keep:
        return
    spared = os.path.realpath(keep_also) if keep_also else None
    for path in complete_checkpoints(output_dir)[:-keep]:
        if os.path.realpath(path) != spared:
            shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ the best checkpoint
BEST_FIELDS = ("best_metric", "best_model_checkpoint", "best_global_step")  # transformers' TrainerState fields


def check_best_metric(args, logged: List[str]) -> None:
    """Refuse, before anything loads, a metric_for_best_model that no evaluation of this run will log (`logged`:
    evaluation.metric_names)."""
    metric = args.metric_for_best_model
    if metric is None:
        return
    if not logged or args.eval_strategy == "no":
        raise ValueError(
            f"metric_for_best_model={metric!r} ranks checkpoints by an evaluation, and this run has "
            f"{'no eval_dataset' if not logged else 'eval_strategy=no'}. Pass an eval_dataset and set "
            "eval_strategy ('steps' or 'epoch'), or unset metric_for_best_model and load_best_model_at_end."
        )
    if metric not in logged:
        raise ValueError(
            f"metric_for_best_model={metric!r} is not an evaluation metric of this run; it logs "
            f"{logged}. Set metric_for_best_model to one of them."
        )


def consider_best(state, args, evaluation: Optional[tuple], path: str) -> Optional[tuple]:
    """Before checkpoint `path` of state.global_step is written: if an evaluation (step, metrics) ran at this step
    and its metric_for_best_model beats state.best_metric, this checkpoint becomes the best. Returns what the
    record was, to put back if the save fails (None: unchanged)."""
    metric = args.metric_for_best_model
    if metric is None or evaluation is None or evaluation[0] != state.global_step:
        return None
    value = evaluation[1][metric]
    best = state.best_metric
    if best is not None and not (value > best if args.greater_is_better else value < best):
        return None
    before = tuple(getattr(state, k) for k in BEST_FIELDS)
    state.best_metric, state.best_model_checkpoint, state.best_global_step = float(value), path, state.global_step
    return before


def load_weights(policy, path: str) -> None:
    """The policy's weights (and optimizer state, which DeepSpeed restores with them) from checkpoint `path` of this
    run (every training rank): load_best_model_at_end. The best one may predate a change of the world size."""
    policy.load_engine(path, _saved_world(path))


class CheckpointCanRunCodeWarning(UserWarning):
    """A checkpoint from elsewhere is about to be loaded with pickle."""


_warned_code: set = set()


def warn_checkpoint_can_run_code(path: str, why: str) -> None:
    """DeepSpeed reads its shards with torch.load(weights_only=False) (deepspeed 0.19: zero_to_fp32 and the torch
    checkpoint engine): a crafted file runs code as the loading user. Said once per checkpoint, on rank 0."""
    real = os.path.realpath(path)
    if real in _warned_code or not dist.is_main():
        return
    _warned_code.add(real)
    warnings.warn(
        f"{path} {why}: DeepSpeed loads checkpoint shards with pickle (torch.load(weights_only=False)), "
        "so a crafted checkpoint can run code as this user. Load only checkpoints you trust.",
        CheckpointCanRunCodeWarning,
        stacklevel=3,
    )


def load(policy, state, source, path: str, *, prompts, run: Dict[str, Any], prompts_per_round: int) -> dict:
    """Restore `policy`'s engines, the TrainerState `state`, the rollout `source`'s state and this rank's RNG states
    from a complete checkpoint (every rank); `prompts` (the train prompts) continue at the checkpoint's round, `run`
    is this run's resume_guards.recorded entries. One written by another number of ranks loads from its universal
    copy (made by check_resume): parameters, Adam moments, scheduler and step exactly; the prompt stream continues
    by round; what is per rank is said once. Returns the checkpoint's trainer state (its other entries)."""
    with open(os.path.join(path, "trainer_state.json")) as fh:
        saved = json.load(fh)
    check_can_continue(saved["identity"], policy.identity(), path)
    saved_world, world = saved["identity"]["world_size"], policy.world
    rng_file = os.path.join(path, f"rng_state_{dist.rank()}.json")
    if not os.path.isfile(rng_file) and saved_world == world:
        raise CheckpointError(f"{path} has no {os.path.basename(rng_file)}: it was written by fewer ranks.")
    policy.load_engine(path, saved_world)
    policy.load_reference(path)
    if os.path.isfile(rng_file):  # a rank the writing run did not have keeps its seed-derived streams
        with open(rng_file) as fh:
            set_rng_state(json.load(fh))
    offset, note, data_changed = resume_guards.resume_note(path, saved, run, policy.args, prompts_per_round)
    prompts.round_offset = offset
    try:
        if saved_world == world:
            rollout_state = read_rollout_state(path, dist.rank())
        else:
            states = [read_rollout_state(path, r) for r in range(saved_world)]
            rollout_state = source.reshard_state(states, dist.rank(), world)
        if data_changed:  # groups sampled from the old set's rows would be trained with the new set's columns
            rollout_state = source.without_samples(rollout_state)
        source.load_state_dict(rollout_state)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    state.global_step = saved["global_step"]
    state.generation_round = saved["generation_round"]
    state.num_input_tokens_seen = saved["num_input_tokens_seen"]
    state.epoch = saved.get("epoch", 0.0)
    state.log_history = saved["log_history"]
    for key in BEST_FIELDS:  # the best checkpoint so far stays the one to beat
        setattr(state, key, saved.get(key))
    if note and dist.is_main():
        print(note, file=sys.stderr, flush=True)
    if saved_world != world and dist.is_main():
        print(
            world_change_note(
                path, saved_world, world, saved["generation_round"], source.reshard_note(saved_world, world)
            ),
            file=sys.stderr,
            flush=True,
        )
    return saved


# ------------------------------------------------------------------------------------------------ export
def export(checkpoint: str, out_dir: str, merged: bool = False) -> str:
    """`dsgrpo export CHECKPOINT OUT [--merged]`: consolidate the (ZeRO-2 or ZeRO-3) shards into a Hugging Face
    folder (config, safetensors, tokenizer, generation config) in one process. A LoRA run's checkpoint exports
    its adapter in PEFT's format, and with `merged` the merged model in OUT/merged too."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not is_complete(checkpoint):
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint; nothing exported.")
    check_intact(checkpoint)
    warn_checkpoint_can_run_code(checkpoint, "is being exported")
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
