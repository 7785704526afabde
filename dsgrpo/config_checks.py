"""GRPOConfig's checks: every rule a config must keep, each refused with the field, the rule and the fix before any
model is loaded (GRPOConfig mixes them in; config.py holds the fields and their defaults)."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

# the AdamW family maps to DeepSpeed's AdamW; anything else must come in through `optimizers=`
ADAMW_OPTIMS = (
    "adamw_torch",
    "adamw_torch_fused",
    "adamw_apex_fused",
    "adamw_torch_xla",
    "adamw_torch_npu_fused",
    "adamw_anyprecision",
)
REPORT_SINKS = ("none", "jsonl", "wandb", "tensorboard", "trackio")  # metrics.jsonl is always written


def eval_group(args) -> int:
    """Completions an evaluation draws per prompt (the rule eval_pass_at_k and eval_maj_at_k are checked against)."""
    return (args.num_generations_eval or args.num_generations) if args.eval_do_sample else 1


class ConfigChecks:
    def validate(self, world_size: int = 1) -> None:
        """Raise ValueError/TypeError naming the field and the fix. Called at construction and again by the
        trainer once the world size is known."""
        self._check_types()
        self._check_partial_rollout()
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and not isinstance(value, bool) and value not in choices:
                raise ValueError(f"{f.name}={value!r} is not one of {list(choices)}. Set {f.name} to one of them.")
        self._check_report_to()
        self._check_steps()
        if self.optim not in ADAMW_OPTIMS:
            raise ValueError(
                f"optim={self.optim!r}: dsgrpo's optimizer is DeepSpeed's AdamW, which the AdamW family "
                f"{list(ADAMW_OPTIMS)} all map to. For another optimizer pass it to the trainer: "
                "GRPOTrainer(..., optimizers=(torch.optim.SGD(model.parameters(), lr=...), None))."
            )
        if self.num_generations < 2:
            raise ValueError(
                f"num_generations={self.num_generations}: GRPO needs at least 2 completions per prompt to compute "
                "group-relative advantages. Set num_generations >= 2."
            )
        if self.num_generations_eval is not None and self.num_generations_eval < 1:
            raise ValueError(f"num_generations_eval={self.num_generations_eval} must be >= 1 (or None).")
        if not self.eval_do_sample and self.num_generations_eval not in (None, 1):
            raise ValueError(
                f"eval_do_sample=False draws one greedy completion per prompt, but num_generations_eval="
                f"{self.num_generations_eval}: greedy samples of a prompt are all the same. Leave "
                "num_generations_eval unset (or 1), or set eval_do_sample=True."
            )
        for name in ("eval_pass_at_k", "eval_maj_at_k"):
            ks = getattr(self, name)
            if ks is None:
                continue
            samples = eval_group(self)
            bad = [k for k in ks if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= samples]
            if bad or not ks:
                raise ValueError(
                    f"{name}={ks}: each k must be a whole number from 1 to the "
                    f"{samples} samples an evaluation draws per prompt (num_generations_eval, else "
                    "num_generations; 1 with eval_do_sample=False). Drop the others, or raise "
                    "num_generations_eval."
                )
        for name in (
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "num_iterations",
            "max_completion_length",
            "weight_sync_bucket_bytes",
            "per_device_eval_batch_size",
            "ref_model_sync_steps",
            "ddp_timeout",
            "weight_sync_timeout_s",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError(
                f"generation_batch_size={self.generation_batch_size} and "
                f"steps_per_generation={self.steps_per_generation} "
                "are both set; they are two ways to say the same thing. Set only one of them."
            )
        if self.max_steps == 0 or (self.max_steps < 0 and self.num_train_epochs <= 0):
            raise ValueError(
                f"max_steps={self.max_steps}, num_train_epochs={self.num_train_epochs}: nothing to train. "
                "Set max_steps > 0 or num_train_epochs > 0."
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1].")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 or None disables it).")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1].")
        if self.temperature <= 0:
            raise ValueError(
                f"temperature={self.temperature} must be > 0 (GRPO samples; greedy decoding gives identical groups)."
            )
        if not 0 <= self.top_entropy_quantile <= 1:
            raise ValueError(f"top_entropy_quantile={self.top_entropy_quantile} must be in [0, 1].")
        if self.epsilon < 0 or self.effective_epsilon_high < 0:
            raise ValueError(f"epsilon={self.epsilon}, epsilon_high={self.epsilon_high} must be >= 0.")
        if self.delta is not None and self.delta <= 1 + self.effective_epsilon_high:
            raise ValueError(
                f"delta={self.delta} must be > 1 + epsilon_high ({1 + self.effective_epsilon_high}); it caps "
                "the ratio above the clip range. Raise delta or set it to None."
            )
        self._check_sampler_correction()
        self._check_objective()
        if self.bf16 and self.fp16:
            raise ValueError("bf16=True and fp16=True: pick one precision (bf16 is the GPU default).")
        tp = self.vllm_tensor_parallel_size
        if tp < 1 or (self.vllm_mode == "colocate" and self.use_vllm and world_size % tp):
            raise ValueError(
                f"vllm_tensor_parallel_size={tp}: the {world_size} ranks must split into engines of {tp} "
                f"consecutive ranks; choose a divisor of the world size."
            )
        for name in ("vllm_server_port", "vllm_group_port"):
            if not 0 < getattr(self, name) < 65536:
                raise ValueError(f"{name}={getattr(self, name)} is not a TCP port (1-65535).")
        if self.vllm_server_timeout <= 0:
            raise ValueError(f"vllm_server_timeout={self.vllm_server_timeout} must be > 0 seconds.")
        if self.reward_weights is not None and not all(isinstance(w, (int, float)) for w in self.reward_weights):
            raise TypeError(
                f"reward_weights={self.reward_weights!r} must be a list of numbers, one per reward function."
            )
        if isinstance(self.gradient_checkpointing, str) and self.gradient_checkpointing != "auto":
            raise ValueError(f"gradient_checkpointing={self.gradient_checkpointing!r}: give true, false or 'auto'.")
        if self.logprob_chunk_tokens < 0:
            raise ValueError(f"logprob_chunk_tokens={self.logprob_chunk_tokens} must be >= 0 (0: sized automatically).")
        if self.max_staleness < 0:
            raise ValueError(
                f"max_staleness={self.max_staleness} must be >= 0 (0 trains only on groups of the current policy)."
            )
        if self.async_chunk_groups is not None and self.async_chunk_groups < 1:
            raise ValueError(f"async_chunk_groups={self.async_chunk_groups} must be >= 1 (or None).")
        if self.async_generator_ranks is not None and not 1 <= self.async_generator_ranks < max(2, world_size):
            raise ValueError(
                f"async_generator_ranks={self.async_generator_ranks} must leave at least one training rank "
                f"and one generating rank in a world of {world_size}: set it between 1 and {world_size - 1}."
            )
        self._check_batch_divisibility(world_size)

    def _check_partial_rollout(self) -> None:
        if self.rollout_overprovision < 0:
            raise ValueError(
                f"rollout_overprovision={self.rollout_overprovision} must be >= 0 (prompt groups in "
                "flight beyond a round's need)."
            )
        band = self.partial_rollout_token_band
        if not (isinstance(band, (list, tuple)) and len(band) == 2 and 0 <= band[0] < 1 < band[1]):
            raise ValueError(
                f"partial_rollout_token_band={band!r} must be [low, high] with 0 <= low < 1 < high (e.g. [0.5, 5.0])."
            )
        if not self.partial_rollout:
            return
        if not self.use_vllm or self.vllm_mode != "colocate":
            raise ValueError(
                "partial_rollout=True steps a colocated vLLM engine one completion at a time; set "
                "use_vllm=True and vllm_mode='colocate', or partial_rollout=False."
            )
        if self.vllm_tensor_parallel_size > 1:
            raise ValueError(
                "partial_rollout=True with vllm_tensor_parallel_size > 1: an engine's ranks would have to "
                "step in lock-step; use vllm_tensor_parallel_size=1 or partial_rollout=False."
            )
        if self.num_iterations != 1:
            raise ValueError(
                f"partial_rollout=True with num_iterations={self.num_iterations}: a carried completion's "
                "early tokens are already off-policy; reusing the batch would compound it. Set "
                "num_iterations=1."
            )

    def _check_report_to(self) -> None:
        for sink in self.report_sinks(installed_only=False):
            if sink not in REPORT_SINKS:
                raise ValueError(
                    f"report_to={self.report_to!r}: dsgrpo has no {sink!r} sink yet (it has "
                    f"{list(REPORT_SINKS)}; metrics.jsonl is always written). Remove {sink!r} rather than "
                    "have it silently dropped."
                )
        import importlib.util

        for sink in self.report_sinks():
            if sink != "jsonl" and importlib.util.find_spec(sink) is None:
                raise ValueError(
                    f"report_to names {sink!r} but the {sink} package is not installed: `pip install "
                    f"{sink}`, or remove {sink!r} from report_to."
                )

    def _check_steps(self) -> None:
        """transformers' rules: a step count below 1 is a fraction of the run; above 1 it is a whole number."""
        for name in ("logging_steps", "save_steps", "eval_steps", "warmup_steps"):
            value = getattr(self, name)
            if value is None:
                continue
            if value < 0 or (value == 0 and name != "warmup_steps"):
                raise ValueError(f"{name}={value} must be > 0 (a count, or below 1 a fraction of the run).")
            if value > 1 and value != int(value):
                raise ValueError(
                    f"{name}={value}: above 1 it counts optimizer steps and must be a whole number "
                    "(below 1 it is a fraction of the run)."
                )
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio={self.warmup_ratio} must be in [0, 1).")
        if self.eval_delay < 0:
            raise ValueError(f"eval_delay={self.eval_delay} must be >= 0.")
        if self.load_best_model_at_end:  # transformers' rules: every checkpoint must come with its evaluation
            if self.eval_strategy == "no" or self.save_strategy != self.eval_strategy:
                raise ValueError(
                    f"load_best_model_at_end=True needs evaluations at the checkpoints: eval_strategy="
                    f"{self.eval_strategy!r} and save_strategy={self.save_strategy!r}. Set both to 'steps' "
                    "(or both to 'epoch')."
                )
            eval_steps = self.eval_steps if self.eval_steps is not None else self.logging_steps
            if (
                self.save_strategy == "steps"
                and (eval_steps >= 1) == (self.save_steps >= 1)
                and round(self.save_steps / eval_steps, 6) != int(round(self.save_steps / eval_steps, 6))
            ):
                raise ValueError(
                    f"load_best_model_at_end=True: save_steps={self.save_steps} must be a multiple of "
                    f"eval_steps={eval_steps}, so every checkpoint has its evaluation."
                )

    def _check_sampler_correction(self) -> None:
        lo, hi = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if hi is not None and hi <= 0:
            raise ValueError(f"vllm_importance_sampling_clip_max={hi} must be > 0 (or None for no upper bound).")
        if lo is not None and lo < 0:
            raise ValueError(f"vllm_importance_sampling_clip_min={lo} must be >= 0 (or None for no lower bound).")
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(
                f"vllm_importance_sampling_clip_min={lo} must be less than vllm_importance_sampling_clip_max={hi}."
            )
        if self.vllm_importance_sampling_correction and lo is None and hi is None:
            raise ValueError(
                "vllm_importance_sampling_correction=True with neither vllm_importance_sampling_clip_min "
                "nor _clip_max: the correction would be unbounded. Set at least one, or turn it off."
            )
        if (
            self.loss_type == "vespo"
            and self.use_vllm
            and self.vllm_importance_sampling_correction
            and not self.vllm_importance_sampling_mode.startswith("token_")
        ):
            raise ValueError(
                f"loss_type='vespo' folds the sampler correction into its sequence weight token by token: "
                f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} must be "
                "'token_truncate' or 'token_mask'."
            )

    def _check_objective(self) -> None:
        if self.off_policy_mask_threshold is not None and self.off_policy_mask_threshold <= 0:
            raise ValueError(
                f"off_policy_mask_threshold={self.off_policy_mask_threshold} must be > 0 (e.g. 0.5), or None."
            )
        if not 0 <= self.ref_model_mixup_alpha <= 1:
            raise ValueError(f"ref_model_mixup_alpha={self.ref_model_mixup_alpha} must be in [0, 1].")
        if self.entropy_coef_min > self.entropy_coef_max or self.entropy_coef_delta < 0:
            raise ValueError(
                f"entropy_coef_min={self.entropy_coef_min}, entropy_coef_max={self.entropy_coef_max}, "
                f"entropy_coef_delta={self.entropy_coef_delta}: need min <= max and delta >= 0."
            )
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0.")
        if self.pad_to_multiple_of is not None and (
            not isinstance(self.pad_to_multiple_of, int) or self.pad_to_multiple_of < 1
        ):
            raise ValueError(
                f"pad_to_multiple_of={self.pad_to_multiple_of!r} must be a positive integer, 'auto' or None."
            )

    def _check_batch_divisibility(self, world_size: int) -> None:
        per_step = self.per_device_train_batch_size * world_size
        if self.generation_batch_size is not None and self.generation_batch_size % per_step != 0:
            raise ValueError(
                f"generation_batch_size={self.generation_batch_size} is not divisible by per_device_train_batch_size "
                f"({self.per_device_train_batch_size}) x world size ({world_size}) = {per_step}. "
                f"Make it a multiple of {per_step}."
            )
        gen_batch = self.resolved_generation_batch_size(world_size)
        if gen_batch % self.num_generations != 0:
            raise ValueError(
                f"The generation batch ({gen_batch} completions = per_device_train_batch_size "
                f"{self.per_device_train_batch_size} x world size {world_size} x steps_per_generation "
                f"{self.resolved_steps_per_generation(world_size)}) is not "
                f"divisible by num_generations={self.num_generations}. Choose values whose product is a multiple of "
                f"{self.num_generations}, or change num_generations."
            )
        if self.num_generations_eval is not None and gen_batch % self.num_generations_eval != 0:
            raise ValueError(
                f"The generation batch ({gen_batch}) is not divisible by num_generations_eval="
                f"{self.num_generations_eval}. Choose a divisor of {gen_batch}."
            )

    def _check_types(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not _matches(value, hints[f.name]):
                raise TypeError(
                    f"{f.name}={value!r} has type {type(value).__name__}; expected {_type_name(hints[f.name])}."
                )

    # -- (de)serialisation ------------------------------------------------------------------------------


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin is not None:
        hint = origin
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))
