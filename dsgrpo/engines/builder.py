"""Build DeepSpeed engines from the JSON configs in ds_configs/ (or the user's), with "auto" values filled from
the GRPOConfig the way transformers fills them, and load Hugging Face models so that under ZeRO-3 a large
model is partitioned as it loads (never whole on one rank)."""

from __future__ import annotations

import copy
import os
from typing import Any, Optional

import torch

from .. import compat, device, dist
from ..config import GRPOConfig, load_deepspeed_config
from ..schedule import lr_scheduler_factory


# The smallest "auto" gradient bucket (elements). transformers' hidden_size**2 alone gives a small model dozens of
# buckets, each a collective that waits for every rank: 30 for the demo's hidden 128 (its train phase 143 -> 108 ms
# a round in one bucket). Models with hidden_size >= 2048 keep hidden_size**2; below, 16 MiB of fp32 at most.
MIN_REDUCE_BUCKET = 1 << 22


def is_zero3(ds_config: dict) -> bool:
    return ds_config.get("zero_optimization", {}).get("stage", 0) == 3


def fill_auto_values(
    ds_config: dict, args: GRPOConfig, *, hidden_size: Optional[int], field: str = "deepspeed", train: bool = True
) -> dict:
    """Replace every "auto" in a DeepSpeed config with the value the GRPOConfig implies; refuse leftovers."""
    cfg = copy.deepcopy(ds_config)
    bf16 = device.use_bf16(args.bf16, args.fp16)
    fills = {
        ("train_micro_batch_size_per_gpu",): args.per_device_train_batch_size,
        ("gradient_accumulation_steps",): args.gradient_accumulation_steps if train else 1,
        ("gradient_clipping",): args.max_grad_norm,
        ("bf16", "enabled"): bf16,
        ("fp16", "enabled"): bool(args.fp16),
        # DeepSpeed's fused AdamW JIT-compiles for minutes on CPU; torch's is as good there. adamw_apex_fused asks
        # for the fused kernel on GPU.
        ("optimizer", "params", "torch_adam"): not device.on_gpu() or args.optim != "adamw_apex_fused",
        ("optimizer", "params", "lr"): args.learning_rate,
        ("optimizer", "params", "betas"): [args.adam_beta1, args.adam_beta2],
        ("optimizer", "params", "eps"): args.adam_epsilon,
        ("optimizer", "params", "weight_decay"): args.weight_decay,
    }
    if hidden_size is not None:  # transformers' heuristics for ZeRO-3 bucket sizes
        fills[("zero_optimization", "reduce_bucket_size")] = max(hidden_size * hidden_size, MIN_REDUCE_BUCKET)
        fills[("zero_optimization", "stage3_prefetch_bucket_size")] = int(0.9 * hidden_size * hidden_size)
        fills[("zero_optimization", "stage3_param_persistence_threshold")] = 10 * hidden_size
    for path, value in fills.items():
        node = cfg
        for key in path[:-1]:
            node = node.get(key, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict) and node.get(path[-1]) == "auto":
            node[path[-1]] = value
    if args.fp16 and "fp16" not in cfg:
        cfg["fp16"] = {"enabled": True}
    if bf16 and "bf16" not in cfg and "fp16" not in cfg:
        # the engines load bf16 weights (device.train_dtype); a config without a bf16 section would have DeepSpeed
        # run them in fp32, silently (a bf16=True run measured fp32's 2e-7 sampler gap instead of bf16's 5e-4)
        cfg["bf16"] = {"enabled": True}
    if cfg.get("train_batch_size") == "auto":
        del cfg["train_batch_size"]  # DeepSpeed derives it from micro batch × accumulation × world
    leftovers = [k for k, v in _walk(cfg) if v == "auto"]
    if leftovers:
        raise ValueError(
            f"{field}: 'auto' is not supported for {leftovers}; give explicit values in the DeepSpeed config."
        )
    return cfg


