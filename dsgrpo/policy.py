"""`Policy`: the model being trained and what belongs to it — its DeepSpeed engine, its reference (a frozen engine of
its own, or for a LoRA policy the same engine with its adapter switched off), its tokenizer, and how it is saved,
exported and checkpointed. The trainer builds one (startup.py) and hands it to checkpoint.py."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, Iterator, Optional

from . import compat, dist, quantization
from .engines import lora
from .engines.export import save_hf_model
from .engines.weights import mix_partitions
from .errors import CheckpointError
from .run_identity import run_identity
from .world_change import ENGINE_TAG, UNIVERSAL_TAG, universal_engine

REFERENCE_TAG = "reference"  # a checkpoint's folder for the mixed reference of sync_ref_model


class Policy:
    def __init__(self, engine, reference, *, adapter: Optional[Dict[str, Any]], tokenizer, args, world: int):
        self.engine = engine  # the DeepSpeed engine that trains (ZeRO-partitioned)
        self.reference = reference  # the frozen reference engine; None at beta 0 and for a LoRA policy
        self.adapter = adapter  # a LoRA policy's shape (lora.fingerprint), or None
        self.tokenizer, self.args, self.world = tokenizer, args, world

    @property
    def module(self):
        """The trained model (the engine's module)."""
        return self.engine.module

    @property
    def lora(self) -> bool:
        """A LoRA policy: only its adapter trains, and its reference is itself with the adapter switched off."""
        return self.adapter is not None

    @property
    def quantised(self) -> bool:
        """QLoRA: its frozen base is a bitsandbytes 4- or 8-bit model."""
        return bool(quantization.quantised_layers(self.module))

    def identity(self) -> dict:
        """What a checkpoint of this policy must match to be resumed (run_identity.py)."""
        return run_identity(self.args, self.world, self.module.config, self.adapter)

    @contextlib.contextmanager
    def reference_view(self) -> Iterator[Any]:
        """The engine whose forward is the reference's: the frozen engine, or the policy's own with its adapter off."""
        if self.lora:
            with self.module.disable_adapter():
                yield self.engine
        else:
            yield self.reference

    def mix_into_reference(self, alpha: float) -> None:
        """TR-DPO's π_ref ← α·π_θ + (1 − α)·π_ref, on each rank's own partitions where both engines shard alike."""
        mix_partitions(self.reference.module, self.module, alpha)

    # ---- saving
    def write(self, output_dir: str) -> None:
        """Hugging Face format, loadable by AutoModelForCausalLM and vLLM; a LoRA policy its adapter in PEFT's format
        (and with save_merged_model the merged model in output_dir/merged). Every rank gathers; rank 0 writes."""
        module, bucket = self.module, self.args.weight_sync_bucket_bytes
        if self.lora:
            lora.save_adapter(module, output_dir, bucket, dist.is_main())
            if self.args.save_merged_model:
                save_hf_model(module, os.path.join(output_dir, "merged"), bucket, self.tokenizer)
        else:
            save_hf_model(module, output_dir, bucket)
        if dist.is_main():
            self.tokenizer.save_pretrained(output_dir)
        dist.barrier("model saved before anyone reads it")

    def write_description(self, folder: str) -> None:
        """What `dsgrpo export` and a reader of a checkpoint need beside the shards (rank 0): the model's config, a
        LoRA policy's adapter config, the generation config, the tokenizer."""
        module = self.module
        module.config.save_pretrained(folder)
        if self.lora:  # `dsgrpo export` rebuilds the adapter from it
            module.peft_config[module.active_adapters[0]].save_pretrained(folder)
        generation_config = getattr(module, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)

    # ---- checkpoint units
    def save_engines(self, folder: str) -> None:
        """This rank's engine shards (a LoRA policy's adapter only: its frozen base is reloaded from the model at
        resume) and, under sync_ref_model, the mixed reference's. Both saves run even when the first fails, so the
        ranks' collectives stay paired when a write fails on some ranks only."""
        failure = None
        try:
            compat.save_engine_checkpoint(
                self.engine, folder, ENGINE_TAG, save_latest=False, exclude_frozen_parameters=self.lora
            )
        except (OSError, RuntimeError) as exc:
            failure = exc
        if self.args.sync_ref_model and self.reference is not None:
            try:
                compat.save_engine_checkpoint(self.reference, folder, REFERENCE_TAG, save_latest=False)
            except (OSError, RuntimeError) as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    def load_engine(self, path: str, saved_world: int) -> None:
        """The engine's weights, optimizer and scheduler state: DeepSpeed's own files when the world size is the
        writing run's, its universal copy (converted once, collective) otherwise."""
        kwargs = dict(load_optimizer_states=True, load_lr_scheduler_states=True, load_module_strict=not self.lora)
        if self.quantised:  # bitsandbytes' layers refuse their own saved extras (8-bit scales): the adapter alone
            kwargs["custom_load_fn"] = _load_adapter
        if saved_world == self.world:
            loaded, _ = self.engine.load_checkpoint(path, tag=ENGINE_TAG, **kwargs)
        else:
            universal_engine(path)
            loaded, _ = compat.load_universal_engine_checkpoint(self.engine, path, UNIVERSAL_TAG, **kwargs)
        if loaded is None:
            raise CheckpointError(f"DeepSpeed found no engine state in {path}/{ENGINE_TAG}.")

    def load_reference(self, path: str) -> None:
        """Under sync_ref_model, the mixed reference the checkpoint holds."""
        if not (self.args.sync_ref_model and self.reference is not None):
            return
        if not os.path.isdir(os.path.join(path, REFERENCE_TAG)):
            raise CheckpointError(
                f"{path} has no {REFERENCE_TAG}/ (the mixed reference of sync_ref_model): it was "
                "written without sync_ref_model. Resume with the settings that wrote it."
            )
        self.reference.load_checkpoint(
            path, tag=REFERENCE_TAG, load_optimizer_states=False, load_lr_scheduler_states=False
        )


def _load_adapter(src: dict, dst) -> None:
    """A quantised LoRA policy's module state from a checkpoint: its trainable parameters only (the frozen base is
    reloaded from the model; the state also holds bitsandbytes' quantisation extras, which its layers refuse)."""
    trainable = {n for n, p in dst.named_parameters() if p.requires_grad}
    missing = sorted(trainable - set(src))
    if missing:
        raise CheckpointError(f"the checkpoint's module state lacks adapter weights {missing[:3]}")
    dst.load_state_dict({k: v for k, v in src.items() if k in trainable}, strict=False)