def _walk(node, prefix=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{prefix}{k}.")
    else:
        yield prefix.rstrip("."), node


class ModelLoader:
    """Loads HF models by hub id or local path. Under ZeRO-3 it tells transformers about the DeepSpeed config
    for the duration of `load` only, so `from_pretrained` partitions parameters as it loads (transformers'
    HfDeepSpeedConfig contract) without changing how the user's own later `from_pretrained` calls behave."""

    def __init__(self, ds_config: dict, dtype: torch.dtype):
        self.ds_config = ds_config
        self.dtype = dtype

    def load(self, name_or_path: str, cls=None, field: str = "model", **kwargs: Any):
        from transformers import AutoModelForCausalLM

        cls = cls or AutoModelForCausalLM
        check_model_source(name_or_path, field)
        # zero.Init partitions over the whole world; in split placement only the training ranks hold the model,
        # so there it loads whole and deepspeed.initialize partitions it over the training group
        partition_at_load = is_zero3(self.ds_config) and not dist.is_split()
        try:
            with compat.hf_zero3_loading(self.ds_config if partition_at_load else None):
                return cls.from_pretrained(name_or_path, dtype=self.dtype, **kwargs)
        except OSError as exc:
            raise OSError(
                f"{field}={name_or_path!r} could not be loaded ({exc}). Pass a local folder saved with "
                "save_pretrained, or a hub id that is in the local cache (no network at run time)."
            ) from None


def check_model_source(name_or_path: str, field: str = "model") -> None:
    """Fail early for a local path that is not there (hub ids are left to transformers)."""
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1  # hub ids: "org/name"
    if looks_local and not os.path.isdir(os.path.expanduser(name_or_path)):
        raise FileNotFoundError(
            f"{field}={name_or_path!r}: no such directory. Pass a folder with config.json "
            "(saved with save_pretrained) or a hub id like 'Qwen/Qwen2.5-0.5B-Instruct'."
        )


def prepare_model(model, args) -> None:
    """What GRPOConfig asks of a model before DeepSpeed wraps it: no dropout (disable_dropout) and fp32 logits
    (cast_lm_head_to_fp32). Works on a ZeRO-3 partitioned model: only module attributes change."""
    if args.disable_dropout:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    if args.cast_lm_head_to_fp32:
        head = model.get_output_embeddings()
        if head is None or not isinstance(head, torch.nn.Linear):
            raise ValueError(
                f"cast_lm_head_to_fp32=True: {type(model).__name__} has no linear output layer to cast "
                "(a LoRA adapter on lm_head, or another head). Set cast_lm_head_to_fp32=False."
            )

        # ZeRO-3's hooks gather the weight around the module's call; the matmul then runs in fp32 while the
        # stored (and trained) weight keeps its dtype and its partitioning
        def fp32_forward(hidden_states, _head=head):
            bias = None if _head.bias is None else _head.bias.float()
            return torch.nn.functional.linear(hidden_states.float(), _head.weight.float(), bias)

        head.forward = fp32_forward


def build_policy_engine(model, args: GRPOConfig, ds_config: dict, optimizer=None, scheduler=None, total_steps: int = 1):
    """The trainable policy: a DeepSpeed engine with AdamW (from the config unless the user passed one) and the
    GRPOConfig's learning-rate schedule."""
    import deepspeed

    ds_config = copy.deepcopy(ds_config)
    if optimizer is not None:
        ds_config.pop("optimizer", None)  # the user's optimizer wins; DeepSpeed refuses two
        # ZeRO refuses optimizers outside its tested list (SGD, ...) unless told; a user who passes one means it
        # (transformers' DeepSpeed integration sets the same)
        ds_config.setdefault("zero_allow_untested_optimizer", True)
    if args.gradient_checkpointing:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, **(args.gradient_checkpointing_kwargs or {})}
        )
    if scheduler is None:
        scheduler = lr_scheduler_factory(args, total_steps)
    # `optimizer` may be an instance or a callable params -> optimizer (DeepSpeed calls it with model_parameters)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config,
        mpu=dist.deepspeed_mpu(),
    )
    # from_pretrained leaves a model in eval mode, and transformers checkpoints a layer only in train mode: without
    # this, gradient_checkpointing=True did nothing (and dropout, where disable_dropout=False, was off unlike TRL's)
    engine.train()
    # user code may keep autograd-tracked copies of the (partitioned) parameters: see compat.pin_grad_accumulators
    engine.dsgrpo_grad_accumulators = compat.pin_grad_accumulators(engine.module.parameters())
    return engine


def build_inference_engine(model, ds_config: dict):
    """A frozen engine (reference or reward model): no optimizer, eval mode, no gradients."""
    import deepspeed

    model.requires_grad_(False)
    model.eval()
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, mpu=dist.deepspeed_mpu())
    engine.eval()
    return engine


def resolve(spec, args: GRPOConfig, hidden_size: Optional[int], field: str, train: bool, world_size: int) -> dict:
    """`spec` ('auto', a file, a dict) as the engine's config, for `world_size` training ranks."""
    return fill_auto_values(
        load_deepspeed_config(spec, field, world_size), args, hidden_size=hidden_size, field=field, train=train
    )
